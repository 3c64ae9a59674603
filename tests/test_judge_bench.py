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
