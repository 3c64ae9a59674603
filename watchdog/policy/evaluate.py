"""One rule against one window: candidate and baseline signals in, a ``Verdict`` out. Pure."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from watchdog.policy.schema import Rule
from watchdog.signals import Signal, VerdictStatus


@dataclass(slots=True)
class Verdict:
    rule: str
    status: VerdictStatus
    reason: str
    source: str
    metric: str
    start: float = 0.0
    end: float = 0.0
    candidate: float | None = None
    baseline: float | None = None
    samples: int | None = None
    baseline_samples: int | None = None
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(**d)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _paired_stats(values: list[float]) -> dict[str, float]:
    """Mean and a normal-approximation 95% interval of per-item paired differences."""
    n = len(values)
    mean = sum(values) / n
    out = {"paired_mean": mean, "paired_n": float(n)}
    if n >= 2:
        var = sum((v - mean) ** 2 for v in values) / (n - 1)
        half = 1.96 * math.sqrt(var / n)
        out["paired_lo"], out["paired_hi"] = mean - half, mean + half
    return out


def evaluate_rule(rule: Rule, candidate: Signal | None, baseline: Signal | None) -> Verdict:
    """The verdict of ``rule`` for one window. ``fail`` when its ``fail_if`` condition is true."""
    cond = rule.condition
    ref = candidate or baseline
    v = Verdict(rule.name, "inconclusive", "", rule.source, rule.metric,
                start=ref.start if ref else 0.0, end=ref.end if ref else 0.0)
    needs_base = "baseline" in cond.names
    needs_cand = "candidate" in cond.names or not needs_base
    paired_names = {n for n in cond.names if n.startswith("paired_")}

    for role, sig, needed in (("candidate", candidate, needs_cand), ("baseline", baseline, needs_base)):
        if not needed:
            continue
        if sig is None:
            v.reason = f"no {role} signal in this window"
            return v
        if sig.error:
            v.status, v.reason = "error", f"{role} source failed: {sig.error}"
            return v
        if role == "candidate":
            v.samples = sig.samples
        else:
            v.baseline_samples = sig.samples
        if sig.samples < rule.min_samples:
            v.reason = f"too few {role} samples: {sig.samples} < min_samples {rule.min_samples}"
            return v
        raw = sig.values.get(rule.metric)
        if raw is None:
            v.reason = f"{rule.metric} not measured for {role}"
            return v
        x = float(raw)
        if math.isnan(x):
            v.reason = f"{rule.metric} is NaN for {role}"
            return v
        setattr(v, role, x)

    env: dict[str, float] = {}
    if v.candidate is not None:
        env["candidate"] = v.candidate
    if v.baseline is not None:
        env["baseline"] = v.baseline
    if paired_names:
        items: list[float] | None = None
        for sig in (candidate, baseline):
            if sig is not None and sig.paired and sig.paired.get(rule.metric):
                items = [float(x) for x in sig.paired[rule.metric]]
                break
        if not items:
            v.reason = f"no paired values for {rule.metric}"
            return v
        stats = _paired_stats(items)
        missing = paired_names - stats.keys()
        if missing:
            v.reason = f"too few paired items for {', '.join(sorted(missing))}: {len(items)}"
            return v
        v.extra = {k: stats[k] for k in sorted(paired_names)}
        env.update(stats)

    shown = ", ".join(f"{k}={_fmt(x)}" for k, x in env.items() if k in cond.names or k in v.extra)
    if cond.evaluate(env):
        v.status, v.reason = "fail", f"{rule.metric}: {cond.text} ({shown})"
    else:
        v.status, v.reason = "pass", f"{rule.metric}: not ({cond.text}) ({shown})"
    return v
