"""What a backtest means for a policy change, as pure functions over plain data.

* ``verdict_row``: one rule's verdict on one window as a flat dict: judged or not (and why: ``n < min``
  when the window had fewer samples than ``min_samples``), the statistic the rule compares, its
  interval, the threshold and the **margin** to it (positive: passing by that much; negative: beyond).
  Condition rules (``fail_if``): the statistic is the candidate value, the threshold the candidate
  value where the condition turns (found numerically, so any condition over candidate and baseline
  works). Judged rules: the statistic is the judge's estimate (FP8 - FP16 drift, or the shift from a
  learned level), the threshold its effect; the rule fails when the whole interval lies beyond it,
  so the margin is threshold - the interval's near end (harm direction).
* ``HealthySpec`` / ``parse_healthy``: which windows are known healthy (``--healthy-until``): a
  window is healthy when it ends at or before the time given for its route (a route pattern beats
  the catch-all).
* ``false_rollbacks``: rollbacks in healthy windows over the healthy windows in which a rollback
  could have happened (serving the candidate, at least one rollback rule judged), with a
  Clopper-Pearson 95 % interval.
* ``margin_table``: per (route, rule): windows seen, judged, not judged (n < min), fired, and the
  min / 5th percentile / median margin.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from watchdog.policy.evaluate import Verdict
from watchdog.policy.schema import Policy, Rule, parse_duration

JUDGED = ("pass", "fail", "marginal")


# --- thresholds and margins ------------------------------------------------------------------------


def crossing(fails: Callable[[float], bool], start: float) -> float | None:
    """The x nearest ``start`` where ``fails(x)`` changes truth (geometric search outward on both
    sides, then bisection), or None when it does not change within +-1e12."""
    at = fails(start)
    best: float | None = None
    for sign in (1.0, -1.0):
        step = 1e-9 * max(1.0, abs(start))
        prev = start
        while step < 1e12:
            x = start + sign * step
            if fails(x) != at:
                lo, hi = prev, x
                for _ in range(80):
                    mid = (lo + hi) / 2
                    if fails(mid) == at:
                        lo = mid
                    else:
                        hi = mid
                if best is None or abs(hi - start) < abs(best - start):
                    best = hi
                break
            prev, step = x, step * 2
    return best


def condition_threshold(rule: Rule, candidate: float | None, baseline: float | None) -> float | None:
    """The candidate value where ``rule.condition`` turns, given the window's baseline; None when
    the condition reads more than candidate and baseline or needs a baseline it lacks."""
    cond = rule.condition
    if cond is None or not cond.names <= {"candidate", "baseline", "value"}:
        return None
    if "baseline" in cond.names and baseline is None:
        return None
    env = {"baseline": baseline if baseline is not None else 0.0}

    def fails(x: float) -> bool:
        return bool(cond.evaluate({**env, "candidate": x, "value": x}))

    start = candidate if candidate is not None else baseline if baseline is not None else 0.0
    return crossing(fails, start)


def _judged_numbers(rule: Rule, v: Verdict) -> tuple[float | None, float | None, float | None, float | None, float | None]:
    """(statistic, low, high, threshold line, margin) of a judged rule's verdict."""
    j = v.judgement or {}
    est, lo, hi, thr = (j.get(k) for k in ("estimate", "ci_low", "ci_high", "effect_threshold"))
    if not all(isinstance(x, int | float) and math.isfinite(x) for x in (est, lo, hi, thr)):
        return None, None, None, None, None
    assert isinstance(est, int | float) and isinstance(lo, int | float)
    assert isinstance(hi, int | float) and isinstance(thr, int | float)
    down = rule.judge is not None and rule.judge.harm_direction == "higher_is_better"
    if down:  # harm is a drop: fails when the interval lies wholly below -threshold
        return float(est), float(lo), float(hi), -float(thr), float(hi) + float(thr)
    return float(est), float(lo), float(hi), float(thr), float(thr) - float(lo)


