"""Live windows judged against a learned null (docs/JUDGE.md, "Variance at the right level").

FP8 and FP16 run on different replicas. Their typical latency and error rate differ by more than
one window's sampling interval, and the difference wanders (AR(1)-like replica effects, load).
Counting requests as independent evidence then rolls back on a stable replica offset. Instead
every live window is reduced to one number per rule, the FP8 - FP16 difference ``e`` in harm
units (log ratio of a latency quantile, rate difference) with its sampling variance ``v``, and:

* with fewer than ``learn_min`` healthy windows learned, the mean difference of the pooled
  windows is judged against 0 with variance ``mean(v) / k + between_sd**2`` (an absolute
  comparison that allows a prior between-window variation);
* afterwards the level is the mean of the last ``recent`` healthy windows before the pool and
  the null variance is learned from the healthy history itself: the mean square of "mean of k
  windows - mean of the ``recent`` windows before them" over that history, blended with the
  prior (2 pseudo degrees of freedom); the critical value is Student t on those degrees of
  freedom. A stable offset is then not a regression; a shift of more than ``effect`` is.

The engine keeps the history (``RuleState.null``, at most ``judge.learn`` entries, only windows
whose verdict passed). Pure numpy, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

from watchdog.core.signals import VerdictStatus
from watchdog.policy.judge import stats as st
from watchdog.policy.judge.memo import cached
from watchdog.policy.judge.pooled import zero_bucket_index
from watchdog.policy.judge.verdict import Judgement, verdict

__all__ = ["baseline_moved", "judge_learned", "quantile_log_diff", "quantile_log_sides", "rate_diff_estimate", "sketch_log_quantile",
           "sketch_log_tail_contrast", "sketch_log_tail_mean"]

#: pseudo degrees of freedom given to the prior between-window sd
PRIOR_DF = 2.0


def sketch_log_quantile(sketch: Mapping[str, Any], q: float, alpha: float = 0.05) -> tuple[float, float] | None:
    """(log of the ``q`` quantile, its sampling variance) from a ``QuantileSketch.to_dict()``
    export; the variance comes from the distribution-free order-statistic interval at level
    ``1 - alpha`` (a normal-approximation se). None when the sketch is empty."""
    acc = float(sketch["relative_accuracy"])
    gamma = (1.0 + acc) / (1.0 - acc)
    bins = [(int(i), int(c)) for i, c in sketch.get("bins", [])]
    zero = int(sketch.get("zero_count", 0))
    if zero:
        bins.append((zero_bucket_index(gamma, float(sketch.get("min_value", 1e-3))), zero))
    if not bins:
        return None
    bins.sort()
    lo_i = bins[0][0]
    counts = np.zeros(bins[-1][0] - lo_i + 1)
    for i, c in bins:
        counts[i - lo_i] += c
    est, lo, hi = st.hist_quantile_ci(counts, q, alpha)
    lg = math.log(gamma)
    z = st.z_quantile(1 - alpha / 2)
    return (lo_i + est) * lg, (((hi - lo) * lg) / (2 * z)) ** 2


def _log_buckets(sketch: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """(log midpoints, counts) of a sketch's non-empty buckets, ascending; None when empty. Inside
    ``memo.window_memo`` once per sketch (the rules reading one window's sketch share them, read-only)."""
    return cached("log_buckets", (sketch,), (), lambda: _log_buckets_now(sketch))


def _log_buckets_now(sketch: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    acc = float(sketch["relative_accuracy"])
    lg = math.log((1.0 + acc) / (1.0 - acc))
    bins = sketch.get("bins", [])
    try:  # fromiter: a third of asarray's time on a list of pairs, the same floats
        arr = np.fromiter(chain.from_iterable(bins), dtype=float).reshape(-1, 2)
    except (TypeError, ValueError):
        arr = np.asarray(bins, dtype=float).reshape(-1, 2)
    arr = arr[arr[:, 1] > 0]
    if not arr.size:
        return None
    arr = arr[np.argsort(arr[:, 0], kind="stable")]
    x, c = (np.floor(arr[:, 0]) - 0.5) * lg, np.floor(arr[:, 1])
    x.flags.writeable = c.flags.writeable = False
    return x, c


def sketch_log_tail_mean(sketch: Mapping[str, Any], p: float) -> tuple[float, float] | None:
    """(mean of log values above the ``p`` quantile, its sampling variance) from a sketch: the
    upper-tail mean (CVaR) of log latency, a tail statistic with several times less sampling
    noise than the p99 point itself (it averages the top ``1 - p`` of the requests). Variance:
    the CVaR estimator's asymptotic variance (Var(X | X > q) + p (E[X | X > q] - q)^2) /
    (n (1 - p)). Bucket values are their log midpoints (error below the sketch's accuracy)."""
    small = _small_buckets(sketch)
    if small is not None:
        return _tail_mean_small(small[0], small[1], float(sum_seq(small[1])) + int(sketch.get("zero_count", 0)), p)
    b = _log_buckets(sketch)
    if b is None:
        return None
    x, counts = b
    n = float(counts.sum()) + int(sketch.get("zero_count", 0))
    above = np.cumsum(counts[::-1])[::-1]  # mass at or above each bucket
    need = n * (1 - p)
    w = np.clip(need - (above - counts), 0.0, counts)  # mass of each bucket inside the top tail
    total = float(w.sum())
    if total <= 0:
        return None
    mu = float((w * x).sum() / total)
    var_t = float((w * (x - mu) ** 2).sum() / total)
    q = float(x[np.flatnonzero(w > 0)[0]])
    return mu, (var_t + p * (mu - q) ** 2) / (n * (1 - p))


def sketch_log_tail_contrast(sketch: Mapping[str, Any], p: float) -> tuple[float, float] | None:
    """(upper-tail mean of log latency above the ``p`` quantile minus the mean log latency of the
    same sketch, its sampling variance), or None when empty.

    The contrast measures the *shape* of one precision's distribution: a multiplicative effect
    (a slower replica, diurnal load that scales every request, a faster engine) moves both terms
    alike and cancels, a tail-only change does not. The two terms come from the same requests
    and are correlated, so the variance is that of the contrast's influence function,
    ``IF(x) = (x - q)+ / (1 - p) + q - tail_mean - (x - mean)``, averaged over the sketch's
    buckets and divided by n (for a normal log latency: 2.71 sigma^2 / n, less than the tail
    mean alone, 3.71 sigma^2 / n). The sketch's zero bucket is left out (sub-millisecond
    latencies have no log-scale position)."""
    small = _small_buckets(sketch)
    if small is not None:
        return _tail_contrast_small(small[0], small[1], p)
    b = _log_buckets(sketch)
    if b is None:
        return None
    x, c = b
    n = float(c.sum())
    need = n * (1.0 - p)
    above = np.cumsum(c[::-1])[::-1]
    w = np.clip(need - (above - c), 0.0, c)  # mass of each bucket inside the top tail
    if need <= 0 or w.sum() <= 0:
        return None
    tail = float((w * x).sum() / w.sum())
    q = float(x[np.flatnonzero(w > 0)[0]])
    mean = float((c * x).sum() / n)
    infl = (w / c) * (x - q) / (1.0 - p) + q - tail - (x - mean)
    return tail - mean, float((c * infl * infl).sum()) / (n * n)


# --- the same statistics for sketches of fewer than SMALL buckets, without numpy ------------------
# A thin window (a few requests) has a handful of buckets, where numpy's per-call overhead is most
# of the cost. numpy sums fewer than 8 values left to right (pairwise summation starts at 8), so
# these loops, doing the same float operations in the same order, give the same bits
# (tests/test_judge_small_sketches.py compares them with the numpy path).

#: most raw bins a sketch may have for the plain-Python path
SMALL = 7


def sum_seq(xs: Sequence[float]) -> float:
    """Sum left to right, as numpy's ``sum`` of fewer than 8 values."""
    s = 0.0
    for x in xs:
        s += x
    return s


def _small_buckets(sketch: Mapping[str, Any]) -> tuple[list[float], list[float]] | None:
    """``_log_buckets`` as two lists for a sketch of at most ``SMALL`` bins (empty lists when it has
    none), or None for the numpy path (more bins, or bins it would not read the same way)."""
    return cached("small_buckets", (sketch,), (), lambda: _small_buckets_now(sketch))


def _small_buckets_now(sketch: Mapping[str, Any]) -> tuple[list[float], list[float]] | None:
    bins = sketch.get("bins", [])
    if not isinstance(bins, list | tuple) or len(bins) > SMALL:
        return None
    try:
        pairs = [(float(k), float(c)) for k, c in bins]
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(k) and math.isfinite(c) for k, c in pairs):
        return None
    acc = float(sketch["relative_accuracy"])
    lg = math.log((1.0 + acc) / (1.0 - acc))
    kept = sorted((kc for kc in pairs if kc[1] > 0), key=lambda kc: kc[0])  # stable, as argsort's
    return [(math.floor(k) - 0.5) * lg for k, _ in kept], [float(math.floor(c)) for _, c in kept]


def _tail_weights(c: list[float], need: float) -> list[float]:
    """``np.clip(need - (above - c), 0, c)`` with ``above`` the mass at or above each bucket."""
    above = [0.0] * len(c)
    acc = 0.0
    for i in range(len(c) - 1, -1, -1):
        acc = c[i] if i == len(c) - 1 else acc + c[i]
        above[i] = acc
    out = []
    for a, ci in zip(above, c, strict=True):
        t = need - (a - ci)
        t = t if t > 0.0 or t != t else 0.0  # numpy's clip: max then min, NaN kept, +0.0 for -0.0
        out.append(t if t < ci or t != t else ci)
    return out


def _tail_mean_small(x: list[float], c: list[float], n: float, p: float) -> tuple[float, float] | None:
    if not c:
        return None
    w = _tail_weights(c, n * (1 - p))
    total = float(sum_seq(w))
    if total <= 0:
        return None
    mu = sum_seq([wi * xi for wi, xi in zip(w, x, strict=True)]) / total
    var_t = sum_seq([wi * ((xi - mu) * (xi - mu)) for wi, xi in zip(w, x, strict=True)]) / total
    q = next(xi for wi, xi in zip(w, x, strict=True) if wi > 0)
    return mu, (var_t + p * (mu - q) ** 2) / (n * (1 - p))


def _tail_contrast_small(x: list[float], c: list[float], p: float) -> tuple[float, float] | None:
    if not c:
        return None
    n = sum_seq(c)
    need = n * (1.0 - p)
    w = _tail_weights(c, need)
    ws = sum_seq(w)
    if need <= 0 or ws <= 0:
        return None
    tail = sum_seq([wi * xi for wi, xi in zip(w, x, strict=True)]) / ws
    q = next(xi for wi, xi in zip(w, x, strict=True) if wi > 0)
    mean = sum_seq([ci * xi for ci, xi in zip(c, x, strict=True)]) / n
    infl = [(wi / ci) * (xi - q) / (1.0 - p) + q - tail - (xi - mean) for wi, ci, xi in zip(w, c, x, strict=True)]
    return tail - mean, sum_seq([ci * f * f for ci, f in zip(c, infl, strict=True)]) / (n * n)


def quantile_log_diff(cand: Mapping[str, Any], base: Mapping[str, Any], q: float,
                      tail: float | None = None, relative_to: str | None = None) -> tuple[float, float] | None:
    """(log q-quantile FP8 - FP16, variance) of one window's two latency sketches, or None;
    with ``tail``, the difference of the upper-tail means of log latency above that quantile;
    with ``relative_to="mean"`` as well, the difference of the two precisions' tail contrasts
    (``sketch_log_tail_contrast``: tail mean minus mean log latency of the same sketch)."""
    sides = quantile_log_sides(cand, base, q, tail, relative_to)
    if sides is None:
        return None
    a, b = sides
    return a[0] - b[0], a[1] + b[1]


def quantile_log_sides(cand: Mapping[str, Any], base: Mapping[str, Any], q: float, tail: float | None = None,
                       relative_to: str | None = None) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """Each precision's own statistic of ``quantile_log_diff`` ((value, variance) for FP8, then
    FP16), or None when either sketch is empty."""
    if tail is not None and relative_to == "mean":
        a, b = sketch_log_tail_contrast(cand, tail), sketch_log_tail_contrast(base, tail)
    elif tail is not None:
        a, b = sketch_log_tail_mean(cand, tail), sketch_log_tail_mean(base, tail)
    else:
        a, b = sketch_log_quantile(cand, q), sketch_log_quantile(base, q)
    if a is None or b is None:
        return None
    return a, b


def rate_diff_estimate(ce: int, cn: int, be: int, bn: int) -> tuple[float, float] | None:
    """(rate difference, variance) of one window's (errors, requests) counts, or None. The
    variance uses shares shrunk toward 1/2 by one pseudo-count so a window without errors still
    has some."""
    if cn <= 0 or bn <= 0:
        return None
    pc, pb = (ce + 0.5) / (cn + 1.0), (be + 0.5) / (bn + 1.0)
    return ce / cn - be / bn, pc * (1 - pc) / cn + pb * (1 - pb) / bn


def _residual_sd(hist: np.ndarray, k: int, recent: int, gap: int = 0) -> tuple[float, int]:
    """Root mean square of (mean of k windows - mean of the ``recent`` windows ending ``gap``
    windows before them) over the history, and its degrees of freedom (non-overlapping residual
    blocks). ``gap``: how far the judged pool lies from the level it is compared with (windows not
    learned in between: a deploy's settling time); a level that wanders predicts worse further away,
    and the history says by how much at that distance (at most what the history can show)."""
    n = hist.size
    if n < recent + k:
        return math.nan, 0
    gap = max(0, min(int(gap), n - recent - k))
    c = np.concatenate([[0.0], np.cumsum(hist)])
    j = np.arange(recent, n - k - gap + 1)
    r = (c[j + gap + k] - c[j + gap]) / k - (c[j] - c[j - recent]) / recent
    return float(np.sqrt(np.mean(r * r))), max(1, int(r.size // k))


def _dispersion(hist: np.ndarray, hv: np.ndarray) -> tuple[float, float]:
    """How many times its stated sampling variance a healthy window varies: the mean of
    (e_t - e_{t-1})^2 / (v_t + v_{t-1}) over the history (successive differences: a slow drift
    of the level barely enters), and its degrees of freedom (2 (n - 1) / 3, the efficiency of
    successive differences against the plain variance for white noise)."""
    if hist.size < 3:
        return math.nan, 0.0
    d = np.diff(hist)
    s = hv[1:] + hv[:-1]
    ok = s > 0
    if not ok.any():
        return math.nan, 0.0
    return float(np.mean(d[ok] ** 2 / s[ok])), 2.0 * (int(ok.sum())) / 3.0


def judge_learned(
    pool: Sequence[tuple[float, float]],
    null: Sequence[float],
    *,
    effect_threshold: float,
    alpha: float,
    prior_sd: float,
    learn_min: int = 24,
    recent: int = 6,
    metric: str = "",
    unit: str = "",
    level_cap: float | None = None,
    level_reset: tuple[float, float] | None = None,
    null_v: Sequence[float] | None = None,
    null_model: str = "residual",
    level_sd: float | None = None,
    gap: int = 0,
) -> Judgement:
    """Judge the last k windows' differences ``pool`` ((e, v), oldest first, harm units: positive
    = worse) against the learned healthy history ``null`` (e of passing windows before the pool,
    oldest first). Fail when the whole ``1 - alpha`` interval of the shift lies beyond
    ``effect_threshold``; see the module docstring for the model.

    ``null_model="sampling"`` (needs ``null_v``, the stated sampling variances of the history):
    for a statistic whose healthy windows differ by sampling noise alone (the tail contrast,
    whose replica and load effects cancel), the null variance is the stated sampling variance
    of the judged statistic (the pool's and the level's windows) times the dispersion learned
    from the history (``_dispersion``; 1 = sampling noise only), blended with a dispersion of 1
    at 2 pseudo degrees of freedom, and the critical value Student t on those degrees of
    freedom. The history's successive differences give it about 2/3 of the windows as degrees
    of freedom, where the residual model has one per ``k`` windows; that is where its power
    comes from. A level that wanders (replica offsets) is not what it models: use the residual
    model there. Without usable ``null_v`` it falls back to the residual model.

    ``level_sd``: the prior sd of the level itself, used while the null warms up (default
    ``prior_sd``). A replica offset makes the level spread wider than the window-to-window
    variation the learned phase needs a prior for; one number for both costs power later.

    ``gap``: windows between the last of ``null`` and the first of ``pool`` that the null did not
    learn (a deploy's settling time, windows not comparable); the residual model measures the
    history's residuals at that distance (``_residual_sd``).

    ``level_reset``: (below, level) from a long-term anchor (watchdog/policy/judge/anchor.py): a
    learned level below ``below`` is not held against the candidate, ``level`` is used instead."""
    k = len(pool)
    method = "learned_null"
    if k == 0:
        return Judgement(metric=metric, status="inconclusive", reason="too_few_items",
                         message=f"{metric}: no window", effect_threshold=effect_threshold, method=method)
    e = np.array([p[0] for p in pool], dtype=float)
    v = np.array([p[1] for p in pool], dtype=float)
    d = float(e.mean())
    hist = np.asarray(null, dtype=float)
    dispersion: float | None = None
    # a long level (a stationary null) is built up over the history: half of it at first
    recent = max(1, min(recent, hist.size // 2))
    learned = hist.size >= max(learn_min, recent + k)
    if learned:
        level = float(hist[-recent:].mean())
        # a learned offset is credited only up to the tolerated effect: a regression present
        # from the first windows is never learned away entirely
        level = min(level, effect_threshold if level_cap is None else level_cap)
        if level_reset is not None and level < level_reset[0]:
            level = min(level_reset[1], effect_threshold if level_cap is None else level_cap)
        hv = np.asarray(null_v if null_v is not None else [], dtype=float)
        if null_model == "sampling" and hv.size == hist.size and np.all(np.isfinite(hv)):
            var, crit, sd_r, df, dispersion = _sampling_null(hist, hv, v, recent, alpha)
            method = "learned_null_sampling"
        else:
            var, crit, sd_r, df = _residual_null(hist, k, recent, alpha, prior_sd, gap)
    else:
        level, sd_r, df = 0.0, math.nan, 0
        warm_sd = prior_sd if level_sd is None else level_sd
        var = float(v.mean()) / k + warm_sd * warm_sd
        crit = st.z_quantile(1 - alpha / 2)
    shift = d - level
    half = crit * math.sqrt(var)
    lo, hi = shift - half, shift + half
    status, reason = _status(metric, method, lo, hi, k, effect_threshold, learned)
    z = shift / math.sqrt(var) if var > 0 else 0.0
    p = float(st.two_sided_p(z))
    msg = (f"{metric}: {status} ({reason}); shift {shift:+.4g}{unit} [{lo:+.4g}, {hi:+.4g}] vs "
           f"{'learned level ' + format(level, '+.4g') if learned else 'no learned level yet'}"
           f" ({hist.size} healthy windows), threshold {effect_threshold:.4g}{unit}, {k} window(s)")
    return Judgement(metric=metric, status=status, reason=reason, message=msg, estimate=shift, ci_low=lo,
                     ci_high=hi, p_value=p, n=k, effect_threshold=effect_threshold, method=method,
                     detail={"difference": d, "level": level, "learned": learned, "null_windows": int(hist.size),
                             "null_sd": None if math.isnan(sd_r) else sd_r, "df": df, "alpha": alpha, "dispersion": dispersion,
                             "gap": gap,
                             "window_estimate": [float(e[-1]), float(v[-1])]})


def baseline_moved(pool: Sequence[tuple[float, float]], pool_b: Sequence[float], hist: Sequence[float],
                   hist_b: Sequence[float], *, recent: int, alpha: float, prior_sd: float, effect: float,
                   gap: int = 0, level_offset: float = 0.0) -> dict[str, Any] | None:
    """FP8's own move, judged, when a shift of the FP8 - FP16 difference that ``judge_learned``
    failed is mostly FP16's (docs/JUDGE.md "Which precision moved"). The difference is FP8's
    statistic minus FP16's (``pool_b`` / ``hist_b``: FP16's own, harm units, NaN where unknown), so
    the shift against the level (the last ``recent`` learned windows) splits into FP8's own move
    ``d8`` and FP16's ``d16`` (shift = d8 - d16). When FP16's own fall is more than half the shift
    (its replicas restarted after creeping with uptime, its load fell), FP8's own move is judged
    instead, against its own learned wander (the residual null of FP8's own series over the history,
    ``_residual_null`` at the rule's ``alpha`` and ``prior_sd``): ``fails`` when its whole interval lies
    beyond ``effect``. A load or mix change that moves both precisions moves ``d8`` as well, and that
    wander is in FP8's own null. None when FP16's move is not most of the shift, or when the history
    lacks FP16's statistic for the level or enough windows to learn FP8's wander: the difference's
    judgement stands.

    ``level_offset``: how far the level the judge held the pool against was capped below the recent
    level (``level_cap`` or the anchor's cap; the caller passes 0 for a level raised to the anchor):
    FP8's own move is judged against the cap too, ``d8 + level_offset``, so a window failed against a
    capped level (FP8 crept past its anchor) is not excused by a small move of FP16 in the last windows."""
    k, n = len(pool), len(hist)
    recent = max(1, min(recent, n // 2))
    if k == 0 or len(pool_b) != k or len(hist_b) != n or n < recent:
        return None
    b_pool, b_hist = np.asarray(pool_b, dtype=float), np.asarray(hist_b, dtype=float)
    if not (np.all(np.isfinite(b_pool)) and np.all(np.isfinite(b_hist[-recent:]))):
        return None
    own8 = np.asarray(hist, dtype=float) + b_hist
    d16 = float(b_pool.mean() - b_hist[-recent:].mean())
    d8 = float((np.array([p[0] for p in pool], dtype=float) + b_pool).mean() - own8[-recent:].mean())
    shift = d8 - d16
    if not (shift > 0 and d16 < -shift / 2):
        return None
    own8 = own8[np.isfinite(own8)]
    if own8.size < recent + 2 * k:
        return None
    var, crit, _, df = _residual_null(own8, k, recent, alpha, prior_sd, gap)
    half = crit * math.sqrt(var)
    own = d8 + level_offset
    return {"shift": shift, "fp16_own": d16, "fp8_own": own, "fp8_own_low": own - half, "fp8_own_high": own + half,
            "df": df, "fails": own - half > effect}


def _sampling_null(hist: np.ndarray, hv: np.ndarray, v: np.ndarray, recent: int,
                   alpha: float) -> tuple[float, float, float, int, float]:
    """The sampling null model of ``judge_learned``: (variance of the shift, critical value,
    its sd, degrees of freedom, dispersion) from the stated sampling variances of the pool ``v``
    and of the level's windows, times the dispersion learned from the history ``hist`` / ``hv``
    (blended with 1 at ``PRIOR_DF``)."""
    k = v.size
    phi, dfd = _dispersion(hist, hv)
    phi = (dfd * phi + PRIOR_DF) / (dfd + PRIOR_DF) if math.isfinite(phi) else 1.0
    rv = hv[-recent:]
    var = phi * (float(v.sum()) / (k * k) + float(rv.sum()) / (rv.size * rv.size))
    crit = st.t_quantile(1 - alpha / 2, dfd + PRIOR_DF)
    return var, crit, math.sqrt(var), int(dfd), phi


def _residual_null(hist: np.ndarray, k: int, recent: int, alpha: float,
                   prior_sd: float, gap: int = 0) -> tuple[float, float, float, int]:
    """The residual null model of ``judge_learned``: (variance of the shift, critical value, the
    history's residual sd, its degrees of freedom), the residual variance blended with
    ``prior_sd`` at ``PRIOR_DF``."""
    sd_r, df = _residual_sd(hist, k, recent, gap)
    var = (df * sd_r * sd_r + PRIOR_DF * prior_sd * prior_sd) / (df + PRIOR_DF)
    crit = st.t_quantile(1 - alpha / 2, df + PRIOR_DF)
    return var, crit, sd_r, df


def _status(metric: str, method: str, lo: float, hi: float, k: int, effect_threshold: float,
            learned: bool) -> tuple[VerdictStatus, str]:
    """(status, reason) of a shift interval [lo, hi] of ``judge_learned``."""
    status, reason = verdict(metric, method, lo, hi, k, effect_threshold=effect_threshold,
                              harm_threshold=effect_threshold, harm_marginal=None, min_n=1, max_ci_width=None)
    if status == "marginal":
        # a rollback guard at a small alpha: "not shown to be beyond the threshold" is a pass,
        # otherwise its wide interval would leave every healthy window marginal (no promote)
        status, reason = "pass", "no_shift_beyond_threshold"
    if not learned and status == "pass":
        status, reason = "inconclusive", "learning_null"
    return status, reason
