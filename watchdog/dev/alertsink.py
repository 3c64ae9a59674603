"""A tiny local HTTP endpoint that records alert POSTs: the demo's "on-call" and the tests' receiver.

Binds 127.0.0.1 on a free port, keeps every POST (path, JSON body, status answered) in memory,
can print a one-line summary of each with rich, can be told to fail the next N requests, and can
answer slowly (``delay_s``: the POST is recorded, then answered that many seconds later, as a slow
receiver that did get the message).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from watchdog.core.httpserver import QuietHTTPServer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    body: Any
    status: int
    at: float
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def accepted(self) -> bool:
        return 200 <= self.status < 300


def summarize(path: str, body: Any) -> str:
    """One line saying what an alert POST was, whatever channel format it used."""
    if isinstance(body, list):  # Alertmanager
        parts = []
        for a in body:
            if isinstance(a, dict):
                state = "resolved" if a.get("endsAt") else "firing"
                labels = a.get("labels", {})
                parts.append(f"{state} {labels.get('severity', '?')} {a.get('annotations', {}).get('summary', '')}")
        return "alertmanager: " + " | ".join(parts)
    if not isinstance(body, dict):
        return f"{path}: (not JSON)"
    if "event_action" in body:  # PagerDuty
        payload = body.get("payload") or {}
        sev = payload.get("severity", "")
        return f"pagerduty {body['event_action']} {sev} {body.get('dedup_key', '')}: {payload.get('summary', '')}"
    if "attachments" in body or "blocks" in body:  # Slack
        return f"slack: {body.get('text', '')}"
    if "schema" in body:
        return f"webhook {body.get('status')} {body.get('severity')}: {body.get('summary', '')}"
    return f"{path}: {json.dumps(body)[:160]}"


class AlertSink:
    """``url = AlertSink().start()``; POST alerts to it; read ``.received``; ``.stop()``."""

    def __init__(self, *, echo: bool = False, status: int = 200, port: int = 0, delay_s: float = 0.0) -> None:
        self.echo = echo
        self.status = status
        self.port = port
        #: seconds between recording a POST and answering it
        self.delay_s = delay_s
        #: sent as ``Retry-After`` (seconds) with every answer that is not a success, when set
        self.retry_after: float | None = None
        self.received: list[Received] = []
        self._fail_next = 0
        self._fail_status = 500
        self._cond = threading.Condition()
        self._server: QuietHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> str:
        if self._server is not None:
            return self.url
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                status = sink._record(self.path, body, dict(self.headers))
                if sink.delay_s > 0:
                    time.sleep(sink.delay_s)
                reply = json.dumps({"status": "ok" if status < 300 else "error"}).encode()
                self.send_response(status)
                if status >= 300 and sink.retry_after is not None:
                    self.send_header("Retry-After", f"{sink.retry_after:g}")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base
                log.debug("alertsink: " + format, *args)

        self._server = QuietHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="alertsink", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = None
        self._thread = None

    def __enter__(self) -> AlertSink:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def fail_next(self, n: int, status: int = 500) -> None:
        """Answer the next ``n`` POSTs with ``status`` (default 500) instead of success."""
        with self._cond:
            self._fail_next = n
            self._fail_status = status

    @property
    def accepted(self) -> list[Received]:
        with self._cond:
            return [r for r in self.received if r.accepted]

    def clear(self) -> None:
        with self._cond:
            self.received.clear()

    def wait_for(self, n: int, timeout: float = 5.0, *, accepted: bool = True) -> list[Received]:
        """Wait until ``n`` POSTs were accepted (or received, with ``accepted=False``); return them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = [r for r in self.received if r.accepted or not accepted]
                if len(got) >= n:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"alertsink: wanted {n} {'accepted ' if accepted else ''}POSTs within {timeout}s, "
                        f"got {len(got)} (of {len(self.received)} received)"
                    )
                self._cond.wait(left)

    def _record(self, path: str, body: Any, headers: dict[str, str]) -> int:
        with self._cond:
            if self._fail_next > 0:
                self._fail_next -= 1
                status = self._fail_status
            else:
                status = self.status
            self.received.append(Received(path, body, status, time.time(), headers))
            self._cond.notify_all()
        if self.echo:
            self._print(path, body, status)
        return status

    def _print(self, path: str, body: Any, status: int) -> None:
        from rich.console import Console
        from rich.markup import escape

        style = "red" if status >= 300 else "bold magenta"
        Console(stderr=False, highlight=False).print(
            f"[{style}]on-call[/] [dim]{status}[/] {escape(summarize(path, body))}", soft_wrap=True
        )