def not_judged_why(v: Verdict) -> str | None:
    """None when the rule judged the window; else a short tag: ``n < min`` (too few samples),
    ``learning`` (the learned null is warming up), ``error`` or ``inconclusive``."""
    if v.status in JUDGED:
        return None
    if v.status == "error":
        return "error"
    if v.reason.startswith("too few") or "too few samples" in v.reason:
        return "n < min"
    if (v.judgement or {}).get("reason") == "learning_null":
        return "learning"
    return "inconclusive"


def verdict_row(policy: Policy, rule: Rule, v: Verdict, model: str, route: str, serving: str) -> dict[str, Any]:
    """One rule's verdict on one window, flattened (see the module doc)."""
    if rule.judge is not None:
        stat, lo, hi, thr, margin = _judged_numbers(rule, v)
        kind = "judge"
    else:
        kind = "condition"
        stat, lo, hi = v.candidate, None, None
        thr = condition_threshold(rule, v.candidate, v.baseline)
        margin = None
        if thr is not None and stat is not None and v.status in JUDGED:
            margin = abs(thr - stat) * (-1.0 if v.status == "fail" else 1.0)
    why = not_judged_why(v)
    need = max(rule.min_samples, rule.judge.min_n) if rule.judge is not None else rule.min_samples
    return {
        "t": v.end, "start": v.start, "policy": policy.name, "model": model, "route": route, "rule": rule.name,
        "metric": rule.metric, "source": rule.source, "kind": kind, "action": rule.action, "for": rule.for_,
        "status": v.status, "judged": why is None, "not_judged": why, "reason": v.reason,
        "candidate": v.candidate, "baseline": v.baseline, "samples": v.samples,
        "baseline_samples": v.baseline_samples, "min_samples": need,
        "stat": stat, "lo": lo, "hi": hi, "threshold": thr, "margin": margin, "serving": serving,
        "candidate_precision": policy.candidate,
    }


# --- healthy stretches -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthySpec:
    """Windows of routes matching ``route`` (fnmatch over ``route`` or ``model/route``; ``*`` =
    every route) that end at or before ``until`` are known healthy."""

    route: str
    until: float

    def matches(self, model: str, route: str) -> bool:
        return self.route == "*" or fnmatch.fnmatchcase(route, self.route) \
            or fnmatch.fnmatchcase(f"{model}/{route}", self.route)


_HHMM = re.compile(r"^(\d{1,2}):(\d{2})(?::(\d{2}))?$")


def parse_healthy(spec: str, start: float) -> HealthySpec:
    """``[ROUTE=]TIME``; TIME is ``end`` (the whole recording), ``+DURATION`` after the recording's
    start, ``HH:MM[:SS]`` (UTC, on the recording's first day) or an ISO time (``...Z``)."""
    route, sep, when = spec.rpartition("=")
    route = route if sep else "*"
    when = when.strip()
    if not when:
        raise ValueError(f"{spec!r}: no time (use [ROUTE=]TIME, e.g. 08:08, +8m, end)")
    if when == "end":
        return HealthySpec(route, math.inf)
    if when.startswith("+"):
        return HealthySpec(route, start + parse_duration(when[1:]))
    m = _HHMM.match(when)
    if m:
        day = datetime.fromtimestamp(start, tz=UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        h, mi, s = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
        if h > 23 or mi > 59 or s > 59:
            raise ValueError(f"{spec!r}: bad time of day {when!r}")
        return HealthySpec(route, day.timestamp() + h * 3600 + mi * 60 + s)
    try:
        t = datetime.fromisoformat(when.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{spec!r}: bad time {when!r} (use HH:MM, +8m, an ISO time or end)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return HealthySpec(route, t.timestamp())


def healthy_until(specs: Iterable[HealthySpec], model: str, route: str) -> float | None:
    """Until when (model, route) is known healthy: the last matching spec with a route pattern,
    else the last catch-all; None when no spec covers it."""
    found: float | None = None
    specific: float | None = None
    for s in specs:
        if s.route == "*":
            found = s.until
        elif s.matches(model, route):
            specific = s.until
    return specific if specific is not None else found


def is_healthy(specs: Iterable[HealthySpec], model: str, route: str, t: float) -> bool:
    until = healthy_until(specs, model, route)
    return until is not None and t <= until + 1e-9


# --- false-rollback rate ---------------------------------------------------------------------------


def _binom_cdf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                        for i in range(0, k + 1)))


