"""Is the daemon ready, and is it alive: named not-ready reasons, Redis health, the loop's checks.

* ``Readiness``: the daemon sets the conditions it observes (``set(reason, message)`` / ``clear(reason)``).
  ``problems()`` is what /readyz and /status show; ``llmwd_not_ready{reason}`` and ``llmwd_ready`` follow.
  An ops alert fires once a condition has held for ``fire_after_s`` and resolves once it has been clear
  for ``resolve_after_s``, so a flapping Redis gives one page, not five.
* ``RedisHealth``: the one answer to "is Redis OK?". Every Redis user of the daemon reports to it
  (``failed(exc, what)`` / ``recovered()``); it owns the reasons ``redis``, ``redis-auth``, ``redis-tls``
  and the ``llmwd_redis_up`` gauge. The actuator's state after each pump is fed in (``writer``): while
  flag writes fail, a successful checkpoint does not declare Redis recovered.
* ``LoopHealth``: what the main loop checks each iteration (Kafka, assignment, watermarks, dead letters,
  offset resets, fencing, pending flips), ``problems()`` (with a stuck loop) and ``alive()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from watchdog.core.metrics import Metrics
from watchdog.ingest.startup import redis_cause

if TYPE_CHECKING:
    from watchdog.actuation.actuator import Actuator
    from watchdog.config.settings import Config
    from watchdog.ingest.consumer import Ingest
    from watchdog.ingest.eventtime import Watermarks
    from watchdog.runtime.stats import DaemonStats

log = logging.getLogger(__name__)

#: every reason the daemon may report (docs/OPERATIONS.md, "Readiness")
REASONS = ("starting", "kafka", "kafka-startup", "undecodable", "unassigned", "loop-stuck", "watermark-stuck",
           "redis", "redis-auth", "redis-tls", "dlq", "offsets-reset", "unrestored", "fenced", "pending-flips",
           "clock-skew", "broker-slow", "thread-died", "route-limit", "golden")

#: reasons that page (the others show in /readyz only)
_SEVERITY = {"redis": "critical", "redis-auth": "critical", "redis-tls": "critical", "kafka": "critical",
             "kafka-startup": "critical", "undecodable": "critical", "unassigned": "warning",
             "watermark-stuck": "warning", "dlq": "critical", "offsets-reset": "warning", "unrestored": "critical",
             "fenced": "warning", "loop-stuck": "critical", "clock-skew": "warning",
             "broker-slow": "warning", "thread-died": "critical", "route-limit": "warning", "golden": "warning"}


#: events rather than conditions: paged at once, shown in readiness only briefly
_IMMEDIATE = {"offsets-reset"}
#: seconds a condition lasts before it pages, where not ``fire_after_s``: a Redis operation reports
#: only after its socket timeout (2 s), so Redis reasons page 1.5 s later - within 5 s of the outage
_FIRE_AFTER = {"redis": 1.5, "redis-auth": 1.5, "redis-tls": 1.5}
#: reasons paged under another reason's incident (one page per outage: a broker restart that lost its
#: data is one Kafka outage, whether we saw it as "not answering" first or only as offsets going back)
_ALERT_KEY = {"offsets-reset": "kafka", "kafka-startup": "kafka", "undecodable": "undecodable"}


@dataclass
class _Condition:
    message: str
    since: float
    cleared_at: float | None = None
    alerted: bool = False


class Readiness:
    def __init__(self, metrics: Metrics, ops_alert: Callable[[str, str, str], Any],
                 ops_resolve: Callable[[str], Any], fire_after_s: float = 3.0, resolve_after_s: float = 5.0) -> None:
        self.metrics = metrics
        self._ops_alert = ops_alert
        self._ops_resolve = ops_resolve
        self.fire_after_s = fire_after_s
        self.resolve_after_s = resolve_after_s
        self._lock = threading.Lock()
        self._cond: dict[str, _Condition] = {}
        for r in REASONS:
            metrics.not_ready.labels(r).set(0)
        for r in _SEVERITY:  # paging reasons start at 0, so increase() sees the first page
            metrics.ops_alerts.labels(r)
        metrics.ready.set(0)
        self._shown: set[str] | None = None

    def set(self, reason: str, message: str, now: float) -> None:
        with self._lock:
            c = self._cond.get(reason)
            if c is None:
                self._cond[reason] = _Condition(message, now)
            else:
                c.message = message
                c.cleared_at = None
        self._gauges()

    def clear(self, reason: str, now: float) -> None:
        with self._lock:
            c = self._cond.get(reason)
            if c is not None and c.cleared_at is None:
                c.cleared_at = now
        self._gauges()

    def _gauges(self) -> None:
        with self._lock:
            active = {r for r, c in self._cond.items() if c.cleared_at is None}
        if active != self._shown:
            self._shown = active
            for r in REASONS:
                self.metrics.not_ready.labels(r).set(1 if r in active else 0)
            self.metrics.ready.set(0 if active else 1)

    def active(self, reason: str) -> bool:
        with self._lock:
            c = self._cond.get(reason)
            return c is not None and c.cleared_at is None

    def problems(self, extra: list[str] | None = None) -> list[str]:
        with self._lock:
            out = [f"{r}: {c.message}" for r, c in sorted(self._cond.items()) if c.cleared_at is None]
        return out + list(extra or [])

    def tick(self, now: float) -> None:
        """Update metrics, fire and resolve the debounced ops alerts (called by the main loop)."""
        fire: list[tuple[str, str]] = []
        resolve: list[str] = []
        with self._lock:
            for reason, c in list(self._cond.items()):
                if c.cleared_at is None:
                    delay = 0.0 if reason in _IMMEDIATE else _FIRE_AFTER.get(reason, self.fire_after_s)
                    if not c.alerted and now - c.since >= delay and reason in _SEVERITY:
                        c.alerted = True
                        fire.append((reason, c.message))
                elif now - c.cleared_at >= self.resolve_after_s or not c.alerted:
                    del self._cond[reason]
                    if c.alerted:
                        resolve.append(reason)
        self._gauges()
        for reason, message in fire:
            self.metrics.ops_alerts.labels(reason).inc()
            self._ops_alert(_ALERT_KEY.get(reason, reason), message, _SEVERITY[reason])
        for reason in resolve:
            key = _ALERT_KEY.get(reason, reason)
            with self._lock:
                shared = any(c.alerted and _ALERT_KEY.get(r, r) == key for r, c in self._cond.items())
            if not shared:
                self._ops_resolve(key)


#: the readiness reasons ``RedisHealth`` owns
REDIS_REASONS = ("redis", "redis-auth", "redis-tls")


class RedisHealth:
    """One tracker of Redis health for the whole daemon (see the module docstring)."""

    def __init__(self, readiness: Readiness, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.readiness = readiness
        self.metrics = metrics
        self.clock = clock
        #: False from a failed Redis operation until one succeeds while flag writes succeed too
        self.ok = True
        self._writer_error: str | None = None
        #: called when another Redis operation succeeds while flag writes are failing: the flag writer
        #: retries at once (else readiness and the pending flips waited out its backoff, up to 8 s
        #: after a 10 s outage)
        self.retry_writer: Callable[[], None] | None = None

    def failed(self, exc: BaseException, what: str) -> None:
        """A Redis operation (``what``) failed: not ready under the reason its error names."""
        reason, line = redis_cause(exc)
        if self.ok:
            log.error("%s: %s", what, line)
        self.ok = False
        self.readiness.set(reason, line, self.clock())
        self.metrics.redis_up.set(0)

    def recovered(self) -> None:
        """A Redis operation succeeded: ready again, unless flag writes are still failing."""
        if self._writer_error is not None:
            if self.retry_writer is not None:
                self.retry_writer()
            return
        if not self.ok:
            log.info("redis reachable again")
        self.ok = True
        now = self.clock()
        for r in REDIS_REASONS:
            self.readiness.clear(r, now)
        self.metrics.redis_up.set(1)

    def writer(self, healthy: bool, last_error: str | None) -> None:
        """The actuator's state after a pump: its failure is a Redis failure until a flip goes through."""
        if healthy:
            self._writer_error = None
        elif last_error:
            self._writer_error = last_error
            self.failed(Exception(last_error), "flip")


