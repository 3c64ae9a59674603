"""HTTP surface: /metrics (Prometheus), /livez (the loop is alive), /healthz (same, kept for
compatibility), /readyz (connected and current: 503 with the named reasons otherwise), /status (JSON),
and the pages passed in as ``pages`` (the daemon's /evidence pages, runtime/evidence_http.py)."""

from __future__ import annotations

import inspect
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from watchdog.core.httpserver import QuietHTTPServer

log = logging.getLogger(__name__)


class BadQuery(ValueError):
    """A /status query the document cannot answer: 400 (``code`` 404 for a route nobody knows)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code

#: seconds an HTTP connection may stay idle or slow before it is closed
REQUEST_TIMEOUT_S = 10.0
#: reads of the /status document before a concurrent change is reported as an error
STATUS_ATTEMPTS = 5

#: the /status document; it may take the query (``?route=...&top=...``) as a mapping
StatusFn = Callable[..., dict[str, Any]]
ReadyFn = Callable[[], list[str]]
#: more read-only pages (the evidence pages, runtime/evidence_http.py): (path, query) -> (status,
#: body, content type), or None for a path they do not serve
PagesFn = Callable[[str, dict[str, str]], "tuple[int, bytes, str] | None"]


class StatusServer:
    """Serves the daemon's health in a background thread.

    ``ready`` returns the list of problems (empty = ready); ``alive`` returns False when the
    main loop has stalled.
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry, status: StatusFn,
                 ready: ReadyFn, alive: Callable[[], bool] = lambda: True, pages: PagesFn | None = None) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            #: seconds a connection may sit idle or send slowly (idle connections pile up threads)
            timeout = REQUEST_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 - stdlib name
                path, _, qs = self.path.partition("?")
                try:
                    if path == "/metrics":
                        self._send(200, generate_latest(outer.registry), CONTENT_TYPE_LATEST)
                    elif path in ("/livez", "/healthz"):
                        ok = outer.alive()
                        self._json(200 if ok else 503, {"status": "ok" if ok else "stalled"})
                    elif path == "/readyz":
                        problems = outer.ready()
                        self._json(503 if problems else 200,
                                   {"ready": not problems, "problems": problems})
                    elif path == "/status":
                        query = dict(parse_qsl(qs[:2000]))
                        try:
                            self._json(200, outer.status_document(query))
                        except BadQuery as exc:
                            self._json(exc.code, {"error": str(exc)})
                    elif outer.pages is not None and (page := outer.pages(path, dict(parse_qsl(qs[:2000])))):
                        self._send(*page)
                    else:
                        self._json(404, {"error": f"no such path {path}"})
                except Exception as exc:  # noqa: BLE001 - a broken status must not kill the server
                    log.exception("error serving %s", path)
                    self._json(500, {"error": str(exc)})

            def _json(self, code: int, body: dict[str, Any]) -> None:
                self._send(code, json.dumps(body, default=str, indent=1).encode(), "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http: " + fmt, *args)

        self.registry = registry
        self.status = status
        #: True when ``status`` takes the query mapping
        self.takes_query = bool(inspect.signature(status).parameters)
        self.ready = ready
        self.alive = alive
        self.pages = pages
        self.httpd = QuietHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="llmwd-http", daemon=True)

    def status_document(self, query: dict[str, str]) -> dict[str, Any]:
        """The /status document. It is read from this thread while the loop changes its dicts: a
        read that met a change ("dictionary changed size during iteration") is read again."""
        for attempt in range(STATUS_ATTEMPTS):
            try:
                return self.status(query) if self.takes_query else self.status()
            except RuntimeError as exc:
                if "during iteration" not in str(exc) or attempt == STATUS_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
