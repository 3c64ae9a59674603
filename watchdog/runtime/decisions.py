"""From signals to flag writes and pages: the decision path of the daemon, on its one thread.

``Decisions.decide`` hands closed windows and golden/GPU signals to ``PolicyEngine.observe`` with the
flags as they are now, and dispatches each action: a rollback/promote goes to the ``Actuator`` (the
flip, the engine state it implies and its page are one Lua script, fenced by the owning partition's
token: ``flip_extras``); an alert rides with the owning partition's next checkpoint (outbox) or, for
a route no owned partition carries, goes to the alerter at once. ``reconcile`` re-asserts a flag Redis
lost (a restart without persistence, a failover) that our engine state says we set.

One view of the flags: ``FlagView`` over the ``RoutingFlags`` cache, the same reader the gateway
uses (kept current by pub/sub within milliseconds, reloaded after every reconnect and every
``FLAG_RELOAD_S``). The daemon decides, reconciles, reports /status and exports
``llmwd_route_precision_is_candidate`` from it, so no two reads disagree and the decision path does
no Redis round trip; the cache's periodic reload replaces the direct read the reconciliation used to
make. A cache that is not current (never loaded, or its connection down) finds no flag lost:
re-asserting against stale data would be a guess. The cache lags our own writes by a pub/sub message,
so ``FlagView`` overlays each flip we applied until the cache shows its epoch (at most
``WRITE_VISIBLE_S``): a flip just written is never taken for a lost one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import redis

from watchdog.actuation.actuator import REVOKED, Actuator, FlagStore, FlipExtras
from watchdog.actuation.outbox import action_record
from watchdog.actuation.routing import RoutingFlags
from watchdog.alerting.alerter import Alerter
from watchdog.config.settings import Config
from watchdog.core.keys import Flag, Keys
from watchdog.core.metrics import Metrics, worst_judgeability
from watchdog.core.signals import Action, Signal
from watchdog.policy import PolicyEngine, changes
from watchdog.policy.status import state_judgeability_rows
from watchdog.runtime.budget import PutOff, StepDeadline
from watchdog.runtime.evidence import EvidenceRecorder
from watchdog.runtime.health import RedisHealth
from watchdog.runtime.maintenance import MaintenanceReader
from watchdog.runtime.ownership import Ownership
from watchdog.runtime.stats import DaemonStats
from watchdog.sources.golden import GoldenLeader
from watchdog.state import partitions as P
from watchdog.state.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

#: seconds between two checks that the flags our engine state says we set are still there (no I/O:
#: the check reads the cache)
RECONCILE_EVERY_S = 1.0
#: the daemon's cache checks for missed flag changes this often (``RoutingFlags.ttl_s``): a flag lost
#: without a reconnect (FLUSHALL, a route deleted with its index entry) is seen within this plus
#: ``RECONCILE_EVERY_S``, i.e. 5 s
FLAG_RELOAD_S = 4.0
#: seconds between two exports of ``llmwd_route_precision_is_candidate``
EXPORT_EVERY_S = 1.0
#: routes an export sets between two looks at the iteration's deadline (one export of 10,000 routes
#: cost the loop 20-95 ms at once): it stops there after at least one slice and goes on next time
EXPORT_SLICE = 2_000
#: seconds between two exports of the rules' judgeability gauges (a snapshot of every route's state)
JUDGEABILITY_EVERY_S = 10.0
#: scopes (policy, model, route) one loop iteration reads for those gauges
JUDGEABILITY_CHUNK = 1_000
#: iterations in a row a judgeability chunk waits for when the iteration's shared deadline has passed
JUDGEABILITY_MAX_WAITS = 4
#: scopes read between two looks at that deadline (a chunk of 1,000 took 30-90 ms at 10,000 routes):
#: a chunk stops at the deadline after at least one slice, and the rest of the pass goes on next time
JUDGEABILITY_SLICE = 100
#: the longest a flip we wrote overlays the cache that has not shown it yet
WRITE_VISIBLE_S = 2.0
#: routes judged in one loop iteration at most: when more windows close at once (thousands of
#: routes), the rest wait for the next iterations, so the loop keeps polling and reporting
MAX_DECIDE_ROUTES = 1000
#: ... and for at most this long (checked after every chunk of at most ``DECIDE_CHUNK_ROUTES`` routes):
#: on a slow or loaded machine 1,000 routes take seconds
DECIDE_BUDGET_S = 0.3
DECIDE_CHUNK_ROUTES = 100
#: a chunk holds the routes judged in about this long, by the running cost per route: at 10,000 routes a
#: chunk of 100 (with a backlog, 250-380 windows) took 0.05-0.16 s, and one chunk is judged even after
#: the iteration's deadline, so it ran past it by that much
DECIDE_CHUNK_S = 0.02


class Backlog:
    """Closed windows' signals waiting to be judged, kept by route across loop iterations: ``add``
    ranks each route once, when its first waiting signal arrives (``rank``: 0, 1 or 2, the engine's
    ``judging_rank``: near a rollback, known, new); ``take(n)`` hands over every ``*`` signal, then the
    signals of the next ``n`` routes, lower ranks first (a flood of new route names waits behind the
    routes being judged, which keep their reaction time, and a route near a rollback is judged before
    10,000 others), routes of a rank in the order they arrived, a rank's signals in the order they arrived. Re-ranking and
    re-splitting the whole backlog every iteration cost O(backlog) per iteration: at 10,000 routes the
    backlog is most of them, and with the iteration's shared deadline a backlog is judged over many
    iterations (a catch-up: hundreds), so that work grew with its square."""

    def __init__(self, rank: Callable[[str, str], int]) -> None:
        self.rank = rank
        self.seq = 0
        #: the ``*`` signals waiting (the next ``take`` has them all), as (arrival, signal)
        self.stars: list[tuple[int, Signal]] = []
        #: each waiting route's signals, as (arrival, signal)
        self.by_route: dict[P.Route, list[tuple[int, Signal]]] = {}
        #: the waiting routes of each rank, in the order they arrived
        self.order: tuple[deque[P.Route], ...] = (deque(), deque(), deque())
        #: the routes waiting (the same set object all along: the checkpointer holds it)
        self.routes: set[P.Route] = set()
        #: each waiting route's arrival (monotonic seconds of its first waiting signal): ``age``
        self.since: dict[P.Route, float] = {}
        #: each waiting route's windows waiting (its precisions' signals of one window end count once)
        #: and the end of its newest, and the windows waiting in all
        self.ends: dict[P.Route, tuple[int, float]] = {}
        self.windows = 0

    def __bool__(self) -> bool:
        return bool(self.stars) or bool(self.by_route)

    def __len__(self) -> int:
        """The routes waiting."""
        return len(self.by_route)

    def windows_per_route(self) -> float:
        """Windows waiting per waiting route: about 1 while each route's window is judged before its next
        closes, more when judging runs behind the windows closing."""
        return self.windows / len(self.by_route) if self.by_route else 0.0

    def age(self, now: float) -> float:
        """Seconds (monotonic ``now``) the longest-waiting route has waited; 0.0 when none waits. Each
        rank's queue is in arrival order, so its oldest route is its first."""
        since = self.since
        first = [since[q[0]] for q in self.order if q]
        return now - min(first) if first else 0.0

    def add(self, signals: list[Signal]) -> None:
        at = time.monotonic()
        for s in signals:
            self.seq += 1
            route = (s.model, s.route)
            if "*" in route:
                self.stars.append((self.seq, s))
                continue
            waiting = self.by_route.get(route)
            if waiting is None:
                waiting = self.by_route[route] = []
                self.order[self.rank(*route)].append(route)
                self.routes.add(route)
                self.since[route] = at
            waiting.append((self.seq, s))
            n, end = self.ends.get(route, (0, None))
            if end != s.end:
                self.ends[route] = (n + 1, s.end)
                self.windows += 1

    def take(self, max_routes: int, max_rank: int = 2) -> list[Signal]:
        """With ``max_rank`` 0, only routes near a rollback (and no ``*`` signal)."""
        out: list[Signal] = []
        if max_rank >= 2:
            out = [s for _, s in self.stars]
            self.stars = []
        n = max(max_routes, 0)
        for queue in self.order[:max_rank + 1]:
            picked: list[tuple[int, Signal]] = []
            while n and queue:
                route = queue.popleft()
                picked += self.by_route.pop(route)
                self._forget(route)
                n -= 1
            picked.sort(key=_arrival)
            out += [s for _, s in picked]
        return out

    def _forget(self, route: P.Route) -> None:
        self.routes.discard(route)
        del self.since[route]
        self.windows -= self.ends.pop(route)[0]

    def drop(self, gone: set[P.Route] | frozenset[P.Route]) -> None:
        """Forget the waiting signals of these routes."""
        hit = [r for r in gone if r in self.by_route]
        if not hit:
            return
        for route in hit:
            del self.by_route[route]
            self._forget(route)
        self.order = tuple(deque(r for r in queue if r in self.by_route) for queue in self.order)


