"""When and how each owned partition is checkpointed in Redis, and the Kafka offset mirror after it.

A checkpoint holds a partition's open windows, the records of the windows it closed (and of the
golden/GPU signals of its routes), the pages decided since the last save (outbox), the engine state
of its routes that changed, and the next offset to read; ``CheckpointStore.save`` writes it in one
script, fenced by the ownership token and idempotent by sequence number. Order per partition:

1. never while a flip of one of its routes is pending (the flip carries that engine state itself);
2. never past a dead letter the broker has not acknowledged;
3. build the save once (``build_save``) and retry the same one until Redis has it; a ``RESYNC``
   answer (Redis lost the checkpoint this incremental save builds on) resends it as a full snapshot,
   ``FENCED`` hands the partition to ``Ownership.fence``;
4. then, and only then, mirror the offset into Kafka and keep it for the synchronous commit at close.

Saves are spaced by ``redis.checkpoint_every_s`` (1 s while Redis is failing) and to at most ~10 % of
the loop's time. The engine state of a judged route is encoded ahead of its partition's save, a slice
per loop iteration (``preencode``): after a window close every route of a partition is judged, and
encoding all their states in the one save that follows took most of a save's loop time (~0.14 ms a
route, 0.35 s for 2,500). The encoding is exactly what the save would have made: an engine state
changes only in ``PolicyEngine.observe``, after which ``Decisions`` puts the route back in
``dirty_routes``, and a route in ``dirty_routes`` is encoded again (at the latest by the save).

Changed open windows are encoded ahead the same way (``WindowAggregator.encode_ahead``), so that no
save snapshots thousands of windows in one iteration (a full save of a 2,500-route partition: 0.25-0.54 s).
The cut stays consistent: a save is built in one go on the loop thread, with the offset read then; a
window encoded ahead and not changed since is exactly what encoding it then would give (an event sets
its ``dirty`` flag, and a dirty window is encoded again by the save), and a window closed since is
dropped from what was encoded ahead. A save waits (``PREENCODE_WAIT_SAVES`` spacings at most, counted
from when it first waited) while more than ``PREENCODE_MAX_LEFT`` routes or ``PREENCODE_MAX_WINDOWS``
windows are not encoded.

Golden/GPU signal records no owned partition carries go straight to the windows stream
(``flush_unowned``), the newest ``MAX_UNOWNED_RECORDS`` kept while Redis is away.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import redis

from watchdog.actuation.actuator import Actuator
from watchdog.config.settings import Config
from watchdog.core.keys import Keys
from watchdog.core.metrics import Metrics
from watchdog.core.signals import Signal
from watchdog.ingest.consumer import Ingest
from watchdog.ingest.eventtime import Watermarks
from watchdog.policy import PolicyEngine
from watchdog.runtime.budget import StepDeadline
from watchdog.runtime.health import RedisHealth
from watchdog.runtime.heap_trim import HEAP_TRIM
from watchdog.runtime.ownership import Ownership
from watchdog.runtime.save_writer import Outcome, SaveWriter
from watchdog.runtime.stats import DaemonStats
from watchdog.state import partitions as P
from watchdog.state.checkpoint import DUPLICATE, FENCED, RESYNC, SAVED, CheckpointStore, PendingSave
from watchdog.windows.aggregator import encode_snapshots

log = logging.getLogger(__name__)

#: golden/GPU signal records held for the windows stream while Redis is down, at most
MAX_UNOWNED_RECORDS = 10_000
#: one loop iteration starts no further partition save once its saves have taken this long
STEP_BUDGET_S = 0.25
#: loop time per iteration spent encoding judged routes' engine state (and changed windows) ahead of
#: their saves while a due save waits for it, even past the iteration's deadline (else a slice then)
PREENCODE_BUDGET_S = 0.04
#: a save waits (for at most ``PREENCODE_WAIT_SAVES`` spacings) while more dirty routes than this are
#: not encoded yet, so that ``preencode`` spreads them over the iterations instead of one save taking them
PREENCODE_MAX_LEFT = 250
#: 6, not 3: at 10,000 routes a window boundary's judging takes the iterations' deadline for 1-2 s, and
#: with 3 spacings the saves gave up waiting and encoded 1,300-2,400 routes in one build (0.15-0.3 s of
#: one iteration; docs/BENCHMARKS.md, "Checkpoint builds after a window boundary")
PREENCODE_WAIT_SAVES = 6
#: past the iteration's deadline a partition is saved only when its last save is this many spacings old
#: (a loop whose deadline is always spent still saves); else the save waits for an iteration with time
SAVE_OVERDUE_SAVES = 2 + PREENCODE_WAIT_SAVES
#: the same for changed open windows (``WindowAggregator.encode_ahead``): a full save of a 2,500-route
#: partition snapshotted its ~5,000 windows in one go, 0.25-0.54 s of one loop iteration at 10,000
#: routes. ``preencode`` encodes a partition's windows while more than half this many wait
PREENCODE_MAX_WINDOWS = 250
#: routes or windows ``preencode`` encodes between two looks at the clock
PREENCODE_SLICE = 32


def _preencode_left(part: P.Partition) -> bool:
    """Whether ``preencode`` has work in ``part``: dirty routes' engine states, or more open windows
    changed since their last encoding than half of ``PREENCODE_MAX_WINDOWS``."""
    return bool(part.dirty_routes) or part.agg.unencoded > PREENCODE_MAX_WINDOWS // 2


class Checkpointer:
    def __init__(self, cfg: Config, keys: Keys, client: Any, checkpoints: CheckpointStore, engine: PolicyEngine,
                 wm: Watermarks, ownership: Ownership, actuator: Actuator, redis_health: RedisHealth,
                 metrics: Metrics, stats: DaemonStats) -> None:
        self.cfg = cfg
        self.keys = keys
        self.redis = client
        self.checkpoints = checkpoints
        self.engine = engine
        self.wm = wm
        self.ownership = ownership
        self.actuator = actuator
        self.redis_health = redis_health
        self.metrics = metrics
        self.stats = stats
        self.ingest: Ingest | None = None
        #: records of golden/GPU signals no owned partition's checkpoint carries, for the windows stream
        self.unowned_records: list[str] = []
        #: routes whose closed windows wait to be judged (``Decisions.deferred_routes``, bound by the daemon)
        self.deferred_routes: Callable[[], set[P.Route]] = set
        #: encodes and writes the saves of the loop (``checkpoint`` without ``force``) off its thread
        self.writer = SaveWriter(checkpoints)
        #: False: every save is encoded and written on the calling thread (as before the writer)
        self.offload = True
        #: the loop iteration's shared deadline (``Daemon.step`` starts it; never reached outside it)
        self.step = StepDeadline()
        #: True while records wait in Kafka for a partition being read (``Ingest.reading_behind``, set by
        #: ``Daemon.step`` each iteration): what is left of the iteration's deadline then goes to reading
        #: them, not to ``preencode``
        self.reading_behind = False
        #: per partition: (the partition, the policy set, route -> engine-state JSON) encoded ahead of
        #: its next save (``preencode``); the routes in it are out of ``part.dirty_routes`` until they
        #: change again
        self._encoded: dict[P.PartitionKey, tuple[P.Partition, Any, dict[P.Route, str | None]]] = {}
        #: per partition: when its save was last refused for routes not judged yet (``checkpoint``)
        self._held_at: dict[P.PartitionKey, float] = {}
        #: per partition: when its due save first waited for ``preencode`` (since its last save)
        self._waiting: dict[P.PartitionKey, float] = {}

    def attach(self, ingest: Ingest) -> None:
        self.ingest = ingest

    def checkpoint(self, now: float, force: bool = False) -> None:
        """Save every partition that changed and whose spacing has passed (all of them with ``force``);
        without ``force``, the least recently saved first and no more once this call has taken
        ``STEP_BUDGET_S`` (the others are saved in the next loop iterations). Without ``force`` the
        saves are built here and encoded and written by the writer thread; their outcomes are taken
        by the next call."""
        self.harvest()
        every = self.cfg.redis.checkpoint_every_s if self.redis_health.ok else 1.0
        t0 = time.perf_counter()
        saved = False
        deferred = self.deferred_routes() if not force else set()
        for held in (self._held_at, self._waiting):
            for pk in [pk for pk in held if pk not in self.ownership.parts]:
                del held[pk]
        for part in sorted(self.ownership.parts.values(), key=lambda p: p.last_save):
            if part.inflight is None and not part.dirty:
                continue
            if not force:
                if part.full and part.inflight is None:
                    # a full save writes every route's engine state: encoded ahead too, a slice at a time
                    part.dirty_routes |= part.routes - self._encoded_of(part).keys()
                spacing = max(every, 10 * part.last_cost_s)
                if self.writer.busy(part.pk) or now - part.last_save < spacing:
                    continue
                if deferred and not part.routes.isdisjoint(deferred):
                    # ``save`` would refuse it (windows closed but not judged)
                    self._held_at[part.pk] = now
                    continue
                if part.inflight is None and (len(part.dirty_routes) > PREENCODE_MAX_LEFT
                                              or part.agg.unencoded > PREENCODE_MAX_WINDOWS) and (
                        # never saved (last_save 0) or held long: the wait counts from the first one
                        now - self._waiting.setdefault(part.pk, now) < PREENCODE_WAIT_SAVES * spacing
                        or now - part.last_save < (1 + PREENCODE_WAIT_SAVES) * spacing
                        # refused until just now: a close burst made last_save old, and its save then
                        # encoded all the partition's routes at once; preencode gets a few seconds
                        or now - self._held_at.get(part.pk, -math.inf) < PREENCODE_WAIT_SAVES * every):
                    continue  # preencode takes them a slice per iteration first
                if time.perf_counter() - t0 > STEP_BUDGET_S or (self.step.passed() and (
                        saved or now - part.last_save < SAVE_OVERDUE_SAVES * spacing)):
                    break  # past the deadline, one overdue save at most (the least recently saved first)
            before = part.last_save
            self._waiting.pop(part.pk, None)
            self.save(part, now, force=force)
            saved = saved or part.last_save != before  # built or sent one (not one held back by a flip)
        if not force:
            # in the loop, what is left of the iteration's deadline, and at least PREENCODE_BUDGET_S while a
            # due save waits for it and the deadline is not spent (else a slice): after a close burst the
            # saves otherwise waited for it and then encoded 1,000-2,400 routes at once. Past the deadline
            # (judging a window boundary takes it all for 1-2 s at 10,000 routes) those 40 ms made
            # iterations of 0.25-0.3 s; the saves wait PREENCODE_WAIT_SAVES spacings from the judging instead
            # While records wait in Kafka (a catch-up, a replica behind) the rest of the deadline belongs to
            # reading them: preencode gets what it gets past the deadline, a slice, and only while a save waits
            # for it. The windows of the routes being read change again with the next poll, and the routes'
            # engine states with their next window's judging, before a save takes what was encoded (in a
            # catch-up the saves are refused again at each window boundary until its windows are judged):
            # filling the deadline with it was 13-25 % of the loop's CPU at 100-1,000 routes, nearly all of it
            # encoded again or dropped with the closed window (docs/BENCHMARKS.md, "Encoding ahead while records
            # wait"). Reading held (back-pressure) is not behind: the saves then catch up with the whole deadline.
            left = self.step.until - time.monotonic()
            if not self.reading_behind:
                least = PREENCODE_BUDGET_S if self._waiting and left > 0 else 0.0
                self.preencode(max(least, left) if math.isfinite(left) else PREENCODE_BUDGET_S)
            elif self._waiting:
                self.preencode(0.0)

    def save_waits_for_preencode(self) -> bool:
        """True while a due save waits for ``preencode`` and there is something left for it to encode (the
        loop then does not wait for records: those saves are what a catch-up's last commit waits for)."""
        parts = self.ownership.parts
        return any(_preencode_left(parts[pk]) for pk in self._waiting if pk in parts)

    def unsaved_age(self, now: float) -> float:
        """How long the longest-unsaved owned partition has held changes Redis does not have (0 when none
        does); exported per partition as ``llmwd_checkpoint_age_seconds``."""
        oldest = 0.0
        for part in self.ownership.parts.values():
            age = now - part.saved_at if part.dirty or part.inflight is not None or part.unsaved else 0.0
            self.metrics.checkpoint_age.labels(str(part.pk[1])).set(age)
            oldest = max(oldest, age)
        return oldest

    def preencode(self, budget_s: float) -> int:
        """Encode the engine state of dirty routes, then changed open windows, ahead of their
        partition's save, for at most about ``budget_s``; returns how many were encoded."""
        parts = self.ownership.parts.values()
        if not any(_preencode_left(part) for part in parts):
            return 0
        paused = gc.isenabled()
        gc.disable()  # short-lived acyclic dicts, as in ``save``
        try:
            t0 = time.perf_counter()
            # half the budget at most for engine states while windows wait too (routes judged without
            # a break took it all, and the windows' saves waited until they went in one go)
            windows = any(part.agg.unencoded > PREENCODE_MAX_WINDOWS // 2 for part in parts)
            done = self._preencode(budget_s / 2 if windows else budget_s)
            # a slice of windows at least, however long the engine states took
            return done + self._preencode_windows(budget_s - (time.perf_counter() - t0))
        finally:
            if paused:
                gc.enable()

    def _preencode_windows(self, budget_s: float) -> int:
        t0 = time.perf_counter()
        done = 0
        for part in sorted(self.ownership.parts.values(), key=lambda p: p.last_save):
            if part.inflight is not None and not self.writer.busy(part.pk):
                continue  # a save Redis did not take waits to be resent (its windows are in it)
            while part.agg.unencoded > PREENCODE_MAX_WINDOWS // 2:
                n = part.agg.encode_ahead(PREENCODE_SLICE)
                done += n
                if not n or time.perf_counter() - t0 > budget_s:
                    return done
        return done

    def _preencode(self, budget_s: float) -> int:
        t0 = time.perf_counter()
        done = 0
        packed = self.cfg.redis.pack_engine_state
        # the partition saved least recently first, the order its save comes in (in dict order, the
        # last partition got no slice after a close burst and its save encoded its 2,500 routes at once)
        for part in sorted(self.ownership.parts.values(), key=lambda p: p.last_save):
            if not part.dirty_routes or (part.inflight is not None and not self.writer.busy(part.pk)):
                continue  # a save Redis did not take waits to be resent: no build soon, keep no copies
            encoded = self._encoded_of(part)
            todo = [r for r in part.dirty_routes if r in part.routes]
            for i in range(0, len(todo), PREENCODE_SLICE):
                chunk = todo[i:i + PREENCODE_SLICE]
                by_route = P.engine_states_by_route(self.engine, set(chunk))
                for route in chunk:
                    scopes = by_route.get(route)
                    # None: no state (yet); the save leaves its key alone, as it did before
                    encoded[route] = P.engine_value(scopes, packed) if scopes is not None else None
                    part.dirty_routes.discard(route)
                done += len(chunk)
                if time.perf_counter() - t0 > budget_s:
                    return done
        return done

    def _encoded_of(self, part: P.Partition) -> dict[P.Route, str | None]:
        """The engine states encoded ahead for ``part`` (empty for a partition assigned anew, or after
        the policies changed: ``set_policy_set`` rewrites states without marking routes dirty)."""
        entry = self._encoded.get(part.pk)
        policy_set = self.engine.policy_set
        if entry is not None and entry[0] is part and entry[1] is policy_set:
            return entry[2]
        if entry is not None and entry[0] is part:
            part.dirty_routes |= entry[2].keys()  # encode them again, under the new policies
        encoded: dict[P.Route, str | None] = {}
        self._encoded[part.pk] = (part, policy_set, encoded)
        return encoded

    def _take_encoded(self, part: P.Partition) -> dict[P.Route, str | None]:
        """The engine states encoded ahead for ``part``, for the save being built (the cache empties)."""
        encoded = self._encoded_of(part)
        del self._encoded[part.pk]
        return encoded

    def save(self, part: P.Partition, now: float, force: bool = False, mirror: bool = True) -> bool:
        """Save one partition's checkpoint; True when Redis holds it (saved, or a retry found it saved).
        With ``force`` (and with ``offload`` off) the write runs here, after the one in flight; else
        it goes to the writer thread and this returns False (``harvest`` finishes it)."""
        assert self.ingest is not None
        if self.writer.busy(part.pk):
            if not force:
                return False
            self._settle(part, mirror)
            if self.ownership.parts.get(part.pk) is not part:
                return False  # its answer was "fenced": the partition is gone
        if part.routes & self.actuator.pending_routes():
            return False  # the flip goes first: it carries the engine state the checkpoint would
        deferred = self.deferred_routes()
        if deferred and not part.routes.isdisjoint(deferred):
            return False  # windows closed but not judged yet: never record them as done before they are
        if not self.ingest.dead_letters.settled(part.pk, timeout_s=1.0 if force else 0.2):
            return False  # never checkpoint past a dead letter the broker has not acknowledged
        # the metric and the save spacing cover the whole time of a save: building it on the loop
        # (engine state, window snapshots) and encoding and writing it (here or on the writer thread)
        t0 = time.perf_counter()
        if part.inflight is None:
            # the snapshots are many small, acyclic, short-lived objects: no cyclic collection while
            # they are made (over the daemon's heap of windows, one costs more than the build)
            paused = gc.isenabled()
            gc.disable()
            try:
                part.inflight = self.build_save(part, now, part.unsaved, part.outbox)
            finally:
                if paused:
                    gc.enable()
            part.unsaved, part.outbox = [], []
        if self.offload and not force:
            built_s = time.perf_counter() - t0
            self.metrics.checkpoint_loop_seconds.observe(built_s)
            self.writer.submit(part.pk, part.token, part.inflight, built_s, now)
            part.last_save = now
            return False
        try:
            status = self._write(part, now)
        except (redis.RedisError, OSError) as exc:
            self._failed(part, now, exc)
            return False
        cost = time.perf_counter() - t0
        self.metrics.checkpoint_loop_seconds.observe(cost)
        return self._finish(part, now, status, cost, mirror)

    def _failed(self, part: P.Partition, now: float, exc: BaseException) -> None:
        """Redis did not take the save: it stays in ``part.inflight``, resent byte for byte later."""
        self.metrics.checkpoints.labels("error").inc()
        self.redis_health.failed(exc, f"checkpoint of partition {part.pk[1]}")
        part.last_save = now

    def _finish(self, part: P.Partition, now: float, status: str, cost: float, mirror: bool) -> bool:
        """After Redis answered ``status``: count it, fence, or record the save and mirror its offset."""
        part.last_cost_s = cost
        self.metrics.checkpoint_seconds.observe(cost)
        self.metrics.checkpoints.labels(status).inc()
        self.redis_health.recovered()
        part.last_save = now
        if status == FENCED:
            self.ownership.fence(part.pk)
            return False
        assert status in (SAVED, DUPLICATE)
        assert part.inflight is not None
        part.saved_at = max(part.saved_at, now)  # the save holds the partition as it was built, at ``now``
        size = part.inflight.size
        self.metrics.checkpoint_bytes.labels(str(part.pk[1])).set(size)
        HEAP_TRIM.freed(size)
        part.seq = part.inflight.seq
        part.inflight = None
        self.stats.checkpoints += 1
        offset = part.start_offset
        if offset is not None:
            if mirror:
                self.ingest.commit_mirror({part.pk: offset})  # type: ignore[union-attr]
            self.ingest.set_final_offset(part.pk, offset)  # type: ignore[union-attr]
        return True

    # -- the writer thread ---------------------------------------------------------------------
    def harvest(self) -> None:
        """Act on the saves the writer thread finished (in the commit order above)."""
        for outcome in self.writer.finished():
            self._outcome(outcome)

    def _settle(self, part: P.Partition, mirror: bool = True) -> None:
        """Wait for the save of ``part`` in flight (and the full one a ``RESYNC`` answer sends)."""
        while self.writer.busy(part.pk):
            outcome = self.writer.wait(part.pk)
            if outcome is not None:
                self._outcome(outcome, mirror)

    def saving(self, routes: set[P.Route]) -> set[P.Route]:
        """Those of ``routes`` whose partition has a save in flight. Their flips wait (the flip writes the
        route's engine state; a save landing after it would write an older one) without blocking the loop:
        a save at 10,000 routes takes up to 1-2.5 s, and ``save`` starts none while a flip is pending."""
        if not routes or not self.writer.any_busy():
            return set()
        out: set[P.Route] = set()
        for part in self.ownership.parts.values():
            if self.writer.busy(part.pk):
                out |= part.routes & routes
        return out

    def drain(self) -> None:
        """Wait for every save in flight and act on it (benches, tests)."""
        for part in list(self.ownership.parts.values()):
            if self.writer.busy(part.pk):
                self._settle(part)
        self.harvest()

    def _outcome(self, outcome: Outcome, mirror: bool = True) -> None:
        now = outcome.at
        part = self.ownership.parts.get(outcome.pk)
        if part is None or part.token != outcome.token or part.inflight is not outcome.save:
            return  # the partition was revoked or fenced since: nothing of ours to record
        if outcome.error is not None:
            if not isinstance(outcome.error, (redis.RedisError, OSError)):
                raise outcome.error  # crash-only, as if it had been raised on the loop
            self._failed(part, now, outcome.error)
            return
        status = outcome.status
        assert status is not None
        if status == RESYNC:
            # the next save is a full snapshot with the same records and sequence number, built like
            # any save (after the checks above: a flip, unjudged windows or a dead letter may have
            # come since this one was built)
            log.warning("partition %s: checkpoint gone from Redis; the next save is a full snapshot", part.pk[1])
            old = outcome.save
            part.inflight = None
            part.unsaved = old.windows + part.unsaved
            part.outbox = old.outbox + part.outbox
            part.full = part.dirty = True
            part.agg.mark_all_changed()  # encoded ahead too, a slice at a time
            self.metrics.checkpoints.labels(RESYNC).inc()
            return
        self._finish(part, now, status, outcome.built_s + outcome.seconds, mirror)

    def _rebuild_full(self, part: P.Partition, now: float) -> None:
        """``part.inflight`` again as a full snapshot with the same records and sequence number."""
        part.full = True
        old = part.inflight
        assert old is not None
        part.inflight = self.build_save(part, now, old.windows, old.outbox, seq=old.seq)

    def _write(self, part: P.Partition, now: float) -> str:
        """Send ``part.inflight``; on ``RESYNC`` resend it as a full snapshot with the same records."""
        assert part.inflight is not None
        status = self.checkpoints.save(part.pk[1], part.token, part.inflight)
        if status == RESYNC:
            log.warning("partition %s: checkpoint gone from Redis; saving a full snapshot", part.pk[1])
            self._rebuild_full(part, now)
            status = self.checkpoints.save(part.pk[1], part.token, part.inflight)
        return status

    def build_save(self, part: P.Partition, now: float, windows: list[str], outbox: list[str],
                   seq: int | None = None) -> PendingSave:
        """What the next save of ``part`` writes (everything when ``part.full``, else what changed)."""
        assert self.ingest is not None
        offset = self.ingest.next_offset.get(part.pk)
        if offset is None:
            offset = part.start_offset if part.start_offset is not None else self.ingest.position(part.pk)
        pc = self.wm.parts.get(part.pk)
        blob = P.checkpoint_blob(part, offset, pc.max_ts if pc else None, self.cfg.instance, now,
                                 topic_id=self.ownership.topic_id)
        full = part.full
        ahead = self._take_encoded(part)
        # encoded ahead and not changed since (a route that changed again is in dirty_routes: encoded anew)
        routes = (part.routes - ahead.keys()) | (part.dirty_routes & part.routes) if full else \
            part.dirty_routes & part.routes
        by_route = P.engine_states_by_route(self.engine, routes) if routes else {}
        group = self.cfg.kafka.group_id
        engines = {self.keys.engine(group, m, r): doc for (m, r), doc in sorted(ahead.items())
                   if doc is not None and (m, r) in part.routes and (m, r) not in routes
                   and (m, r) not in part.evicted}
        packed = self.cfg.redis.pack_engine_state
        engines.update((self.keys.engine(group, m, r), P.engine_value(by_route[(m, r)], packed))
                       for m, r in sorted(routes) if (m, r) in by_route)
        for m, r in sorted(part.evicted - part.routes):  # forgotten as idle: '' deletes the key
            engines[self.keys.engine(self.cfg.kafka.group_id, m, r)] = ""
        part.evicted = set()
        snapshots, closed = part.agg.snapshot_changes(everything=full)
        part.start_offset = offset
        part.dirty = False
        part.full = False
        part.dirty_routes = set()
        return PendingSave(part.seq + 1 if seq is None else seq, blob, windows, outbox, engines, {}, closed,
                           incremental=not full, snapshots=snapshots, encoder=encode_snapshots)

    # -- golden/GPU signal records -------------------------------------------------------------
    def record_signals(self, signals: list[Signal]) -> None:
        """Golden and GPU signals go into the windows stream too (backtests replay them): with the
        checkpoint of the partition that owns their route, which holds the engine state they move;
        else (a "*" route, or a route no owned partition carries) straight to the stream."""
        for sig in signals:
            part = self.ownership.part_of(sig.model, sig.route)
            record = P.window_record(sig, self.cfg.instance)
            if part is not None:
                part.unsaved.append(record)
                part.dirty = True
            else:
                self.unowned_records.append(record)
        if len(self.unowned_records) > MAX_UNOWNED_RECORDS:  # Redis down for long: keep the newest
            log.warning("dropping %d golden/GPU signal records Redis could not take",
                        len(self.unowned_records) - MAX_UNOWNED_RECORDS)
            del self.unowned_records[:-MAX_UNOWNED_RECORDS]

    def flush_unowned(self) -> None:
        if not self.unowned_records:
            return
        try:
            pipe = self.redis.pipeline(transaction=True)
            for record in self.unowned_records:
                pipe.xadd(self.keys.windows, {"json": record}, maxlen=self.cfg.redis.windows_maxlen,
                          approximate=True)
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self.redis_health.failed(exc, "recording golden/GPU signals")
            return
        self.unowned_records.clear()
