"""Statistical judge: known answers cross-checked against scipy, verdict rules, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as ss

from watchdog.policy.judge import stats as st
from watchdog.policy.judge.paired import judge_paired, judge_paired_replays
from watchdog.policy.judge.pooled import (
    judge_rate_pooled,
    judge_unpaired_pooled,
    pool_counts,
    pool_histograms,
    zero_bucket_index,
)
from watchdog.policy.judge.unpaired import judge_rate, judge_unpaired
from watchdog.policy.judge.verdict import Judgement, attribute, combine
from watchdog.windows.sketch import QuantileSketch


def _golden_like(seed: int, n: int = 200, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    d = np.round(rng.standard_t(3, n) * 0.08, 3) + shift
    d[rng.random(n) < 0.7] = 0.0
    return d


# --- cross-checks against scipy ----------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_signed_rank_matches_scipy_with_zeros_and_ties(seed: int) -> None:
    d = _golden_like(seed, shift=0.0)
    d[:5] = 0.05  # force ties
    z, p, n = st.signed_rank_test(d)
    ref = ss.wilcoxon(d, zero_method="wilcox", method="approx", correction=False)
    assert p == pytest.approx(ref.pvalue, rel=1e-9)
    assert n == int((d != 0).sum())
    p_cc = st.signed_rank_test(d, continuity=True)[1]
    ref_cc = ss.wilcoxon(d, zero_method="wilcox", method="approx", correction=True)
    assert p_cc == pytest.approx(ref_cc.pvalue, rel=1e-9)


@pytest.mark.parametrize("seed", [4, 5])
def test_mann_whitney_matches_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = np.round(rng.lognormal(0.1, 0.5, 130), 1)  # rounded: many ties
    y = np.round(rng.lognormal(0.0, 0.5, 90), 1)
    u, p, sup = st.mann_whitney(x, y)
    ref = ss.mannwhitneyu(x, y, method="asymptotic", use_continuity=True)
    assert u == pytest.approx(ref.statistic)
    assert p == pytest.approx(ref.pvalue, rel=1e-9)
    assert sup == pytest.approx(ref.statistic / (x.size * y.size))


def test_mann_whitney_on_counts_equals_rank_test_on_bucket_values() -> None:
    rng = np.random.default_rng(6)
    cx = rng.integers(0, 20, 40).astype(float)
    cy = rng.integers(0, 20, 40).astype(float)
    xs = np.repeat(np.arange(40.0), cx.astype(int))
    ys = np.repeat(np.arange(40.0), cy.astype(int))
    u, p, _ = st.mann_whitney_counts(cx, cy)
    ref = ss.mannwhitneyu(xs, ys, method="asymptotic", use_continuity=True)
    assert u == pytest.approx(ref.statistic)
    assert p == pytest.approx(ref.pvalue, rel=1e-9)
    # the binned Hodges-Lehmann interval equals the one on expanded samples
    assert st.shift_ci_counts(cx, cy, 0.01) == pytest.approx(st.shift_ci_samples(xs, ys, 0.01))


def test_hodges_lehmann_estimate_is_median_of_pairwise_differences() -> None:
    x = np.array([1.0, 4.0, 6.0, 9.0])
    y = np.array([0.0, 2.0, 3.0])
    est, lo, hi = st.shift_ci_samples(x, y, 0.5)
    assert est == pytest.approx(float(np.median(np.subtract.outer(x, y))))
    assert lo <= est <= hi


def test_newcombe_interval_known_value() -> None:
    # Newcombe (1998) example: 56/70 vs 48/80 -> diff 0.2, 95 % hybrid score CI 0.0524 .. 0.3339
    d, lo, hi, p = st.rate_diff_ci(56, 70, 48, 80, 0.05)
    assert float(d) == pytest.approx(0.2)
    assert float(lo) == pytest.approx(0.0524, abs=1e-4)
    assert float(hi) == pytest.approx(0.3339, abs=1e-4)
    table = np.array([[56, 14], [48, 32]])
    ref = ss.chi2_contingency(table, correction=False).pvalue
    assert float(p) == pytest.approx(ref, rel=1e-9)


def test_holm_matches_definition() -> None:
    assert st.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert st.holm([]) == []


# --- paired verdicts ---------------------------------------------------------------------------


def test_paired_clear_regression_fails() -> None:
    d = _golden_like(7, shift=0.0)
    d[:80] -= 0.15  # mean drop 0.06
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=1, metric="rougeL")
    assert (j.status, j.reason) == ("fail", "significant_regression")
    assert j.ci_high < -0.01 and j.estimate < 0
    assert j.n == 200 and j.p_value < 1e-6


def test_paired_noise_passes_and_small_drift_is_marginal() -> None:
    j = judge_paired(_golden_like(8), direction="higher_is_better", effect_threshold=0.05, seed=1)
    assert (j.status, j.reason) == ("pass", "within_effect_threshold")
    d = np.full(200, -0.004)
    d[::2] = -0.006
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.05, prior_jump=0.0)
    assert (j.status, j.reason) == ("marginal", "significant_within_threshold")
    # the spread prior (two pseudo-items at +-0.5) keeps a near-constant drift from looking sure
    assert judge_paired(d, direction="higher_is_better", effect_threshold=0.05).status == "pass"


def test_paired_straddling_threshold_is_marginal() -> None:
    d = _golden_like(9, shift=-0.02)
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=1)
    assert j.ci_low < -0.01 < j.ci_high
    assert (j.status, j.reason) == ("marginal", "straddles_threshold")


def test_paired_lower_is_better_direction() -> None:
    d = np.abs(_golden_like(10)) + 0.1  # candidate much higher on a lower-is-better metric
    assert judge_paired(d, direction="lower_is_better", effect_threshold=0.01).status == "fail"
    assert judge_paired(d, direction="higher_is_better", effect_threshold=0.01).status == "pass"


def test_paired_edge_cases() -> None:
    zeros = judge_paired(np.zeros(100), direction="higher_is_better", effect_threshold=0.01, prior_jump=0.0)
    assert zeros.status == "pass" and zeros.ci_low == 0.0 == zeros.ci_high and zeros.p_value == 1.0
    # with the prior a replay in which nothing changed is not proof of "within 1 point" on 100 items
    zp = judge_paired(np.zeros(100), direction="higher_is_better", effect_threshold=0.01)
    assert zp.status == "marginal" and zp.ci_low == pytest.approx(-zp.ci_high) and zp.ci_high > 0.01
    few = judge_paired([0.1] * 10, direction="higher_is_better", effect_threshold=0.01, min_items=30)
    assert (few.status, few.reason) == ("inconclusive", "too_few_items")
    d = list(_golden_like(11)) + [math.nan, math.inf]
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.01)
    assert j.n == 200 and j.detail["dropped"] == 2
    all_nan = judge_paired([math.nan] * 50, direction="higher_is_better", effect_threshold=0.01)
    assert all_nan.reason == "too_few_items"
    wide = judge_paired(_golden_like(12), direction="higher_is_better", effect_threshold=0.5, max_ci_width=0.001)
    assert (wide.status, wide.reason) == ("inconclusive", "ci_too_wide")
    with pytest.raises(ValueError):
        judge_paired([0.0] * 40, direction="up", effect_threshold=0.01)  # type: ignore[arg-type]


def test_paired_bootstrap_is_deterministic_with_seed() -> None:
    d = _golden_like(13, shift=-0.01)
    a = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=42, method="bootstrap")
    b = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=42, method="bootstrap")
    c = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=43, method="bootstrap")
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)
    assert (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)


def test_paired_bootstrap_interval_close_to_normal_theory() -> None:
    rng = np.random.default_rng(14)
    d = rng.normal(-0.02, 0.05, 400)
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.0, alpha=0.05, n_boot=4000,
                     method="bootstrap")
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert j.ci_low == pytest.approx(d.mean() - 1.96 * se, abs=0.3 * se)
    assert j.ci_high == pytest.approx(d.mean() + 1.96 * se, abs=0.3 * se)


@pytest.mark.parametrize(("n", "alpha", "jump"), [(30, 0.01, 0.5), (200, 0.001, 0.5), (500, 0.05, 0.0), (80, 0.009, 0.25)])
def test_t_interval_is_student_t_with_the_spread_prior(n: int, alpha: float, jump: float) -> None:
    d = _golden_like(40 + n)[:n] if n <= 200 else np.random.default_rng(5).normal(0, 0.1, n)
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.0, alpha=alpha, prior_jump=jump)
    s2 = ((n - 1) * d.var(ddof=1) + 2 * jump * jump) / (n + 1)
    half = ss.t.ppf(1 - alpha / 2, n - 1) * math.sqrt(s2 / n)
    assert j.method == "t" and j.estimate == pytest.approx(d.mean(), abs=1e-15)
    assert (j.ci_low, j.ci_high) == pytest.approx((d.mean() - half, d.mean() + half), rel=2e-4)


def test_signed_rank_method_uses_walsh_interval() -> None:
    rng = np.random.default_rng(15)
    d = rng.normal(-0.05, 0.02, 60)
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, method="signed_rank")
    assert j.method == "signed_rank" and j.status == "fail"
    walsh = [(d[i] + d[k]) / 2 for i in range(60) for k in range(i, 60)]
    assert j.estimate == pytest.approx(float(np.median(walsh)))


# --- unpaired and rates ------------------------------------------------------------------------


def _hist(values: np.ndarray, gamma: float) -> dict[int, int]:
    idx, counts = np.unique(np.ceil(np.log(values) / math.log(gamma)).astype(int), return_counts=True)
    return {int(i): int(c) for i, c in zip(idx, counts, strict=True)}


def test_unpaired_latency_regression_samples_and_histogram_agree() -> None:
    rng = np.random.default_rng(16)
    base = rng.lognormal(math.log(300), 0.5, 3000)
    cand = rng.lognormal(math.log(300 * 1.3), 0.5, 3000)
    j = judge_unpaired(cand, base, effect_threshold=0.10, metric="latency_ms")
    assert j.status == "fail" and j.estimate == pytest.approx(0.3, abs=0.05)
    assert j.detail["prob_superiority"] > 0.6
    g = 1.01 / 0.99
    jh = judge_unpaired(_hist(cand, g), _hist(base, g), gamma=g, effect_threshold=0.10)
    assert jh.status == "fail"
    assert jh.estimate == pytest.approx(j.estimate, abs=0.03)
    same = judge_unpaired(base[:1500], base[1500:], effect_threshold=0.10)
    assert same.status in ("pass", "marginal") and same.ci_low < 0.1


def test_unpaired_edge_cases() -> None:
    assert judge_unpaired([1.0] * 10, [1.0] * 10).reason == "too_few_items"
    assert judge_unpaired([0.0] * 60, [1.0] * 60).status == "error"
    assert judge_unpaired({1: 60}, [1.0] * 60, gamma=1.02).status == "error"
    assert judge_unpaired({1: 60}, {1: 60}).status == "error"  # no gamma
    # higher-is-better metric (throughput): a 30 % drop fails
    rng = np.random.default_rng(17)
    base = rng.lognormal(3, 0.2, 500)
    j = judge_unpaired(base * 0.7, base[::-1].copy(), direction="higher_is_better", effect_threshold=0.1)
    assert j.status == "fail"


def test_rate_verdicts() -> None:
    assert judge_rate(120, 4000, 40, 4000, effect_threshold=0.005).status == "fail"
    assert judge_rate(410, 40000, 400, 40000, effect_threshold=0.005).status == "pass"
    assert judge_rate(41, 4000, 40, 4000, effect_threshold=0.005).reason == "straddles_threshold"
    assert judge_rate(1, 50, 0, 50).reason == "too_few_items"
    assert judge_rate(5, 4, 0, 10).status == "error"
    assert judge_rate(0, 4000, 0, 4000).status == "pass"


# --- combination and attribution ---------------------------------------------------------------


def _j(metric: str, status: str, p: float | None) -> Judgement:
    return Judgement(metric=metric, status=status, reason="x", message="", p_value=p)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("items", "critical", "k", "expected"),
    [
        ([("a", "pass", 0.5), ("b", "pass", 0.2)], (), 1, ("pass", "all_pass")),
        ([("a", "fail", 1e-6), ("b", "pass", 0.2)], (), 1, ("fail", "k_metrics_failed")),
        ([("a", "fail", 1e-6), ("b", "pass", 0.2)], (), 2, ("marginal", "some_marginal")),
        ([("a", "fail", 1e-6), ("b", "pass", 0.2)], ("a",), 2, ("fail", "critical_metric_failed")),
        ([("a", "fail", 0.008), ("b", "pass", 0.5), ("c", "pass", 0.6)], (), 1,
         ("marginal", "not_significant_after_holm")),
        ([("a", "pass", 0.5), ("b", "error", None)], (), 1, ("error", "source_error")),
        ([("a", "pass", 0.5), ("b", "inconclusive", None)], (), 1, ("inconclusive", "some_inconclusive")),
        ([("a", "marginal", 0.001), ("b", "inconclusive", None)], (), 1, ("marginal", "some_marginal")),
        ([], (), 1, ("inconclusive", "no_metrics")),
    ],
)
def test_combine_table(items: list, critical: tuple, k: int, expected: tuple[str, str]) -> None:
    out = combine([_j(*i) for i in items], critical=critical, alpha=0.01, k=k)
    assert (out.status, out.reason) == expected


@pytest.mark.parametrize(
    ("args", "gpu", "cause", "inhibit"),
    [
        ((0.60, 0.70, 0.70, 0.70), None, "candidate", False),   # only FP8 dropped
        ((0.60, 0.70, 0.62, 0.70), None, "input_shift", True),  # FP16 dropped too
        ((0.60, 0.70, 0.70, 0.70), ["xid 79"], "gpu_health", True),
        ((0.71, 0.70, 0.60, 0.70), None, "none", False),        # candidate did not degrade
    ],
)
def test_attribute_table(args: tuple, gpu: list[str] | None, cause: str, inhibit: bool) -> None:
    a = attribute(*args, gpu_problems=gpu, direction="higher_is_better", noise=0.005)
    assert (a.cause, a.inhibit_rollback) == (cause, inhibit)


def test_attribute_lower_is_better_and_nan() -> None:
    a = attribute(400.0, 300.0, 390.0, 300.0, direction="lower_is_better")
    assert a.cause == "input_shift"
    assert attribute(math.nan, 1, 1, 1).cause == "candidate"


# --- batched statistics used by the benchmark ----------------------------------------------------


def test_shift_ci_counts_rows_equals_one_row_version() -> None:
    rng = np.random.default_rng(20)
    cx = rng.integers(0, 30, (12, 200)).astype(float)
    cy = rng.integers(0, 30, (12, 200)).astype(float)
    cx[:, :60] = 0  # shifted supports, leading/trailing empty bins
    cy[:, 150:] = 0
    cx[4] = 0  # an empty side gives NaN
    est, lo, hi = st.shift_ci_counts_rows(cx, cy, 0.01)
    for i in range(12):
        if i == 4:
            assert math.isnan(est[i]) and math.isnan(lo[i])
            continue
        assert (est[i], lo[i], hi[i]) == st.shift_ci_counts(cx[i], cy[i], 0.01)


def test_bootstrap_quantiles_match_bootstrap_ci() -> None:
    d = np.stack([_golden_like(s, shift=-0.01) for s in (21, 22, 23)])
    est, q = st.bootstrap_mean_quantiles(d, [0.005, 0.995, 0.0005, 0.9995], seed=3)
    e2, lo, hi = st.bootstrap_mean_ci(d, alpha=0.01, seed=3)
    assert np.array_equal(est, e2) and np.array_equal(q[:, 0], lo) and np.array_equal(q[:, 1], hi)
    assert (q[:, 2] <= q[:, 0]).all() and (q[:, 3] >= q[:, 1]).all()


def test_average_replays_fills_missing_items_from_the_other_replay() -> None:
    a = np.array([[0.1, np.nan, 0.3, np.nan]])
    b = np.array([[0.3, 0.2, np.inf, np.nan]])
    out = st.average_replays([a, b])[0]
    assert out[:3] == pytest.approx([0.2, 0.2, 0.3]) and math.isnan(out[3])


# --- sequential judge over golden replays -----------------------------------------------------------


def _replay(seed: int, base_shift: float, n: int = 200) -> np.ndarray:
    rng = np.random.default_rng(seed)
    d = rng.standard_t(3, n) * 0.06
    d[rng.random(n) < 0.7] = 0.0
    return d + base_shift * (rng.random(n) < 0.5) * 2


@pytest.mark.parametrize(
    ("replays", "status", "pooled", "reason"),
    [
        # one replay: plain judge_paired at the full alpha
        ([_replay(30, -0.06)], "fail", 1, "significant_regression"),
        # the prompt set changed: only the latest replay counts
        ([_replay(31, -0.06, 150), _replay(32, 0.0)], "pass", 1, "within_effect_threshold"),
        # FP8 noise only: the pooled look passes
        ([_replay(33, 0.0), _replay(34, 0.0)], "pass", 2, "within_effect_threshold"),
        # a clear regression fails already on the latest replay
        ([_replay(35, -0.06), _replay(36, -0.06)], "fail", 1, "significant_regression"),
    ],
)
def test_paired_replays_table(replays: list, status: str, pooled: int, reason: str) -> None:
    j = judge_paired_replays(replays, direction="higher_is_better", effect_threshold=0.03, seed=1)
    assert (j.status, j.reason, j.detail["pooled_replays"]) == (status, reason, pooled)


def test_identical_replays_are_one_look_and_rotated_replays_are_concatenated() -> None:
    r = _replay(38, -0.02)
    same = judge_paired_replays([r, r.copy()], direction="higher_is_better", effect_threshold=0.0)
    alone = judge_paired(r, direction="higher_is_better", effect_threshold=0.0)
    assert same.detail["identical_replays"] and (same.ci_low, same.ci_high) == (alone.ci_low, alone.ci_high)
    r2 = _replay(39, -0.02)
    rot = judge_paired_replays([r, r2], direction="higher_is_better", effect_threshold=0.0, rotated=True)
    both = judge_paired(np.concatenate([r, r2]), direction="higher_is_better", effect_threshold=0.0, alpha=0.009)
    assert rot.detail["looks"]["rotated2"]["n"] == 400
    assert rot.detail["looks"]["rotated2"]["ci_high"] == pytest.approx(both.ci_high)


def test_paired_replays_pooled_look_catches_what_single_replays_miss() -> None:
    rng = np.random.default_rng(37)
    r1 = rng.normal(-0.03, 0.2, 200)
    r2 = -0.06 - r1 + rng.normal(0.0, 0.04, 200)  # noise anti-correlated across replays
    singles = [judge_paired(r, direction="higher_is_better", effect_threshold=0.0075, alpha=0.001, seed=1)
               for r in (r1, r2)]
    assert [s.status for s in singles] == ["marginal", "marginal"]
    j = judge_paired_replays([r1, r2], direction="higher_is_better", effect_threshold=0.0075, seed=1)
    assert (j.status, j.detail["pooled_replays"]) == ("fail", 2)
    looks = j.detail["looks"]
    assert looks["latest"]["alpha"] == pytest.approx(0.001) and looks["pooled2"]["alpha"] == pytest.approx(0.009)
    # the pooled look is the t interval of the per-item mean at its level, its spread prior scaled
    # by the replays' correlation (clipped at 0 here: each replay's prior halves in the mean)
    avg = (r1 + r2) / 2
    n = avg.size
    assert j.detail["replay_correlation"] == 0.0
    half = ss.t.ppf(1 - 0.009 / 2, n - 1) * math.sqrt(((n - 1) * avg.var(ddof=1) + 0.25) / (n + 1) / n)
    assert looks["pooled2"]["ci_low"] == pytest.approx(avg.mean() - half, rel=1e-3)
    assert looks["pooled2"]["ci_high"] == pytest.approx(avg.mean() + half, rel=1e-3)


def test_paired_replays_edge_cases() -> None:
    assert judge_paired_replays([], direction="higher_is_better", effect_threshold=0.01).reason == "too_few_items"
    bad = judge_paired_replays([[0.0] * 50], direction="higher_is_better", effect_threshold=0.01,
                               first_look_share=1.0)
    assert bad.status == "error"
    # first_look_share=0: the pooled look alone, at the full alpha
    j = judge_paired_replays([_replay(38, 0.0), _replay(39, 0.0)], direction="higher_is_better",
                             effect_threshold=0.01, first_look_share=0.0)
    assert list(j.detail["looks"]) == ["pooled2"] and j.detail["looks"]["pooled2"]["alpha"] == 0.01


# --- pooled live windows ----------------------------------------------------------------------------


def _sketch(values: np.ndarray, zeros: int = 0, accuracy: float = 0.01) -> QuantileSketch:
    sk = QuantileSketch(accuracy)
    for v in values:
        sk.add(float(v))
    for _ in range(zeros):
        sk.add(0.0)
    return sk


def test_pool_histograms_equals_merged_sketch() -> None:
    rng = np.random.default_rng(40)
    sketches = [_sketch(rng.lognormal(5.5, 0.5, 300), zeros=z) for z in (0, 3, 1)]
    merged = QuantileSketch(0.01)
    for sk in sketches[1:]:
        merged.merge(sk)
    hist, gamma = pool_histograms([s.to_dict() for s in sketches], pool_windows=2)
    assert gamma == pytest.approx(merged.gamma)
    z = zero_bucket_index(merged.gamma, merged.min_value)
    assert hist.pop(z) == 4 and z < min(merged.buckets)
    assert hist == merged.buckets
    # None windows are skipped, plain {index: count} mappings pool too
    assert pool_histograms([None, {1: 2}, {1: 3, 2: 1}]) == ({1: 5, 2: 1}, None)
    with pytest.raises(ValueError):
        pool_histograms([sketches[0].to_dict(), _sketch(np.array([5.0]), accuracy=0.02).to_dict()])
    with pytest.raises(ValueError):
        pool_histograms([{1: 1}], pool_windows=0)


@pytest.mark.parametrize(
    ("pool", "status"),
    [(1, "marginal"), (3, "fail")],
)
def test_pooled_latency_table(pool: int, status: str) -> None:
    # +25 % latency on windows of 150 requests: one window straddles a 5 % threshold, three fail
    rng = np.random.default_rng(46)
    cand = [_sketch(rng.lognormal(math.log(300 * 1.25), 0.6, 150)).to_dict() for _ in range(3)]
    base = [_sketch(rng.lognormal(math.log(300), 0.6, 150)).to_dict() for _ in range(3)]
    j = judge_unpaired_pooled(cand, base, pool_windows=pool, effect_threshold=0.05, metric="latency_ms")
    assert j.status == status and j.detail["pooled_windows"] == pool
    ch, g = pool_histograms(cand, pool_windows=pool)
    bh, _ = pool_histograms(base, pool_windows=pool)
    assert j.n == min(sum(ch.values()), sum(bh.values()))
    # the p-value is Mann-Whitney on the pooled bucket values (scipy)
    xs = np.repeat(list(ch), list(ch.values())).astype(float)
    ys = np.repeat(list(bh), list(bh.values())).astype(float)
    ref = ss.mannwhitneyu(xs, ys, method="asymptotic", use_continuity=True)
    assert j.p_value == pytest.approx(ref.pvalue, rel=1e-9)


def test_pooled_latency_errors_are_data() -> None:
    a = _sketch(np.array([5.0] * 60)).to_dict()
    b = _sketch(np.array([5.0] * 60), accuracy=0.02).to_dict()
    assert judge_unpaired_pooled([a], [b], effect_threshold=0.05).status == "error"
    assert judge_unpaired_pooled([{"bins": "x"}], [a], effect_threshold=0.05).status == "error"


@pytest.mark.parametrize(
    ("windows_c", "windows_b", "pool", "status", "reason"),
    [
        ([(2, 80), (3, 90), (2, 70)], [(1, 80), (0, 90), (1, 70)], 1, "inconclusive", "too_few_items"),
        ([(2, 80), (3, 90), (2, 70)], [(1, 80), (0, 90), (1, 70)], 3, "marginal", "straddles_threshold"),
        # +1.7 pts on 600-request windows: one window straddles a 0.5 pt threshold, three fail
        ([(15, 600), (15, 600), (15, 600)], [(5, 600), (5, 600), (5, 600)], 1, "marginal", "straddles_threshold"),
        ([(15, 600), (15, 600), (15, 600)], [(5, 600), (5, 600), (5, 600)], 3, "fail", "significant_regression"),
        # a missing window (None) is skipped: only two windows pool
        ([None, (15, 600), (15, 600)], [None, (5, 600), (5, 600)], 3, "marginal", "straddles_threshold"),
        ([(0, 600), (15, 600), (15, 600)], [(0, 600), (5, 600), (5, 600)], 3, "marginal", "straddles_threshold"),
    ],
)
def test_pooled_rate_table(windows_c: list, windows_b: list, pool: int, status: str, reason: str) -> None:
    j = judge_rate_pooled(windows_c, windows_b, pool_windows=pool, effect_threshold=0.005)
    assert (j.status, j.reason) == (status, reason)
    ce, cn = pool_counts(windows_c, pool_windows=pool)
    be, bn = pool_counts(windows_b, pool_windows=pool)
    if j.p_value is not None:
        assert j.p_value == judge_rate(ce, cn, be, bn, effect_threshold=0.005).p_value
        ref = ss.chi2_contingency(np.array([[ce, cn - ce], [be, bn - be]]), correction=False).pvalue
        assert j.p_value == pytest.approx(ref, rel=1e-9)


# --- the benchmark's exact Kayenta screen ------------------------------------------------------------


@pytest.mark.parametrize("direction", ["increase", "decrease"])
def test_kayenta_screen_is_exact(direction: str) -> None:
    from bench import baselines as bl

    rng = np.random.default_rng(42)
    x = np.round(rng.normal(0.0, 1.0, (300, 60)) + rng.normal(0, 0.5, (300, 1)), 1)  # ties
    y = np.round(rng.normal(0.0, 1.0, (300, 60)), 1)
    x[:40, :10] = np.nan
    y[30:70, 5:30] = np.nan
    _, lo, hi = bl._pairwise_shift_ci(x, y, 0.98)
    screened = bl._excludes_zero(x, y, 0.98, direction)
    exact = lo > 0 if direction == "increase" else hi < 0
    assert exact.sum() > 10 and np.array_equal(screened, exact)
    full = bl.kayenta_classify_many(x, y, direction=direction, allowed_ratios=[1.0])[1.0]
    assert np.array_equal(full == 1, bl.kayenta_classify(x, y, direction=direction, allowed_ratio=1.0) == 1)


def test_pooled_judges_work_from_their_own_module() -> None:
    import watchdog.policy.judge.pooled as judge_pool

    j = judge_pool.judge_rate_pooled([(30, 1000)], [(10, 1000)], pool_windows=3, effect_threshold=0.001)
    assert isinstance(j, Judgement) and j.status == "fail" and j.detail["pooled_windows"] == 1
