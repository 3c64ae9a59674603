"""Latencies and rates of one window: candidate and baseline samples of different requests.

``judge_unpaired``: raw samples or log-bucket histograms (Mann-Whitney U, Hodges-Lehmann ratio of
medians, probability of superiority); ``judge_rate``: error / timeout rates (Newcombe score
interval of the difference). Nothing here does I/O; docs/JUDGE.md explains the statistics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from watchdog.policy.judge import stats as st
from watchdog.policy.judge.verdict import (
    Direction,
    Histogram,
    Judgement,
    Samples,
    check_direction,
    error,
    inconclusive,
    message,
    verdict,
)

log = logging.getLogger(__name__)

#: above this many pairwise differences, raw samples are binned for the Hodges-Lehmann interval
_MAX_PAIRS = 4_000_000

_FINE_GAMMA = 1.002

_MAX_BINS = 50_000


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
    where bucket ``i`` holds values in ``(gamma**(i-1), gamma**i]`` (``watchdog/windows/sketch.py``;
    pass ``gamma``; put a zero bucket, if any, at an index below all others). The effect is the
    Hodges-Lehmann shift of log values = the typical candidate/baseline ratio; ``estimate`` is
    that ratio - 1. ``effect_threshold`` and ``marginal_threshold`` are relative (0.10 = 10 %
    worse); ``max_ci_width`` is in log-ratio units (about relative). ``detail`` carries U, the
    probability of superiority P(candidate > baseline) and the ratio of medians."""
    sign = check_direction(direction)
    method = "mann_whitney"
    if effect_threshold < 0 or (sign < 0 and effect_threshold >= 1):
        return error(metric, method, "effect_threshold out of range", effect_threshold)
    is_hist = isinstance(candidate, Mapping) or isinstance(baseline, Mapping)
    try:
        if is_hist:
            hc, hb, g = _histograms(candidate, baseline, gamma)
            n1, n2 = int(sum(hc.values())), int(sum(hb.values()))
            if min(n1, n2) < max(min_samples, 1):
                return inconclusive(metric, method, "too_few_items", f"n={n1}/{n2} < {min_samples}",
                                     min(n1, n2), effect_threshold)
            r = _hist_shift(hc, hb, g, alpha)
        else:
            x = np.asarray(candidate, dtype=float).ravel()
            y = np.asarray(baseline, dtype=float).ravel()
            x, y = x[np.isfinite(x)], y[np.isfinite(y)]
            n1, n2 = int(x.size), int(y.size)
            if min(n1, n2) < max(min_samples, 1):
                return inconclusive(metric, method, "too_few_items", f"n={n1}/{n2} < {min_samples}",
                                     min(n1, n2), effect_threshold)
            r = _sample_shift(x, y, alpha)
    except ValueError as exc:
        return error(metric, method, str(exc), effect_threshold)
    n = min(n1, n2)
    harm_lo, harm_hi, h_thr, h_marg = _harm_interval(sign, r.lo, r.hi, effect_threshold, marginal_threshold)
    status, reason = verdict(metric, method, harm_lo, harm_hi, n, effect_threshold=effect_threshold,
                              harm_threshold=h_thr, harm_marginal=h_marg, min_n=min_samples,
                              max_ci_width=max_ci_width)
    est, lo, hi = math.expm1(r.shift), math.expm1(r.lo), math.expm1(r.hi)
    return Judgement(
        metric=metric, status=status, reason=reason,
        message=message(metric, status, reason, est * 100, lo * 100, hi * 100, n, effect_threshold * 100, "%"),
        estimate=est, ci_low=lo, ci_high=hi, p_value=r.p, n=n, effect_threshold=effect_threshold,
        method=method,
        detail={"u": r.u, "n_candidate": n1, "n_baseline": n2, "prob_superiority": r.superiority,
                "median_ratio": r.median_ratio, "log_shift": r.shift, "alpha": alpha, "direction": direction,
                "binned": is_hist},
    )


class _Shift(NamedTuple):
    """Mann-Whitney U, its p-value and probability of superiority, the Hodges-Lehmann shift of
    log values with its interval, and the ratio of medians, of one candidate/baseline pair."""

    u: float
    p: float
    superiority: float
    shift: float
    lo: float
    hi: float
    median_ratio: float


