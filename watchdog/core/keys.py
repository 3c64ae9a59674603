"""The Redis key layout of llm-watchdog: every key the daemon, the CLI and the gateways touch.

This is the one module that spells key names. Writers (``watchdog.actuation.actuator``) and readers
(``watchdog.actuation.routing``, gateways in other languages, see docs/ROUTING.md) derive every name from a
``Keys`` built on the same prefix, so two deployments can share one Redis under two prefixes.

It also holds ``Flag``, the parsed form of one route hash, because the hash fields are part of the
layout. On Redis Cluster (``redis+cluster://`` URLs, ``watchdog.state.redis_conn``) the prefix must
be a hash tag such as ``{llmwd}``: every key of a deployment then maps to one slot, so each Lua
script and MULTI (route hash + audit + owner token + engine state + outbox) runs on one shard.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: Version of the JSON records this module's writers produce (audit records, pub/sub messages).
SCHEMA_VERSION = 1

#: URL schemes of a Redis Cluster (``watchdog.state.redis_conn`` builds the client)
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

#: Fields of a route hash, in display order. ``pinned_until`` is present only while pinned (or
#: until the next write after a pin expired).
ROUTE_FIELDS = ("model", "route", "precision", "epoch", "reason", "policy", "changed_at", "changed_by",
                "mode", "pinned_until")


def key_part(name: str) -> str:
    """A model or route name as it stands in a key: ``%`` and ``:`` percent-encoded, so that
    model ``llama3:8b`` + route ``chat`` and model ``llama3`` + route ``8b:chat`` name two keys.
    Names without either character are unchanged."""
    return name.replace("%", "%25").replace(":", "%3A")


def _key_unpart(part: str) -> str:
    """The name ``key_part`` encoded."""
    return part.replace("%3A", ":").replace("%25", "%")


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob (``SCAN MATCH``, ``KEYS``)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


#: every URL scheme ``watchdog.state.redis_conn.client_from_url`` serves (redis-py's own three,
#: then Sentinel and Cluster)
REDIS_URL_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", *CLUSTER_SCHEMES)


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` cannot name a Redis (None when its scheme is one ``client_from_url`` serves):
    ``localhost:6379`` would otherwise pass a config check and fail only when the client is built."""
    scheme, sep, _ = url.partition("://")
    if sep and scheme.lower() in REDIS_URL_SCHEMES:
        return None
    forms = ", ".join(f"{s}://" for s in REDIS_URL_SCHEMES)
    shown = url[:200]
    if "@" in shown:  # the message is printed: never the password of ``user:pw@host``
        shown = "***@" + shown.rpartition("@")[2]
    hint = f" (did you mean 'redis://{shown}'?)" if not sep and shown else ""
    return f"Redis URL {shown!r} has no scheme this client serves: use one of {forms}{hint}"


def require_redis_url(url: str) -> str:
    """``url``, or ValueError with ``redis_url_problem``'s line (a pydantic validator's body)."""
    problem = redis_url_problem(url)
    if problem is not None:
        raise ValueError(problem)
    return url


def hash_tag(prefix: str) -> str | None:
    """The part Redis Cluster hashes for every key under ``prefix``: the text between the first
    ``{`` and the next ``}``, when that is inside the prefix and not empty; else None (each key
    would then hash whole, and model or route names would spread one deployment over slots)."""
    start = prefix.find("{")
    end = prefix.find("}", start + 1) if start >= 0 else -1
    if start < 0 or end <= start + 1:
        return None
    return prefix[start + 1:end]


def cluster_prefix_problem(url: str, prefix: str) -> str | None:
    """Why ``prefix`` cannot serve with ``url`` (None when it can): on a Redis Cluster a prefix
    without a hash tag would spread one deployment's keys over slots, and its scripts would fail
    with CROSSSLOT."""
    if not is_cluster_url(url) or hash_tag(prefix) is not None:
        return None
    bare = prefix.replace("{", "").replace("}", "") or "llmwd"
    return (f"redis prefix {prefix!r} has no hash tag, which a Redis Cluster URL needs (every key of "
            f"a deployment must map to one slot): use prefix '{{{bare}}}'")


def require_cluster_prefix(url: str, prefix: str) -> str:
    """``prefix``, or ValueError with ``cluster_prefix_problem``'s line (a pydantic validator's body)."""
    problem = cluster_prefix_problem(url, prefix)
    if problem is not None:
        raise ValueError(problem)
    return prefix


