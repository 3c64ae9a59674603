"""The gateway's settings: the ``gateway:`` section of the watchdog's YAML file (or a file of its own).

The file is read by the daemon config's loader (``watchdog.config.settings.read_config_file``):
``${VAR}`` / ``${VAR:-default}`` expanded, duplicate keys refused, errors as ``file:line:col``;
``LLMWD_GATEWAY__*`` environment variables override the section's keys.

Who may pick which route (``watchdog.gateway.access``): a client whose bearer key is known
(``clients``, ``auth.keys_file`` or the ``api_keys`` shorthand) is served on its key's route; its
``route_header`` may pick only that route or one of its ``allow_routes``. A client without a known
key (allowed unless ``auth.required``) may pick one of ``routes`` with the header; otherwise its
route is the request's model in ``model_routes``, else ``default_route``. A header naming any other
route is refused (``unknown_route: refuse``) or ignored (``unknown_route: default``); a client never
creates a route. The pool serving a request is the first entry of ``pools`` whose ``model`` and
``route`` match (``*`` matches anything; exact entries are tried before wildcard ones). A route
without a Redis flag serves ``default_precision``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from watchdog.config.settings import env_overrides, env_problem
from watchdog.config.yamlfile import ConfigError, read_config_file, set_path, validate
from watchdog.config.yamlpos import PosDoc
from watchdog.core.keys import require_cluster_prefix, require_redis_url
from watchdog.ingest.emitter import EventsConfig
from watchdog.policy.names import check_route

#: the largest request body the gateway reads (more: 413)
MAX_BODY = 8 * 1024 * 1024

__all__ = ["AuthConfig", "ClientConfig", "EventsConfig", "GatewayConfig", "GatewayConfigError", "MetricsConfig",
           "PoolConfig", "UpstreamConfig", "check_route", "load_gateway_config"]


#: a route name, checked and NFKC-normalised by ``check_route``
Route = Annotated[str, AfterValidator(check_route)]
#: a route name or ``*``
RouteOrAny = Annotated[str, AfterValidator(lambda v: v if v == "*" else check_route(v))]
#: a model name as events carry it (the same rule as routes)
ModelName = Annotated[str, AfterValidator(lambda v: check_route(v, "model"))]


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
    #: with ``model: "*"``: the model name the pool's flags, events and the daemon's state use,
    #: whatever name the client sends (so renaming a model cannot dodge a rollback or make new
    #: routes); None: the client's model name (``warnings`` names that)
    served_model: ModelName | None = None
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

    def flag_model(self, model: str) -> str:
        """The model whose flag a request for ``model`` obeys and whose events it writes."""
        return self.served_model if self.model == "*" and self.served_model else model


class ClientConfig(_Section):
    """One client of the gateway: its bearer key and the routes it may be served on."""

    #: the client's ``Authorization: Bearer`` token; write ``${ENV_VAR}``, never the key itself
    api_key: str = Field(min_length=1, repr=False)
    #: the route this client's requests are served on (and counted in)
    route: Route
    #: other routes the client's route header may pick; ``["*"]``: any route the gateway knows
    allow_routes: list[RouteOrAny] = Field(default_factory=list)


class AuthConfig(_Section):
    """Client authentication at the gateway (off by default: most deployments have an auth layer
    in front; docs/INTEGRATIONS.md "Security")."""

    #: true: a request without a known bearer key is refused with 401 (``invalid_api_key``)
    required: bool = False
    #: a YAML file holding a list of clients (``{api_key, route, allow_routes}``), read at start
    #: through the same loader (``${VAR}`` expanded); joins ``gateway.clients``
    keys_file: str | None = None
    #: bearer keys that may read ``GET /metrics`` on the proxy port while ``required`` is true
    #: (client keys may not: the series show every team's routes); unused with ``metrics.port``
    metrics_keys: list[str] = Field(default_factory=list, repr=False)


class MetricsConfig(_Section):
    """Where ``/metrics`` is served."""

    #: a separate listener for ``/metrics`` (the proxy port then answers 404 there); None: on the
    #: proxy port, behind ``auth`` when ``auth.required`` (``auth.metrics_keys``)
    port: int | None = Field(None, ge=0, le=65535)
    host: str = "127.0.0.1"


class GatewayConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: the daemon's ``redis.prefix``; a hash tag such as ``{llmwd}`` on Redis Cluster
    redis_prefix: str = Field("llmwd", validate_default=True)
    default_precision: str = "fp8"
    route_header: str = "X-LLMWD-Route"
    precision_header: str = "X-LLMWD-Precision"
    default_route: Route = "default"
    #: routes a client without a known key may pick with ``route_header``
    routes: list[Route] = Field(default_factory=list)
    #: a route header the client may not use: ``refuse`` (400/403, OpenAI-style error) or
    #: ``default`` (ignored: the key's, the model's or the default route serves)
    unknown_route: Literal["refuse", "default"] = "refuse"
    auth: AuthConfig = Field(default_factory=AuthConfig)
    #: the gateway's clients: bearer key -> route (+ the routes its header may pick)
    clients: list[ClientConfig] = Field(default_factory=list)
    #: shorthand for ``clients`` without ``allow_routes``: bearer key -> route
    api_keys: dict[str, Route] = Field(default_factory=dict, repr=False)
    #: client model name -> route, used when neither the API key nor an allowed header gives one
    model_routes: dict[str, Route] = Field(default_factory=dict)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    #: chat/completions requests served at once (reading the body, waiting on the upstream, relaying);
    #: one more is answered 503 ``gateway_overloaded`` with ``Retry-After`` at once, without an event
    max_in_flight: int = Field(512, ge=1)
    #: bytes of request bodies held at once (a body counts from its first chunk until its request, and
    #: its shadow request, end); a body past it is answered 503 ``gateway_overloaded`` like the above.
    #: At least one body of the largest size (``MAX_BODY``); memory runs ~3x this (raw, parsed, sent)
    max_body_bytes_in_flight: int = Field(128 * 1024 * 1024, ge=MAX_BODY)
    #: TCP connections open at once, idle keep-alive ones included; one more is answered 503
    #: ``gateway_overloaded`` and closed before its request is read (its file descriptor and buffers freed)
    max_connections: int = Field(4096, ge=1)
    #: seconds a connection has to send a whole request head (request line and headers), from its
    #: start or from the first byte of its next request; past it the connection is closed (uvicorn
    #: itself waits forever for a first request: one idle socket per client held a slot and a descriptor)
    header_timeout_s: float = Field(20.0, gt=0, le=3600)
    #: bytes of one request head (request line and headers); past it: 431 and the connection closed
    max_header_bytes: int = Field(64 * 1024, ge=4096)
    #: engine label put into events (e.g. ``vllm-0.6.3``); default: the served upstream's model name
    engine: str | None = None
    pools: list[PoolConfig] = Field(default_factory=list)
    events: EventsConfig = Field(default_factory=EventsConfig)

    @field_validator("redis_url")
    @classmethod
    def _url_scheme_served(cls, url: str) -> str:
        return require_redis_url(url)

    @field_validator("redis_prefix")
    @classmethod
    def _cluster_prefix_tagged(cls, prefix: str, info: ValidationInfo) -> str:
        return require_cluster_prefix(str(info.data.get("redis_url", "")), prefix)

    @model_validator(mode="after")
    def _one_route_per_key(self) -> GatewayConfig:
        seen: set[str] = set()
        for key in [*self.api_keys, *(c.api_key for c in self.clients)]:
            if key in seen:  # the message must not hold the key: it is printed
                raise ValueError("the same client key is listed twice (api_keys / clients / auth.keys_file)")
            seen.add(key)
        return self

    def warnings(self) -> list[str]:
        """What is valid but lets a client steer its precision: a pool with ``model: "*"`` takes
        the client's model name as the model of the flag it obeys and of its events, so a client
        that renames its model (``llama-x`` for ``llama``) reaches a route with no flag - a rolled
        back route serves it FP8 - and makes the daemon judge a new route per name."""
        out = []
        for i, pool in enumerate(self.pools):
            if pool.model == "*" and not pool.served_model:
                out.append(f"gateway.pools[{i}]: model '*' lets a client pick the flag it obeys by its model name "
                           f"(a route rolled back for one model still serves FP8 to another name); set "
                           f"served_model (the one model its upstreams serve) or list each served model in "
                           f"its own pool")
        return out

    def all_clients(self) -> list[ClientConfig]:
        """``clients`` and the ``api_keys`` shorthand, as one list."""
        return [*self.clients, *(ClientConfig(api_key=k, route=r) for k, r in self.api_keys.items())]

    def known_routes(self) -> frozenset[str]:
        """Every route this gateway may serve: the configured ones, never one a client names."""
        out = {self.default_route, *self.routes, *self.model_routes.values(), *self.api_keys.values()}
        for c in self.clients:
            out.add(c.route)
            out.update(r for r in c.allow_routes if r != "*")
        out.update(p.route for p in self.pools if p.route != "*")
        return frozenset(out)

    def pool_for(self, model: str, route: str) -> PoolConfig | None:
        exact = [p for p in self.pools if p.matches(model, route) and "*" not in (p.model, p.route)]
        if exact:
            return exact[0]
        return next((p for p in self.pools if p.matches(model, route)), None)

    def models(self) -> list[str]:
        return sorted({p.model for p in self.pools if p.model != "*"})


class GatewayConfigError(ValueError):
    """The gateway section is invalid; ``str()`` is one line per problem, ready to print."""


def _section(doc: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    if "gateway" in doc:
        return doc["gateway"], ("gateway",)
    return doc, ()


def load_gateway_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                        **overrides: Any) -> GatewayConfig:
    """Read the ``gateway:`` section of ``path`` (or the whole file when it has no such key) with the
    daemon config's loader, apply the ``LLMWD_GATEWAY__*`` variables and ``overrides``, read
    ``auth.keys_file`` and validate."""
    env = os.environ if env is None else env
    name = str(path) if path else "<defaults>"
    data: dict[str, Any] = {}
    doc: PosDoc | None = None
    prefix: tuple[str, ...] = ()
    from_env: dict[tuple[Any, ...], str] = {}
    try:
        if path is not None:
            whole, doc = read_config_file(path, env)
            daemon_keys = sorted(k for k in ("kafka", "policies", "windows") if k in whole)
            if "gateway" not in whole and daemon_keys:  # read whole, each daemon key was one more error
                raise GatewayConfigError(f"{name}: no 'gateway:' section; this looks like the daemon's config "
                                         f"({', '.join(daemon_keys)}): add a gateway: section (docs/INTEGRATIONS.md)")
            section, prefix = _section(whole)
            if not isinstance(section, dict):
                pos = doc.pos(prefix)
                raise GatewayConfigError(f"{name}:{pos.line}:{pos.col}: gateway: must be a mapping")
            data = dict(section)
        problem = env_problem(env)
        if problem is not None:
            raise GatewayConfigError(problem)
        for key_path, value, var in env_overrides(env)[0]:
            if key_path[0] == "gateway" and len(key_path) > 1:
                set_path(data, key_path[1:], value, var, label="gateway.")
                from_env[key_path[1:]] = var
        data.update(overrides)
        auth = data.get("auth")
        keys_file = auth.get("keys_file") if isinstance(auth, dict) else None
        if isinstance(keys_file, str):
            data["clients"] = [*(data.get("clients") or []), *_read_keys_file(keys_file, path, env)]
    except ConfigError as exc:
        raise GatewayConfigError(str(exc)) from exc
    try:
        return validate(GatewayConfig, data, name, doc, from_env, prefix, section=("gateway",))
    except ConfigError as exc:
        raise GatewayConfigError(str(exc)) from exc


def _read_keys_file(keys_file: str, config_path: str | Path | None, env: Mapping[str, str]) -> list[ClientConfig]:
    """The clients listed in ``auth.keys_file`` (relative to the config file), validated."""
    p = Path(keys_file)
    if not p.is_absolute() and config_path is not None:
        p = Path(config_path).parent / p
    if not p.is_file():
        raise GatewayConfigError(f"{p}: auth.keys_file is not a file")
    data, doc = read_config_file(p, env)
    clients = data.get("clients")
    if not isinstance(clients, list):
        raise GatewayConfigError(f"{p}:1:1: the keys file must hold `clients:`, a list of "
                                 "{api_key, route, allow_routes}")
    out, lines = [], []
    for i, item in enumerate(clients):
        try:
            out.append(ClientConfig.model_validate(item))
        except ValidationError as exc:
            for e in exc.errors():
                pos = doc.pos(("clients", i, *e["loc"]), key=True)
                lines.append(f"{p}:{pos.line}:{pos.col}: clients.{i}.{'.'.join(map(str, e['loc']))}: {e['msg']}")
    if lines:
        raise GatewayConfigError("\n".join(lines))
    return out
