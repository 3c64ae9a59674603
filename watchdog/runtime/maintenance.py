"""Operators' maintenance annotations (``Keys.maintenance``), read off the main loop.

Judging marks live windows that fall inside a declared maintenance span (``Decisions.mark_maintenance``).
It read the annotations with one MGET per judging pass on the loop thread, so each pass waited a Redis
round trip: on a 0.1-0.45 s link that was most of the loop's time (tests/test_slow_network.py). Here a
thread of its own (``THREAD_NAME``) keeps the annotations of the routes judging asked about, and the loop
reads what it found last. A route asked about for the first time is read on the loop, once (one MGET for
all the new routes of a pass), so its first window is not judged without an annotation that was already
there. Redis errors of that read propagate (the caller judges without the marks and readiness says why).
Routes not asked about for ``FORGET_S`` are dropped, so the set stays that of the routes being judged.

What the thread reads every ``EVERY_S`` (it read every asked route's key each time: at 10,000 routes
4-10 us of daemon CPU per ingested event, for annotations that change a few times a day):

* ``Keys.maintenance_generation``, which every write of ``FlagStore.maintenance`` (the ``flags
  maintenance`` command) bumps in the same transaction: when it moved, every asked route's key again;
* the keys of the routes that have an annotation now (usually none), so one that ended or expired (its
  TTL) or was rewritten goes as it went before;
* every asked route's key at least every ``FULL_EVERY_S`` whatever the generation says, for writers that
  do not bump it (a SET by hand).

So an annotation written by the CLI is seen within about ``EVERY_S`` plus a round trip, one written
without the bump within ``FULL_EVERY_S``; an annotation that ends, within ``EVERY_S`` either way.

Without ``start`` (a loop driven by hand) ``values`` reads Redis itself, as before."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from watchdog.core.keys import Keys

#: the reader's thread name (the daemon watches its long-lived threads by name)
THREAD_NAME = "maintenance-reader"
#: seconds between two looks at the generation (and at the keys of the routes with an annotation)
EVERY_S = 1.0
#: seconds between two reads of every asked route's key whatever the generation says (writers that do
#: not bump it are seen within this)
FULL_EVERY_S = 30.0
#: a route not asked about for this long is read no more (looked for every ``FORGET_S / 10``: at 10,000
#: routes a look every cycle cost more than the cycle's reads)
FORGET_S = 600.0
#: keys per MGET
CHUNK = 1000

Route = tuple[str, str]


class MaintenanceReader:
    def __init__(self, client: Any, keys: Keys, on_error: Callable[[BaseException, str], None],
                 on_round_trip: Callable[[float], None] | None = None) -> None:
        self.client = client
        self.keys = keys
        self.on_error = on_error
        #: told the seconds of each cycle's PING: a slow link shows there, not only in what waits on it
        self.on_round_trip = on_round_trip
        self.round_trip_s: float | None = None
        self._lock = threading.Lock()
        self._asked: dict[Route, float] = {}
        self._found: dict[Route, Any] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def values(self, wanted: Sequence[Route]) -> dict[Route, Any]:
        """The annotation of each of ``wanted`` that has one (as last read; a route not asked about
        before, read now); Redis errors of a read made here propagate."""
        if self._thread is None:
            return self._read(wanted)
        now = time.monotonic()
        with self._lock:
            new = [r for r in wanted if r not in self._asked]
        if new:  # read now, once per route: its first window must not miss an annotation already there
            found = self._read(new)
            with self._lock:
                self._found.update(found)
        with self._lock:
            for r in wanted:
                self._asked[r] = now
            return {r: self._found[r] for r in wanted if r in self._found}

    def _read(self, routes: Sequence[Route]) -> dict[Route, Any]:
        """Each of ``routes`` that has an annotation, and the annotation (MGETs of ``CHUNK`` keys)."""
        found: dict[Route, Any] = {}
        for i in range(0, len(routes), CHUNK):
            chunk = routes[i:i + CHUNK]
            values = self.client.mget([self.keys.maintenance(m, r) for m, r in chunk])
            found.update((route, v) for route, v in zip(chunk, values, strict=True) if v)
        return found

    def _run(self) -> None:
        generation: Any = None  # Keys.maintenance_generation when the last full read began
        full_at = -math.inf  # monotonic time of the last full read (none yet)
        swept_at = time.monotonic()  # of the last look for routes to forget
        while not self._stop.is_set():
            self._wake.wait(EVERY_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            with self._lock:
                if now - swept_at >= FORGET_S / 10:
                    swept_at = now
                    for r in [r for r, at in self._asked.items() if now - at > FORGET_S]:
                        del self._asked[r]
                        self._found.pop(r, None)
                annotated = sorted(self._found)
            try:
                t0 = time.perf_counter()
                self.client.ping()
                self.round_trip_s = time.perf_counter() - t0
                if self.on_round_trip is not None:
                    self.on_round_trip(self.round_trip_s)
                seen = self.client.get(self.keys.maintenance_generation)  # read before the keys it covers
                full = seen != generation or now - full_at >= FULL_EVERY_S
                if full:
                    with self._lock:
                        routes = sorted(self._asked)
                else:
                    routes = annotated
                found = self._read(routes)
            except (redis.RedisError, OSError) as exc:
                self.on_error(exc, "reading maintenance annotations")
                continue
            if full:
                generation, full_at = seen, now
            with self._lock:  # routes first asked while this read ran keep what their own read found
                read = set(routes)
                self._found = found | {r: v for r, v in self._found.items() if r not in read}
