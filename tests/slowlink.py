"""An asyncio TCP proxy that makes a link slow, not dead: latency per direction, jitter, a bandwidth
shared by every connection of a direction, and stalls that hold everything for a while then resume.

``SlowLink(target_port)`` listens on a free loopback port (``.port``) and forwards to ``target_port``.
Its knobs may change while it runs:

- ``up`` / ``down``: a ``Direction`` each (client -> server, server -> client) with ``delay_s``,
  ``jitter_s`` (a uniform extra of 0..jitter_s per chunk; bytes keep their order, as TCP does) and
  ``bandwidth`` (bytes/s, 0 = unlimited). Bandwidth is a queue shared by all connections of that
  direction (one link), and the proxy reads no faster than it forwards (at most ``BUFFER`` bytes
  queued per connection), so a sender's socket fills as on a real narrow link.
- ``stall()`` / ``resume()``: nothing moves either way (connections stay open, nothing is refused).

It runs its own event loop on a daemon thread; ``close()`` stops it and drops every connection."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
from dataclasses import dataclass, field

#: bytes read ahead per connection and direction before the proxy stops reading (back-pressure)
BUFFER = 1024 * 1024
#: largest chunk read at once: a large write is paced in pieces this big
CHUNK = 16 * 1024


@dataclass
class Direction:
    delay_s: float = 0.0
    jitter_s: float = 0.0
    bandwidth: float = 0.0
    #: when the shared link is free again (loop time)
    _free_at: float = field(default=0.0, repr=False)
    #: bytes forwarded this way
    bytes: int = 0


class SlowLink:
    def __init__(self, target_port: int, *, listen_port: int = 0, host: str = "127.0.0.1", seed: int = 7) -> None:
        self.target = (host, target_port)
        self.up = Direction()
        self.down = Direction()
        self._rng = random.Random(seed)
        self._open = True
        self._resumed: asyncio.Event | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        sock = socket.create_server(("127.0.0.1", listen_port))
        self.port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(sock,), name="slowlink", daemon=True)
        self._thread.start()
        self._started.wait(5)

    # -- knobs ---------------------------------------------------------------------------------

    def set(self, *, delay_s: float | None = None, jitter_s: float | None = None,
            bandwidth: float | None = None) -> None:
        """The same setting both ways (``delay_s`` per direction: a round trip is twice it)."""
        for d in (self.up, self.down):
            if delay_s is not None:
                d.delay_s = delay_s
            if jitter_s is not None:
                d.jitter_s = jitter_s
            if bandwidth is not None:
                d.bandwidth = bandwidth

    def stall(self) -> None:
        self._loop.call_soon_threadsafe(self._resumed.clear)  # type: ignore[union-attr]

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._resumed.set)  # type: ignore[union-attr]

    def close(self) -> None:
        async def shut() -> None:
            self._open = False
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- the loop ------------------------------------------------------------------------------

    def _main(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self._loop)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, sock=sock))
        self._started.set()
        self._loop.run_forever()

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.transport.abort()
            return
        self._writers |= {cw, sw}
        try:
            await asyncio.gather(self._pump(cr, sw, self.up), self._pump(sr, cw, self.down))
        finally:
            self._writers -= {cw, sw}

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, d: Direction) -> None:
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        room = asyncio.Semaphore(BUFFER // CHUNK)

        async def send() -> None:
            last = 0.0
            while (item := await line.get()) is not None:
                due, data = item
                due = max(due, last)  # FIFO: jitter never reorders bytes
                last = due
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                await self._resumed.wait()  # type: ignore[union-attr]
                dst.write(data)
                d.bytes += len(data)
                room.release()
                await dst.drain()
            dst.close()

        sender = asyncio.ensure_future(send())
        try:
            while self._open:
                await room.acquire()
                await self._resumed.wait()  # type: ignore[union-attr]
                data = await src.read(CHUNK)
                if not data:
                    break
                now = loop.time()
                start = max(now, d._free_at)
                if d.bandwidth > 0:
                    d._free_at = start + len(data) / d.bandwidth
                    await asyncio.sleep(d._free_at - now)  # the link carries it this long
                    start = d._free_at
                jitter = self._rng.uniform(0, d.jitter_s) if d.jitter_s else 0.0
                line.put_nowait((start + d.delay_s + jitter, data))
        except (ConnectionError, OSError):
            pass
        finally:
            line.put_nowait(None)
            with contextlib.suppress(ConnectionError, OSError):
                await sender
            with contextlib.suppress(Exception):
                dst.close()


def round_trip(port: int, n: int = 5) -> float:
    """Median seconds of a Redis PING through ``port`` (a sanity check of the link's settings)."""
    import redis

    c = redis.Redis(port=port, socket_timeout=30)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        c.ping()
        ts.append(time.perf_counter() - t)
    c.close()
    return sorted(ts)[len(ts) // 2]
