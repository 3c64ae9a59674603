"""The daemon's HTTP server (watchdog/runtime/http.py): idle connections are closed, and a /status
read that meets the loop changing its dicts is read again instead of answering 500."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from watchdog.runtime import http


def test_idle_connections_are_closed_and_status_retries_a_concurrent_change(monkeypatch: Any) -> None:
    monkeypatch.setattr(http, "REQUEST_TIMEOUT_S", 0.5)
    calls: list[int] = []

    def status() -> dict[str, Any]:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("dictionary changed size during iteration")
        return {"ok": True}

    server = http.StatusServer("127.0.0.1", 0, CollectorRegistry(), status, lambda: []).start()
    try:
        r = httpx.get(f"{server.url}/status")
        assert r.status_code == 200 and r.json() == {"ok": True} and len(calls) == 3
        host, port = server.httpd.server_address[:2]
        idle = socket.create_connection((str(host), int(port)))
        idle.settimeout(5)
        t0 = time.monotonic()
        assert idle.recv(1) == b""  # the server closed the silent connection
        assert time.monotonic() - t0 < 3
        idle.close()
    finally:
        server.stop()
