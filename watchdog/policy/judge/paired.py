"""Golden replays: per-item candidate - baseline differences of the same prompts.

``judge_paired`` (t, bootstrap or Wilcoxon signed-rank / Hodges-Lehmann interval) judges one
replay, ``judge_paired_replays`` several, ``judge_broken`` the share of items that broke (Fisher's
exact test, one-sided). Nothing here does I/O; docs/JUDGE.md explains the statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from watchdog.policy.judge import stats as st
from watchdog.policy.judge.unpaired import judge_rate
from watchdog.policy.judge.verdict import (
    Direction,
    Judgement,
    PairedMethod,
    Samples,
    check_direction,
    error,
    inconclusive,
    message,
    verdict,
)


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
    sign = check_direction(direction)
    if effect_threshold < 0:
        return error(metric, method, "effect_threshold must be >= 0", effect_threshold)
    arr = np.asarray(diffs, dtype=float).ravel()
    finite = arr[np.isfinite(arr)]
    dropped = int(arr.size - finite.size)
    n = int(finite.size)
    if n < max(min_items, 2):
        return inconclusive(metric, method, "too_few_items", f"{n} usable items < {min_items}", n,
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
        return error(metric, str(method), "method must be t, bootstrap or signed_rank", effect_threshold)
    harm_lo, harm_hi = (lo, hi) if sign > 0 else (-hi, -lo)
    status, reason = verdict(metric, method, harm_lo, harm_hi, n, effect_threshold=effect_threshold,
                              harm_threshold=effect_threshold, harm_marginal=marginal_threshold,
                              min_n=min_items, max_ci_width=max_ci_width)
    return Judgement(
        metric=metric, status=status, reason=reason,
        message=message(metric, status, reason, est, lo, hi, n, effect_threshold),
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
    flip noise) at ``alpha * (1 - first_look_share)``, its spread prior scaled by the replays'
    correlation (``replay_correlation``). Fail if either look fails, otherwise the
    pooled look decides. The error budget is split, not doubled (alpha spending): at a true
    drift of exactly ``effect_threshold`` the chance of a fail per evaluation stays <= alpha / 2,
    as for one ``judge_paired`` call at ``alpha``. Most of it goes to the pooled look because it
    carries twice the information (an O'Brien-Fleming-like split).

    With one replay, or when the latest two differ in length (the prompt set changed), it is
    ``judge_paired`` on the latest replay at the full ``alpha``. An item missing (NaN) in one
    replay takes the other's value. ``detail['looks']`` holds both looks."""
    if not replays:
        return inconclusive(metric, "bootstrap_replays", "too_few_items", "no replays", 0, effect_threshold)
    if not 0.0 <= first_look_share < 1.0:
        return error(metric, "bootstrap_replays", "first_look_share must be in [0, 1)", effect_threshold)
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
    rho = replay_correlation(prev, latest)
    looks = []
    if first_look_share > 0:
        looks.append(("latest", judge_paired(latest, alpha=alpha * first_look_share, **common)))  # type: ignore[arg-type]
    pooled_common = {**common, "prior_jump": prior_jump * math.sqrt((1.0 + rho) / 2.0)}
    looks.append(("pooled2", judge_paired(pooled, alpha=alpha * (1 - first_look_share), **pooled_common)))  # type: ignore[arg-type]
    out = _pick_look(looks, method)
    out.detail["replay_correlation"] = rho
    return out