@dataclass(frozen=True, slots=True)
class Keys:
    """Names of every Redis key under one prefix (default ``llmwd``)."""

    prefix: str = "llmwd"

    def route(self, model: str, route: str) -> str:
        """Hash ``{prefix}:route:{model}:{route}``: the precision one route serves.

        Fields: ``precision`` (e.g. ``fp8``/``fp16``), ``epoch`` (fencing counter, +1 on every
        write, 0 when the hash is absent), ``reason``, ``policy``, ``changed_at`` (unix seconds),
        ``changed_by``, ``mode`` (``policy`` or ``manual``), ``model``, ``route`` and, while pinned,
        ``pinned_until`` (unix seconds). Written only by the flip script in ``watchdog/actuation/flip.lua``.
        """
        return f"{self.prefix}:route:{key_part(model)}:{key_part(route)}"

    @property
    def routes_index(self) -> str:
        """Set ``{prefix}:routes`` of every route hash key ever written, so listing needs no SCAN."""
        return f"{self.prefix}:routes"

    @property
    def audit(self) -> str:
        """Stream ``{prefix}:audit``: one record per applied flag change (schema in docs/ROUTING.md)."""
        return f"{self.prefix}:audit"

    @property
    def channel(self) -> str:
        """Pub/sub channel ``{prefix}:flags``: a JSON message per applied flag change."""
        return f"{self.prefix}:flags"

    def state(self, name: str) -> str:
        """String ``{prefix}:state:{name}``: a JSON blob of daemon state (policy-engine state,
        ingest "windows closed until" marks), so a restarted daemon resumes where it stopped."""
        return f"{self.prefix}:state:{name}"

    @property
    def windows(self) -> str:
        """Stream ``{prefix}:windows``: one JSON record (field ``json``) per closed live window,
        written by the daemon with its state, capped with MAXLEN ~ (for backtests and replays)."""
        return f"{self.prefix}:windows"

    def checkpoint(self, group: str, topic: str, partition: int) -> str:
        """Hash ``{prefix}:ckpt:{group}:{topic}:{partition}``: fields ``seq`` (save sequence number) and
        ``json`` (next offset, watermark, open windows, routes), written by ``watchdog/state/checkpoint.lua``."""
        return f"{self.prefix}:ckpt:{group}:{topic}:{partition}"

    def owner(self, group: str, topic: str, partition: int) -> str:
        """String ``{prefix}:owner:{group}:{topic}:{partition}``: the ownership token
        ``<generation>:<instance>`` of the replica that holds the partition (``...:gen`` counts them).
        Checkpoint and flip writes carrying another token are refused (fencing)."""
        return f"{self.prefix}:owner:{group}:{topic}:{partition}"

    def engine(self, group: str, model: str, route: str) -> str:
        """String ``{prefix}:engine:{group}:{model}:{route}``: JSON policy-engine state of one route
        (cooldown, budget, promote timer, rule streaks), written with checkpoints and flips; packed
        (``state.checkpoint.pack_engine``) when ``redis.pack_engine_state`` is on."""
        return f"{self.prefix}:engine:{group}:{key_part(model)}:{key_part(route)}"

    def engine_pattern(self, group: str) -> str:
        """A ``SCAN MATCH`` pattern for every ``engine`` key of ``group``: the routes the daemons
        keep policy state for (routes seen within ``windows.route_idle_s``)."""
        return _glob_escape(f"{self.prefix}:engine:{group}:") + "*"

    def engine_route(self, group: str, key: str) -> tuple[str, str] | None:
        """``(model, route)`` of an ``engine`` key of ``group``, or None for any other key."""
        head = f"{self.prefix}:engine:{group}:"
        if not key.startswith(head):
            return None
        parts = key[len(head):].split(":")
        if len(parts) != 2:
            return None
        return _key_unpart(parts[0]), _key_unpart(parts[1])

    @property
    def outbox(self) -> str:
        """Stream ``{prefix}:outbox``: one JSON record (field ``json``) per page to send, written in the
        same atomic step as the decision that causes it; read through consumer group ``pager``, which
        copies each record's messages to the channels' page streams and deletes it in one MULTI."""
        return f"{self.prefix}:outbox"

    def pages(self, group: str, channel: str) -> str:
        """Stream ``{prefix}:pages:{group}:{channel}``: the messages one alert channel still has to
        deliver (field ``json``: an ``Alert``), written by the pager as it takes an outbox record and
        read through consumer group ``pager``; an entry is deleted once delivered (or given up)."""
        return f"{self.prefix}:pages:{group}:{key_part(channel)}"

    def incidents(self, group: str) -> str:
        """Hash ``{prefix}:incidents:{group}``: one field per open incident key (``model/route/policy``),
        its JSON as the value; written by the pager as it acknowledges outbox records."""
        return f"{self.prefix}:incidents:{group}"

    def lease(self, name: str) -> str:
        """String ``{prefix}:lease:{name}`` with a TTL: the holder of singleton work (golden scheduler)."""
        return f"{self.prefix}:lease:{name}"

    def golden_signals(self, group: str) -> str:
        """Stream ``{prefix}:golden:{group}:signals``: one entry per finished golden replay (field
        ``json``: ``{"schema": 1, "job": name, "signals": [signal_to_dict(...)]}``), written by the
        replica holding the golden lease, capped with MAXLEN ~; every replica of the group reads it
        and judges the signals of the routes it owns."""
        return f"{self.prefix}:golden:{group}:signals"

    def golden_requests(self, group: str) -> str:
        """List ``{prefix}:golden:{group}:requests``: on-suspicion replay requests (JSON ``{"model",
        "route", "reason", "at", "by"}``) pushed by any replica, popped by the golden lease holder."""
        return f"{self.prefix}:golden:{group}:requests"

    def maintenance(self, model: str, route: str) -> str:
        """String ``{prefix}:maintenance:{model}:{route}``: an operator's maintenance annotation,
        JSON ``{"start": unix s, "until": unix s, "reason": str, "by": str}`` with a TTL that ends
        it. Model ``*`` covers every model of the route. Live windows overlapping it are marked
        (``watchdog.policy.changes.mark_maintenance``) and the learned live rules with ``settle``
        judge nothing until it ended and the route settled (docs/JUDGE.md, "Deploys")."""
        return f"{self.prefix}:maintenance:{key_part(model)}:{key_part(route)}"

    @property
    def maintenance_generation(self) -> str:
        """Integer ``{prefix}:maintenance-generation``: +1 (INCR) in the same transaction as every write
        of a ``maintenance`` key (``FlagStore.maintenance``), so the daemon's reader
        (``watchdog.runtime.maintenance``) reads every route's annotation again only when it moved. A
        writer that does not bump it (a SET by hand) is seen by the reader's slower full read."""
        return f"{self.prefix}:maintenance-generation"

    def evidence(self, evidence_id: str) -> str:
        """String ``{prefix}:evidence:{id}`` with a TTL: the JSON evidence record of one decision
        (rollback, promote or alert; schema in docs/EVIDENCE.md), at most ``evidence.max_bytes``."""
        return f"{self.prefix}:evidence:{key_part(evidence_id)}"

    @property
    def evidence_index(self) -> str:
        """Sorted set ``{prefix}:evidence-index``: evidence ids scored by decision time (unix s),
        trimmed to ``evidence.max_records`` and ``evidence.ttl_s`` on every write."""
        return f"{self.prefix}:evidence-index"

    @property
    def evidence_summaries(self) -> str:
        """Hash ``{prefix}:evidence-summaries``: evidence id -> a small JSON summary (kind, route,
        policy, rule, reason, time) for the incident list; trimmed with ``evidence_index``."""
        return f"{self.prefix}:evidence-summaries"

    def heartbeat(self, instance: str) -> str:
        """String ``{prefix}:heartbeat:{instance}`` with a TTL: a JSON blob a live daemon refreshes."""
        return f"{self.prefix}:heartbeat:{instance}"


