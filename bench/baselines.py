"""Baseline rollback deciders the judge is benchmarked against (vectorised over simulated runs).

* Flagger-style threshold counter. Each check compares one window statistic with a fixed
  threshold; a failed check increments ``failedChecks``; the canary is rolled back when
  ``failedChecks >= analysis.threshold``. In Flagger (pkg/controller/scheduler.go) the counter is
  *not* reset by a successful check: it is reset only when a new analysis starts (new revision).
  For an always-on monitor we model one analysis as ``iterations`` consecutive checks (Flagger
  promotes after its iterations/steps and the next analysis starts from zero).
  ``reset_on_success=True`` gives the Argo-like "consecutive failures" variant. Flagger itself
  rolls back on the tick *after* the threshold is reached; we count the rollback at the window
  that reached it (optimistic for Flagger).
* Kayenta-style judge (Netflix ACA judge): per metric, an unpaired Mann-Whitney comparison of
  the canary and baseline data points at 98 % confidence; a metric is High/Low when the whole
  interval of the Hodges-Lehmann shift lies outside a tolerance band of +-0.25 x |estimate| AND
  the effect size (mean ratio) passes the allowance (``allowedIncrease``/``allowedDecrease``);
  fewer than ``min_points`` (50) points is Nodata. Metrics are scored into a weighted canary
  score (percentage of passing metrics); score < marginal (75, Spinnaker's default; pass 95)
  fails the canary at once, which here means roll back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

KAYENTA_CONFIDENCE = 0.98
KAYENTA_TOLERANCE = 0.25
KAYENTA_MIN_POINTS = 50
KAYENTA_MARGINAL = 75.0
KAYENTA_PASS = 95.0


@dataclass(frozen=True)
class FlaggerConfig:
    failure_threshold: int = 2
    iterations: int = 10
    reset_on_success: bool = False


def flagger_rollbacks(failed: np.ndarray, cfg: FlaggerConfig, *, restart: bool = True, start: int = 0
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Run the counter over ``failed`` (runs x windows, bool: did the check fail).

    Returns (number of rollbacks per run, window index of the first rollback at or after
    ``start``, or -1). With ``restart`` the counter starts afresh after a rollback (the next
    revision is analysed)."""
    runs, windows = failed.shape
    count = np.zeros(runs, dtype=np.int64)
    pos = np.zeros(runs, dtype=np.int64)
    rollbacks = np.zeros(runs, dtype=np.int64)
    first = np.full(runs, -1, dtype=np.int64)
    for w in range(windows):
        f = failed[:, w]
        count = count + f
        if cfg.reset_on_success:
            count = np.where(f, count, 0)
        pos += 1
        hit = count >= cfg.failure_threshold
        rollbacks += hit
        if w >= start:
            first = np.where(hit & (first < 0), w, first)
        done = hit | (pos >= cfg.iterations)
        count = np.where(done, 0, count)
        pos = np.where(done, 0, pos)
        if not restart:
            count = np.where(first >= 0, 0, count)
    return rollbacks, first


def _k(n1: int, n2: int, z: float) -> int:
    m = n1 * n2
    k = int(math.floor(m / 2 - z * math.sqrt(m * (n1 + n2 + 1) / 12.0)))
    return min(max(k, 0), m - 1)