def _histograms(candidate: Samples | Histogram, baseline: Samples | Histogram,
                gamma: float | None) -> tuple[Histogram, Histogram, float]:
    """Both inputs as histograms with their gamma; ValueError when they are not two histograms
    or gamma is missing or not above 1."""
    if not (isinstance(candidate, Mapping) and isinstance(baseline, Mapping)):
        raise ValueError("pass two histograms or two sample lists")
    if gamma is None or gamma <= 1:
        raise ValueError("histograms need gamma > 1")
    return candidate, baseline, gamma


def _hist_shift(candidate: Histogram, baseline: Histogram, gamma: float, alpha: float) -> _Shift:
    """``_Shift`` of two log-bucket histograms (bucket ``i`` holds ``(gamma**(i-1), gamma**i]``)."""
    cx, cy, lo_index = _aligned(candidate, baseline)
    u1, p, sup = st.mann_whitney_counts(cx, cy)
    shift, s_lo, s_hi = st.shift_ci_counts(cx, cy, alpha)
    log_g = math.log(gamma)
    shift, s_lo, s_hi = shift * log_g, s_lo * log_g, s_hi * log_g
    med_ratio = math.exp((_hist_median(cx) - _hist_median(cy)) * log_g)
    return _Shift(u1, p, sup, shift, s_lo, s_hi, med_ratio)


def _sample_shift(x: np.ndarray, y: np.ndarray, alpha: float) -> _Shift:
    """``_Shift`` of two finite positive samples; above ``_MAX_PAIRS`` pairwise differences the
    Hodges-Lehmann interval is taken on a fine log binning (gamma ``_FINE_GAMMA``)."""
    n1, n2 = int(x.size), int(y.size)
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
    return _Shift(u1, p, sup, shift, s_lo, s_hi, med_ratio)


def _harm_interval(sign: int, s_lo: float, s_hi: float, effect_threshold: float,
                   marginal_threshold: float | None) -> tuple[float, float, float, float | None]:
    """The log-shift interval and the thresholds turned into harm units (positive = worse):
    (harm low, harm high, harm threshold, harm marginal threshold or None)."""
    if sign > 0:
        harm_lo, harm_hi = s_lo, s_hi
        h_thr = math.log1p(effect_threshold)
        h_marg = None if marginal_threshold is None else math.log1p(marginal_threshold)
    else:
        harm_lo, harm_hi = -s_hi, -s_lo
        h_thr = -math.log1p(-effect_threshold)
        h_marg = None if marginal_threshold is None else -math.log1p(-marginal_threshold)
    return harm_lo, harm_hi, h_thr, h_marg

def _hist_median(c: np.ndarray) -> float:
    cum = np.cumsum(c)
    return float(np.searchsorted(cum, cum[-1] / 2.0))

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
        return error(metric, method, "counts must be finite and >= 0", effect_threshold)
    if candidate_errors > candidate_n or baseline_errors > baseline_n:
        return error(metric, method, "more errors than requests", effect_threshold)
    n = int(min(candidate_n, baseline_n))
    if n < max(min_samples, 1):
        return inconclusive(metric, method, "too_few_items", f"n={candidate_n}/{baseline_n} < {min_samples}",
                             n, effect_threshold)
    d, lo, hi, p = st.rate_diff_ci_one(candidate_errors, candidate_n, baseline_errors, baseline_n, alpha)
    status, reason = verdict(metric, method, lo, hi, n, effect_threshold=effect_threshold,
                              harm_threshold=effect_threshold, harm_marginal=marginal_threshold,
                              min_n=min_samples, max_ci_width=max_ci_width)
    return Judgement(
        metric=metric, status=status, reason=reason,
        message=message(metric, status, reason, d * 100, lo * 100, hi * 100, n, effect_threshold * 100, " pts"),
        estimate=d, ci_low=lo, ci_high=hi, p_value=p, n=n, effect_threshold=effect_threshold, method=method,
        detail={"candidate_rate": candidate_errors / candidate_n, "baseline_rate": baseline_errors / baseline_n,
                "alpha": alpha},
    )
