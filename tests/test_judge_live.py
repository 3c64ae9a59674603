"""Live rules against a learned null (watchdog/policy/judge/live.py) and the exact broken-items test."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.stats as ss

from watchdog.core.signals import Signal
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.judge import stats as st
from watchdog.policy.judge.live import (
    judge_learned,
    quantile_log_diff,
    sketch_log_quantile,
    sketch_log_tail_contrast,
    sketch_log_tail_mean,
)
from watchdog.policy.judge.paired import judge_broken
from watchdog.policy.loader import PolicySet, parse_policy_text
from watchdog.windows.sketch import QuantileSketch


def _ar1(rng: np.random.Generator, n: int, sd: float, rho: float = 0.95) -> np.ndarray:
    x = np.zeros(n)
    x[0] = rng.normal(0, sd)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + rng.normal(0, sd * math.sqrt(1 - rho * rho))
    return x


@pytest.mark.parametrize(("offset", "shift", "status"), [
    (0.04, 0.0, "pass"),      # a stable replica offset of +4 % is not a regression
    (-0.47, 0.0, "pass"),     # FP8 1.6x faster: the level is learned, nothing to judge
    (-0.47, 0.10, "fail"),    # ... and +10 % from there is a regression
    (0.0, 0.10, "fail"),
    (0.0, 0.02, "pass"),      # within the 3 % effect
])
def test_learned_null_judges_shifts_not_offsets(offset: float, shift: float, status: str) -> None:
    rng = np.random.default_rng(int(1000 * (offset + shift)) % 97)
    hist = offset + _ar1(rng, 96, 0.02) * 0.3 + rng.normal(0, 0.005, 96)
    pool = [(hist[-1] + shift + rng.normal(0, 0.005), 0.005**2) for _ in range(3)]
    j = judge_learned(pool, list(hist), effect_threshold=0.03, alpha=0.001, prior_sd=0.03, learn_min=24)
    assert j.status == status, j.message
    assert j.detail["learned"] and j.detail["null_windows"] == 96


def test_learned_null_credits_a_harmful_level_only_up_to_the_effect() -> None:
    hist = [0.20] * 40  # FP8 20 % slower from the first window: learned, but credited only 3 %
    j = judge_learned([(0.20, 1e-6)], hist, effect_threshold=0.03, alpha=0.001, prior_sd=0.01)
    assert j.detail["level"] == pytest.approx(0.03) and j.status == "fail"


def test_without_history_the_prior_between_window_sd_is_added() -> None:
    j = judge_learned([(0.05, 1e-6)] * 3, [], effect_threshold=0.0, alpha=0.01, prior_sd=0.03)
    z = st.z_quantile(0.995)
    assert not j.detail["learned"] and j.ci_low == pytest.approx(0.05 - z * math.sqrt(1e-6 / 3 + 0.03**2))
    assert j.status == "inconclusive" and j.reason == "learning_null"


def test_quantile_interval_of_a_sketch_covers_the_true_p99() -> None:
    rng = np.random.default_rng(3)
    true = math.log(800) + 0.35 * ss.norm.ppf(0.99)
    hits = 0
    for _ in range(200):
        sk = QuantileSketch()
        sk.add_many(list(np.exp(math.log(800) + 0.35 * rng.standard_normal(1000))))
        est, var = sketch_log_quantile(sk.to_dict(), 0.99)
        hits += abs(est - true) <= 1.96 * math.sqrt(var) + 0.01  # + the sketch's 1 % accuracy
    assert hits >= 180  # 95 % nominal; 200 draws: >= 90 % with margin for binning


def test_quantile_log_diff_sees_a_p99_only_change() -> None:
    rng = np.random.default_rng(4)
    z = rng.standard_normal(20000)
    base = np.exp(6 + 0.35 * z)
    u = ss.norm.cdf(z)
    cand = base * (1 + 0.10 * np.clip((u - 0.9) / 0.09, 0, 1))
    a, b = QuantileSketch(), QuantileSketch()
    a.add_many(list(cand))
    b.add_many(list(base))
    d99, v99 = quantile_log_diff(a.to_dict(), b.to_dict(), 0.99)
    d50, _ = quantile_log_diff(a.to_dict(), b.to_dict(), 0.5)
    assert d99 == pytest.approx(math.log(1.10), abs=0.03) and abs(d50) < 0.021
    assert d99 - 3 * math.sqrt(v99) > 0


@pytest.mark.parametrize(("k", "n", "p"), [(5, 32, 0.045), (14, 200, 0.02), (0, 10, 0.3), (3, 1000, 0.001), (200, 200, 0.5)])
def test_binomial_tail_matches_scipy(k: int, n: int, p: float) -> None:
    assert st.binom_sf(k, n, p) == pytest.approx(ss.binom.sf(k - 1, n, p), rel=1e-9)


def test_broken_items_ranks_the_damage_and_tests_it_exactly() -> None:
    d = [0.0] * 184 + [-0.6, -0.3, -0.9] + [-0.5] * 13
    j = judge_broken(d, direction="higher_is_better", drop=0.2, effect_threshold=0.0, null_broken=30,
                     null_items=2000, alpha=0.001, item_ids=[f"q{i}" for i in range(200)], metric="rougeL")
    assert j.status == "fail" and j.detail["broken_count"] == 16, j.message
    assert [b["item"] for b in j.detail["broken"][:3]] == ["q186", "q184", "q187"]
    healthy = judge_broken([0.0] * 197 + [-0.5] * 3, direction="higher_is_better", drop=0.2, effect_threshold=0.0,
                           null_broken=30, null_items=2000, alpha=0.001)
    assert healthy.status == "pass"


@pytest.mark.parametrize(("k", "total", "marked", "draws"), [(13, 4600, 82, 200), (0, 50, 5, 10), (3, 50, 10, 20),
                                                         (21, 30, 25, 20), (5, 40, 30, 10), (1, 10, 1, 1)])
def test_hypergeometric_tail_matches_scipy(k: int, total: int, marked: int, draws: int) -> None:
    assert st.hypergeom_sf(k, total, marked, draws) == pytest.approx(ss.hypergeom.sf(k - 1, total, marked, draws),
                                                                     rel=1e-9, abs=1e-300)


def test_broken_items_exact_test_holds_its_size_and_beats_the_bound_then_tail() -> None:
    """Fisher's exact test (effect 0): under the null (replay and history break at the same share)
    it rejects at most alpha of the time; at a count the old Wilson-bound-then-binomial-tail
    decision let pass (13 of 200 vs 69 of 4,400, the shape of 6 % of items destroyed) it fails."""
    rng = np.random.default_rng(5)
    alpha, p = 0.01, 0.016
    x, k0 = rng.binomial(200, p, 20_000), rng.binomial(4400, p, 20_000)
    cache: dict[tuple[int, int], bool] = {}
    fails = 0
    for xi, ki in zip(x.tolist(), k0.tolist(), strict=True):
        if (xi, ki) not in cache:
            j = judge_broken([-0.5] * xi + [0.0] * (200 - xi), direction="higher_is_better", drop=0.2,
                             effect_threshold=0.0, null_broken=ki, null_items=4400, alpha=alpha)
            cache[xi, ki] = j.status == "fail"
        fails += cache[xi, ki]
    assert fails / x.size <= alpha  # exact: conservative by discreteness, never above
    assert fails / x.size > alpha / 20  # and not a test that never fires
    j = judge_broken([-0.5] * 13 + [0.0] * 187, direction="higher_is_better", drop=0.2, effect_threshold=0.0,
                     null_broken=69, null_items=4400, alpha=1e-4)
    assert j.status == "fail" and j.detail["test"] == "fisher_exact" and j.p_value == pytest.approx(4.23e-5, rel=0.01)
    j12 = judge_broken([-0.5] * 12 + [0.0] * 188, direction="higher_is_better", drop=0.2, effect_threshold=0.0,
                       null_broken=69, null_items=4400, alpha=1e-4)
    assert j12.status == "pass"


def test_broken_alpha_is_taken_from_the_rules_alpha() -> None:
    text = """
