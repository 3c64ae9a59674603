"""A user-space TCP proxy that delays what the server sends back (a slow network in front of a
real broker or Redis; the kernel here has no netem). ``delay_s`` may be changed while it runs;
``blackhole()`` holds everything either way (a peer that stops answering without refusing) until
``restore()``.

The delay is a delay line, as on a long link: each chunk the server sends is forwarded ``delay_s``
after it arrived, and chunks in flight overlap (a reply in three segments arrives ``delay_s`` late,
not three times that), so a round trip takes ``delay_s`` more, however the reply is segmented."""

from __future__ import annotations

import collections
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
        line: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()
        done = threading.Event()
        if delayed:
            threading.Thread(target=self._send_due, args=(line, ready, done, dst), daemon=True).start()
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if delayed:
                    with ready:
                        line.append((time.monotonic() + self.delay_s, data))
                        ready.notify()
                    continue
                if not self._hold():
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            done.set()
            with ready:
                ready.notify()
            self._close(src) if delayed else self._close(src, dst)

    def _send_due(self, line: collections.deque[tuple[float, bytes]], ready: threading.Condition,
                  done: threading.Event, dst: socket.socket) -> None:
        """Forward each chunk of ``line`` when it is due, in order; close both ends once the source
        closed and everything was sent."""
        try:
            while True:
                with ready:
                    while not line and not done.is_set():
                        ready.wait(0.1)
                    if not line:
                        return
                    due, data = line[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(min(wait, 0.05))
                    continue
                if not self._hold():
                    return
                with ready:
                    line.popleft()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.close()

    def _hold(self) -> bool:
        """Wait while blackholed; False once the proxy is closed."""
        while not self._open.wait(0.1):
            if self._stop.is_set():
                return False
        return True

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def blackhole(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._stop.set()
        self.server.close()
