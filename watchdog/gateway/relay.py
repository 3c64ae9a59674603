"""One upstream exchange: send the request, relay the answer (or a 502/504) to the client, and
note what happened in an ``Exchange`` for the event; a client that hangs up cancels it.

Upstream ``Retry-After`` and ``x-ratelimit-*`` headers reach the client unchanged, on answers and
errors alike. A client disconnect (``http.disconnect`` on the ASGI ``receive``) cancels the
upstream request: the gateway closes its connection, which is how vLLM and most OpenAI servers
learn to abort the generation, and the event says ``cancelled`` with the tokens streamed so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from watchdog.gateway.config import UpstreamConfig
from watchdog.gateway.openai_io import Result, StreamParser, error_body, parse_response

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = (b"content-type", b"application/json")
SSE = (b"content-type", b"text/event-stream")
#: client headers forwarded upstream unchanged
PASS = frozenset({b"traceparent", b"tracestate", b"baggage", b"user-agent", b"accept"})
#: upstream headers relayed to the client unchanged (rate limits: the client's back-off needs them)
RELAYED_PREFIX = "x-ratelimit-"
RELAYED = frozenset({"retry-after", "retry-after-ms"})


@dataclass(slots=True)
class Exchange:
    """What one proxied request produced, filled in while its answer is relayed."""

    status: str = ""
    http_status: int = 0
    ttft: float | None = None
    result: Result = field(default_factory=Result)
    #: the whole answer was handed to the server (a disconnect after this is the normal end)
    answered: bool = False
    #: perf_counter time the client's disconnect was seen, and ms from then to the upstream closed
    disconnected_at: float | None = None
    cancel_ms: float | None = None
    parser: StreamParser | None = None


def relayed_headers(resp: aiohttp.ClientResponse) -> Headers:
    """The upstream's ``Retry-After`` / ``x-ratelimit-*`` headers, to hand to the client."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()
            if k.lower() in RELAYED or k.lower().startswith(RELAYED_PREFIX)]


def forward_headers(headers: dict[bytes, bytes], request_id: str, upstream: UpstreamConfig) -> dict[str, str]:
    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items() if k in PASS}
    out["content-type"] = "application/json"
    out["x-request-id"] = request_id
    key = upstream.api_key()
    if key:
        out["authorization"] = f"Bearer {key}"
    return out


async def reply(send: Send, status: int, body: bytes, *headers: tuple[bytes, bytes]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers or (JSON,))})
    await send({"type": "http.response.body", "body": body})


async def until_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body was read already)."""
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            return


async def run_cancellable(x: Exchange, receive: Receive, work: Awaitable[None]) -> None:
    """Run ``work`` (the forward); a client disconnect before the answer is complete cancels it and
    marks ``x`` cancelled, with the time the cancel took."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() or x.answered:
            await task
            return
        x.disconnected_at = time.perf_counter()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        x.cancel_ms = (time.perf_counter() - x.disconnected_at) * 1000
        x.status = "cancelled"
        if x.parser is not None:  # what was streamed before the client went
            x.result = x.parser.finish()
    finally:
        watcher.cancel()
        if not task.done():  # cancelled from outside (server shutdown)
            task.cancel()


async def forward(client: aiohttp.ClientSession, x: Exchange, kind: str, send: Send, body: dict[str, Any],
                  upstream: UpstreamConfig, headers: dict[bytes, bytes], request_id: str, route: str,
                  precision: str, out_headers: Headers, started: float) -> None:
    """Send the request to ``upstream`` and relay its answer (or a 502/504) to the client,
    filling in ``x`` as it goes."""
    fwd = forward_headers(headers, request_id, upstream)
    up_body = body if upstream.model is None else {**body, "model": upstream.model}
    url = f"{upstream.url}/{'chat/completions' if kind == 'chat' else 'completions'}"
    stream = bool(body.get("stream"))
    # a stream may run long: its limit is the gap between two reads, not the whole answer
    timeout = aiohttp.ClientTimeout(total=None if stream else upstream.timeout_s,
                                    sock_connect=upstream.connect_timeout_s,
                                    sock_read=upstream.timeout_s if stream else None)
    try:
        async with client.post(url, data=orjson.dumps(up_body), headers=fwd, timeout=timeout) as resp:
            x.http_status = resp.status
            out = [*out_headers, *relayed_headers(resp)]
            try:
                if x.http_status != 200:
                    x.status = await relay_error(send, x.http_status, await resp.read(), out, precision)
                elif not stream:
                    content = await resp.read()
                    x.answered = True
                    await reply(send, 200, content, JSON, *out)
                    x.status = "ok"
                    x.result = parse_response(kind, content)
                else:
                    await relay_stream(x, kind, send, resp, precision, out, started)
            except asyncio.CancelledError:
                resp.close()  # the client went: drop the upstream connection, the engine aborts
                raise
    except TimeoutError:
        x.status = "timeout"
        await reply(send, 504, error_body(504, f"the {precision} upstream timed out", "timeout"), JSON, *out_headers)
    except aiohttp.ClientError as exc:
        x.status = "error"
        log.warning("upstream %s (%s) failed: %s", precision, route, type(exc).__name__)
        await reply(send, 502, error_body(502, f"the {precision} upstream is unreachable", "upstream_error"),
                    JSON, *out_headers)


async def relay_error(send: Send, http_status: int, content: bytes, out_headers: Headers, precision: str) -> str:
    """Upstream 5xx → a clean 502 (``error``); 408 relayed as ``error``; 429 relayed as
    ``rate_limited`` (with its Retry-After); other 4xx relayed as the client's own mistake
    (``client_error``). Only ``error`` counts against the precision."""
    if http_status >= 500:
        await reply(send, 502, error_body(502, f"the {precision} upstream returned HTTP {http_status}",
                                          "upstream_error"), JSON, *out_headers)
        return "error"
    await reply(send, http_status, content, JSON, *out_headers)
    if http_status == 429:
        return "rate_limited"
    return "error" if http_status == 408 else "client_error"


async def relay_stream(x: Exchange, kind: str, send: Send, resp: aiohttp.ClientResponse, precision: str,
                       out_headers: Headers, started: float) -> None:
    """Relay an SSE answer chunk by chunk; a failure mid-stream ends it with an error event."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [SSE, (b"cache-control", b"no-cache"), *out_headers]})
    parser = x.parser = StreamParser(kind)
    x.status = "ok"
    try:
        async for chunk in resp.content.iter_any():
            if x.ttft is None:
                x.ttft = (time.perf_counter() - started) * 1000
            parser.feed(chunk)
            # a client closes once it has read [DONE] (the openai client does), maybe before the upstream
            # ends its response: that close is the normal end, not a cancel
            x.answered = x.answered or parser.done
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except (TimeoutError, aiohttp.ClientError) as exc:
        if not parser.done:  # after [DONE] the answer is whole: only the response's end was late or cut
            x.status = "timeout" if isinstance(exc, TimeoutError) else "error"
            await send({"type": "http.response.body", "more_body": True, "body": b"data: "
                        + error_body(504 if x.status == "timeout" else 502,
                                     f"the {precision} upstream failed mid-stream", x.status) + b"\n\n"})
    x.answered = True
    await send({"type": "http.response.body", "body": b""})
    x.result = parser.finish()
    if parser.error:
        x.status = "error"
