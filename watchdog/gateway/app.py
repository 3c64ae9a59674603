"""The gateway's ASGI application: OpenAI endpoints in front of per-route FP8/baseline upstreams.

Per request: resolve the route, read the precision from the cached Redis flags (no I/O), forward
to that pool's upstream with aiohttp's client, relay the answer (streamed chunk by chunk for SSE), then queue
one event for Kafka. Sampled requests are mirrored to the other precision after the answer went
out; their event leaves when the shadow answer is in (or its timeout passed). Nothing that happens
to events or shadows reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from watchdog.core.events import name_problem
from watchdog.gateway.access import Access, Refusal
from watchdog.gateway.config import MAX_BODY, GatewayConfig, PoolConfig, UpstreamConfig
from watchdog.gateway.openai_io import Result, error_body, estimate_prompt_tokens, parse_response, prompt_of
from watchdog.gateway.relay import JSON, Exchange, forward, forward_headers, reply, run_cancellable
from watchdog.ingest.emitter import EventEmitter

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
#: OpenAI endpoints answered 404 with a clear error code (``<name>_not_proxied``)
_REFUSED_ENDPOINTS = {"/v1/embeddings": "embeddings", "/embeddings": "embeddings"}
_JSON = JSON
#: the trace id of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``), the only part put into events
_TRACE_ID = re.compile(rb"[0-9a-f]{32}")
#: the client's X-Request-ID is kept in events (``client_request_id``) up to this many characters
MAX_CLIENT_ID = 128
MAX_SHADOWS_IN_FLIGHT = 64
#: seconds a request body may take to arrive: a request holds an in-flight slot while it is read, so
#: a client that sends its body slowly (or never finishes it) must not keep it
BODY_TIMEOUT_S = 30.0


class BodyBudget:
    """Bytes of request bodies the gateway holds at once (``gateway.max_body_bytes_in_flight``): a
    request's body counts from its first chunk until the request ends, or until its shadow request
    ends when one mirrors it. ``max_in_flight`` alone bounds memory only at its count times
    ``MAX_BODY`` (~4 GiB at the defaults, with the parsed copy twice that)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def hold(self) -> BodyHold:
        return BodyHold(self)


class _OverBudget(Exception):
    """The bodies held would pass ``max_body_bytes_in_flight`` (``_read_body``)."""


class BodyHold:
    """One request's share of a ``BodyBudget``; ``release`` is idempotent."""

    __slots__ = ("budget", "held", "kept")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0
        #: a shadow task took the body over: it releases the hold when it ends
        self.kept = False

    def take(self, n: int) -> bool:
        """Count ``n`` more bytes of this request's body; False (nothing taken) past the budget."""
        b = self.budget
        if b.used + n > b.limit:
            return False
        b.used += n
        self.held += n
        return True

    def release(self) -> None:
        self.budget.used -= self.held
        self.held = 0


