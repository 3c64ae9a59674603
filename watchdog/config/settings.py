"""Daemon configuration: a YAML file, overridden by ``LLMWD_`` environment variables, validated by pydantic.

The file may use ``${VAR}`` and ``${VAR:-default}`` in any string value (``$${`` is a literal
``${``); an unset variable without a default is an error naming it and its ``file:line:col``.
A plain (unquoted) value is typed after expansion, so ``port: ${PORT:-9464}`` is an integer.
Relative paths in ``policies`` and ``golden.root`` are relative to the config file.

Environment overrides (they win over the file) use ``__`` between levels:

- ``LLMWD_KAFKA__BOOTSTRAP_SERVERS=host:9092`` sets one key; the other keys of ``kafka`` stay;
- a value starting with ``{`` or ``[`` is JSON and **replaces** the whole value at that path:
  ``LLMWD_KAFKA__SECURITY='{}'`` clears the file's ``security`` mapping,
  ``LLMWD_POLICIES='["/etc/p/a.yaml"]'`` replaces the list; so is one starting with ``"`` (a JSON
  string: ``LLMWD_REDIS__PREFIX='"{llmwd}"'`` for a Redis Cluster hash-tag prefix);
- deeper variables merge: ``LLMWD_KAFKA__SECURITY__SASL_MECHANISM=PLAIN`` changes one key.

Errors name the file, line and column of the bad value (or the environment variable).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from watchdog.config.yamlfile import ConfigError as ConfigError
from watchdog.config.yamlfile import env_path, env_value, read_config_file, set_path, validate
from watchdog.config.yamlpos import PosDoc
from watchdog.core.brokers import require_bootstrap_servers, require_topic_name
from watchdog.core.durations import duration_problem
from watchdog.core.keys import require_cluster_prefix, require_redis_url
from watchdog.core.schedule import cron_trigger, zone_info
from watchdog.core.signals import Severity

ENV_PREFIX = "LLMWD_"


Codec = Literal["json", "otlp_json", "otlp_proto"]
CODECS: tuple[str, ...] = ("json", "otlp_json", "otlp_proto")


class OtlpOptions(BaseModel):
    """How spans map to events (``kafka.otlp`` in the daemon config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: attributes holding the route, tried in order, each on the span first, then on the resource
    route_attributes: list[str] = Field(default_factory=lambda: ["llmwd.route"], min_length=1)
    #: used when no route attribute is present; None: the span is rejected (``missing_field:route``)
    default_route: str | None = None
    #: attributes holding the precision, tried like the route attributes
    precision_attributes: list[str] = Field(default_factory=lambda: ["llmwd.precision"], min_length=1)
    #: model name (or fnmatch pattern, e.g. ``"*-fp8"``) -> precision, when no precision attribute is set
    model_precisions: dict[str, str] = Field(default_factory=dict)
    #: last resort; None: the span is rejected (``missing_field:precision``)
    default_precision: str | None = None
    #: attributes naming the serving instance (the event's ``replica``: windows keep latency per replica),
    #: tried like the route attributes; a non-string value or none of them: no replica
    replica_attributes: list[str] = Field(default_factory=lambda: ["k8s.pod.name", "service.instance.id"])
    #: a record larger than this is rejected whole (``too_large``): it holds a whole batch of spans
    max_record_bytes: int = Field(16 * 1024 * 1024, ge=1024)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KafkaConfig(_Section):
    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "llm.inference.logs"
    #: dead-letter topic; default ``<topic>.dlq``
    dlq_topic: str | None = None
    #: not empty: every replica with an empty instance or group would share one name
    group_id: str = Field("llm-watchdog", min_length=1)
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    session_timeout_ms: int = Field(10_000, ge=1000)
    heartbeat_interval_ms: int = Field(2_000, ge=100)
    max_poll_records: int = Field(2_000, ge=1)
    #: passed through to kafka-python unchanged (security_protocol, sasl_mechanism,
    #: sasl_plain_username, sasl_plain_password, ssl_cafile, ssl_certfile, ssl_keyfile, ...)
    security: dict[str, Any] = Field(default_factory=dict)
    #: how records on the topic are encoded: our JSON events, or OpenTelemetry span batches as the
    #: Collector's Kafka exporter writes them (watchdog/ingest/otlp.py); ``otlp`` maps spans to events
    codec: Codec = "json"
    otlp: OtlpOptions = Field(default_factory=OtlpOptions)
    #: bound on each start-up attempt against the brokers (then retried with backoff, not ready)
    startup_timeout_s: float = Field(10.0, gt=0)
    #: assigned no partition for longer than this: not ready (``unassigned``)
    unassigned_grace_s: float = Field(30.0, gt=0)
    #: ceiling of the loop's wait for a log-end / position answer (idle-partition confirmation);
    #: the wait starts at 1 s, doubles after a timeout up to this, then settles at 4x the answers'
    #: duration (watchdog/ingest/brokerwait.py): round trips up to ~2 s keep windows closing
    broker_timeout_ms: int = Field(8000, ge=100, le=120_000)
    #: how old the client's view of the topic may get: a topic deleted and re-created (new id) or given
    #: more partitions is seen within this. kafka-python's own 5 min let a re-created topic's first
    #: events be skipped on Tansu, which answers a fetch past the new log's end with no error
    metadata_max_age_ms: int = Field(5_000, ge=500, le=300_000)

    @field_validator("bootstrap_servers")
    @classmethod
    def _bootstrap_usable(cls, servers: str) -> str:
        return require_bootstrap_servers(servers)

    @field_validator("topic", "dlq_topic")
    @classmethod
    def _topic_legal(cls, topic: str | None) -> str | None:
        return None if topic is None else require_topic_name(topic)

    @property
    def dead_letter_topic(self) -> str:
        return self.dlq_topic or f"{self.topic}.dlq"


class RedisConfig(_Section):
    #: ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` or ``redis+cluster://``
    #: (watchdog/state/redis_conn.py)
    url: str = "redis://127.0.0.1:6379/0"
    #: every key name starts with it; on Redis Cluster it must be a hash tag such as ``{llmwd}``
    prefix: str = Field("llmwd", validate_default=True)
    socket_timeout_s: float = Field(2.0, gt=0)
    #: closed live windows kept in the ``{prefix}:windows`` stream (history for backtests, audits)
    windows_maxlen: int = Field(100_000, ge=0)
    #: seconds between two checkpoints of a partition that keeps receiving events
    checkpoint_every_s: float = Field(1.0, gt=0)
    #: write each route's policy-engine state zstd-compressed (~3x smaller: at 10,000 routes the text a
    #: window boundary makes the daemon hold, and Redis memory and write bandwidth, docs/OPERATIONS.md).
    #: Every release since 2026-12-06 reads both forms; one before it cannot read a packed state, so turn
    #: this on once no replica runs an older release (a rolling upgrade moves partitions between them)
    pack_engine_state: bool = False

    @field_validator("url")
    @classmethod
    def _url_scheme_served(cls, url: str) -> str:
        return require_redis_url(url)

    @field_validator("prefix")
    @classmethod
    def _cluster_prefix_tagged(cls, prefix: str, info: ValidationInfo) -> str:
        return require_cluster_prefix(str(info.data.get("url", "")), prefix)


class WindowConfig(_Section):
    length_s: float = Field(10.0, gt=0)
    grace_s: float = Field(2.0, ge=0)
    max_event_bytes: int = Field(1_048_576, ge=256)
    shadow_sample_rate: float = Field(1.0, ge=0, le=1)
    shadow_max_pairs: int = Field(200, ge=0)
    #: events stamped later than now + this are dead-lettered as ``future`` (they never move a watermark)
    max_future_s: float = Field(300.0, gt=0)
    #: events stamped more than this before now are dead-lettered as ``stale`` (a zeroed or years-old
    #: clock would otherwise open a window of its own on a daemon without a checkpoint); 0: no bound.
    #: The default is Kafka's default retention, so a backlog the broker still holds is read.
    max_age_s: float = Field(7 * 86_400.0, ge=0)
    #: windows stay open this long past the watermark; an event whose window closed is ``late``
    allowed_lateness_s: float = Field(0.0, ge=0)
    #: the host clock may differ from the steady and the events' clock by this much before readiness
    #: says ``clock-skew`` (docs/OPERATIONS.md, "Time")
    clock_skew_s: float = Field(300.0, gt=0)
    #: routes (model, route) one partition keeps state for; an event of a further route is
    #: dead-lettered ``route_limit`` (docs/OPERATIONS.md, "Bounded routes")
    max_routes_per_partition: int = Field(2_000, ge=1, le=1_000_000)
    #: routes one replica keeps state for, over all the partitions it owns
    max_routes: int = Field(10_000, ge=1, le=10_000_000)
    #: a route without an event for this long (the daemon's clock) is forgotten: its windows' and
    #: engine state and its checkpoint entries, unless its flag is off the default precision, a
    #: flip of it is pending or an incident of it is open
    route_idle_s: float = Field(3_600.0, gt=0)

    @field_validator("length_s", "grace_s", "max_future_s", "max_age_s", "allowed_lateness_s", "clock_skew_s",
                     "route_idle_s")
    @classmethod
    def _at_most_a_year(cls, seconds: float) -> float:
        problem = duration_problem(seconds)  # the bound of policy durations
        if problem is not None:
            raise ValueError(problem)
        return seconds


#: channel kinds whose receiver groups alerts itself: storm grouping (``group_wait_s``) is refused
RECEIVER_GROUPED_KINDS = {
    "alertmanager": "its route's group_by, group_wait and group_interval",
    "pagerduty": "one event per request, each incident its own dedup_key; group them with the service's "
                 "alert grouping",
}


class AlertChannelConfig(BaseModel):
    """One entry of ``alerts: channels:``: how one on-call channel is reached (docs/ALERTS.md).

    The one schema of a channel's settings: the daemon config validates it here, and
    ``watchdog.alerting.channels.channel_config`` builds the same model from a mapping, then checks
    what only the channel registry knows (a known ``kind``, a ``url`` unless the kind has a default,
    a PagerDuty ``routing_key``). Secrets (``routing_key``, ``headers``) stay out of its repr."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    url: str | None = None
    routing_key: str | None = Field(None, repr=False)
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    min_severity: Severity = "info"
    timeout_s: float = Field(5.0, gt=0)
    #: label used in logs and stats; defaults to the kind (plus an index when repeated)
    name: str | None = None
    #: PagerDuty ``payload.source`` and the Alertmanager ops label; defaults to this host's name
    source: str | None = None
    #: re-post open incidents this often (Alertmanager forgets alerts not re-sent within its
    #: resolve_timeout); None: the kind's default (60 s for alertmanager, never for the others)
    resend_interval_s: float | None = Field(None, gt=0)
    #: seconds between the starts of two requests, to stay within the receiver's rate limit;
    #: None: the kind's default (1 s for slack, its documented 1 message a second, else 0)
    min_interval_s: float | None = Field(None, ge=0)
    #: storm grouping (docs/ALERTS.md, "Storms"): a route incident's message waits up to this many
    #: seconds for others, then every message waiting for the channel goes as one; 0: one message per
    #: incident. None: the kind's default (1 s for slack, 0 for webhook); alertmanager and pagerduty
    #: group on the receiver's side (group_by, alert grouping) and refuse a value above 0
    group_wait_s: float | None = Field(None, ge=0, le=60)
    #: at most this many incidents' messages in one grouped message (each listed by name)
    group_max: int = Field(100, ge=2, le=200)

    @field_validator("group_wait_s")
    @classmethod
    def _grouping_kind(cls, value: float | None, info: ValidationInfo) -> float | None:
        kind = info.data.get("kind")
        if value and kind in RECEIVER_GROUPED_KINDS:
            raise ValueError(f"{kind} groups alerts on its own side ({RECEIVER_GROUPED_KINDS[kind]}): "
                             "leave group_wait_s unset or 0")
        return value


class AlertsConfig(_Section):
    channels: list[AlertChannelConfig] = Field(default_factory=list)
    #: announce manual ``flags set/pin/unpin`` on the channels (an info message; audited either way)
    announce_manual_changes: bool = True


class GoldenJobConfig(_Section):
    """One scheduled golden replay: a set, the engines to compare, the routes it guards."""

    name: str
    set: str
    model: str
    routes: list[str]
    #: engine options for probes.engines.get_engine, e.g. {kind: torch, model_path: ..., precision: fp8}
    candidate: dict[str, Any]
    baseline: dict[str, Any]
    every_s: float | None = Field(3600.0, gt=0)
    #: crontab fields (minute hour day month weekday); when set it is the schedule and ``every_s`` is ignored
    cron: str | None = None
    #: the IANA zone ``cron`` is read in (not the host's): on a zone's spring-forward day a time that does not
    #: exist runs once an hour later; on its fall-back day a time that occurs twice runs twice
    timezone: str = "UTC"
    jitter_s: float = Field(30.0, ge=0)
    max_items: int | None = Field(None, ge=1)
    on_suspicion: bool = True
    #: generate the baseline's answers twice per replay (an A/A pass, FP16 against FP16): the
    #: broken-items test's null for how much answers move by themselves (sampling, batch-dependent
    #: kernels), measured rather than assumed. Costs one more baseline pass per replay.
    repeat_baseline: bool = True

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, zone: str) -> str:
        zone_info(zone)
        return zone

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, spec: str | None) -> str | None:
        if spec is not None:
            cron_trigger(spec, "UTC", 0.0)
        return spec


class GoldenEnginesConfig(_Section):
    """Engines kept loaded and compiled between scheduled replays (watchdog/sources/engine_cache.py)."""

    #: keep engines between replays; false: build and close them on every replay (the old behaviour)
    resident: bool = True
    #: at most this many engines resident (a job uses two: candidate and baseline)
    max_engines: int = Field(4, ge=1)
    #: at most this much memory (GB, as the engines report it) resident; None: only max_engines bounds
    max_gb: float | None = Field(None, gt=0)
    #: release an engine unused this long (seconds); keep it above the jobs' every_s to stay resident
    idle_s: float | None = Field(5400.0, gt=0)
    #: persistent compile cache for in-process engines (TORCHINDUCTOR_CACHE_DIR, and TRITON_CACHE_DIR in its
    #: ``triton`` folder): a restarted daemon or a cold ``replay`` reuses compiled kernels; None: torch's and
    #: Triton's defaults (/tmp/torchinductor_USER, ~/.triton/cache); a variable the environment sets wins
    compile_cache_dir: str | None = None


class GoldenConfig(_Section):
    jobs: list[GoldenJobConfig] = Field(default_factory=list)
    #: the directory the jobs' sets are looked up in (relative to the config file). None: the
    #: ``golden_sets`` directory beside the config file when there is one and ``$WATCHDOG_GOLDEN_DIR`` is
    #: unset (``load_config`` fills it in), else ``$WATCHDOG_GOLDEN_DIR``, ``./golden_sets``, the shipped sets
    root: str | None = None
    engines: GoldenEnginesConfig = Field(default_factory=GoldenEnginesConfig)
    reports_dir: str | None = None
    #: drift reports each job keeps in ``reports_dir`` (the newest; ``latest.json`` always stays): 720 is
    #: 30 days of an hourly job, ~70 MB at ~100 KB a 54-item report
    reports_keep: int = Field(720, ge=1)
    #: seconds a report is kept (older ones go at its job's next replay); None: by count only
    reports_max_age_s: float | None = Field(None, gt=0)
    #: minimum seconds between two suspicion-triggered replays of one job
    debounce_s: float = Field(60.0, ge=0)

    def in_process(self) -> bool:
        """Whether a job runs an engine inside the daemon (``kind: torch``)."""
        return any(opts.get("kind") == "torch" for job in self.jobs for opts in (job.candidate, job.baseline))


class GpuConfig(_Section):
    enabled: bool = False
    interval_s: float = Field(1.0, gt=0)
    #: GPU UUID (or MIG instance UUID) -> the "model/route" entries (globs allowed) it serves
    routes: dict[str, list[str]] = Field(default_factory=dict)
    #: device-to-device bandwidth self-test (imports torch, needs CUDA): at start, then every
    #: ``bandwidth_every_s``; off by default so the daemon stays torch-free (docs/GPU.md)
    bandwidth_test: bool = False
    bandwidth_every_s: float = Field(3600.0, ge=60)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535)
    #: how people reach this daemon (e.g. https://llmwd.example.com); alerts link to its /evidence/<id> or /status
    external_url: str | None = Field(None, pattern=r"^https?://[^\s/]+")

    @property
    def status_url(self) -> str:
        """The /status link put into alerts: ``external_url`` if set, else host:port."""
        if self.external_url:
            return f"{self.external_url.rstrip('/')}/status"
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}/status"

    @property
    def evidence_url(self) -> str:
        """The base of the evidence links put into alerts (``<base>/<id>``), beside ``status_url``."""
        return self.status_url[: -len("/status")] + "/evidence"


class EvidenceConfig(_Section):
    """Evidence records of decisions (docs/EVIDENCE.md)."""

    enabled: bool = True
    #: records kept (the oldest beyond this are deleted on each write)
    max_records: int = Field(500, ge=1, le=100_000)
    #: seconds a record is kept (Redis TTL; the index is trimmed to it as well)
    ttl_s: float = Field(30 * 86400.0, ge=60)
    #: the largest record in bytes of JSON; bigger ones are cut (texts, then windows) to fit
    max_bytes: int = Field(65_536, ge=8_192, le=1_048_576)
    #: judged windows kept per rule before a decision, and recorded after it
    windows_before: int = Field(12, ge=1, le=200)
    windows_after: int = Field(6, ge=0, le=200)
    #: routes whose rules all pass that keep their windows (the least recently judged beyond it lose
    #: theirs; a route with a failing rule, an open incident or a flip is kept regardless)
    history_routes: int = Field(500, ge=0, le=100_000)


class Config(BaseModel):
    """Top-level daemon configuration."""

    model_config = ConfigDict(extra="forbid")

    instance: str = Field(default_factory=lambda: os.uname().nodename, min_length=1)
    default_precision: str = "fp8"
    #: precisions a route flag may take; ``flags set`` and policies are checked against it
    precisions: list[str] = Field(default_factory=lambda: ["fp8", "fp16"], min_length=1)
    policies: list[str] = Field(default_factory=lambda: ["policies/default.yaml"])
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    windows: WindowConfig = Field(default_factory=WindowConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    golden: GoldenConfig = Field(default_factory=GoldenConfig)
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    evidence: EvidenceConfig = Field(default_factory=EvidenceConfig)
    #: the ``llm-watchdog gateway`` settings, validated by watchdog.gateway.config when it starts
    gateway: dict[str, Any] = Field(default_factory=dict)
    #: seconds between checks of the policy files for edits
    policy_poll_s: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _default_precision_known(self) -> Config:
        self.precisions = [p.lower() for p in self.precisions]
        self.default_precision = self.default_precision.lower()
        if self.default_precision not in self.precisions:
            raise ValueError(f"default_precision {self.default_precision!r} is not one of precisions "
                             f"{self.precisions}")
        return self


#: LLMWD_* variables that are read elsewhere, not config keys
_NOT_CONFIG = {"TANSU", "REDIS_SERVER", "CONFIG", "LITELLM_CONFIG", "TEST_FULL_EXIT"}
#: prefixes of LLMWD_* variables that another settings model reads (watchdog/integrations/litellm.py)
_NOT_CONFIG_PREFIXES = ("LITELLM__",)
#: variables that match no config key but another command reads (the flags CLI's old spelling of
#: $LLMWD_REDIS__URL): a warning, not an error, where the daemon's config is loaded
_READ_ELSEWHERE = {"LLMWD_REDIS_URL"}


def env_overrides(env: Mapping[str, str]) -> tuple[list[tuple[tuple[str, ...], Any, str]], list[str]]:
    """``LLMWD_*`` variables as (path, value, variable) overrides, and the variables that match
    no config key (for ``config check``)."""
    fields = set(Config.model_fields)
    out: list[tuple[tuple[str, ...], Any, str]] = []
    unknown: list[str] = []
    for var in sorted(env):
        rest = var[len(ENV_PREFIX):]
        if not var.startswith(ENV_PREFIX) or rest in _NOT_CONFIG or rest.startswith(_NOT_CONFIG_PREFIXES):
            continue
        path = env_path(var, ENV_PREFIX)
        if path[0] not in fields or not all(path):
            unknown.append(var)
            continue
        out.append((path, env_value(var, env[var]), var))
    return out, unknown


def env_hint(var: str) -> str:
    """For a variable that matches no config key: the spelling it probably meant, if any - the
    ``__`` a section needs (``LLMWD_REDIS_URL`` -> ``; did you mean $LLMWD_REDIS__URL?``) or the
    nearest section or top-level key (``LLMWD_REDS__URL`` -> ``$LLMWD_REDIS__URL``)."""
    rest = var[len(ENV_PREFIX):].lower() if var.startswith(ENV_PREFIX) else ""
    fields = list(Config.model_fields)

    def near(word: str) -> str | None:
        found = difflib.get_close_matches(word, fields, n=1, cutoff=0.75)
        return found[0] if found else None

    head, sep, tail = rest.partition("__")
    if sep:  # an unknown section: its nearest name
        meant = near(head)
        guess = f"{meant}__{tail}" if meant and tail else None
    else:
        head, sep, tail = rest.partition("_")
        if sep and tail and (head in fields or (near(head) and not near(rest))):
            guess = f"{head if head in fields else near(head)}__{tail}"  # one _ where a section needs two
        else:
            guess = near(rest)  # a misspelled top-level key (policy_poll -> policy_poll_s)
    return f"; did you mean ${ENV_PREFIX}{guess.upper()}?" if guess and len(var) <= 200 else ""


def env_problem(env: Mapping[str, str]) -> str | None:
    """The first ``LLMWD_*`` variable that matches no config key but is a near miss of one (a typo
    such as ``LLMWD_REDS__URL`` would otherwise be ignored silently), as one line with the spelling
    it probably meant; None when there is none. A variable like no config key (``LLMWD_DRILL_ROOT``,
    tooling's own) only gets ``config check``'s and ``run``'s warning."""
    for var in env_overrides(env)[1]:
        hint = env_hint(var)
        if var not in _READ_ELSEWHERE and hint:
            shown = var if len(var) <= 80 else var[:80] + "..."
            return f"${shown} matches no config key{hint}"
    return None


def _resolve_paths(data: dict[str, Any], base: Path, env: Mapping[str, str]) -> None:
    policies = data.get("policies")
    if isinstance(policies, list):
        data["policies"] = [os.path.normpath(base / p) if isinstance(p, str) and not Path(p).is_absolute() else p
                            for p in policies]
    golden = data.get("golden")
    if golden is not None and not isinstance(golden, dict):
        return  # validation names it
    root = (golden or {}).get("root")
    if isinstance(root, str) and not Path(root).is_absolute():
        data["golden"]["root"] = os.path.normpath(base / root)
    elif root is None and not env.get("WATCHDOG_GOLDEN_DIR") and (base / "golden_sets").is_dir():
        # the layout ``init`` writes: config.yaml, policies/ and golden_sets/ side by side
        data["golden"] = {**(golden or {}), "root": os.path.normpath(base / "golden_sets")}


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                **overrides: Any) -> Config:
    """Read ``path`` (YAML) if given, apply ``overrides`` and the ``LLMWD_*`` env overrides, validate."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    doc: PosDoc | None = None
    name = str(path) if path else "<env>"
    if path is not None:
        data, doc = read_config_file(path, env)
        _resolve_paths(data, Path(path).parent, env)
    data.update(overrides)
    problem = env_problem(env)
    if problem is not None:
        raise ConfigError(problem)
    from_env: dict[tuple[Any, ...], str] = {}
    for key_path, value, var in env_overrides(env)[0]:
        set_path(data, key_path, value, var)
        from_env[key_path] = var
    return validate(Config, data, name, doc, from_env)
