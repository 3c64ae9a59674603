"""The verdict of one statistical comparison, and how verdicts combine.

A ``Judgement`` is what every judge returns: the harm estimate and its interval, the status
(``judge_stats.classify``: fail only when the whole ``1 - alpha`` interval lies beyond the effect
threshold) and a one-line message. ``combine`` merges the metrics of one policy evaluation
(Holm-Bonferroni); ``attribute`` says whether a drop is better explained by an input shift or GPU
health than by the candidate. Nothing here does I/O; docs/JUDGE.md explains the statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from watchdog.core.signals import VerdictStatus
from watchdog.policy.judge import stats as st

Direction = Literal["higher_is_better", "lower_is_better"]
PairedMethod = Literal["t", "bootstrap", "signed_rank"]
Samples = Sequence[float] | np.ndarray
Histogram = Mapping[int, int]


@dataclass(slots=True)
class Judgement:
    """Verdict on one metric (or, from ``combine``, on one policy evaluation).

    ``estimate``/``ci_low``/``ci_high`` are the drift candidate vs baseline in the metric's own
    terms: a mean per-item difference (paired), a relative change of the typical value
    (unpaired: 0.10 = 10 % higher) or a rate difference (rates). ``reason`` is a stable code.
    """

    metric: str
    status: VerdictStatus
    reason: str
    message: str
    estimate: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    p_value: float | None = None
    n: int = 0
    effect_threshold: float | None = None
    method: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

def check_direction(direction: str) -> int:
    if direction == "higher_is_better":
        return -1
    if direction == "lower_is_better":
        return 1
    raise ValueError(f"direction must be higher_is_better or lower_is_better, got {direction!r}")

def verdict(
    metric: str, method: str, harm_lo: float, harm_hi: float, n: int, *, effect_threshold: float,
    harm_threshold: float, harm_marginal: float | None, min_n: int, max_ci_width: float | None,
) -> tuple[VerdictStatus, str]:
    code, reason = st.classify_one(
        float(harm_lo), float(harm_hi), n, effect_threshold=harm_threshold,
        marginal_threshold=harm_marginal, min_n=min_n, max_ci_width=max_ci_width,
    )
    status: VerdictStatus = st.STATUS_NAMES[code]  # type: ignore[assignment]
    return status, st.REASONS[reason]

def message(metric: str, status: str, reason: str, est: float, lo: float, hi: float, n: int,
             thr: float, unit: str = "") -> str:
    return (f"{metric}: {status} ({reason}); drift {est:+.4g}{unit} "
            f"[{lo:+.4g}, {hi:+.4g}], threshold {thr:.4g}{unit}, n={n}")

def inconclusive(metric: str, method: str, reason: str, msg: str, n: int, thr: float,
                  **detail: Any) -> Judgement:
    return Judgement(metric=metric, status="inconclusive", reason=reason, message=f"{metric}: {msg}",
                     n=n, effect_threshold=thr, method=method, detail=dict(detail))

def error(metric: str, method: str, msg: str, thr: float | None) -> Judgement:
    return Judgement(metric=metric, status="error", reason="bad_input", message=f"{metric}: {msg}",
                     effect_threshold=thr, method=method)

def combine(
    judgements: Iterable[Judgement],
    critical: Iterable[str] = (),
    *,
    method: Literal["holm", "none"] = "holm",
    alpha: float = 0.01,
    k: int = 1,
    metric: str = "policy",
) -> Judgement:
    """One verdict for the metrics of one policy evaluation.

    1. Holm-Bonferroni over the p-values of all metrics: a ``fail`` whose adjusted p-value is
       above ``alpha`` becomes ``marginal`` (``not_significant_after_holm``).
    2. fail if any critical metric fails (``critical_metric_failed``), or if at least ``k``
       metrics fail (``k_metrics_failed``).
    3. error if any metric is ``error`` (a failed measurement is never a pass).
    4. marginal if any metric is marginal or fails below ``k`` (``some_marginal``).
    5. inconclusive if any metric is inconclusive (``some_inconclusive``): the policy does not
       pass on partial evidence.
    6. pass otherwise (``all_pass``); no metrics at all is inconclusive (``no_metrics``).
    """
    items = list(judgements)
    crit = set(critical)
    if not items:
        return Judgement(metric=metric, status="inconclusive", reason="no_metrics", message=f"{metric}: no metrics")
    pvals = [j.p_value for j in items]
    adjusted: list[float | None] = list(pvals)
    if method == "holm":
        present = [i for i, p in enumerate(pvals) if p is not None and math.isfinite(p)]
        adj = st.holm([float(pvals[i]) for i in present])  # type: ignore[arg-type]
        for i, adj_p in zip(present, adj, strict=True):
            adjusted[i] = adj_p
    statuses: dict[str, str] = {}
    for j, a in zip(items, adjusted, strict=True):
        s = j.status
        if s == "fail" and a is not None and a > alpha:
            s = "marginal"
        statuses[j.metric] = s
    fails = [m for m, s in statuses.items() if s == "fail"]
    crit_fails = [m for m in fails if m in crit]
    detail: dict[str, Any] = {
        "statuses": statuses, "adjusted_p": {j.metric: a for j, a in zip(items, adjusted, strict=True)},
        "original": {j.metric: j.status for j in items}, "failed": fails, "k": k, "method": method,
    }
    if crit_fails:
        status, reason = "fail", "critical_metric_failed"
        msg = f"critical metric(s) failed: {', '.join(crit_fails)}"
    elif len(fails) >= k:
        status, reason, msg = "fail", "k_metrics_failed", f"{len(fails)} metric(s) failed: {', '.join(fails)}"
    elif "error" in statuses.values():
        errs = [m for m, s in statuses.items() if s == "error"]
        status, reason, msg = "error", "source_error", f"measurement error: {', '.join(errs)}"
    elif fails or "marginal" in statuses.values():
        downgraded = [j.metric for j in items if j.status == "fail" and statuses[j.metric] == "marginal"]
        status, reason = "marginal", "some_marginal"
        if downgraded and all(statuses[m] != "marginal" or m in downgraded for m in statuses):
            reason = "not_significant_after_holm"
        msg = "marginal: " + ", ".join(m for m, s in statuses.items() if s in ("marginal", "fail"))
    elif "inconclusive" in statuses.values():
        status, reason = "inconclusive", "some_inconclusive"
        msg = "inconclusive: " + ", ".join(m for m, s in statuses.items() if s == "inconclusive")
    else:
        status, reason, msg = "pass", "all_pass", f"all {len(items)} metric(s) pass"
    return Judgement(metric=metric, status=status, reason=reason, message=f"{metric}: {msg}",  # type: ignore[arg-type]
                     n=len(items), method=f"combine:{method}", detail=detail)

Cause = Literal["candidate", "input_shift", "gpu_health", "none"]

@dataclass(slots=True)
class Attribution:
    """Which cause best explains a candidate's drop between two windows.

    ``inhibit_rollback`` is True when the cause is not the candidate: the caller should alert
    with ``cause`` and keep serving the candidate."""

    cause: Cause
    inhibit_rollback: bool
    message: str
    candidate_change: float
    baseline_change: float
    gpu_problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

def attribute(
    candidate_now: float,
    candidate_before: float,
    baseline_now: float,
    baseline_before: float,
    gpu_problems: Sequence[str] | None = None,
    *,
    direction: Direction = "higher_is_better",
    shared_fraction: float = 0.5,
    noise: float = 0.0,
) -> Attribution:
    """Attribute a candidate's degradation (``now`` vs ``before``) to a cause.

    * ``gpu_health`` when ``gpu_problems`` (e.g. XID errors, throttling, ECC on the candidate's
      GPU) is non-empty: a sick GPU explains the drop better than the precision;
    * ``input_shift`` when the baseline degraded too, by at least ``shared_fraction`` of the
      candidate's degradation and by more than ``noise``: the traffic changed, not FP8;
    * ``candidate`` when the candidate degraded by more than ``noise`` and neither applies;
    * ``none`` when the candidate did not degrade.
    Changes are harm-oriented (positive = worse) in metric units."""
    sign = check_direction(direction)
    nums = (candidate_now, candidate_before, baseline_now, baseline_before)
    problems = [str(p) for p in (gpu_problems or [])]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in nums):
        cause: Cause = "gpu_health" if problems else "candidate"
        return Attribution(cause, cause != "candidate", "non-finite input; cannot attribute",
                           math.nan, math.nan, problems)
    c_harm = sign * (candidate_now - candidate_before)
    b_harm = sign * (baseline_now - baseline_before)
    if problems:
        return Attribution("gpu_health", True, f"GPU health explains the change: {', '.join(problems)}",
                           c_harm, b_harm, problems)
    if c_harm <= noise:
        return Attribution("none", False, "candidate did not degrade", c_harm, b_harm, problems)
    if b_harm > noise and b_harm >= shared_fraction * c_harm:
        return Attribution("input_shift", True,
                           f"baseline degraded too ({b_harm:+.4g} vs candidate {c_harm:+.4g}): input shift",
                           c_harm, b_harm, problems)
    return Attribution("candidate", False, f"candidate degraded by {c_harm:+.4g}, baseline by {b_harm:+.4g}",
                       c_harm, b_harm, problems)