class _Collector:
    """Emitter and flag-reader state, read at scrape time (no work on the request path)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def collect(self) -> Any:
        em, flags = self.gw.emitter, self.gw.flags
        for name, doc, value in (
            ("llmwd_gateway_events_accepted", "Events queued for Kafka", em.accepted if em else 0),
            ("llmwd_gateway_events_sent", "Events acknowledged by Kafka", em.sent if em else 0),
            ("llmwd_gateway_events_dropped", "Events dropped: the buffer was full", em.dropped if em else 0),
            ("llmwd_gateway_events_lost", "Events the producer gave up on: not delivered within "
             "events.delivery_timeout_s, or refused by its queue", em.lost if em else 0),
            ("llmwd_gateway_events_errors", "Producer errors (connect, send, delivery), events or not",
             em.errors if em else 0),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
        g = GaugeMetricFamily("llmwd_gateway_events_queued", "Events waiting in the buffer")
        g.add_metric([], em.queued if em else 0)
        yield g
        g = GaugeMetricFamily("llmwd_gateway_in_flight", "Chat/completions requests being served now")
        g.add_metric([], self.gw.in_flight)
        yield g
        g = GaugeMetricFamily("llmwd_gateway_in_flight_limit", "gateway.max_in_flight: more are answered 503")
        g.add_metric([], self.gw.cfg.max_in_flight)
        yield g
        g = GaugeMetricFamily("llmwd_gateway_connections", "TCP connections open now")
        g.add_metric([], self.gw.connections)
        yield g
        g = GaugeMetricFamily("llmwd_gateway_connections_limit", "gateway.max_connections: more are answered 503")
        g.add_metric([], self.gw.cfg.max_connections)
        yield g
        c = CounterMetricFamily("llmwd_gateway_connections_closed", "Connections the gateway closed before a "
                                "request: over max_connections (limit), no request head within "
                                "header_timeout_s (header_timeout) or a head over max_header_bytes (headers_too_large)", labels=["reason"])
        for reason, n in self.gw.connections_closed.items():
            c.add_metric([reason], n)
        yield c
        g = GaugeMetricFamily("llmwd_gateway_body_bytes_in_flight", "Bytes of request bodies held now")
        g.add_metric([], self.gw.bodies.used)
        yield g
        g = GaugeMetricFamily("llmwd_gateway_body_bytes_in_flight_limit",
                              "gateway.max_body_bytes_in_flight: a body past it is answered 503")
        g.add_metric([], self.gw.bodies.limit)
        yield g
        g = GaugeMetricFamily("llmwd_gateway_redis_up", "1 while the flag reader is connected to Redis")
        g.add_metric([], 1 if flags is not None and flags.healthy else 0)
        yield g


class Gateway:
    """The ASGI app. ``flags`` needs ``precision_for(model, route)``; ``emitter`` may be None."""

    def __init__(self, cfg: GatewayConfig, flags: Any, emitter: EventEmitter | None,
                 registry: CollectorRegistry | None = None, seed: int | None = None) -> None:
        self.cfg = cfg
        self.flags = flags
        self.emitter = emitter
        self.rng = random.Random(seed)
        # aiohttp, not httpx: at 64 concurrent requests httpx's pool managed ~190 req/s on this
        # machine and aiohttp ~3,700 (bench/gateway.py, docs/BENCHMARKS.md)
        self.client: aiohttp.ClientSession | None = None
        self._shadows: set[asyncio.Task[None]] = set()
        #: requests between the in-flight check and their end (``gateway.max_in_flight``)
        self.in_flight = 0
        self.bodies = BodyBudget(cfg.max_body_bytes_in_flight)
        #: TCP connections open now, and those closed by ``gateway.max_connections`` / ``header_timeout_s``
        #: (kept by ``server.guarded_protocol``)
        self.connections = 0
        self.connections_closed = {"limit": 0, "header_timeout": 0, "headers_too_large": 0}
        self._route_header = cfg.route_header.lower().encode()
        self._precision_header = cfg.precision_header.lower().encode()
        self.access = Access(cfg)
        self.registry = registry or CollectorRegistry()
        # the route label holds configured routes only (Access.label: anything else is "other")
        self.requests = Counter("llmwd_gateway_requests_total", "Proxied requests by route, precision, status",
                                ["route", "precision", "status"], registry=self.registry)
        self.refused = Counter("llmwd_gateway_refused_total",
                               "Requests refused before any upstream call, by error code", ["code"],
                               registry=self.registry)
        self.shadows = Counter("llmwd_gateway_shadows_total", "Shadow requests by result", ["result"],
                               registry=self.registry)
        self.registry.register(_Collector(self))

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        kind = _ENDPOINTS.get(path)
        if kind is not None and method == "POST":
            await self._proxy_bounded(kind, scope, receive, send)
        elif path in _REFUSED_ENDPOINTS:
            # refused, not proxied: no precision flag or event applies to them (docs/INTEGRATIONS.md)
            await self._refuse(send, Refusal(404, f"{_REFUSED_ENDPOINTS[path]}_not_proxied",
                                             f"llm-watchdog-gateway does not proxy {_REFUSED_ENDPOINTS[path]}: "
                                             "send them to the serving engine directly"), b"")
        elif method == "GET" and path in ("/v1/models", "/models"):
            who = self.access.authenticate(dict(scope["headers"]).get(b"authorization"))
            if isinstance(who, Refusal):
                await self._refuse(send, who, b"")
                return
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "llm-watchdog-gateway"}
                    for m in self.cfg.models()]
            await self._reply(send, 200, orjson.dumps({"object": "list", "data": data}))
        elif method == "GET" and path == "/healthz":
            await self._reply(send, 200, orjson.dumps({"ok": True, "redis": bool(getattr(self.flags, "healthy", False))}))
        elif method == "GET" and path == "/metrics" and self.cfg.metrics.port is None:
            if not self.access.may_read_metrics(dict(scope["headers"]).get(b"authorization")):
                await self._refuse(send, Refusal(401, "invalid_api_key", "/metrics needs a key of auth.metrics_keys"),
                                   b"")
                return
            await self._reply(send, 200, generate_latest(self.registry), (b"content-type", b"text/plain; version=0.0.4"))
        else:
            await self._reply(send, 404, error_body(404, f"no route {method} {path}", "not_found"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=60)
        self.client = aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))

    async def shutdown(self) -> None:
        for task in list(self._shadows):
            task.cancel()
        if self.client is not None:
            await self.client.close()

    async def _refuse(self, send: Send, refusal: Refusal, request_id: bytes) -> None:
        self.refused.labels(refusal.code).inc()
        headers = [_JSON, (b"x-request-id", request_id)] if request_id else [_JSON]
        if refusal.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="llm-watchdog-gateway"'))
        elif refusal.status == 503:  # the openai clients retry a 503 after Retry-After
            headers.append((b"retry-after", b"1"))
        await self._reply(send, refusal.status, error_body(refusal.status, refusal.message, refusal.kind,
                                                           refusal.code), *headers)

    _reply = staticmethod(reply)

    async def _proxy_bounded(self, kind: str, scope: Scope, receive: Receive, send: Send) -> None:
        """``_proxy`` within ``max_in_flight``; beyond it a 503 before the body is read, so a burst
        holds neither buffers nor upstream connections (and no event: no precision served it)."""
        limit = self.cfg.max_in_flight
        if self.in_flight >= limit:
            request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()
            await self._refuse(send, Refusal(503, "gateway_overloaded",
                                             f"the gateway is serving its limit of {limit} requests; retry shortly"),
                               request_id)
            return
        self.in_flight += 1
        hold = self.bodies.hold()
        try:
            await self._proxy(kind, scope, receive, send, hold)
        finally:
            self.in_flight -= 1
            if not hold.kept:
                hold.release()

    # -- routing ------------------------------------------------------------------------------

    def resolve_route(self, headers: dict[bytes, bytes], model: str) -> str | Refusal:
        """The request's route, or why it is refused (``watchdog.gateway.access``)."""
        who = self.access.authenticate(headers.get(b"authorization"))
        if isinstance(who, Refusal):
            return who
        return self.access.route(who, headers.get(self._route_header), model)

    # -- proxying -----------------------------------------------------------------------------

    async def _proxy(self, kind: str, scope: Scope, receive: Receive, send: Send, hold: BodyHold) -> None:
        started = time.perf_counter()
        headers = dict(scope["headers"])
        # the event's id is the gateway's own, never the client's: the daemon samples shadow pairs
        # by a hash of it (bottom-k), and a client must not choose its way into or out of a sample
        event_id = uuid.uuid4().hex
        client_id = (headers.get(b"x-request-id") or b"").decode("utf-8", "replace")
        request_id = client_id or event_id  # what the client and the upstream see
        who = self.access.authenticate(headers.get(b"authorization"))
        if isinstance(who, Refusal):
            await self._refuse(send, who, request_id.encode())
            return
        request = await self._request(receive, send, headers, request_id, who, hold)
        if request is None:
            return
        body, model, route, pool = request
        on_candidate = self.flags.precision_for(model, route) == pool.candidate_precision
        if on_candidate and pool.baseline_share and self.rng.random() < pool.baseline_share:
            on_candidate = False
        upstream = pool.candidate if on_candidate else pool.baseline
        precision = pool.candidate_precision if on_candidate else pool.baseline_precision
        out_headers = [(b"x-request-id", request_id.encode()), (self._precision_header, precision.encode()),
                       (b"x-llmwd-route", route.encode())]
        x = Exchange()
        assert self.client is not None, "startup() was not run"
        await run_cancellable(x, receive, forward(self.client, x, kind, send, body, upstream, headers, request_id,
                                                  route, precision, out_headers, started))
        status = x.status
        latency_ms = (time.perf_counter() - started) * 1000
        self.requests.labels(self.access.label(route), precision, status).inc()
        if self.emitter is None:
            return
        event = self._event(kind, body, pool, upstream, event_id, model, route, precision, status,
                            latency_ms, x.ttft, x.result, headers, x.http_status)
        if x.cancel_ms is not None:
            event["cancel_ms"] = round(x.cancel_ms, 3)
        if client_id:
            event["client_request_id"] = client_id[:MAX_CLIENT_ID]
        if status == "ok" and pool.shadow_sample and self.rng.random() < pool.shadow_sample:
            if len(self._shadows) < MAX_SHADOWS_IN_FLIGHT:
                hold.kept = True
                task = asyncio.get_running_loop().create_task(
                    self._shadow(kind, body, pool, not on_candidate, request_id, event, hold))
                self._shadows.add(task)
                task.add_done_callback(self._shadows.discard)
                return
            self.shadows.labels("skipped").inc()
        self.emitter.emit(event)

    async def _request(self, receive: Receive, send: Send, headers: dict[bytes, bytes], request_id: str,
                       who: Any, hold: BodyHold) -> tuple[dict[str, Any], str, str, PoolConfig] | None:
        """(body, model, route, pool) of a request from client ``who`` (None: anonymous); None when
        it was answered already with 408 (body not in within ``BODY_TIMEOUT_S``), 413 (body too
        large), 503 (the bodies held would pass ``max_body_bytes_in_flight``), 400 (no JSON object with
        a valid model name), the route refusal (``watchdog.gateway.access``) or 404 (model not served here)."""
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                raw = await _read_body(receive, hold, _content_length(headers))
        except _OverBudget:
            await self._refuse(send, Refusal(503, "gateway_overloaded", "the gateway holds its limit of "
                                             f"{self.bodies.limit} bytes of request bodies; retry shortly"),
                               request_id.encode())
            return None
        except TimeoutError:
            await self._refuse(send, Refusal(408, "body_timeout", f"the request body did not arrive within "
                                                                  f"{BODY_TIMEOUT_S:g} s"), request_id.encode())
            return None
        if raw is None:
            await self._reply(send, 413, error_body(413, f"request body over {MAX_BODY} bytes", "invalid_request_error"),
                              _JSON, (b"x-request-id", request_id.encode()))
            return None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            await self._reply(send, 400, error_body(400, "body must be a JSON object with a 'model'",
                                                    "invalid_request_error"), _JSON, (b"x-request-id", request_id.encode()))
            return None
        assert isinstance(body, dict)
        why = name_problem(model)
        if why:
            await self._refuse(send, Refusal(400, "invalid_model", f"model name {model[:80]!r} {why}"),
                               request_id.encode())
            return None
        route = self.access.route(who, headers.get(self._route_header), model)
        if isinstance(route, Refusal):
            await self._refuse(send, route, request_id.encode())
            return None
        pool = self.cfg.pool_for(model, route)
        if pool is None:
            await self._reply(send, 404, error_body(404, f"model {model!r} is not served here", "model_not_found"),
                              _JSON, (b"x-request-id", request_id.encode()))
            return None
        return body, pool.flag_model(model), route, pool

    def _event(self, kind: str, body: dict[str, Any], pool: PoolConfig, upstream: UpstreamConfig,
               request_id: str, model: str, route: str, precision: str, status: str, latency_ms: float,
               ttft: float | None, result: Result, headers: dict[bytes, bytes], http_status: int) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "schema": 1, "request_id": request_id, "ts": time.time(), "model": model, "route": route,
            "precision": precision, "engine": self.cfg.engine or upstream.model or model, "status": status,
            "latency_ms": round(latency_ms, 3), "prompt_tokens": result.prompt_tokens,
            # a stream cut short (cancelled, timed out, failed mid-stream): the tokens relayed before
            # it ended; an answer that was not relayed has an empty result, so 0
            "completion_tokens": result.completion_tokens,
        }
        if not result.usage_seen:
            ev["prompt_tokens"] = estimate_prompt_tokens(kind, body)
            ev["prompt_tokens_estimated"] = True
        if len(result.choices) > 1 and status == "ok":
            # n > 1: one event for the request, choice 0 as `completion`, the others alongside
            ev["choices"] = len(result.choices)
            if pool.log_completions:
                ev["other_completions"] = result.choices[1:]
        if ttft is not None:
            ev["ttft_ms"] = round(ttft, 3)
        if pool.log_prompts:
            prompt = prompt_of(kind, body)
            if prompt is not None:
                ev["prompt"] = prompt
        if pool.log_completions and status == "ok":
            ev["completion"] = result.completion
        if pool.log_logprobs and status == "ok" and result.logprobs:
            ev["completion_logprobs"] = result.logprobs
        trace = headers.get(b"traceparent")
        if trace:
            parts = trace.split(b"-")
            # a W3C trace id is 32 lower-case hex digits; anything else a client wrote is not put into the event
            if len(parts) >= 3 and _TRACE_ID.fullmatch(parts[1]):
                ev["trace_id"] = parts[1].decode("ascii")
        if http_status and http_status != 200:
            ev["http_status"] = http_status
        return ev

    async def _shadow(self, kind: str, body: dict[str, Any], pool: PoolConfig, to_candidate: bool,
                      request_id: str, event: dict[str, Any], hold: BodyHold) -> None:
        """Mirror to the other precision (never streamed), attach ``shadow``, then emit."""
        upstream = pool.candidate if to_candidate else pool.baseline
        precision = pool.candidate_precision if to_candidate else pool.baseline_precision
        sbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        if upstream.model is not None:
            sbody["model"] = upstream.model
        if pool.log_logprobs and kind == "chat":
            sbody["logprobs"] = True
        elif pool.log_logprobs and sbody.get("logprobs") is None:
            sbody["logprobs"] = 1
        url = f"{upstream.url}/{'chat/completions' if kind == 'chat' else 'completions'}"
        t0 = time.perf_counter()
        try:
            assert self.client is not None
            timeout = aiohttp.ClientTimeout(total=pool.shadow_timeout_s, sock_connect=upstream.connect_timeout_s)
            async with self.client.post(url, data=orjson.dumps(sbody), timeout=timeout,
                                        headers=forward_headers({}, f"{request_id}-shadow", upstream)) as resp:
                content = await resp.read()
                ok = resp.status == 200
            if ok:
                res = parse_response(kind, content)
                shadow: dict[str, Any] = {"precision": precision,
                                          "latency_ms": round((time.perf_counter() - t0) * 1000, 3)}
                if pool.log_completions:
                    shadow["completion"] = res.completion
                if pool.log_logprobs and res.logprobs:
                    shadow["completion_logprobs"] = res.logprobs
                event["shadow"] = shadow
                self.shadows.labels("ok").inc()
            else:
                self.shadows.labels("error").inc()
        except (TimeoutError, aiohttp.ClientError):
            self.shadows.labels("error").inc()
        except asyncio.CancelledError:
            self.shadows.labels("cancelled").inc()
            raise
        finally:
            hold.release()
            if self.emitter is not None:
                self.emitter.emit(event)


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(b"content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


async def _read_body(receive: Receive, hold: BodyHold, declared: int | None) -> bytes | None:
    """The request body; None past ``MAX_BODY``. Raises ``_OverBudget`` when the bodies held would
    pass the budget - judged on the declared length before anything is read."""
    if declared is not None:
        if declared > MAX_BODY:
            return None
        if not hold.take(declared):
            raise _OverBudget
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            return None
        if size > hold.held and not hold.take(size - hold.held):
            raise _OverBudget
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)

