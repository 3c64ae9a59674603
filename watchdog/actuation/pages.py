"""Each alert channel's durable page stream: its own position, acknowledged by id.

The pager (``watchdog.actuation.outbox``) copies the messages of an outbox record to one Redis
stream per channel that accepts them (``Keys.pages(group, channel)``). :class:`PageStreams` is the
:class:`~watchdog.alerting.delivery.PageSource` the channel workers read them from, through consumer
group ``pager``, so each channel has its own position and a dead or slow channel holds back only its
own stream. A delivered (or given up) page is acknowledged by its own entry id and deleted in one
MULTI (``XACK`` + ``XDEL``), so the stream holds exactly what that channel still owes.

A restart reads this consumer's own pending entries first (handed out, not acknowledged: sent again,
at least once, with the same page id), then new ones. Entries a dead replica held are claimed after
``claim_idle_s``; entries this process holds (waiting out a retry) are touched every third of that,
so no live replica's page is claimed and sent twice. Redis errors never reach the worker: a failed
fetch returns what it has, a failed acknowledgement is retried at the next fetch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from watchdog.alerting.channels import Alert
from watchdog.core.keys import Keys, text

log = logging.getLogger(__name__)

GROUP = "pager"


class PageStreams:
    def __init__(self, client: Any, keys: Keys, group: str, instance: str, claim_idle_s: float = 30.0) -> None:
        self.client = client
        self.keys = keys
        self.group = group
        self.instance = instance
        self.claim_idle_s = claim_idle_s
        self._lock = threading.Lock()
        self._held: dict[str, set[str]] = {}  # channel -> entry ids handed out and not yet acknowledged
        self._unacked: dict[str, set[str]] = {}  # delivered, acknowledgement failed: retried at the next fetch
        self._pending_from: dict[str, str | None] = {}  # cursor through our own pending entries; None: done
        self._last_touch: dict[str, float] = {}
        self._last_claim: dict[str, float] = {}
        self.error: str | None = None

    def stream(self, channel: str) -> str:
        return self.keys.pages(self.group, channel)

    def create(self, channels: list[str]) -> None:
        """Create each channel's stream and consumer group (Redis errors propagate)."""
        for channel in channels:
            try:
                self.client.xgroup_create(self.stream(channel), GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            with self._lock:
                self._pending_from.setdefault(channel, "0")

    def fetch(self, channel: str, n: int) -> list[tuple[str, Alert]]:
        """Up to ``n`` pages ``channel`` does not hold yet: own pending first, then new, then claimed."""
        got: list[tuple[str, Any]] = []
        try:
            self._retry_acks(channel)
            self._touch(channel)
            got = self._read(channel, n)
            self.error = None
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):  # Redis lost the stream: start afresh
                log.error("page stream of %s gone from Redis; re-creating it", channel)
                with self._lock:
                    self._pending_from[channel] = "0"
                self._safe(lambda: self.create([channel]))
            else:
                self._failed("fetch", channel, exc)
        except (redis.RedisError, OSError) as exc:
            self._failed("fetch", channel, exc)
        out: list[tuple[str, Alert]] = []
        with self._lock:
            held = self._held.setdefault(channel, set())
            for entry, fields in got:
                if entry in held:
                    continue
                raw = (fields or {}).get("json") or (fields or {}).get(b"json")
                try:
                    alert = Alert.from_json(text(raw)) if raw else None
                except (ValueError, TypeError) as exc:
                    log.error("page %s of %s unreadable, dropped: %s", entry, channel, exc)
                    alert = None
                held.add(entry)
                if alert is None:  # deleted while pending, or unreadable: nothing to send
                    self._unacked.setdefault(channel, set()).add(entry)
                    continue
                out.append((entry, alert))
        return out

    def _read(self, channel: str, n: int) -> list[tuple[str, Any]]:
        stream = self.stream(channel)
        got: list[tuple[str, Any]] = []
        with self._lock:
            cursor = self._pending_from.get(channel, "0")
        if cursor is not None:
            got += self._xread(stream, cursor, n)
            with self._lock:
                self._pending_from[channel] = got[-1][0] if len(got) >= n else None
        if len(got) < n:
            got += self._xread(stream, ">", n - len(got))
        now = time.monotonic()
        if len(got) < n and now - self._last_claim.get(channel, 0.0) > self.claim_idle_s / 2:
            self._last_claim[channel] = now
            claimed = self.client.xautoclaim(stream, GROUP, self.instance, min_idle_time=int(self.claim_idle_s * 1000),
                                             count=n - len(got))
            got += [(text(e), f) for e, f in (claimed[1] if len(claimed) > 1 else [])]
        return got

    def _xread(self, stream: str, start: str, n: int) -> list[tuple[str, Any]]:
        reply = self.client.xreadgroup(GROUP, self.instance, {stream: start}, count=n)
        return [(text(e), f) for _s, entries in reply or [] for e, f in entries]

    def _touch(self, channel: str) -> None:
        """Reset the idle time of what we hold, so another replica does not claim it."""
        now = time.monotonic()
        if now - self._last_touch.get(channel, 0.0) < self.claim_idle_s / 3:
            return
        self._last_touch[channel] = now
        with self._lock:
            held = sorted(self._held.get(channel, ()))
        if held:
            self.client.xclaim(self.stream(channel), GROUP, self.instance, 0, held, justid=True)

    def ack(self, channel: str, entry: str) -> None:
        """``channel`` is done with ``entry`` (delivered or given up): acknowledge and delete it."""
        try:
            self._ack(channel, [entry])
        except (redis.RedisError, OSError) as exc:
            self._failed("acknowledgement", channel, exc)
            with self._lock:
                self._unacked.setdefault(channel, set()).add(entry)

    def _ack(self, channel: str, entries: list[str]) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.stream(channel), GROUP, *entries)
        pipe.xdel(self.stream(channel), *entries)
        pipe.execute()
        with self._lock:
            self._held.get(channel, set()).difference_update(entries)
            self._unacked.get(channel, set()).difference_update(entries)

    def _retry_acks(self, channel: str) -> None:
        with self._lock:
            entries = sorted(self._unacked.get(channel, ()))
        if entries:
            self._ack(channel, entries)

    def backlog(self, channels: list[str]) -> dict[str, int]:
        """Pages each channel still owes (its stream's length); Redis errors propagate."""
        pipe = self.client.pipeline(transaction=False)
        for channel in channels:
            pipe.xlen(self.stream(channel))
        return dict(zip(channels, (int(x) for x in pipe.execute()), strict=True))

    def _failed(self, what: str, channel: str, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.warning("page %s for %s failed (retried): %s", what, channel, self.error)

    def _safe(self, fn: Any) -> None:
        try:
            fn()
        except (redis.RedisError, OSError) as exc:
            self._failed("stream creation", "?", exc)
