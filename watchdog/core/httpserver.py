"""The project's threaded HTTP server: a client that goes away mid-request is not an error.

``http.server`` prints a traceback for every exception a handler raises, including a client that
closed its connection (a keep-alive connection closed by its pool, a timed-out or killed client).
That is normal traffic for a status endpoint, an alert sink or a test upstream, not something to
report; every other error is still reported.
"""

from __future__ import annotations

import sys
from http.server import ThreadingHTTPServer
from typing import Any

__all__ = ["QuietHTTPServer"]


class QuietHTTPServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
            return
        super().handle_error(request, client_address)
