"""Coverage of the pooled look of two golden replays (``judge_paired_replays``): its spread prior
is scaled by the replays' correlation (``replay_correlation``), halved for independent jumps,
whole for persistent ones. A false rollback needs the interval to lie wholly on the harmful side
of the true mean; that one-sided error must stay within the coverage file's band (1.2 x nominal
alpha / 2 plus three Monte-Carlo standard errors) when the two replays are

* independent: every answer a fresh draw (sampled serving), sparse or heavy-tailed;
* persistent: 70 % of the items keep their difference, 30 % are redrawn (greedy decoding with
  batch-dependent kernels; the decision benchmark's golden model without learned levels).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_judge_coverage import TRUE_MEAN, _limit, heavy, sparse
from watchdog.policy.judge.paired import judge_paired_replays, replay_correlation

N_PAIRS = 8000
ALPHA = 0.01


def _pairs(kind: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    if kind == "independent-sparse":
        return sparse(rng, (N_PAIRS, n)), sparse(rng, (N_PAIRS, n)), TRUE_MEAN["sparse"]
    if kind == "independent-heavy":
        return heavy(rng, (N_PAIRS, n)), heavy(rng, (N_PAIRS, n)), TRUE_MEAN["heavy"]
    base = sparse(rng, (N_PAIRS, n))
    second = np.where(rng.random((N_PAIRS, n)) < 0.3, sparse(rng, (N_PAIRS, n)), base)
    first = np.where(rng.random((N_PAIRS, n)) < 0.3, sparse(rng, (N_PAIRS, n)), base)
    return first, second, TRUE_MEAN["sparse"]


@pytest.mark.parametrize(("kind", "n"), [("independent-sparse", 200), ("independent-sparse", 500),
                                         ("independent-heavy", 200), ("persistent-sparse", 200),
                                         ("persistent-sparse", 500)])
def test_pooled_look_harmful_tail_at_most_nominal(kind: str, n: int) -> None:
    a, b, mu = _pairs(kind, n, np.random.default_rng([n, len(kind)]))
    misses = 0
    for x, y in zip(a, b, strict=True):
        j = judge_paired_replays([x, y], direction="higher_is_better", effect_threshold=0.0, alpha=ALPHA,
                                 first_look_share=0.0)
        misses += j.ci_high is not None and j.ci_high < mu
    assert misses / N_PAIRS <= _limit(ALPHA / 2), f"{kind} n={n}: {misses}/{N_PAIRS} harmful misses"


def test_replay_correlation_is_clipped_and_conservative_when_undefined() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, 300)
    assert replay_correlation(x, x) == pytest.approx(1.0)
    assert replay_correlation(x, -x) == 0.0
    assert replay_correlation(np.zeros(300), x) == 1.0  # no spread: the whole prior
    assert replay_correlation(x[:2], x[:2]) == 1.0
    y = x + rng.normal(0, 1, 300)
    assert replay_correlation(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
