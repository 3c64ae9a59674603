"""The cyclic collector, run by the main loop once per iteration, and the long-lived heap frozen.

CPython starts a young collection when allocations minus deallocations (of any generation) pass a
threshold. In steady state the daemon frees old windows about as fast as it makes new ones, so that
count rarely reaches the threshold while the young list keeps every container made since the last
collection: at 10,000 routes each young collection walked most of the live windows (0.03-0.6 s, nothing
found), a middle one 0.4-0.8 s, a full one up to 2.35 s (docs/BENCHMARKS.md, "The cyclic collector at
10,000 routes"). A middle generation collected every second still walked 0.5 s of what a window boundary
makes (the closed windows' signals, records and verdicts). While a loop runs, automatic collection is
off for the process and ``collect`` does it, at the start of each iteration's deadline (its time is
taken from the work that can wait, ``watchdog/runtime/budget.py``):

* the young generation (what was made and kept since the last iteration: each object is walked once,
  in the iteration that made it), then everything that survived is frozen (``gc.freeze``, a list
  splice), so no later pass walks the long-lived windows, routes and engine state again;
* every ``GROWTH_CHECK_S`` the heap is measured (``sys.getallocatedblocks``: ~1 ms at 6M blocks) and when
  it has grown by ``FULL_GROWTH`` since the last full collection, everything is unfrozen and collected:
  a cycle that died after an iteration froze it is freed there, so memory stays bounded. That pass walks
  the whole heap (0.8-1.5 s at 10,000 routes on a loaded 2-core machine), so it should be rare: a cycle
  that dies within the iteration that made it is freed by that iteration's pass, and the heap grows by
  cyclic garbage only from cycles that survive their iteration and die later. kafka-python made one
  per poll that found no record (``watchdog.ingest.consumer.drop_spent_wakeups`` takes away what kept
  it alive); ``Daemon.step`` keeps the closed windows out of its own frame's locals so that such a cycle
  holds little. The heap count sees CPython's small objects only: what glibc keeps of freed larger
  blocks is ``watchdog/runtime/heap_trim.py``'s. The pass comes while
  the heap fills after a start (routes arriving, their histories growing) and rarely after. CPython's
  own rule is a 25 % growth of what its middle passes kept: with a heap that grows for minutes after a
  start, that was a full pass every ~30 s of it.

The settings are the process's: the first running loop takes them, the last one to stop puts them back
(tests and the demo run several daemons in one process).
"""

from __future__ import annotations

import gc
import math
import sys
import threading
import time

#: seconds between two measures of the heap
GROWTH_CHECK_S = 1.0
#: growth of the heap (allocated blocks) since the last full collection that starts the next one
FULL_GROWTH = 1.0


class GcPauses:
    """The cyclic collector's passes (on any thread: the loop waits for them either way) since the last
    ``take``, as (generation, seconds)."""

    def __init__(self) -> None:
        self._started = 0.0
        self.passes: list[tuple[int, float]] = []

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.passes.append((info["generation"], time.perf_counter() - self._started))

    def take(self) -> list[tuple[int, float]]:
        passes, self.passes = self.passes, []
        return passes


class LoopCollector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._was_enabled = True
        self.pauses = GcPauses()
        self._check_at = -math.inf
        #: the heap's allocated blocks right after the last full collection
        self.base = 0

    def enter(self) -> None:
        """A loop starts: the start-up heap is collected and frozen, automatic collection goes off."""
        with self._lock:
            gc.collect()
            gc.freeze()
            if self._users == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
                gc.callbacks.append(self.pauses)
                self.base = sys.getallocatedblocks()
                self._check_at = time.monotonic()
            self._users += 1

    def exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                gc.unfreeze()  # let whatever the daemons held be collected
                if self.pauses in gc.callbacks:
                    gc.callbacks.remove(self.pauses)
                if self._was_enabled:
                    gc.enable()

    def collect(self) -> None:
        """The collector's work for one loop iteration (module docstring)."""
        if self._users == 0:
            return
        gc.collect(0)
        gc.freeze()
        t = time.monotonic()
        if t - self._check_at < GROWTH_CHECK_S:
            return
        self._check_at = t
        if sys.getallocatedblocks() > self.base * (1 + FULL_GROWTH):
            self.full()

    def full(self) -> None:
        """Collect everything, frozen or not, and freeze what is left."""
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        self.base = sys.getallocatedblocks()


LOOP_GC = LoopCollector()
