"""Alert channels: what an on-call alert looks like on the wire for each receiver.

One registry maps a channel kind (``webhook``, ``slack``, ``pagerduty``, ``alertmanager``) to its
class. A channel is pure: it turns an :class:`~watchdog.alerting.message.Alert` into (url, headers,
JSON body); the HTTP POST, retries and queueing live in :mod:`watchdog.alerting.delivery`.

Each channel keeps its body within what its receiver accepts, in its own ``payload`` (the limits
and the cutting are :mod:`watchdog.alerting.limits`); ``body`` encodes it and refuses to send more
than ``max_body_bytes``. ``accepts`` decides which alerts a channel gets: its ``min_severity``, and
the policy's ``notify``/``page`` channel names when the alert carries them (``Alert.notify``).
"""

from __future__ import annotations

import difflib
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import quote

from pydantic import ValidationError

from watchdog.alerting import groups, limits
from watchdog.alerting.limits import clip, fit_mapping, stable_key
from watchdog.alerting.message import Alert, rfc3339
from watchdog.config.settings import AlertChannelConfig
from watchdog.core.signals import SEVERITY_RANK

#: version of the generic webhook body; bump when a field changes meaning
WEBHOOK_SCHEMA = "llm-watchdog.alert/v1"
#: version of the generic webhook body of a grouped message (several incidents)
WEBHOOK_GROUP_SCHEMA = "llm-watchdog.alert-group/v1"

def channel_config(raw: AlertChannelConfig | Mapping[str, Any] | Any) -> AlertChannelConfig:
    """A checked :class:`~watchdog.config.settings.AlertChannelConfig` from the model itself, a
    mapping or another pydantic model: the schema's checks, then the registry's (a known kind,
    with "did you mean"; a ``url`` unless the kind has a default; a required ``routing_key``).

    Raises ``ValueError`` naming the bad field.
    """
    if isinstance(raw, AlertChannelConfig):
        config = raw
    else:
        if isinstance(raw, Mapping):
            data: dict[str, Any] = dict(raw)
        elif hasattr(raw, "model_dump"):
            data = raw.model_dump()
        else:
            raise ValueError(f"alert channel config must be a mapping, got {type(raw).__name__}")
        try:  # None means "the default" here, as it does for a key left out
            config = AlertChannelConfig.model_validate({k: v for k, v in data.items() if v is not None})
        except ValidationError as exc:
            raise ValueError(_schema_problems(data.get("kind"), exc)) from None
    cls = channel_class(config.kind)
    if not config.url and cls.default_url is None:
        raise ValueError(f"alert channel {config.kind}: 'url' is required")
    if cls.requires_routing_key and not config.routing_key:
        raise ValueError(f"alert channel {config.kind}: 'routing_key' is required")
    if config.group_wait_s and not issubclass(cls, GroupingChannel):
        raise ValueError(f"alert channel {config.kind}: group_wait_s: this kind does not group messages; "
                         "leave it unset or 0")
    return config


def _schema_problems(kind: Any, exc: ValidationError) -> str:
    problems = []
    for err in exc.errors(include_url=False):
        field_name = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown field {field_name!r}")
        elif err["type"] == "missing":
            problems.append(f"{field_name!r} is required")
        else:
            problems.append(f"{field_name}: {err['msg']}")
    where = f"alert channel {kind}" if kind else "alert channel"
    return f"{where}: {'; '.join(problems)}"


