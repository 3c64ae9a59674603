"""Wire the gateway together and serve it with uvicorn (in the foreground, or a thread for tests)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from watchdog.gateway.app import Gateway
from watchdog.gateway.config import GatewayConfig
from watchdog.ingest.emitter import EventEmitter

log = logging.getLogger(__name__)


def build_gateway(cfg: GatewayConfig, flags: Any = None, emitter: EventEmitter | None = None) -> Gateway:
    """A gateway with a ``RoutingFlags`` reader and an event emitter made from ``cfg`` unless given."""
    if flags is None:
        from watchdog.actuation.routing import RoutingFlags
        from watchdog.core.keys import Keys

        flags = RoutingFlags(cfg.redis_url, Keys(cfg.redis_prefix), default_precision=cfg.default_precision)
    if emitter is None and cfg.events.enabled:
        emitter = EventEmitter(cfg.events).start()
    return Gateway(cfg, flags, emitter)


def serve_metrics(app: Gateway) -> Any:
    """Start the separate ``/metrics`` listener (``gateway.metrics.port``) in a daemon thread; the
    server (``server_port``, ``shutdown()``), or None when metrics stay on the proxy port."""
    m = app.cfg.metrics
    if m.port is None:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(m.port, addr=m.host, registry=app.registry)
    log.info("gateway metrics on http://%s:%s/metrics", m.host, server.server_port)
    return server


def guarded_protocol(app: Gateway) -> type:
    """uvicorn's httptools protocol with the bounds uvicorn lacks on what a client holds open:

    * ``gateway.max_connections``: a connection past it is answered 503 ``gateway_overloaded`` and
      closed at once (uvicorn's ``limit_concurrency`` answers 503 to *requests* while idle sockets
      stay, so a few hundred idle sockets would refuse every real request);
    * ``gateway.header_timeout_s``: a connection that has not sent a whole request head that long
      after it opened, or after the first byte of its next request, is closed. uvicorn arms no timer
      before a first request, so an idle or trickling socket was held for good;
    * ``gateway.max_header_bytes``: a request head past it is answered 431 and the connection closed
      (httptools buffers an unfinished head without bound).

    An idle keep-alive connection between requests is uvicorn's own ``timeout_keep_alive`` (75 s)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from watchdog.gateway.openai_io import error_body

    limit, head_s, head_max = app.cfg.max_connections, app.cfg.header_timeout_s, app.cfg.max_header_bytes
    refused = _closing_answer(503, "Service Unavailable", error_body(
        503, f"the gateway holds its limit of {limit} connections; retry shortly", "server_error",
        "gateway_overloaded"), b"retry-after: 1\r\n")
    too_large = _closing_answer(431, "Request Header Fields Too Large", error_body(
        431, f"the request head is over {head_max} bytes", "invalid_request_error", "headers_too_large"))

    class GuardedProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        #: bytes received since the current request head began (None: not reading a head)
        _head_bytes: int | None = 0
        _refused = False
        #: between the first byte of a request head and its end
        _in_head = False

        def connection_made(self, transport: Any) -> None:
            app.connections += 1
            super().connection_made(transport)
            if app.connections > limit:
                app.connections_closed["limit"] += 1
                self._refuse(refused)
                return
            self._arm_head()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # read and dropped until the close: closing on unread data resets the answer away
            if self._head_bytes is not None:
                self._head_bytes += len(data)
            super().data_received(data)
            # still in the head after parsing this chunk: every byte of it was head (httptools buffers
            # an unfinished head without bound: 160 MB of headers were 160 MB of RSS)
            if self._head_over():
                if self.cycle is not None and not self.cycle.response_complete:
                    # an earlier request's answer is not written yet: the 431 goes after it (written
                    # now it was read as that answer, and the answer cut); nothing more read till then
                    self.flow.pause_reading()
                else:
                    self._refuse_head()

        def _head_over(self) -> bool:
            return self._head_bytes is not None and self._head_bytes > head_max and not self.transport.is_closing()

        def _refuse_head(self) -> None:
            app.connections_closed["headers_too_large"] += 1
            self._refuse(too_large)

        def _refuse(self, answer: bytes) -> None:
            """Answer and end the connection: our side shut at once, the socket closed after a
            second of dropping what the client still sends (a close with unread data sends a reset,
            which can discard the answer before the client reads it)."""
            self._refused = True
            self._disarm_head()
            self.transport.write(answer)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(1.0, self.transport.close)

        def on_message_complete(self) -> None:
            # what comes next is the next request's head: not at the end of the *response*, which can
            # come before the body is all in (an answer before the body is read: the rest of the
            # body was then counted as head, and a healthy connection refused 431 after its answer)
            self._head_bytes = 0
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            app.connections -= 1
            self._disarm_head()
            super().connection_lost(exc)

        def handle_websocket_upgrade(self) -> None:
            # the connection goes on under uvicorn's WebSocket protocol (the gateway answers it 403),
            # and its connection_lost is the one called at the end: it gives the count back (else
            # each WebSocket attempt leaked one, and max_connections of them refused every client)
            super().handle_websocket_upgrade()
            ws = self.transport.get_protocol()

            def connection_lost(exc: Exception | None, lost: Any = ws.connection_lost) -> None:
                app.connections -= 1
                lost(exc)

            ws.connection_lost = connection_lost  # type: ignore[method-assign]

        def on_message_begin(self) -> None:
            self._in_head = True
            # timed only while no earlier request is in flight or queued: behind one, uvicorn pauses
            # reading (pipelining), and the rest of this head waits in the socket for the server, not
            # the client (a stream longer than header_timeout_s was cut, with a reset, 1 s after a
            # pipelined request and part of the next head came in behind it). Armed then when that
            # answer is complete (on_response_complete).
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head()
            super().on_message_begin()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._head_over() and self.cycle.response_complete:
                self._refuse_head()
            elif self._in_head and self._head_timer is None and not self.transport.is_closing():
                self._arm_head()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm_head()
            self._head_bytes = None
            super().on_headers_complete()

        def _arm_head(self) -> None:
            self._head_timer = self.loop.call_later(head_s, self._head_late)

        def _disarm_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                app.connections_closed["header_timeout"] += 1
                self.transport.close()

    return GuardedProtocol


