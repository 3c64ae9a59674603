"""The cheaper paths of the per-window judge give the same bits as the paths they replace
(bench/judge_cost.py measures them; the decisions must not move): the one-comparison rate interval
and verdict rule against the vectorised ones, the replica matrix against the plain-Python build it
replaced, the stacked replica statistics against separate calls, clean_side's early exit against
its full loop, and the window memo's scope."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import numpy as np
import pytest

from watchdog.policy.judge import fleet
from watchdog.policy.judge import sequential as seq
from watchdog.policy.judge import stats as st
from watchdog.policy.judge.memo import cached, window_memo


def _bits(x: float) -> str:
    return float(x).hex()


def test_rate_interval_of_one_comparison_has_the_vectorised_bits() -> None:
    rng = random.Random(1)
    cases = [(0, 200, 0, 200), (200, 200, 0, 200), (0, 1, 1, 1), (3, 7000, 2, 350)]
    for _ in range(4000):
        n1, n2 = rng.choice([1, 2, 20, 200, 1000, 7000, 10**6]), rng.choice([1, 3, 200, 350, 5000])
        cases.append((rng.randint(0, n1), n1, rng.randint(0, n2), n2))
    for k1, n1, k2, n2 in cases:
        alpha = rng.choice([0.005, 0.01, 0.05, 0.0005])
        one = st.rate_diff_ci_one(k1, n1, k2, n2, alpha)
        ref = [float(v) for v in st.rate_diff_ci(k1, n1, k2, n2, alpha)]
        assert [_bits(v) for v in one] == [_bits(v) for v in ref], (k1, n1, k2, n2, alpha)


def test_verdict_rule_of_one_interval_matches_classify() -> None:
    rng = random.Random(2)
    edges = [0.0, 0.01, -0.01, 0.005, math.nan, math.inf, -math.inf, 1e-12]
    for _ in range(5000):
        lo = rng.choice(edges) if rng.random() < 0.3 else rng.uniform(-0.05, 0.05)
        hi = rng.choice(edges) if rng.random() < 0.3 else lo + rng.uniform(0, 0.05)
        n = rng.choice([0, 1, 199, 200, 5000])
        kw = dict(effect_threshold=rng.choice([0.0, 0.005, 0.01]),
                  marginal_threshold=rng.choice([None, 0.0, 0.002]), min_n=rng.choice([1, 200]),
                  max_ci_width=rng.choice([None, 0.02]))
        with np.errstate(invalid="ignore"):  # inf - inf
            code, reason = st.classify(np.array([lo]), np.array([hi]), np.array([n]), **kw)  # type: ignore[arg-type]
        assert st.classify_one(lo, hi, n, **kw) == (int(code[0]), str(reason[0]))  # type: ignore[arg-type]


def _matrix_reference(replicas):
    """The plain-Python build ``fleet._matrix`` replaced (d6eacdb)."""
    ids = sorted(replicas)
    hists = [replicas[i].get("latency_hist") or {} for i in ids]
    acc = float(next((h["relative_accuracy"] for h in hists if "relative_accuracy" in h), 0.01))
    lg = math.log((1.0 + acc) / (1.0 - acc))
    keys = sorted({int(k) for h in hists for k, c in h.get("bins", []) if int(c) > 0})
    pos = {k: j for j, k in enumerate(keys)}
    mat = np.zeros((len(ids), len(keys)))
    for r, h in enumerate(hists):
        for k, c in h.get("bins", []):
            if int(c) > 0:
                mat[r, pos[int(k)]] += int(c)
    idx = np.asarray(keys, dtype=float)
    return ids, (idx - 0.5) * lg, mat, lg, idx


def _replicas(rng: random.Random) -> dict:
    def rep(n: int, off: float) -> dict:
        b: dict[int, int] = {}
        for _ in range(n):
            k = math.ceil((6.5 + off + rng.gauss(0, 0.35) * (5 if rng.random() < 0.03 else 1)) / 0.02)
            b[k] = b.get(k, 0) + 1
        bins = [[k, c] for k, c in sorted(b.items())]
        if bins and rng.random() < 0.2:
            bins.append([bins[0][0], 0])  # an empty bucket
        if rng.random() < 0.2:
            bins.append([rng.randint(-5, 5), rng.randint(0, 3)])  # a repeated or far bucket
        return {"latency_hist": {"relative_accuracy": 0.01, "bins": bins}, "cells": []}

    m = rng.randint(2, 12)
    reps = {f"r{i}": rep(rng.choice([0, 1, 2, 5, 19, 20, 30, 300, 1500]), rng.gauss(0, 0.05)) for i in range(m)}
    if rng.random() < 0.2:
        reps["r0"] = rep(rng.choice([300, 1500]), rng.choice([0.5, 1.5]))  # a stalled replica
    if rng.random() < 0.1:
        reps["_other"] = rep(500, 0.5)
    return reps


def test_replica_matrix_is_the_plain_build() -> None:
    rng = random.Random(3)
    for _ in range(1500):
        reps = _replicas(rng)
        ref, new = _matrix_reference(reps), fleet._matrix(reps)
        assert ref[0] == new[0] and ref[3] == new[3]
        for a, b in zip(ref[1:], new[1:], strict=True):
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_stacked_rows_have_the_bits_of_separate_calls() -> None:
    rs = np.random.default_rng(5)
    for _ in range(1500):
        m, width = int(rs.integers(1, 34)), int(rs.integers(1, 300))
        x = (np.sort(rs.integers(-50, 800, width)).astype(float) - 0.5) * 0.0199
        a = rs.integers(0, 50, (m, width)).astype(float) * (rs.random((m, width)) < 0.6)
        b = rs.integers(0, 500, (m, width)).astype(float)
        both = np.concatenate((a, b))
        for f in (lambda c, x=x: fleet._mean_rows(x, c), lambda c, x=x: fleet._contrast_rows(x, c, 0.95)):
            sa, sb, s2 = f(a), f(b), f(both)
            for i in range(2):
                assert np.array_equal(np.concatenate((sa[i], sb[i])), s2[i], equal_nan=True)


def test_clean_side_early_exit_finds_what_the_loop_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4)
    opts = fleet.FleetOptions(replicas="robust")
    found = 0
    for _ in range(600):
        reps = _replicas(rng)
        fast = fleet.clean_side(reps, opts)
        with monkeypatch.context() as m:
            m.setattr(fleet, "counts_at_least", lambda r, least: True)  # always run the loop
            try:
                full = fleet.clean_side(reps, opts)
            except ValueError:  # the loop cannot take a matrix without buckets; the exit can
                assert fast == []
                continue
        assert fast == full
        found += bool(full)
    assert found > 20  # stalled replicas were found (the comparison covered both outcomes)


def test_memo_keeps_results_only_inside_a_window() -> None:
    calls = []

    def compute() -> int:
        calls.append(1)
        return len(calls)

    obj = {"a": 1}
    assert cached("k", (obj,), (), compute) == 1
    assert cached("k", (obj,), (), compute) == 2  # no memo outside a window
    with window_memo():
        assert cached("k", (obj,), (), compute) == 3
        assert cached("k", (obj,), (), compute) == 3
        assert cached("k", (obj,), (0.9,), compute) == 4  # other parameters, another entry
        assert cached("k", ({"a": 1},), (), compute) == 5  # an equal but other object
        with window_memo():
            assert cached("k", (obj,), (), compute) == 6  # a nested window starts empty
        assert cached("k", (obj,), (), compute) == 3
    assert cached("k", (obj,), (), compute) == 7


def _evaluate_reference(state, *, alpha, gamma, tolerance, windows, power=0.8):
    """``sequential.evaluate`` as it was (d6eacdb): one log LR per test in ``max``, then again."""
    tests = [[t[0], t[1], float(t[2]) - tolerance * float(t[3]), float(t[3])]
             for t in state.get("tests", []) if float(t[3]) > 0]
    out = {"reject": False, "log_lr": 0.0, "threshold": math.log(1.0 / alpha), "tests": len(tests),
           "windows": 0, "estimate": None, "se": None, "mde_now": math.inf, "mde_horizon": math.inf}
    w = state.get("w")
    if w is not None and float(w) > 0:
        out["mde_horizon"] = _mde_reference(windows / float(w), alpha, gamma, tolerance, power)
    if not tests:
        return out
    best = max(tests, key=lambda t: seq.log_mixture_lr(float(t[2]), float(t[3]), gamma))
    llr = seq.log_mixture_lr(float(best[2]), float(best[3]), gamma)
    oldest = max(tests, key=lambda t: float(t[3]))
    out.update(reject=llr >= out["threshold"], log_lr=llr, windows=int(best[1]),
               estimate=tolerance + float(best[2]) / float(best[3]), se=1.0 / math.sqrt(float(best[3])),
               mde_now=_mde_reference(float(oldest[3]), alpha, gamma, tolerance, power), oldest_windows=int(oldest[1]))
    return out


def _mde_reference(info, alpha, gamma, tolerance, power):
    """``sequential.mde`` as it was: ``boundary`` with all 8 fixed-point steps."""
    if info <= 0:
        return math.inf
    base = 2.0 * (math.log(1.0 / alpha) - math.log(2.0) + 0.5 * math.log1p(gamma * gamma * info))
    z = math.sqrt(max(base, 1e-12))
    for _ in range(8):
        z = math.sqrt(max(base - 2.0 * seq._log_phi(z), 1e-12))
    b = z * math.sqrt(1.0 / (gamma * gamma) + info) / info if gamma > 0 else math.inf
    return tolerance + b + NormalDist().inv_cdf(power) / math.sqrt(info)


def test_horizon_evaluation_has_the_bits_of_the_plain_one() -> None:
    rng = random.Random(6)
    for _ in range(500):
        state = seq.new_state()
        between = rng.choice([0.0, 0.01, 0.02])
        shift = rng.choice([0.0, 0.02, 0.08, -0.05])
        for i in range(rng.randint(0, 120)):
            v = rng.choice([1e-5, 1e-3, 0.05, 2.0]) * rng.random()
            seq.update(state, shift + rng.gauss(0, math.sqrt(v + between**2)), v, end=float(i),
                       between_sd=between, restart=rng.choice([1, 6]), windows=rng.choice([12, 48, 288]))
        kw = dict(alpha=rng.choice([0.0005, 0.005]), gamma=rng.choice([0.03, 0.05, 0.01]),
                  tolerance=rng.choice([0.0, 0.005, 0.05]), windows=48)
        new, ref = seq.evaluate(state, **kw), _evaluate_reference(state, **kw)
        assert new.keys() == ref.keys()
        for k in ref:
            assert repr(new[k]) == repr(ref[k]), (k, new[k], ref[k])


def test_null_before_the_pool_is_the_plain_selection() -> None:
    from watchdog.policy.pooling import _null_before

    def plain(null, first):
        past = [x for x in null if float(x.get("end", math.inf)) <= first]
        return [float(x["e"]) for x in past], [float(x.get("v", math.nan)) for x in past]

    rng = random.Random(7)
    for _ in range(500):
        null = [{"end": float(i * 10), "e": rng.gauss(0, 0.02), "v": rng.random() * 1e-4} for i in range(rng.randint(0, 300))]
        if null and rng.random() < 0.3:
            del rng.choice(null)["v"]  # states saved before ``v`` was kept
        if null and rng.random() < 0.2:
            del rng.choice(null)["end"]
        if null and rng.random() < 0.1:
            rng.shuffle(null)
        if null and rng.random() < 0.1:
            rng.choice(null)["e"] = 1  # an int from an old JSON state
        first = rng.choice([0.0, 5.0, 1000.0, 2990.0, 1e9, math.nan])
        assert repr(_null_before(null, first)) == repr(plain(null, first))
    with pytest.raises(KeyError):  # a selected window without a difference is an error, as before
        _null_before([{"end": 1.0}], 5.0)
    assert _null_before([{"end": 9.0}], 5.0) == ([], [])  # ... an unselected one is not