def replay_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Correlation across items of two replays' differences, clipped to [0, 1]; 1 (the
    conservative end) when it is undefined (fewer than 3 items measured in both, or no spread).

    It sets the spread prior of the pooled look: an unseen jump of ``prior_jump`` in one replay
    moves the two-replay mean of its item by half of it, so for replays whose jumps are
    independent (correlation 0: sampled or batch-dependent answers, or the persistent part
    removed by the learned levels) the prior's variance in the mean halves - each replay keeps
    its own two pseudo-items, as for the mean of two independent single-replay estimates (the
    rotated look, 2 n items, gets two in all) - and for persistent jumps (correlation 1) it
    stays whole: prior_jump * sqrt((1 + rho) / 2)."""
    ok = np.isfinite(a) & np.isfinite(b)
    if int(ok.sum()) < 3:
        return 1.0
    x, y = a[ok] - a[ok].mean(), b[ok] - b[ok].mean()
    sxy, sxx, syy = float(x @ y), float(x @ x), float(y @ y)
    if sxx <= 0.0 or syy <= 0.0:
        return 1.0
    return min(max(sxy / math.sqrt(sxx * syy), 0.0), 1.0)

def _pick_look(looks: list[tuple[str, Judgement]], method: str) -> Judgement:
    failed = [j for _, j in looks if j.status == "fail"]
    chosen = failed[0] if failed else looks[-1][1]
    chosen.detail["pooled_replays"] = 2 if chosen is looks[-1][1] else 1
    chosen.detail["looks"] = {name: {"status": j.status, "reason": j.reason, "estimate": j.estimate,
                                     "ci_low": j.ci_low, "ci_high": j.ci_high,
                                     "alpha": j.detail.get("alpha"), "n": j.n} for name, j in looks}
    chosen.method = f"{method}_replays"
    return chosen

def judge_broken(
    diffs: Samples,
    *,
    direction: Direction,
    drop: float,
    effect_threshold: float,
    null_broken: float,
    null_items: float,
    tolerance: float | None = None,
    alpha: float = 0.01,
    min_items: int = 30,
    item_ids: Sequence[Any] | None = None,
    top: int = 20,
    metric: str = "",
) -> Judgement:
    """How many items broke (a harmful per-item change larger than ``drop``) against how many
    break in the null: ``null_broken`` of ``null_items``. NaN items are not measured; an infinite
    harmful difference counts as broken (its harm is shown as the largest float). Sensitive to
    "6 % of prompts destroyed" when the mean barely moves. ``detail['broken']`` ranks the broken
    items, worst first (ids from ``item_ids`` when given, else positions).

    Two nulls. With ``tolerance`` (a share, the golden rules' A/A null) the counts are A/A
    replays of the baseline (FP16 against FP16; half the items that moved by more than ``drop``
    either way, by symmetry) and the test is the predictive tail of the count when items break
    at the A/A share - uncertain, Beta(k + 1/2, n - k + 1/2) - plus ``tolerance`` plus
    ``effect_threshold`` (``broken_null_tail``). Without it (the old form) the counts are
    pseudo or learned counts of the same comparison: Fisher's exact test with no effect, else
    the binomial tail at the null share's upper bound plus the effect."""
    sign = check_direction(direction)
    arr = np.asarray(diffs, dtype=float).ravel()
    # NaN marks an item not measured (missing in one replay); an infinite difference is a
    # measurement - harmful infinity is the surest break there is, never a dropped item
    ok = ~np.isnan(arr)
    n = int(ok.sum())
    harm = np.where(ok, sign * arr, -np.inf)
    broken = np.flatnonzero(harm > drop)
    order = broken[np.argsort(-harm[broken], kind="stable")]
    ids = list(item_ids) if item_ids is not None and len(item_ids) == arr.size else None
    ranked = [{"item": ids[i] if ids else int(i), "harm": float(np.nan_to_num(harm[i]))} for i in order[:top]]
    j = judge_rate(int(broken.size), n, round(null_broken), max(round(null_items), 1),
                   effect_threshold=effect_threshold, alpha=alpha, min_samples=min_items, metric=metric)
    j.method = "broken_items"
    if j.status not in ("inconclusive", "error"):
        # the decision is exact (a score interval on a handful of broken items is too optimistic
        # for a 1e-4 target)
        tail, level, p0 = _broken_tail(int(broken.size), n, null_broken, null_items, alpha, effect_threshold,
                                       tolerance)
        j.p_value = tail
        j.detail["null_share_upper"] = p0
        j.detail["test"] = ("aa_mixture" if tolerance is not None else
                            "fisher_exact" if effect_threshold <= 0 else "binomial_at_null_upper")
        if tail <= level:
            j.status, j.reason = "fail", st.REASONS["fail"]
        else:
            j.status, j.reason = "pass", st.REASONS["pass"]
    j.detail.update({"broken": ranked, "broken_count": int(broken.size), "null_broken": float(null_broken),
                     "null_items": float(null_items), "drop": drop, "tolerance": tolerance})
    if j.status != "inconclusive" and j.status != "error":
        test = j.detail.get("test")
        null = (f"{null_broken:g}/{null_items:g} in A/A replays + {tolerance:g} tolerated" if tolerance is not None
                else f"{null_broken:g}/{null_items:g} in the null")
        j.message = (f"{metric}: {j.status} ({j.reason}); {broken.size}/{n} items broke by > {drop:g} vs "
                     f"{null}; share difference {j.estimate:+.3f} [{j.ci_low:+.3f}, {j.ci_high:+.3f}], "
                     + (f"Fisher exact p={j.p_value:.2g}" if test == "fisher_exact" else
                        f"tail p={j.p_value:.2g} at null share {j.detail['null_share_upper']:.3f}"
                        + (f" + {effect_threshold:g}" if effect_threshold > 0 else "")))
    return j


def broken_null_tail(k: int, n: int, aa_broken: float, aa_items: float, shift: float, grid: int = 256) -> float:
    """P(X >= k) for X ~ Binomial(n, shift + q), q the baseline's harmful-side share with its
    uncertainty (``aa_items`` 0 means q = 0). ``aa_broken`` is the A/A half-count (half the items
    that moved by more than ``drop`` either way), so the A/A pass observed 2 ``aa_broken`` moves
    of ``aa_items``: the moving share r ~ Beta(2 aa_broken + 1/2, aa_items - 2 aa_broken + 1/2)
    (Jeffreys) and q = r / 2. (A Beta on the half-count itself is sqrt(2) too wide: at one
    200-item A/A pass its worst-case size was 27 times below the 1e-4 it is run at;
    tests/test_judge_broken.py checks the size exactly.) Integrated on ``grid`` points from the
    Beta's log density (no scipy in the daemon)."""
    if k <= 0:
        return 1.0
    if aa_items <= 0:
        return st.binom_sf(k, n, min(shift, 1.0))
    moves = min(2.0 * aa_broken, aa_items)
    a, b = moves + 0.5, aa_items - moves + 0.5
    mean = a / (a + b)
    sd = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
    lo, hi = max(mean - 12 * sd, 0.0), min(mean + 12 * sd, 1.0)
    r = np.linspace(lo, hi, 4 * grid + 1)[1:-1] if hi > lo else np.array([mean])
    logpdf = (a - 1) * np.log(np.maximum(r, 1e-300)) + (b - 1) * np.log1p(-np.minimum(r, 1 - 1e-16))
    w = np.exp(logpdf - logpdf.max())
    w /= w.sum()
    # binom_sf is monotone in p: evaluate it on a coarse grid of the mass, interpolate between
    keep = w > 1e-12 * w.max()
    rs, ws = r[keep], w[keep]
    pts = np.unique(np.linspace(0, rs.size - 1, min(grid, rs.size)).round().astype(int))
    tails = np.array([st.binom_sf(k, n, min(shift + float(rs[i]) / 2, 1.0)) for i in pts])
    return float(min(1.0, np.dot(ws, np.interp(np.arange(rs.size), pts, tails)) / ws.sum()))


def _broken_tail(k: int, n: int, null_broken: float, null_items: float, alpha: float,
                 effect_threshold: float, tolerance: float | None = None) -> tuple[float, float, float]:
    """(tail probability of k or more broken of n, the level it is compared with, the null share)."""
    if tolerance is not None:
        share = (null_broken / null_items if null_items > 0 else 0.0) + tolerance + effect_threshold
        return broken_null_tail(k, n, null_broken, null_items, tolerance + effect_threshold), alpha, share
    nb, ni = round(null_broken), max(round(null_items), 1)
    if effect_threshold <= 0:
        return st.hypergeom_sf(k, ni + n, nb + k, n), alpha, nb / ni
    _, p0_hi = st.wilson(nb, ni, st.z_quantile(1 - alpha / 2))
    return st.binom_sf(k, n, min(float(p0_hi) + effect_threshold, 1.0)), alpha / 2, float(p0_hi)


def broken_items_to_fail(n: int, *, null_broken: float, null_items: float, alpha: float,
                         effect_threshold: float = 0.0, tolerance: float | None = None) -> int | None:
    """The fewest broken items of ``n`` that make ``judge_broken`` fail with this null (None when
    even all ``n`` would not): how far a replay is from a rollback on this test, in items. The
    tail falls as the count rises, so a binary search over 0..n finds it."""
    def fails(k: int) -> bool:
        tail, level, _ = _broken_tail(k, n, null_broken, null_items, alpha, effect_threshold, tolerance)
        return tail <= level

    if n <= 0 or not fails(n):
        return None
    lo, hi = 0, n  # fails(hi) holds; find the smallest such k
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
