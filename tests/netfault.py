"""User-space TCP proxies for network faults (the kernel here has no netem).

``DelayProxy`` delays what the server sends back (a slow network in front of a real broker or
Redis). ``delay_s`` may be changed while it runs;
``blackhole()`` holds everything either way (a peer that stops answering without refusing) until
``restore()``.

The delay is a delay line, as on a long link: each chunk the server sends is forwarded ``delay_s``
after it arrived, and chunks in flight overlap (a reply in three segments arrives ``delay_s`` late,
not three times that), so a round trip takes ``delay_s`` more, however the reply is segmented.

``AckCutProxy`` loses a Kafka broker's produce acknowledgements after the broker wrote the batch."""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
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


class AckCutProxy:
    """A Kafka-protocol proxy that loses produce acknowledgements: the request reaches the broker, the broker
    writes the records and answers, and the proxy closes the client's connection instead of forwarding the
    first ``cuts`` produce responses (an acknowledgement lost after the write). The client sees a broken
    connection and retries the batch the broker already holds.

    It reads Kafka's framing (a 4-byte size, then api key, version and correlation id in each request; the
    correlation id first in each response) to tell produce responses from the rest. The broker must
    advertise the proxy's port (``start_tansu(advertised_port=...)``), else clients reconnect around it."""

    PRODUCE = 0

    def __init__(self, target_port: int, listen_port: int, cuts: int = 1) -> None:
        self.target_port = target_port
        self.cuts = cuts
        #: produce responses the broker sent that never reached the client
        self.cut = 0
        self.produce_requests = 0
        self._lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", listen_port))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            api_keys: dict[int, int] = {}  # correlation id -> api key of the requests in flight
            threading.Thread(target=self._requests, args=(client, upstream, api_keys), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client, api_keys), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, api_keys: dict[int, int]) -> None:
        try:
            while (frame := _read_frame(client)) is not None:
                api_key, _version, correlation = struct.unpack(">hhi", frame[4:12])
                api_keys[correlation] = api_key
                if api_key == self.PRODUCE:
                    with self._lock:
                        self.produce_requests += 1
                upstream.sendall(frame)
        except OSError:
            pass
        finally:
            _hang_up(client, upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket, api_keys: dict[int, int]) -> None:
        try:
            while (frame := _read_frame(upstream)) is not None:
                (correlation,) = struct.unpack(">i", frame[4:8])
                if api_keys.pop(correlation, None) == self.PRODUCE and self._take_cut():
                    return  # the broker wrote the batch; the client never hears so
                client.sendall(frame)
        except OSError:
            pass
        finally:
            _hang_up(client, upstream)

    def _take_cut(self) -> bool:
        with self._lock:
            if self.cut >= self.cuts:
                return False
            self.cut += 1
            return True

    def close(self) -> None:
        self.server.close()


def _hang_up(*socks: socket.socket) -> None:
    """Close at once: ``shutdown`` first, since a bare ``close`` sends nothing while the other pump thread is
    still blocked in ``recv`` on the same socket."""
    for s in socks:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()


def _read_frame(sock: socket.socket) -> bytes | None:
    """One size-prefixed Kafka frame, size included; None when the peer closed."""
    head = _read_exact(sock, 4)
    if head is None:
        return None
    body = _read_exact(sock, struct.unpack(">i", head)[0])
    return None if body is None else head + body


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
