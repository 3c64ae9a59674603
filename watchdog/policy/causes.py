"""Cause-aware inhibition: is a tripped rule better explained by an input shift or by GPU health
than by the candidate precision? Thin policy-side glue over ``watchdog.policy.judge.paired.attribute``. Pure."""

from __future__ import annotations

import math
from typing import Any

from watchdog.core.signals import Signal
from watchdog.policy.judge.verdict import Attribution, attribute
from watchdog.policy.schema import Policy, Rule
from watchdog.policy.state import RuleState, ScopeState

#: metrics that compare the two precisions' outputs with each other: a broken candidate drags the
#: baseline's value down with it (the FP16 window's shadow is the FP8 answer), so a "baseline drop"
#: there is no evidence of an input shift
PAIRWISE_METRICS = frozenset({"shadow_rougeL", "shadow_bleu", "agreement_rougeL"})


def gpu_reading(policy: Policy, sig: Signal) -> dict[str, Any] | None:
    """The problems a GPU signal shows, or None when it carries no usable reading (an error, or
    NVML unavailable: unknown is not healthy, so the previous reading stands)."""
    if sig.error:
        return None
    problems = []
    for name in policy.inhibit.gpu_metrics:
        value = sig.values.get(name)
        if value is not None and not math.isnan(value) and value > 0:
            problems.append(f"{name}={value:g}")
    return {"at": sig.end, "problems": problems}


def gpu_problems(policy: Policy, st: ScopeState, now: float) -> list[str]:
    """GPU problems of the route's latest reading, if inhibition by GPU is on and it is fresh."""
    if not policy.inhibit.gpu or not st.gpu:
        return []
    if now - float(st.gpu["at"]) > policy.inhibit.gpu_max_age:
        return []
    return list(st.gpu.get("problems", []))


def attribute_rule(policy: Policy, rule: Rule, rs: RuleState, problems: list[str]) -> Attribution:
    """Why ``rule`` trips: ``candidate`` (roll back), ``input_shift`` or ``gpu_health`` (alert only).

    The "before" values are those of the rule's last passing window - for a pooled rule the last
    one before the pool's first window: a window inside the pool may have passed while a
    regression was already in it, and comparing with it sees no candidate change beyond one
    window's noise. Without them (or without this window's numbers) only the GPU can be blamed
    instead of the candidate."""
    v = rs.last
    now_c = v.candidate if v else None
    now_b = v.baseline if v else None
    before_c, before_b = _before(rs)
    numbers = (now_c, before_c, now_b, before_b)
    usable = (policy.inhibit.input_shift and rule.metric not in PAIRWISE_METRICS
              and all(x is not None for x in numbers))
    if not usable and not problems:
        return Attribution("candidate", False, "no earlier passing window to compare with",
                           math.nan, math.nan, [])
    if not usable:
        now_c = before_c = now_b = before_b = math.nan
    return attribute(float(now_c), float(before_c), float(now_b), float(before_b),  # type: ignore[arg-type]
                     problems, direction=rule.direction, shared_fraction=policy.inhibit.shared_fraction)


def _before(rs: RuleState) -> tuple[float | None, float | None]:
    """(candidate, baseline) of the reference window of ``attribute_rule``."""
    ref = rs.ref or {}
    recent = ref.get("recent")
    if not rs.pool or len(rs.pool) < 2 or not isinstance(recent, list):
        return ref.get("candidate"), ref.get("baseline")  # no pool (or a state saved before "recent")
    first = rs.pool[0]
    # live windows carry their start; golden replays only their end
    earlier = [e for e in recent if (e[0] <= float(first["start"]) if "start" in first else e[0] < float(first["end"]))]
    return (earlier[-1][1], earlier[-1][2]) if earlier else (None, None)
