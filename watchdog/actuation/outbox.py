"""Pages from the outbox: on-call messages written in the same atomic step as the decision.

A flip, the engine state it implies and its page record land together (``flip.lua``); alerts and
resolves land with the partition checkpoint (``checkpoint.lua``). The pager reads the outbox stream
through a Redis consumer group (``pager``) in order, lets the ``Alerter``'s incident book turn each
record into messages (``render``: nothing is sent yet), and in one MULTI stores the record's incident,
appends each message to the page stream of every channel that accepts it (``watchdog.actuation.pages``)
and acknowledges and deletes the record. It never waits on the network: each channel then delivers
its own stream at its own pace (the incidents are a Redis hash, one field per incident key, so
replicas that share the outbox share them too; a record's incident is re-read from it before the
record is handled). So:

* no page goes out before its flip is in Redis (the record does not exist before);
* a dead Slack webhook holds back only Slack's pages, never PagerDuty's;
* a restarted daemon re-reads the records it had not yet copied and the incidents as they were, and
  each channel resumes from its own unacknowledged pages: nothing is lost, and only a page delivered
  in the instant before the crash is sent again, with the same page id (at least once);
* records and pages of a dead replica are claimed after ``claim_idle_s``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from typing import Any

import redis

from watchdog.actuation.pages import PageStreams
from watchdog.alerting.alerter import Alerter
from watchdog.core.keys import Keys, text
from watchdog.core.signals import Action

log = logging.getLogger(__name__)

GROUP = "pager"
#: outbox records taken per pump
BATCH = 100
#: seconds between two reads of the channels' backlog
BACKLOG_EVERY_S = 1.0


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
        self.pages = PageStreams(client, keys, group, instance, claim_idle_s)
        self._incidents_key = keys.incidents(group)
        self._ready = False
        self._restored = False
        self._attached = False
        self._last_claim = 0.0
        self._last_backlog = 0.0
        self._backlog: dict[str, int] = {}
        #: outbox records copied to the channels' page streams
        self.taken = 0

    def start(self) -> None:
        """Create the consumer groups and load the open incidents (Redis errors propagate)."""
        try:
            self.client.xgroup_create(self.keys.outbox, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.pages.create(self.alerter.channel_names())
        if not self._restored:
            raw = self.client.hgetall(self._incidents_key)
            self.alerter.restore_incidents([json.loads(text(v)) for v in raw.values()])
            self._restored = True
        if not self._attached:
            self.alerter.attach(self.pages)
            self._attached = True
        self._ready = True

    def pump(self, now: float) -> None:
        """Move the outbox along: never waits on a channel; Redis errors propagate (the caller reports them)."""
        try:
            self._pump(now)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis lost the stream (restart without persistence): start the group afresh
            log.error("outbox consumer group gone from Redis; re-creating it")
            self._ready = False

    def _pump(self, now: float) -> None:
        if not self._ready:
            self.start()
        taken = 0
        for entry_id, raw in self._next(now):
            self._take(entry_id, raw)
            taken += 1
        if taken:
            self.alerter.wake()
        if time.monotonic() - self._last_backlog >= BACKLOG_EVERY_S:
            self._last_backlog = time.monotonic()
            self._backlog = self.pages.backlog(self.alerter.channel_names())

    def _take(self, entry_id: str, raw: str) -> None:
        """One record: its messages onto the channels' page streams, its incident stored, the record
        acknowledged and deleted, all in one MULTI."""
        pipe = self.client.pipeline(transaction=True)
        try:
            action = action_from_record(raw)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("outbox record %s unreadable, skipped: %s", entry_id, exc)
        else:
            key = action.incident_key
            stored = self.client.hget(self._incidents_key, key)
            self.alerter.set_incident(key, json.loads(text(stored)) if stored else None)
            for i, alert in enumerate(self.alerter.render(action)):
                # the page id names the record, so a record read again after a crash gives the same ids
                alert = replace(alert, page_id=f"{self.keys.prefix}:{entry_id}:{i}")
                for channel in self.alerter.channels_for(alert):
                    pipe.xadd(self.pages.stream(channel), {"json": alert.to_json()})
            inc = self.alerter.incident(key)
            if inc is None:
                pipe.hdel(self._incidents_key, key)
            else:
                pipe.hset(self._incidents_key, key, json.dumps(inc, default=str))
        pipe.xack(self.keys.outbox, GROUP, entry_id)
        pipe.xdel(self.keys.outbox, entry_id)
        pipe.execute()
        self.taken += 1

    def _next(self, now: float) -> list[tuple[str, str]]:
        # our own unacknowledged records first (a restart), then new ones, then a dead replica's
        out: list[tuple[str, str]] = []
        for start in ("0", ">"):
            reply = self.client.xreadgroup(GROUP, self.instance, {self.keys.outbox: start}, count=BATCH)
            for _stream, entries in reply or []:
                out += [(text(e), _json(f)) for e, f in entries]
            if out:
                return out
        if now - self._last_claim > self.claim_idle_s / 2:
            self._last_claim = now
            claimed = self.client.xautoclaim(self.keys.outbox, GROUP, self.instance,
                                             min_idle_time=int(self.claim_idle_s * 1000), count=BATCH)
            out += [(text(e), _json(f)) for e, f in (claimed[1] if len(claimed) > 1 else [])]
        return out

    def backlog(self) -> dict[str, int]:
        """Pages each channel still owes, as of the last read (at most ``BACKLOG_EVERY_S`` old)."""
        return dict(self._backlog)

    def idle(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        """At shutdown: copy what the outbox holds to the page streams (delivery goes on at the next start)."""
        try:
            self.pump(time.time())
        except (redis.RedisError, OSError):
            return


def _json(fields: Any) -> str:
    """The ``json`` field of a stream entry ("{}" for a deleted one, which is then skipped)."""
    return text((fields or {}).get("json") or (fields or {}).get(b"json") or "{}")
