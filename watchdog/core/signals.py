"""Plain data passed between the sources, the policy engine and the actuators.

Every source (live Kafka windows, golden replays, GPU health) reduces what it measured to
``Signal`` objects; the policy engine turns signals into ``Action`` objects; the actuator and the
alerter carry actions out. Nothing here does I/O, so the policy core stays a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Source = Literal["live", "golden", "gpu"]
ActionKind = Literal["rollback", "promote", "alert", "resolve"]

#: The one severity scale of the project, lowest first: a policy rule's ``severity``, an action's,
#: an alert's, and a channel's ``min_severity`` (docs/ALERTS.md) all take these values.
Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
#: position on the scale, for ``min_severity`` filters, escalation and "the worst of these rules"
SEVERITY_RANK: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}

#: Verdict of one rule (or a whole policy) for one scope.
#: ``inconclusive`` neither rolls back nor promotes; ``error`` means the source failed to measure.
VerdictStatus = Literal["pass", "marginal", "fail", "inconclusive", "error"]


@dataclass(slots=True)
class Signal:
    """What one source measured for one (model, route, precision) over one interval.

    ``values`` maps metric names to numbers; a metric that could not be measured is absent,
    never 0. ``paired`` holds per-item values for paired statistics (golden replays: the
    per-item candidate - baseline difference of each metric). ``error`` is set when the source
    failed (engine timeout, NVML failure): the signal then counts as an error, never a pass.
    """

    source: Source
    model: str
    route: str
    precision: str | None
    start: float
    end: float
    samples: int
    values: dict[str, float] = field(default_factory=dict)
    paired: dict[str, list[float]] | None = None
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


#: ``Action.detail`` key of the policy's alert routing, ``{"notify": [...], "page": [...]}``: the
#: alerter sends the incident's messages to those channels only (absent: to every channel)
ROUTING_KEY = "routing"


@dataclass(slots=True)
class Action:
    """Something the policy engine wants done for one (model, route)."""

    kind: ActionKind
    policy: str
    model: str
    route: str
    reason: str
    severity: Severity = "warning"
    #: target precision for rollback/promote
    precision: str | None = None
    #: evaluated and reported, never applied
    dry_run: bool = False
    #: end of the window/report that caused it (idempotency across replays)
    at: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def incident_key(self) -> str:
        return f"{self.model}/{self.route}/{self.policy}"