class Channel(ABC):
    """Base class: turns an alert into one HTTP POST. Subclasses set ``kind`` and ``payload``."""

    kind: ClassVar[str] = ""
    default_url: ClassVar[str | None] = None
    requires_routing_key: ClassVar[bool] = False
    #: None: this receiver keeps state, a message is sent once
    default_resend_interval_s: ClassVar[float | None] = None
    #: seconds between the starts of two requests (the receiver's rate limit); 0: no limit
    default_min_interval_s: ClassVar[float] = 0.0
    #: the largest request body this channel sends (a bigger one is a bug: refused, not sent)
    max_body_bytes: ClassVar[int] = limits.WEBHOOK_BODY_MAX_BYTES
    #: ``group_wait_s`` when the config leaves it unset; 0: no grouping (a ``GroupingChannel`` may group)
    default_group_wait_s: ClassVar[float] = 0.0

    def __init__(self, config: AlertChannelConfig | Mapping[str, Any] | Any) -> None:
        self.config = channel_config(config)
        self.name = self.config.name or self.config.kind
        self.resend_interval_s = self.config.resend_interval_s or self.default_resend_interval_s
        self.min_interval_s = (self.default_min_interval_s if self.config.min_interval_s is None
                               else self.config.min_interval_s)
        #: seconds a route incident's message waits for others to go with it; 0: one per message
        self.group_wait_s = (self.default_group_wait_s if self.config.group_wait_s is None
                             else self.config.group_wait_s)
        self.group_max = self.config.group_max

    def accepts(self, alert: Alert) -> bool:
        """``alert`` is at least this channel's ``min_severity`` and, when its policy names channels,
        this channel is one of them (``notify``, or ``page`` for a critical alert)."""
        if SEVERITY_RANK[alert.severity] < SEVERITY_RANK[self.config.min_severity]:
            return False
        return alert.routed_to(self.name)

    def endpoint(self) -> str:
        url = self.config.url or self.default_url
        assert url is not None  # checked by channel_config
        return url

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", "User-Agent": "llm-watchdog", **self.config.headers}

    @abstractmethod
    def payload(self, alert: Alert) -> Any:
        """The request body this channel's receiver expects for ``alert``, within its limits."""

    def body(self, alert: Alert | list[Alert], group_id: str | None = None) -> bytes:
        """``payload(alert)`` (of a list, its one alert: only a ``GroupingChannel`` takes more) as UTF-8
        JSON; ``ValueError`` if over ``max_body_bytes``."""
        if isinstance(alert, list):
            (alert,) = alert
        return self._encoded(self.payload(alert))

    def _encoded(self, payload: Any) -> bytes:
        data = limits.encode(payload)
        if len(data) > self.max_body_bytes:
            raise ValueError(f"{self.kind} body of {len(data)} bytes is over {self.max_body_bytes}")
        return data

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, url={self.endpoint()!r})"


class GroupingChannel(Channel):
    """A channel whose receiver takes several incidents in one message: storm grouping
    (``group_wait_s``) is allowed for it alone (``channel_config``)."""

    @abstractmethod
    def group_payload(self, alerts: list[Alert], group_id: str) -> Any:
        """The body of one message about several incidents, within the receiver's limits."""

    def body(self, alert: Alert | list[Alert], group_id: str | None = None) -> bytes:
        if isinstance(alert, list) and len(alert) > 1:
            return self._encoded(self.group_payload(alert, group_id or ""))
        return super().body(alert)


_REGISTRY: dict[str, type[Channel]] = {}


def register_channel(cls: type[Channel]) -> type[Channel]:
    """Class decorator: add a channel kind to the registry (duplicate kinds are rejected)."""
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no kind")
    if cls.kind in _REGISTRY and _REGISTRY[cls.kind] is not cls:
        raise ValueError(f"alert channel kind {cls.kind!r} is already registered by {_REGISTRY[cls.kind].__name__}")
    _REGISTRY[cls.kind] = cls
    return cls


def channel_kinds() -> list[str]:
    return sorted(_REGISTRY)


def channel_class(kind: str) -> type[Channel]:
    try:
        return _REGISTRY[kind]
    except KeyError:
        close = difflib.get_close_matches(kind, _REGISTRY, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown alert channel kind {kind!r}{hint} (known: {', '.join(channel_kinds())})"
        ) from None