def clopper_pearson(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) two-sided interval for k successes in n trials."""
    if n <= 0:
        return 0.0, 1.0
    a = (1 - conf) / 2

    def solve(target: Callable[[float], float]) -> float:
        lo, hi = 0.0, 1.0  # target is decreasing in p
        for _ in range(100):
            mid = (lo + hi) / 2
            if target(mid) > a:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    upper = 1.0 if k >= n else solve(lambda p: _binom_cdf(k, n, p))
    lower = 0.0 if k <= 0 else 1.0 - solve(lambda q: _binom_cdf(n - k, n, q))
    return lower, upper


@dataclass(slots=True)
class FalseRollbacks:
    rollbacks: int
    windows: int
    #: healthy windows not counted: no rollback rule judged them (too few samples, learning, ...)
    not_judged: int
    #: healthy windows not counted: the route was already serving the baseline
    rolled_back: int
    low: float
    high: float

    @property
    def rate(self) -> float | None:
        return self.rollbacks / self.windows if self.windows else None

    def to_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks, "windows": self.windows, "rate": self.rate,
                "ci95": [self.low, self.high], "not_judged": self.not_judged, "rolled_back": self.rolled_back}


def false_rollbacks(verdicts: Sequence[Mapping[str, Any]], rollbacks: Iterable[tuple[str, str, float]],
                    specs: list[HealthySpec]) -> FalseRollbacks:
    """Rollbacks ((model, route, time)) in healthy live windows over the healthy live windows that
    could have rolled back: serving the candidate, with at least one rollback rule judged."""
    windows: dict[tuple[str, str, float], dict[str, bool]] = {}
    for row in verdicts:
        if row["source"] != "live" or not is_healthy(specs, row["model"], row["route"], row["t"]):
            continue
        w = windows.setdefault((row["model"], row["route"], row["t"]), {"judged": False, "candidate": True})
        if row["serving"] != row["candidate_precision"]:
            w["candidate"] = False
        if row["action"] == "rollback" and row["judged"]:
            w["judged"] = True
    at_risk = {k for k, w in windows.items() if w["candidate"] and w["judged"]}
    k = sum(1 for m, r, t in rollbacks if any(key[:2] == (m, r) and abs(key[2] - t) < 1e-6 for key in at_risk))
    n = len(at_risk)
    lo, hi = clopper_pearson(k, n)
    return FalseRollbacks(k, n, sum(1 for w in windows.values() if w["candidate"] and not w["judged"]),
                          sum(1 for w in windows.values() if not w["candidate"]), lo, hi)


# --- margins ---------------------------------------------------------------------------------------


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    i = int(math.floor(pos))
    j = min(i + 1, len(s) - 1)
    return s[i] + (s[j] - s[i]) * (pos - i)


def margin_table(verdicts: Sequence[Mapping[str, Any]], specs: list[HealthySpec] | None = None) -> list[dict[str, Any]]:
    """Per (model, route, policy, rule), over healthy windows when ``specs`` is given (else all):
    windows seen, judged, not judged for too few samples, fired (failed), and the min, 5th
    percentile and median margin of the judged windows (None without any)."""
    groups: dict[tuple[str, str, str, str], list[Mapping[str, Any]]] = {}
    for row in verdicts:
        if specs and not is_healthy(specs, row["model"], row["route"], row["t"]):
            continue
        groups.setdefault((row["model"], row["route"], row["policy"], row["rule"]), []).append(row)
    out = []
    for (model, route, policy, rule), rows in groups.items():
        margins = [float(r["margin"]) for r in rows if r["judged"] and r["margin"] is not None]
        out.append({
            "model": model, "route": route, "policy": policy, "rule": rule, "metric": rows[0]["metric"],
            "kind": rows[0]["kind"], "seen": len(rows), "judged": sum(r["judged"] for r in rows),
            "n_below_min": sum(r["not_judged"] == "n < min" for r in rows),
            "fired": sum(r["status"] == "fail" for r in rows),
            "min": min(margins) if margins else None,
            "p5": _quantile(margins, 0.05) if margins else None,
            "median": _quantile(margins, 0.5) if margins else None,
        })
    return out
