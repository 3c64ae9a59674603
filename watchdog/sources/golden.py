"""Golden replays as a signal source: scheduled (APScheduler) and on demand.

Each job replays one golden set through a candidate and a baseline engine and turns the drift
report into ``source: golden`` signals for every route the job guards. Jobs run in the scheduler's
worker threads, never two runs of one job at once; the daemon's main loop drains finished reports
through ``drain``. Engines are built lazily inside the job, so a daemon without golden jobs never
imports torch; they stay resident between replays (``watchdog.sources.engine_cache``: bounded,
released on config change, idle timeout or when the scheduler stops).

One schema: the config models (``watchdog.config.settings.GoldenConfig`` / ``GoldenJobConfig``) are
turned into a scheduler here (``GoldenScheduler.from_config``), nowhere else. ``GoldenLeader`` runs
the scheduler only on the replica that holds the group's golden lease; ``watchdog.runtime.golden.GoldenRelay`` takes the signals
of its replays to the replica owning each route, and requests raised elsewhere to it.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import redis

from watchdog.config.settings import GoldenConfig, GoldenJobConfig
from watchdog.core.metrics import Metrics
from watchdog.core.schedule import cron_trigger
from watchdog.core.signals import Signal
from watchdog.sources.engine_cache import EngineBuildError, EngineCache

log = logging.getLogger(__name__)

#: seconds from the scheduler's start to an ``every_s`` job's first run (``every_s`` if shorter) when none ran
#: within ``every_s`` or none is known: long enough for the daemon to settle, short enough to see a broken
#: job soon
FIRST_RUN_S = 60.0
#: runs one replay: (job) -> a report with ``to_signals(model, route)`` and ``save(dir)``, or a
#: (report, extra candidate values) pair
ReplayFn = Callable[["GoldenJob"], Any]


@dataclass
class GoldenJob:
    """A ``golden.jobs`` entry of the daemon config (``spec``, the one schema) and its run state."""

    spec: GoldenJobConfig
    #: where its set is looked up (``golden.root``; None: ``probes.golden.default_root``)
    root: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    last_run: float | None = None
    last_error: str | None = None
    #: extra candidate values of the last run (e.g. fp8_saturation)
    last_extra: dict[str, float] = field(default_factory=dict)
    runs: int = 0

    @property
    def name(self) -> str:
        return self.spec.name


class ReplayFailed(Exception):
    """A replay that produced no report, and whose failure it was (``side``, the error signal's
    ``failed_side``): ``candidate`` (its engine could not be built: FP8's failure, counted toward the
    rule's ``errors_trip_after``), ``baseline``, ``both`` (not one engine's: a shared engine, the
    scoring, the scheduler) or ``set``. Only the candidate's trips the rule (policy/evaluate.py)."""

    side = "both"

    def __init__(self, message: str, side: str | None = None) -> None:
        super().__init__(message)
        if side is not None:
            self.side = side


class GoldenSetInvalid(ReplayFailed):
    """The job's golden set could not be loaded (gone, or an edit made it invalid): nothing was replayed,
    and neither engine is to blame."""

    side = "set"


def _load_set(job: GoldenJob) -> Any:
    from probes.golden import GoldenSetError, find_golden_set, load_golden_set

    try:
        return load_golden_set(find_golden_set(job.spec.set, job.root))
    except GoldenSetError as exc:
        more = f" (and {len(exc.errors) - 1} more problems)" if len(exc.errors) > 1 else ""
        raise GoldenSetInvalid(f"golden set invalid: {exc.errors[0] if exc.errors else exc}{more}") from None


def default_replay(job: GoldenJob, engines: EngineCache | None = None) -> Any:
    """Replay the job's set through its candidate and baseline engines.

    The set is read from disk at every replay, so an edit takes effect at the next one; one that
    leaves it invalid raises ``GoldenSetInvalid``. With ``engines`` (the scheduler's resident cache)
    the engines are taken from it and stay loaded and compiled for the next replay; without, both
    are built here and closed after."""
    from probes.golden_replay import replay

    golden = _load_set(job)
    if job.spec.max_items is not None:
        golden = golden.head(job.spec.max_items)
    if engines is None:
        engines = EngineCache(max_engines=2, idle_s=None)
        try:
            return _replay_with(job, engines, golden, replay)
        finally:
            engines.close()
    return _replay_with(job, engines, golden, replay)


def _replay_with(job: GoldenJob, engines: EngineCache, golden: Any, replay: Callable[..., Any]) -> Any:
    try:
        with engines.lease(job.name, [job.spec.candidate, job.spec.baseline]) as (candidate, baseline):
            return _replay_leased(job, golden, replay, candidate, baseline)
    except EngineBuildError as exc:
        raise _build_failed(job, exc) from exc


