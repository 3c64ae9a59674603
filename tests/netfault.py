"""A user-space TCP proxy that delays what the server sends back (a slow network in front of a
real broker or Redis; the kernel here has no netem). ``delay_s`` may be changed while it runs;
``blackhole()`` holds everything either way (a peer that stops answering without refusing) until
``restore()``."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class DelayProxy:
    def __init__(self, target_port: int, listen_port: int, delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.server = socket.create_server(("127.0.0.1", listen_port))
        self.port = self.server.getsockname()[1]
        self._stop = threading.Event()
        self._open = threading.Event()
        self._open.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if delayed and self.delay_s > 0:
                    time.sleep(self.delay_s)
                while not self._open.wait(0.1):
                    if self._stop.is_set():
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def blackhole(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._stop.set()
        self.server.close()