def _arrival(item: tuple[int, Signal]) -> int:
    return item[0]


class FlagView:
    """The daemon's one view of the routing flags (see the module docstring). Thread-safe: /status
    reads it from the HTTP thread."""

    def __init__(self, flags: RoutingFlags) -> None:
        self.flags = flags
        self._lock = threading.Lock()
        #: route -> (precision, epoch, monotonic time) of flips we applied that the cache may not show yet
        self._written: dict[P.Route, tuple[str, int, float]] = {}

    @property
    def current(self) -> bool:
        """True when the cache is loaded and its connection up."""
        return self.flags.healthy

    def wrote(self, route: P.Route, precision: str, epoch: int) -> None:
        with self._lock:
            self._written[route] = (precision, epoch, time.monotonic())

    def snapshot(self) -> dict[P.Route, str]:
        """``{(model, route): precision}`` of every route with a flag."""
        out = self.flags.snapshot()
        with self._lock:
            written = list(self._written.items())
        t = time.monotonic()
        for route, entry in written:
            precision, epoch, at = entry
            cached = self.flags.flag(*route)
            if (cached is not None and cached.epoch >= epoch) or t - at > WRITE_VISIBLE_S:
                with self._lock:
                    if self._written.get(route) == entry:
                        del self._written[route]
                continue
            out[route] = precision
        return out


