"""The daemon: wires ingest -> windows -> policy engine -> actuator/alerter, in one main loop.

One thread owns the decision path (poll, close windows, evaluate, act, persist, commit), so the
order of those steps is the at-least-once guarantee: offsets are committed only after the windows
they fed are closed and what those windows decided is durably in Redis.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from watchdog.actuator import Actuator, FlagStore
from watchdog.alerts import Alerter
from watchdog.config import Config
from watchdog.ingest import Ingest, make_consumer, make_producer
from watchdog.keys import Keys, client_from_url
from watchdog.metrics import Metrics
from watchdog.otlp import decoder_for
from watchdog.policy import PolicyEngine, PolicyError, PolicyLoader
from watchdog.routing import RoutingFlags
from watchdog.signals import Action, Signal
from watchdog.windows import WindowAggregator

log = logging.getLogger(__name__)

#: seconds between two saves of the engine state while windows keep closing
PERSIST_EVERY_S = 0.5

#: a source of signals other than Kafka (golden replays, GPU health): called every loop
SignalSource = Callable[[float], list[Signal]]


@dataclass
class DaemonStats:
    started_at: float = field(default_factory=time.time)
    last_loop: float = field(default_factory=time.monotonic)
    windows_closed: int = 0
    actions: int = 0
    last_commit: float = 0.0
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
        self.redis = redis_client or client_from_url(cfg.redis.url, timeout_s=cfg.redis.socket_timeout_s)
        self.store = FlagStore(self.redis, self.keys)
        self.actuator = Actuator(self.store)
        self.flags = RoutingFlags(cfg.redis.url, self.keys, default_precision=cfg.default_precision)
        self.alerter = alerter or Alerter.from_config(
            [c.model_dump() for c in cfg.alerts.channels],
            status_url=cfg.server.status_url)
        self.loader = PolicyLoader(cfg.policies, background=True)  # reloads off the main loop
        if self.loader.last_errors:
            raise PolicyError(self.loader.last_errors)
        self.loader.on_error = self._policy_rejected
        self.engine = PolicyEngine(self.loader.policy_set)
        self.sources = list(sources or [])
        self.golden = self._golden_scheduler()
        self.gpu = self._gpu_monitor(gpu_nvml)
        self.aggregator = self._new_aggregator()
        self.ingest: Ingest | None = None
        self._state_dirty = False
        self._closed_until = 0.0
        self._redis_ok = True
        self._stop = threading.Event()
        self._last_policy_check = 0.0
        self._last_persist_try = 0.0
        self._reload_requested = threading.Event()
        self._max_event_ts = 0.0
        #: newest event time read per (topic, partition): windows close on the slowest partition
        #: that still has a backlog, so a backlog read partition by partition is not dropped as late
        self._partition_ts: dict[tuple[str, int], float] = {}
        #: closed live windows not yet recorded in Redis (written with the state, atomically)
        self._unsaved: list[Signal] = []
        #: (model, route) -> end of the window that caused the pending flip (reaction metric)
        self._decided_at: dict[tuple[str, str], float] = {}
        self.metrics.policies_loaded.set(len(self.loader.policy_set.policies))

    # -- construction helpers --------------------------------------------------------------
    def _golden_scheduler(self) -> Any:
        g = self.cfg.golden
        if not g.jobs:
            return None
        from watchdog.golden_source import GoldenJob, GoldenScheduler

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
                             nvml=nvml)
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
        agg = WindowAggregator(length_s=w.length_s, grace_s=w.grace_s, shadow_sample_rate=w.shadow_sample_rate,
                               shadow_max_pairs=w.shadow_max_pairs)
        agg.skip_before = getattr(self, "_closed_until", 0.0)
        return agg

    def _on_revoked(self) -> None:
        # Open windows hold uncommitted events of partitions that may now move to another
        # replica; drop them: whoever owns each partition next re-reads it from the commit.
        self.aggregator = self._new_aggregator()
        self._partition_ts.clear()

    def connect_kafka(self) -> None:
        k = self.cfg.kafka
        self.ingest = Ingest(make_consumer(k), make_producer(k), topic=k.topic, dlq_topic=k.dead_letter_topic,
                             max_event_bytes=self.cfg.windows.max_event_bytes, metrics=self.metrics,
                             sink=self._fold, on_revoked=self._on_revoked,
                             decode_many=decoder_for(k.codec, k.otlp))

    def _fold(self, event: Any, pkey: tuple[str, int], offset: int) -> None:
        ts = event.ts
        if ts > self._max_event_ts:
            self._max_event_ts = ts
        if ts > self._partition_ts.get(pkey, 0.0):
            self._partition_ts[pkey] = ts
        self.aggregator.add(event, pkey, offset)

    def _event_watermark(self) -> float | None:
        """Event time every partition has reached: the newest event read from the slowest partition
        that still has a backlog (caught-up or idle partitions do not hold it back); None while a
        partition with a backlog has not been read at all. Closing windows on the newest event of
        *any* partition instead drops the slower partitions' events as late when a backlog is read
        (measured: 59 % of a 4-partition backlog)."""
        assert self.ingest is not None
        marks = []
        for pk in self.ingest.behind():
            ts = self._partition_ts.get(pk)
            if ts is None:
                return None
            marks.append(ts)
        return min(marks) if marks else self._max_event_ts

    @property
    def _state_name(self) -> str:
        return f"daemon:{self.cfg.kafka.group_id}"

    def restore(self) -> None:
        """Load the engine state and the 'windows closed until' mark written by a previous run."""
        try:
            raw = self.store.load_state(self._state_name)
        except redis.RedisError as exc:
            log.warning("could not load saved state (starting fresh): %s", exc)
            return
        if not raw:
            return
        saved = json.loads(raw)
        self._closed_until = float(saved.get("closed_until", 0.0))
        self.aggregator.skip_before = self._closed_until
        self.engine.import_state(saved.get("engine", {}))
        log.info("restored state: windows closed until %.3f", self._closed_until)

    # -- the loop ----------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        if self.ingest is None:
            self.connect_kafka()
        self.restore()
        self.alerter.start()
        if self.golden is not None:
            self.golden.start()
        if self.gpu is not None:
            self.gpu.start()
        log.info("llm-watchdog running: topic %s, %d policies", self.cfg.kafka.topic,
                 len(self.loader.policy_set.policies))
        self.freeze_startup_heap()
        try:
            while not self._stop.is_set():
                self.step()
        finally:
            self.shutdown()

    @staticmethod
    def freeze_startup_heap() -> None:
        """Start-up is over: move what it allocated (modules, policies, clients: ~80k objects) out
        of the cyclic collector's reach, so the collections the loop triggers scan only what the
        loop allocates (measured: full collections were half of the daemon's GC time)."""
        gc.collect()
        gc.freeze()

    def step(self, poll_ms: int = 200) -> None:
        t0 = time.monotonic()
        assert self.ingest is not None
        seen = self.ingest.poll(poll_ms)
        now = self.clock()
        # Windows close on event time (the newest event read, capped at our clock) so that a backlog
        # read after a restart or a stall is never cut short. Only when a poll of assigned
        # partitions finds nothing waiting does wall-clock time close the windows of quiet routes.
        signals: list[Signal] = []
        if seen:
            mark = self._event_watermark()
            if mark is not None:
                signals = self.aggregator.close_due(min(now, mark))
        elif self.aggregator.open_windows() and self.ingest.assigned():
            signals = self.aggregator.close_due(now)
        self._unsaved.extend(signals)
        if signals:
            self.metrics.windows_closed.inc(len(signals))
            self.stats.windows_closed += len(signals)
            self._closed_until = max(self._closed_until, max(s.end for s in signals))
        for source in self.sources:
            try:
                found = source(now)
                signals.extend(found)
                # golden reports join the recorded history; GPU samples are too frequent for it
                self._unsaved.extend(sig for sig in found if sig.source == "golden")
            except Exception as exc:  # noqa: BLE001 - a broken probe must not stop the daemon
                log.exception("signal source failed")
                self.alerter.ops_alert("source-failed", f"a signal source failed: {exc}", "warning", {})
        if signals:
            self._decide(signals, now)
        self._act(now)
        self._persist(now)
        self._maybe_commit(now)
        self._check_policies(now)
        self.stats.last_loop = time.monotonic()
        self.metrics.loop_seconds.observe(self.stats.last_loop - t0)

    def _decide(self, signals: list[Signal], now: float) -> None:
        actions = self.engine.observe(signals, now, self.flags.snapshot(), self.cfg.default_precision)
        self._state_dirty = True
        for action in actions:
            self._dispatch(action)

    def _dispatch(self, action: Action) -> None:
        self.stats.actions += 1
        self.metrics.verdicts.labels(action.kind, action.policy, str(action.dry_run).lower()).inc()
        self.stats.last_actions = (self.stats.last_actions + [_action_dict(action)])[-50:]
        log.info("action %s %s/%s by %s%s: %s", action.kind, action.model, action.route, action.policy,
                 " (dry run)" if action.dry_run else "", action.reason)
        if self.golden is not None and (action.detail or {}).get("request_replay"):
            self.golden.request(action.model, action.route, action.reason, self.clock())
        if action.kind in ("rollback", "promote") and not action.dry_run:
            self.actuator.submit(action)
            self._decided_at[(action.model, action.route)] = action.at or self.clock()
        self.alerter.handle(action)

    def _act(self, now: float) -> None:
        for result in self.actuator.pump(now):
            self.metrics.flips.labels("applied" if result.applied else "unchanged" if result.unchanged
                                      else str(result.refused)).inc()
            decided = self._decided_at.pop((result.model, result.route), None)
            if result.applied and decided is not None:
                self.metrics.reaction_seconds.observe(max(0.0, now - decided))
            if result.refused:
                self.alerter.ops_alert(f"refused/{result.model}/{result.route}",
                                       f"switch of {result.model}/{result.route} to {result.precision} refused: "
                                       f"{result.refused}", "warning", {"policy": result.policy})
        self.metrics.pending.set(self.actuator.pending())
        self._set_redis_health(self.actuator.healthy, self.actuator.last_error)

    def _persist(self, now: float, force: bool = False) -> None:
        # While windows close batch after batch (a backlog), save at most every PERSIST_EVERY_S: the
        # engine state is a few ms per hundred routes, and offsets are committed only after a save
        # anyway, so coalescing loses nothing. Flips do not wait for it (they go through the actuator).
        wait = PERSIST_EVERY_S if self._redis_ok else 1.0
        if not self._state_dirty or (not force and now - self._last_persist_try < wait):
            return
        self._last_persist_try = now
        # check_circular=False: the state is a tree; the check costs ~20 % of the encoding
        blob = json.dumps({"schema": 1, "closed_until": self._closed_until, "engine": self.engine.export_state(),
                           "saved_at": now, "instance": self.cfg.instance}, check_circular=False)
        try:
            # state, the closed windows' records and the heartbeat land together or not at all
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(self.keys.state(self._state_name), blob)
            for sig in self._unsaved:
                pipe.xadd(self.keys.windows, {"json": json.dumps(_window_record(sig))},
                          maxlen=self.cfg.redis.windows_maxlen, approximate=True)
            pipe.set(self.keys.heartbeat(self.cfg.instance), json.dumps({"at": now, "pid": os.getpid()}), ex=60)
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._set_redis_health(False, f"saving state failed: {exc}")
            return
        self._unsaved.clear()
        self._state_dirty = False
        self._set_redis_health(self.actuator.healthy, self.actuator.last_error)

    def _maybe_commit(self, now: float, force: bool = False) -> None:
        """Commit only when every decision is in Redis: nothing pending, state saved."""
        if self.ingest is None or self._state_dirty or self.actuator.pending():
            return
        if not force and now - self.stats.last_commit < 1.0:
            return
        if self.ingest.commit(self.aggregator.min_open_offsets()):
            self.stats.last_commit = now
            self.ingest.lag()

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
        self.alerter.ops_alert("policy-reload", "policy edit rejected; the last good policies stay in force",
                               "warning", {"errors": errors[:20]})

    def _set_redis_health(self, ok: bool, error: str | None) -> None:
        if ok != self._redis_ok:
            if ok:
                log.info("redis reachable again")
                self.alerter.ops_resolve("redis")
            else:
                log.error("redis unreachable: %s", error)
                self.alerter.ops_alert("redis", f"Redis unreachable: {error}", "critical", {})
        self._redis_ok = ok
        self.metrics.redis_up.set(1 if ok else 0)

    def shutdown(self) -> None:
        """Finish the open windows, act on them, save, commit, close."""
        now = self.clock()
        try:
            signals = self.aggregator.close_all()
            self._unsaved.extend(signals)
            if signals:
                self._closed_until = max(self._closed_until, max(s.end for s in signals))
                self._decide(signals, now)
            deadline = time.monotonic() + 5
            while self.actuator.pending() and time.monotonic() < deadline:
                self._act(self.clock())
                time.sleep(0.1)
            self._persist(self.clock(), force=True)
            self._maybe_commit(self.clock(), force=True)
        finally:
            if self.golden is not None:
                self.golden.stop()
            if self.gpu is not None:
                self.gpu.stop()
            if self.ingest is not None:
                self.ingest.close()
            self.flags.close()
            self.alerter.stop(timeout=5)
            gc.unfreeze()  # let whatever this daemon held be collected (tests run several per process)
            log.info("llm-watchdog stopped")

    # -- surface -------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        out = []
        if not self._redis_ok:
            out.append(f"redis: {self.actuator.last_error or 'unreachable'}")
        if self.ingest is None or not self.ingest.healthy:
            out.append(f"kafka: {(self.ingest and self.ingest.last_error) or 'not connected'}")
        if self.actuator.pending():
            out.append(f"{self.actuator.pending()} flag change(s) pending")
        return out

    def alive(self) -> bool:
        return time.monotonic() - self.stats.last_loop < 30

    def status(self) -> dict[str, Any]:
        return {
            "instance": self.cfg.instance,
            "uptime_s": round(time.time() - self.stats.started_at, 1),
            "ready": not self.problems(),
            "problems": self.problems(),
            "policies": [p.name for p in self.loader.policy_set.policies],
            "flags": {f"{m}/{r}": p for (m, r), p in self.flags.snapshot().items()},
            "verdicts": self.engine.snapshot(),
            "pending_decisions": self.actuator.pending(),
            "windows_closed": self.stats.windows_closed,
            "open_windows": self.aggregator.open_windows(),
            "recent_actions": self.stats.last_actions[-20:],
            "incidents": self.alerter.open_incidents(),
            "alerts": self.alerter.stats(),
            "golden": self.golden.status() if self.golden is not None else [],
            "gpu": [h.to_dict() for h in self.gpu.latest()] if self.gpu is not None else [],
            "heavy_modules_loaded": sorted(m for m in ("torch", "transformers", "evaluate", "pynvml")
                                           if m in sys.modules),
        }


def _window_record(sig: Signal) -> dict[str, Any]:
    return {"schema": 1, "source": sig.source, "model": sig.model, "route": sig.route, "precision": sig.precision,
            "start": sig.start, "end": sig.end, "samples": sig.samples, "values": sig.values}


def _action_dict(a: Action) -> dict[str, Any]:
    return {"kind": a.kind, "policy": a.policy, "model": a.model, "route": a.route, "precision": a.precision,
            "reason": a.reason, "severity": a.severity, "dry_run": a.dry_run, "at": a.at}
