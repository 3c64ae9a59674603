"""Statistical judge: plain numbers in, a ``Judgement`` out.

Three comparisons of a candidate (FP8) against a baseline (FP16):

* ``judge_paired``   golden replays: per-item candidate - baseline differences (bootstrap or
  Wilcoxon signed-rank / Hodges-Lehmann interval);
* ``judge_unpaired`` latencies: raw samples or log-bucket histograms (Mann-Whitney U, Hodges-
  Lehmann ratio of medians, probability of superiority);
* ``judge_rate``     error / timeout rates (Newcombe score interval of the difference).

Every judge applies one rule (``judge_stats.classify``) to a "harm" interval (positive = worse):
fail only when the whole ``1 - alpha`` interval lies beyond the effect threshold, i.e. the
regression is both significant and larger than what the policy tolerates. ``combine`` merges the
metrics of one policy evaluation (Holm-Bonferroni), ``attribute`` says whether a drop is better
explained by an input shift or GPU health than by the candidate. Pooling the last k live windows
lives in ``watchdog/judge_pool.py`` (re-exported here). Nothing here does I/O. docs/JUDGE.md
explains the statistics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from watchdog import judge_stats as st
from watchdog.judge_pool import (
    SketchLike,
    judge_rate_pooled,
    judge_unpaired_pooled,
    pool_counts,
    pool_histograms,
    zero_bucket_index,
)
from watchdog.signals import VerdictStatus

__all__ = [
    "Attribution", "Direction", "Judgement", "SketchLike", "attribute", "combine", "judge_broken", "judge_paired",
    "judge_paired_replays", "judge_rate", "judge_rate_pooled", "judge_unpaired", "judge_unpaired_pooled",
    "pool_counts", "pool_histograms", "zero_bucket_index",
]

log = logging.getLogger(__name__)

Direction = Literal["higher_is_better", "lower_is_better"]
PairedMethod = Literal["t", "bootstrap", "signed_rank"]
Samples = Sequence[float] | np.ndarray
Histogram = Mapping[int, int]

#: above this many pairwise differences, raw samples are binned for the Hodges-Lehmann interval
_MAX_PAIRS = 4_000_000
_FINE_GAMMA = 1.002
_MAX_BINS = 50_000


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


def _check_direction(direction: str) -> int:
    if direction == "higher_is_better":
        return -1
    if direction == "lower_is_better":
        return 1
    raise ValueError(f"direction must be higher_is_better or lower_is_better, got {direction!r}")


def _verdict(
    metric: str, method: str, harm_lo: float, harm_hi: float, n: int, *, effect_threshold: float,
    harm_threshold: float, harm_marginal: float | None, min_n: int, max_ci_width: float | None,
) -> tuple[VerdictStatus, str]:
    code, reason = st.classify(
        np.array([harm_lo]), np.array([harm_hi]), np.array([n]), effect_threshold=harm_threshold,
        marginal_threshold=harm_marginal, min_n=min_n, max_ci_width=max_ci_width,
    )
    status: VerdictStatus = st.STATUS_NAMES[int(code[0])]  # type: ignore[assignment]
    return status, st.REASONS[str(reason[0])]


def _message(metric: str, status: str, reason: str, est: float, lo: float, hi: float, n: int,
             thr: float, unit: str = "") -> str:
    return (f"{metric}: {status} ({reason}); drift {est:+.4g}{unit} "
            f"[{lo:+.4g}, {hi:+.4g}], threshold {thr:.4g}{unit}, n={n}")


def _inconclusive(metric: str, method: str, reason: str, msg: str, n: int, thr: float,
                  **detail: Any) -> Judgement:
    return Judgement(metric=metric, status="inconclusive", reason=reason, message=f"{metric}: {msg}",
                     n=n, effect_threshold=thr, method=method, detail=dict(detail))


def _error(metric: str, method: str, msg: str, thr: float | None) -> Judgement:
    return Judgement(metric=metric, status="error", reason="bad_input", message=f"{metric}: {msg}",
                     effect_threshold=thr, method=method)


# --- paired ------------------------------------------------------------------------------------


def judge_paired(
    diffs: Samples,
    *,
    direction: Direction,
    effect_threshold: float,
    marginal_threshold: float | None = None,
    alpha: float = 0.01,
    min_items: int = 30,
    method: PairedMethod = "t",
    max_ci_width: float | None = None,
    seed: int | None = 0,
    n_boot: int = 2000,
    metric: str = "",
    prior_jump: float = 0.5,
) -> Judgement:
    """Judge per-item candidate - baseline differences of one golden replay.

    ``method``: ``t`` (default) is the studentised interval of the mean with a weak prior on the
    spread (``judge_stats.t_mean_ci``; ``prior_jump`` in metric units), whose harmful-tail error
    is at or below nominal on sparse, heavy-tailed and concentrated differences (docs/JUDGE.md,
    "Golden intervals"); ``bootstrap`` is the old percentile bootstrap (kept for comparison: it
    under-covers), ``signed_rank`` the Hodges-Lehmann interval of the median shift.

    ``effect_threshold`` (>= 0, metric units) is the largest harmful mean drift tolerated;
    ``marginal_threshold`` (default 0) the drift above which a significant harm is reported as
    marginal. NaN/inf items are dropped (counted in ``detail['dropped']``). The p-value is the
    Wilcoxon signed-rank test of "no drift" either way (used by ``combine``)."""
    sign = _check_direction(direction)
    if effect_threshold < 0:
        return _error(metric, method, "effect_threshold must be >= 0", effect_threshold)
    arr = np.asarray(diffs, dtype=float).ravel()
    finite = arr[np.isfinite(arr)]
    dropped = int(arr.size - finite.size)
    n = int(finite.size)
    if n < max(min_items, 2):
        return _inconclusive(metric, method, "too_few_items", f"{n} usable items < {min_items}", n,
                             effect_threshold, dropped=dropped)
    z, p, nonzero = st.signed_rank_test(finite)
    if method == "t":
        est_a, lo_a, hi_a = st.t_mean_ci(finite[None, :], alpha=alpha, prior_jump=prior_jump)
        est, lo, hi = float(est_a[0]), float(lo_a[0]), float(hi_a[0])
    elif method == "bootstrap":
        est_a, lo_a, hi_a = st.bootstrap_mean_ci(finite[None, :], alpha=alpha, n_boot=n_boot, seed=seed)
        est, lo, hi = float(est_a[0]), float(lo_a[0]), float(hi_a[0])
    elif method == "signed_rank":
        est, lo, hi = st.walsh_ci(finite, alpha)
    else:
        return _error(metric, str(method), "method must be t, bootstrap or signed_rank", effect_threshold)
    harm_lo, harm_hi = (lo, hi) if sign > 0 else (-hi, -lo)
    status, reason = _verdict(metric, method, harm_lo, harm_hi, n, effect_threshold=effect_threshold,
                              harm_threshold=effect_threshold, harm_marginal=marginal_threshold,
                              min_n=min_items, max_ci_width=max_ci_width)
    return Judgement(
        metric=metric, status=status, reason=reason,
        message=_message(metric, status, reason, est, lo, hi, n, effect_threshold),
        estimate=est, ci_low=lo, ci_high=hi, p_value=p, n=n, effect_threshold=effect_threshold,
        method=method,
        detail={"dropped": dropped, "nonzero": nonzero, "z": z, "alpha": alpha, "direction": direction,
                "mean": float(finite.mean()), "changed_fraction": nonzero / n},
    )


def judge_paired_replays(
    replays: Sequence[Samples],
    *,
    direction: Direction,
    effect_threshold: float,
    marginal_threshold: float | None = None,
    alpha: float = 0.01,
    first_look_share: float = 0.1,
    min_items: int = 30,
    max_ci_width: float | None = None,
    seed: int | None = 0,
    n_boot: int = 2000,
    metric: str = "",
    method: PairedMethod = "t",
    prior_jump: float = 0.5,
    rotated: bool = False,
) -> Judgement:
    """Judge the latest golden replays of the same items (oldest first) with two looks.

    ``rotated``: the latest two replays asked different items (sampled from a larger pool), so
    the pooled look concatenates them (2 n independent items) instead of averaging per item.

    Look 1 is the latest replay alone at level ``alpha * first_look_share``; look 2 is the
    per-item mean of the latest two replays (same prompts in the same order, which halves the
    flip noise) at ``alpha * (1 - first_look_share)``. Fail if either look fails, otherwise the
    pooled look decides. The error budget is split, not doubled (alpha spending): at a true
    drift of exactly ``effect_threshold`` the chance of a fail per evaluation stays <= alpha / 2,
    as for one ``judge_paired`` call at ``alpha``. Most of it goes to the pooled look because it
    carries twice the information (an O'Brien-Fleming-like split).

    With one replay, or when the latest two differ in length (the prompt set changed), it is
    ``judge_paired`` on the latest replay at the full ``alpha``. An item missing (NaN) in one
    replay takes the other's value. ``detail['looks']`` holds both looks."""
    if not replays:
        return _inconclusive(metric, "bootstrap_replays", "too_few_items", "no replays", 0, effect_threshold)
    if not 0.0 <= first_look_share < 1.0:
        return _error(metric, "bootstrap_replays", "first_look_share must be in [0, 1)", effect_threshold)
    common = dict(direction=direction, effect_threshold=effect_threshold, marginal_threshold=marginal_threshold,
                  min_items=min_items, max_ci_width=max_ci_width, seed=seed, n_boot=n_boot, metric=metric,
                  method=method, prior_jump=prior_jump)
    latest = np.asarray(replays[-1], dtype=float).ravel()
    prev = np.asarray(replays[-2], dtype=float).ravel() if len(replays) >= 2 else None
    identical = prev is not None and prev.size == latest.size and bool(
        np.array_equal(np.nan_to_num(prev, nan=1e300), np.nan_to_num(latest, nan=1e300)))
    if rotated and prev is not None:
        both = np.concatenate([prev, latest])
        looks = []
        if first_look_share > 0:
            looks.append(("latest", judge_paired(latest, alpha=alpha * first_look_share, **common)))  # type: ignore[arg-type]
        looks.append(("rotated2", judge_paired(both, alpha=alpha * (1 - first_look_share), **common)))  # type: ignore[arg-type]
        return _pick_look(looks, method)
    if prev is None or prev.size != latest.size or identical:
        j = judge_paired(latest, alpha=alpha, **common)  # type: ignore[arg-type]
        j.detail["pooled_replays"] = 1
        j.detail["identical_replays"] = identical
        return j
    pooled = st.average_replays([prev[None, :], latest[None, :]])[0]
    looks = []
    if first_look_share > 0:
        looks.append(("latest", judge_paired(latest, alpha=alpha * first_look_share, **common)))  # type: ignore[arg-type]
    looks.append(("pooled2", judge_paired(pooled, alpha=alpha * (1 - first_look_share), **common)))  # type: ignore[arg-type]
    return _pick_look(looks, method)


def _pick_look(looks: list[tuple[str, Judgement]], method: str) -> Judgement:
    failed = [j for _, j in looks if j.status == "fail"]
    chosen = failed[0] if failed else looks[-1][1]
    chosen.detail["pooled_replays"] = 2 if chosen is looks[-1][1] else 1
    chosen.detail["looks"] = {name: {"status": j.status, "reason": j.reason, "estimate": j.estimate,
                                     "ci_low": j.ci_low, "ci_high": j.ci_high,
                                     "alpha": j.detail.get("alpha"), "n": j.n} for name, j in looks}
    chosen.method = f"{method}_replays"
    return chosen


# --- concentrated damage -----------------------------------------------------------------------


def judge_broken(
    diffs: Samples,
    *,
    direction: Direction,
    drop: float,
    effect_threshold: float,
    null_broken: int,
    null_items: int,
    alpha: float = 0.01,
    min_items: int = 30,
    item_ids: Sequence[Any] | None = None,
    top: int = 20,
    metric: str = "",
) -> Judgement:
    """How many items broke (a harmful per-item change larger than ``drop``) against how many
    break in the null: ``null_broken`` of ``null_items`` (FP16-vs-FP16 replays, or healthy FP8
    history). The share of broken items is judged like a rate (Newcombe interval of the
    difference of the two shares): fail when the whole interval lies beyond
    ``effect_threshold`` (share points: 0.02 = 2 % of the set broke more than in the null).
    Sensitive to "6 % of prompts destroyed" when the mean barely moves. ``detail['broken']``
    ranks the broken items, worst first (ids from ``item_ids`` when given, else positions)."""
    sign = _check_direction(direction)
    arr = np.asarray(diffs, dtype=float).ravel()
    ok = np.isfinite(arr)
    n = int(ok.sum())
    harm = np.where(ok, sign * arr, -np.inf)
    broken = np.flatnonzero(harm > drop)
    order = broken[np.argsort(-harm[broken], kind="stable")]
    ids = list(item_ids) if item_ids is not None and len(item_ids) == arr.size else None
    ranked = [{"item": ids[i] if ids else int(i), "harm": float(harm[i])} for i in order[:top]]
    j = judge_rate(int(broken.size), n, int(null_broken), int(null_items), effect_threshold=effect_threshold,
                   alpha=alpha, min_samples=min_items, metric=metric)
    j.method = "broken_items"
    if j.status not in ("inconclusive", "error"):
        # the decision is exact (a score interval on a handful of broken items is too optimistic
        # for a 1e-4 target). With no tolerated effect: Fisher's exact test, one-sided - given
        # the broken items of the replay and of the null together, the chance that the replay
        # holds this many of them. With an effect: the count against the null share's upper
        # 1 - alpha/2 bound (Wilson) plus the effect, binomial tail at alpha / 2.
        if effect_threshold <= 0:
            p0 = null_broken / max(null_items, 1)
            tail = st.hypergeom_sf(int(broken.size), null_items + n, null_broken + int(broken.size), n)
            level = alpha
        else:
            _, p0_hi = st.wilson(null_broken, max(null_items, 1), st.z_quantile(1 - alpha / 2))
            p0 = float(p0_hi)
            tail = st.binom_sf(int(broken.size), n, min(p0 + effect_threshold, 1.0))
            level = alpha / 2
        j.p_value = tail
        j.detail["null_share_upper"] = p0
        j.detail["test"] = "fisher_exact" if effect_threshold <= 0 else "binomial_at_null_upper"
        if tail <= level:
            j.status, j.reason = "fail", st.REASONS["fail"]
        else:
            j.status, j.reason = "pass", st.REASONS["pass"]
    j.detail.update({"broken": ranked, "broken_count": int(broken.size), "null_broken": int(null_broken),
                     "null_items": int(null_items), "drop": drop})
    if j.status != "inconclusive" and j.status != "error":
        j.message = (f"{metric}: {j.status} ({j.reason}); {broken.size}/{n} items broke by > {drop:g} vs "
                     f"{null_broken}/{null_items} in the null; share difference {j.estimate:+.3f} "
                     f"[{j.ci_low:+.3f}, {j.ci_high:+.3f}], "
                     + (f"Fisher exact p={j.p_value:.2g}" if j.detail.get("test") == "fisher_exact" else
                        f"binomial tail p={j.p_value:.2g} at null share {j.detail['null_share_upper']:.3f} + "
                        f"{effect_threshold:g}"))
    return j


# --- unpaired ----------------------------------------------------------------------------------


def _aligned(cand: Histogram, base: Histogram) -> tuple[np.ndarray, np.ndarray, int]:
    keys = [int(k) for k, v in cand.items() if v] + [int(k) for k, v in base.items() if v]
    lo, hi = min(keys), max(keys)
    if hi - lo + 1 > _MAX_BINS:
        raise ValueError(f"histogram spans {hi - lo + 1} buckets (> {_MAX_BINS})")
    cx = np.zeros(hi - lo + 1)
    cy = np.zeros(hi - lo + 1)
    for k, v in cand.items():
        cx[int(k) - lo] += v
    for k, v in base.items():
        cy[int(k) - lo] += v
    if (cx < 0).any() or (cy < 0).any():
        raise ValueError("negative bucket count")
    return cx, cy, lo


def _log_hist(values: np.ndarray, gamma: float, lo_index: int, size: int) -> np.ndarray:
    idx = np.ceil(np.log(values) / math.log(gamma)).astype(np.int64) - lo_index
    return np.bincount(idx, minlength=size).astype(float)


def judge_unpaired(
    candidate: Samples | Histogram,
    baseline: Samples | Histogram,
    *,
    direction: Direction = "lower_is_better",
    effect_threshold: float = 0.10,
    marginal_threshold: float | None = None,
    alpha: float = 0.01,
    min_samples: int = 50,
    max_ci_width: float | None = None,
    gamma: float | None = None,
    metric: str = "",
) -> Judgement:
    """Judge two independent samples of a positive metric (latency) by their ratio.

    Inputs are raw samples, or histograms ``{bucket_index: count}`` of a log-bucketed sketch
    where bucket ``i`` holds values in ``(gamma**(i-1), gamma**i]`` (``watchdog/sketch.py``;
    pass ``gamma``; put a zero bucket, if any, at an index below all others). The effect is the
    Hodges-Lehmann shift of log values = the typical candidate/baseline ratio; ``estimate`` is
    that ratio - 1. ``effect_threshold`` and ``marginal_threshold`` are relative (0.10 = 10 %
    worse); ``max_ci_width`` is in log-ratio units (about relative). ``detail`` carries U, the
    probability of superiority P(candidate > baseline) and the ratio of medians."""
    sign = _check_direction(direction)
    method = "mann_whitney"
    if effect_threshold < 0 or (sign < 0 and effect_threshold >= 1):
        return _error(metric, method, "effect_threshold out of range", effect_threshold)
    is_hist = isinstance(candidate, Mapping) or isinstance(baseline, Mapping)
    try:
        if is_hist:
            if not (isinstance(candidate, Mapping) and isinstance(baseline, Mapping)):
                raise ValueError("pass two histograms or two sample lists")
            if gamma is None or gamma <= 1:
                raise ValueError("histograms need gamma > 1")
            n1, n2 = int(sum(candidate.values())), int(sum(baseline.values()))
            if min(n1, n2) < max(min_samples, 1):
                return _inconclusive(metric, method, "too_few_items", f"n={n1}/{n2} < {min_samples}",
                                     min(n1, n2), effect_threshold)
            cx, cy, lo_index = _aligned(candidate, baseline)
            u1, p, sup = st.mann_whitney_counts(cx, cy)
            shift, s_lo, s_hi = st.shift_ci_counts(cx, cy, alpha)
            log_g = math.log(gamma)
            shift, s_lo, s_hi = shift * log_g, s_lo * log_g, s_hi * log_g
            med_ratio = math.exp((_hist_median(cx) - _hist_median(cy)) * log_g)
        else:
            x = np.asarray(candidate, dtype=float).ravel()
            y = np.asarray(baseline, dtype=float).ravel()
            x, y = x[np.isfinite(x)], y[np.isfinite(y)]
            n1, n2 = int(x.size), int(y.size)
            if min(n1, n2) < max(min_samples, 1):
                return _inconclusive(metric, method, "too_few_items", f"n={n1}/{n2} < {min_samples}",
                                     min(n1, n2), effect_threshold)
            if (x <= 0).any() or (y <= 0).any():
                raise ValueError("samples must be > 0 (the effect is a ratio)")
            u1, p, sup = st.mann_whitney(x, y)
            lx, ly = np.log(x), np.log(y)
            if n1 * n2 <= _MAX_PAIRS:
                shift, s_lo, s_hi = st.shift_ci_samples(lx, ly, alpha)
            else:
                lo_i = int(math.ceil(min(lx.min(), ly.min()) / math.log(_FINE_GAMMA)))
                size = int(math.ceil(max(lx.max(), ly.max()) / math.log(_FINE_GAMMA))) - lo_i + 1
                cx = _log_hist(x, _FINE_GAMMA, lo_i, size)
                cy = _log_hist(y, _FINE_GAMMA, lo_i, size)
                b, b_lo, b_hi = st.shift_ci_counts(cx, cy, alpha)
                g = math.log(_FINE_GAMMA)
                shift, s_lo, s_hi = b * g, b_lo * g, b_hi * g
            med_ratio = float(np.median(x) / np.median(y))
    except ValueError as exc:
        return _error(metric, method, str(exc), effect_threshold)
    n = min(n1, n2)
    if sign > 0:
        harm_lo, harm_hi = s_lo, s_hi
        h_thr = math.log1p(effect_threshold)
        h_marg = None if marginal_threshold is None else math.log1p(marginal_threshold)
    else:
        harm_lo, harm_hi = -s_hi, -s_lo
        h_thr = -math.log1p(-effect_threshold)
        h_marg = None if marginal_threshold is None else -math.log1p(-marginal_threshold)
    status, reason = _verdict(metric, method, harm_lo, harm_hi, n, effect_threshold=effect_threshold,
                              harm_threshold=h_thr, harm_marginal=h_marg, min_n=min_samples,
                              max_ci_width=max_ci_width)
    est, lo, hi = math.expm1(shift), math.expm1(s_lo), math.expm1(s_hi)
    return Judgement(
        metric=metric, status=status, reason=reason,
        message=_message(metric, status, reason, est * 100, lo * 100, hi * 100, n, effect_threshold * 100, "%"),
        estimate=est, ci_low=lo, ci_high=hi, p_value=p, n=n, effect_threshold=effect_threshold,
        method=method,
        detail={"u": u1, "n_candidate": n1, "n_baseline": n2, "prob_superiority": sup,
                "median_ratio": med_ratio, "log_shift": shift, "alpha": alpha, "direction": direction,
                "binned": is_hist},
    )


def _hist_median(c: np.ndarray) -> float:
    cum = np.cumsum(c)
    return float(np.searchsorted(cum, cum[-1] / 2.0))


# --- rates -------------------------------------------------------------------------------------


def judge_rate(
    candidate_errors: int,
    candidate_n: int,
    baseline_errors: int,
    baseline_n: int,
    *,
    effect_threshold: float = 0.005,
    marginal_threshold: float | None = None,
    alpha: float = 0.01,
    min_samples: int = 100,
    max_ci_width: float | None = None,
    metric: str = "error_rate",
) -> Judgement:
    """Judge an error/timeout rate (lower is better): difference of proportions, Newcombe's hybrid
    score interval, pooled z-test p-value. ``effect_threshold`` is absolute (0.005 = 0.5 points)."""
    method = "newcombe"
    vals = (candidate_errors, candidate_n, baseline_errors, baseline_n)
    if any(v is None or not math.isfinite(v) or v < 0 for v in vals):
        return _error(metric, method, "counts must be finite and >= 0", effect_threshold)
    if candidate_errors > candidate_n or baseline_errors > baseline_n:
        return _error(metric, method, "more errors than requests", effect_threshold)
    n = int(min(candidate_n, baseline_n))
    if n < max(min_samples, 1):
        return _inconclusive(metric, method, "too_few_items", f"n={candidate_n}/{baseline_n} < {min_samples}",
                             n, effect_threshold)
    d, lo, hi, p = (float(v) for v in st.rate_diff_ci(candidate_errors, candidate_n, baseline_errors,
                                                        baseline_n, alpha))
    status, reason = _verdict(metric, method, lo, hi, n, effect_threshold=effect_threshold,
                              harm_threshold=effect_threshold, harm_marginal=marginal_threshold,
                              min_n=min_samples, max_ci_width=max_ci_width)
    return Judgement(
        metric=metric, status=status, reason=reason,
        message=_message(metric, status, reason, d * 100, lo * 100, hi * 100, n, effect_threshold * 100, " pts"),
        estimate=d, ci_low=lo, ci_high=hi, p_value=p, n=n, effect_threshold=effect_threshold, method=method,
        detail={"candidate_rate": candidate_errors / candidate_n, "baseline_rate": baseline_errors / baseline_n,
                "alpha": alpha},
    )


# --- combining metrics -------------------------------------------------------------------------


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


# --- cause-aware inhibition --------------------------------------------------------------------

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
    sign = _check_direction(direction)
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
