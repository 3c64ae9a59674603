"""Smoke test of the decision benchmark (bench/decisions.py --quick): the shipped policies run
through PolicyEngine.observe on simulated fleet windows and golden replays."""

from __future__ import annotations

import json
from pathlib import Path

from bench import decisions


def test_quick_benchmark_runs_the_shipped_engine(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    assert decisions.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["quick"] and res["policies"] == ["fp8-default", "fp8-strict-legal-medical"]
    live = {(r["model"], r["routes"]): r for r in res["live"]}
    assert {m for m, _ in live} == {"iid", "replica-1/10", "replica-2/15", "replica-4/30"}
    for model in ("iid", "replica-1/10", "replica-2/15"):  # healthy traffic: no rollback at all
        for routes in ("legal", "chat"):
            assert live[(model, routes)]["rollbacks"] == 0, live[(model, routes)]
            assert live[(model, routes)]["windows"] == 4 * 30
    assert all(r["rollbacks"] == 0 for r in res["golden"]), res["golden"]
    power = {r["scenario"]: r["power"] for r in res["power"]}
    # a diffuse -0.03 ROUGE-L drop on 200 items is caught within 2 replays by the default policy
    assert power["golden -0.03 diffuse (golden-200)"] >= 0.75, power
    assert {r["baseline"] for r in res["baselines"]} == {"flagger", "kayenta"}
    # the fleet confounders (bench/fleet_confounders.py) run through the same engine
    assert {(r["model"], r["routes"]) for r in res["fleet"]} == {(m, s) for m in ("stalls", "deploys")
                                                                 for s in ("legal", "chat")}
    # the fleet situations (bench/fleet_traffic.py): thin and lopsided traffic roll nothing back,
    # the cold start and the low-traffic regressions are measured
    assert res["fleet_healthy"] and all(r["rollbacks"] == 0 for r in res["fleet_healthy"]), res["fleet_healthy"]
    scenarios = {r["scenario"] for r in res["fleet_power"]}
    assert any(s.startswith("cold start") for s in scenarios) and any("low-50" in s for s in scenarios)


def test_simulated_sketch_bins_have_the_distribution_of_bucketed_requests() -> None:
    """The benchmark draws a window's sketch bins as one multinomial over the buckets'
    probabilities instead of drawing every request: the counts must be those of bucketing
    real draws (chi-square of 400,000 requests each way, healthy and p99-only regressed)."""
    import math

    import numpy as np

    rng = np.random.default_rng(12)
    for p99 in (0.0, 0.10):
        mu = math.log(decisions.MEDIAN_MS) + 0.013
        z = rng.standard_normal(400_000)
        lat = np.exp(mu + decisions.SIGMA * z)
        if p99:
            lat = lat * decisions._tail(decisions._norm_cdf(z), p99)
        keys, counts = np.unique(np.ceil(np.log(lat) / decisions.LOG_G).astype(int), return_counts=True)
        k2, c2 = decisions._bin_counts(rng, 400_000, mu, p99)
        lo = min(keys[0], k2[0])
        a = np.bincount(keys - lo, counts, minlength=max(keys[-1], k2[-1]) - lo + 1)
        b = np.bincount(k2 - lo, c2, minlength=a.size)
        use = a + b > 40
        chi2 = float(((a[use] - b[use]) ** 2 / (a[use] + b[use])).sum())
        df = int(use.sum())
        assert chi2 < df + 4 * math.sqrt(2 * df), (p99, chi2, df)  # ~4 sd above the mean
        assert abs(counts.sum() - c2.sum()) == 0