def _build_failed(job: GoldenJob, exc: EngineBuildError) -> ReplayFailed:
    """An engine of the job could not be built: whose it was (one config for both sides: both)."""
    shared = job.spec.candidate == job.spec.baseline
    side = "both" if shared else ("candidate", "baseline")[exc.index]
    what = f"{exc.options.get('kind', '?')}, {exc.options.get('precision', '?')}"
    return ReplayFailed(f"{'shared' if shared else side} engine could not be built ({what}): {exc}", side)


def _replay_leased(job: GoldenJob, golden: Any, replay: Callable[..., Any], candidate: Any, baseline: Any) -> Any:
    reset = getattr(candidate, "reset_saturation", None)
    if callable(reset):
        reset()  # a resident engine: count this replay's saturation, not the runs before
    report = replay(golden, candidate, baseline, progress=False, repeat_baseline=job.spec.repeat_baseline)
    extra: dict[str, float] = {}
    saturation = getattr(candidate, "saturation", lambda: None)()
    if saturation is not None:
        # share of FP8 activations clipped at +-448: rising means the calibration went stale
        extra["fp8_saturation"] = float(saturation.total)
    return report, extra


class GoldenScheduler:
    def __init__(self, jobs: list[GoldenJob], replay_fn: ReplayFn | None = None,
                 reports_dir: str | Path | None = None, debounce_s: float = 60.0,
                 engines: EngineCache | None = None, reports_keep: int = 720,
                 reports_max_age_s: float | None = None) -> None:
        self.jobs = {j.name: j for j in jobs}
        #: engines kept loaded between replays (None: each replay builds and closes its own)
        self.engines = engines
        self.replay_fn: ReplayFn = replay_fn or functools.partial(default_replay, engines=engines)
        self.reports_dir = Path(reports_dir) if reports_dir else None
        #: reports kept per job in ``reports_dir``: the newest this many, none older than the age
        self.reports_keep = reports_keep
        self.reports_max_age_s = reports_max_age_s
        self.debounce_s = debounce_s
        #: the signals of each finished run, one list per run (a run's candidate and baseline signals
        #: must reach the policy engine together)
        self._done: queue.SimpleQueue[tuple[str, list[Signal]]] = queue.SimpleQueue()
        self._scheduler: Any = None
        self._requested: dict[str, float] = {}
        #: (model, route) -> {metric: [rule names]} the policies judge on its golden signals (the daemon's
        #: ``PolicySet.golden_rules``); None: not checked
        self.judged: Callable[[str, str], Mapping[str, list[str]]] | None = None

    @classmethod
    def from_config(cls, cfg: GoldenConfig, replay_fn: ReplayFn | None = None,
                    metrics: Metrics | None = None) -> GoldenScheduler | None:
        """The scheduler of the daemon config's ``golden`` section; None when it has no jobs."""
        if not cfg.jobs:
            return None
        e = cfg.engines
        engines = None
        if e.resident:
            engines = EngineCache(max_engines=e.max_engines, idle_s=e.idle_s, metrics=metrics,
                                  max_bytes=int(e.max_gb * 1e9) if e.max_gb is not None else None)
        if e.compile_cache_dir:
            from probes.engines.torch_engine import use_compile_cache  # imports no torch

            try:
                use_compile_cache(e.compile_cache_dir, replace=False)
            except OSError as exc:
                log.warning("golden.engines.compile_cache_dir %s cannot be used (%s): in-process engines compile "
                            "into torch's and Triton's default caches", e.compile_cache_dir, exc)
        return cls([GoldenJob(j, root=cfg.root) for j in cfg.jobs], replay_fn=replay_fn,
                   reports_dir=cfg.reports_dir, debounce_s=cfg.debounce_s, engines=engines,
                   reports_keep=cfg.reports_keep, reports_max_age_s=cfg.reports_max_age_s)

    def start(self, last_runs: Mapping[str, float] | None = None) -> GoldenScheduler:
        """Schedule the jobs. An ``every_s`` job's first run comes ``every_s`` after its last run anywhere
        (``last_runs``: seconds since then, from the golden stream), or ``FIRST_RUN_S`` (at most
        ``every_s``) from now when that is sooner or unknown: a daemon restarted, or a lease handed over,
        more often than ``every_s`` pushed the next replay back by ``every_s`` each time and never replayed."""
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.interval import IntervalTrigger

        self._scheduler = BackgroundScheduler(job_defaults={"coalesce": True, "max_instances": 1})
        now = datetime.now(UTC)  # APScheduler's triggers are anchored on the wall clock
        for job in self.jobs.values():
            if job.spec.cron:
                trigger: Any = cron_trigger(job.spec.cron, job.spec.timezone, job.spec.jitter_s)
            elif job.spec.every_s:
                since = (last_runs or {}).get(job.name)
                soon = min(job.spec.every_s, FIRST_RUN_S)
                first_s = soon if since is None else max(soon, job.spec.every_s - since)
                trigger = IntervalTrigger(seconds=job.spec.every_s, jitter=job.spec.jitter_s,
                                          start_date=now + timedelta(seconds=first_s))
                log.info("golden replay %s: first run in %.0f s (%s)", job.name, first_s,
                         "no earlier run found" if since is None else f"last run {since:.0f} s ago")
            else:
                continue
            self._scheduler.add_job(self.run_job, trigger, args=[job.name], id=job.name, name=job.name)
        self._scheduler.start()
        return self

    def stop(self) -> None:
        """Stop scheduling; resident engines are released (after a replay still running)."""
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None
        if self.engines is not None:
            self.engines.close()

    def sweep(self) -> int:
        """Release resident engines idle past their timeout (the daemon's loop calls this)."""
        return self.engines.sweep() if self.engines is not None else 0

    def request(self, model: str, route: str, reason: str, now: float | None = None) -> list[str]:
        """Replay now every on-suspicion job guarding (model, route); debounced per job."""
        now = time.time() if now is None else now
        started = []
        for job in self.jobs.values():
            if not job.spec.on_suspicion or job.spec.model != model or route not in job.spec.routes:
                continue
            if now - self._requested.get(job.name, -1e18) < self.debounce_s:
                continue
            self._requested[job.name] = now
            log.info("golden replay %s requested: %s", job.name, reason)
            threading.Thread(target=self.run_job, args=[job.name], name=f"golden-{job.name}", daemon=True).start()
            started.append(job.name)
        return started

    def run_job(self, name: str) -> bool:
        """Run one replay unless that job is already running; queue its signals."""
        job = self.jobs[name]
        if not job.lock.acquire(blocking=False):
            log.info("golden replay %s already running; skipped", name)
            return False
        started = time.time()
        try:
            result = self.replay_fn(job)
            report, extra = result if isinstance(result, tuple) else (result, {})
            job.last_extra = dict(extra)
            self._save(job, report)
            signals = []
            for route in job.spec.routes:
                for sig in report.to_signals(job.spec.model, route):
                    if sig.precision == job.spec.candidate.get("precision"):
                        sig.values.update(extra)
                    signals.append(sig)
            self._done.put((name, signals))
            job.last_error = _not_judged(signals) or self._unmeasured(job, signals)
            return True
        except ReplayFailed as exc:  # the set or an engine that cannot be built, named: no traceback
            log.error("golden replay %s not run: %s", name, exc)
            log.debug("golden replay %s not run", name, exc_info=True)
            job.last_error = str(exc)
            self._failed(job, started, str(exc), exc.side)
            return False
        except Exception as exc:  # noqa: BLE001 - a failed replay is an error signal, not a crash
            log.exception("golden replay %s failed", name)
            job.last_error = str(exc)
            # raised outside both engines' calls (those are per-item errors in the report): not FP8's
            self._failed(job, started, f"replay failed: {type(exc).__name__}: {exc}", "both")
            return False
        finally:
            job.runs += 1
            job.last_run = time.time()
            job.lock.release()

    def _unmeasured(self, job: GoldenJob, signals: list[Signal]) -> str | None:
        """The metrics golden rules of the job's routes judge that its replay did not measure (a manifest
        edit dropped one from ``metrics``, an engine that cannot score for ``ppl``): those rules stay
        inconclusive, so a damaged FP8 would never be rolled back by them. None when all were measured."""
        missing: dict[str, set[str]] = {}
        precision = job.spec.candidate.get("precision")
        for sig in signals:
            if self.judged is None or sig.error or sig.precision != precision:
                continue
            for metric, rules in self.judged(sig.model, sig.route).items():
                if metric not in sig.values and not (sig.paired or {}).get(metric):
                    missing.setdefault(metric, set()).update(rules)
        return "; ".join(f"{m} not measured by set {job.spec.set} (rules {', '.join(sorted(r))} judge nothing)"
                         for m, r in sorted(missing.items())) or None

    def _save(self, job: GoldenJob, report: Any) -> None:
        """Write the report under ``reports_dir/<job>`` and delete those past the retention. A report
        that cannot be written (a full disk) is logged, never an error of the replay: its signals judge
        FP8 all the same."""
        from probes.drift import prune_reports

        if self.reports_dir is None:
            return
        out = self.reports_dir / job.name
        try:
            report.save(out)
        except OSError as exc:
            log.error("golden replay %s: report not saved: %s", job.name, exc)
        try:  # also after a failed save: what it deletes may be what the disk lacked
            gone = prune_reports(out, self.reports_keep, self.reports_max_age_s)
        except OSError as exc:
            log.error("golden replay %s: old reports not deleted: %s", job.name, exc)
            return
        if gone:
            log.debug("golden replay %s: %d old reports deleted", job.name, len(gone))

    def _failed(self, job: GoldenJob, started: float, error: str, failed_side: str) -> None:
        """A replay that produced no report: one error signal per guarded route. ``failed_side`` (``ReplayFailed.side``)
        decides whether it counts toward the rule's ``errors_trip_after``: only ``candidate`` does."""
        detail = {"failed_side": failed_side, "golden_set": job.spec.set}
        self._done.put((job.name, [Signal(source="golden", model=job.spec.model, route=route,
                                          precision=str(job.spec.candidate.get("precision", "fp8")), start=started,
                                          end=time.time(), samples=0, error=error, detail=dict(detail))
                                   for route in job.spec.routes]))

    def drain_runs(self) -> list[tuple[str, list[Signal]]]:
        """(job name, its signals) of each run finished since the last call; idle engines are swept."""
        self.sweep()
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def drain(self, now: float | None = None) -> list[Signal]:
        """The signals of the runs finished since the last call, in one list."""
        return [sig for _job, run in self.drain_runs() for sig in run]

    def failing(self) -> dict[str, str]:
        """{job: why} of the jobs whose last replay judged nothing of the candidate (the readiness reason
        ``golden``): the set could not be loaded, the replay itself raised, the baseline failed every
        item, or a metric golden rules judge was not measured. A report whose candidate failed every item
        is not here: that is a verdict on FP8."""
        return {j.name: j.last_error for j in self.jobs.values() if j.last_error}

    def engines_status(self) -> dict[str, Any] | None:
        return self.engines.status() if self.engines is not None else None

    def status(self) -> list[dict[str, Any]]:
        return [{"job": j.name, "set": j.spec.set, "routes": j.spec.routes, "runs": j.runs, "last_run": j.last_run,
                 "running": j.lock.locked(), "last_error": j.last_error, **j.last_extra} for j in self.jobs.values()]


