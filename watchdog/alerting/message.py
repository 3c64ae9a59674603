"""One on-call message (:class:`Alert`), as every channel sees it, and what may go in it.

Pure data: the message, its JSON form (a durable page stream stores it), the scrubbing that keeps
prompts and completions out of receivers, and the RFC 3339 time format the payloads use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import Any, Literal

from watchdog.core.signals import Severity

AlertStatus = Literal["firing", "resolved"]

#: detail keys that may carry customer text; never sent to a receiver
PRIVATE_KEYS = frozenset(
    {
        "prompt",
        "prompts",
        "completion",
        "completions",
        "messages",
        "message_text",
        "input",
        "inputs",
        "output",
        "outputs",
        "response",
        "responses",
        "text",
        "texts",
        "reference",
        "references",
        "candidate_text",
        "baseline_text",
    }
)
_MAX_DETAIL_STR = 300
_MAX_DETAIL_ITEMS = 50
#: characters of detail in one message, all levels together
_MAX_DETAIL_CHARS = 32_768


@dataclass(frozen=True, slots=True)
class Alert:
    """One message about one incident, as every channel sees it."""

    key: str
    status: AlertStatus
    severity: Severity
    summary: str
    description: str
    #: what caused this message: alert, rollback, promote, resolve, escalate, ops, ops_resolve
    event: str
    started_at: float
    ended_at: float | None = None
    model: str | None = None
    route: str | None = None
    policy: str | None = None
    dry_run: bool = False
    #: set when the message raises the severity of an already open incident
    previous_severity: Severity | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    #: back-link to the watchdog status page, if known
    url: str | None = None
    #: stable id of this message: the same on every retry and after a restart (webhook ``id``,
    #: Slack context line, ``Idempotency-Key`` header); receivers that keep no state dedupe by it
    page_id: str | None = None
    #: the channels the policy names (None: every channel): ``notify`` gets every message of the
    #: incident, ``page`` also gets its critical ones; a channel's ``min_severity`` applies to both
    notify: tuple[str, ...] | None = None
    page: tuple[str, ...] = ()

    @property
    def is_ops(self) -> bool:
        return self.route is None

    def routed_to(self, channel: str) -> bool:
        """The policy sends this message to ``channel`` (every channel when it names none)."""
        if self.notify is None:
            return True
        return channel in self.notify or (self.severity == "critical" and channel in self.page)

    def to_json(self) -> str:
        """The message as JSON, for a durable per-channel page stream."""
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Alert:
        d = {k: v for k, v in json.loads(raw).items() if k in _ALERT_FIELDS}
        if d.get("notify") is not None:
            d["notify"] = tuple(d["notify"])
        d["page"] = tuple(d.get("page") or ())
        return cls(**d)


_ALERT_FIELDS = frozenset(f.name for f in fields(Alert))


def scrub(detail: Mapping[str, Any], depth: int = 0, budget: list[int] | None = None) -> dict[str, Any]:
    """Copy ``detail`` without keys that may hold prompts/completions, with long values cut: strings
    to 300 characters, collections to 50 items, 3 levels, and ``_MAX_DETAIL_CHARS`` in all (what is
    past it is left out and ``_truncated`` set), so a message's detail stays small however big the
    action's was."""
    left = [_MAX_DETAIL_CHARS] if budget is None else budget
    out: dict[str, Any] = {}
    for i, (k, v) in enumerate(detail.items()):
        if i >= _MAX_DETAIL_ITEMS or left[0] <= 0:
            out["_truncated"] = True
            break
        if str(k).lower() in PRIVATE_KEYS:
            continue
        left[0] -= len(str(k)) + 4
        out[str(k)] = _scrub_value(v, depth, left)
    return out


def _scrub_value(v: Any, depth: int, left: list[int]) -> Any:
    if v is None or isinstance(v, bool | int | float):
        left[0] -= 8
        return v
    if isinstance(v, str):
        v = v if len(v) <= _MAX_DETAIL_STR else v[:_MAX_DETAIL_STR] + "…"
        left[0] -= len(v) + 2
        return v
    if depth >= 3:
        v = str(v)[:_MAX_DETAIL_STR]
        left[0] -= len(v) + 2
        return v
    if isinstance(v, Mapping):
        return scrub(v, depth + 1, left)
    if isinstance(v, list | tuple | set | frozenset):
        out = []
        for x in list(v)[:_MAX_DETAIL_ITEMS]:
            if left[0] <= 0:
                out.append("…")
                break
            out.append(_scrub_value(x, depth + 1, left))
        return out
    v = str(v)[:_MAX_DETAIL_STR]
    left[0] -= len(v) + 2
    return v


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


#: type of a function that lists the alerts of open incidents (for channels that re-send)
ActiveAlerts = Callable[[], list[Alert]]
