"""Coverage of the golden interval (judge_stats.t_mean_ci), proven by simulation.

Golden-like per-item differences of a higher-is-better metric (ROUGE-L), three shapes:

* sparse:       the measured healthy FP8 shape (docs/DRIFT.md, 3,000-step run): 86.7 % unchanged, rare jumps of
                0.2-0.8 either way (more up than down), small noise otherwise;
* heavy:        Student t with 3 degrees of freedom, scale 0.05;
* concentrated: the sparse shape plus 6 % of items destroyed (-0.3 to -0.7).

A false rollback needs the interval to lie wholly on the harmful side of the truth: for a
higher-is-better metric, its upper end below the true mean. We check that this one-sided error
is at most 1.2 x its nominal alpha / 2 at the levels the shipped policies use, for n = 30-500.

Tolerance: with N simulated replays and a true error rate p, the count of misses is binomial;
we allow the observed rate up to 1.2 p + 3 sqrt(p / N) (three Monte-Carlo standard errors above
the +20 % band), so a correct interval fails this test with probability below 0.2 % per case.
N = 20,000 replays per case keeps the file at about a second (vectorised: one call per case).
The other tail (interval above the truth: a missed regression, not a false rollback) is
conservative or near nominal except for concentrated damage at large n - the broken-items test
covers that shape (docs/JUDGE.md, "Golden intervals").
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from watchdog.policy.judge import stats as st

N_SIM = 20_000


def sparse(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    nz = rng.random(shape) < 0.133
    u = rng.random(shape)
    big = rng.uniform(0.2, 0.8, shape)
    small = rng.normal(0, 0.07, shape)
    return np.where(nz, np.where(u < 0.09, -big, np.where(u < 0.26, big, small)), 0.0)


def heavy(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return 0.05 * rng.standard_t(3, shape)


def concentrated(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return np.where(rng.random(shape) < 0.06, -rng.uniform(0.3, 0.7, shape), sparse(rng, shape))


#: true means, from the shapes' definitions
TRUE_MEAN = {
    "sparse": 0.133 * (0.17 * 0.5 - 0.09 * 0.5),
    "heavy": 0.0,
    "concentrated": 0.94 * 0.133 * (0.17 * 0.5 - 0.09 * 0.5) - 0.06 * 0.5,
}
SHAPES = {"sparse": sparse, "heavy": heavy, "concentrated": concentrated}


def _limit(p: float) -> float:
    return 1.2 * p + 3 * math.sqrt(p / N_SIM)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("n", [30, 100, 200, 500])
def test_harmful_tail_at_most_nominal(shape: str, n: int) -> None:
    rng = np.random.default_rng(1000 + n)
    x = SHAPES[shape](rng, (N_SIM, n))
    mu = TRUE_MEAN[shape]
    for alpha in (0.01, 0.002):
        _, lo, hi = st.t_mean_ci(x, alpha=alpha)
        harmful = float(np.mean(hi < mu))
        assert harmful <= _limit(alpha / 2), (shape, n, alpha, harmful / (alpha / 2))


@pytest.mark.parametrize("n", [100, 200, 500])
def test_plain_t_within_20_percent_on_heavy_tails(n: int) -> None:
    """Without the spread prior the interval is Student t, whose two tails on heavy-tailed
    (symmetric) differences are within +-20 % of nominal at alpha 0.01 (both tails pooled)."""
    rng = np.random.default_rng(2000 + n)
    x = heavy(rng, (N_SIM, n))
    _, lo, hi = st.t_mean_ci(x, alpha=0.01, prior_jump=0.0)
    miss = float(np.mean((lo > 0) | (hi < 0)))
    tol = 0.2 * 0.01 + 3 * math.sqrt(0.01 / N_SIM)
    assert abs(miss - 0.01) <= tol, miss / 0.01


def test_the_old_percentile_bootstrap_under_covers_where_the_prior_does_not() -> None:
    """Why the bootstrap went: on the sparse shape at n = 100 its harmful tail is several times
    nominal; the t interval with the spread prior stays below it (same replays)."""
    rng = np.random.default_rng(7)
    x = sparse(rng, (4000, 100))
    mu = TRUE_MEAN["sparse"]
    _, blo, bhi = st.bootstrap_mean_ci(x, alpha=0.01, n_boot=1000, seed=1)
    _, tlo, thi = st.t_mean_ci(x, alpha=0.01)
    assert float(np.mean(bhi < mu)) > 3 * 0.005
    assert float(np.mean(thi < mu)) <= _limit(0.005)
