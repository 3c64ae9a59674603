"""The project's HTTP servers (status endpoint, alert sink, test upstreams) print nothing when a
client resets its connection mid-request; ``http.server`` alone prints a traceback."""

from __future__ import annotations

import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from watchdog.core.httpserver import QuietHTTPServer


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # never reached: the client resets before its headers end
        self.send_response(204)
        self.end_headers()


def _reset_mid_request(server_cls: type[ThreadingHTTPServer]) -> None:
    httpd = server_cls(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        for _ in range(3):
            s = socket.create_connection(httpd.server_address[:2])
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the handler now waits for the rest
            time.sleep(0.2)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # RST
        time.sleep(0.5)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("server_cls, quiet", [(QuietHTTPServer, True), (ThreadingHTTPServer, False)])
def test_a_client_reset_prints_no_traceback(server_cls: type[ThreadingHTTPServer], quiet: bool,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    _reset_mid_request(server_cls)
    err = capfd.readouterr().err
    assert ("Traceback" not in err) is quiet, err