policies:
  - name: p
    rules:
      - name: g
        source: golden
        metric: rougeL
        judge: {test: paired, effect: 0.0, alpha: 0.001, broken: {drop: 0.2, effect: 0.0, alpha: 0.002}}
        action: rollback
"""
    _, errors = parse_policy_text(text, "p.yaml")
    assert len(errors) == 1 and "broken.alpha (0.002)" in errors[0] and errors[0].startswith("p.yaml:8:"), errors
    ok, errors = parse_policy_text(text.replace("alpha: 0.002", "alpha: 0.0001"), "p.yaml")
    assert not errors
    judge = ok[0].rules[0].judge
    assert judge is not None and judge.broken_alpha == 0.0001 and judge.mean_alpha == pytest.approx(0.0009)


POLICY = """
policies:
  - name: p
    rules:
      - name: p99
        metric: latency_p99_ms
        judge: {test: quantile, q: 0.99, effect: 0.03, alpha: 0.001, min_items: 100, pool: 2, learn: 30, learn_min: 10}
        action: rollback
"""


def _window(t: int, rng: np.random.Generator, fp8_scale: float) -> list[Signal]:
    out = []
    for prec, scale in (("fp8", fp8_scale), ("fp16", 1.0)):
        sk = QuantileSketch()
        sk.add_many(list(scale * np.exp(6 + 0.3 * rng.standard_normal(2000))))
        out.append(Signal("live", "m", "r", prec, 300.0 * t, 300.0 * (t + 1), 2000, {}, None, None,
                          {"events": 2000, "latency_hist": sk.to_dict()}))
    return out


def test_engine_learns_the_null_and_keeps_it_in_its_state() -> None:
    policies, errors = parse_policy_text(POLICY, "p.yaml")
    assert not errors
    engine = PolicyEngine(PolicySet(tuple(policies)))
    rng = np.random.default_rng(5)
    flags = {("m", "r"): "fp8"}
    for t in range(40):  # FP8 runs 5 % slower on its replicas: a stable offset
        assert engine.observe(_window(t, rng, 1.05), 300.0 * (t + 1) + 1, flags) == []
    rs = engine.states[("p", "m", "r")].rules["p99"]
    assert len(rs.null) == 30 and rs.last is not None and rs.last.status == "pass"
    saved = json.loads(json.dumps(engine.export_state(), allow_nan=False))
    other = PolicyEngine(PolicySet(tuple(policies)))
    other.import_state(saved)
    assert other.states[("p", "m", "r")].rules["p99"].null == rs.null
    acts = []
    for t in range(40, 43):  # then +25 %
        acts += other.observe(_window(t, rng, 1.05 * 1.25), 300.0 * (t + 1) + 1, flags)
    assert acts and acts[0].kind == "rollback" and acts[0].detail["rules"] == ["p99"]


# --- the tail contrast (relative_to: mean) and the sampling null ------------------------------


def _bucketed(x: np.ndarray, acc: float = 0.01) -> dict[str, object]:
    """A sketch export of ``x`` (the QuantileSketch's log buckets), without the per-value loop."""
    keys, counts = np.unique(np.ceil(np.log(x) / math.log((1 + acc) / (1 - acc))).astype(int), return_counts=True)
    return {"relative_accuracy": acc, "bins": np.column_stack((keys, counts)).tolist()}


@pytest.mark.parametrize(("n", "p", "sigma"), [(1000, 0.95, 0.35), (1000, 0.9, 0.35), (300, 0.9, 0.6), (5000, 0.8, 0.35)])
def test_tail_contrast_variance_matches_its_sampling_variance(n: int, p: float, sigma: float) -> None:
    """The influence-function variance of (tail mean - mean) of one sketch against the spread
    of 2,000 simulated windows: the two terms are correlated, so neither the sum nor the tail
    mean's own variance would match."""
    rng = np.random.default_rng(int(n * p))
    est, var = [], []
    for _ in range(2000):
        e, v = sketch_log_tail_contrast(_bucketed(np.exp(6 + sigma * rng.standard_normal(n))), p)
        est.append(e)
        var.append(v)
    ratio = float(np.var(est, ddof=1) / np.mean(var))
    assert 0.9 < ratio < 1.1, ratio  # 2,000 draws: the ratio's own sd is ~0.03
    v_tail = np.mean([sketch_log_tail_mean(_bucketed(np.exp(6 + sigma * rng.standard_normal(n))), p)[1]  # type: ignore[index]
                      for _ in range(200)])
    assert np.mean(var) < 0.9 * v_tail  # and it is smaller than the tail mean's alone


def test_tail_contrast_ignores_a_scale_change_and_sees_a_tail_change() -> None:
    rng = np.random.default_rng(8)
    z = rng.standard_normal(20000)
    base = np.exp(6 + 0.35 * z)
    tail_only = base * (1 + 0.10 * np.clip((ss.norm.cdf(z) - 0.9) / 0.09, 0, 1))
    ref = sketch_log_tail_contrast(_bucketed(base), 0.95)
    assert ref is not None
    for scale in (0.625, 1.04, 1.3):  # a 1.6x speed-up, a replica offset, a slow hour
        other = sketch_log_tail_contrast(_bucketed(base * scale), 0.95)
        assert other is not None and other[0] == pytest.approx(ref[0], abs=0.004)  # bucket width 0.02
    bad = quantile_log_diff(_bucketed(tail_only), _bucketed(base), 0.99, tail=0.95, relative_to="mean")
    assert bad is not None and bad[0] == pytest.approx(0.068, abs=0.008)
    assert bad[0] > 4 * math.sqrt(bad[1])
    scaled = quantile_log_diff(_bucketed(base * 1.3), _bucketed(base), 0.99, tail=0.95, relative_to="mean")
    assert scaled is not None and abs(scaled[0]) < 0.004


def _stationary(rng: np.random.Generator, n: int, v: float, excess_sd: float) -> tuple[list[float], list[float]]:
    e = rng.normal(0, math.sqrt(v), n) + rng.normal(0, excess_sd, n)
    return list(e), [v] * n


@pytest.mark.parametrize("excess_sd", [0.0, 0.03])
def test_sampling_null_scales_the_stated_variance_by_the_learned_dispersion(excess_sd: float) -> None:
    rng = np.random.default_rng(21)
    v = 0.01**2
    hist, hv = _stationary(rng, 200, v, excess_sd)
    j = judge_learned([(0.01, v)] * 5, hist, null_v=hv, null_model="sampling", effect_threshold=0.0, alpha=1e-4,
                      prior_sd=0.02, recent=48)
    assert j.method == "learned_null_sampling" and j.detail["learned"] and j.status == "pass", j.message
    phi = j.detail["dispersion"]
    # dispersion: 1 for sampling noise alone, 1 + 0.03^2 / 0.01^2 = 10 with the excess
    assert phi == pytest.approx(1.0 + excess_sd**2 / v, rel=0.4)  # df 132: its sd is ~12 %
    df = 2 * 199 / 3 + 2
    half = st.t_quantile(1 - 5e-5, df) * math.sqrt(phi * (v / 5 + v / 48))
    assert j.ci_high - j.estimate == pytest.approx(half)
    # +4 %: 8.5 sampling sds, but within the spread of an excess of 3 % per window
    strong = judge_learned([(0.04, v)] * 5, hist, null_v=hv, null_model="sampling", effect_threshold=0.0,
                           alpha=1e-4, prior_sd=0.02, recent=48)
    assert strong.status == ("fail" if excess_sd == 0.0 else "pass"), strong.message


def test_sampling_null_without_stated_variances_falls_back_to_the_residual_model() -> None:
    rng = np.random.default_rng(2)
    hist, _ = _stationary(rng, 100, 1e-4, 0.0)
    j = judge_learned([(0.0, 1e-4)] * 3, hist, null_v=[math.nan] * 100, null_model="sampling",
                      effect_threshold=0.0, alpha=0.01, prior_sd=0.01)
    assert j.method == "learned_null" and j.detail["learned"]


@pytest.mark.parametrize("excess_ratio", [0.0, 1.0, 4.0])
def test_sampling_null_false_alarm_rate_is_near_nominal(excess_ratio: float) -> None:
    """Healthy stationary histories (sampling noise, plus a between-window excess of 0, 1 or 4
    times the sampling variance): the one-sided harmful rate of the sampling null at alpha 0.02
    stays within [0.3, 1.6] x nominal (2,000 pools; 1 % nominal, binomial sd 0.22 %)."""
    rng = np.random.default_rng(int(10 * excess_ratio) + 1)
    v, k, hits, trials = 0.01**2, 5, 0, 2000
    for _ in range(trials):
        e, hv = _stationary(rng, 140, v * rng.uniform(0.5, 2.0), math.sqrt(excess_ratio * v))
        j = judge_learned([(x, hv[0]) for x in e[-k:]], e[:-k], null_v=hv[:-k], null_model="sampling",
                          effect_threshold=0.0, alpha=0.02, prior_sd=0.01, recent=24)
        hits += j.ci_low > 0
    assert 0.3 * 0.01 * trials <= hits <= 1.6 * 0.01 * trials, hits


def test_a_level_learned_before_a_gap_is_judged_at_the_gaps_distance() -> None:
    """After a deploy's settling time (bench/outside_check.py ``maint-one-side``: 2 false rollbacks in
    2,500 windows) the pool is compared with a level learned 4-7 windows earlier (simulated here:
    AR(1) difference, sd 2 %, rho 0.9, 6 windows apart: harmful tail 7.8x nominal without the gap,
    1.0x with it; 1.0x at gap 0 either way); a wandering level
    (AR(1) pool offsets) predicts worse there than right before the pool. The residual model measures
    the history's residuals at that distance: the harmful tail is near nominal with the gap, several
    times nominal without it."""
    rng = np.random.default_rng(17)
    gap, k, alpha = 6, 3, 0.02
    fails = {0: 0, gap: 0}
    sims = 1500
    for _ in range(sims):
        x = _ar1(rng, 200 + gap + k, 0.02, rho=0.9) + rng.normal(0, 0.004, 200 + gap + k)
        hist, pool = list(x[:200]), [(float(e), 0.004**2) for e in x[200 + gap:]]
        for g in fails:
            j = judge_learned(pool, hist, effect_threshold=0.0, alpha=alpha, prior_sd=0.015, learn_min=24, recent=3,
                              level_cap=1.0, gap=g)
            fails[g] += j.status == "fail"
    assert fails[0] / sims > 4 * alpha / 2          # the adjacent-window residual is too narrow (~8x)
    assert fails[gap] / sims < 1.5 * alpha / 2      # measured at the gap: about nominal (~1.0x)
    # no gap: exactly the statistic as before
    x = list(_ar1(rng, 100, 0.02))
    a = judge_learned([(0.01, 1e-5)] * 3, x, effect_threshold=0.0, alpha=0.01, prior_sd=0.015, recent=3)
    b = judge_learned([(0.01, 1e-5)] * 3, x, effect_threshold=0.0, alpha=0.01, prior_sd=0.015, recent=3, gap=0)
    assert a.ci_low == b.ci_low and a.detail["gap"] == 0
