"""bench/outside_check2.py: the second outside check through the shipped engine (--quick), and that its
generators draw what their names say."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench import outside_check2 as oc2


def test_quick_healthy_run_covers_every_shape(tmp_path: Path) -> None:
    out = tmp_path / "res.json"
    assert oc2.main(["--quick", "--parts", "healthy", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["shape"] for r in res["healthy"]] == [f.name for f in oc2.SHAPES]
    rolled = {r["shape"]: r["rollbacks"]["fp8-default"] for r in res["healthy"]}
    assert all(k == 0 for k in rolled.values()), rolled  # gc-1v1 too, since a stall with no other replica


def _sim(name: str, windows: int = 400) -> oc2.FleetSim:
    return oc2.FleetSim(next(f for f in oc2.SHAPES if f.name == name), 4, windows, 11)


def test_generators_draw_their_situations() -> None:
    s = _sim("gc-2v12")
    assert s.k == {"fp8": 12, "fp16": 2} and s.pause
    assert any(len(v) == 2 and {p for p, _, _ in v} == {"fp8", "fp16"} for v in s.pause.values())   # a shared host
    s = _sim("deploy-fp8-named")
    sigs = s.signals(399, ["a", "b", "c", "d"])
    assert all("builds" in x.detail for x in sigs if x.precision == "fp8")
    assert not any("builds" in x.detail for x in sigs if x.precision == "fp16")
    first = {p: np.argmax(s.bld[p][:, :, 0] > 0, axis=1) for p in ("fp8", "fp16")}
    lag = np.abs(first["fp8"] - first["fp16"])
    assert ((lag >= 5) & (lag <= 8)).any()
    s = _sim("bias-flip20")
    flips = np.flatnonzero(np.diff(np.sign(s.bias_p[0])))
    assert set(np.diff(flips)) == {20}
    s = _sim("cold-noisy15")
    assert 0.1 < float(np.std(s.rep_off["fp8"])) < 0.2
