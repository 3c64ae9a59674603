"""Numerical core of the statistical judge: rank tests, intervals and the verdict rule.

Pure numpy (no scipy: the daemon must stay light). Most functions take 2-D arrays (one row per
independent comparison) so that the benchmark in ``bench/decisions.py`` runs the very same code
vectorised over thousands of simulated runs; ``watchdog/policy/judge/paired.py`` wraps them for one comparison.

Conventions: every interval here is a two-sided ``1 - alpha`` interval. "Harm" is a drift
oriented so that positive means worse (the caller flips the sign for higher-is-better metrics).
"""

from __future__ import annotations

import functools
import logging
import math
from statistics import NormalDist

import numpy as np

log = logging.getLogger(__name__)

_erfc = np.frompyfunc(math.erfc, 1, 1)

# Verdict codes used by the vectorised rule (``classify``); ``judge.py`` maps them to strings.
PASS, MARGINAL, FAIL, INCONCLUSIVE = 0, 1, 2, 3
STATUS_NAMES = ("pass", "marginal", "fail", "inconclusive")
REASONS = {
    "pass": "within_effect_threshold",
    "fail": "significant_regression",
    "significant": "significant_within_threshold",
    "straddles": "straddles_threshold",
    "wide": "ci_too_wide",
    "few": "too_few_items",
}


@functools.lru_cache(maxsize=1024)  # called with a few per-rule levels, once per rule and window
def z_quantile(p: float) -> float:
    """Standard normal quantile."""
    return NormalDist().inv_cdf(p)


def normal_sf(z: np.ndarray | float) -> np.ndarray:
    """Upper tail of the standard normal, elementwise."""
    z = np.asarray(z, dtype=float)
    return np.asarray(_erfc(z / math.sqrt(2.0)), dtype=float) * 0.5


def two_sided_p(z: np.ndarray | float) -> np.ndarray:
    return np.minimum(1.0, 2.0 * normal_sf(np.abs(np.asarray(z, dtype=float))))


# --- ranks -----------------------------------------------------------------------------------


