"""Daemon configuration: a YAML file, overridden by ``LLMWD_`` environment variables, validated by pydantic.

Environment overrides use ``__`` between levels: ``LLMWD_KAFKA__BOOTSTRAP_SERVERS=host:9092``,
``LLMWD_REDIS__URL=redis://...``. Errors name the file, line and column of the bad value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

ENV_PREFIX = "LLMWD_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KafkaConfig(_Section):
    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "llm.inference.logs"
    #: dead-letter topic; default ``<topic>.dlq``
    dlq_topic: str | None = None
    group_id: str = "llm-watchdog"
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    session_timeout_ms: int = Field(10_000, ge=1000)
    heartbeat_interval_ms: int = Field(2_000, ge=100)
    max_poll_records: int = Field(2_000, ge=1)
    #: passed through to kafka-python unchanged (security_protocol, sasl_mechanism,
    #: sasl_plain_username, sasl_plain_password, ssl_cafile, ssl_certfile, ssl_keyfile, ...)
    security: dict[str, Any] = Field(default_factory=dict)
    #: bound on each start-up attempt against the brokers (then retried with backoff, not ready)
    startup_timeout_s: float = Field(10.0, gt=0)
    #: assigned no partition for longer than this: not ready (``unassigned``)
    unassigned_grace_s: float = Field(30.0, gt=0)

    @property
    def dead_letter_topic(self) -> str:
        return self.dlq_topic or f"{self.topic}.dlq"


class RedisConfig(_Section):
    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "llmwd"
    socket_timeout_s: float = Field(2.0, gt=0)
    #: closed live windows kept in the ``{prefix}:windows`` stream (history for backtests, audits)
    windows_maxlen: int = Field(100_000, ge=0)
    #: seconds between two checkpoints of a partition that keeps receiving events
    checkpoint_every_s: float = Field(1.0, gt=0)


class WindowConfig(_Section):
    length_s: float = Field(10.0, gt=0)
    grace_s: float = Field(2.0, ge=0)
    max_event_bytes: int = Field(1_048_576, ge=256)
    shadow_sample_rate: float = Field(1.0, ge=0, le=1)
    shadow_max_pairs: int = Field(200, ge=0)
    #: events stamped later than now + this are dead-lettered as ``future`` (they never move a watermark)
    max_future_s: float = Field(300.0, gt=0)
    #: windows stay open this long past the watermark; an event whose window closed is ``late``
    allowed_lateness_s: float = Field(0.0, ge=0)


class AlertChannelConfig(_Section):
    kind: str
    url: str | None = None
    routing_key: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    min_severity: Literal["info", "warning", "critical"] = "info"
    timeout_s: float = Field(5.0, gt=0)


class AlertsConfig(_Section):
    channels: list[AlertChannelConfig] = Field(default_factory=list)


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
    cron: str | None = None
    jitter_s: float = Field(30.0, ge=0)
    max_items: int | None = Field(None, ge=1)
    on_suspicion: bool = True


class GoldenConfig(_Section):
    jobs: list[GoldenJobConfig] = Field(default_factory=list)
    reports_dir: str | None = None
    #: minimum seconds between two suspicion-triggered replays of one job
    debounce_s: float = Field(60.0, ge=0)


class GpuConfig(_Section):
    enabled: bool = False
    interval_s: float = Field(1.0, gt=0)
    #: GPU UUID (or MIG instance UUID) -> the "model/route" entries (globs allowed) it serves
    routes: dict[str, list[str]] = Field(default_factory=dict)


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(9464, ge=0, le=65535)


class Config(BaseSettings):
    """Top-level daemon configuration."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    instance: str = Field(default_factory=lambda: os.uname().nodename)
    default_precision: str = "fp8"
    policies: list[str] = Field(default_factory=lambda: ["policies/default.yaml"])
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    windows: WindowConfig = Field(default_factory=WindowConfig)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    golden: GoldenConfig = Field(default_factory=GoldenConfig)
    gpu: GpuConfig = Field(default_factory=GpuConfig)
    #: seconds between checks of the policy files for edits
    policy_poll_s: float = Field(1.0, gt=0)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # environment wins over the file's values (passed as init kwargs)
        return env_settings, init_settings


class ConfigError(ValueError):
    """The configuration file or environment is invalid; ``str()`` is ready to print."""


def _line_index(node: yaml.Node, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], tuple[int, int]]:
    marks = {path: (node.start_mark.line + 1, node.start_mark.column + 1)}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            marks.update(_line_index(value, (*path, key.value)))
            marks[(*path, key.value)] = (key.start_mark.line + 1, key.start_mark.column + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            marks.update(_line_index(item, (*path, i)))
    return marks


def load_config(path: str | Path | None = None, **overrides: Any) -> Config:
    """Read ``path`` (YAML) if given, apply ``LLMWD_*`` env overrides and ``overrides``, validate."""
    data: dict[str, Any] = {}
    marks: dict[tuple[Any, ...], tuple[int, int]] = {}
    name = str(path) if path else "<env>"
    if path is not None:
        text = Path(path).read_text()
        try:
            node = yaml.compose(text)
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
            raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{name}:1:1: the config must be a mapping")
        if node is not None:
            marks = _line_index(node)
    data.update(overrides)
    try:
        return Config(**data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            pos = next((marks[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in marks), None)
            where = f"{name}:{pos[0]}:{pos[1]}" if pos else name
            lines.append(f"{where}: {'.'.join(str(p) for p in loc)}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from exc
