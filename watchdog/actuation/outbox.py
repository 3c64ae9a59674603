"""Pages from the outbox: on-call messages written in the same atomic step as the decision.

A flip, the engine state it implies and its page record land together (``flip.lua``); alerts and
resolves land with the partition checkpoint (``checkpoint.lua``). The pager takes the outbox stream
from its head, in order: it lets the ``Alerter``'s incident book turn a record into messages
(``render``: nothing is sent yet) and, in one MULTI under WATCH of the outbox and the incidents,
stores the record's incident, appends each message to the page stream of every channel that accepts
it (``watchdog.actuation.pages``) and deletes the record. It never waits on the network: each channel
then delivers its own stream at its own pace. The incidents are a Redis hash, one field per incident
key, so replicas that share the outbox share them too; the WATCH makes replicas take the records one
after another, in stream order, each exactly once (the loser of a race reads the new head). So:

* no page goes out before its flip is in Redis (the record does not exist before);
* a dead Slack webhook holds back only Slack's pages, never PagerDuty's;
* a restarted daemon finds the records not yet taken at the head of the outbox and the incidents as
  they were, and each channel's undelivered pages in its stream: nothing is lost, and only a page
  delivered in the instant before the crash is sent again, with the same page id (at least once).

Before this design the outbox was read through consumer group ``pager`` and records were only
acknowledged; ``start`` trims what that group had acknowledged and removes the group, once.
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

#: the consumer group of the outbox before per-channel page streams (removed by ``Pager.start``)
GROUP = "pager"
#: outbox records taken per pump
BATCH = 100
#: tries of one record while other replicas change the incidents under it
WATCH_TRIES = 5
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
                 lease_ttl_s: float = 10.0) -> None:
        self.client = client
        self.keys = keys
        self.instance = instance
        self.alerter = alerter
        self.pages = PageStreams(client, keys, group, instance, lease_ttl_s)
        self._incidents_key = keys.incidents(group)
        self._ready = False
        self._restored = False
        self._attached = False
        self._last_backlog = 0.0
        self._backlog: dict[str, int] = {}
        #: outbox records copied to the channels' page streams
        self.taken = 0

    def start(self) -> None:
        """Load the open incidents, hand the page streams to the alerter (Redis errors propagate)."""
        self._migrate()
        if not self._restored:
            raw = self.client.hgetall(self._incidents_key)
            self.alerter.restore_incidents([json.loads(text(v)) for v in raw.values()])
            self._restored = True
        if not self._attached:
            self.alerter.attach(self.pages, self._stored_incidents)
            self._attached = True
        self._ready = True

    def _stored_incidents(self) -> list[dict[str, Any]] | None:
        """The open route incidents as Redis has them (another replica may have resolved one this
        process still holds); None when Redis does not answer. Called from a sender thread."""
        try:
            raw = self.client.hgetall(self._incidents_key)
            return [json.loads(text(v)) for v in raw.values()]
        except (redis.RedisError, OSError, ValueError) as exc:
            log.warning("open incidents could not be read from Redis: %s", exc)
            return None

    def _migrate(self) -> None:
        """Trim what the old consumer group ``pager`` acknowledged, then remove the group."""
        try:
            groups = self.client.xinfo_groups(self.keys.outbox)
        except redis.ResponseError:  # no outbox yet
            return
        if not any(text(g.get("name")) == GROUP for g in groups):
            return
        last = next(text(g.get("last-delivered-id")) for g in groups if text(g.get("name")) == GROUP)
        pending = self.client.xpending(self.keys.outbox, GROUP)
        if pending.get("pending"):
            keep_from = text(pending["min"])
        else:
            ms, seq = last.split("-")
            keep_from = f"{ms}-{int(seq) + 1}"
        trimmed = self.client.xtrim(self.keys.outbox, minid=keep_from, approximate=False)
        self.client.xgroup_destroy(self.keys.outbox, GROUP)
        log.info("outbox: %d records the old consumer group had acknowledged trimmed; group removed", trimmed)

    def pump(self) -> None:
        """Move the outbox along: never waits on a channel; Redis errors propagate (the caller reports them)."""
        if not self._ready:
            self.start()
        taken = 0
        for entry_id, raw in self._head():
            if not self._take(entry_id, raw):
                break  # another replica took it first, or it kept changing: read the head again next pump
            taken += 1
        if taken:
            self.alerter.wake()
        self.pages.keep(self.alerter.channel_names())
        if time.monotonic() - self._last_backlog >= BACKLOG_EVERY_S:
            self._last_backlog = time.monotonic()
            self._backlog = self.pages.backlog(self.alerter.channel_names())

    def _head(self) -> list[tuple[str, str]]:
        entries = self.client.xrange(self.keys.outbox, count=BATCH)
        return [(text(e), text((f or {}).get("json") or "{}")) for e, f in entries]

    def _take(self, entry_id: str, raw: str) -> bool:
        """One record: its messages onto the channels' page streams, its incident stored, the record
        deleted, all in one MULTI under WATCH of the outbox and the incidents: if another replica
        took a record or changed an incident meanwhile, this one reads again."""
        try:
            action = action_from_record(raw)
        except (ValueError, KeyError, TypeError) as exc:
            log.error("outbox record %s unreadable, skipped: %s", entry_id, exc)
            action = None
        for _ in range(WATCH_TRIES):
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(self.keys.outbox, self._incidents_key)
                    if not pipe.xrange(self.keys.outbox, min=entry_id, max=entry_id):
                        return False  # another replica took it
                    stored = pipe.hget(self._incidents_key, action.incident_key) if action is not None else None
                    pipe.multi()
                    if action is not None:
                        self._render(pipe, entry_id, action, stored)
                    pipe.xdel(self.keys.outbox, entry_id)
                    pipe.execute()
                except redis.WatchError:
                    continue
            self.taken += 1
            return True
        log.warning("outbox record %s: the outbox kept changing under it; taken again at the next pump", entry_id)
        return False

    def _render(self, pipe: Any, entry_id: str, action: Action, stored: Any) -> None:
        key = action.incident_key
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

    def backlog(self) -> dict[str, int]:
        """Pages each channel still owes, as of the last read (at most ``BACKLOG_EVERY_S`` old)."""
        return dict(self._backlog)

    def wait(self, timeout_s: float) -> None:
        """At shutdown: copy what the outbox holds to the page streams (delivery goes on at the next start)."""
        try:
            self.pump()
        except (redis.RedisError, OSError):
            return

    def release(self) -> None:
        """After the alerter stopped: hand the channels' leases to the next replica."""
        self.pages.release()
