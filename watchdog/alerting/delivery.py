"""Delivery to one alert channel: a bounded queue drained in order by one thread.

:class:`ChannelWorker` owns everything that touches the network for one channel: the queue
(oldest dropped, and counted, when full), the delivery thread, the HTTP POST through httpx, the
retry decision (connection errors, timeouts, 408/425/429 and 5xx are retried; other 4xx are not)
and the retry delays from :func:`watchdog.core.backoff.backoff_delay` on the monotonic clock. A
channel that fails or hangs delays only its own messages; the alerter never waits on it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from watchdog.alerting.channels import ActiveAlerts, Alert, Channel
from watchdog.core.backoff import backoff_delay

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Delivery:
    """One message on its way to one channel: the attempts so far and when the next is due."""

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
                 max_attempts: int, active: ActiveAlerts, rng: random.Random,
                 on_page: Callable[[str, int], None] | None = None) -> None:
        self._on_page = on_page or (lambda result, n: None)  # counts (delivered|failed|dropped, n) messages
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
            self._on_page("dropped", 1)
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
                        self._on_page("dropped", len(self._queue))
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
                        self._on_page("delivered", 1)
                        if item.done is not None:
                            item.done(True)
                    elif outcome == "retry" and item.attempt < self.max_attempts:
                        self.retried += 1
                        item.due = time.monotonic() + self._retry_delay(item.attempt, retry_after)
                        self._append(item, front=True)
                    else:
                        self.failed += 1
                        self._on_page("failed", 1)
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