def _not_judged(signals: list[Signal]) -> str | None:
    """The error of a replay whose baseline failed every item (nothing of FP8 judged), else None."""
    for sig in signals:
        if sig.error and sig.detail.get("failed_side") in ("baseline", "both"):
            return sig.error
    return None


class _Lease(Protocol):
    def tick(self, now: float) -> bool: ...

    def release(self) -> None: ...


class GoldenLeader:
    """Runs ``scheduler`` only while this replica holds ``lease`` (``watchdog.state.lease.Lease``): one
    replica of a consumer group replays, and only it answers on-suspicion requests."""

    def __init__(self, scheduler: GoldenScheduler, lease: _Lease,
                 forward: Callable[[str, str, str, float], None] | None = None,
                 last_runs: Callable[[set[str]], dict[str, float]] | None = None) -> None:
        self.scheduler = scheduler
        self.lease = lease
        #: seconds since each job last replayed on any replica (``GoldenStream.last_runs``); None: unknown
        self.last_runs = last_runs
        self.running = False
        #: where a request goes while this replica does not replay (the holder, through Redis:
        #: ``watchdog.runtime.golden.GoldenRelay.forward``); None: dropped
        self.forward = forward

    def tick(self, now: float) -> None:
        """Renew or take the lease (called by the main loop); start or stop the scheduler with it."""
        held = self.lease.tick(now)
        if held and not self.running:
            self.scheduler.start(self._last_runs())
            self.running = True
        elif not held and self.running:
            self.scheduler.stop()
            self.running = False

    def _last_runs(self) -> dict[str, float] | None:
        if self.last_runs is None:
            return None
        try:
            return self.last_runs(set(self.scheduler.jobs))
        except (redis.RedisError, OSError) as exc:  # then each job's first run comes soon
            log.warning("golden replays' last runs not read (%s): each job runs in %.0f s", exc, FIRST_RUN_S)
            return None

    def request(self, model: str, route: str, reason: str, now: float) -> None:
        """An on-suspicion replay of (model, route): here if this replica replays, else forwarded."""
        if self.running:
            self.scheduler.request(model, route, reason, now)
        elif self.forward is not None:
            self.forward(model, route, reason, now)

    def stop(self) -> None:
        """Stop replaying and hand the lease back (daemon shutdown)."""
        if self.running:
            self.scheduler.stop()
            self.lease.release()
            self.running = False