class Decisions:
    def __init__(self, cfg: Config, keys: Keys, engine: PolicyEngine, store: FlagStore, flags: RoutingFlags,
                 alerter: Alerter, ownership: Ownership, checkpoints: CheckpointStore, redis_health: RedisHealth,
                 metrics: Metrics, stats: DaemonStats, golden: GoldenLeader | None,
                 clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.keys = keys
        self.engine = engine
        self.flags = FlagView(flags)
        self.alerter = alerter
        self.ownership = ownership
        self.checkpoints = checkpoints
        self.redis_health = redis_health
        self.metrics = metrics
        self.stats = stats
        self.golden = golden
        self.clock = clock
        self.store = store
        #: maintenance annotations, read off the loop once the daemon starts its thread
        self.maintenance = MaintenanceReader(store.client, keys, redis_health.failed,
                                             metrics.redis_round_trip.set)
        self.actuator = Actuator(store, changed_by=f"watchdog@{cfg.instance}", extras=self.flip_extras)
        #: (model, route) -> end of the window that caused the pending flip, and when the watermark closed
        #: it (None: not a window the watermark closed; the reaction metrics)
        self._decided_at: dict[P.Route, tuple[float, float | None]] = {}
        #: when the watermark closed the window ending at a time (the daemon binds ``WindowCloser.closed_at``)
        self.closed_at: Callable[[float], float | None] = lambda end: None
        #: open per-route ops incidents (refused or re-asserted flips): resolved when a later flip
        #: of the route goes through
        self._open_incidents: set[str] = set()
        self._last_reconcile = 0.0
        #: the cache's flags at the last ``lost_pins`` (by identity: its pins change only with them)
        self._pins_seen: Mapping[P.Route, Flag] | None = None
        #: route -> pinned_until of each pin put back, so that one is put back once while its write travels
        self._put_back: dict[P.Route, float | None] = {}
        self._last_export = 0.0
        self._last_judgeability = 0.0
        #: the judgeability pass under way: the scopes still to read, and the rows read so far
        #: the loop iteration's shared deadline (``Daemon.step`` starts it; never reached outside it)
        self.step = StepDeadline()
        #: the next judgeability chunk waits while the iteration's deadline has passed (not for ever)
        self._jb_put_off = PutOff(JUDGEABILITY_MAX_WAITS)
        self._jb_pass: tuple[list[tuple[str, str, str]], list[dict[str, Any]]] | None = None
        #: route -> value last exported to ``llmwd_route_precision_is_candidate``
        self._exported: dict[P.Route, int] = {}
        #: the export under way: the routes still to go through, every route it exports, and the view of
        #: the flags and of the routes' policies it reads
        self._export_pass: tuple[list[P.Route], set[P.Route], dict[P.Route, str], dict[P.Route, Any]] | None = None
        #: signals of closed windows not judged yet (``MAX_DECIDE_ROUTES``), and their routes: the
        #: partitions carrying them are not checkpointed until they are
        self.backlog = Backlog(engine.judging_rank)
        self.deferred_routes: set[P.Route] = self.backlog.routes
        #: routes whose engine state, when last judged here, said a rollback may be near (rank 0 of
        #: ``PolicyEngine.judging_rank``), with how near (``PolicyEngine.nearness``): the closer closes
        #: their windows first (``WindowCloser.first``), and they are judged nearest first. Only an order:
        #: a route that moved away stays in it until judged again
        self.near: dict[P.Route, float] = {}
        #: seconds of loop time per route judged, a running mean over the chunks (sizes the next chunk)
        self.route_cost_s = DECIDE_CHUNK_S / DECIDE_CHUNK_ROUTES
        #: evidence records of the decisions (runtime/evidence.py); None: not kept
        self.evidence: EvidenceRecorder | None = None
        #: of the routes about to be flipped, those whose flips wait (the daemon binds
        #: ``Checkpointer.saving``: a checkpoint in flight must not land after a flip of its routes)
        self.flips_wait: Callable[[set[P.Route]], set[P.Route]] = lambda routes: set()

    # -- deciding ------------------------------------------------------------------------------
    def decide(self, signals: list[Signal], now: float, near_only: bool = False) -> None:
        """Judge ``signals`` (after those deferred before): routes near a rollback first, then those the
        engine knows, then new ones (``Backlog``), at most
        ``MAX_DECIDE_ROUTES`` routes and about ``DECIDE_BUDGET_S`` now; the rest wait (and their
        partitions are not checkpointed) until the next iterations. ``near_only``: only the routes
        near a rollback (the loop judges them before it closes the other windows)."""
        backlog = self.backlog
        if backlog and self.ownership.revoked_routes:  # a lost partition's windows: the new owner's
            backlog.drop(self.ownership.revoked_routes)
        if near_only:  # nearest first (stable: a route's windows keep their order)
            near = self.near
            signals = sorted(signals, key=lambda s: -near.get((s.model, s.route), 0.0))
        backlog.add(signals)
        if not backlog or (near_only and not backlog.order[0]):
            return
        flags = self.flags.snapshot()
        for route, precision in self.lost_flags(flags).items():
            # our flip is gone from Redis: the engine must not read that as an operator's change
            flags[route] = precision
            self.reassert(route, precision, now)
        until = min(time.monotonic() + DECIDE_BUDGET_S, self.step.until)  # after at least one chunk
        judged = 0
        while backlog and judged < MAX_DECIDE_ROUTES:
            fit = max(1, int(DECIDE_CHUNK_S / max(self.route_cost_s, 1e-7)))
            chunk = backlog.take(min(DECIDE_CHUNK_ROUTES, fit, MAX_DECIDE_ROUTES - judged), 0 if near_only else 2)
            if not chunk:
                break
            touched = {(s.model, s.route) for s in chunk}
            judged += len(touched)
            t0 = time.perf_counter()
            self._decide_now(chunk, touched, flags, now)
            if touched:
                self.route_cost_s += ((time.perf_counter() - t0) / len(touched) - self.route_cost_s) / 4
            if time.monotonic() >= until:
                break

    def _decide_now(self, signals: list[Signal], touched: set[P.Route], flags: dict[P.Route, str],
                    now: float) -> None:
        """Judge these routes' closed windows and dispatch what the engine decides."""
        self.mark_maintenance(signals, touched)
        actions = self.engine.observe(signals, now, flags, self.cfg.default_precision)
        nearness, near = self.engine.nearness, self.near
        for route in touched:
            if "*" in route:
                continue
            how = nearness(*route)
            if how is None:
                near.pop(route, None)
            else:
                near[route] = how
        if self.evidence is not None:
            self.evidence.observe(signals, touched, now)
        everywhere = any("*" in r for r in touched)
        for part in self.ownership.parts.values():
            # engine state of these routes may have changed (a "*" signal, e.g. GPU health, touches all)
            mine = part.routes if everywhere else part.routes & touched
            if mine:
                part.dirty_routes |= mine
                part.dirty = True
        for action in actions:
            self.dispatch(action)

    def mark_maintenance(self, signals: list[Signal], routes: set[P.Route]) -> None:
        """Mark live signals inside an operator's maintenance span (``Keys.maintenance``; one MGET
        over the signals' routes and their ``*`` model): the learned latency rules re-baseline there.
        Redis away: nothing is marked (those windows are judged as usual) and readiness says why."""
        wanted = sorted({r for r in routes if "*" not in r} | {("*", route) for _m, route in routes if route != "*"})
        if not wanted or not any(s.source == "live" for s in signals):
            return
        try:
            found = self.maintenance.values(wanted)
        except (redis.RedisError, OSError) as exc:
            self.redis_health.failed(exc, "reading maintenance annotations")
            return
        if found:
            changes.mark_maintenance(signals, changes.maintenance_spans(found))

    def dispatch(self, action: Action) -> None:
        if self.evidence is not None:  # before anything carries the action: its pages link to the record
            flag = self.flags.flags.flag(action.model, action.route)
            self.evidence.decided(action, flag.precision if flag is not None else None)
        self.stats.record_action(action)
        self.metrics.verdicts.labels(action.kind, action.policy, str(action.dry_run).lower()).inc()
        log.info("action %s %s/%s by %s%s: %s", action.kind, action.model, action.route, action.policy,
                 " (dry run)" if action.dry_run else "", action.reason)
        detail = action.detail or {}
        if str(detail.get("blocked") or "").startswith("flip budget"):
            self.metrics.budget_exhausted.labels(action.policy).inc()
        if self.golden is not None and detail.get("request_replay"):
            self.golden.request(action.model, action.route, action.reason, self.clock())
        pk = self.ownership.owner_of(action.model, action.route)
        if action.kind in ("rollback", "promote") and not action.dry_run:
            if pk is None and (action.model, action.route) in self.ownership.revoked_routes:
                log.warning("%s of %s/%s not applied: the route's partition moved to another replica",
                            action.kind, action.model, action.route)
                self.metrics.flips.labels("not_owner").inc()
                return
            # the page goes with the flip (flip.lua writes the outbox record); a route no assigned
            # partition carries (a GPU signal of this host; golden signals reach only owners) flips unfenced
            self.actuator.submit(action)
            end = action.at or self.clock()
            self._decided_at[(action.model, action.route)] = (end, self.closed_at(end))
            return
        part = self.ownership.parts.get(pk) if pk is not None else None
        if part is not None:
            part.outbox.append(action_record(action, self.cfg.instance))
            part.dirty = True
        else:
            self.alerter.handle(action)

    def flip_extras(self, action: Action) -> FlipExtras:
        """What the flip of ``action`` writes with it: the owner's fence, the route's engine state, the page."""
        route = (action.model, action.route)
        part = self.ownership.part_of(*route)
        page = "" if (action.detail or {}).get("reassert") else action_record(action, self.cfg.instance)
        engine_key = self.keys.engine(self.cfg.kafka.group_id, *route)
        if part is None:
            # not ours (see dispatch): fenced out if it was ours once, else unfenced without engine state
            token = REVOKED if route in self.ownership.revoked_routes else ""
            return FlipExtras(owner_key=self.checkpoints.owner_key(-1), token=token, engine_key=engine_key,
                              engine_json="", outbox_key=self.keys.outbox, outbox_json=page)
        scopes = {pol: st.to_json() for pol, st in self.engine.scopes_of(route).items()}
        engine_json = P.engine_value(scopes, self.cfg.redis.pack_engine_state)
        return FlipExtras(owner_key=self.checkpoints.owner_key(part.pk[1]), token=part.token,
                          engine_key=engine_key, engine_json=engine_json, outbox_key=self.keys.outbox,
                          outbox_json=page)

    # -- writing -------------------------------------------------------------------------------
    def act(self, now: float) -> None:
        """Try the pending flips; count, time and report what finished."""
        pending = self.actuator.pending_routes()
        for result in self.actuator.pump(now, wait=self.flips_wait(pending)):
            self.metrics.flips.labels("applied" if result.applied else "unchanged" if result.unchanged
                                      else str(result.refused)).inc()
            decided = self._decided_at.pop((result.model, result.route), None)
            if result.applied:
                self.flags.wrote((result.model, result.route), result.precision, result.epoch)
                if decided is not None:
                    end, closed = decided
                    written = self.clock()  # not ``now``: the iteration's judging came before this write
                    self.metrics.window_end_to_flip_seconds.observe(max(0.0, written - end))
                    if closed is not None:
                        self.metrics.close_to_flip_seconds.observe(max(0.0, written - closed))
            if result.applied or result.unchanged:
                self._resolve(f"refused/{result.model}/{result.route}", "a later switch went through")
                if result.applied:
                    self._resolve(f"reassert/{result.model}/{result.route}", f"flag re-asserted: {result.precision}")
            if result.refused == "fenced":
                pk = self.ownership.owner_of(result.model, result.route)
                if pk is not None:
                    self.ownership.fence(pk)
            elif result.refused:
                key = f"refused/{result.model}/{result.route}"
                self._open_incidents.add(key)
                self.alerter.ops_alert(key, f"switch of {result.model}/{result.route} to {result.precision} refused: "
                                       f"{result.refused}", "warning", {"policy": result.policy})
        self.metrics.pending.set(self.actuator.pending())
        self.redis_health.writer(self.actuator.healthy, self.actuator.last_error)

    # -- lost flags ----------------------------------------------------------------------------
    def reconcile(self, now: float, force: bool = False) -> None:
        """Re-assert a flag Redis lost (restart without persistence, failover) that our engine state
        says we set: a cooldown never blocks restoring the safe state."""
        if not force and now - self._last_reconcile < RECONCILE_EVERY_S:
            return
        self._last_reconcile = now
        lost = self.lost_flags(self.flags.snapshot())
        for route, precision in lost.items():
            self.reassert(route, precision, now)
        pins = self.lost_pins(time.time())
        if lost or pins:
            self.act(now)

    def lost_pins(self, wall: float) -> int:
        """Put back the operators' pins still in force whose flag Redis lost (a restart without
        persistence, an evicting ``maxmemory`` policy): a pin holds a route against the policies, so
        a pin that quietly vanished let a route an operator held on FP16 go back to FP8. Only routes
        of this replica's partitions, as for our own flips; the number put back."""
        flags = self.flags.flags.mapping
        if not self.flags.current or flags is self._pins_seen:
            return 0  # the cache is the one of the last look: no pin appeared or vanished since
        self._pins_seen = flags
        pins = self.flags.flags.pins  # read after the flags: at least as new as they are
        put_back = 0
        for route, flag in pins.items():
            if route in flags or not flag.pinned(wall) or self._put_back.get(route) == flag.pinned_until \
                    or self.ownership.owner_of(*route) not in self.ownership.parts:
                continue
            model, name = route
            until = flag.pinned_until or wall
            log.error("pin of %s/%s (%s until %s) is gone from Redis; putting it back", model, name,
                      flag.precision, until)
            self.actuator.submit_pin(model, name, flag.precision, until,
                                     f"pin put back: its flag was lost from Redis (was: {flag.reason})"[:500])
            key = f"reassert/{model}/{name}"
            self._open_incidents.add(key)
            self.alerter.ops_alert(key, f"pin of {model}/{name} was lost from Redis; putting back {flag.precision} "
                                   f"until {until:.0f}", "warning", {})
            self._put_back[route] = flag.pinned_until
            put_back += 1
        for route in [r for r in self._put_back if r in flags or r not in pins]:
            del self._put_back[route]  # back in the flags (or its pin gone): a later loss is put back again
        return put_back

    def lost_flags(self, flags: dict[P.Route, str]) -> dict[P.Route, str]:
        """Owned routes our engine state says we flipped whose flag is absent from ``flags``."""
        if not self.flags.current:
            return {}
        pending = self.actuator.pending_routes()
        out: dict[P.Route, str] = {}
        for key, precision in self.engine.flipped_routes(self.cfg.default_precision).items():
            if key in flags or key in pending or self.ownership.owner_of(*key) not in self.ownership.parts:
                continue
            out[key] = precision
        return out

    def reassert(self, route: P.Route, precision: str, now: float) -> None:
        model, name = route
        policy = self.engine.policy_of(route)
        log.error("flag of %s/%s is gone from Redis; re-asserting %s", model, name, precision)
        self.actuator.submit(Action(kind="rollback", policy=policy.name if policy else "", model=model,
                                    route=name, reason=f"re-asserted {precision}: the flag was lost from Redis",
                                    severity="critical", precision=precision, at=now, detail={"reassert": True}))
        key = f"reassert/{model}/{name}"
        self._open_incidents.add(key)
        self.alerter.ops_alert(key, f"flag of {model}/{name} was lost from Redis; re-asserting {precision}",
                               "warning", {})

    def _resolve(self, key: str, summary: str) -> None:
        if key in self._open_incidents:
            self._open_incidents.discard(key)
            self.alerter.ops_resolve(key, summary)

    # -- the precision gauge -------------------------------------------------------------------
    def export_flags(self, now: float) -> None:
        """``llmwd_route_precision_is_candidate{model, route}``: 1 while the route serves its policy's
        candidate (``default_precision`` without a policy), else 0; for every route with a flag or with
        engine state here. The series of a route no longer known is removed. An export reads one view
        of the flags and the engine's routes, and goes through them ``EXPORT_SLICE`` at a time: when this
        iteration's deadline has passed, the rest waits for the next iterations."""
        if self._export_pass is None:
            if now - self._last_export < EXPORT_EVERY_S:
                return
            self._last_export = now
            flags = self.flags.snapshot()
            policies = self.engine.route_policies()
            known = set(flags) | set(policies)
            self._export_pass = (list(known), known, flags, policies)
            if self.step.passed():
                return
        todo, known, flags, policies = self._export_pass
        default = self.cfg.default_precision
        gauge = self.metrics.route_precision
        exported = self._exported
        at = 0
        while at < len(todo):
            for route in todo[at:at + EXPORT_SLICE]:
                policy = policies.get(route)
                candidate = policy.candidate if policy is not None else default
                value = 1 if flags.get(route, default) == candidate else 0
                # only what changed: a label lookup per known route every second cost seconds at 8,000 routes
                if exported.get(route) != value:
                    gauge.labels(*route).set(value)
                    exported[route] = value
            at += EXPORT_SLICE
            if self.step.passed():
                break
        if at < len(todo):
            self._export_pass = (todo[at:], known, flags, policies)
            return
        self._export_pass = None
        for route in [r for r in exported if r not in known]:
            gauge.remove(*route)
            del exported[route]

    def export_judgeability(self, now: float) -> None:
        """``llmwd_rule_judged`` / ``llmwd_rule_mde`` from the engine's state (bounded in Metrics): a
        pass over every scope every ``JUDGEABILITY_EVERY_S``, ``JUDGEABILITY_CHUNK`` scopes per loop
        iteration (one pass over 8,000 routes cost the loop ~0.3-0.7 s at once); the gauges change
        when a pass completes."""
        states = self.engine.states
        if self._jb_pass is None and now - self._last_judgeability < JUDGEABILITY_EVERY_S:
            return
        if self._jb_put_off.now(self.step):
            return
        if self._jb_pass is None:
            self._last_judgeability = now
            self._jb_pass = (sorted(states), [])
        keys, rows = self._jb_pass
        at = 0
        while at < min(len(keys), JUDGEABILITY_CHUNK):
            chunk = keys[at:at + min(JUDGEABILITY_SLICE, JUDGEABILITY_CHUNK - at)]
            at += len(chunk)
            # only the rows the gauges can show are kept between the chunks (the same rows as keeping all)
            rows = worst_judgeability(rows + state_judgeability_rows(self.engine.policy_set,
                                                                      {k: states[k] for k in chunk if k in states}))
            if self.step.passed():
                break
        self._jb_pass = (keys[at:], rows)
        if at >= len(keys):
            self._jb_pass = None
            self.metrics.set_judgeability(rows)
