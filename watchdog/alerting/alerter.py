"""On-call alerting: one incident per (model, route, policy), delivered in the background.

:class:`IncidentBook` is the pure part: it turns policy actions and operational alerts into
:class:`~watchdog.alerting.channels.Alert` messages, opening one incident per key and suppressing
repeats until the incident escalates or resolves. :class:`Alerter` adds the I/O: one worker
thread per channel with a bounded queue, HTTP POST through httpx, and retries with exponential
backoff and jitter. ``handle()`` only enqueues; it never waits on the network.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from watchdog.alerting.channels import (
    ActiveAlerts,
    Alert,
    Channel,
    build_channel,
    rfc3339,
    scrub,
)
from watchdog.core.backoff import backoff_delay
from watchdog.core.signals import SEVERITIES, SEVERITY_RANK, Action, Severity

log = logging.getLogger(__name__)

OPS_PREFIX = "ops/"


@dataclass(slots=True)
class Incident:
    key: str
    severity: Severity
    summary: str
    description: str
    opened_at: float
    updated_at: float
    event: str
    model: str | None = None
    route: str | None = None
    policy: str | None = None
    dry_run: bool = False
    #: announcements already made for this incident ("rollback", "dry-rollback")
    announced: set[str] = field(default_factory=set)
    #: repeats suppressed since the incident opened
    repeats: int = 0
    last_reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "severity": self.severity,
            "summary": self.summary,
            "model": self.model,
            "route": self.route,
            "policy": self.policy,
            "event": self.event,
            "dry_run": self.dry_run,
            "opened_at": rfc3339(self.opened_at),
            "updated_at": rfc3339(self.updated_at),
            "repeats_suppressed": self.repeats,
            "last_reason": self.last_reason,
        }

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "severity": self.severity, "summary": self.summary,
                "description": self.description, "opened_at": self.opened_at, "updated_at": self.updated_at,
                "event": self.event, "model": self.model, "route": self.route, "policy": self.policy,
                "dry_run": self.dry_run, "announced": sorted(self.announced), "repeats": self.repeats,
                "last_reason": self.last_reason, "detail": self.detail}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Incident:
        return cls(d["key"], d["severity"], d["summary"], d["description"], float(d["opened_at"]),
                   float(d["updated_at"]), d["event"], d.get("model"), d.get("route"), d.get("policy"),
                   bool(d.get("dry_run")), set(d.get("announced") or []), int(d.get("repeats", 0)),
                   d.get("last_reason", ""), dict(d.get("detail") or {}))


def _precision(p: str | None, default: str) -> str:
    return (p or default).upper()


def describe(action: Action) -> tuple[str, Severity]:
    """Headline and severity of the message an action announces."""
    where = f"route {action.route} ({action.model})"
    dry = "DRY RUN: " if action.dry_run else ""
    if action.kind == "rollback":
        target = _precision(action.precision, "fp16")
        source = _precision(action.detail.get("from_precision"), "fp8")
        if action.dry_run:
            # Nothing changed in production: keep the policy's severity rather than paging.
            return f"{dry}would roll back {source} to {target} on {where} because {action.reason}", action.severity
        return f"{source} rolled back to {target} on {where} because {action.reason}", "critical"
    if action.kind == "promote":
        target = _precision(action.precision, "fp8")
        verb = "would promote" if action.dry_run else "promoted"
        return f"{dry}{verb} {where} back to {target}: {action.reason}", "info"
    if action.kind == "resolve":
        return f"{dry}resolved on {where}: {action.reason}", "info"
    return f"{dry}{action.policy} on {where}: {action.reason}", action.severity


class IncidentBook:
    """Pure incident state: which keys are open, and which messages an event produces."""

    def __init__(self, *, status_url: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self._open: dict[str, Incident] = {}
        self._status_url = status_url
        self._clock = clock
        self.suppressed = 0

    # -- inputs -------------------------------------------------------------------------------

    def on_action(self, action: Action) -> list[Alert]:
        if action.severity not in SEVERITY_RANK:
            raise ValueError(f"unknown severity {action.severity!r} (one of {', '.join(SEVERITIES)})")
        now = action.at or self._clock()
        summary, severity = describe(action)
        detail = scrub(action.detail)
        if action.kind in ("alert", "rollback"):
            tag = None
            if action.kind == "rollback":
                tag = "dry-rollback" if action.dry_run else "rollback"
            return self._fire(
                action.incident_key, severity, summary, action.reason, action.kind, now,
                model=action.model, route=action.route, policy=action.policy,
                dry_run=action.dry_run, tag=tag, detail=detail,
            )
        if action.kind == "promote":
            # A promote is a real state change: announce it even if the incident was forgotten.
            return self._close(action.incident_key, summary, action.reason, "promote", now, always=True,
                               model=action.model, route=action.route, policy=action.policy,
                               dry_run=action.dry_run, detail=detail)
        if action.kind == "resolve":
            return self._close(action.incident_key, summary, action.reason, "resolve", now, always=False,
                               model=action.model, route=action.route, policy=action.policy,
                               dry_run=action.dry_run, detail=detail)
        raise ValueError(f"unknown action kind {action.kind!r}")

    def on_ops_alert(self, key: str, summary: str, severity: Severity = "warning",
                     detail: Mapping[str, Any] | None = None) -> list[Alert]:
        if severity not in SEVERITY_RANK:
            raise ValueError(f"unknown severity {severity!r} (one of {', '.join(SEVERITIES)})")
        return self._fire(OPS_PREFIX + key, severity, summary, summary, "ops", self._clock(),
                          detail=scrub(detail or {}))

    def on_ops_resolve(self, key: str, summary: str | None = None) -> list[Alert]:
        incident = self._open.get(OPS_PREFIX + key)
        text = summary or (f"resolved: {incident.summary}" if incident else f"resolved: {key}")
        return self._close(OPS_PREFIX + key, text, text, "ops_resolve", self._clock(), always=False)

    # -- views --------------------------------------------------------------------------------

    def open_incidents(self) -> list[dict[str, Any]]:
        return [i.as_dict() for i in sorted(self._open.values(), key=lambda i: i.opened_at)]

    def active_alerts(self) -> list[Alert]:
        """The current firing message of every open incident (for receivers that need re-sending)."""
        return [self._alert(i, "firing", i.summary, i.description, i.event) for i in self._open.values()]

    def __len__(self) -> int:
        return len(self._open)

    def export(self, prefix: str = "") -> list[dict[str, Any]]:
        """Open incidents whose key starts with ``prefix``, as JSON (stored in Redis by the pager)."""
        return [i.to_json() for k, i in sorted(self._open.items()) if k.startswith(prefix)]

    def restore(self, incidents: list[dict[str, Any]]) -> None:
        for d in incidents:
            inc = Incident.from_json(d)
            self._open[inc.key] = inc

    # -- internals ----------------------------------------------------------------------------

    def _fire(self, key: str, severity: Severity, summary: str, description: str, event: str,
              now: float, *, model: str | None = None, route: str | None = None, policy: str | None = None,
              dry_run: bool = False, tag: str | None = None, detail: dict[str, Any] | None = None) -> list[Alert]:
        incident = self._open.get(key)
        if incident is None:
            incident = Incident(key, severity, summary, description, now, now, event, model, route, policy,
                                dry_run, detail=detail or {}, last_reason=description)
            if tag:
                incident.announced.add(tag)
            self._open[key] = incident
            return [self._alert(incident, "firing", summary, description, event)]
        incident.updated_at = now
        incident.last_reason = description
        escalates = SEVERITY_RANK[severity] > SEVERITY_RANK[incident.severity]
        new_announcement = tag is not None and tag not in incident.announced
        if not escalates and not new_announcement:
            incident.repeats += 1
            self.suppressed += 1
            return []
        previous = incident.severity
        if escalates:
            incident.severity = severity
        if tag:
            incident.announced.add(tag)
        incident.summary, incident.description, incident.event = summary, description, event
        incident.dry_run = dry_run
        incident.detail = detail or incident.detail
        return [self._alert(incident, "firing", summary, description, event,
                            previous=previous if escalates else None)]

    def _close(self, key: str, summary: str, description: str, event: str, now: float, *, always: bool,
               model: str | None = None, route: str | None = None, policy: str | None = None,
               dry_run: bool = False, detail: dict[str, Any] | None = None) -> list[Alert]:
        incident = self._open.pop(key, None)
        if incident is None:
            if not always:
                self.suppressed += 1
                return []
            # Unknown here (e.g. opened before a restart): reach every channel, so a receiver that still
            # holds the incident (PagerDuty, Alertmanager) closes it.
            incident = Incident(key, "critical", summary, description, now, now, event, model, route, policy,
                                dry_run)
        if incident.route is None and route is not None:
            incident.route, incident.model, incident.policy = route, model, policy
        if detail:
            incident.detail = detail
        if incident.summary and summary != incident.summary:
            description = f"{description} (was: {incident.summary})"
        return [self._alert(incident, "resolved", summary, description, event, ended_at=now, dry_run=dry_run)]

    def _alert(self, incident: Incident, status: Literal["firing", "resolved"], summary: str, description: str,
               event: str, *, previous: Severity | None = None, ended_at: float | None = None,
               dry_run: bool | None = None) -> Alert:
        return Alert(
            key=incident.key, status=status, severity=incident.severity, summary=summary,
            description=description, event=event, started_at=incident.opened_at, ended_at=ended_at,
            model=incident.model, route=incident.route, policy=incident.policy,
            dry_run=incident.dry_run if dry_run is None else dry_run, previous_severity=previous,
            detail=dict(incident.detail), url=self._status_url,
        )


@dataclass(slots=True)
class _Delivery:
    alert: Alert
    attempt: int = 0
    due: float = 0.0
    #: called once the message is delivered or given up (not when abandoned at stop)
    done: Callable[[bool], None] | None = None


class ChannelWorker:
    """Delivers one channel's alerts in order from a bounded queue, in its own thread.

    Order is kept per channel (a resolve never overtakes its trigger): while the head of the
    queue waits for a retry, the messages behind it wait too.
    """

    def __init__(self, channel: Channel, *, max_queue: int, backoff_initial: float, backoff_max: float,
                 max_attempts: int, active: ActiveAlerts, rng: random.Random) -> None:
        self.channel = channel
        self.max_queue = max_queue
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.max_attempts = max_attempts
        self._active = active
        self._rng = rng
        self._queue: deque[_Delivery] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None  # set by stop(): drain until then
        self._abandoned = 0  # deliveries dropped by the last stop()
        self._last_resend = time.monotonic()
        self.sent = self.failed = self.retried = self.dropped = 0
        self.last_error: str | None = None

    # -- called from any thread ---------------------------------------------------------------

    def put(self, alert: Alert, done: Callable[[bool], None] | None = None) -> None:
        with self._cond:
            self._append(_Delivery(alert, done=done))
            self._cond.notify()

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._deadline = None
        self._abandoned = 0
        self._thread = threading.Thread(target=self._run, name=f"alerts-{self.channel.name}", daemon=True)
        self._thread.start()

    def request_stop(self, deadline: float) -> None:
        with self._cond:
            self._deadline = deadline
            self._cond.notify()

    def join(self, deadline: float) -> bool:
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()) + 0.05)
            if self._thread.is_alive():
                return False
            self._thread = None
        return not self._queue and not self._abandoned

    def stats(self) -> dict[str, Any]:
        return {"kind": self.channel.config.kind, "url": self.channel.endpoint(), "sent": self.sent,
                "failed": self.failed, "retried": self.retried, "dropped": self.dropped,
                "queued": self.queued(), "last_error": self.last_error}

    # -- worker thread ------------------------------------------------------------------------

    def _append(self, item: _Delivery, front: bool = False) -> None:
        if front:
            self._queue.appendleft(item)
        else:
            self._queue.append(item)
        while len(self._queue) > self.max_queue:
            lost = self._queue.popleft()
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # log the 1st, 2nd, 4th, 8th... drop, not all
                log.warning("alert queue of %s full: dropped %s (%s); %d dropped so far", self.channel.name,
                            lost.alert.key, lost.alert.status, self.dropped)

    def _next(self) -> _Delivery | None:
        """Wait for the next due delivery; None when stopping and done."""
        while True:
            item = self._wait()
            if not isinstance(item, str):
                return item
            # fetched without holding our lock: the alerter takes its lock, then ours
            alerts = [a for a in self._active() if self.channel.accepts(a)]
            with self._cond:
                for alert in alerts:
                    self._append(_Delivery(alert))

    def _wait(self) -> _Delivery | None | Literal["resend"]:
        with self._cond:
            while True:
                now = time.monotonic()
                stopping = self._deadline is not None
                if stopping and (not self._queue or now >= self._deadline):  # type: ignore[operator]
                    if self._queue:
                        self.dropped += len(self._queue)
                        self._abandoned += len(self._queue)
                        log.warning("alerts to %s: %d undelivered at stop", self.channel.name, len(self._queue))
                        self._queue.clear()
                    return None
                if self._queue and self._queue[0].due <= now:
                    return self._queue.popleft()
                waits = []
                if self._queue:
                    waits.append(self._queue[0].due - now)
                if stopping:
                    waits.append(self._deadline - now)  # type: ignore[operator]
                elif self.channel.resend_interval_s and not self._queue:
                    until = self._last_resend + self.channel.resend_interval_s - now
                    if until <= 0:
                        self._last_resend = now
                        return "resend"
                    waits.append(until)
                self._cond.wait(min(waits) if waits else None)

    def _run(self) -> None:
        ch = self.channel
        with httpx.Client(timeout=ch.config.timeout_s, headers=ch.headers()) as client:
            while (item := self._next()) is not None:
                outcome, retry_after = self._attempt(client, item)
                with self._cond:
                    if outcome == "ok":
                        self.sent += 1
                        if item.done is not None:
                            item.done(True)
                    elif outcome == "retry" and item.attempt < self.max_attempts:
                        self.retried += 1
                        item.due = time.monotonic() + self._retry_delay(item.attempt, retry_after)
                        self._append(item, front=True)
                    else:
                        self.failed += 1
                        if item.done is not None:
                            item.done(False)
                        log.error("alert %s (%s) to %s given up after %d attempt(s): %s", item.alert.key,
                                  item.alert.status, ch.name, item.attempt, self.last_error)

    def _attempt(self, client: httpx.Client, item: _Delivery) -> tuple[str, float | None]:
        item.attempt += 1
        ch = self.channel
        try:
            body = ch.payload(item.alert)
            resp = client.post(ch.endpoint(), json=body)
        except httpx.HTTPError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("alert to %s failed (attempt %d): %s", ch.name, item.attempt, self.last_error)
            return "retry", None
        except Exception as exc:  # a payload bug must not kill the delivery thread
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("alert to %s could not be built", ch.name)
            return "fail", None
        if 200 <= resp.status_code < 300:
            log.info("alert %s (%s) delivered to %s", item.alert.key, item.alert.status, ch.name)
            return "ok", None
        self.last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code in (408, 425, 429) or resp.status_code >= 500:
            log.warning("alert to %s failed (attempt %d): %s", ch.name, item.attempt, self.last_error)
            return "retry", _retry_after(resp)
        return "fail", None

    def _retry_delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before retry ``attempt`` of one delivery: the project's one schedule
        (``core.backoff``), jittered by this worker's own random stream, Retry-After honoured."""
        return backoff_delay(attempt, self.backoff_initial, self.backoff_max, self._rng, retry_after)


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return max(0.0, float(resp.headers.get("retry-after", "")))
    except ValueError:
        return None


