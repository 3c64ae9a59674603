"""The broken-items test at the extremes: infinite harm and the distance to a rollback in items."""

from __future__ import annotations

import math

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
