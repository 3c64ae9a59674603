"""Typed policy model (pydantic). Structure only; cross-field checks with file positions live in
``loader.py`` so that every message can point at a line and column."""

from __future__ import annotations

import fnmatch
import functools
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from watchdog.policy.conditions import Condition, parse_condition

#: Metric names a live window may carry (see docs/ARCHITECTURE.md).
LIVE_METRICS = (
    "error_rate",
    "timeout_rate",
    "latency_p50_ms",
    "latency_p95_ms",
    "latency_p99_ms",
    "ttft_p99_ms",
    "tokens_per_s",
    "empty_rate",
    "mean_completion_tokens",
    "perplexity",
    "shadow_rougeL",
    "shadow_bleu",
)

# Parsing is pure, so one parse per distinct condition text is enough.
_parse_cached = functools.lru_cache(maxsize=4096)(parse_condition)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: object) -> float:
    """``"90s"``, ``"5m"``, ``"1h30m"``, ``"2d"`` or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r}: use e.g. 30s, 5m, 1h, 1d")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"bad duration {value!r}: use e.g. 30s, 5m, 1h, 1d")
    text = value.strip().replace(" ", "")
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"bad duration '{value}': use e.g. 30s, 5m, 1h30m, 1d")
    return total


Duration = Annotated[float, BeforeValidator(parse_duration)]
Name = Annotated[str, Field(min_length=1, max_length=120, pattern=r"^[A-Za-z0-9_.:/-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class Scope(_Strict):
    """Which (model, route) pairs a policy covers; shell-style globs (``*``, ``?``, ``[ab]``)."""

    models: list[str] = Field(default_factory=lambda: ["*"])
    routes: list[str] = Field(default_factory=lambda: ["*"])
    exclude_models: list[str] = Field(default_factory=list)
    exclude_routes: list[str] = Field(default_factory=list)

    def covers(self, model: str, route: str) -> bool:
        def hit(name: str, globs: list[str]) -> bool:
            return any(fnmatch.fnmatchcase(name, g) for g in globs)

        return (
            hit(model, self.models)
            and hit(route, self.routes)
            and not hit(model, self.exclude_models)
            and not hit(route, self.exclude_routes)
        )


class Rule(_Strict):
    name: Name
    description: str = ""
    source: Literal["live", "golden", "gpu"] = "live"
    metric: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_.:-]*$")]
    #: the rule FAILS when this condition is true
    fail_if: str
    min_samples: Annotated[int, Field(ge=0)] = 1
    for_: Annotated[int, Field(alias="for", ge=1)] = 1
    #: consecutive error verdicts (the source failed) that count as a trip; null = errors never trip
    errors_trip_after: Annotated[int, Field(ge=1)] | None = 3
    severity: Literal["info", "warning", "critical"] = "warning"
    action: Literal["rollback", "alert"] = "alert"

    @property
    def condition(self) -> Condition:
        return _parse_cached(self.fail_if)


class Promote(_Strict):
    mode: Literal["manual", "auto"] = "manual"
    healthy_windows: Annotated[int, Field(ge=1)] = 10
    #: time since the rollback before an automatic promote may happen
    after: Duration = 1800.0


class Actions(_Strict):
    """Alert routing passed to the alerter in ``Action.detail['channels']``."""

    notify: list[str] = Field(default_factory=list)
    #: extra channels for critical actions (rollbacks caused by critical rules, critical alerts)
    page: list[str] = Field(default_factory=list)

    def channels(self, severity: str) -> list[str]:
        out = list(self.notify)
        if severity == "critical":
            out += [c for c in self.page if c not in out]
        return out


class Policy(_Strict):
    name: Name
    description: str = ""
    scope: Scope = Field(default_factory=Scope)
    candidate: Name = "fp8"
    baseline: Name = "fp16"
    rules: Annotated[list[Rule], Field(min_length=1)]
    actions: Actions = Field(default_factory=Actions)
    dry_run: bool = False
    cooldown: Duration = 300.0
    min_time_in_state: Duration = 0.0
    max_flips_per_day: Annotated[int, Field(ge=0)] = 6
    promote: Promote = Field(default_factory=Promote)

    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)


class PolicyFile(_Strict):
    policies: Annotated[list[Policy], Field(min_length=1)]