def _pairwise_shift_ci(x: np.ndarray, y: np.ndarray, conf: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise Hodges-Lehmann shift of x - y and its Mann-Whitney interval; NaNs are removed
    per row by giving them infinite differences that are excluded from the order statistics."""
    rows = x.shape[0]
    est = np.full(rows, np.nan)
    lo = np.full(rows, np.nan)
    hi = np.full(rows, np.nan)
    z = NormalDist().inv_cdf(0.5 + conf / 2)
    nx = np.isfinite(x).sum(axis=1)
    ny = np.isfinite(y).sum(axis=1)
    chunk = max(1, 4_000_000 // (x.shape[1] * y.shape[1]))
    for s in range(0, rows, chunk):
        e = min(s + chunk, rows)
        d = (x[s:e, :, None] - y[s:e, None, :]).reshape(e - s, -1)
        d = np.where(np.isfinite(d), d, np.inf)
        n1s, n2s = nx[s:e], ny[s:e]
        uniform = bool((n1s == n1s[0]).all() and (n2s == n2s[0]).all())
        if uniform:
            m = int(n1s[0] * n2s[0])
            if m == 0:
                continue
            k = _k(int(n1s[0]), int(n2s[0]), z)
            d = np.partition(d, sorted({k, (m - 1) // 2, m // 2, m - 1 - k}), axis=1)
        else:
            d.sort(axis=1)
        for r in range(e - s):
            n1, n2 = int(n1s[r]), int(n2s[r])
            m = n1 * n2
            if m == 0:
                continue
            k = _k(n1, n2, z)
            row = d[r]
            est[s + r] = (row[(m - 1) // 2] + row[m // 2]) / 2
            lo[s + r] = row[k]
            hi[s + r] = row[m - 1 - k]
    return est, lo, hi


def pairwise_shift_ci_screened(x: np.ndarray, y: np.ndarray, conf: float, direction: str
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_pairwise_shift_ci`` for the rows whose interval can be significant in ``direction``;
    the other rows get est = lo = hi = 0 (not significant; the exact values are not needed for
    the Kayenta classification, which only asks whether the interval clears the band)."""
    cand = _excludes_zero(x, y, conf, direction)
    est = np.zeros(x.shape[0])
    lo = np.zeros(x.shape[0])
    hi = np.zeros(x.shape[0])
    idx = np.flatnonzero(cand)
    if idx.size:
        est[idx], lo[idx], hi[idx] = _pairwise_shift_ci(x[idx], y[idx], conf)
    return est, lo, hi


def _excludes_zero(x: np.ndarray, y: np.ndarray, conf: float, direction: str) -> np.ndarray:
    """Exact, cheap pre-test per row: does the Mann-Whitney interval of x - y lie wholly above 0
    ("increase") or wholly below 0 ("decrease")? Counts the pairs x_i > y_j (x_i < y_j) with a
    binary search of the sorted x in the sorted y instead of forming all n1 * n2 differences;
    NaNs are left out, as ``_pairwise_shift_ci`` does. Since the tolerance band is >= 0, a row
    where this is False can never be High/Low, so the O(n1 n2) interval is only needed for the
    others."""
    xs = np.sort(x, axis=1)  # NaNs sort last
    ys = np.sort(y, axis=1)
    nx = np.isfinite(x).sum(axis=1)
    ny = np.isfinite(y).sum(axis=1)
    m = nx * ny
    z = NormalDist().inv_cdf(0.5 + conf / 2)
    k = np.floor(m / 2 - z * np.sqrt(m * (nx + ny + 1) / 12.0))
    k = np.clip(k, 0, np.maximum(m - 1, 0))
    count = np.zeros(x.shape[0])
    for r in range(x.shape[0]):
        yr, xr = ys[r, : ny[r]], xs[r, : nx[r]]
        if direction == "increase":
            # lo = d_(k) > 0  <=>  #(x_i > y_j) >= m - k
            count[r] = np.searchsorted(yr, xr, side="left").sum()
        else:
            # hi = d_(m-1-k) < 0  <=>  #(x_i < y_j) >= m - k
            count[r] = (ny[r] - np.searchsorted(yr, xr, side="right")).sum()
    return (m > 0) & (count >= m - k)


def kayenta_classify(
    canary: np.ndarray,
    baseline: np.ndarray,
    *,
    direction: str,
    allowed_ratio: float,
    min_points: int = KAYENTA_MIN_POINTS,
) -> np.ndarray:
    """Per row: 1 when the metric is classified as a harmful High/Low, 0 for Pass, -1 Nodata.

    ``direction`` "increase" (harm is higher canary values, allowance = allowedIncrease >= 1) or
    "decrease" (allowance = allowedDecrease <= 1). Effect size is the mean ratio canary/baseline."""
    return kayenta_classify_many(canary, baseline, direction=direction, allowed_ratios=[allowed_ratio],
                                 min_points=min_points)[allowed_ratio]


def kayenta_classify_many(
    canary: np.ndarray,
    baseline: np.ndarray,
    *,
    direction: str,
    allowed_ratios: list[float],
    min_points: int = KAYENTA_MIN_POINTS,
) -> dict[float, np.ndarray]:
    """``kayenta_classify`` for several allowances; the interval is computed once."""
    est, lo, hi = pairwise_shift_ci_screened(canary, baseline, KAYENTA_CONFIDENCE, direction)
    band = KAYENTA_TOLERANCE * np.abs(est)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.nanmean(canary, axis=1) / np.nanmean(baseline, axis=1)
    sig = lo > band if direction == "increase" else hi < -band
    points = np.minimum(np.isfinite(canary).sum(axis=1), np.isfinite(baseline).sum(axis=1))
    out = {}
    for a in allowed_ratios:
        if direction == "increase":
            effect_ok = np.where(np.isfinite(ratio), ratio >= a, True)
        else:
            effect_ok = np.where(np.isfinite(ratio), ratio <= a, True)
        cls = (sig & effect_ok).astype(np.int8)
        cls[points < min_points] = -1
        out[a] = cls
    return out


def kayenta_score(classes: list[np.ndarray], weights: list[float] | None = None, *,
                  nodata_fails: bool = False) -> np.ndarray:
    """Canary score (0-100) from per-metric classes (one group per metric, equal weights unless
    given). Nodata metrics are excluded. Kayenta scores 0 when half or more metrics are Nodata;
    the benchmark passes ``nodata_fails=False`` (a concession: low-traffic windows would
    otherwise roll back) so Nodata neither passes nor fails."""
    c = np.stack(classes)  # metrics x runs
    w = np.ones(c.shape[0]) if weights is None else np.asarray(weights, dtype=float)
    has = c >= 0
    passed = (c == 0) * w[:, None]
    total = has * w[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        score = np.where(total.sum(axis=0) > 0, 100.0 * passed.sum(axis=0) / total.sum(axis=0), 100.0)
    nodata_share = (~has).mean(axis=0)
    if nodata_fails:
        return np.where(nodata_share >= 0.5, 0.0, score)
    return np.where(nodata_share >= 1.0, 100.0, score)


def kayenta_rollback(score: np.ndarray, marginal: float = KAYENTA_MARGINAL) -> np.ndarray:
    """A Kayenta interval below the marginal threshold fails the canary immediately."""
    return score < marginal
