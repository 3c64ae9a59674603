"""On-call alerting: actions and operational events in, one message per incident change out.

:class:`Alerter` is what the daemon, the outbox and the ``flags`` CLI call. It feeds each action
or operational alert to its :class:`~watchdog.alerting.incidents.IncidentBook` (which decides
whether the event is news) under one lock, and hands every resulting message to the
:class:`~watchdog.alerting.delivery.ChannelWorker` of each channel that accepts it (its
``min_severity``, and the policy's ``notify``/``page`` names when the policy names channels). ``handle()`` only enqueues; it never waits on the network. The daemon's pager uses ``render()``
instead (the book decides, nothing is queued: the pager writes the messages to each channel's
durable page stream) and ``attach()`` gives every worker that stream to deliver. Stats, open
incidents and the start/stop of the workers are here too.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from watchdog.alerting.channels import Channel, build_channel, unique_names
from watchdog.alerting.delivery import ChannelWorker
from watchdog.alerting.incidents import OPS_PREFIX, IncidentBook
from watchdog.alerting.message import Alert
from watchdog.alerting.queue import PageSource
from watchdog.core.signals import Action, Severity

log = logging.getLogger(__name__)


class Alerter:
    """Turns actions and operational events into on-call messages on every configured channel."""

    def __init__(self, channels: Sequence[Channel | Mapping[str, Any] | Any], *, max_queue: int = 1000,
                 backoff_initial: float = 0.5, backoff_max: float = 60.0, max_attempts: int | None = None,
                 status_url: str | None = None, clock: Callable[[], float] = time.time,
                 seed: int | None = None, on_page: Callable[[str, int], None] | None = None,
                 on_channel_page: Callable[[str, str, int], None] | None = None, max_in_flight: int = 4,
                 durable_give_up_s: float = 3600.0, evidence_url: str | None = None) -> None:
        """``on_page(result, n)`` counts messages over all channels: delivered, failed (given up) or
        dropped; ``on_channel_page(channel, result, n)`` the same per channel, plus ``retried``.
        An in-memory message (an ops alert) is retried like a page from the outbox, until it is
        ``durable_give_up_s`` old, unless ``max_attempts`` is given (a short-lived CLI)."""
        if max_queue < 1 or (max_attempts is not None and max_attempts < 1) or backoff_initial <= 0 \
                or backoff_max < backoff_initial:
            raise ValueError("alerter: need max_queue >= 1, max_attempts >= 1, 0 < backoff_initial <= backoff_max")
        if max_in_flight < 1:
            raise ValueError("alerter: need max_in_flight >= 1")
        built = [c if isinstance(c, Channel) else build_channel(c) for c in channels]
        self._dedupe_names(built)
        self._book = IncidentBook(status_url=status_url, clock=clock, evidence_url=evidence_url)
        self._lock = threading.Lock()
        rng = random.Random(seed)

        def count(channel: str, result: str, n: int) -> None:
            if on_page is not None and result != "retried":
                on_page(result, n)
            if on_channel_page is not None:
                on_channel_page(channel, result, n)

        self.workers = [
            ChannelWorker(ch, max_queue=max_queue, backoff_initial=backoff_initial, backoff_max=backoff_max,
                          max_attempts=max_attempts, active=self._active_alerts, rng=random.Random(rng.random()),
                          on_page=count, max_in_flight=max_in_flight, durable_give_up_s=durable_give_up_s)
            for ch in built
        ]
        self.invalid = 0
        self._shared_incidents: Callable[[], list[dict[str, Any]] | None] | None = None

    @classmethod
    def from_config(cls, channels: Iterable[Mapping[str, Any] | Any], **kwargs: Any) -> Alerter:
        return cls(list(channels), **kwargs)

    @staticmethod
    def _dedupe_names(channels: list[Channel]) -> None:
        for ch, name in zip(channels, unique_names([ch.name for ch in channels]), strict=True):
            ch.name = name

    # -- inputs (never block on I/O) ----------------------------------------------------------

    def handle(self, action: Action) -> list[Alert]:
        """Record an action and queue its messages in memory; returns them (empty when suppressed)."""
        with self._lock:
            alerts = self._render(action)
            self._dispatch(alerts)
        return alerts

    def render(self, action: Action) -> list[Alert]:
        """Record an action and return its messages without sending them: the pager writes them to
        each channel's durable page stream (``attach``), in the same step as the incident."""
        with self._lock:
            return self._render(action)

    def _render(self, action: Action) -> list[Alert]:
        try:
            return self._book.on_action(action)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.invalid += 1
            log.error("alerter: cannot handle action %r for %s: %s", action.kind, action.incident_key, exc)
            return []

    def channels_for(self, alert: Alert) -> list[str]:
        """Names of the channels that take ``alert``: its policy names them (or names none) and
        their ``min_severity`` accepts it (``Channel.accepts``)."""
        return [w.channel.name for w in self.workers if w.channel.accepts(alert)]

    def channel_names(self) -> list[str]:
        return [w.channel.name for w in self.workers]

    def attach(self, source: PageSource,
               incidents: Callable[[], list[dict[str, Any]] | None] | None = None) -> None:
        """Every channel also delivers its durable pages from ``source``, each at its own pace.
        ``incidents`` lists the route incidents open in the shared store (None when it cannot be
        read): a channel that re-posts open incidents asks it first, so an incident another replica
        resolved is not posted as firing again."""
        self._shared_incidents = incidents
        for w in self.workers:
            w.attach(source)

    def wake(self) -> None:
        """New durable pages were written: let every channel fetch them now."""
        for w in self.workers:
            w.wake()

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
            return self._book.get(key)

    def set_incident(self, key: str, data: dict[str, Any] | None) -> None:
        """Make the book's view of ``key`` what the shared store says (another replica may have paged it)."""
        with self._lock:
            self._book.replace(key, data)

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

    def resolve_ops(self, why: str) -> list[Alert]:
        """Close every open ops incident, saying ``why``: at stop, as they are about this process
        and are not kept, so a new start could never resolve them."""
        with self._lock:
            alerts = []
            for inc in self._book.export(OPS_PREFIX):
                text = f"resolved: {inc['summary']} ({why})"
                alerts += self._book.on_ops_resolve(inc["key"][len(OPS_PREFIX):], text)
            self._dispatch(alerts)
        return alerts

    def _dispatch(self, alerts: list[Alert]) -> None:
        # called under self._lock so two threads' messages for one key reach the queues in order
        for alert in alerts:
            log.info("alert %s %s %s: %s", alert.status, alert.severity, alert.key, alert.summary)
            for w in self.workers:
                if w.channel.accepts(alert):
                    w.put(alert)

    def _active_alerts(self) -> list[Alert]:
        shared = self._shared_incidents() if self._shared_incidents is not None else None
        with self._lock:
            if shared is not None:
                self._book.sync(shared, keep_prefix=OPS_PREFIX)
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
