"""Pages from the outbox: on-call messages written in the same atomic step as the decision.

A flip, the engine state it implies and its page record land together (``flip.lua``); alerts and
resolves land with the partition checkpoint (``checkpoint.lua``). The pager reads the outbox stream
through a Redis consumer group (``pager``), one record at a time in order, hands it to the
``Alerter``, and once every channel has delivered (or given up) stores the open incidents and
acknowledges the record in one MULTI (the incidents are a Redis hash, one field per incident key, so
replicas that share the outbox share them too; a record's incident is re-read from it before the
record is handled). So:

* no page goes out before its flip is in Redis (the record does not exist before);
* a restarted daemon re-reads its unacknowledged record and the incidents as they were before it,
  so it neither loses a resolve nor re-pages what was acknowledged (a page delivered but not yet
  acknowledged when the process died is sent again: at least once, receivers dedupe by key);
* records of a dead replica are claimed after ``claim_idle_s``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis

from watchdog.alerting.alerter import Alerter
from watchdog.core.keys import Keys, text
from watchdog.core.signals import Action

log = logging.getLogger(__name__)

GROUP = "pager"


def action_record(action: Action, instance: str) -> str:
    return json.dumps({"schema": 1, "kind": action.kind, "policy": action.policy, "model": action.model,
                       "route": action.route, "reason": action.reason, "severity": action.severity,
                       "precision": action.precision, "dry_run": action.dry_run, "at": action.at,
                       "detail": action.detail, "instance": instance}, default=str)


def action_from_record(raw: str) -> Action:
    d = json.loads(raw)
    return Action(kind=d["kind"], policy=d["policy"], model=d["model"], route=d["route"], reason=d["reason"],
                  severity=d.get("severity", "warning"), precision=d.get("precision"),
                  dry_run=bool(d.get("dry_run")), at=float(d.get("at") or 0.0), detail=d.get("detail") or {})


class Pager:
    def __init__(self, client: Any, keys: Keys, group: str, instance: str, alerter: Alerter,
                 claim_idle_s: float = 30.0) -> None:
        self.client = client
        self.keys = keys
        self.instance = instance
        self.alerter = alerter
        self.claim_idle_s = claim_idle_s
        self._incidents_key = keys.incidents(group)
        self._ready = False
        self._restored = False
        self._current: str | None = None
        self._current_key: str | None = None
        self._done = threading.Event()
        #: the record in flight is acknowledged by the delivery thread or, on a retry, by the loop
        self._lock = threading.Lock()
        self._loop_thread: int | None = None
        self._last_claim = 0.0
        self.delivered = 0

    def start(self) -> None:
        """Create the consumer group and load the open incidents (Redis errors propagate)."""
        try:
            self.client.xgroup_create(self.keys.outbox, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        if not self._restored:
            raw = self.client.hgetall(self._incidents_key)
            self.alerter.restore_incidents([json.loads(text(v)) for v in raw.values()])
            self._restored = True
        self._ready = True

    def pump(self, now: float) -> None:
        """Move the outbox along: never blocks; Redis errors propagate (the caller reports them)."""
        try:
            self._pump(now)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis lost the stream (restart without persistence): start the group afresh
            log.error("outbox consumer group gone from Redis; re-creating it")
            self._ready = False
            self._current = None

    def _pump(self, now: float) -> None:
        self._loop_thread = threading.get_ident()
        if not self._ready:
            self.start()
        if self._current is not None:
            if not self._done.is_set():
                return
            self._ack()  # the delivery thread's own acknowledgement failed (Redis): retry it here
            if self._current is not None:
                return
        entry = self._next(now)
        if entry is None:
            return
        entry_id, raw = entry
        self._current = entry_id
        self._done.clear()
        try:
            action = action_from_record(raw)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("outbox record %s unreadable, skipped: %s", entry_id, exc)
            self._current_key = None
            self._done.set()
            return
        self._current_key = action.incident_key
        raw = self.client.hget(self._incidents_key, action.incident_key)
        self.alerter.set_incident(action.incident_key, json.loads(text(raw)) if raw else None)
        self.alerter.handle(action, on_done=self._delivered)

    def _delivered(self) -> None:
        """Every channel is done with the record: acknowledge it at once, from the delivery thread,
        so the window in which a crash re-sends a delivered page is one Redis round trip, not a loop
        iteration; if Redis fails here, the next ``pump`` retries."""
        self._done.set()
        if threading.get_ident() == self._loop_thread:
            return  # called from inside Alerter.handle (no channel to wait for): the loop acknowledges
        try:
            self._ack()
        except (redis.RedisError, OSError) as exc:
            log.warning("outbox acknowledgement failed (retried by the loop): %s", exc)

    def _ack(self) -> None:
        with self._lock:
            if self._current is None:
                return
            pipe = self.client.pipeline(transaction=True)
            if self._current_key:
                inc = self.alerter.incident(self._current_key)
                if inc is None:
                    pipe.hdel(self._incidents_key, self._current_key)
                else:
                    pipe.hset(self._incidents_key, self._current_key, json.dumps(inc, default=str))
            pipe.xack(self.keys.outbox, GROUP, self._current)
            pipe.execute()
            self.delivered += 1
            self._current = None

    def _next(self, now: float) -> tuple[str, str] | None:
        # our own unacknowledged record first (a restart), then new ones, then a dead replica's
        for start in ("0", ">"):
            reply = self.client.xreadgroup(GROUP, self.instance, {self.keys.outbox: start}, count=1)
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    if fields:
                        return text(entry_id), text(fields.get("json") or fields.get(b"json") or "{}")
        if now - self._last_claim > self.claim_idle_s / 2:
            self._last_claim = now
            claimed = self.client.xautoclaim(self.keys.outbox, GROUP, self.instance,
                                             min_idle_time=int(self.claim_idle_s * 1000), count=1)
            for entry_id, fields in (claimed[1] if len(claimed) > 1 else []):
                if fields:
                    return text(entry_id), text(fields.get("json") or "{}")
        return None

    def idle(self) -> bool:
        return self._current is None

    def wait(self, timeout_s: float) -> None:
        """At shutdown: give the record in flight a moment to be delivered and acknowledged."""
        deadline = time.monotonic() + timeout_s
        while self._current is not None and time.monotonic() < deadline:
            if self._done.wait(0.05):
                try:
                    self.pump(time.time())
                except redis.RedisError:
                    return
                return
