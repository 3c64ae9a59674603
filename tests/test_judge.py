"""Statistical judge: known answers cross-checked against scipy, verdict rules, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as ss

from watchdog import judge_stats as st
from watchdog.judge import Judgement, attribute, combine, judge_paired, judge_rate, judge_unpaired


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
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.05, seed=1)
    assert (j.status, j.reason) == ("marginal", "significant_within_threshold")


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
    zeros = judge_paired(np.zeros(100), direction="higher_is_better", effect_threshold=0.01)
    assert zeros.status == "pass" and zeros.ci_low == 0.0 == zeros.ci_high and zeros.p_value == 1.0
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
    a = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=42)
    b = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=42)
    c = judge_paired(d, direction="higher_is_better", effect_threshold=0.01, seed=43)
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)
    assert (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)


def test_paired_bootstrap_interval_close_to_normal_theory() -> None:
    rng = np.random.default_rng(14)
    d = rng.normal(-0.02, 0.05, 400)
    j = judge_paired(d, direction="higher_is_better", effect_threshold=0.0, alpha=0.05, n_boot=4000)
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert j.ci_low == pytest.approx(d.mean() - 1.96 * se, abs=0.3 * se)
    assert j.ci_high == pytest.approx(d.mean() + 1.96 * se, abs=0.3 * se)


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
    return {int(i): int(c) for i, c in zip(idx, counts)}


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
