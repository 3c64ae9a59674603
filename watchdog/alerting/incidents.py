"""Incidents: one per (model, route, policy) or operational key, and the messages they produce.

:class:`IncidentBook` is the pure part of on-call alerting: it turns policy actions and operational
alerts into :class:`~watchdog.alerting.message.Alert` messages, opening one incident per key and
suppressing repeats until the incident escalates (a higher severity, or a rollback not yet
announced) or resolves. It holds no lock, thread or socket; :class:`~watchdog.alerting.alerter.Alerter`
serialises the calls and hands the messages to the channel workers. Open incidents export to and
restore from JSON, so the pager can keep them in Redis across restarts and replicas.

An incident remembers its policy's channel routing (``Action.detail['routing']``: ``notify`` and
``page`` names) and every message it produces carries it, so a resolve reaches the channels its
trigger reached, also after a restart. A later action of the incident adds its routing to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote

from watchdog.alerting.message import Alert, rfc3339, scrub
from watchdog.core.signals import ROUTING_KEY, SEVERITIES, SEVERITY_RANK, Action, Severity

#: key prefix of operational incidents (about this process, not a route)
OPS_PREFIX = "ops/"

#: (notify, page) channel names; notify None: every channel
Routing = tuple[tuple[str, ...] | None, tuple[str, ...]]
EVERY_CHANNEL: Routing = (None, ())


def routing_of(detail: Mapping[str, Any]) -> Routing:
    """The routing an action's detail carries (none: every channel)."""
    raw = detail.get(ROUTING_KEY)
    if not isinstance(raw, Mapping):
        return EVERY_CHANNEL
    notify, page = raw.get("notify") or [], raw.get("page") or []
    if not notify and not page:
        return EVERY_CHANNEL
    return tuple(str(c) for c in notify), tuple(str(c) for c in page)


def merge_routing(a: Routing, b: Routing) -> Routing:
    """Both routings' channels: a message that either would send somewhere goes there."""
    if a[0] is None or b[0] is None:
        return EVERY_CHANNEL
    return tuple(dict.fromkeys(a[0] + b[0])), tuple(dict.fromkeys(a[1] + b[1]))


