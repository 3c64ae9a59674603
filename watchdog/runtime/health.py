"""Named not-ready reasons, their metrics and one debounced ops alert per outage.

The daemon sets the conditions it observes each loop (``set(reason, message)`` / ``clear(reason)``).
``problems()`` is what /readyz and /status show; ``llmwd_not_ready{reason}`` and ``llmwd_ready`` follow.
An ops alert fires once a condition has held for ``fire_after_s`` and resolves once it has been clear
for ``resolve_after_s``, so a flapping Redis gives one page, not five.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from watchdog.core.metrics import Metrics

#: every reason the daemon may report (docs/OPERATIONS.md, "Readiness")
REASONS = ("starting", "kafka", "kafka-startup", "undecodable", "unassigned", "loop-stuck", "watermark-stuck",
           "redis", "redis-auth", "redis-tls", "dlq", "offsets-reset", "unrestored", "fenced", "pending-flips")

#: reasons that page (the others show in /readyz only)
_SEVERITY = {"redis": "critical", "redis-auth": "critical", "redis-tls": "critical", "kafka": "critical",
             "kafka-startup": "critical", "undecodable": "critical", "unassigned": "warning",
             "watermark-stuck": "warning", "dlq": "critical", "offsets-reset": "warning", "unrestored": "critical",
             "fenced": "warning", "loop-stuck": "critical"}


#: events rather than conditions: paged at once, shown in readiness only briefly
_IMMEDIATE = {"offsets-reset"}
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
                    delay = 0.0 if reason in _IMMEDIATE else self.fire_after_s
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
