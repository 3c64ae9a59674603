"""bench/outside_check3.py: the third outside check through the shipped engine (--quick): no healthy live or
golden shape rolls back, golden-batch apart (an A/A pass at another batch size than the FP8 pass is a harness
protocol the product's replay never runs: docs/BENCHMARKS_decisions.md, "Outside check, third pass")."""

from __future__ import annotations

import json
from pathlib import Path

from bench import outside_check3 as oc3


def test_quick_healthy_and_golden_runs_roll_nothing_back(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    assert oc3.main(["--quick", "--parts", "healthy,golden", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["healthy"] + res["golden"] + res["reported"]
    assert {r["shape"] for r in res["golden"]} >= {"golden-shuffled", "golden-edited-nan"}
    rolled = {r["shape"]: r["rollbacks"] for r in rows if r["shape"] != "golden-batch"}
    assert rolled and all(n == 0 for per in rolled.values() for n in per.values()), rolled
