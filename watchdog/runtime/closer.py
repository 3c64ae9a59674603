"""Closing windows on event time: when the watermark says a window is complete, it closes.

Windows close on event time only (``watchdog.ingest.eventtime.Watermarks``): a stalled broker or loop
is a stall, never lateness. A partition with nothing to read holds the watermark back until the
broker confirms it is fully read (``confirm_idle`` asks for the log ends, bounded, every
``CONFIRM_EVERY_S``); that check also notices a re-created topic. ``close_windows`` closes the
owned partitions' due windows, queues their records for the partition's next checkpoint and returns
their signals for the policy engine, within a time budget per loop iteration (``CLOSE_BUDGET_S``):
windows left due count as closed (their events are late) and close at the next iterations.
``close_first`` closes the due windows of the routes near a rollback before all others, in every
partition, so that their judging does not wait behind thousands of windows closing.
``closed_at`` says when the watermark closed a window (the start of ``llmwd_close_to_flip_seconds``).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Container

from watchdog.config.settings import Config
from watchdog.core.metrics import Metrics
from watchdog.core.signals import Signal
from watchdog.ingest.consumer import Ingest
from watchdog.ingest.eventtime import Watermarks
from watchdog.runtime.budget import StepDeadline
from watchdog.runtime.ownership import Ownership
from watchdog.runtime.stats import DaemonStats
from watchdog.state import partitions as P

#: seconds between two broker confirmations that idle partitions are fully read
CONFIRM_EVERY_S = 0.5
#: loop time one iteration spends closing windows, and windows closed between two looks at the
#: clock: thousands of routes' windows fall due at once, and closing them all in one iteration
#: stalled ingest for seconds (10,000 routes: ~5 s); the rest close in the next iterations
CLOSE_BUDGET_S = 0.2
CLOSE_CHUNK = 200
#: window boundaries whose closing time is kept (``closed_at``): at 10 s windows, the last 40 minutes
CLOSINGS_KEPT = 256


class WindowCloser:
    def __init__(self, cfg: Config, wm: Watermarks, ownership: Ownership, metrics: Metrics, stats: DaemonStats,
                 clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.wm = wm
        self.ownership = ownership
        self.metrics = metrics
        self.stats = stats
        self.clock = clock
        self.ingest: Ingest | None = None
        self._last_confirm = 0.0
        #: index of the partition that closes first (one the budget stopped in goes first next time)
        self._first = 0
        #: the last call left due windows open (the loop should not wait for records before the next)
        self.behind = False
        #: the loop iteration's shared deadline (``Daemon.step`` starts it; never reached outside it)
        self.step = StepDeadline()
        #: each time the watermark passed another window boundary: the boundary (windows ending at or
        #: before it are closed) and the clock then, both ascending
        self._closed_ends: list[float] = []
        self._closed_times: list[float] = []
        self._dropped = False
        #: routes whose due windows close first (``close_first``; the daemon binds ``Decisions.near``)
        self.first: Container[P.Route] = frozenset()

    def attach(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def confirm_idle(self, now: float) -> None:
        """Partitions that gave no record this poll: caught up if the broker says their log ends there."""
        ingest = self.ingest
        assert ingest is not None
        if ingest.held:
            return  # reading is held (judging runs behind): a partition not read now is not caught up
        took = ingest.broker_wait.last_s or 0.0
        # a slow broker is asked less often: the loop waits for each answer
        if now - self._last_confirm < max(CONFIRM_EVERY_S, 2 * took):
            return
        self.ownership.check_topic_id(now)
        # records waiting in Ingest's buffer are not read yet: Tansu can answer a log end of the start of
        # the last batch + 1, which a position inside that batch passes while records still wait
        quiet = [pk for pk in self.ownership.parts if pk not in ingest.last_polled and not ingest.holds(pk)]
        if not quiet:
            return
        self._last_confirm = now
        asked = self.clock()
        ends = ingest.end_offsets(quiet)
        if ends is None:
            return
        for pk, end in ends.items():
            pos = ingest.next_offset.get(pk)
            if pos is None:
                pos = ingest.position(pk)
            if pos is not None and pos >= end:
                self.wm.confirm_caught_up(pk, asked)

    def close_first(self, now: float) -> list[Signal]:
        """Close the due windows of the routes in ``first`` (routes near a rollback), in every owned
        partition, before the others: at 10,000 routes closing every due window takes several
        iterations, and these are the windows whose judging may flip a route."""
        upto = self._upto(now)
        out: list[Signal] = []
        if upto is None or not self.first:
            return out
        deadline = min(time.monotonic() + CLOSE_BUDGET_S, self.step.until)
        for part in self.ownership.parts.values():  # a chunk in each, more while the budget lasts
            while True:
                sigs = self._close_part(part, upto, out, first_only=True)
                if len(sigs) < CLOSE_CHUNK or time.monotonic() >= deadline:
                    break
        self._count(out)
        return out

    def close_windows(self, now: float) -> list[Signal]:
        """Close the windows the watermark completed; their signals."""
        upto = self._upto(now)
        if upto is None:
            return []
        out: list[Signal] = []
        self.behind = False
        parts = self.ownership.parts
        deadline = min(time.monotonic() + CLOSE_BUDGET_S, self.step.until)
        order = list(parts.values())
        if order:  # a partition left with due windows by the budget goes first next time
            self._first %= len(order)
            order = order[self._first:] + order[:self._first]
        for i, part in enumerate(order):
            if i and time.monotonic() >= deadline:
                self._first += i  # these partitions close first next time
                self.behind = True
                break
            while True:
                sigs = self._close_part(part, upto, out)
                if len(sigs) < CLOSE_CHUNK or time.monotonic() >= deadline:
                    break
            if len(sigs) >= CLOSE_CHUNK:  # stopped by the budget with windows still due
                self._first += i
                self.behind = True
                break
        self._count(out)
        for pk in parts:
            mark = self.wm.mark(pk)
            if mark is not None:
                self.metrics.watermark.labels(str(pk[1])).set(mark)
        return out

    def _upto(self, now: float) -> float | None:
        """The clock ``close_due`` closes to (None: the watermark closes nothing yet); notes a new close mark."""
        t = self.wm.close_time(now)
        if t is None:
            return None
        w = self.cfg.windows
        self._closing(math.floor((t - w.allowed_lateness_s) / w.length_s) * w.length_s, now)
        return t - w.allowed_lateness_s + w.grace_s  # close_due subtracts the grace again

    def _close_part(self, part: P.Partition, upto: float, out: list[Signal], first_only: bool = False) -> list[Signal]:
        """One chunk of a partition's due windows: recorded for its next checkpoint and added to ``out``."""
        before = part.agg.closed_end
        sigs = part.agg.close_due(upto, limit=CLOSE_CHUNK, first=self.first, first_only=first_only)
        if sigs:
            part.unsaved.extend(P.window_record(s, self.cfg.instance) for s in sigs)
            out.extend(sigs)
        if sigs or part.agg.closed_end != before:
            part.dirty = True
        return sigs

    def _count(self, out: list[Signal]) -> None:
        if out:
            self.metrics.windows_closed.inc(len(out))
            self.stats.windows_closed += len(out)

    def _closing(self, boundary: float, now: float) -> None:
        if self._closed_ends and boundary <= self._closed_ends[-1]:
            return
        self._closed_ends.append(boundary)
        self._closed_times.append(now)
        if len(self._closed_ends) > CLOSINGS_KEPT:
            del self._closed_ends[0], self._closed_times[0]
            self._dropped = True

    def closed_at(self, end: float) -> float | None:
        """The clock when the watermark closed the window ending at ``end`` (the loop iteration that
        first found it due, whether or not the close budget let it close there); None when it has not
        closed yet or closed before the boundaries kept (``CLOSINGS_KEPT``)."""
        i = bisect.bisect_left(self._closed_ends, end)
        if i == len(self._closed_ends) or (i == 0 and self._dropped and end < self._closed_ends[0]):
            return None
        return self._closed_times[i]
