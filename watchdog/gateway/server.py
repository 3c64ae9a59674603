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


def uvicorn_config(app: Gateway, host: str, port: int) -> Any:
    import uvicorn

    loop = "uvloop"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        loop = "asyncio"
    return uvicorn.Config(app, host=host, port=port, loop=loop, http="httptools", lifespan="on",
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
