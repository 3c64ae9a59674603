"""The broken-items test at the extremes: infinite harm and the distance to a rollback in items."""

from __future__ import annotations

import math

import numpy as np
import pytest

from watchdog.policy.judge.paired import broken_items_to_fail, judge_broken


def test_infinite_harm_is_a_broken_item_and_nan_is_not_measured() -> None:
    """A harmful infinite difference (a metric that blew up) is the surest break, never dropped;
    NaN marks an item that was not measured (missing in one replay)."""
    d = [-math.inf] * 30 + [math.nan] * 5 + [math.inf] * 2
    j = judge_broken(d, direction="higher_is_better", drop=0.2, effect_threshold=0.0, null_broken=6,
                     null_items=400, alpha=1e-4)
    assert j.status == "fail" and j.detail["broken_count"] == 30 and j.n == 32, j.message
    assert all(math.isfinite(b["harm"]) for b in j.detail["broken"])  # JSON-able
    lower = judge_broken([math.inf] * 32, direction="lower_is_better", drop=0.2, effect_threshold=0.0,
                         null_broken=6, null_items=400, alpha=1e-4)
    assert lower.status == "fail" and lower.detail["broken_count"] == 32


@pytest.mark.parametrize("effect", [0.0, 0.02])
@pytest.mark.parametrize(("n", "k0", "n0"), [(32, 6, 400), (200, 69, 4400), (30, 0, 400)])
def test_broken_items_to_fail_is_the_smallest_failing_count(n: int, k0: int, n0: int, effect: float) -> None:
    k = broken_items_to_fail(n, null_broken=k0, null_items=n0, alpha=1e-4, effect_threshold=effect)
    assert k is not None

    def status(x: int) -> str:
        return judge_broken([-0.5] * x + [0.0] * (n - x), direction="higher_is_better", drop=0.2,
                            effect_threshold=effect, null_broken=k0, null_items=n0, alpha=1e-4, min_items=1).status

    assert status(k) == "fail" and status(k - 1) == "pass"
    assert broken_items_to_fail(3, null_broken=200, null_items=400, alpha=1e-4) is None
    # the demo's numbers: 32 items against the default policy's prior null (1.5 % of 400)
    assert broken_items_to_fail(32, null_broken=6, null_items=400, alpha=1e-4) == 6


@pytest.mark.parametrize(("n", "n_aa"), [(200, 200), (200, 400), (400, 400)])
def test_aa_null_size_is_at_most_alpha_and_not_far_below(n: int, n_aa: int) -> None:
    """The A/A-null test's exact false-rollback probability, worst case over the baseline's true
    harmful-side share q: the A/A pass moves M ~ Binomial(n_aa, 2 q) items (half of them count),
    FP8 breaks X ~ Binomial(n, q + tolerance) at the null's boundary, and the test fails when X
    reaches the line for that M. Summed exactly over M; at most alpha for every q, and within
    a factor 3 of it (the earlier Beta on the half-count was 27 times below it at n_aa 200)."""
    from scipy import stats

    alpha, tol = 1e-4, 0.015
    moves = np.arange(0, 81)
    lines = np.array([broken_items_to_fail(n, null_broken=m / 2, null_items=n_aa, alpha=alpha, tolerance=tol)
                      or n + 1 for m in moves])
    sizes = []
    for q in np.linspace(0.0, 0.05, 21):
        pm = stats.binom.pmf(moves, n_aa, 2 * q)
        assert 1 - pm.sum() < 1e-7  # the enumeration covers the A/A counts that matter
        sizes.append(float((pm * stats.binom.sf(lines - 1, n, q + tol)).sum()))
    assert max(sizes) <= alpha
    assert max(sizes) >= alpha / 3
