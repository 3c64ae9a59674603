"""The cheaper paths of the per-window judge give the same bits as the paths they replace
(bench/judge_cost.py measures them; the decisions must not move): the one-comparison rate interval
and verdict rule against the vectorised ones, the replica matrix against the plain-Python build it
replaced, the stacked replica statistics against separate calls, clean_side's early exit against
its full loop, and the window memo's scope."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from watchdog.policy.judge import fleet
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
            m.setattr(fleet, "_counts_at_least", lambda r, least: True)  # always run the loop
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