def unique_names(names: list[str]) -> list[str]:
    """Channel names as the alerter uses them: a second channel named ``slack`` is ``slack-2``."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append(f"{name}-{n + 1}" if n else name)
    return out


def channel_names(configs: list[AlertChannelConfig]) -> list[str]:
    """The names of the channels built from ``configs`` (what a policy's ``actions`` may name)."""
    return unique_names([c.name or c.kind for c in configs])


def build_channel(raw: AlertChannelConfig | Mapping[str, Any] | Any) -> Channel:
    config = channel_config(raw)
    return channel_class(config.kind)(config)


def _title(alert: Alert) -> str:
    state = "RESOLVED" if alert.status == "resolved" else alert.severity.upper()
    return f"[{state}] {alert.summary}"


def _facts(alert: Alert) -> dict[str, str]:
    facts = {"incident": stable_key(alert.key, limits.PAGERDUTY_DEDUP_KEY_MAX)}
    if alert.route is not None:
        facts.update(model=str(alert.model), route=alert.route, policy=str(alert.policy))
    facts["event"] = alert.event + (" (dry run)" if alert.dry_run else "")
    facts["since"] = rfc3339(alert.started_at)
    if alert.page_id:
        facts["page"] = alert.page_id
    return facts


@register_channel
class WebhookChannel(GroupingChannel):
    """Generic JSON: the alert as one object with a schema version; a storm as one object listing
    them (``llm-watchdog.alert-group/v1``) when ``group_wait_s`` is set."""

    kind = "webhook"

    def payload(self, alert: Alert) -> dict[str, Any]:
        body = self._fields(alert, limits.WEBHOOK_TEXT_MAX_BYTES)
        body["detail"] = fit_mapping(alert.detail, limits.WEBHOOK_BODY_MAX_BYTES // 2)
        body["id"] = body.pop("id")  # last, as before
        return body

    def _fields(self, alert: Alert, text: int) -> dict[str, Any]:
        return {
            "schema": WEBHOOK_SCHEMA,
            "source": "llm-watchdog",
            "key": stable_key(alert.key, limits.WEBHOOK_KEY_MAX),
            "status": alert.status,
            "severity": alert.severity,
            "previous_severity": alert.previous_severity,
            "event": alert.event,
            "dry_run": alert.dry_run,
            "summary": clip(alert.summary, text, "bytes"),
            "description": clip(alert.description, text, "bytes"),
            "model": alert.model,
            "route": alert.route,
            "policy": alert.policy,
            "started_at": rfc3339(alert.started_at),
            "ended_at": rfc3339(alert.ended_at) if alert.ended_at is not None else None,
            "url": _url(alert.url),
            "id": stable_key(alert.page_id, limits.WEBHOOK_KEY_MAX) if alert.page_id else None,
        }

    def group_payload(self, alerts: list[Alert], group_id: str) -> dict[str, Any]:
        """One object for the group: counts, a title and each incident as a v1 object without its
        ``detail``, its texts cut to the group's share of the body (1 KiB each for up to ~100
        incidents, ~300-600 bytes for 200, what the other fields leave); incidents past the body's
        bound are counted in ``omitted`` (never with ``group_max`` at most 200 and names of a few
        hundred bytes)."""
        firing = sum(a.status == "firing" for a in alerts)
        body: dict[str, Any] = {
            "schema": WEBHOOK_GROUP_SCHEMA,
            "source": "llm-watchdog",
            "id": group_id,
            "status": groups.status(alerts),
            "severity": groups.worst_severity(alerts),
            "count": len(alerts),
            "firing": firing,
            "resolved": len(alerts) - firing,
            "summary": groups.title(alerts),
            "url": _url(groups.status_link(alerts)),
            "omitted": 0,
            "alerts": [],
        }
        used = len(limits.encode(body)) + 32  # room for a longer ``omitted`` count
        # what the two texts of each incident may share: the body less every incident's other
        # fields (names, key, link, times) as they are, not as they usually are
        bare = sum(len(limits.encode({**self._fields(a, 0), "summary": "", "description": ""})) + 1
                   for a in alerts)
        text = min(1024, max(128, (self.max_body_bytes - used - bare) // (2 * len(alerts))))
        for i, alert in enumerate(alerts):
            item = self._fields(alert, text)
            size = len(limits.encode(item)) + 1
            if used + size > self.max_body_bytes:
                body["omitted"] = len(alerts) - i
                break
            body["alerts"].append(item)
            used += size
        return body


SLACK_COLORS = {
    "critical": "#d62728",
    "warning": "#f2c744",
    "info": "#1f77b4",
    "resolved": "#2ca02c",
}


@register_channel
class SlackChannel(GroupingChannel):
    """Slack incoming webhook: fallback ``text`` plus one coloured attachment holding blocks."""

    kind = "slack"
    #: an incoming webhook takes 1 message a second (short bursts allowed), then answers 429
    default_min_interval_s = 1.0
    #: people read it: a storm is one message, an isolated incident waits 1 s for company
    default_group_wait_s = 1.0

    def payload(self, alert: Alert) -> dict[str, Any]:
        title = _title(alert)
        color = SLACK_COLORS["resolved" if alert.status == "resolved" else alert.severity]
        block = limits.SLACK_BLOCK_TEXT_MAX
        facts = " · ".join(f"*{k}* `{clip(v, 200)}`" for k, v in _facts(alert).items())
        label = "evidence" if "/evidence/" in (alert.url or "") else "watchdog status"
        link = f"\n<{url}|{label}>" if (url := _url(alert.url)) else ""
        # the link is kept whole: the text is cut before it
        body = clip(alert.description or alert.summary, block - limits.size(link)) + link
        blocks = [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{clip(title, block - 2)}*"}},
            {"type": "section", "text": {"type": "mrkdwn", "text": body}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": clip(facts, block)}]},
        ]
        return {
            "text": clip(title, limits.SLACK_TEXT_MAX),
            "attachments": [{"color": color, "fallback": clip(title, limits.SLACK_FALLBACK_MAX), "blocks": blocks}],
        }

    def group_payload(self, alerts: list[Alert], group_id: str) -> dict[str, Any]:
        """One message for the group: a title with the counts, one line per incident packed into
        section blocks (each within 3,000 characters, at most 50 blocks in all), the status link."""
        title = groups.title(alerts)
        state = groups.status(alerts)
        color = SLACK_COLORS["resolved" if state == "resolved" else groups.worst_severity(alerts)]
        block = limits.SLACK_BLOCK_TEXT_MAX
        url = _url(groups.status_link(alerts))
        link = f"<{url}|watchdog status>" if url else "the watchdog's /status"
        blocks: list[dict[str, Any]] = [
            {"type": "section", "text": {"type": "mrkdwn", "text": f"*{clip(title, block - 2)}*"}}]
        room = limits.SLACK_MAX_BLOCKS - 3  # the title, a possible "and N more", the context line
        sections: list[str] = []
        text = ""
        listed = 0
        for alert in alerts:
            item = "• " + groups.line(alert)
            if text and limits.size(text) + 1 + limits.size(item) > block:
                sections.append(text)
                text = ""
                if len(sections) == room:
                    break
            text = f"{text}\n{item}" if text else item
            listed += 1
        if text:
            sections.append(text)
        blocks += [{"type": "section", "text": {"type": "mrkdwn", "text": t}} for t in sections]
        if listed < len(alerts):
            more = f"… and {len(alerts) - listed} more incidents: {link}"
            blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": clip(more, block)}})
        facts = (f"*group* `{clip(group_id, 300)}` · *incidents* `{len(alerts)}` · "
                 f"*since* `{rfc3339(min(a.started_at for a in alerts))}` · {link}")
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": clip(facts, block)}]})
        return {
            "text": clip(title, limits.SLACK_TEXT_MAX),
            "attachments": [{"color": color, "fallback": clip(title, limits.SLACK_FALLBACK_MAX), "blocks": blocks}],
        }


@register_channel
class PagerDutyChannel(Channel):
    """PagerDuty Events API v2: trigger/resolve with ``dedup_key`` = incident key."""

    kind = "pagerduty"
    default_url = "https://events.pagerduty.com/v2/enqueue"
    requires_routing_key = True
    max_body_bytes = limits.PAGERDUTY_EVENT_MAX_BYTES

    def payload(self, alert: Alert) -> dict[str, Any]:
        short = limits.PAGERDUTY_FIELD_MAX
        # An ops incident is about one daemon: without its source, one replica's resolve would close
        # another's still-open incident (as for Alertmanager's ``source`` label)
        key = f"{alert.key}@{self.config.source or _hostname()}" if alert.is_ops else alert.key
        body: dict[str, Any] = {
            "routing_key": self.config.routing_key,
            "dedup_key": stable_key(key, limits.PAGERDUTY_DEDUP_KEY_MAX),
        }
        if alert.status == "resolved":
            body["event_action"] = "resolve"
            return body
        body["event_action"] = "trigger"
        # what is not custom_details is at most ~3 KB: the details get the rest of the 512 KB
        details = {**_facts(alert), "description": clip(alert.description, 64 * 1024, "bytes"), **alert.detail}
        body["payload"] = {
            "summary": clip(alert.summary, limits.PAGERDUTY_SUMMARY_MAX),
            "source": clip(self.config.source or _hostname(), short),
            "severity": alert.severity,
            "timestamp": rfc3339(alert.started_at),
            "component": clip(alert.model or "llm-watchdog", short),
            "group": clip(alert.route or "ops", short),
            "class": clip(alert.event, short),
            "custom_details": fit_mapping(details, self.max_body_bytes - 16 * 1024),
        }
        body["client"] = "llm-watchdog"
        if url := _url(alert.url):
            body["client_url"] = url
        return body


@register_channel
class AlertmanagerChannel(Channel):
    """Prometheus Alertmanager API v2: POST a list of alerts to ``/api/v2/alerts``."""

    kind = "alertmanager"
    default_resend_interval_s = 60.0
    max_body_bytes = limits.ALERTMANAGER_BODY_MAX_BYTES

    def endpoint(self) -> str:
        base = super().endpoint().rstrip("/")
        return base if base.endswith("/api/v2/alerts") else base + "/api/v2/alerts"

    def payload(self, alert: Alert) -> list[dict[str, Any]]:
        item = self._item(alert, alert.severity)
        if alert.status == "resolved":
            item["endsAt"] = rfc3339(alert.ended_at if alert.ended_at is not None else time.time())
        out = [item]
        # Labels identify an Alertmanager alert, so a new severity is a new alert: end the old one.
        if alert.previous_severity and alert.previous_severity != alert.severity:
            old = self._item(alert, alert.previous_severity)
            old["endsAt"] = rfc3339(time.time())
            out.insert(0, old)
        return out

    def _item(self, alert: Alert, severity: str) -> dict[str, Any]:
        labels = {"alertname": "LLMWatchdogOps" if alert.is_ops else "LLMWatchdogIncident", "severity": severity}
        if alert.is_ops:
            # An ops incident is about one daemon ("my Redis is unreachable"): without the source, one
            # replica's resolve would end another's still-open alert in Alertmanager.
            labels.update(key=alert.key, source=self.config.source or _hostname())
        else:
            labels.update(model=str(alert.model), route=str(alert.route), policy=str(alert.policy))
        # labels identify the alert: a long value is cut the same way every time (head + hash)
        labels = {k: stable_key(v, limits.ALERTMANAGER_LABEL_MAX) for k, v in labels.items()}
        note = limits.ALERTMANAGER_ANNOTATION_MAX_BYTES
        urn = f"urn:llm-watchdog:incident:{quote(stable_key(alert.key, limits.PAGERDUTY_DEDUP_KEY_MAX), safe='')}"
        return {
            "labels": labels,
            "annotations": {"summary": clip(alert.summary, note, "bytes"),
                            "description": clip(alert.description or alert.summary, note, "bytes"),
                            **({"evidence": url} if (url := _url(alert.url)) and "/evidence/" in url else {})},
            "startsAt": rfc3339(alert.started_at),
            "generatorURL": _url(alert.url) or urn,
        }


def _url(url: str | None) -> str | None:
    """A link the receiver can follow, or None: a URL is never cut (half a URL is a wrong one)."""
    return url if url and len(url) <= limits.URL_MAX else None


def _hostname(_cache: dict[str, str] = {}) -> str:  # noqa: B006 - memo of one value
    if "h" not in _cache:
        _cache["h"] = socket.gethostname() or "llm-watchdog"
    return _cache["h"]