def rank_with_ties(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Average ranks (1-based) of a 1-D array and the sizes of its tie groups."""
    n = a.size
    order = np.argsort(a, kind="mergesort")
    sorted_a = a[order]
    starts = np.flatnonzero(np.r_[True, sorted_a[1:] != sorted_a[:-1]])
    sizes = np.diff(np.r_[starts, n])
    # the average rank of a tie group that starts at position s (0-based) with size t
    group_rank = starts + (sizes + 1) / 2.0
    ranks = np.empty(n, dtype=float)
    ranks[order] = np.repeat(group_rank, sizes)
    return ranks, sizes


# --- paired: Wilcoxon signed-rank and bootstrap ---------------------------------------------


def signed_rank_test(diffs: np.ndarray, *, continuity: bool = False) -> tuple[float, float, int]:
    """Wilcoxon signed-rank test, normal approximation, zeros dropped ("wilcox" zero method)
    and the variance corrected for ties. Returns (z, two-sided p, number of non-zero diffs)."""
    d = diffs[diffs != 0.0]
    n = d.size
    if n == 0:
        return 0.0, 1.0, 0
    ranks, ties = rank_with_ties(np.abs(d))
    t_plus = float(ranks[d > 0].sum())
    mean = n * (n + 1) / 4.0
    var = n * (n + 1) * (2 * n + 1) / 24.0 - float((ties**3 - ties).sum()) / 48.0
    if var <= 0:
        return 0.0, 1.0, n
    dev = t_plus - mean
    if continuity and dev != 0:
        dev -= 0.5 * math.copysign(1.0, dev)
    z = dev / math.sqrt(var)
    return z, float(two_sided_p(z)), n


def walsh_ci(diffs: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """Hodges-Lehmann estimate (median of Walsh averages) and its distribution-free interval
    from the signed-rank distribution (normal approximation of the order-statistic index)."""
    d = np.asarray(diffs, dtype=float)
    n = d.size
    i, j = np.triu_indices(n)
    walsh = np.sort((d[i] + d[j]) / 2.0)
    m = walsh.size
    z = z_quantile(1 - alpha / 2)
    k = int(math.floor(n * (n + 1) / 4.0 - z * math.sqrt(n * (n + 1) * (2 * n + 1) / 24.0)))
    k = min(max(k, 0), m - 1)
    return float(np.median(walsh)), float(walsh[k]), float(walsh[m - 1 - k])


def bootstrap_weights(n: int, n_boot: int, seed: int | None) -> np.ndarray:
    """Multinomial resampling counts (n_boot x n) / n: row b gives the weights of resample b."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(float) / n


def bootstrap_mean_ci(
    diffs: np.ndarray, *, alpha: float, n_boot: int = 2000, seed: int | None = 0, chunk: int = 2048
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of the mean for each row of ``diffs`` (runs x items).

    Vectorised as one matrix product per chunk of rows: resample means = rows @ weights.T.
    The same resampling plan (seeded) is used for every row, so results are deterministic.
    """
    x = np.atleast_2d(np.asarray(diffs, dtype=float))
    est = x.mean(axis=1)
    w = bootstrap_weights(x.shape[1], n_boot, seed)
    lo = np.empty(x.shape[0])
    hi = np.empty(x.shape[0])
    q = [alpha / 2, 1 - alpha / 2]
    for s in range(0, x.shape[0], chunk):
        means = x[s : s + chunk] @ w.T
        lo[s : s + chunk], hi[s : s + chunk] = np.quantile(means, q, axis=1)
    return est, lo, hi


def bootstrap_mean_quantiles(
    diffs: np.ndarray, qs: list[float], *, n_boot: int = 2000, seed: int | None = 0, chunk: int = 2048
) -> tuple[np.ndarray, np.ndarray]:
    """Mean of each row and the ``qs`` quantiles of its bootstrap distribution (rows x len(qs)).

    The same resampling plan as ``bootstrap_mean_ci`` (which is the special case
    ``qs = [alpha / 2, 1 - alpha / 2]``); several levels cost one pass."""
    x = np.atleast_2d(np.asarray(diffs, dtype=float))
    est = x.mean(axis=1)
    w = bootstrap_weights(x.shape[1], n_boot, seed)
    out = np.empty((x.shape[0], len(qs)))
    for s in range(0, x.shape[0], chunk):
        means = x[s : s + chunk] @ w.T
        out[s : s + chunk] = np.quantile(means, qs, axis=1).T
    return est, out


def t_quantile(p: float, df: float) -> float:
    """Student-t quantile (Cornish-Fisher expansion in 1/df around the normal quantile; error
    below 1e-3 for df >= 10 at p <= 0.9995, which is all the judge asks for)."""
    z = z_quantile(p)
    if not math.isfinite(df) or df > 1e7:
        return z
    nu = float(df)
    return (z + (z**3 + z) / (4 * nu) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3))


def t_mean_ci(
    diffs: np.ndarray, *, alpha: float, prior_jump: float = 0.5
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Studentised interval of the mean of each row (runs x items), with two pseudo-items at
    +/- ``prior_jump`` added to the variance (not to the mean).

    Golden differences are sparse: most items do not change and a few jump by a lot, so a
    replay that happens to contain no jump has a tiny sample variance and a plain t (or
    bootstrap) interval collapses around zero while the true mean is carried by the jumps it
    did not see. The two pseudo-items are a weak prior on the spread: they matter only when the
    sample spread is small (n = 200: s^2 gains 2 c^2 / (n + 1) = 0.0025 at c = 0.5), and they
    bring the harmful-tail error of the interval to or below nominal on the sparse, heavy-tailed
    and concentrated shapes of docs/JUDGE.md (tests/test_judge_coverage.py). Deterministic:
    no resampling, so one replay always gets the same verdict."""
    x = np.atleast_2d(np.asarray(diffs, dtype=float))
    n = x.shape[1]
    est = x.mean(axis=1)
    if n < 2:
        nan = np.full(x.shape[0], np.nan)
        return est, nan, nan
    s2 = x.var(axis=1, ddof=1)
    s2 = ((n - 1) * s2 + 2.0 * prior_jump * prior_jump) / (n + 1)
    half = t_quantile(1 - alpha / 2, n - 1) * np.sqrt(s2 / n)
    return est, est - half, est + half


def hist_quantile_ci(
    counts: np.ndarray, q: float, alpha: float
) -> tuple[float, float, float]:
    """Distribution-free interval of the ``q`` quantile from a histogram (counts per ordered
    bucket): the order statistics of ranks n q -/+ z sqrt(n q (1 - q)) (normal approximation to
    the binomial count below the quantile). Returns bucket positions (fractional: a rank inside
    a bucket is interpolated linearly) of (estimate, low, high)."""
    c = np.asarray(counts, dtype=float)
    n = float(c.sum())
    if n <= 0:
        return math.nan, math.nan, math.nan
    z = z_quantile(1 - alpha / 2)
    half = z * math.sqrt(n * q * (1 - q))
    cum = np.cumsum(c)

    def pos(rank: float) -> float:
        rank = min(max(rank, 0.5), n - 0.5)
        i = int(np.searchsorted(cum, rank))
        before = cum[i - 1] if i > 0 else 0.0
        return i - 1 + (rank - before) / c[i] if c[i] > 0 else float(i)

    return pos(n * q), pos(n * q - half - 1), pos(n * q + half + 1)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact (log-space sum; n up to a few thousand)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    first = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * lp + (n - k) * lq
    i = np.arange(k, n, dtype=float)
    # log term(i+1) - log term(i) = log((n - i) / (i + 1)) + log(p / q)
    logs = np.concatenate([[first], first + np.cumsum(np.log((n - i) / (i + 1)) + (lp - lq))])
    top = float(logs.max())
    return min(1.0, math.exp(top) * float(np.exp(logs - top).sum()))


def hypergeom_sf(k: int, total: int, marked: int, draws: int) -> float:
    """P(X >= k) for X ~ Hypergeometric: ``draws`` taken without replacement from ``total`` of
    which ``marked`` are marked (exact, log-space sum)."""
    lo, hi = max(0, draws - (total - marked)), min(draws, marked)
    if k <= lo:
        return 1.0
    if k > hi:
        return 0.0

    def lchoose(a: int, b: int) -> float:
        return math.lgamma(a + 1) - math.lgamma(b + 1) - math.lgamma(a - b + 1)

    i = np.arange(k, hi + 1)
    logs = np.array([lchoose(marked, int(x)) + lchoose(total - marked, draws - int(x)) for x in i])
    logs -= lchoose(total, draws)
    top = float(logs.max())
    return min(1.0, math.exp(top) * float(np.exp(logs - top).sum()))


def average_replays(replays: list[np.ndarray]) -> np.ndarray:
    """Per-item mean over replays of the same items (rows x items each); an item missing
    (NaN/inf) in one replay takes the mean of the others, NaN if missing everywhere."""
    stack = np.stack([np.where(np.isfinite(r), r, np.nan) for r in replays])
    ok = np.isfinite(stack)
    total = np.where(ok, stack, 0.0).sum(axis=0)
    count = ok.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


# --- unpaired: Mann-Whitney U -----------------------------------------------------------------


def mann_whitney(x: np.ndarray, y: np.ndarray, *, continuity: bool = True) -> tuple[float, float, float]:
    """Mann-Whitney U of ``x`` against ``y`` (normal approximation with tie correction).

    Returns (U of x, two-sided p, probability of superiority P(x > y) + P(x = y) / 2).
    """
    n1, n2 = x.size, y.size
    ranks, ties = rank_with_ties(np.concatenate([x, y]))
    u1 = float(ranks[:n1].sum()) - n1 * (n1 + 1) / 2.0
    return u1, _mw_p(u1, n1, n2, ties, continuity), u1 / (n1 * n2)


def _mw_p(u1: float, n1: int, n2: int, ties: np.ndarray, continuity: bool) -> float:
    n = n1 + n2
    mean = n1 * n2 / 2.0
    var = n1 * n2 / 12.0 * ((n + 1) - float((ties**3 - ties).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0
    dev = abs(u1 - mean)
    if continuity:
        dev = max(dev - 0.5, 0.0)
    return float(two_sided_p(dev / math.sqrt(var)))


def mann_whitney_counts(cx: np.ndarray, cy: np.ndarray, *, continuity: bool = True) -> tuple[float, float, float]:
    """Mann-Whitney U on binned data: ``cx``/``cy`` are counts over the same ordered bins.

    Values in one bin are treated as ties (exactly what a rank test on bucket values does)."""
    cx = np.asarray(cx, dtype=float)
    cy = np.asarray(cy, dtype=float)
    n1, n2 = int(cx.sum()), int(cy.sum())
    below_y = np.cumsum(cy) - cy
    u1 = float((cx * (below_y + cy / 2.0)).sum())
    t = cx + cy
    ties = t[t > 0]
    return u1, _mw_p(u1, n1, n2, ties, continuity), u1 / (n1 * n2)


def _order_stat_index(n1: int, n2: int, alpha: float) -> int:
    """0-based index k of the lower interval bound among the n1*n2 sorted pairwise differences."""
    z = z_quantile(1 - alpha / 2)
    k = int(math.floor(n1 * n2 / 2.0 - z * math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12.0)))
    return min(max(k, 0), n1 * n2 - 1)


def shift_ci_samples(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """Hodges-Lehmann shift (median of all x_i - y_j) with its Mann-Whitney interval."""
    d = (x[:, None] - y[None, :]).ravel()
    m = d.size
    k = _order_stat_index(x.size, y.size, alpha)
    part = np.partition(d, [k, (m - 1) // 2, m // 2, m - 1 - k])
    return float((part[(m - 1) // 2] + part[m // 2]) / 2.0), float(part[k]), float(part[m - 1 - k])


def shift_ci_counts(cx: np.ndarray, cy: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """Hodges-Lehmann shift and interval on binned data, in bin units.

    The pairwise-difference distribution of bin indices is the cross-correlation of the two
    count vectors, computed in O(bins^2) instead of O(n1 * n2)."""
    cx = np.asarray(cx, dtype=float)
    cy = np.asarray(cy, dtype=float)
    n1, n2 = int(cx.sum()), int(cy.sum())
    dist = np.convolve(cx, cy[::-1])  # index j <-> difference j - (len(cy) - 1)
    cum = np.rint(np.cumsum(dist))
    offset = cy.size - 1
    m = n1 * n2
    k = _order_stat_index(n1, n2, alpha)

    def order_stat(r: int) -> float:  # 0-based rank r
        return float(np.searchsorted(cum, r + 1 - 0.5) - offset)

    med = (order_stat((m - 1) // 2) + order_stat(m // 2)) / 2.0
    return med, order_stat(k), order_stat(m - 1 - k)


def shift_ci_counts_rows(cx: np.ndarray, cy: np.ndarray, alpha: float, *, chunk: int = 4096
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``shift_ci_counts`` for many rows at once (rows x bins, same bins in both arrays).

    The pairwise-difference distribution of every row is one batched FFT convolution (counts are
    integers, so rounding the FFT result is exact while n1 * n2 stays far below 2**52). Rows
    with an empty side give NaN."""
    cx = np.atleast_2d(np.asarray(cx, dtype=float))
    cy = np.atleast_2d(np.asarray(cy, dtype=float))
    used = np.flatnonzero((cx + cy).any(axis=0))
    if used.size:  # bins empty in every row change no difference count: trim them
        cx, cy = cx[:, used[0] : used[-1] + 1], cy[:, used[0] : used[-1] + 1]
    rows, bins = cx.shape
    n1, n2 = cx.sum(axis=1), cy.sum(axis=1)
    m = n1 * n2
    z = z_quantile(1 - alpha / 2)
    k = np.floor(m / 2.0 - z * np.sqrt(m * (n1 + n2 + 1) / 12.0))
    k = np.clip(k, 0, np.maximum(m - 1, 0))
    ranks = np.stack([k, np.floor((m - 1) / 2), np.floor(m / 2), m - 1 - k], axis=1)  # rows x 4
    size = 1 << int(math.ceil(math.log2(max(2 * bins - 1, 2))))
    offset = bins - 1
    out = np.full((rows, 4), np.nan)
    for s in range(0, rows, chunk):
        e = min(s + chunk, rows)
        fx = np.fft.rfft(cx[s:e], size, axis=1)
        fy = np.fft.rfft(cy[s:e, ::-1], size, axis=1)
        dist = np.rint(np.fft.irfft(fx * fy, size, axis=1)[:, : 2 * bins - 1])
        cum = np.cumsum(dist, axis=1)
        for c in range(4):
            # 0-based rank r sits at the first difference whose cumulative count reaches r + 1
            out[s:e, c] = (cum < ranks[s:e, c : c + 1] + 0.5).sum(axis=1) - offset
    empty = m <= 0
    out[empty] = np.nan
    return (out[:, 1] + out[:, 2]) / 2.0, out[:, 0], out[:, 3]


# --- rates --------------------------------------------------------------------------------------


def wilson(k: np.ndarray | float, n: np.ndarray | float, z: float) -> tuple[np.ndarray, np.ndarray]:
    k = np.asarray(k, dtype=float)
    n = np.asarray(n, dtype=float)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


def rate_diff_ci(
    k1: np.ndarray | float, n1: np.ndarray | float, k2: np.ndarray | float, n2: np.ndarray | float, alpha: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Difference p1 - p2 with Newcombe's hybrid score interval (from two Wilson intervals) and
    the pooled two-proportion z-test p-value. Returns (diff, low, high, p)."""
    z = z_quantile(1 - alpha / 2)
    k1, n1, k2, n2 = (np.asarray(v, dtype=float) for v in (k1, n1, k2, n2))
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1, z)
    l2, u2 = wilson(k2, n2, z)
    d = p1 - p2
    low = d - np.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    high = d + np.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    pool = (k1 + k2) / (n1 + n2)
    se = np.sqrt(pool * (1 - pool) * (1 / n1 + 1 / n2))
    with np.errstate(divide="ignore", invalid="ignore"):
        zs = np.where(se > 0, d / np.where(se > 0, se, 1.0), 0.0)
    return d, low, high, two_sided_p(zs)


def rate_diff_ci_one(k1: float, n1: float, k2: float, n2: float, alpha: float) -> tuple[float, float, float, float]:
    """``rate_diff_ci`` of one comparison in plain floats (the daemon judges one window at a
    time, where numpy's per-call overhead was most of the cost): the same operations in the same
    order, so the same bits (tests/test_judge_cost_paths.py). Falls back to ``rate_diff_ci`` where a
    square root would be of a negative number (numpy's NaN, not math's error)."""
    z = z_quantile(1 - alpha / 2)
    k1, n1, k2, n2 = float(k1), float(n1), float(k2), float(n2)
    try:
        p1, p2 = k1 / n1, k2 / n2
        l1, u1 = _wilson_one(k1, n1, z)
        l2, u2 = _wilson_one(k2, n2, z)
        d = p1 - p2
        # ``** 2``, not ``x * x``: on numpy scalars ``**`` is C pow, as on Python floats
        low = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
        high = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
        pool = (k1 + k2) / (n1 + n2)
        se = math.sqrt(pool * (1 - pool) * (1 / n1 + 1 / n2))
    except (ValueError, ZeroDivisionError):
        return tuple(float(v) for v in rate_diff_ci(k1, n1, k2, n2, alpha))  # type: ignore[return-value]
    zs = d / se if se > 0 else 0.0
    p_two = 2.0 * (math.erfc(abs(zs) / math.sqrt(2.0)) * 0.5)
    return d, low, high, (1.0 if p_two >= 1.0 else p_two)  # np.minimum(1.0, p), NaN kept


def _wilson_one(k: float, n: float, z: float) -> tuple[float, float]:
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


def classify_one(lo: float, hi: float, n: float, *, effect_threshold: float, marginal_threshold: float | None,
                 min_n: int, max_ci_width: float | None) -> tuple[int, str]:
    """``classify`` of one interval: (status code, reason key), the same rule without arrays."""
    m_level = 0.0 if marginal_threshold is None else marginal_threshold
    status, reason = PASS, "pass"
    if lo > m_level:
        status, reason = MARGINAL, "significant"
    if lo <= effect_threshold and hi > effect_threshold:
        status, reason = MARGINAL, "straddles"
    if lo > effect_threshold:
        status, reason = FAIL, "fail"
    if max_ci_width is not None and (hi - lo) > max_ci_width:
        status, reason = INCONCLUSIVE, "wide"
    if n < min_n or not math.isfinite(lo) or not math.isfinite(hi):
        status, reason = INCONCLUSIVE, "few"
    return status, reason


# --- verdict rule ------------------------------------------------------------------------------


def classify(
    lo: np.ndarray,
    hi: np.ndarray,
    n: np.ndarray,
    *,
    effect_threshold: float,
    marginal_threshold: float | None,
    min_n: int,
    max_ci_width: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The verdict rule on a harm interval [lo, hi] (positive = worse), vectorised.

    fail          lo > effect_threshold: the regression is significant AND confidently larger
                  than the effect threshold.
    inconclusive  fewer than ``min_n`` items, or an interval wider than ``max_ci_width`` (this
                  takes precedence over fail).
    marginal      the interval straddles the threshold, or lo > marginal_threshold
                  (significantly harmful, but within the threshold; default marginal level 0).
    pass          hi <= effect_threshold and lo <= marginal level.

    Returns (status codes, reason keys) as arrays.
    """
    lo = np.asarray(lo, dtype=float)
    hi = np.asarray(hi, dtype=float)
    n = np.broadcast_to(np.asarray(n), lo.shape)
    m_level = 0.0 if marginal_threshold is None else marginal_threshold
    status = np.full(lo.shape, PASS, dtype=np.int8)
    reason = np.full(lo.shape, "pass", dtype=object)
    sig = lo > m_level
    straddle = (lo <= effect_threshold) & (hi > effect_threshold)
    status[sig] = MARGINAL
    reason[sig] = "significant"
    status[straddle] = MARGINAL
    reason[straddle] = "straddles"
    fail = lo > effect_threshold
    status[fail] = FAIL
    reason[fail] = "fail"
    if max_ci_width is not None:
        # thin evidence is the main source of false rollbacks: a too-wide interval never fails
        wide = (hi - lo) > max_ci_width
        status[wide] = INCONCLUSIVE
        reason[wide] = "wide"
    bad = (n < min_n) | ~np.isfinite(lo) | ~np.isfinite(hi)
    status[bad] = INCONCLUSIVE
    reason[bad] = "few"
    return status, reason


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (same order as given)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