@dataclass(slots=True)
class Incident:
    """One open incident: its key, current (highest) severity, latest text and what was announced."""

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
    routing: Routing = EVERY_CHANNEL

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
                "last_reason": self.last_reason, "detail": self.detail,
                "notify": None if self.routing[0] is None else list(self.routing[0]), "page": list(self.routing[1])}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Incident:
        return cls(d["key"], d["severity"], d["summary"], d["description"], float(d["opened_at"]),
                   float(d["updated_at"]), d["event"], d.get("model"), d.get("route"), d.get("policy"),
                   bool(d.get("dry_run")), set(d.get("announced") or []), int(d.get("repeats", 0)),
                   d.get("last_reason", ""), dict(d.get("detail") or {}),
                   routing_of({ROUTING_KEY: {"notify": d.get("notify"), "page": d.get("page")}}))


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

    def __init__(self, *, status_url: str | None = None, clock: Callable[[], float] = time.time,
                 evidence_url: str | None = None) -> None:
        self._open: dict[str, Incident] = {}
        self._status_url = status_url
        #: base of the evidence pages (``<base>/<id>``); a message whose incident has an evidence
        #: record (``detail['evidence']``, docs/EVIDENCE.md) links there instead of /status
        self._evidence_url = evidence_url.rstrip("/") if evidence_url else None
        self._clock = clock
        self.suppressed = 0

    # -- inputs -------------------------------------------------------------------------------

    def on_action(self, action: Action) -> list[Alert]:
        if action.severity not in SEVERITY_RANK:
            raise ValueError(f"unknown severity {action.severity!r} (one of {', '.join(SEVERITIES)})")
        now = action.at or self._clock()
        summary, severity = describe(action)
        routing = routing_of(action.detail)
        detail = scrub({k: v for k, v in action.detail.items() if k != ROUTING_KEY})
        if action.kind in ("alert", "rollback"):
            tag = None
            if action.kind == "rollback":
                tag = "dry-rollback" if action.dry_run else "rollback"
            elif isinstance(action.detail.get("announce"), str):
                # news the open incident's severity would swallow (the manual promote hint, a policy
                # gone while its rollback is in force): sent once per incident, as an update
                tag = f"alert:{action.detail['announce']}"
            return self._fire(
                action.incident_key, severity, summary, action.reason, action.kind, now,
                model=action.model, route=action.route, policy=action.policy,
                dry_run=action.dry_run, tag=tag, detail=detail, routing=routing,
            )
        if action.kind == "promote":
            # A promote is a real state change: announce it even if the incident was forgotten.
            return self._close(action.incident_key, summary, action.reason, "promote", now, always=True,
                               model=action.model, route=action.route, policy=action.policy,
                               dry_run=action.dry_run, detail=detail, routing=routing)
        if action.kind == "resolve":
            return self._close(action.incident_key, summary, action.reason, "resolve", now, always=False,
                               model=action.model, route=action.route, policy=action.policy,
                               dry_run=action.dry_run, detail=detail, routing=routing)
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

    def get(self, key: str) -> dict[str, Any] | None:
        """One open incident as JSON (None when closed or unknown)."""
        inc = self._open.get(key)
        return inc.to_json() if inc is not None else None

    def sync(self, incidents: list[dict[str, Any]], keep_prefix: str) -> None:
        """Make the open incidents those of ``incidents`` (as the shared store has them), except the
        ones whose key starts with ``keep_prefix``, which only this book knows."""
        self._open = {k: i for k, i in self._open.items() if k.startswith(keep_prefix)}
        self.restore(incidents)

    def replace(self, key: str, data: dict[str, Any] | None) -> None:
        """Make ``key`` what ``data`` says (None: not open), e.g. as another replica left it."""
        self._open.pop(key, None)
        if data is not None:
            self.restore([data])

    # -- internals ----------------------------------------------------------------------------

    def _fire(self, key: str, severity: Severity, summary: str, description: str, event: str,
              now: float, *, model: str | None = None, route: str | None = None, policy: str | None = None,
              dry_run: bool = False, tag: str | None = None, detail: dict[str, Any] | None = None,
              routing: Routing = EVERY_CHANNEL) -> list[Alert]:
        incident = self._open.get(key)
        if incident is None:
            incident = Incident(key, severity, summary, description, now, now, event, model, route, policy,
                                dry_run, detail=detail or {}, last_reason=description, routing=routing)
            if tag:
                incident.announced.add(tag)
            self._open[key] = incident
            return [self._alert(incident, "firing", summary, description, event)]
        incident.updated_at = now
        incident.last_reason = description
        incident.routing = merge_routing(incident.routing, routing)
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
               dry_run: bool = False, detail: dict[str, Any] | None = None,
               routing: Routing = EVERY_CHANNEL) -> list[Alert]:
        incident = self._open.pop(key, None)
        if incident is None:
            if not always:
                self.suppressed += 1
                return []
            # Unknown here (e.g. opened before a restart): reach every channel the policy names, paging
            # ones included, so a receiver that still holds the incident (PagerDuty, Alertmanager) closes it.
            incident = Incident(key, "critical", summary, description, now, now, event, model, route, policy,
                                dry_run, routing=routing)
        incident.routing = merge_routing(incident.routing, routing)
        if incident.route is None and route is not None:
            incident.route, incident.model, incident.policy = route, model, policy
        if detail:
            if "evidence" in incident.detail and "evidence" not in detail:  # a resolve links the incident's
                detail = {**detail, "evidence": incident.detail["evidence"]}
            incident.detail = detail
        if incident.summary and summary != incident.summary:
            description = f"{description} (was: {incident.summary})"
        return [self._alert(incident, "resolved", summary, description, event, ended_at=now, dry_run=dry_run)]

    def _link(self, incident: Incident) -> str | None:
        eid = incident.detail.get("evidence")
        if self._evidence_url and isinstance(eid, str) and eid:
            return f"{self._evidence_url}/{quote(eid, safe='')}"
        return self._status_url

    def _alert(self, incident: Incident, status: Literal["firing", "resolved"], summary: str, description: str,
               event: str, *, previous: Severity | None = None, ended_at: float | None = None,
               dry_run: bool | None = None) -> Alert:
        return Alert(
            key=incident.key, status=status, severity=incident.severity, summary=summary,
            description=description, event=event, started_at=incident.opened_at, ended_at=ended_at,
            model=incident.model, route=incident.route, policy=incident.policy,
            dry_run=incident.dry_run if dry_run is None else dry_run, previous_severity=previous,
            detail=dict(incident.detail), url=self._link(incident),
            notify=incident.routing[0], page=incident.routing[1],
        )
