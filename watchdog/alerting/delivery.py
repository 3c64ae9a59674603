"""Delivery to one alert channel: a few sender threads draining that channel's own queue.

:class:`ChannelWorker` owns everything that touches the network for one channel: its
:class:`~watchdog.alerting.queue.DeliveryQueue` (in order per incident, up to ``max_in_flight``
incidents at once), the sender threads, the HTTP POST through httpx, the retry decision (connection
errors, timeouts, 408/425/429 and 5xx are retried; other 4xx are not) and the retry delays from
:func:`watchdog.core.backoff.backoff_delay` on the monotonic clock. The backoff is the channel's, not
each message's: after a retryable failure the channel sends one probe at a time, each after the
next backoff delay, and goes back to ``max_in_flight`` at once when one gets through, so a receiver
that is down is not hammered by every waiting message and gets them all soon after it is back. A
channel that fails or hangs delays only its own messages; the alerter never waits on it.

Durable pages come from a :class:`PageSource` (the Redis outbox's per-channel stream, see
``watchdog.actuation.pages``): the worker fetches at most ``window`` of them at a time, retries a
retryable failure until it is delivered or ``durable_give_up_s`` old, and acknowledges each by its
own id as soon as it is delivered or given up. In-memory messages (ops alerts) are retried the same
way, unless ``max_attempts`` is given: then they are given up after that many attempts.

A channel with ``group_wait_s`` (storm grouping, :mod:`watchdog.alerting.groups`) sends the route
incidents' messages that wait for it together, as one request: a message waits up to
``group_wait_s`` for company, a group holds at most ``group_max``; it is delivered, retried or given
up as a whole, and its durable pages are acknowledged in one round trip.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import httpx

from watchdog.alerting import groups
from watchdog.alerting.channels import Channel
from watchdog.alerting.message import ActiveAlerts, Alert
from watchdog.alerting.queue import Delivery, DeliveryQueue, PageSource, acker
from watchdog.core.backoff import backoff_delay

log = logging.getLogger(__name__)

#: seconds between two looks at the page source when nobody woke the worker
POLL_S = 1.0
#: a channel whose receiver answers after its ``timeout_s`` waits up to this many times longer
SLOW_TIMEOUT_FACTOR = 8.0
#: answers to a group that its parts may not get (too large, or one message in it the receiver
#: cannot take): the group is sent again as two halves, down to single messages, never given up whole
SPLIT_STATUSES = frozenset({400, 413, 422})
#: page ids of in-memory messages: this process, then a count
_PROCESS_ID = uuid.uuid4().hex[:12]
_SEQ = itertools.count(1)
#: ids of retried messages and of the parts of refused groups (``Delivery.batch``)
_BATCH = itertools.count(1)


class ChannelWorker:
    """Delivers one channel's alerts from its queue, in ``max_in_flight`` threads of its own."""

    def __init__(self, channel: Channel, *, max_queue: int, backoff_initial: float, backoff_max: float,
                 max_attempts: int | None, active: ActiveAlerts, rng: random.Random,
                 on_page: Callable[[str, str, int], None] | None = None, max_in_flight: int = 4,
                 durable_give_up_s: float = 3600.0) -> None:
        #: counts (channel, delivered|failed|dropped|retried, n) messages
        self._on_page = on_page or (lambda channel, result, n: None)
        self.channel = channel
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.max_attempts = max_attempts
        self.max_in_flight = max_in_flight
        self.durable_give_up_s = durable_give_up_s
        # a grouping channel holds enough pages for two full groups, so a storm is not cut in windows
        self.window = max(8 * max_in_flight, 2 * channel.group_max if channel.group_wait_s else 0)
        self._active = active
        self._rng = rng
        self._queue = DeliveryQueue(max_queue)
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._deadline: float | None = None  # set by stop(): drain until then
        self._abandoned = 0  # in-memory deliveries dropped by the last stop()
        self._last_resend = time.monotonic()
        self._source: PageSource | None = None
        self._fetching = False
        self._fetch_wanted = True
        self._next_poll = 0.0
        self._failures = 0  # retryable failures in a row: the channel's backoff
        self._resume_at = 0.0  # monotonic time of the next probe while failing
        self._next_start = 0.0  # monotonic time the next request may start (channel.min_interval_s)
        #: seconds to wait for an answer: ``timeout_s``, doubled after each answer that did not come
        #: in time (the receiver may have the message and be slow), back once one comes in time
        self.read_timeout = channel.config.timeout_s
        self.sent = self.failed = self.retried = self.dropped = 0
        #: requests that carried several incidents' messages (storm grouping)
        self.grouped = 0
        self.last_error: str | None = None

    # -- called from any thread ---------------------------------------------------------------

    def put(self, alert: Alert) -> None:
        with self._cond:
            self._count_dropped(self._queue.put(Delivery(alert, queued_at=time.monotonic())))
            self._cond.notify()

    def attach(self, source: PageSource) -> None:
        """Deliver this channel's durable pages from ``source`` too."""
        with self._cond:
            self._source = source
            self._wake_locked()

    def wake(self) -> None:
        """New durable pages may be waiting: fetch now rather than at the next poll."""
        with self._cond:
            self._wake_locked()

    def _wake_locked(self) -> None:
        self._fetch_wanted = True
        self._cond.notify()

    def queued(self) -> int:
        with self._cond:
            return len(self._queue) + self._queue.in_flight()

    def start(self) -> None:
        if any(t.is_alive() for t in self._threads):
            return
        self._deadline = None
        self._abandoned = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"alerts-{self.channel.name}-{i}",
                                          daemon=True) for i in range(self.max_in_flight)]
        for t in self._threads:
            t.start()

    def request_stop(self, deadline: float) -> None:
        with self._cond:
            self._deadline = deadline
            self._cond.notify_all()

    def join(self, deadline: float) -> bool:
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()) + 0.05)
        if any(t.is_alive() for t in self._threads):
            return False
        self._threads = []
        return not self._queue.in_memory() and not self._abandoned

    def stats(self) -> dict[str, Any]:
        return {"kind": self.channel.config.kind, "url": self.channel.endpoint(), "sent": self.sent,
                "failed": self.failed, "retried": self.retried, "dropped": self.dropped,
                "queued": self.queued(), "last_error": self.last_error, "grouped": self.grouped,
                "senders": sum(t.is_alive() for t in self._threads)}

    # -- sender threads -----------------------------------------------------------------------

    def _count_dropped(self, lost: list[Delivery]) -> None:
        for item in lost:
            self.dropped += 1
            self._on_page(self.channel.name, "dropped", 1)
            if self.dropped & (self.dropped - 1) == 0:  # log the 1st, 2nd, 4th, 8th... drop, not all
                log.warning("alert queue of %s full: dropped %s (%s); %d dropped so far", self.channel.name,
                            item.alert.key, item.alert.status, self.dropped)

    def _next(self, index: int) -> list[Delivery] | None:
        """Wait for the next message that may go (one delivery, or a group of them); None when
        stopping and done."""
        while True:
            got = self._wait(index)
            if got is None or isinstance(got, list):
                return got
            if got == "resend":
                # fetched without holding our lock: the alerter takes its lock, then ours
                alerts = [a for a in self._active() if self.channel.accepts(a)]
                with self._cond:
                    for alert in alerts:
                        self._count_dropped(self._queue.put(Delivery(alert, queued_at=time.monotonic())))
            else:
                self._fetch()

    def _fetch(self) -> None:
        source = self._source
        assert source is not None
        name = self.channel.name
        pages: list[tuple[str, Alert]] | None = []
        try:
            with self._cond:
                room = self.window - self._queue.durable()
            pages = source.fetch(name, max(0, room))  # with no room: only whether we may deliver
        except Exception:  # a source bug must not kill the sender thread
            log.exception("pages for %s could not be fetched", name)
            pages = []
        with self._cond:
            self._fetching = False
            self._next_poll = time.monotonic() + POLL_S
            if pages is None:  # another replica delivers this channel now: it sends what we had not
                if self._queue.drop_durable():
                    log.warning("pages of %s: delivered by another replica now", name)
                pages = []
            now = time.monotonic()
            for entry, alert in pages:
                self._queue.put(Delivery(alert, entry=entry, done=acker(source, name, entry), queued_at=now))
            self._cond.notify_all()

    def _wait(self, index: int) -> list[Delivery] | None | Literal["resend", "fetch"]:
        with self._cond:
            while True:
                now = time.monotonic()
                stopping = self._deadline is not None
                if stopping and (not self._queue.in_memory() or now >= self._deadline):  # type: ignore[operator]
                    self._abandon()
                    return None
                got = self._take(now)
                if isinstance(got, list):
                    return got
                waits = [got] if got is not None else []
                if stopping:
                    waits.append(self._deadline - now)  # type: ignore[operator]
                else:
                    if self._source is not None and not self._fetching:
                        room = self._queue.durable() < self.window
                        if (self._fetch_wanted and room) or now >= self._next_poll:
                            self._fetching, self._fetch_wanted = True, False
                            return "fetch"
                        waits.append(max(0.0, self._next_poll - now))
                    if index == 0 and self.channel.resend_interval_s and not len(self._queue):
                        until = self._last_resend + self.channel.resend_interval_s - now
                        if until <= 0:
                            self._last_resend = now
                            return "resend"
                        waits.append(until)
                self._cond.wait(min(waits) if waits else None)

    def _take(self, now: float) -> list[Delivery] | float | None:
        """The next message that may go (one delivery, or with ``group_wait_s`` a group of them),
        or how long to wait: while the channel fails, one probe at a time, after the channel's
        backoff delay; never two starts closer than the channel's ``min_interval_s``."""
        if self._failures and self._queue.in_flight():
            return None  # the probe in flight decides
        if self._failures and self._resume_at > now:
            return self._resume_at - now
        pace = self.channel.min_interval_s
        if pace and self._next_start > now and len(self._queue):
            return self._next_start - now
        ch = self.channel
        got: list[Delivery] | float | None
        if ch.group_wait_s:
            wait_s = 0.0 if self._deadline is not None else ch.group_wait_s  # stopping: no waiting
            got = self._queue.take_group(now, ch.group_max, wait_s, lambda d: groups.groupable(d.alert))
        else:
            one = self._queue.take(now)
            got = [one] if isinstance(one, Delivery) else one
        if pace and isinstance(got, list):
            self._next_start = now + pace
        return got

    def _abandon(self) -> None:
        left = [d for d in self._queue.drain() if not d.durable]  # durable ones stay in their store
        if left:
            self.dropped += len(left)
            self._on_page(self.channel.name, "dropped", len(left))
            self._abandoned += len(left)
            log.warning("alerts to %s: %d undelivered at stop", self.channel.name, len(left))

    def _run(self, index: int) -> None:
        ch = self.channel
        with httpx.Client(timeout=ch.config.timeout_s, headers=ch.headers()) as client:
            while (batch := self._next(index)) is not None:
                outcome, retry_after = self._attempt(client, batch)
                acked = outcome == "ok"
                if acked:  # first thing after the 2xx: the shortest window in which a crash would send it again
                    self._done(batch, True)
                    log.info("alert %s delivered to %s", _describe(batch), ch.name)
                with self._cond:
                    if outcome == "retry":
                        self._failures += 1
                        self._resume_at = time.monotonic() + self._retry_delay(self._failures, retry_after)
                    else:  # delivered, or refused by a receiver that answers: the channel is up
                        self._failures = 0
                    if outcome == "split":  # each half its own batch; the refusal is no attempt of theirs
                        half = (len(batch) + 1) // 2
                        for part in (batch[:half], batch[half:]):
                            tag = next(_BATCH)
                            for d in part:
                                d.batch, d.attempt = tag, d.attempt - 1
                        again = batch
                    else:
                        again = [d for d in batch if outcome == "retry" and self._may_retry(d)]
                        tag = next(_BATCH)  # retried as the same message (same id), not joined by others
                        for d in again:
                            d.batch = tag
                    kept = {id(d) for d in again}
                    over = [d for d in batch if id(d) not in kept]
                    if again:
                        self.retried += len(again)
                        self._on_page(ch.name, "retried", len(again))
                        for d in reversed(again):  # back in front, in their order
                            self._count_dropped(self._queue.retry(d))
                        self._cond.notify_all()
                    if over:
                        if outcome == "ok":
                            self.sent += len(over)
                            self.grouped += len(over) > 1
                        else:
                            self.failed += len(over)
                            log.error("alert %s to %s given up after %d attempt(s): %s", _describe(over),
                                      ch.name, max(d.attempt for d in over), self.last_error)
                        self._on_page(ch.name, "delivered" if outcome == "ok" else "failed", len(over))
                if not over:
                    continue
                if not acked:
                    self._done(over, outcome == "ok")  # outside our lock: it may write to Redis
                with self._cond:
                    for d in over:
                        self._queue.finish(d)
                    self._cond.notify_all()

    def _done(self, batch: list[Delivery], ok: bool) -> None:
        """Tell the page source the batch's durable pages are done, a group's in one round trip."""
        durable = [d for d in batch if d.entry is not None and d.done is not None]
        if len(durable) > 1 and self._source is not None:
            self._source.ack_many(self.channel.name, [d.entry for d in durable if d.entry is not None])
            durable_ids = {id(d) for d in durable}
            rest = [d for d in batch if id(d) not in durable_ids]
        else:
            rest = batch
        for d in rest:
            if d.done is not None:
                d.done(ok)

    def _may_retry(self, item: Delivery) -> bool:
        if item.durable or self.max_attempts is None:  # never lost to a receiver that is only down
            return time.monotonic() - (item.first_try or 0.0) < self.durable_give_up_s
        return item.attempt < self.max_attempts

    def _attempt(self, client: httpx.Client, batch: list[Delivery]) -> tuple[str, float | None]:
        for item in batch:
            item.attempt += 1
            if item.first_try is None:
                item.first_try = time.monotonic()
                if item.alert.page_id is None:  # an in-memory message: its id, the same on every retry
                    item.alert = replace(item.alert, page_id=f"{_PROCESS_ID}-{next(_SEQ)}")
        ch = self.channel
        alerts = [d.alert for d in batch]
        # a group's id names its pages: the same group retried carries the same Idempotency-Key
        key = groups.group_id(alerts) if len(alerts) > 1 else alerts[0].page_id
        attempt = max(d.attempt for d in batch)
        waited = self.read_timeout
        started = time.monotonic()
        try:
            body = ch.body(alerts, key)  # within the receiver's limits, valid UTF-8 JSON
            headers = {"Idempotency-Key": key} if key else None
            resp = client.post(ch.endpoint(), content=body, headers=headers,
                               timeout=httpx.Timeout(ch.config.timeout_s, read=waited))
        except httpx.ReadTimeout as exc:
            # sent, but no answer in time: a slow receiver that has it. Sending it again every
            # backoff with the same timeout would copy it each time and never get an answer.
            with self._cond:
                self.read_timeout = max(self.read_timeout,
                                        min(2 * waited, SLOW_TIMEOUT_FACTOR * ch.config.timeout_s))
            self.last_error = f"{type(exc).__name__}: no answer within {waited:g} s"
            log.warning("alert to %s failed (attempt %d): %s; waiting up to %g s next time", ch.name,
                        attempt, self.last_error, self.read_timeout)
            return "retry", None
        except httpx.HTTPError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("alert to %s failed (attempt %d): %s", ch.name, attempt, self.last_error)
            return "retry", None
        except Exception as exc:  # a payload bug must not kill the delivery thread
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("alert to %s could not be built", ch.name)
            return "fail", None
        if time.monotonic() - started < ch.config.timeout_s:
            with self._cond:
                self.read_timeout = ch.config.timeout_s  # answered in time again
        if 200 <= resp.status_code < 300:
            return "ok", None
        self.last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
        if resp.status_code in (408, 425, 429) or resp.status_code >= 500:
            log.warning("alert to %s failed (attempt %d): %s", ch.name, attempt, self.last_error)
            return "retry", _retry_after(resp)
        if len(batch) > 1 and resp.status_code in SPLIT_STATUSES:
            log.warning("alert %s to %s refused (%s): sent again as two groups", _describe(batch), ch.name,
                        self.last_error)
            return "split", None
        return "fail", None

    def _retry_delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before probe ``attempt`` of a failing channel: the project's one schedule
        (``core.backoff``), jittered by this worker's own random stream, Retry-After honoured."""
        return backoff_delay(attempt, self.backoff_initial, self.backoff_max, self._rng, retry_after)


def _describe(batch: list[Delivery]) -> str:
    """A log label: one message's incident and state, or a group's size."""
    if len(batch) == 1:
        return f"{batch[0].alert.key} ({batch[0].alert.status})"
    return f"group of {len(batch)} incidents ({batch[0].alert.key}, ...)"


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return max(0.0, float(resp.headers.get("retry-after", "")))
    except ValueError:
        return None