class LoopHealth:
    """The readiness conditions the main loop observes, and the loop's own liveness."""

    def __init__(self, cfg: Config, readiness: Readiness, wm: Watermarks, fenced: Callable[[], list[int]],
                 actuator: Actuator, stats: DaemonStats) -> None:
        self.cfg = cfg
        self.readiness = readiness
        self.wm = wm
        #: the partitions another replica fenced us out of that the group still hands us
        self.fenced = fenced
        self.actuator = actuator
        self.stats = stats
        self.ingest: Ingest | None = None
        self._no_assignment_since: float | None = None
        self._last_lag = 0.0
        #: records behind the log ends at the last lag check (None: not known yet)
        self._lag_total: int | None = None
        #: the daemon's long-lived threads (alert senders, readiness ticker, GPU monitor)
        self.threads: list[threading.Thread] = []

    def attach(self, ingest: Ingest, now: float) -> None:
        """Kafka clients are up: from ``now`` the group must hand us partitions."""
        self.ingest = ingest
        self._no_assignment_since = now

    def update(self, now: float) -> None:
        """Set or clear every condition the loop observes; fire and resolve ops alerts."""
        ingest = self.ingest
        assert ingest is not None
        self._kafka(ingest, now)
        self._threads(now)
        self._assignment(ingest, now)
        self._partitions(ingest, now)
        r = self.readiness
        pending = self.actuator.pending()
        if pending:
            r.set("pending-flips", f"{pending} flag change(s) pending", now)
        else:
            r.clear("pending-flips", now)
        if now - self._last_lag > 1.0:
            self._last_lag = now
            self._lag_total = sum(ingest.lag().values())
        r.tick(now)

    def caught_up(self, within: int = 1000) -> bool:
        """At most ``within`` records behind at the last lag check (Tansu's high watermark is off by up
        to a batch: it reports the high watermark at the start of the last batch, not its end)."""
        return self._lag_total is not None and self._lag_total <= within

    def _kafka(self, ingest: Ingest, now: float) -> None:
        r = self.readiness
        if ingest.last_polled:
            ingest.clear_broker_silence()
        silent = ingest.broker_silence()
        if ingest.healthy and silent is not None and now - silent > 2.0:
            r.set("kafka", f"broker not answering for {now - silent:.0f} s ({ingest.broker_error}): "
                  f"windows wait, nothing is closed on the wall clock", now)
        elif ingest.healthy:
            r.clear("kafka", now)
            r.clear("undecodable", now)
        else:
            r.set(ingest.error_reason or "kafka", ingest.last_error or "not connected", now)
        # records may flow while log-end requests time out: idle partitions then hold every window
        wait = ingest.broker_wait
        if wait.failing_since is not None and now - wait.failing_since > 2.0:
            r.set("broker-slow", f"log-end requests failing for {now - wait.failing_since:.0f} s (waiting up to "
                  f"{wait.timeout_ms} ms; {wait.last_error}): idle partitions cannot be confirmed, windows wait", now)
        else:
            r.clear("broker-slow", now)

    def _threads(self, now: float) -> None:
        dead = [t.name for t in self.threads if not t.is_alive()]
        if dead:
            self.readiness.set("thread-died", f"threads stopped: {', '.join(dead)[:200]} (see the log; restart "
                               "the daemon)", now)
        else:
            self.readiness.clear("thread-died", now)

    def _assignment(self, ingest: Ingest, now: float) -> None:
        r = self.readiness
        if ingest.assigned():
            self._no_assignment_since = None
            r.clear("unassigned", now)
            return
        self._no_assignment_since = self._no_assignment_since or now
        if now - self._no_assignment_since > self.cfg.kafka.unassigned_grace_s:
            r.set("unassigned", f"no partition assigned for {now - self._no_assignment_since:.0f} s "
                  f"(group {self.cfg.kafka.group_id}; a broker group wedge looks like this)", now)

    def _partitions(self, ingest: Ingest, now: float) -> None:
        r = self.readiness
        stuck_after = max(30.0, 3 * (self.cfg.windows.length_s + self.cfg.windows.grace_s))
        stuck = self.wm.stuck(now, stuck_after)
        if stuck:
            r.set("watermark-stuck", f"partitions {[pk[1] for pk in stuck]} deliver events but their event time "
                  f"has not advanced for {stuck_after:.0f} s", now)
        else:
            r.clear("watermark-stuck", now)
        dlq = ingest.dead_letters.failures()
        if dlq:
            r.set("dlq", "; ".join(f"partition {pk[1]} paused: {e}" for pk, e in sorted(dlq.items()))[:300], now)
        else:
            r.clear("dlq", now)
        resets = ingest.recent_resets(now, 3.0)
        if resets:
            r.set("offsets-reset", f"partitions {[pk[1] for pk in resets]}: offsets went back (broker "
                  f"restarted empty?)", now)
        else:
            r.clear("offsets-reset", now)
        fenced = self.fenced()
        if fenced:
            r.set("fenced", f"partitions {fenced} taken by another replica", now)
        else:
            r.clear("fenced", now)

    def problems(self) -> list[str]:
        extra = []
        if time.monotonic() - self.stats.last_loop > 15 and self.ingest is not None:
            extra.append(f"loop-stuck: no loop iteration for {time.monotonic() - self.stats.last_loop:.0f} s")
        return self.readiness.problems(extra)

    def alive(self) -> bool:
        return time.monotonic() - self.stats.last_loop < 30 or self.ingest is None
