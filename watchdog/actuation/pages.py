"""Each alert channel's durable page stream: its own position, acknowledged by id.

The pager (``watchdog.actuation.outbox``) copies the messages of an outbox record to one Redis
stream per channel that accepts them (``Keys.pages(group, channel)``). :class:`PageStreams` is the
:class:`~watchdog.alerting.delivery.PageSource` the channel workers read them from: a channel's
stream holds exactly the pages that channel still owes, oldest first, so a dead or slow channel
holds back only its own stream. A page delivered (or given up) is deleted by its own entry id.

One replica at a time delivers a channel: the holder of the lease ``{prefix}:lease:pages:{group}:
{channel}`` (10 s TTL, renewed by the pager's pump and at each fetch), so a channel's pages reach it in order even with
several replicas. The holder reads from the head of the stream past what it already holds; a
restarted (or new) holder starts at the head again, so nothing undelivered is lost, and only a page
delivered in the instant before a crash (not yet deleted) is sent again, with the same page id.
Redis errors never reach the worker: a failed fetch returns nothing, a failed delete is retried at
the next fetch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from watchdog.alerting.message import Alert
from watchdog.core.keys import Keys, text
from watchdog.state.lease import Lease

log = logging.getLogger(__name__)


class PageStreams:
    def __init__(self, client: Any, keys: Keys, group: str, instance: str, lease_ttl_s: float = 10.0) -> None:
        self.client = client
        self.keys = keys
        self.group = group
        self.instance = instance
        self.lease_ttl_s = lease_ttl_s
        self._lock = threading.Lock()
        self._lease_lock = threading.Lock()  # one lease round trip at a time (pump and sender threads)
        self._leases: dict[str, Lease] = {}
        self._held: dict[str, set[str]] = {}  # channel -> entry ids handed out and not yet deleted
        self._unacked: dict[str, set[str]] = {}  # done, delete failed: retried at the next fetch
        self._cursor: dict[str, str] = {}  # channel -> last entry id handed out ("-": from the head)
        self.error: str | None = None

    def stream(self, channel: str) -> str:
        return self.keys.pages(self.group, channel)

    def fetch(self, channel: str, n: int) -> list[tuple[str, Alert]] | None:
        """Up to ``n`` pages ``channel`` does not hold yet, oldest first; None while another replica
        holds its lease (what we held is forgotten: the holder sends it, or we read it again)."""
        try:
            self._retry_acks(channel)
            if not self._lease(channel):
                with self._lock:
                    self._held.pop(channel, None)
                return None
            if n <= 0:
                return []
            with self._lock:
                start = self._cursor.get(channel, "-")
            got = self.client.xrange(self.stream(channel), min=start if start == "-" else "(" + start, count=n)
            self.error = None
        except (redis.RedisError, OSError) as exc:
            self._failed("fetch", channel, exc)
            return []
        out: list[tuple[str, Alert]] = []
        with self._lock:
            held = self._held.setdefault(channel, set())
            for raw_id, fields in got:
                entry = text(raw_id)
                self._cursor[channel] = entry
                if entry in held:
                    continue
                held.add(entry)
                try:
                    out.append((entry, Alert.from_json(text(fields.get("json") or fields.get(b"json")))))
                except (ValueError, TypeError, AttributeError) as exc:
                    log.error("page %s of %s unreadable, deleted: %s", entry, channel, exc)
                    self._unacked.setdefault(channel, set()).add(entry)
        return out

    def _lease(self, channel: str) -> bool:
        with self._lease_lock:
            lease = self._leases.get(channel)
            if lease is None:
                key = self.keys.lease(f"pages:{self.group}:{channel}")
                lease = self._leases[channel] = Lease(self.client, key, self.instance, self.lease_ttl_s)
            was = lease.held(time.monotonic())
            now_held = lease.tick(time.monotonic())
        if now_held and not was:
            with self._lock:  # (re)gained: read from the head, past what we still hold
                self._cursor[channel] = "-"
        return now_held

    def keep(self, channels: list[str]) -> None:
        """Acquire or renew every channel's lease (the pager calls this each pump): a channel whose
        sender threads are all busy with slow requests keeps its lease, so no replica takes over and
        sends its pages in flight a second time."""
        for channel in channels:
            self._lease(channel)

    def ack(self, channel: str, entry: str) -> None:
        """``channel`` is done with ``entry`` (delivered or given up): delete it from the stream."""
        try:
            self._ack(channel, [entry])
        except (redis.RedisError, OSError) as exc:
            self._failed("delete", channel, exc)
            with self._lock:
                self._unacked.setdefault(channel, set()).add(entry)

    def ack_many(self, channel: str, entries: list[str]) -> None:
        """``channel`` is done with all of ``entries`` (one grouped message): one XDEL."""
        if not entries:
            return
        try:
            self._ack(channel, entries)
        except (redis.RedisError, OSError) as exc:
            self._failed("delete", channel, exc)
            with self._lock:
                self._unacked.setdefault(channel, set()).update(entries)

    def _ack(self, channel: str, entries: list[str]) -> None:
        self.client.xdel(self.stream(channel), *entries)
        with self._lock:
            self._held.get(channel, set()).difference_update(entries)
            self._unacked.get(channel, set()).difference_update(entries)

    def _retry_acks(self, channel: str) -> None:
        with self._lock:
            entries = sorted(self._unacked.get(channel, ()))
        if entries:
            self._ack(channel, entries)

    def release(self) -> None:
        """At stop: hand every channel's lease back, so another replica goes on at once."""
        for lease in self._leases.values():
            lease.release()

    def backlog(self, channels: list[str]) -> dict[str, int]:
        """Pages each channel still owes (its stream's length); Redis errors propagate."""
        pipe = self.client.pipeline(transaction=False)
        for channel in channels:
            pipe.xlen(self.stream(channel))
        return dict(zip(channels, (int(x) for x in pipe.execute()), strict=True))

    def _failed(self, what: str, channel: str, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.warning("page %s for %s failed (retried): %s", what, channel, self.error)
