"""The gateway's settings: the ``gateway:`` section of the watchdog's YAML file (or a file of its own).

Route resolution, in order: the ``route_header`` request header (default ``X-LLMWD-Route``), the
client's API key (``Authorization: Bearer <key>``) looked up in ``api_keys``, the request's model
in ``model_routes``, else ``default_route``. The pool serving a request is the first entry of
``pools`` whose ``model`` and ``route`` match (``*`` matches anything; exact entries are tried
before wildcard ones). A route without a Redis flag serves ``default_precision``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from watchdog.ingest.emitter import EventsConfig

__all__ = ["EventsConfig", "GatewayConfig", "GatewayConfigError", "PoolConfig", "UpstreamConfig",
           "load_gateway_config"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpstreamConfig(_Section):
    """One OpenAI-compatible upstream (vLLM, TensorRT-LLM's server, probes.openai_server...)."""

    #: base URL including ``/v1``, e.g. ``http://vllm-fp8:8000/v1``
    url: str
    #: name of the environment variable holding the upstream's API key (never the key itself)
    api_key_env: str | None = None
    #: model name sent upstream; default: the client's model name
    model: str | None = None
    timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)

    @field_validator("url")
    @classmethod
    def _strip(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        return v.rstrip("/")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None


class PoolConfig(_Section):
    """The FP8 (candidate) and baseline upstreams of one (model, route)."""

    model: str = "*"
    route: str = "*"
    candidate_precision: str = "fp8"
    baseline_precision: str = "fp16"
    candidate: UpstreamConfig
    baseline: UpstreamConfig
    #: fraction of requests mirrored to the other precision in the background (``shadow`` block)
    shadow_sample: float = Field(0.0, ge=0, le=1)
    #: fraction served on the baseline even while the flag says candidate, so windows can compare
    baseline_share: float = Field(0.0, ge=0, le=1)
    #: put the prompt / completion / completion log-probabilities into the events (off: they may
    #: hold customer data). Live agreement needs ``log_completions`` on the route.
    log_prompts: bool = False
    log_completions: bool = False
    log_logprobs: bool = False
    #: seconds the background shadow request may take before it is abandoned
    shadow_timeout_s: float = Field(30.0, gt=0)

    def matches(self, model: str, route: str) -> bool:
        return self.model in ("*", model) and self.route in ("*", route)


class GatewayConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "llmwd"
    default_precision: str = "fp8"
    route_header: str = "X-LLMWD-Route"
    precision_header: str = "X-LLMWD-Precision"
    default_route: str = "default"
    #: gateway API key -> route (the key is the client's ``Authorization: Bearer`` token)
    api_keys: dict[str, str] = Field(default_factory=dict)
    #: client model name -> route, used when neither the header nor the API key gives one
    model_routes: dict[str, str] = Field(default_factory=dict)
    #: engine label put into events (e.g. ``vllm-0.6.3``); default: the served upstream's model name
    engine: str | None = None
    pools: list[PoolConfig] = Field(default_factory=list)
    events: EventsConfig = Field(default_factory=EventsConfig)

    def pool_for(self, model: str, route: str) -> PoolConfig | None:
        exact = [p for p in self.pools if p.matches(model, route) and "*" not in (p.model, p.route)]
        if exact:
            return exact[0]
        return next((p for p in self.pools if p.matches(model, route)), None)

    def models(self) -> list[str]:
        return sorted({p.model for p in self.pools if p.model != "*"})


class GatewayConfigError(ValueError):
    """The gateway section is invalid; ``str()`` is one line per problem, ready to print."""


def load_gateway_config(path: str | Path | None = None, **overrides: Any) -> GatewayConfig:
    """Read the ``gateway:`` section of ``path`` (or the whole file when it has no such key)."""
    data: dict[str, Any] = {}
    name = str(path) if path else "<defaults>"
    if path is not None:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:
            raise GatewayConfigError(f"{name}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc
        if not isinstance(doc, dict):
            raise GatewayConfigError(f"{name}: the config must be a mapping")
        section = doc.get("gateway", doc)
        if not isinstance(section, dict):
            raise GatewayConfigError(f"{name}: gateway: must be a mapping")
        data = dict(section)
    data.update(overrides)
    try:
        return GatewayConfig(**data)
    except ValidationError as exc:
        lines = [f"{name}: gateway.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise GatewayConfigError("\n".join(lines)) from exc