def _closing_answer(status: int, reason: str, body: bytes, extra: bytes = b"") -> bytes:
    """A whole HTTP/1.1 answer that ends the connection (written straight to the transport)."""
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n%sconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % (status, reason.encode(), extra, len(body))) + body


def raise_fd_limit(connections: int) -> str | None:
    """Raise this process's soft limit of open files towards ``connections`` + 1,024 (the hard limit
    caps it); a warning when even that leaves fewer descriptors than the connections need."""
    import resource

    need = connections + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        return (f"gateway.max_connections {connections} needs ~{need} open files, the limit here is {soft}: "
                f"past ~{max(0, soft - 1024)} connections new ones fail to be accepted (raise `ulimit -n` or "
                "lower gateway.max_connections)")
    return None


def uvicorn_config(app: Gateway, host: str, port: int) -> Any:
    import uvicorn

    loop = "uvloop"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        loop = "asyncio"
    return uvicorn.Config(app, host=host, port=port, loop=loop, http=guarded_protocol(app), lifespan="on",
                          access_log=False, log_level="warning", log_config=None, timeout_keep_alive=75,
                          backlog=4096)


class GatewayServer:
    """Runs ``app`` under uvicorn in a daemon thread; ``port`` is known once ``start`` returns."""

    def __init__(self, app: Gateway, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(uvicorn_config(app, host, port))
        self._thread: threading.Thread | None = None
        self.host = host
        self.metrics_server: Any = None

    @property
    def port(self) -> int:
        servers = getattr(self.server, "servers", [])
        for srv in servers:
            for sock in srv.sockets:
                return int(sock.getsockname()[1])
        return int(self.server.config.port)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 10.0) -> GatewayServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()),
                                        name="llmwd-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        self.metrics_server = serve_metrics(self.app)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
        if self.app.emitter is not None:
            self.app.emitter.close()
        close = getattr(self.app.flags, "close", None)
        if close is not None:
            close()
