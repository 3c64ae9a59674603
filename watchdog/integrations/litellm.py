"""A LiteLLM ``CustomLogger``: route each request to the FP8 or baseline deployment per the Redis
flag, and log every answer to Kafka as a watchdog event.

In a LiteLLM proxy config (docs/INTEGRATIONS.md)::

    litellm_settings:
      callbacks: my_watchdog.logger      # a module that builds one WatchdogLogger

``async_pre_call_hook`` (the proxy runs it before routing) rewrites ``data["model"]`` from the
client's model to the variant for the route's precision (``variants``), and records model, route
and precision in ``data["metadata"]["llmwd"]``. The route comes from the ``X-LLMWD-Route`` request
header, else the virtual key's alias (``key_routes``, key alias then team alias), else
``model_routes``, else ``default_route``. ``async_log_success_event`` / ``async_log_failure_event``
queue one event in the docs/EVENTS.md schema on a ``watchdog.gateway.emitter.EventEmitter``
(bounded, batched, never blocking LiteLLM).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

log = logging.getLogger(__name__)


def _seconds(t: Any) -> float | None:
    if isinstance(t, datetime):
        return t.timestamp()
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return float(t)
    return None


class WatchdogLogger(CustomLogger):
    def __init__(self, flags: Any, emitter: Any, variants: Mapping[str, Mapping[str, str]], *,
                 route_header: str = "x-llmwd-route", key_routes: Mapping[str, str] | None = None,
                 model_routes: Mapping[str, str] | None = None, default_route: str = "default",
                 candidate: str = "fp8", baseline: str = "fp16", log_completions: bool = False) -> None:
        super().__init__()
        self.flags = flags
        self.emitter = emitter
        #: client model -> {precision: model name in the proxy's model_list}
        self.variants = {m: dict(v) for m, v in variants.items()}
        self.route_header = route_header.lower()
        self.key_routes = dict(key_routes or {})
        self.model_routes = dict(model_routes or {})
        self.default_route = default_route
        self.candidate = candidate
        self.baseline = baseline
        self.log_completions = log_completions
        self._variant_of = {name: (m, p) for m, v in self.variants.items() for p, name in v.items()}

    # -- routing ---------------------------------------------------------------------------------

    def resolve_route(self, data: Mapping[str, Any], user_api_key_dict: Any) -> str:
        headers = (data.get("proxy_server_request") or {}).get("headers") or {}
        for k, v in headers.items():
            if k.lower() == self.route_header and v:
                return str(v)
        for alias in (getattr(user_api_key_dict, "key_alias", None), getattr(user_api_key_dict, "team_alias", None)):
            if alias and alias in self.key_routes:
                return self.key_routes[alias]
        return self.model_routes.get(str(data.get("model")), self.default_route)

    async def async_pre_call_hook(self, user_api_key_dict: Any, cache: Any, data: dict[str, Any],
                                  call_type: Any) -> dict[str, Any]:
        model = data.get("model")
        if not isinstance(model, str) or model not in self.variants:
            return data  # not a model we route: leave the request alone
        route = self.resolve_route(data, user_api_key_dict)
        flag = self.flags.precision_for(model, route)
        precision = flag if flag in self.variants[model] else self.baseline
        if precision not in self.variants[model]:
            return data
        data["model"] = self.variants[model][precision]
        metadata = data.setdefault("metadata", {})
        metadata["llmwd"] = {"model": model, "route": route, "precision": precision,
                             "request_id": metadata.get("llmwd", {}).get("request_id") or uuid.uuid4().hex}
        return data

    # -- logging ---------------------------------------------------------------------------------

    def _context(self, kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        params = kwargs.get("litellm_params") or {}
        for md in (params.get("metadata"), kwargs.get("metadata"),
                   ((kwargs.get("standard_logging_object") or {}).get("metadata") or {}).get("requester_metadata")):
            if isinstance(md, Mapping) and isinstance(md.get("llmwd"), Mapping):
                return dict(md["llmwd"])
        # a call that skipped the pre-call hook: recognise the variant by name
        name = kwargs.get("model_group") or params.get("model_group") or kwargs.get("model")
        found = self._variant_of.get(str(name)) if name else None
        if found is None:
            return None
        return {"model": found[0], "route": self.default_route, "precision": found[1],
                "request_id": uuid.uuid4().hex}

    def _event(self, kwargs: Mapping[str, Any], start: Any, end: Any, status: str,
               response: Any = None) -> dict[str, Any] | None:
        ctx = self._context(kwargs)
        if ctx is None:
            return None
        t0, t1 = _seconds(start), _seconds(end)
        slo = kwargs.get("standard_logging_object") or {}
        latency = (t1 - t0) * 1000 if t0 is not None and t1 is not None else float(slo.get("response_time") or 0) * 1000
        ev: dict[str, Any] = {"schema": 1, "request_id": str(ctx["request_id"]), "ts": t1 or time.time(),
                              "model": ctx["model"], "route": ctx["route"], "precision": ctx["precision"],
                              "engine": "litellm", "status": status, "latency_ms": max(0.0, latency),
                              "prompt_tokens": int(slo.get("prompt_tokens") or 0),
                              "completion_tokens": int(slo.get("completion_tokens") or 0) if status == "ok" else 0}
        first = _seconds(kwargs.get("completion_start_time"))
        if first is not None and t0 is not None and kwargs.get("stream"):
            ev["ttft_ms"] = max(0.0, (first - t0) * 1000)
        usage = getattr(response, "usage", None)
        if usage is not None and status == "ok":
            ev["prompt_tokens"] = int(getattr(usage, "prompt_tokens", 0) or 0)
            ev["completion_tokens"] = int(getattr(usage, "completion_tokens", 0) or 0)
        if self.log_completions and status == "ok":
            with contextlib.suppress(AttributeError, IndexError, TypeError):
                ev["completion"] = response.choices[0].message.content or ""
        return ev

    async def async_log_success_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        ev = self._event(kwargs, start_time, end_time, "ok", response_obj)
        if ev is not None:
            self.emitter.emit(ev)

    async def async_log_failure_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
        exc = kwargs.get("exception")
        timeout = "timeout" in type(exc).__name__.lower() if exc is not None else False
        ev = self._event(kwargs, start_time, end_time, "timeout" if timeout else "error")
        if ev is not None:
            self.emitter.emit(ev)