def text(value: Any) -> str:
    """A Redis reply as ``str`` whether or not the client decodes responses."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _float_or_none(value: str | None) -> float | None:
    if value in (None, ""):
        return None
    try:
        return float(value)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Flag:
    """One route hash, parsed."""

    model: str
    route: str
    precision: str
    epoch: int
    reason: str = ""
    policy: str = ""
    changed_at: float | None = None
    changed_by: str = ""
    mode: str = ""
    pinned_until: float | None = None

    def pinned(self, now: float) -> bool:
        """True while a pin holds: policy-driven writes are refused until ``pinned_until``."""
        return self.pinned_until is not None and self.pinned_until > now

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hash(cls, raw: dict[Any, Any], model: str = "", route: str = "") -> Flag | None:
        """Parse an HGETALL reply; None when the hash is absent or has no precision."""
        fields = {text(k): text(v) for k, v in raw.items()}
        precision = fields.get("precision")
        if not precision:
            return None
        try:
            epoch = int(fields.get("epoch", "0"))
        except ValueError:
            epoch = 0
        return cls(
            model=fields.get("model") or model,
            route=fields.get("route") or route,
            precision=precision,
            epoch=epoch,
            reason=fields.get("reason", ""),
            policy=fields.get("policy", ""),
            changed_at=_float_or_none(fields.get("changed_at")),
            changed_by=fields.get("changed_by", ""),
            mode=fields.get("mode", ""),
            pinned_until=_float_or_none(fields.get("pinned_until")),
        )
