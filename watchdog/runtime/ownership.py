"""Which partitions, and so which routes, this replica owns: assign, restore, revoke, forget, fence.

Events are keyed ``model/route``, so a route lives in one partition and its owner decides for it
(``watchdog.state.partitions``). ``Ownership`` holds the owned ``Partition`` objects, the route ->
partition map (``owner_of``, with Kafka's murmur2 partitioner as the guess for a route known only from
golden/GPU signals), the routes of partitions we lost (their flips are the new owner's), the
partitions another replica fenced us out of, and those whose checkpoint Redis could not give yet.
It also folds each event into its partition's windows (``fold``, the hot path: the ingest sink).

A partition is restored before any of its records is folded: claim (fencing older owners), load the
checkpoint and its routes' engine state, seek to the checkpointed offset. Redis away means wait
(the partition stays paused), never start from blank state. Revoked partitions are checkpointed first
(the ``save`` hook, ``Checkpointer.save``) and then forgotten.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import redis
from kafka.partitioner.default import murmur2

from watchdog.config.settings import Config
from watchdog.core.events import partition_key
from watchdog.ingest.consumer import Ingest
from watchdog.ingest.eventtime import Watermarks
from watchdog.policy import PolicyEngine
from watchdog.runtime.health import Readiness, RedisHealth
from watchdog.state import partitions as P
from watchdog.state.checkpoint import CheckpointStore
from watchdog.windows.aggregator import WindowAggregator

log = logging.getLogger(__name__)

#: seconds between two tries to restore a partition whose checkpoint Redis could not give
RESTORE_RETRY_S = 1.0


class Ownership:
    def __init__(self, cfg: Config, engine: PolicyEngine, checkpoints: CheckpointStore, wm: Watermarks,
                 readiness: Readiness, redis_health: RedisHealth, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.engine = engine
        self.checkpoints = checkpoints
        self.wm = wm
        self.readiness = readiness
        self.redis_health = redis_health
        self.clock = clock
        self.ingest: Ingest | None = None
        #: the partitions we own and have restored (the daemon's ``parts``: never rebound)
        self.parts: dict[P.PartitionKey, P.Partition] = {}
        #: assigned, but Redis could not give their checkpoint yet: paused until it does
        self.unrestored: set[P.PartitionKey] = set()
        self.route_part: dict[P.Route, P.PartitionKey] = {}
        #: partitions another replica took while we were away (a readiness reason while still assigned)
        self.fenced: set[P.PartitionKey] = set()
        self.nparts: int | None = None
        #: id of the topic as last seen: a new one means it was re-created (the broker lost its data)
        self.topic_id: str | None = None
        #: routes of partitions we held and lost: their decisions are the new owner's
        self.revoked_routes: set[P.Route] = set()
        #: the later of the steady and the host clock at the current poll (the ingest sink refuses
        #: events further in the future than that)
        self.poll_now = 0.0
        self._last_restore_try = 0.0
        #: the caps on routes with state (``windows.max_routes_per_partition``, ``windows.max_routes``)
        self.max_part_routes = cfg.windows.max_routes_per_partition
        self.max_routes = cfg.windows.max_routes
        self.max_age_s = cfg.windows.max_age_s or float("inf")
        #: the precisions a flag may take (``precisions``): an event of another can never be judged, and
        #: each distinct one would open windows of its own on its route
        self.precisions = frozenset(cfg.precisions)
        #: events of new routes refused (``route_limit``), by the cap that refused them
        self.route_limited = {"partition": 0, "replica": 0}
        #: False once the loop failed (crash-only): closing the consumer revokes every partition, and
        #: their state - a poll folded halfway - must not become a checkpoint
        self.save_on_revoke = True
        self._save: Callable[[P.Partition, float], Any] = lambda part, now: None
        self._restored: Callable[[float], Any] = lambda now: None

    def bind(self, save: Callable[[P.Partition, float], Any], restored: Callable[[float], Any]) -> None:
        """``save(part, now)`` checkpoints a partition about to be revoked; ``restored(now)`` runs after
        a restore (the flag reconciliation: a restored route's flips must be in Redis)."""
        self._save = save
        self._restored = restored

    def attach(self, ingest: Ingest) -> None:
        self.ingest = ingest

    # -- the hot path: the ingest sink ---------------------------------------------------------
    def fold(self, event: Any, pk: P.PartitionKey, offset: int) -> str | None:
        """Fold one event into its partition's windows; the dead-letter reason when refused
        (``future``, ``stale``: older than ``windows.max_age_s``, ``late``, ``route_limit``: a new route
        beyond the partition's or the replica's cap, ``unknown_precision``: not one of ``precisions``)."""
        ts = event.ts
        now = self.poll_now
        if ts > now + self.wm.max_future_s:
            return "future"
        if ts < now - self.max_age_s:
            return "stale"
        if event.precision not in self.precisions:
            return "unknown_precision"
        part = self.parts[pk]
        route = (event.model, event.route)
        if route in part.routes:
            if not part.agg.add(event, pk, offset):
                return "late"
        else:
            if len(part.routes) >= self.max_part_routes:
                self.route_limited["partition"] += 1
                return "route_limit"
            if len(self.route_part) >= self.max_routes:
                self.route_limited["replica"] += 1
                return "route_limit"
            if not part.agg.add(event, pk, offset):
                return "late"
            part.routes.add(route)
            part.evicted.discard(route)
            self.route_part[route] = pk
            self.revoked_routes.discard(route)
        part.last_seen[route] = now
        self.wm.observe(pk, ts, now, offset)
        part.dirty = True
        return None

    # -- rebalance -----------------------------------------------------------------------------
    def assigned(self, pks: list[P.PartitionKey]) -> None:
        """Rebalance callback: restore every newly assigned partition."""
        assert self.ingest is not None
        self.readiness.clear("starting", self.clock())
        self.nparts = self.ingest.partition_count() or self.nparts
        for pk in pks:
            if pk not in self.parts:
                self.restore(pk)

    def revoked(self, pks: list[P.PartitionKey]) -> None:
        """Rebalance callback: checkpoint first (what is not in the checkpoint is re-read by the next
        owner from its offset), then forget."""
        now = self.clock()
        for pk in pks:
            part = self.parts.get(pk)
            if part is not None and self.save_on_revoke:
                self._save(part, now)
            self.forget(pk)

    def new_aggregator(self) -> WindowAggregator:
        w = self.cfg.windows
        # future events are refused before they reach a window (in fold, against ``poll_now``)
        return WindowAggregator(length_s=w.length_s, grace_s=w.grace_s, shadow_sample_rate=w.shadow_sample_rate,
                                shadow_max_pairs=w.shadow_max_pairs, max_future_s=float("inf"))

    def restore(self, pk: P.PartitionKey) -> bool:
        """Claim ``pk`` (fencing older owners), load its checkpoint and its routes' engine state, seek."""
        assert self.ingest is not None
        now = self.clock()
        try:
            claim = self.checkpoints.claim(pk[1])
            data = claim.data or {}
            routes = {(str(m), str(r)) for m, r in data.get("routes", [])}
            saved = self.checkpoints.load_engines(sorted(routes))
        except (redis.RedisError, OSError) as exc:
            # never start a partition from blank state because Redis is away: wait for it
            self.redis_health.failed(exc, f"restoring partition {pk[1]}")
            self.unrestored.add(pk)
            self.ingest.pause(pk)
            self.readiness.set("unrestored", f"partition {pk[1]}: checkpoint not loaded (Redis)", now)
            return False
        agg = self.new_aggregator()
        agg.import_open(data.get("windows") or [])
        agg.set_closed_end(self._closed_end_bound(pk, data.get("closed_end"), data.get("max_ts"), now))
        part = P.Partition(pk, claim.token, claim.seq, agg, routes=routes, start_offset=data.get("offset"),
                           full=claim.data is None, last_seen=dict.fromkeys(routes, self.poll_now or now),
                           saved_at=now)
        P.load_engine_states(self.engine, saved)
        for route in routes:
            self.route_part[route] = pk
        self.revoked_routes -= routes
        self.wm.assign(pk, data.get("max_ts"), now)
        self.parts[pk] = part
        self.unrestored.discard(pk)
        self.fenced.discard(pk)
        offset = self._resume_offset(pk, part.start_offset, data.get("topic_id"), now)
        if offset is not None:
            self.ingest.seek(pk, offset)
        self.ingest.resume(pk)
        if not self.unrestored:
            self.readiness.clear("unrestored", now)
        log.info("partition %s restored: token %s, seq %s, offset %s, %d open windows, %d routes", pk[1],
                 claim.token, claim.seq, offset, agg.open_windows(), len(routes))
        self._restored(now)
        return True

    def _closed_end_bound(self, pk: P.PartitionKey, closed_end: int | None, max_ts: float | None,
                          now: float) -> int | None:
        """A checkpoint's "closed up to" mark, never ahead of the steady clock nor the partition's newest
        event (a mark persisted by a host clock that had stepped ahead would make every later event late)."""
        if closed_end is None:
            return None
        limit = int(math.floor(max(now, max_ts or 0.0) / self.cfg.windows.length_s))
        if closed_end > limit:
            log.warning("partition %s: checkpoint's windows-closed mark %.0f s ahead of the clock and of its "
                        "events; brought back to now", pk[1], (closed_end - limit) * self.cfg.windows.length_s)
            return limit
        return closed_end

    def _resume_offset(self, pk: P.PartitionKey, offset: int | None, saved_tid: str | None,
                       now: float) -> int | None:
        """The checkpointed offset, or 0 when the checkpoint is of an earlier topic of this name."""
        assert self.ingest is not None
        tid = self.ingest.topic_id()
        if offset is not None and tid and saved_tid and saved_tid != tid:
            log.error("partition %s: the checkpoint is of an earlier topic with this name (id %s, now %s): "
                      "the broker lost its data; reading from the start", pk[1], saved_tid, tid)
            self.ingest.mark_reset(pk, now)
            return 0
        return offset

    def retry_unrestored(self, now: float) -> None:
        """Try again (at most once a second) the partitions whose checkpoint Redis could not give."""
        if not self.unrestored or now - self._last_restore_try < RESTORE_RETRY_S:
            return
        assert self.ingest is not None
        self._last_restore_try = now
        assigned = set(self.ingest.assignment())
        for pk in list(self.unrestored):
            if pk in assigned:
                self.restore(pk)
            else:
                self.unrestored.discard(pk)

    def forget(self, pk: P.PartitionKey) -> None:
        part = self.parts.pop(pk, None)
        self.unrestored.discard(pk)
        self.wm.revoke(pk)
        if self.ingest is not None:
            self.ingest.forget(pk)
        if part is not None:
            P.drop_engine_states(self.engine, part.routes)
            self.revoked_routes |= part.routes
            for route in part.routes:
                if self.route_part.get(route) == pk:
                    del self.route_part[route]

    def fence(self, pk: P.PartitionKey) -> None:
        """Another replica took ``pk`` while we were away: stop acting for it (it is re-read by them)."""
        log.error("partition %s: ownership taken by another replica (fenced); dropping our state of it", pk[1])
        self.fenced.add(pk)
        if self.ingest is not None and pk in self.parts:
            self.ingest.pause(pk)
        self.forget(pk)

    def fenced_partitions(self) -> list[int]:
        """Partitions we were fenced out of that the group still hands us. Fenced is wrong only while
        that lasts: once the rebalance moved them elsewhere (or we re-claimed them) all is consistent."""
        assert self.ingest is not None
        self.fenced &= set(self.ingest.assignment())
        return sorted(pk[1] for pk in self.fenced)

    def check_topic_id(self, now: float) -> None:
        """A new topic id means the topic was re-created (a broker that restarted empty): the old
        offsets mean nothing there. (Comparing positions with end offsets cannot tell: Tansu reports
        the end at the start of its last batch.)"""
        assert self.ingest is not None
        tid = self.ingest.topic_id()
        if tid is None:
            return
        if self.topic_id is not None and tid != self.topic_id:
            log.error("topic %s was re-created (id %s -> %s): the broker lost its data; reading every "
                      "partition from the start", self.cfg.kafka.topic, self.topic_id, tid)
            for pk in list(self.parts):
                self.ingest.mark_reset(pk, now)
                self.ingest.seek(pk, 0)
        self.topic_id = tid

    def dead_lettered(self, pks: set[P.PartitionKey]) -> None:
        """Partitions that dead-lettered: their checkpoint must pass the dead letter once acknowledged."""
        for pk in pks:
            if pk in self.parts:
                self.parts[pk].dirty = True

    # -- routes --------------------------------------------------------------------------------
    def owner_of(self, model: str, route: str) -> P.PartitionKey | None:
        """The owned partition carrying (model, route): where its events came from, else (a route known
        only from golden/GPU signals) where Kafka's default partitioner puts the key ``model/route``."""
        pk = self.route_part.get((model, route))
        if pk is not None or not self.nparts or "*" in (model, route):
            return pk
        guess = (self.cfg.kafka.topic, (murmur2(partition_key(model, route)) & 0x7FFFFFFF) % self.nparts)
        part = self.parts.get(guess)
        if part is None:
            return None
        part.routes.add((model, route))
        part.last_seen[(model, route)] = self.poll_now or self.clock()
        part.evicted.discard((model, route))
        self.route_part[(model, route)] = guess
        return guess

    def part_of(self, model: str, route: str) -> P.Partition | None:
        """The owned partition carrying (model, route), if we own it."""
        pk = self.owner_of(model, route)
        return self.parts.get(pk) if pk is not None else None

    def status(self) -> dict[str, Any]:
        """The partitions section of /status."""
        out = {}
        for pk, part in sorted(self.parts.items()):
            pc = self.wm.parts.get(pk)
            out[str(pk[1])] = {"token": part.token, "seq": part.seq, "open_windows": part.agg.open_windows(),
                               "routes": len(part.routes), "watermark": self.wm.mark(pk),
                               "idle": bool(pc and pc.caught_up_at), "closed_until": part.agg.closed_until}
        return out
