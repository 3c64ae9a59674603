"""Golden signals judged by each route's owner, whichever replica replayed.

The golden scheduler runs on the replica holding the golden lease (``sources.golden.GoldenLeader``),
but a route's policy-engine state (cooldown, flip budget, streaks) and its fencing token live with
the replica that owns the route's Kafka partition. ``GoldenRelay`` joins the two through Redis
(``state.golden_stream``):

* every loop, the replica's finished replays (normally only the holder has any) are written to the
  group's golden signal stream, one entry per replay; kept in memory and retried while Redis fails;
* every replica reads the stream on from its own cursor and returns, as a signal source of the main
  loop, the signals of the routes it owns (``Ownership.owner_of``): they are judged and flipped
  there, fenced with the owner's token. A ``*`` model or route is judged by the holder;
* a route whose partition nobody owns yet (no assignment yet, a rebalance under way) is judged by
  no one for now: its entry stays in the stream, and a replica that is assigned a partition reads
  the last ``REREAD_S`` again (at most ``REREAD_MAX`` entries) and judges what is now its own.
  Re-reading is safe: the policy engine judges a (source, window end) of a route once (its
  ``last_end``, kept in the engine state the checkpoints and flips save), and the relay does not
  hand back an entry it handed back before or one the engine has seen;
* an on-suspicion request (``confirm_with: golden``) raised on a replica that does not hold the
  lease is pushed to the group's request list (once per route per debounce); the holder pops the
  list every loop and asks its scheduler, whose per-job debounce applies.

A failed read or write is a Redis failure (``RedisHealth``: readiness and ``llmwd_redis_up``).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable

import redis

from watchdog.core.metrics import Metrics
from watchdog.core.signals import Signal
from watchdog.policy import PolicyEngine
from watchdog.runtime.health import Readiness, RedisHealth
from watchdog.runtime.ownership import Ownership
from watchdog.sources.golden import GoldenLeader, GoldenScheduler
from watchdog.state.golden_stream import STREAM_MAXLEN, GoldenEntry, GoldenStream

log = logging.getLogger(__name__)

#: how far back a replica reads the stream at start and after it is assigned a partition
REREAD_S = 3600.0
#: at most this many entries are read back then (the newest): all the stream keeps
REREAD_MAX = STREAM_MAXLEN
#: entries read in one loop iteration at most (the rest in the next ones)
READ_BATCH = 100
#: finished replays kept in memory while Redis cannot take them (the newest)
MAX_UNPUBLISHED = 50
#: a forwarded request older than this when the holder takes it is dropped (no replica held the
#: lease meanwhile; the rule that asked asks again while it stays suspect)
REQUEST_MAX_AGE_S = 600.0
#: (entry id, model, route) already handed to the engine, remembered (the newest)
MAX_DELIVERED = 20_000


class GoldenRelay:
    def __init__(self, stream: GoldenStream, scheduler: GoldenScheduler, leader: GoldenLeader, ownership: Ownership,
                 engine: PolicyEngine, redis_health: RedisHealth, metrics: Metrics, instance: str,
                 clock: Callable[[], float]) -> None:
        self.stream = stream
        self.scheduler = scheduler
        self.leader = leader
        self.ownership = ownership
        self.engine = engine
        self.redis_health = redis_health
        self.metrics = metrics
        self.instance = instance
        self.clock = clock
        #: where this replica reads on; None: read the recent span again first
        self.cursor: str | None = None
        self.unpublished: list[tuple[str, list[Signal]]] = []
        self._delivered: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._known_parts: set[tuple[str, int]] = set()
        #: (model, route) -> when this replica last forwarded a request for it (non-holder debounce)
        self._forwarded: dict[tuple[str, str], float] = {}
        leader.forward = self.forward

    # -- the signal source of the main loop ----------------------------------------------------
    def __call__(self, now: float) -> list[Signal]:
        """Publish finished replays, hand requests to the scheduler (holder), return our routes' signals."""
        self.unpublished += [(job, run) for job, run in self.scheduler.drain_runs() if run]
        if len(self.unpublished) > MAX_UNPUBLISHED:
            log.warning("dropping %d golden replays Redis could not take", len(self.unpublished) - MAX_UNPUBLISHED)
            del self.unpublished[:-MAX_UNPUBLISHED]
        try:
            if self.unpublished:
                self.stream.publish(self.unpublished)
                self.metrics.golden_stream.labels("published").inc(len(self.unpublished))
                self.unpublished = []
            if self.leader.running:
                for req in self.stream.pop_requests():
                    if now - req["at"] > REQUEST_MAX_AGE_S:
                        log.info("golden replay request for %s/%s from %s dropped: %.0f s old", req["model"],
                                 req["route"], req.get("by"), now - req["at"])
                        continue
                    started = self.scheduler.request(req["model"], req["route"],
                                                     f"{req.get('reason', '')} (asked by {req.get('by', '?')})", now)
                    log.info("golden replay request for %s/%s from %s: %s", req["model"], req["route"],
                             req.get("by"), ", ".join(started) or "debounced or no job")
            entries = self._read()
        except (redis.RedisError, OSError) as exc:
            self.metrics.golden_stream.labels("error").inc()
            self.redis_health.failed(exc, "golden signal stream")
            return []
        self.redis_health.recovered()
        return self._mine(entries, now)

    def _read(self) -> list[GoldenEntry]:
        parts = set(self.ownership.parts)
        if parts - self._known_parts:
            self.cursor = None  # newly assigned partitions: their routes' recent signals may wait there
        if self.cursor is None:
            entries, cursor = self.stream.recent(REREAD_S, REREAD_MAX)
        else:
            entries = self.stream.read(self.cursor, READ_BATCH)
            cursor = entries[-1].id if entries else self.cursor
        # only now: a failed read leaves the cursor and the partitions to retry
        self.cursor = cursor
        self._known_parts = parts
        return entries

    def _mine(self, entries: list[GoldenEntry], now: float) -> list[Signal]:
        out = []
        for entry in entries:
            # a replay's signals of one route (candidate and baseline) go together or not at all
            routes: dict[tuple[str, str], list[Signal]] = {}
            for sig in entry.signals:
                routes.setdefault((sig.model, sig.route), []).append(sig)
            for (model, route), sigs in routes.items():
                key = (entry.id, model, route)
                if key in self._delivered or not self._owns(sigs[0]) or all(self._seen(s) for s in sigs):
                    continue
                self._delivered[key] = None
                out.extend(sigs)
                pk = self.ownership.owner_of(model, route)
                part = self.ownership.parts.get(pk) if pk is not None else None
                if part is not None:  # a judged replay is activity: a route only golden jobs see is kept
                    part.last_seen[(model, route)] = now
        while len(self._delivered) > MAX_DELIVERED:
            self._delivered.popitem(last=False)
        if out:
            self.metrics.golden_stream.labels("judged").inc(len(out))
        return out

    def _owns(self, sig: Signal) -> bool:
        if "*" in (sig.model, sig.route):
            return self.leader.running
        return self.ownership.owner_of(sig.model, sig.route) in self.ownership.parts

    def _seen(self, sig: Signal) -> bool:
        """The engine judged this source's window of the route already (in every policy that did one)."""
        ends = [st.last_end[sig.source] for st in self.engine.scopes_of((sig.model, sig.route)).values()
                if sig.source in st.last_end]
        return bool(ends) and min(ends, default=-math.inf) >= sig.end

    def status(self) -> dict[str, object]:
        """The /status view: where this replica reads, what waits to be written."""
        return {"cursor": self.cursor, "unpublished": len(self.unpublished), "key": self.stream.key}

    # -- on-suspicion requests -----------------------------------------------------------------
    def forward(self, model: str, route: str, reason: str, now: float) -> None:
        """A replay asked for on a replica that does not replay: to the holder, through Redis."""
        debounce = self.scheduler.debounce_s
        for key, at in list(self._forwarded.items()):
            if now - at >= debounce:
                del self._forwarded[key]
        if now - self._forwarded.get((model, route), -math.inf) < debounce:
            return
        if len(self._forwarded) >= 10_000:  # bounded: a flood of routes forwards without the debounce
            self._forwarded.clear()
        try:
            self.stream.push_request(model, route, reason, now, self.instance)
        except (redis.RedisError, OSError) as exc:
            self.redis_health.failed(exc, "golden replay request")
            return
        self._forwarded[(model, route)] = now
        self.metrics.golden_stream.labels("requested").inc()
        log.info("golden replay of %s/%s asked of the golden lease holder: %s", model, route, reason)


def golden_readiness(readiness: Readiness, leader: GoldenLeader, now: float) -> None:
    """Hold the readiness reason ``golden`` (one warning page) while a job of this replica's scheduler
    judged nothing of FP8 at its last replay (``GoldenScheduler.failing``: an invalid or missing set,
    a replay that raised, a baseline that failed every item, a metric the golden rules judge not
    measured); clear it at the next replay that judged.
    Only the lease holder replays, so only it can name the reason."""
    failing = leader.scheduler.failing() if leader.running else {}
    if failing:
        text = "; ".join(f"{job}: {why}" for job, why in sorted(failing.items()))
        readiness.set("golden", f"golden replays judge nothing: {text}"[:500], now)
    else:
        readiness.clear("golden", now)
