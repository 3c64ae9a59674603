"""bench/ordinary_days.py: the fleet's ordinary days through the shipped engine (--quick), and that the
generators draw what their names say."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench import ordinary_days as od


def test_quick_run_covers_every_shape_for_both_policies(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    assert od.main(["--quick", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    names = [r["shape"] for r in res["healthy"]]
    assert names == [d.name for d in od.SHAPES] and len(names) >= 5
    assert [r["shape"] for r in res["reported"]] == ["load-coupled"]
    for row in res["healthy"] + res["reported"]:
        assert row["windows"] == res["routes"] * res["windows_per_route"]
        assert set(row["rollbacks"]) == set(od.POLICIES) == set(row["upper95_per_10k"])
        assert all(u > 0 for u in row["upper95_per_10k"].values())
    # healthy ordinary days roll nothing back (a quick run is 80 windows per shape)
    assert all(k == 0 for row in res["healthy"] for k in row["rollbacks"].values()), res["healthy"]


def _sim(name: str, windows: int = 700) -> od.DaySim:
    return od.DaySim(next(d for d in od.SHAPES + od.REPORTED if d.name == name), 4, windows, 11)


def test_generators_draw_their_situations() -> None:
    s = _sim("shadow-collapse")
    assert s.share.min() <= 0.01 and s.share.max() == 0.15
    s = _sim("autoscale")
    assert set(np.unique(s.nrep["fp8"])) <= {6, 8, 10, 12} and np.unique(s.nrep["fp8"]).size > 1
    assert (s.nrep["fp16"] == 3).all()
    s = _sim("canary")     # one replica per precision on a new build while the others keep the old one
    mixed = [(s.bld[p][:, :, :s.k[p]].min(axis=2) != s.bld[p][:, :, :s.k[p]].max(axis=2)) for p in ("fp8", "fp16")]
    assert (mixed[0] & mixed[1]).sum() > 100
    s = _sim("rollout-day")   # FP8 switches first, FP16 a day later
    first = {p: int(np.argmax((s.bld[p][0, :, :s.k[p]] > 0).any(axis=1))) for p in ("fp8", "fp16")}
    assert first["fp16"] - first["fp8"] == 288
    s = _sim("creep-fp16")
    assert s.mult["fp16"].max() > 0.25 and np.abs(s.mult["fp8"]).max() == 0
    s = _sim("late-replica")
    assert s.skew and all(d in (1, 2) for _, _, d in s.skew.values())
    # per request FP8 = FP16: every shape's FP8 latency multiplier is the FP16 one's but for replicas,
    # builds in flight and (load-coupled) queueing on FP8's busier replicas
    s = _sim("load-coupled")
    diff = s.mult["fp8"][:, :, 0] - s.mult["fp16"][:, :, 0]
    assert diff.min() > 0.02 and diff.max() < 0.25


def test_cancellations_shorten_answers_and_leave_the_window() -> None:
    s = _sim("heavy-cancel", 200)
    (r, t, prec), _ = next(iter(s.cancel.items()))
    sigs = s.signals(t, [f"legal/d{i}" for i in range(4)])
    sig = next(x for x in sigs if x.route == f"legal/d{r}" and x.precision == prec)
    assert sig.detail["not_judged"]["cancelled"] > 0


def test_fp16_recovering_from_a_creep_stays_no_fp8_regression() -> None:
    """creep-fp16, one route (seed 3, 260 windows): 19 false rollbacks before the anchor bounded the
    learned level downward (docs/BENCHMARKS_decisions.md "Ordinary days"), none since."""
    from watchdog.policy.loader import load_policy_files

    ps = load_policy_files([str(p) for p in sorted((od.ROOT / "policies").glob("*.yaml"))])
    c = od.run_day(ps, next(d for d in od.SHAPES if d.name == "creep-fp16"), 1, 260, 3)
    assert c.windows == 260 and c.rollbacks == {p: 0 for p in od.POLICIES}, c.events
