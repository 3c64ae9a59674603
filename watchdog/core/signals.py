"""Plain data passed between the sources, the policy engine and the actuators.

Every source (live Kafka windows, golden replays, GPU health) reduces what it measured to
``Signal`` objects; the policy engine turns signals into ``Action`` objects; the actuator and the
alerter carry actions out. Nothing here does I/O, so the policy core stays a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

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

#: version of ``signal_to_dict``'s records (the golden signal stream)
SIGNAL_SCHEMA = 1


def signal_to_dict(sig: Signal) -> dict[str, Any]:
    """``sig`` as plain JSON-able data (schema ``SIGNAL_SCHEMA``); ``signal_from_dict`` reads it back."""
    return {"schema": SIGNAL_SCHEMA, "source": sig.source, "model": sig.model, "route": sig.route,
            "precision": sig.precision, "start": sig.start, "end": sig.end, "samples": sig.samples,
            "values": dict(sig.values), "paired": sig.paired, "error": sig.error, "detail": sig.detail}


def signal_from_dict(d: dict[str, Any]) -> Signal:
    """The ``Signal`` of a ``signal_to_dict`` record; ValueError on another schema or a bad field."""
    if d.get("schema") != SIGNAL_SCHEMA:
        raise ValueError(f"signal record schema {d.get('schema')!r}, expected {SIGNAL_SCHEMA}")
    raw_source = d.get("source")
    if raw_source not in get_args(Source):
        raise ValueError(f"unknown signal source {raw_source!r}")
    source = cast(Source, raw_source)
    paired = d.get("paired")
    try:
        return Signal(source=source, model=str(d["model"]), route=str(d["route"]),
                      precision=None if d.get("precision") is None else str(d["precision"]),
                      start=float(d["start"]), end=float(d["end"]), samples=int(d["samples"]),
                      values={str(k): float(v) for k, v in (d.get("values") or {}).items()},
                      paired={str(k): [float(x) for x in v] for k, v in paired.items()} if paired else None,
                      error=None if d.get("error") is None else str(d["error"]), detail=dict(d.get("detail") or {}))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad signal record: {exc!r}") from exc


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
