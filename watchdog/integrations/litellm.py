"""A LiteLLM ``CustomLogger``: send each request to the FP8 or baseline deployment per the Redis flag,
and log every answer to Kafka as a watchdog event (docs/EVENTS.md).

In the LiteLLM proxy config (docs/INTEGRATIONS_otlp_litellm.md)::

    litellm_settings:
      callbacks: watchdog.integrations.litellm.handler

``handler`` is built on first access from the YAML file named by ``LLMWD_LITELLM_CONFIG``
(``LiteLLMSettings``), so importing this module opens no connection. Per request:

* ``async_pre_call_hook`` finds the route (the virtual key's or team's alias in ``key_routes``, else
  ``model_routes``, else ``default_route``; the ``X-LLMWD-Route`` header may pick only a route the
  key allows, ``key_allow_routes``, or, for a key without a route, one of ``routes``: a client never
  escapes its key's route nor creates one; other headers are ignored and counted), reads the
  precision from the routing flags (``watchdog.actuation.routing.RoutingFlags``: an in-memory cache kept
  current over pub/sub, last known value while Redis is down; no I/O on the request path) and
  rewrites ``data["model"]`` to the deployment in ``variants[model][precision]``;
* ``async_log_success_event`` / ``async_log_failure_event`` queue one event on a bounded buffer that
  a thread drains to Kafka (``watchdog.ingest.emitter.EventEmitter``): full buffer → dropped and counted.

No hook ever raises: an internal error is logged and counted, and the request goes on unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from litellm.integrations.custom_logger import CustomLogger
from pydantic import BaseModel, ConfigDict, Field, field_validator

from watchdog.config.yamlfile import ConfigError, env_path, env_value, read_config_file, set_path, validate
from watchdog.core.keys import require_redis_url
from watchdog.ingest.emitter import EventEmitter, EventsConfig
from watchdog.policy.names import check_route

log = logging.getLogger(__name__)

CONFIG_ENV = "LLMWD_LITELLM_CONFIG"
#: environment overrides of the settings file: ``LLMWD_LITELLM__REDIS_URL=...``
ENV_PREFIX = "LLMWD_LITELLM__"
#: LiteLLM's call id (the client's ``x-litellm-call-id`` when sent) is kept in events up to this many characters
MAX_CALL_ID = 128


class LiteLLMSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "llmwd"
    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "llm.inference.logs"
    #: client-facing model -> {precision: model_name of a deployment in the proxy's model_list}
    variants: dict[str, dict[str, str]]
    route_header: str = "x-llmwd-route"
    #: virtual key alias or team alias -> route (the key decides)
    key_routes: dict[str, str] = Field(default_factory=dict)
    #: virtual key alias or team alias -> other routes its route header may pick
    key_allow_routes: dict[str, list[str]] = Field(default_factory=dict)
    #: routes the route header may pick on requests whose key has no route in ``key_routes``
    routes: list[str] = Field(default_factory=list)
    #: client model -> route, when neither header nor key names one
    model_routes: dict[str, str] = Field(default_factory=dict)
    default_route: str = "default"
    #: precision of a route without a flag (the watchdog's ``default_precision``)
    default_precision: str = "fp8"
    #: served when the flag names a precision with no deployment in ``variants``
    baseline: str = "fp16"
    buffer_size: int = Field(10_000, ge=1)
    #: put completions into the events (live agreement needs them; they may hold customer data)
    log_completions: bool = False

    @field_validator("redis_url")
    @classmethod
    def _url_scheme_served(cls, url: str) -> str:
        return require_redis_url(url)

    @classmethod
    def from_file(cls, path: str | Path, env: Mapping[str, str] | None = None) -> LiteLLMSettings:
        """Read ``path`` as the daemon reads its config (bounded YAML, ``${VAR}`` placeholders), apply
        the ``LLMWD_LITELLM__<KEY>`` variables (``__`` between levels; JSON for ``{``/``[`` values)
        and validate; errors (``ConfigError``) name ``file:line:col`` or the variable."""
        env = os.environ if env is None else env
        data, doc = read_config_file(path, env)
        from_env: dict[tuple[Any, ...], str] = {}
        for var in sorted(env):
            if var.startswith(ENV_PREFIX) and len(var) > len(ENV_PREFIX):
                key_path = env_path(var, ENV_PREFIX)
                set_path(data, key_path, env_value(var, env[var]), var)
                from_env[key_path] = var
        return cast(LiteLLMSettings, validate(cls, data, str(path), doc, from_env))


def failure_status(exc: BaseException | None) -> str:
    """The event status of a failed call: ``cancelled`` (the call was cancelled: the client went),
    ``rate_limited`` (HTTP 429), ``timeout`` (408, litellm.Timeout, httpx/asyncio timeouts),
    ``client_error`` (any other 4xx: a bad request, a bad key, a context window exceeded; not the
    precision's fault), else ``error``."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    code = getattr(exc, "status_code", None)
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
        return {429: "rate_limited", 408: "timeout"}.get(code, "client_error")
    name = f"{type(exc).__name__} {exc}".lower() if exc is not None else ""
    return "timeout" if "timeout" in name or "timed out" in name else "error"


def _content_chunks(chunk: Any) -> int:
    """Content pieces in one streamed chunk (one per token with vLLM), over all choices."""
    n = 0
    with contextlib.suppress(AttributeError, TypeError):
        for choice in chunk.choices:
            if getattr(choice.delta, "content", None):
                n += 1
    return n


def _seconds(t: Any) -> float | None:
    if isinstance(t, datetime):
        return t.timestamp()
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return float(t)
    return None


class WatchdogLogger(CustomLogger):
    def __init__(self, settings: LiteLLMSettings, flags: Any = None, events: Any = None) -> None:
        super().__init__()
        self.settings = settings
        if flags is None:
            from watchdog.actuation.routing import RoutingFlags
            from watchdog.core.keys import Keys

            flags = RoutingFlags(settings.redis_url, Keys(settings.redis_prefix),
                                 default_precision=settings.default_precision)
        self.flags = flags
        if events is None:
            events = EventEmitter(EventsConfig(bootstrap_servers=settings.bootstrap_servers, topic=settings.topic,
                                               buffer_size=settings.buffer_size), name="litellm").start()
        self.events = events
        self.route_header = settings.route_header.lower()
        self._variant_of = {name: (m, p) for m, v in settings.variants.items() for p, name in v.items()}
        #: litellm_call_id -> context, for calls whose metadata does not reach the logging hooks
        self._pending: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        #: call ids already logged as cancelled (a later hook for them is not a second event)
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self.hook_errors = 0
        #: route headers ignored: a route the request's key may not pick, or not a valid name
        self.ignored_route_headers = 0

    # -- routing --------------------------------------------------------------------------------

    def resolve_route(self, data: Mapping[str, Any], user_api_key_dict: Any) -> str:
        s = self.settings
        alias = next((a for a in (getattr(user_api_key_dict, "key_alias", None),
                                  getattr(user_api_key_dict, "team_alias", None)) if a and a in s.key_routes), None)
        own = s.key_routes[alias] if alias else None
        headers = (data.get("proxy_server_request") or {}).get("headers") or {}
        for k, v in headers.items():
            if k.lower() == self.route_header and v:
                try:
                    route = check_route(str(v))
                except ValueError:
                    route = None
                allowed = (route == own or route in s.key_allow_routes.get(alias, ())) if alias \
                    else route in s.routes
                if route is not None and allowed:
                    return route
                self.ignored_route_headers += 1
        if own is not None:
            return own
        return s.model_routes.get(str(data.get("model")), s.default_route)

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict[str, Any],
                                  call_type: Any) -> dict[str, Any]:
        try:
            self._route(data, user_api_key_dict)
        except Exception:  # noqa: BLE001 - a routing bug must not fail the request: serve it as asked
            self.hook_errors += 1
            log.exception("llm-watchdog pre-call hook failed; request left unchanged")
        return data

    def _route(self, data: dict[str, Any], user_api_key_dict: Any) -> None:
        model = data.get("model")
        variants = self.settings.variants.get(model) if isinstance(model, str) else None
        if not variants:
            return  # not a model we route
        route = self.resolve_route(data, user_api_key_dict)
        precision = self.flags.precision_for(model, route)
        if precision not in variants:
            precision = self.settings.baseline
            if precision not in variants:
                return
        data["model"] = variants[precision]
        ctx = {"model": model, "route": route, "precision": precision, "deployment": variants[precision],
               "call_id": str(data.get("litellm_call_id") or "")}
        metadata = data.get("metadata")
        if isinstance(metadata, dict):
            metadata["llmwd"] = ctx
        call_id = data.get("litellm_call_id")
        if call_id:
            with self._lock:
                self._pending[str(call_id)] = ctx
                while len(self._pending) > 10_000:  # calls that never reach a logging hook
                    self._pending.popitem(last=False)

    # -- logging --------------------------------------------------------------------------------

    def _context(self, kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        call_id = kwargs.get("litellm_call_id")
        if call_id:
            with self._lock:
                ctx = self._pending.pop(str(call_id), None)
            if ctx is not None:
                return ctx
        params = kwargs.get("litellm_params") or {}
        for md in (params.get("metadata"), kwargs.get("metadata")):
            if isinstance(md, Mapping) and isinstance(md.get("llmwd"), Mapping):
                return dict(md["llmwd"])
        # a call that did not pass the pre-call hook (the Router in-process): know the variant by name
        md = params.get("metadata")
        md = md if isinstance(md, Mapping) else {}
        name = (params.get("model_group") or kwargs.get("model_group") or md.get("model_group")
                or kwargs.get("model"))
        found = self._variant_of.get(str(name)) if name else None
        if found is None:
            return None
        return {"model": found[0], "route": self.settings.default_route, "precision": found[1],
                "deployment": str(name), "call_id": str(call_id or "")}

    def event(self, kwargs: Mapping[str, Any], start: Any, end: Any, status: str,
              response: Any = None) -> dict[str, Any] | None:
        """The event dict for one finished call (docs/EVENTS.md), or None for a model we do not route."""
        ctx = self._context(kwargs)
        if ctx is None:
            return None
        t0, t1 = _seconds(start), _seconds(end)
        latency = (t1 - t0) * 1000.0 if t0 is not None and t1 is not None else 0.0
        slo = kwargs.get("standard_logging_object") or {}
        ev: dict[str, Any] = {
            # the event id is the hook's own: LiteLLM takes its call id from the client's
            # x-litellm-call-id header when sent, and the daemon samples shadow pairs by a hash of
            # the event id (bottom-k): a client must not choose its way into or out of a sample
            "schema": 1, "request_id": uuid.uuid4().hex, "ts": t1 if t1 is not None else time.time(),
            "model": ctx["model"], "route": ctx["route"], "precision": ctx["precision"],
            "engine": f"litellm:{ctx['deployment']}", "status": status, "latency_ms": max(0.0, latency),
            "prompt_tokens": int(slo.get("prompt_tokens") or 0),
            "completion_tokens": int(slo.get("completion_tokens") or 0) if status == "ok" else 0,
        }
        if ctx.get("call_id"):
            ev["litellm_call_id"] = str(ctx["call_id"])[:MAX_CALL_ID]
        usage = getattr(response, "usage", None)
        if usage is not None and status == "ok":
            ev["prompt_tokens"] = int(getattr(usage, "prompt_tokens", 0) or 0)
            ev["completion_tokens"] = int(getattr(usage, "completion_tokens", 0) or 0)
        first = _seconds(kwargs.get("completion_start_time"))
        if first is not None and t0 is not None and kwargs.get("stream"):
            ev["ttft_ms"] = max(0.0, (first - t0) * 1000.0)
        if self.settings.log_completions and status == "ok":
            with contextlib.suppress(AttributeError, IndexError, TypeError):
                ev["completion"] = response.choices[0].message.content or ""
        return ev

    def _emit(self, kwargs: Any, start: Any, end: Any, status: str, response: Any = None) -> None:
        try:
            call_id = kwargs.get("litellm_call_id") if isinstance(kwargs, Mapping) else None
            if call_id and str(call_id) in self._cancelled:
                return  # logged already, as cancelled, when its stream was dropped
            ev = self.event(kwargs, start, end, status, response)
            if ev is not None:
                self.events.emit(ev)
        except Exception:  # noqa: BLE001 - logging must never fail or slow the request
            self.hook_errors += 1
            log.exception("llm-watchdog logging hook failed; event lost")

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        self._emit(kwargs, start_time, end_time, "ok", response_obj)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        status = failure_status(kwargs.get("exception") if isinstance(kwargs, Mapping) else None)
        self._emit(kwargs, start_time, end_time, status)

    async def async_post_call_streaming_iterator_hook(self, user_api_key_dict: Any, response: Any,
                                                      request_data: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """(Proxy) relay a streamed answer; a stream the client drops before its end (the proxy
        closes this generator) is logged at once as ``cancelled`` with the content chunks relayed so
        far, since LiteLLM calls neither logging hook for it. A stream that fails is left to the
        failure hook."""
        started, chunks, ended = time.time(), 0, False
        try:
            async for chunk in response:
                chunks += _content_chunks(chunk)
                yield chunk
            ended = True
        except Exception:
            ended = True  # a failure, not a hang-up: async_log_failure_event logs it
            raise
        finally:
            if not ended:
                self._log_cancelled(request_data, started, chunks)
                close = getattr(response, "aclose", None)
                if close is not None:  # let the upstream connection go: the engine stops generating
                    with contextlib.suppress(Exception):
                        await close()

    def _log_cancelled(self, data: Mapping[str, Any], started: float, chunks: int) -> None:
        try:
            call_id = data.get("litellm_call_id")
            ev = self.event(data, started, time.time(), "cancelled")
            if ev is None:
                return
            ev["completion_tokens"] = chunks
            if call_id:
                with self._lock:
                    self._cancelled[str(call_id)] = None
                    while len(self._cancelled) > 10_000:
                        self._cancelled.popitem(last=False)
            self.events.emit(ev)
        except Exception:  # noqa: BLE001 - logging must never fail the request
            self.hook_errors += 1
            log.exception("llm-watchdog stream hook failed; event lost")

    def close(self) -> None:
        self.events.close()
        close = getattr(self.flags, "close", None)
        if close is not None:
            close()


_handler: WatchdogLogger | None = None
_handler_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    """``handler``: the proxy's instance, built on first access from ``$LLMWD_LITELLM_CONFIG``."""
    global _handler
    if name != "handler":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _handler_lock:
        if _handler is None:
            path = os.environ.get(CONFIG_ENV)
            if not path:
                raise RuntimeError(f"set {CONFIG_ENV} to the llm-watchdog LiteLLM settings file")
            try:
                settings = LiteLLMSettings.from_file(path)
            except ConfigError as exc:  # one clear message in the proxy's log, not a traceback into ours
                raise RuntimeError(f"llm-watchdog LiteLLM settings (${CONFIG_ENV}): {exc}") from None
            _handler = WatchdogLogger(settings)
        return _handler
