"""The daemon: wires ingest -> windows -> policy engine -> actuator/outbox, in one main loop.

One thread owns the decision path. Reliability contract (docs/OPERATIONS.md):

* windows close on event time (``watchdog.ingest.eventtime``): a stalled broker or loop is a stall, never
  lateness; future and late events are dead-lettered with their reason;
* each partition is checkpointed in Redis (open windows, closed-window records, engine state of its
  routes, next offset) atomically, fenced by an ownership token and idempotent by sequence number;
  a restart, a rebalance or a graceful stop resumes exactly from the checkpoint;
* a flip, the engine state it implies and its page are one Lua script; pages go out from the outbox.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from kafka.partitioner.default import murmur2

from watchdog.actuation.actuator import REVOKED, Actuator, FlagStore, FlipExtras
from watchdog.actuation.outbox import Pager, action_record
from watchdog.actuation.routing import RoutingFlags
from watchdog.alerting.alerter import Alerter
from watchdog.config.settings import Config
from watchdog.core.events import partition_key
from watchdog.core.keys import Keys
from watchdog.core.metrics import Metrics
from watchdog.core.signals import Action, Signal
from watchdog.ingest.consumer import Ingest, make_consumer, make_producer
from watchdog.ingest.eventtime import Watermarks
from watchdog.ingest.otlp import decoder_for
from watchdog.ingest.startup import StartupTimeout, Stopped, bounded, diagnose, redis_cause
from watchdog.policy import PolicyEngine, PolicyError, PolicyLoader
from watchdog.runtime.health import Readiness
from watchdog.state import partitions as P
from watchdog.state.checkpoint import DUPLICATE, FENCED, RESYNC, SAVED, CheckpointStore, PendingSave
from watchdog.state.lease import Lease
from watchdog.state.redis_conn import client_from_url
from watchdog.windows.aggregator import WindowAggregator

log = logging.getLogger(__name__)

#: golden/GPU signal records held for the windows stream while Redis is down, at most
MAX_UNOWNED_RECORDS = 10_000

#: a source of signals other than Kafka (golden replays, GPU health): called every loop
SignalSource = Callable[[float], list[Signal]]
#: seconds between two broker confirmations that idle partitions are fully read
CONFIRM_EVERY_S = 0.5
#: seconds between two checks that Redis still holds the flags our engine state says we set
RECONCILE_EVERY_S = 5.0


@dataclass
class DaemonStats:
    started_at: float = field(default_factory=time.time)
    last_loop: float = field(default_factory=time.monotonic)
    windows_closed: int = 0
    actions: int = 0
    checkpoints: int = 0
    last_actions: list[dict[str, Any]] = field(default_factory=list)


class Daemon:
    def __init__(self, cfg: Config, *, redis_client: redis.Redis | None = None, alerter: Alerter | None = None,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.time,
                 sources: list[SignalSource] | None = None, gpu_nvml: Any = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.metrics = metrics or Metrics()
        self.stats = DaemonStats()
        self.keys = Keys(cfg.redis.prefix)
        self.group = cfg.kafka.group_id
        self.redis = redis_client or client_from_url(cfg.redis.url, timeout_s=cfg.redis.socket_timeout_s)
        self.store = FlagStore(self.redis, self.keys)
        self.checkpoints = CheckpointStore(self.redis, self.keys, self.group, cfg.kafka.topic, cfg.instance,
                                           cfg.redis.windows_maxlen)
        self.actuator = Actuator(self.store, changed_by=f"watchdog@{cfg.instance}", extras=self._flip_extras)
        self.flags = RoutingFlags(cfg.redis.url, self.keys, default_precision=cfg.default_precision)
        self.alerter = alerter or Alerter.from_config(
            [c.model_dump() for c in cfg.alerts.channels], on_page=self.metrics.count_page,
            status_url=cfg.server.status_url)
        self.pager = Pager(self.redis, self.keys, self.group, cfg.instance, self.alerter)
        self.readiness = Readiness(self.metrics, self._raise_ops_alert, self.alerter.ops_resolve)
        self.loader = PolicyLoader(cfg.policies, background=True)  # reloads off the main loop
        if self.loader.last_errors:
            raise PolicyError(self.loader.last_errors)
        self.loader.on_error = self._policy_rejected
        self.engine = PolicyEngine(self.loader.policy_set)
        self.sources = list(sources or [])
        #: records of golden/GPU signals no owned partition's checkpoint carries, for the windows stream
        self._unowned_records: list[str] = []
        self.golden = self._golden_scheduler()
        self.golden_lease = Lease(self.redis, self.keys.lease(f"golden:{self.group}"), cfg.instance)
        self._golden_running = False
        self.gpu = self._gpu_monitor(gpu_nvml)
        w = cfg.windows
        self.wm = Watermarks(out_of_order_s=w.grace_s, max_future_s=w.max_future_s)
        self.ingest: Ingest | None = None
        self.parts: dict[P.PartitionKey, P.Partition] = {}
        self._unrestored: set[P.PartitionKey] = set()
        self._route_part: dict[P.Route, P.PartitionKey] = {}
        self._fenced: set[P.PartitionKey] = set()
        self._nparts: int | None = None
        self._topic_id: str | None = None
        #: routes of partitions we held and lost: their decisions are the new owner's
        self._revoked_routes: set[P.Route] = set()
        self._redis_ok = True
        self._stop = threading.Event()
        self._last_policy_check = 0.0
        self._last_confirm = 0.0
        self._last_reconcile = 0.0
        self._last_restore_try = 0.0
        self._last_lag = 0.0
        self._no_assignment_since: float | None = None
        self._poll_now = 0.0
        self._reload_requested = threading.Event()
        #: (model, route) -> end of the window that caused the pending flip (reaction metric)
        self._decided_at: dict[tuple[str, str], float] = {}
        self.metrics.policies_loaded.set(len(self.loader.policy_set.policies))
        self.readiness.set("starting", "connecting to Kafka", self.clock())

    # -- construction helpers --------------------------------------------------------------
    def _golden_scheduler(self) -> Any:
        g = self.cfg.golden
        if not g.jobs:
            return None
        from watchdog.sources.golden import GoldenJob, GoldenScheduler

        jobs = [GoldenJob(name=j.name, set_path=j.set, model=j.model, routes=j.routes, candidate=j.candidate,
                          baseline=j.baseline, every_s=j.every_s, cron=j.cron, jitter_s=j.jitter_s,
                          max_items=j.max_items, on_suspicion=j.on_suspicion) for j in g.jobs]
        scheduler = GoldenScheduler(jobs, reports_dir=g.reports_dir, debounce_s=g.debounce_s)
        self.sources.append(scheduler.drain)
        return scheduler

    def _gpu_monitor(self, nvml: Any) -> Any:
        """``nvml`` replaces the pynvml module (tests replay readings recorded on an H200)."""
        g = self.cfg.gpu
        if not g.enabled:
            return None
        # probes.gpu_* import pynvml lazily; without NVML the monitor reports "unavailable"
        from probes.gpu_metrics import GpuGauges
        from probes.gpu_monitor import GpuMonitor

        mapping = {gpu: [tuple(entry.split("/", 1)) for entry in entries] for gpu, entries in g.routes.items()}
        monitor = GpuMonitor(interval_s=g.interval_s, mapping=mapping, gauges=GpuGauges(self.metrics.registry),
                             nvml=nvml, bandwidth_test=g.bandwidth_test, bandwidth_every_s=g.bandwidth_every_s)
        last = [0.0]

        def gpu_source(now: float) -> list[Signal]:
            if now - last[0] < g.interval_s:
                return []
            last[0] = now
            return monitor.signals()

        self.sources.append(gpu_source)
        return monitor

    def _new_aggregator(self) -> WindowAggregator:
        w = self.cfg.windows
        # future events are refused before they reach a window (by wall clock, in _fold)
        return WindowAggregator(length_s=w.length_s, grace_s=w.grace_s, shadow_sample_rate=w.shadow_sample_rate,
                                shadow_max_pairs=w.shadow_max_pairs, max_future_s=float("inf"))

    def connect_kafka(self) -> bool:
        """One bounded attempt to build the Kafka clients; False (not ready, reason named) on failure."""
        k = self.cfg.kafka
        try:
            consumer = bounded(lambda: make_consumer(k), k.startup_timeout_s, self._stop, "consumer")
            producer = bounded(lambda: make_producer(k), k.startup_timeout_s, self._stop, "producer")
        except Stopped:
            return False
        except (StartupTimeout, Exception) as exc:  # noqa: BLE001 - reported, retried with backoff
            cause = diagnose(k.bootstrap_servers, k.security)
            what = "timed out" if isinstance(exc, StartupTimeout) else f"failed ({type(exc).__name__}: {exc})"
            log.error("kafka start-up %s after %.0f s: %s", what, k.startup_timeout_s, cause)
            self.readiness.set("kafka-startup", cause, self.clock())
            return False
        self.ingest = Ingest(consumer, producer, topic=k.topic, dlq_topic=k.dead_letter_topic,
                             max_event_bytes=self.cfg.windows.max_event_bytes, metrics=self.metrics,
                             sink=self._fold, on_assigned=self._on_assigned, on_revoked=self._on_revoked,
                             accept=self.parts.__contains__, decode_many=decoder_for(k.codec, k.otlp))
        self.readiness.clear("kafka-startup", self.clock())
        self.readiness.set("starting", "joining the consumer group", self.clock())
        self._no_assignment_since = self.clock()
        return True

    # -- partitions ----------------------------------------------------------------------------
    def _on_assigned(self, pks: list[P.PartitionKey]) -> None:
        assert self.ingest is not None
        self.readiness.clear("starting", self.clock())
        self._nparts = self.ingest.partition_count() or self._nparts
        for pk in pks:
            if pk not in self.parts:
                self._restore(pk)

    def _restore(self, pk: P.PartitionKey) -> bool:
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
            self._redis_failed(exc, f"restoring partition {pk[1]}")
            self._unrestored.add(pk)
            self.ingest.pause(pk)
            self.readiness.set("unrestored", f"partition {pk[1]}: checkpoint not loaded (Redis)", now)
            return False
        agg = self._new_aggregator()
        agg.import_open(data.get("windows") or [])
        agg.set_closed_end(data.get("closed_end"))
        part = P.Partition(pk, claim.token, claim.seq, agg, routes=routes, start_offset=data.get("offset"),
                           full=claim.data is None)
        P.load_engine_states(self.engine, saved)
        for route in routes:
            self._route_part[route] = pk
        self._revoked_routes -= routes
        self.wm.assign(pk, data.get("max_ts"), now)
        self.parts[pk] = part
        self._unrestored.discard(pk)
        self._fenced.discard(pk)
        offset = part.start_offset
        tid = self.ingest.topic_id()
        if offset is not None and tid and data.get("topic_id") and data["topic_id"] != tid:
            log.error("partition %s: the checkpoint is of an earlier topic with this name (id %s, now %s): "
                      "the broker lost its data; reading from the start", pk[1], data["topic_id"], tid)
            self.ingest.resets[pk] = now
            offset = 0
        if offset is not None:
            self.ingest.seek(pk, offset)
        self.ingest.resume(pk)
        if not self._unrestored:
            self.readiness.clear("unrestored", now)
        log.info("partition %s restored: token %s, seq %s, offset %s, %d open windows, %d routes", pk[1],
                 claim.token, claim.seq, offset, agg.open_windows(), len(routes))
        self._reconcile(now, force=True)
        return True

    def _on_revoked(self, pks: list[P.PartitionKey]) -> None:
        # checkpoint first: what is not in the checkpoint is re-read by the next owner from its offset
        now = self.clock()
        for pk in pks:
            part = self.parts.get(pk)
            if part is not None:
                self._save(part, now, force=True)
            self._forget(pk)

    def _forget(self, pk: P.PartitionKey) -> None:
        part = self.parts.pop(pk, None)
        self._unrestored.discard(pk)
        self.wm.revoke(pk)
        if self.ingest is not None:
            self.ingest.forget(pk)
        if part is not None:
            P.drop_engine_states(self.engine, part.routes)
            self._revoked_routes |= part.routes
            for route in part.routes:
                if self._route_part.get(route) == pk:
                    del self._route_part[route]

    def _owner_of(self, model: str, route: str) -> P.PartitionKey | None:
        """The owned partition carrying (model, route): where its events came from, else (a route known
        only from golden/GPU signals) where Kafka's default partitioner puts the key ``model/route``."""
        pk = self._route_part.get((model, route))
        if pk is not None or not self._nparts or "*" in (model, route):
            return pk
        guess = (self.cfg.kafka.topic, (murmur2(partition_key(model, route)) & 0x7FFFFFFF) % self._nparts)
        part = self.parts.get(guess)
        if part is None:
            return None
        part.routes.add((model, route))
        self._route_part[(model, route)] = guess
        return guess

    # -- the hot path ----------------------------------------------------------------------------
    def _fold(self, event: Any, pk: P.PartitionKey, offset: int) -> str | None:
        ts = event.ts
        if ts > self._poll_now + self.wm.max_future_s:
            return "future"
        part = self.parts[pk]
        if not part.agg.add(event, pk, offset):
            return "late"
        self.wm.observe(pk, ts, self._poll_now)
        route = (event.model, event.route)
        if route not in part.routes:
            part.routes.add(route)
            self._route_part[route] = pk
            self._revoked_routes.discard(route)
        part.dirty = True
        return None

    # -- the loop ----------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self.alerter.start()
        if self.gpu is not None:
            self.gpu.start()
        log.info("llm-watchdog starting: topic %s, %d policies, instance %s", self.cfg.kafka.topic,
                 len(self.loader.policy_set.policies), self.cfg.instance)
        backoff = 1.0
        try:
            while self.ingest is None and not self._stop.is_set():
                if self.connect_kafka():
                    break
                self.readiness.tick(self.clock())
                self.stats.last_loop = time.monotonic()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
            if self.ingest is None:
                return
            self.freeze_startup_heap()
            while not self._stop.is_set():
                self.step()
        finally:
            self.shutdown()

    @staticmethod
    def freeze_startup_heap() -> None:
        """Start-up is over: move what it allocated out of the cyclic collector's reach, so the
        collections the loop triggers scan only what the loop allocates."""
        gc.collect()
        gc.freeze()

    def step(self, poll_ms: int = 200) -> None:
        t0 = time.monotonic()
        assert self.ingest is not None
        self._poll_now = self.clock()
        self.ingest.poll(poll_ms)
        self.ingest.commit_mirror({})  # mirror offsets a busy commit held back
        now = self.clock()
        self.wm.records_read(self.ingest.last_polled, now)
        for pk in self.ingest.dead_lettered:
            if pk in self.parts:
                self.parts[pk].dirty = True  # its checkpoint must pass the dead letter once acknowledged
        self.ingest.dead_lettered.clear()
        if self._unrestored and now - self._last_restore_try >= 1.0:
            self._last_restore_try = now
            assigned = set(self.ingest.assignment())
            for pk in list(self._unrestored):
                if pk in assigned:
                    self._restore(pk)
                else:
                    self._unrestored.discard(pk)
        self._confirm_idle(now)
        signals = self._close_windows(now)
        for source in self.sources:
            try:
                extra = source(now)
            except Exception as exc:  # noqa: BLE001 - a broken probe must not stop the daemon
                log.exception("signal source failed")
                self.alerter.ops_alert("source-failed", f"a signal source failed: {exc}", "warning", {})
                continue
            self._record_source_signals(extra)
            signals.extend(extra)
        if signals:
            self._decide(signals, now)
        self._act(now)
        self._checkpoint(now)
        self._flush_unowned_records()
        self._pump_pager(now)
        self._golden_tick(now)
        self._reconcile(now)
        self._check_policies(now)
        self._update_readiness(now)
        self.stats.last_loop = time.monotonic()
        self.metrics.loop_last.set(time.time())
        self.metrics.loop_seconds.observe(self.stats.last_loop - t0)

    def _check_topic_id(self, now: float) -> None:
        """A new topic id means the topic was re-created (a broker that restarted empty): the old
        offsets mean nothing there. (Comparing positions with end offsets cannot tell: Tansu reports
        the end at the start of its last batch.)"""
        assert self.ingest is not None
        tid = self.ingest.topic_id()
        if tid is None:
            return
        if self._topic_id is not None and tid != self._topic_id:
            log.error("topic %s was re-created (id %s -> %s): the broker lost its data; reading every "
                      "partition from the start", self.cfg.kafka.topic, self._topic_id, tid)
            for pk in list(self.parts):
                self.ingest.resets[pk] = now
                self.ingest.seek(pk, 0)
        self._topic_id = tid

    def _confirm_idle(self, now: float) -> None:
        assert self.ingest is not None
        if now - self._last_confirm < CONFIRM_EVERY_S:
            return
        self._check_topic_id(now)
        quiet = [pk for pk in self.parts if pk not in self.ingest.last_polled]
        if not quiet:
            return
        self._last_confirm = now
        asked = self.clock()
        ends = self.ingest.end_offsets(quiet, timeout_ms=1000)
        if ends is None:
            return
        for pk, end in ends.items():
            pos = self.ingest.next_offset.get(pk)
            if pos is None:
                pos = self.ingest.position(pk)
            if pos is not None and pos >= end:
                self.wm.confirm_caught_up(pk, asked)

    def _close_windows(self, now: float) -> list[Signal]:
        t = self.wm.close_time(now)
        if t is None:
            return []
        w = self.cfg.windows
        upto = t - w.allowed_lateness_s + w.grace_s  # close_due subtracts the grace again
        out: list[Signal] = []
        for part in self.parts.values():
            before = part.agg.closed_end
            sigs = part.agg.close_due(upto)
            if sigs:
                part.unsaved.extend(P.window_record(s, self.cfg.instance) for s in sigs)
                out.extend(sigs)
            if sigs or part.agg.closed_end != before:
                part.dirty = True
        if out:
            self.metrics.windows_closed.inc(len(out))
            self.stats.windows_closed += len(out)
        for pk in self.parts:
            mark = self.wm.mark(pk)
            if mark is not None:
                self.metrics.watermark.labels(str(pk[1])).set(mark)
        return out

    def _record_source_signals(self, signals: list[Signal]) -> None:
        """Golden and GPU signals go into the windows stream too (backtests replay them): with the
        checkpoint of the partition that owns their route, which holds the engine state they move;
        else (a "*" route, or a route no owned partition carries) straight to the stream."""
        for sig in signals:
            pk = self._owner_of(sig.model, sig.route)
            record = P.window_record(sig, self.cfg.instance)
            if pk is not None and pk in self.parts:
                self.parts[pk].unsaved.append(record)
                self.parts[pk].dirty = True
            else:
                self._unowned_records.append(record)
        if len(self._unowned_records) > MAX_UNOWNED_RECORDS:  # Redis down for long: keep the newest
            log.warning("dropping %d golden/GPU signal records Redis could not take",
                        len(self._unowned_records) - MAX_UNOWNED_RECORDS)
            del self._unowned_records[:-MAX_UNOWNED_RECORDS]

    def _flush_unowned_records(self) -> None:
        if not self._unowned_records:
            return
        try:
            pipe = self.redis.pipeline(transaction=True)
            for record in self._unowned_records:
                pipe.xadd(self.keys.windows, {"json": record}, maxlen=self.cfg.redis.windows_maxlen,
                          approximate=True)
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._redis_failed(exc, "recording golden/GPU signals")
            return
        self._unowned_records.clear()

    def _decide(self, signals: list[Signal], now: float) -> None:
        flags = dict(self.flags.snapshot())
        for route, precision in self._lost_flags(flags).items():
            # our flip is gone from Redis: the engine must not read that as an operator's change
            flags[route] = precision
            self._reassert(route, precision, now)
        actions = self.engine.observe(signals, now, flags, self.cfg.default_precision)
        touched = {(s.model, s.route) for s in signals}
        for part in self.parts.values():
            # engine state of these routes may have changed (a "*" signal, e.g. GPU health, touches all)
            mine = part.routes if any("*" in r for r in touched) else part.routes & touched
            if mine:
                part.dirty_routes |= mine
                part.dirty = True
        for action in actions:
            self._dispatch(action)

    def _dispatch(self, action: Action) -> None:
        self.stats.actions += 1
        self.metrics.verdicts.labels(action.kind, action.policy, str(action.dry_run).lower()).inc()
        self.stats.last_actions = (self.stats.last_actions + [_action_dict(action)])[-50:]
        log.info("action %s %s/%s by %s%s: %s", action.kind, action.model, action.route, action.policy,
                 " (dry run)" if action.dry_run else "", action.reason)
        blocked = str((action.detail or {}).get("blocked") or "")
        if blocked.startswith("flip budget"):
            self.metrics.budget_exhausted.labels(action.policy).inc()
        if self.golden is not None and (action.detail or {}).get("request_replay") and self._golden_running:
            self.golden.request(action.model, action.route, action.reason, self.clock())
        pk = self._owner_of(action.model, action.route)
        if action.kind in ("rollback", "promote") and not action.dry_run:
            if pk is None and (action.model, action.route) in self._revoked_routes:
                log.warning("%s of %s/%s not applied: the route's partition moved to another replica",
                            action.kind, action.model, action.route)
                self.metrics.flips.labels("not_owner").inc()
                return
            # the page goes with the flip (flip.lua writes the outbox record); a route no assigned
            # partition carries (a GPU or golden signal of this host) flips unfenced, audited by instance
            self.actuator.submit(action)
            self._decided_at[(action.model, action.route)] = action.at or self.clock()
            return
        if pk is not None and pk in self.parts:
            self.parts[pk].outbox.append(action_record(action, self.cfg.instance))
            self.parts[pk].dirty = True
        else:
            self.alerter.handle(action)

    def _flip_extras(self, action: Action) -> FlipExtras:
        route = (action.model, action.route)
        pk = self._owner_of(*route)
        part = self.parts.get(pk) if pk is not None else None
        page = "" if (action.detail or {}).get("reassert") else action_record(action, self.cfg.instance)
        engine_key = self.keys.engine(self.group, *route)
        if part is None:
            # not ours (see _dispatch): fenced out if it was ours once, else unfenced without engine state
            token = REVOKED if route in self._revoked_routes else ""
            return FlipExtras(owner_key=self.checkpoints.owner_key(-1), token=token, engine_key=engine_key,
                              engine_json="", outbox_key=self.keys.outbox, outbox_json=page)
        scopes = {pol: st.to_json() for (pol, m, r), st in self.engine.states.items() if (m, r) == route}
        return FlipExtras(owner_key=self.checkpoints.owner_key(part.pk[1]), token=part.token,
                          engine_key=engine_key, engine_json=P.engine_json(scopes), outbox_key=self.keys.outbox,
                          outbox_json=page)

    def _act(self, now: float) -> None:
        for result in self.actuator.pump(now):
            self.metrics.flips.labels("applied" if result.applied else "unchanged" if result.unchanged
                                      else str(result.refused)).inc()
            decided = self._decided_at.pop((result.model, result.route), None)
            if result.applied and decided is not None:
                self.metrics.reaction_seconds.observe(max(0.0, now - decided))
            if result.refused == "fenced":
                pk = self._owner_of(result.model, result.route)
                if pk is not None:
                    self._fence(pk)
            elif result.refused:
                self.alerter.ops_alert(f"refused/{result.model}/{result.route}",
                                       f"switch of {result.model}/{result.route} to {result.precision} refused: "
                                       f"{result.refused}", "warning", {"policy": result.policy})
        self.metrics.pending.set(self.actuator.pending())
        if not self.actuator.healthy and self.actuator.last_error:
            self._redis_failed(Exception(self.actuator.last_error), "flip")

    # -- checkpoints ---------------------------------------------------------------------------
    def _checkpoint(self, now: float, force: bool = False) -> None:
        every = self.cfg.redis.checkpoint_every_s if self._redis_ok else 1.0
        for part in list(self.parts.values()):
            if part.inflight is None and not part.dirty:
                continue
            if not force and now - part.last_save < max(every, 10 * part.last_cost_s):
                continue
            self._save(part, now, force=force)

    def _pending_routes(self) -> set[P.Route]:
        return set(self.actuator._pending)  # noqa: SLF001 - (model, route) keys of pending flips

    def _save(self, part: P.Partition, now: float, force: bool = False, mirror: bool = True) -> bool:
        """Save one partition's checkpoint; True when Redis holds it (saved, or a retry found it saved)."""
        assert self.ingest is not None
        if part.routes & self._pending_routes():
            return False  # the flip goes first: it carries the engine state the checkpoint would
        if not self.ingest.dlq_settled(part.pk, timeout_s=1.0 if force else 0.2):
            return False  # never checkpoint past a dead letter the broker has not acknowledged
        if part.inflight is None:
            part.inflight = self._build_save(part, now, part.unsaved, part.outbox)
            part.unsaved, part.outbox = [], []
        t0 = time.perf_counter()
        try:
            status = self.checkpoints.save(part.pk[1], part.token, part.inflight)
            if status == RESYNC:
                # Redis lost the checkpoint this save builds on: send a full snapshot, same records
                log.warning("partition %s: checkpoint gone from Redis; saving a full snapshot", part.pk[1])
                part.full = True
                old = part.inflight
                part.inflight = self._build_save(part, now, old.windows, old.outbox, seq=old.seq)
                status = self.checkpoints.save(part.pk[1], part.token, part.inflight)
        except (redis.RedisError, OSError) as exc:
            self.metrics.checkpoints.labels("error").inc()
            self._redis_failed(exc, f"checkpoint of partition {part.pk[1]}")
            part.last_save = now
            return False
        part.last_cost_s = time.perf_counter() - t0
        self.metrics.checkpoint_seconds.observe(part.last_cost_s)
        self.metrics.checkpoints.labels(status).inc()
        self._redis_recovered()
        part.last_save = now
        if status == FENCED:
            self._fence(part.pk)
            return False
        assert status in (SAVED, DUPLICATE)
        self.metrics.checkpoint_bytes.labels(str(part.pk[1])).set(part.inflight.size)
        part.seq = part.inflight.seq
        part.inflight = None
        self.stats.checkpoints += 1
        offset = part.start_offset
        if offset is not None:
            if mirror:
                self.ingest.commit_mirror({part.pk: offset})
            self.ingest.final_offsets[part.pk] = offset
        return True

    def _build_save(self, part: P.Partition, now: float, windows: list[str], outbox: list[str],
                    seq: int | None = None) -> PendingSave:
        assert self.ingest is not None
        offset = self.ingest.next_offset.get(part.pk)
        if offset is None:
            offset = part.start_offset if part.start_offset is not None else self.ingest.position(part.pk)
        pc = self.wm.parts.get(part.pk)
        blob = P.checkpoint_blob(part, offset, pc.max_ts if pc else None, self.cfg.instance, now,
                                 topic_id=self._topic_id)
        full = part.full
        routes = part.routes if full else part.dirty_routes & part.routes
        by_route = P.engine_states_by_route(self.engine) if routes else {}
        engines = {self.keys.engine(self.group, m, r): P.engine_json(by_route[(m, r)])
                   for m, r in sorted(routes) if (m, r) in by_route}
        changed, closed = part.agg.export_changes(everything=full)
        part.start_offset = offset
        part.dirty = False
        part.full = False
        part.dirty_routes = set()
        return PendingSave(part.seq + 1 if seq is None else seq, blob, windows, outbox, engines, changed, closed,
                           incremental=not full)

    def _fence(self, pk: P.PartitionKey) -> None:
        """Another replica took ``pk`` while we were away: stop acting for it (it is re-read by them)."""
        log.error("partition %s: ownership taken by another replica (fenced); dropping our state of it", pk[1])
        self._fenced.add(pk)
        if self.ingest is not None and pk in self.parts:
            self.ingest.pause(pk)
        self._forget(pk)

    # -- pages, singletons, flags --------------------------------------------------------------
    def _pump_pager(self, now: float) -> None:
        try:
            self.pager.pump(now)
        except (redis.RedisError, OSError) as exc:
            self._redis_failed(exc, "outbox")
        else:
            self._redis_recovered()

    def _golden_tick(self, now: float) -> None:
        if self.golden is None:
            return
        held = self.golden_lease.tick(now)
        if held and not self._golden_running:
            self.golden.start()
            self._golden_running = True
        elif not held and self._golden_running:
            self.golden.stop()
            self._golden_running = False

    def _reconcile(self, now: float, force: bool = False) -> None:
        """Re-assert a flag Redis lost (restart without persistence, failover) that our engine state
        says we set: a cooldown never blocks restoring the safe state."""
        if not force and now - self._last_reconcile < RECONCILE_EVERY_S:
            return
        self._last_reconcile = now
        try:
            flags = self.store.snapshot()
        except (redis.RedisError, OSError):
            return
        lost = self._lost_flags(flags)
        for route, precision in lost.items():
            self._reassert(route, precision, now)
        if lost:
            self._act(now)

    def _lost_flags(self, flags: dict[tuple[str, str], str]) -> dict[P.Route, str]:
        """Owned routes our engine state says we flipped whose flag is absent from ``flags``."""
        out: dict[P.Route, str] = {}
        pending = self._pending_routes()
        for (_policy, model, route), st in self.engine.states.items():
            if st.last_flip is None or st.serving in (None, self.cfg.default_precision):
                continue
            key = (model, route)
            if key in flags or key in pending or self._owner_of(model, route) not in self.parts:
                continue
            out[key] = str(st.serving)
        return out

    def _reassert(self, route: P.Route, precision: str, now: float) -> None:
        model, name = route
        policy = next((p for (p, m, r) in self.engine.states if (m, r) == route), "")
        log.error("flag of %s/%s is gone from Redis; re-asserting %s", model, name, precision)
        self.actuator.submit(Action(kind="rollback", policy=policy, model=model, route=name,
                                    reason=f"re-asserted {precision}: the flag was lost from Redis",
                                    severity="critical", precision=precision, at=now, detail={"reassert": True}))
        self.alerter.ops_alert(f"reassert/{model}/{name}", f"flag of {model}/{name} was lost from Redis; "
                               f"re-asserted {precision}", "warning", {})

    def _check_policies(self, now: float) -> None:
        if self._reload_requested.is_set():
            self._reload_requested.clear()
            self.reload_policies()
            return
        if now - self._last_policy_check < self.cfg.policy_poll_s:
            return
        self._last_policy_check = now
        if self.loader.check():
            self._apply_policies()

    def request_reload(self) -> None:
        """Safe from a signal handler: the main loop re-reads the policy files next iteration."""
        self._reload_requested.set()

    def reload_policies(self) -> None:
        """SIGHUP: re-read the policy files now."""
        if self.loader.reload():
            self._apply_policies()

    def _apply_policies(self) -> None:
        self.engine.set_policy_set(self.loader.policy_set)
        self.metrics.policy_reloads.labels("ok").inc()
        self.metrics.policies_loaded.set(len(self.loader.policy_set.policies))
        self.alerter.ops_resolve("policy-reload")
        log.info("policies reloaded: %d in force", len(self.loader.policy_set.policies))

    def _policy_rejected(self, errors: list[str]) -> None:
        self.metrics.policy_reloads.labels("rejected").inc()
        log.error("policy edit rejected, previous policies stay in force:\n%s", "\n".join(errors))
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        first = errors[0] if errors else "unknown error"  # starts with file:line:col
        self.alerter.ops_alert("policy-reload", f"policy edit rejected: {first}{more}; the last good policies "
                               "stay in force", "warning", {"errors": errors[:20]})

    # -- health --------------------------------------------------------------------------------
    def _raise_ops_alert(self, reason: str, message: str, severity: str) -> None:
        self.alerter.ops_alert(reason, message, severity, {})  # type: ignore[arg-type]

    def _redis_failed(self, exc: BaseException, what: str) -> None:
        reason, line = redis_cause(exc)
        if self._redis_ok:
            log.error("%s: %s", what, line)
        self._redis_ok = False
        self.readiness.set(reason, line, self.clock())
        self.metrics.redis_up.set(0)

    def _redis_recovered(self) -> None:
        if not self._redis_ok and self.actuator.healthy:
            log.info("redis reachable again")
        if self.actuator.healthy:
            self._redis_ok = True
            now = self.clock()
            for r in ("redis", "redis-auth", "redis-tls"):
                self.readiness.clear(r, now)
            self.metrics.redis_up.set(1)

    def _update_readiness(self, now: float) -> None:
        assert self.ingest is not None
        r = self.readiness
        silent = self.ingest.broker_silent_since
        if self.ingest.last_polled:
            self.ingest.broker_silent_since = silent = None
        if self.ingest.healthy and silent is not None and now - silent > 2.0:
            r.set("kafka", f"broker not answering for {now - silent:.0f} s ({self.ingest.broker_error}): "
                  f"windows wait, nothing is closed on the wall clock", now)
        elif self.ingest.healthy:
            r.clear("kafka", now)
            r.clear("undecodable", now)
        else:
            r.set(self.ingest.error_reason or "kafka", self.ingest.last_error or "not connected", now)
        if self.ingest.assigned():
            self._no_assignment_since = None
            r.clear("unassigned", now)
        else:
            self._no_assignment_since = self._no_assignment_since or now
            if now - self._no_assignment_since > self.cfg.kafka.unassigned_grace_s:
                r.set("unassigned", f"no partition assigned for {now - self._no_assignment_since:.0f} s "
                      f"(group {self.group}; a broker group wedge looks like this)", now)
        stuck_after = max(30.0, 3 * (self.cfg.windows.length_s + self.cfg.windows.grace_s))
        stuck = self.wm.stuck(now, stuck_after)
        if stuck:
            r.set("watermark-stuck", f"partitions {[pk[1] for pk in stuck]} deliver events but their event time "
                  f"has not advanced for {stuck_after:.0f} s", now)
        else:
            r.clear("watermark-stuck", now)
        dlq = self.ingest.dlq_failures()
        if dlq:
            r.set("dlq", "; ".join(f"partition {pk[1]} paused: {e}" for pk, e in sorted(dlq.items()))[:300], now)
        else:
            r.clear("dlq", now)
        resets = {pk: t for pk, t in self.ingest.resets.items() if now - t < 3}
        if resets:
            r.set("offsets-reset", f"partitions {sorted(pk[1] for pk in resets)}: offsets went back (broker "
                  f"restarted empty?)", now)
        else:
            r.clear("offsets-reset", now)
        # fenced is wrong only while the group still hands us what another replica holds: once the
        # rebalance has moved those partitions elsewhere (or we re-claimed them) our assignment is consistent
        self._fenced &= set(self.ingest.assignment())
        if self._fenced:
            r.set("fenced", f"partitions {sorted(pk[1] for pk in self._fenced)} taken by another replica", now)
        else:
            r.clear("fenced", now)
        if self.actuator.pending():
            r.set("pending-flips", f"{self.actuator.pending()} flag change(s) pending", now)
        else:
            r.clear("pending-flips", now)
        if now - self._last_lag > 1.0:
            self._last_lag = now
            self.ingest.lag()
        r.tick(now)

    def shutdown(self) -> None:
        """Checkpoint every partition (open windows stay open, in the checkpoint) and close."""
        deadline = time.monotonic() + 6.0
        try:
            if self.ingest is not None and not self.ingest.assigned():
                # stopped while joining the group: finish the join (bounded) so that close() can leave
                # as a full member. Tansu keeps a member that vanished mid-join and hands the next
                # replica no partitions for minutes (bench/tansu_wedge.py reproduces it)
                until = time.monotonic() + 4.0
                while not self.ingest.assigned() and time.monotonic() < until:
                    self.ingest.poll(100)
            if self.ingest is not None:
                while self.actuator.pending() and time.monotonic() < deadline - 3:
                    self._act(self.clock())
                    if self.actuator.pending():
                        time.sleep(0.1)
                for part in list(self.parts.values()):
                    if time.monotonic() < deadline - 1:
                        self._save(part, self.clock(), force=True, mirror=False)
                self.pager.wait(max(0.0, min(1.0, deadline - time.monotonic() - 1)))
        finally:
            if self.golden is not None and self._golden_running:
                self.golden.stop()
                self.golden_lease.release()
            if self.gpu is not None:
                self.gpu.stop()
            if self.ingest is not None:
                ingest = self.ingest
                closer = threading.Thread(target=ingest.close, name="kafka-close", daemon=True)
                closer.start()
                closer.join(max(0.5, deadline - time.monotonic()))
            self.flags.close()
            self.alerter.stop(timeout=1.5)
            gc.unfreeze()  # let whatever this daemon held be collected (tests run several per process)
            log.info("llm-watchdog stopped")

    # -- surface -------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        extra = []
        if time.monotonic() - self.stats.last_loop > 15 and self.ingest is not None:
            extra.append(f"loop-stuck: no loop iteration for {time.monotonic() - self.stats.last_loop:.0f} s")
        return self.readiness.problems(extra)

    def alive(self) -> bool:
        return time.monotonic() - self.stats.last_loop < 30 or self.ingest is None

    def status(self) -> dict[str, Any]:
        parts = {}
        for pk, part in sorted(self.parts.items()):
            pc = self.wm.parts.get(pk)
            parts[str(pk[1])] = {"token": part.token, "seq": part.seq, "open_windows": part.agg.open_windows(),
                                 "routes": len(part.routes), "watermark": self.wm.mark(pk),
                                 "idle": bool(pc and pc.caught_up_at), "closed_until": part.agg.closed_until}
        problems = self.problems()
        return {
            "instance": self.cfg.instance,
            "uptime_s": round(time.time() - self.stats.started_at, 1),
            "ready": not problems,
            "problems": problems,
            "partitions": parts,
            "policies": [p.name for p in self.loader.policy_set.policies],
            "flags": {f"{m}/{r}": p for (m, r), p in self.flags.snapshot().items()},
            "verdicts": self.engine.snapshot(),
            "pending_decisions": self.actuator.pending(),
            "windows_closed": self.stats.windows_closed,
            "checkpoints": self.stats.checkpoints,
            "open_windows": sum(p.agg.open_windows() for p in self.parts.values()),
            "recent_actions": self.stats.last_actions[-20:],
            "incidents": self.alerter.open_incidents(),
            "alerts": self.alerter.stats(),
            "golden": self.golden.status() if self.golden is not None else [],
            "golden_lease": self._golden_running,
            "gpu": [h.to_dict() for h in self.gpu.latest()] if self.gpu is not None else [],
            "heavy_modules_loaded": sorted(m for m in ("torch", "transformers", "evaluate", "pynvml")
                                           if m in sys.modules),
        }


def _action_dict(a: Action) -> dict[str, Any]:
    return {"kind": a.kind, "policy": a.policy, "model": a.model, "route": a.route, "precision": a.precision,
            "reason": a.reason, "severity": a.severity, "dry_run": a.dry_run, "at": a.at}

