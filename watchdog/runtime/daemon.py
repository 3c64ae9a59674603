"""The daemon: wires ingest -> windows -> policy engine -> actuator/outbox, and runs one main loop.

One thread owns the decision path. Reliability contract (docs/OPERATIONS.md):

* windows close on event time (``watchdog.ingest.eventtime``): a stalled broker or loop is a stall, never
  lateness; future and late events are dead-lettered with their reason;
* each partition is checkpointed in Redis (open windows, closed-window records, engine state of its
  routes, next offset) atomically, fenced by an ownership token and idempotent by sequence number;
  a restart, a rebalance or a graceful stop resumes exactly from the checkpoint;
* a flip, the engine state it implies and its page are one Lua script; pages go out from the outbox.

This module holds only the wiring (``Daemon.__init__``, ``connect_kafka``) and the loop (``run``,
``step``, ``shutdown``). Each concern has its own module: ``ownership`` (partitions owned, the ingest
sink), ``closer`` (closing windows on event time), ``decisions`` (signals -> actions -> flips, the one
flag view), ``checkpointer`` (saves and offset commits), ``policies`` (reloads), ``health``
(readiness, Redis health, liveness), ``stats`` and ``status`` (counters, the /status document),
``sources.golden`` and ``sources.gpu`` (signals other than Kafka).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from watchdog.actuation.actuator import FlagStore
from watchdog.actuation.outbox import Pager
from watchdog.actuation.routing import RoutingFlags
from watchdog.alerting.alerter import Alerter
from watchdog.config.settings import Config
from watchdog.core.backoff import Backoff
from watchdog.core.keys import Keys
from watchdog.core.metrics import Metrics
from watchdog.core.signals import Signal
from watchdog.ingest.consumer import Ingest, make_consumer, make_offsets_consumer, make_producer
from watchdog.ingest.eventtime import Watermarks
from watchdog.ingest.otlp import decoder_for
from watchdog.ingest.startup import StartupTimeout, Stopped, bounded, diagnose
from watchdog.runtime.budget import StepDeadline
from watchdog.runtime.checkpointer import Checkpointer
from watchdog.runtime.clock import ClockCheck, SteadyClock
from watchdog.runtime.closer import WindowCloser
from watchdog.runtime.collector import LOOP_GC
from watchdog.runtime.decisions import FLAG_RELOAD_S, Decisions
from watchdog.runtime.evidence import EvidenceRecorder
from watchdog.runtime.evidence_http import EvidencePages
from watchdog.runtime.golden import GoldenRelay, golden_readiness
from watchdog.runtime.health import LoopHealth, Readiness, RedisHealth
from watchdog.runtime.heap_trim import HEAP_TRIM, fix_mmap_threshold
from watchdog.runtime.ownership import Ownership
from watchdog.runtime.policies import PolicyReloader
from watchdog.runtime.routes import RouteKeeper
from watchdog.runtime.stats import DaemonStats
from watchdog.runtime.status import StatusDocument
from watchdog.sources.golden import GoldenLeader, GoldenScheduler
from watchdog.sources.gpu import GpuSource
from watchdog.state.checkpoint import CheckpointStore
from watchdog.state.golden_stream import GoldenStream
from watchdog.state.lease import Lease
from watchdog.state.redis_conn import client_from_url

log = logging.getLogger(__name__)

#: a source of signals other than Kafka (golden replays, GPU health): called every loop
SignalSource = Callable[[float], list[Signal]]


#: a loop iteration doing more than this much work (its wait for records excluded) is logged with
#: the phases that took the time and the cyclic collector's part of it, at most once per
#: ``SLOW_LOOP_LOG_EVERY_S`` (issue 19's bound on an iteration)
SLOW_LOOP_S = 0.25
SLOW_LOOP_LOG_EVERY_S = 60.0
#: reading from Kafka is held while a closed window has waited longer than a window's length to be judged,
#: bounded to this range of seconds (``hold_after_s``)
HOLD_AFTER_MIN_S = 5.0
HOLD_AFTER_MAX_S = 30.0
#: ... or while the routes waiting have more than this many windows each waiting on average (a route's
#: next window closed before its last was judged), counted once at least ``HOLD_MIN_WINDOWS`` wait
HOLD_WINDOWS_PER_ROUTE = 2.5
HOLD_MIN_WINDOWS = 500
#: ... or while a partition has held changes Redis does not have for this many times ``hold_after_s``
#: (saves that fall behind: what waits for them grows, and a restart reads it all again). 6, not 3: on a
#: replica at its CPU's limit, 3 (30 s at 10 s windows) held reading every few windows, and the saves it let
#: through took CPU from judging (window end -> flip p99 5 -> 30 s; docs/BENCHMARKS.md, "Checkpoints that
#: fall behind")
HOLD_UNSAVED_FACTOR = 6.0
#: name prefixes of the daemon's long-lived threads (readiness ticker, alert senders, GPU monitor,
#: flag reader, checkpoint writer)
OWN_THREADS = ("readiness", "alerts-", "gpu-monitor", "llmwd-routing-flags", "checkpoint-writer", "outbox-pager",
               "maintenance-reader")
#: the outbox pager's thread (``Daemon._run_pager``): the outbox is moved to the page streams off the loop, since
#: each pump is one Redis round trip or more (a record taken is four): at 0.1-0.45 s of round trip the loop spent
#: most of its time there (tests/test_slow_network.py)
PAGER_THREAD = "outbox-pager"


class Daemon:
    def __init__(self, cfg: Config, *, redis_client: redis.Redis | None = None, alerter: Alerter | None = None,
                 metrics: Metrics | None = None, clock: SteadyClock | None = None,
                 sources: list[SignalSource] | None = None, gpu_nvml: Any = None) -> None:
        self.cfg = cfg
        #: every duration, guard and "now" of the daemon: step-free wall time (watchdog.runtime.clock)
        self.clock = clock = clock or SteadyClock()
        self.clock_check = ClockCheck(clock, cfg.windows.clock_skew_s)
        self.metrics = metrics or Metrics()
        self.stats = DaemonStats()
        self.keys = Keys(cfg.redis.prefix)
        self.redis = redis_client or client_from_url(cfg.redis.url, timeout_s=cfg.redis.socket_timeout_s)
        self.store = FlagStore(self.redis, self.keys)
        self.checkpoints = CheckpointStore(self.redis, self.keys, cfg.kafka.group_id, cfg.kafka.topic,
                                           cfg.instance, cfg.redis.windows_maxlen)
        self.alerter = alerter or Alerter.from_config(
            [c.model_dump() for c in cfg.alerts.channels], on_page=self.metrics.count_page,
            on_channel_page=self.metrics.count_channel_page,
            status_url=cfg.server.status_url, evidence_url=cfg.server.evidence_url)
        self.pager = Pager(self.redis, self.keys, cfg.kafka.group_id, cfg.instance, self.alerter)
        self.readiness = Readiness(self.metrics, self._raise_ops_alert, self.alerter.ops_resolve)
        self.redis_health = RedisHealth(self.readiness, self.metrics, clock)
        self.policies = PolicyReloader(cfg, self.metrics, self.alerter)  # PolicyError on invalid policies
        # after the policies: a daemon that cannot start says only why (not first that Redis is down)
        self.flags = RoutingFlags(cfg.redis.url, self.keys, default_precision=cfg.default_precision,
                                  ttl_s=FLAG_RELOAD_S, timeout_s=cfg.redis.socket_timeout_s)
        self.engine = self.policies.engine
        self.sources = list(sources or [])
        self.golden = GoldenScheduler.from_config(cfg.golden, metrics=self.metrics)
        if self.golden is not None:  # read at each replay: the policies in force after a reload
            self.golden.judged = lambda model, route: self.engine.policy_set.golden_rules(model, route)
        self.golden_leader: GoldenLeader | None = None
        gpu = GpuSource.from_config(cfg.gpu, self.metrics.registry, gpu_nvml)
        self.gpu = gpu.monitor if gpu is not None else None
        if gpu is not None:
            self.sources.append(gpu)
        w = cfg.windows
        self.wm = Watermarks(out_of_order_s=w.grace_s, max_future_s=w.max_future_s)
        self.ingest: Ingest | None = None
        self.ownership = Ownership(cfg, self.engine, self.checkpoints, self.wm, self.readiness, self.redis_health,
                                   clock)
        self.parts = self.ownership.parts
        self.golden_relay: GoldenRelay | None = None
        if self.golden is not None:
            lease = Lease(self.redis, self.keys.lease(f"golden:{cfg.kafka.group_id}"), cfg.instance)
            golden_stream = GoldenStream(self.redis, self.keys, cfg.kafka.group_id)
            self.golden_leader = GoldenLeader(self.golden, lease, last_runs=golden_stream.last_runs)
            # golden signals go to each route's owner through Redis (runtime/golden.py)
            self.golden_relay = GoldenRelay(golden_stream, self.golden,
                                            self.golden_leader, self.ownership, self.engine, self.redis_health,
                                            self.metrics, cfg.instance, clock)
            self.sources.append(self.golden_relay)
        self.decisions = Decisions(cfg, self.keys, self.engine, self.store, self.flags, self.alerter,
                                   self.ownership, self.checkpoints, self.redis_health, self.metrics, self.stats,
                                   self.golden_leader, clock)
        self.actuator = self.decisions.actuator
        self.redis_health.retry_writer = self.actuator.retry_now
        gpu_mon = self.gpu
        self.evidence = self.decisions.evidence = EvidenceRecorder(
            cfg.evidence, self.keys, self.redis, self.engine, cfg.instance,
            gpu_latest=(lambda: [h.to_dict() for h in gpu_mon.latest()]) if gpu_mon is not None else None,
            count=lambda result, n: self.metrics.evidence.labels(result).inc(n),
            on_evict=self.metrics.evidence_history_evictions.inc)
        #: the /evidence pages, for the HTTP server (``StatusServer(..., pages=daemon.evidence_pages)``)
        self.evidence_pages = EvidencePages(self.redis, self.keys)
        self.checkpointer = Checkpointer(cfg, self.keys, self.redis, self.checkpoints, self.engine, self.wm,
                                         self.ownership, self.actuator, self.redis_health, self.metrics, self.stats)
        self.checkpointer.deferred_routes = lambda: self.decisions.deferred_routes
        self.decisions.flips_wait = self.checkpointer.saving
        self.ownership.bind(save=functools.partial(self.checkpointer.save, force=True),
                            restored=functools.partial(self.decisions.reconcile, force=True))
        self.routes = RouteKeeper(cfg, self.ownership, self.engine, self.readiness, self.metrics,
                                  self.decisions.flags.snapshot, self.actuator.pending_routes,
                                  self.alerter.open_incidents, self.evidence.forget)
        self.closer = WindowCloser(cfg, self.wm, self.ownership, self.metrics, self.stats, clock)
        self.decisions.closed_at = self.closer.closed_at
        self.closer.first = self.decisions.near
        self.health = LoopHealth(cfg, self.readiness, self.wm, self.ownership.fenced_partitions, self.actuator,
                                 self.stats)
        self._status = StatusDocument(cfg.instance, self.stats, self.problems, self.ownership, self.policies,
                                      self.decisions.flags, self.engine, self.actuator, self.alerter, self.golden,
                                      self.golden_leader, self.gpu, self.routes, cfg.default_precision,
                                      self.golden_relay)
        #: the loop iteration's shared deadline for the work that can wait (watchdog/runtime/budget.py)
        self.step_deadline = self.closer.step = self.decisions.step = self.checkpointer.step = \
            self.evidence.step = StepDeadline()
        self._stop = threading.Event()
        self._slow_logged = -math.inf
        #: when reading was last held, and since when it is held now (None: reading); the log lines
        self._held_since: float | None = None
        self._held_logged = -math.inf
        #: when the longest-waiting closed window began to wait, as of the loop's last look (None: none
        #: waits). The gauge ages it at scrape time: a judging pass of seconds (a catch-up, a slow policy) shows
        #: on a scrape during it, not only at the next iteration's start
        self._backlog_since: float | None = None
        self.metrics.judging_backlog_seconds.set_function(self._backlog_age)
        self._failed_sources: set[str] = set()
        #: the outbox pager's thread (None: ``step`` pumps inline, as a loop driven by hand does), the loop's
        #: wake-up call to it, and what it raised that was not a Redis error (``step`` raises it: crash-only)
        self._pager_thread: threading.Thread | None = None
        self._pager_wake = threading.Event()
        self._pager_error: BaseException | None = None
        #: whether this daemon's loop holds the process's collector settings (LOOP_GC)
        self._gc_entered = False
        self.readiness.set("starting", "connecting to Kafka", self.clock())

    def connect_kafka(self) -> bool:
        """One bounded attempt to build the Kafka clients; False (not ready, reason named) on failure."""
        k = self.cfg.kafka
        try:
            consumer = bounded(lambda: make_consumer(k), k.startup_timeout_s, self._stop, "consumer")
            producer = bounded(lambda: make_producer(k), k.startup_timeout_s, self._stop, "producer")
            offsets = bounded(lambda: make_offsets_consumer(k), k.startup_timeout_s, self._stop, "offsets consumer")
        except Stopped:
            return False
        except (StartupTimeout, Exception) as exc:  # noqa: BLE001 - reported, retried with backoff
            cause = diagnose(k.bootstrap_servers, k.security)
            what = "timed out" if isinstance(exc, StartupTimeout) else f"failed ({type(exc).__name__}: {exc})"
            log.error("kafka start-up %s after %.0f s: %s", what, k.startup_timeout_s, cause)
            self.readiness.set("kafka-startup", cause, self.clock())
            return False
        own = self.ownership
        self.ingest = ingest = Ingest(consumer, producer, topic=k.topic, dlq_topic=k.dead_letter_topic,
                                      max_event_bytes=self.cfg.windows.max_event_bytes, metrics=self.metrics,
                                      sink=own.fold, on_assigned=own.assigned, on_revoked=own.revoked,
                                      accept=self.parts.__contains__, decode_many=decoder_for(k.codec, k.otlp),
                                      clock=self.clock, broker_timeout_ms=k.broker_timeout_ms, offsets=offsets)
        own.attach(ingest)
        self.checkpointer.attach(ingest)
        self.closer.attach(ingest)
        self.readiness.clear("kafka-startup", self.clock())
        self.readiness.set("starting", "joining the consumer group", self.clock())
        self.health.attach(ingest, self.clock())
        return True

    # -- the loop ----------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """The main loop until ``stop``. Crash-only: an unexpected exception leaves without a
        checkpoint or a flip (the state it would save may be what broke) and is raised again; the
        next start restores the last good checkpoint and re-reads from its offsets."""
        before = set(threading.enumerate())
        self.alerter.start()
        # pages fire on time even while the loop waits on a Redis or broker timeout
        threading.Thread(target=self._tick_readiness, name="readiness", daemon=True).start()
        if self.gpu is not None:
            self.gpu.start()
        self.checkpointer.writer.start()
        self._pager_thread = threading.Thread(target=self._run_pager, name=PAGER_THREAD, daemon=True)
        self._pager_thread.start()
        self.decisions.maintenance.start()
        #: the long-lived threads this daemon started: the death of one is a readiness reason (by
        #: name as well: other threads of the process - a test's, an embedding app's - are not ours)
        self.health.threads = [t for t in threading.enumerate()
                               if t not in before and t.name.startswith(OWN_THREADS)]
        log.info("llm-watchdog starting: topic %s, %d policies, instance %s", self.cfg.kafka.topic,
                 len(self.policies.loader.policy_set.policies), self.cfg.instance)
        backoff = Backoff(1.0, 30.0, jitter=False)
        crashed = False
        try:
            while self.ingest is None and not self._stop.is_set():
                if self.connect_kafka():
                    break
                self.readiness.tick(self.clock())
                self.stats.last_loop = time.monotonic()
                self._stop.wait(backoff.fail())
            if self.ingest is None:
                return
            self.freeze_startup_heap()
            while not self._stop.is_set():
                self.step()
        except Exception:
            crashed = True
            log.critical("the main loop failed; leaving without a checkpoint (the next start restores the last "
                         "good one and re-reads)", exc_info=True)
            raise
        finally:
            self._stop.set()
            self.shutdown(checkpoint=not crashed)

    def _tick_readiness(self) -> None:
        while not self._stop.wait(0.5):
            self.readiness.tick(self.clock())

    def freeze_startup_heap(self) -> None:
        """Start-up is over: move what it allocated out of the cyclic collector's reach, and let the
        loop run the collector (watchdog/runtime/collector.py; ``shutdown`` gives it back)."""
        if not self._gc_entered:
            self._gc_entered = True
            LOOP_GC.enter()
            # large transient buffers mapped whole (watchdog/runtime/heap_trim.py); not beside an in-process
            # engine, whose tensors above the threshold would each be mapped and faulted in anew
            if not self.cfg.golden.in_process():
                fix_mmap_threshold()

    def step(self, poll_ms: int = 200) -> None:
        t0 = time.monotonic()
        laps: list[tuple[str, float]] = []

        def lap(phase: str) -> None:
            laps.append((phase, time.monotonic()))

        ingest = self.ingest
        assert ingest is not None
        # an event is ``future`` only when ahead of both the steady and the host clock: neither a step
        # of the host clock nor a start-up anchor the host corrected since drops real events
        self.ownership.poll_now = max(self.clock(), self.clock.wall())
        self._hold_reading(t0)
        # no wait for records while closed windows wait to be judged either: with the iteration's shared
        # deadline the judging of a backlog is spread over many iterations, each of which waited poll_ms; nor,
        # once no record waits in Kafka, while a due save waits for its encoding (``preencode``): the encoding
        # a catch-up leaves until its last record is read (``Checkpointer.reading_behind``) is what its last
        # commit waits for, and iterations that each waited poll_ms for records made that 2-3 s longer
        ck = self.checkpointer
        ingest.poll(0 if self.closer.behind or self.decisions.deferred_routes
                    or (not ck.reading_behind and ck.save_waits_for_preencode()) else poll_ms)
        ingest.commit_mirror({})  # mirror offsets a busy commit held back
        lap("poll")
        self.step_deadline.start()
        LOOP_GC.collect()  # inside the deadline: the work that can wait gets what the collector left
        lap("collector")
        trimmed = HEAP_TRIM.maybe_trim()
        if trimmed is not None:
            self.metrics.malloc_trim_seconds.observe(trimmed)
        lap("heap trim")
        now = self.clock()
        self.wm.records_read(ingest.last_polled, now)
        self.wm.live_from(ingest.read_to_end())
        self.checkpointer.reading_behind = ingest.reading_behind()
        self.ownership.dead_lettered(ingest.dead_letters.drain_touched())
        self.ownership.retry_unrestored(now)
        self.closer.confirm_idle(now)
        lap("partitions")
        self._close_and_judge(now, lap)
        self.evidence.flush(now)
        lap("evidence")
        self.checkpointer.checkpoint(now)
        self.checkpointer.flush_unowned()
        lap("checkpoint")
        if self._pager_error is not None:
            raise self._pager_error
        if self._pager_thread is None:
            self._pump_pager()
        else:
            self._pager_wake.set()  # one pump per iteration at most, on its own thread: never a wait here
        lap("pager")
        if self.golden_leader is not None:
            self.golden_leader.tick(now)
            golden_readiness(self.readiness, self.golden_leader, now)
        lap("golden")
        self.decisions.reconcile(now)
        lap("reconcile")
        self.decisions.export_flags(now)
        lap("flag gauges")
        self.decisions.export_judgeability(now)
        lap("judgeability")
        self.policies.check(now)
        self._check_clock(now)
        self.routes.update(now)
        self.health.update(now)
        lap("housekeeping")
        gc_passes = LOOP_GC.pauses.take()
        for generation, seconds in gc_passes:
            self.metrics.gc_seconds.labels(str(generation)).observe(seconds)
        self.stats.last_loop = time.monotonic()
        self.metrics.loop_last.set(self.clock())
        self.metrics.loop_seconds.observe(self.stats.last_loop - t0)
        busy = self.stats.last_loop - t0 - ingest.poll_call_s
        self.metrics.loop_busy_seconds.observe(busy)
        if busy > SLOW_LOOP_S and self.stats.last_loop - self._slow_logged >= SLOW_LOOP_LOG_EVERY_S:
            self._slow_logged = self.stats.last_loop
            spans, prev = [], t0
            for phase, t in laps:
                spans.append((t - prev - (ingest.poll_call_s if phase == "poll" else 0.0), phase))
                prev = t
            log.warning("slow loop iteration: %.2f s of work (%s; the cyclic collector %.2f s of it); at most "
                        "one such line per %.0f s", busy,
                        ", ".join(f"{p} {d:.2f} s" for d, p in sorted(spans, reverse=True)[:4]),
                        sum(seconds for _, seconds in gc_passes), SLOW_LOOP_LOG_EVERY_S)

    def _backlog_age(self) -> float:
        since = self._backlog_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def hold_after_s(self) -> float:
        """How long a closed window may wait to be judged before reading is held: a window's length
        (judging one window's close must not take longer than the next window), within
        [``HOLD_AFTER_MIN_S``, ``HOLD_AFTER_MAX_S``]."""
        return min(max(self.cfg.windows.length_s, HOLD_AFTER_MIN_S), HOLD_AFTER_MAX_S)

    def _hold_reading(self, mono: float) -> None:
        """Back-pressure. When the replica judges closed windows more slowly than they close (more routes
        than its CPU judges in time), reading on would pile their signals, their window records and the
        checkpoints they hold back (a partition with a window not judged is not saved) into memory without
        bound: at 10,000 routes on a saturated 2-core machine, RSS grew 2.5-3 MB/s and almost no checkpoint was
        saved (docs/BENCHMARKS.md, "Back-pressure").
        While the longest-waiting window has waited more than ``hold_after_s``, or the routes waiting have
        more than ``HOLD_WINDOWS_PER_ROUTE`` windows each waiting (a read that catches up on the topic closes
        several windows of every route in a few seconds, faster than the wait grows), or a partition has held
        changes Redis does not have for ``HOLD_UNSAVED_FACTOR`` times as long (its saves fall behind: refused
        while any of its routes waits to be judged, or spaced out by their cost), no partition is read
        (no more windows close), so the backlog is judged, the partitions are saved and their offsets
        committed; the rest waits in Kafka, where the consumer-lag metric and alert see it."""
        backlog = self.decisions.backlog
        age = backlog.age(mono)
        unsaved = self.checkpointer.unsaved_age(self.clock())
        m = self.metrics
        m.judging_backlog_routes.set(len(backlog))
        self._backlog_since = mono - age if age > 0.0 else None
        ingest = self.ingest
        assert ingest is not None
        hold_after = self.hold_after_s()
        judging = age > hold_after or (backlog.windows >= HOLD_MIN_WINDOWS
                                       and backlog.windows_per_route() > HOLD_WINDOWS_PER_ROUTE)
        # not while Redis fails: saves cannot catch up then (readiness says so), and the live judging goes on
        saving = self.redis_health.ok and unsaved > HOLD_UNSAVED_FACTOR * hold_after
        hold = judging or saving
        if not hold and not ingest.held:
            return
        ingest.hold(hold)
        m.reading_held.set(1 if hold else 0)
        if hold and self._held_since is None:
            self._held_since = mono
            if mono - self._held_logged >= SLOW_LOOP_LOG_EVERY_S:
                self._held_logged = mono
                what = (f"judging runs behind: a closed window has waited {age:.1f} s ({len(backlog)} routes, "
                        f"{backlog.windows} windows waiting)" if judging else
                        f"checkpoints run behind: a partition's changes have waited {unsaved:.1f} s to be saved")
                log.warning("%s; reading from Kafka is held until they catch up (more routes than this replica "
                            "judges and saves in time: add replicas and partitions, or longer windows); at most one "
                            "such line per %.0f s", what, SLOW_LOOP_LOG_EVERY_S)
        elif not hold and self._held_since is not None:
            log.info("judging and checkpoints caught up: reading again after %.1f s held", mono - self._held_since)
            self._held_since = None

    def _close_and_judge(self, now: float, lap: Callable[[str], None]) -> None:
        """Not inline in ``step``: a frame kafka-python keeps in a reference cycle after a poll (a timed-out
        fetch's exception, its traceback and the callers' frames) holds ``step``'s locals as they were when
        it returned, and the closed windows' signals (thousands at a window boundary) must not be among
        them: the collector frees such a cycle only in its next full pass (watchdog/runtime/collector.py).
        The windows of routes near a rollback are closed, judged and their flips written first: at 10,000
        routes the other windows due take several iterations to close and seconds to judge."""
        near = self.closer.close_first(now)
        if near or self.decisions.backlog.order[0]:
            self.decisions.decide(near, now, near_only=True)
            self.decisions.act(now)
            lap("near")
        signals = self.closer.close_windows(now)
        lap("close")
        signals.extend(self._poll_sources(now))
        lap("sources")
        if signals or self.decisions.deferred_routes:
            self.decisions.decide(signals, now)
        self.decisions.act(now)
        lap("decide")

    def _check_clock(self, now: float) -> None:
        """The host clock against the steady and the events' clock: ``clock-skew`` while they disagree.
        An events' clock behind the host counts only from live events, read after their partition was
        caught up: a backlog is old, not skewed, and so is its last event when no traffic follows."""
        events = self.wm.events_now(now)
        if events is not None and events < self.clock.wall():
            events = self.wm.events_now(now, live=True)
        problem = self.clock_check.check(events)
        if problem:
            self.readiness.set("clock-skew", problem, now)
        else:
            self.readiness.clear("clock-skew", now)

    def _poll_sources(self, now: float) -> list[Signal]:
        """Signals of the golden, GPU and other sources; each is recorded for the windows stream."""
        out: list[Signal] = []
        for source in self.sources:
            # one incident per source, resolved by its next good call (a later failure pages again)
            key = f"source-failed/{getattr(source, '__qualname__', type(source).__name__)}"
            try:
                extra = source(now)
            except Exception as exc:  # noqa: BLE001 - a broken probe must not stop the daemon
                log.exception("signal source failed")
                self._failed_sources.add(key)
                self.alerter.ops_alert(key, f"a signal source failed: {exc}", "warning", {})
                continue
            if key in self._failed_sources:
                self._failed_sources.discard(key)
                self.alerter.ops_resolve(key, "the source answers again")
            self.checkpointer.record_signals(extra)
            out.extend(extra)
        return out

    def _run_pager(self) -> None:
        """The pager's thread: one pump each time the loop asks (once per iteration), until the stop."""
        while not self._stop.is_set():
            if not self._pager_wake.wait(0.5):
                continue
            self._pager_wake.clear()
            if self._stop.is_set():
                return
            try:
                self._pump_pager()
            except Exception as exc:  # noqa: BLE001 - raised again on the loop (crash-only)
                self._pager_error = exc
                return

    def _pump_pager(self) -> None:
        try:
            self.pager.pump()
        except (redis.RedisError, OSError) as exc:
            self.redis_health.failed(exc, "outbox")
        else:
            self.redis_health.recovered()
            self.metrics.set_pages_backlog(self.pager.backlog())

    def shutdown(self, checkpoint: bool = True) -> None:
        """Checkpoint every partition (open windows stay open, in the checkpoint) and close; without
        ``checkpoint`` (a crash) only close: Kafka gets the offsets of the last good checkpoints."""
        deadline = time.monotonic() + 6.0
        if not checkpoint:
            self.ownership.save_on_revoke = False  # nor when closing the consumer revokes the partitions
        try:
            if self.ingest is not None and checkpoint:
                self._drain(deadline)
        finally:
            if self.golden_leader is not None:
                self.golden_leader.stop()
            if self.golden is not None:
                self.golden.stop()  # resident replay engines go (now, or when a running replay ends)
            if self.gpu is not None:
                self.gpu.stop()
            self.checkpointer.writer.stop()
            self.decisions.maintenance.stop()
            if self.ingest is not None:
                closer = threading.Thread(target=self.ingest.close, name="kafka-close", daemon=True)
                closer.start()
                closer.join(max(0.5, deadline - time.monotonic()))
            self.flags.close()
            # ops incidents are about this process and are not kept: close them while we still can
            self.alerter.resolve_ops("the daemon stopped; a new start pages again if it persists")
            if self.alerter.stop(timeout=1.5):
                self.pager.release()  # nothing in flight: the next replica may deliver our channels at once
            if self._gc_entered:
                self._gc_entered = False
                LOOP_GC.exit()
            log.info("llm-watchdog stopped")

    def _drain(self, deadline: float) -> None:
        """Before closing: finish a join, write pending flips, checkpoint every partition, send pages."""
        ingest = self.ingest
        assert ingest is not None
        if not ingest.assigned():
            # stopped while joining the group: finish the join (bounded) so that close() can leave
            # as a full member. Tansu keeps a member that vanished mid-join and hands the next
            # replica no partitions for minutes (bench/tansu_wedge.py reproduces it)
            until = time.monotonic() + 4.0
            while not ingest.assigned() and time.monotonic() < until:
                ingest.poll(100)
        while self.decisions.deferred_routes and time.monotonic() < deadline - 4:
            self.decisions.decide([], self.clock())  # windows closed but not judged yet
        while self.actuator.pending() and time.monotonic() < deadline - 3:
            self.decisions.act(self.clock())
            if self.actuator.pending():
                time.sleep(0.1)
        for part in list(self.parts.values()):
            if time.monotonic() < deadline - 1:
                self.checkpointer.save(part, self.clock(), force=True, mirror=False)
        if self._pager_thread is not None:  # its last pump ends first: the one below copies what is left
            self._pager_wake.set()
            self._pager_thread.join(max(0.0, deadline - time.monotonic() - 1))
        self.pager.wait(max(0.0, min(1.0, deadline - time.monotonic() - 1)))

    # -- surface -------------------------------------------------------------------------------
    def request_reload(self) -> None:
        """Safe from a signal handler: the main loop re-reads the policy files next iteration."""
        self.policies.request()

    def reload_policies(self) -> None:
        """SIGHUP: re-read the policy files now."""
        self.policies.reload()

    def _raise_ops_alert(self, reason: str, message: str, severity: str) -> None:
        self.alerter.ops_alert(reason, message, severity, {})  # type: ignore[arg-type]

    def problems(self) -> list[str]:
        return self.health.problems()

    def alive(self) -> bool:
        return self.health.alive()

    def status(self, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The /status document (``query``: ``route``/``model`` for one route, ``top`` for how many)."""
        doc = self._status.build(query)
        doc["evidence"] = self.evidence.status()
        rtt = self.decisions.maintenance.round_trip_s
        doc["redis_round_trip_s"] = round(rtt, 4) if rtt is not None else None
        return doc