class Alerter:
    """Turns actions and operational events into on-call messages on every configured channel."""

    def __init__(self, channels: Sequence[Channel | Mapping[str, Any] | Any], *, max_queue: int = 1000,
                 backoff_initial: float = 0.5, backoff_max: float = 60.0, max_attempts: int = 8,
                 status_url: str | None = None, clock: Callable[[], float] = time.time,
                 seed: int | None = None) -> None:
        if max_queue < 1 or max_attempts < 1 or backoff_initial <= 0 or backoff_max < backoff_initial:
            raise ValueError("alerter: need max_queue >= 1, max_attempts >= 1, 0 < backoff_initial <= backoff_max")
        built = [c if isinstance(c, Channel) else build_channel(c) for c in channels]
        self._dedupe_names(built)
        self._book = IncidentBook(status_url=status_url, clock=clock)
        self._lock = threading.Lock()
        rng = random.Random(seed)
        self.workers = [
            ChannelWorker(ch, max_queue=max_queue, backoff_initial=backoff_initial, backoff_max=backoff_max,
                          max_attempts=max_attempts, active=self._active_alerts, rng=random.Random(rng.random()))
            for ch in built
        ]
        self.invalid = 0

    @classmethod
    def from_config(cls, channels: Iterable[Mapping[str, Any] | Any], **kwargs: Any) -> Alerter:
        return cls(list(channels), **kwargs)

    @staticmethod
    def _dedupe_names(channels: list[Channel]) -> None:
        seen: dict[str, int] = {}
        for ch in channels:
            n = seen.get(ch.name, 0)
            seen[ch.name] = n + 1
            if n:
                ch.name = f"{ch.name}-{n + 1}"

    # -- inputs (never block on I/O) ----------------------------------------------------------

    def handle(self, action: Action, on_done: Callable[[], None] | None = None) -> list[Alert]:
        """Record an action; returns the messages it produced (empty when suppressed). ``on_done`` is
        called once every message is delivered or given up on every channel (at once when none)."""
        with self._lock:
            try:
                alerts = self._book.on_action(action)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self.invalid += 1
                log.error("alerter: cannot handle action %r for %s: %s", action.kind, action.incident_key, exc)
                alerts = []
            self._dispatch(alerts, on_done)
        return alerts

    def export_incidents(self) -> list[dict[str, Any]]:
        """Open route incidents (ops incidents are about this process and are not kept)."""
        with self._lock:
            return [d for d in self._book.export() if not d["key"].startswith(OPS_PREFIX)]

    def restore_incidents(self, incidents: list[dict[str, Any]]) -> None:
        with self._lock:
            self._book.restore(incidents)

    def incident(self, key: str) -> dict[str, Any] | None:
        """One open incident as JSON (None when closed or unknown)."""
        with self._lock:
            inc = self._book._open.get(key)  # noqa: SLF001 - the book is this class's own state
            return inc.to_json() if inc is not None else None

    def set_incident(self, key: str, data: dict[str, Any] | None) -> None:
        """Make the book's view of ``key`` what the shared store says (another replica may have paged it)."""
        with self._lock:
            self._book._open.pop(key, None)  # noqa: SLF001
            if data is not None:
                self._book.restore([data])

    def ops_alert(self, key: str, summary: str, severity: Severity = "warning",
                  detail: Mapping[str, Any] | None = None) -> list[Alert]:
        """Open (or escalate) an operational incident not tied to a route, e.g. "Redis unreachable"."""
        with self._lock:
            try:
                alerts = self._book.on_ops_alert(key, summary, severity, detail)
            except ValueError as exc:
                self.invalid += 1
                log.error("alerter: ops alert %s rejected: %s", key, exc)
                return []
            self._dispatch(alerts)
        return alerts

    def ops_resolve(self, key: str, summary: str | None = None) -> list[Alert]:
        with self._lock:
            alerts = self._book.on_ops_resolve(key, summary)
            self._dispatch(alerts)
        return alerts

    def _dispatch(self, alerts: list[Alert], on_done: Callable[[], None] | None = None) -> None:
        # called under self._lock so two threads' messages for one key reach the queues in order
        targets = [(alert, w) for alert in alerts for w in self.workers if w.channel.accepts(alert)]
        for alert in alerts:
            log.info("alert %s %s %s: %s", alert.status, alert.severity, alert.key, alert.summary)
        if on_done is None:
            for alert, worker in targets:
                worker.put(alert)
            return
        if not targets:
            on_done()
            return
        left = [len(targets)]
        guard = threading.Lock()

        def one_done(_ok: bool) -> None:
            with guard:
                left[0] -= 1
                last = left[0] == 0
            if last:
                on_done()

        for alert, worker in targets:
            worker.put(alert, one_done)

    def _active_alerts(self) -> list[Alert]:
        with self._lock:
            return self._book.active_alerts()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Alerter:
        for w in self.workers:
            w.start()
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Deliver what is queued for up to ``timeout`` s, then stop. True when all was delivered."""
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.request_stop(deadline)
        return all([w.join(deadline) for w in self.workers])

    def __enter__(self) -> Alerter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- views --------------------------------------------------------------------------------

    def open_incidents(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._book.open_incidents()

    @property
    def sent(self) -> int:
        return sum(w.sent for w in self.workers)

    @property
    def failed(self) -> int:
        return sum(w.failed for w in self.workers)

    @property
    def retried(self) -> int:
        return sum(w.retried for w in self.workers)

    @property
    def dropped(self) -> int:
        return sum(w.dropped for w in self.workers)

    @property
    def suppressed(self) -> int:
        return self._book.suppressed

    def stats(self) -> dict[str, Any]:
        with self._lock:
            open_count = len(self._book)
        return {
            "sent": self.sent,
            "failed": self.failed,
            "retried": self.retried,
            "suppressed": self.suppressed,
            "dropped": self.dropped,
            "invalid": self.invalid,
            "queued": sum(w.queued() for w in self.workers),
            "open_incidents": open_count,
            "channels": {w.channel.name: w.stats() for w in self.workers},
        }
