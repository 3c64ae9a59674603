"""A precision that stalls as a whole for a window (watchdog/policy/stalls.py): a pause on a precision's
only replica is not judged, a stall that lasts is; the shape it reads moves with a pause, not with the
request mix. Through the shipped engine and policies on bench/outside_check2.py's one-replica fleet."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from bench import outside_check2 as oc2
from bench.decisions import T0, WINDOW_S
from bench.outside_check import run_sim
from watchdog.policy import stalls
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.judge.fleet import within_tail_contrast
from watchdog.policy.loader import load_policy_files
from watchdog.windows.fleet import FleetStats

ROOT = Path(__file__).resolve().parents[1]
PS = load_policy_files(sorted((ROOT / "policies").glob("*.yaml")))
ONE_EACH = next(f for f in oc2.SHAPES if f.name == "gc-1v1")


def test_pauses_on_the_only_replica_roll_nothing_back(monkeypatch) -> None:
    f = dataclasses.replace(ONE_EACH, gc=0.15, host=0.05)  # a pause in a fifth of the windows
    seen = oc2.run_fleet(PS, f, 6, 80, 5)
    assert sum(seen.rollbacks.values()) == 0, seen.events
    monkeypatch.setattr(stalls, "STALL_DEV", math.inf)  # the same windows with the check off
    blind = oc2.run_fleet(PS, f, 6, 80, 5)
    assert blind.rollbacks["fp8-default"] >= 2, blind.events


def test_a_stall_that_lasts_is_judged() -> None:
    sim = oc2.FleetSim(dataclasses.replace(ONE_EACH, gc=0.0, host=0.0), 4, 90, 7)
    for r in range(4):
        for t in range(60, 90):
            sim.pause[(r, t)] = [("fp8", 0, 0.15)]  # FP8 makes 15 % of its requests x5 from window 60 on
    c = run_sim(PS, sim, 4, 90, "legal/h")
    assert all(60 + stalls.STALL_RUN - 1 <= t < 60 + stalls.STALL_RUN + 2 for t in c.first), c.first


def test_stalls_that_come_too_often_to_be_pauses_are_judged() -> None:
    sim = oc2.FleetSim(dataclasses.replace(ONE_EACH, gc=0.0, host=0.0), 4, 200, 9)
    rng = np.random.default_rng(9)
    for r in range(4):
        for t in range(60, 200):
            if rng.random() < 0.4 and not all((r, t - k) in sim.pause for k in (1, 2, 3)):
                sim.pause[(r, t)] = [("fp8", 0, 0.15)]  # FP8 stalls in ~40 % of windows, never 4 in a row
    c = run_sim(PS, sim, 4, 200, "legal/h")
    assert all(60 < t < 160 for t in c.first), c.first


def test_a_restart_from_a_checkpoint_neither_forgets_a_pause_nor_judges_it_again() -> None:
    """Engines restored from their exported state (what a checkpoint holds) between and inside runs of
    stalled windows give the same actions, verdicts and state, bit for bit, as one that kept running."""
    names = [f"legal/h{i}" for i in range(4)]
    sim = oc2.FleetSim(dataclasses.replace(ONE_EACH, gc=0.0, host=0.0), 4, 60, 13)
    for r in range(4):
        for t in (*range(20, 23), 30, 41, *range(50, 56)):  # runs of 3, single pauses, a run that is judged
            sim.pause[(r, t)] = [("fp8", 0, 0.15)]
    kept, restarted = PolicyEngine(PS), PolicyEngine(PS)
    acts: dict[str, list[str]] = {"kept": [], "restarted": []}
    held_at_restart = 0
    for t in range(60):
        sigs = sim.signals(t, names)
        if t in (21, 22, 31, 52, 54):
            held_at_restart += any(int(e.get("stall", 0)) for st in restarted.states.values()
                                   for rs in st.rules.values() for e in rs.pool)
            state = json.loads(json.dumps(restarted.export_state()))
            restarted = PolicyEngine(PS)
            restarted.import_state(state)
        now = T0 + (t + 1) * WINDOW_S + 1
        for name, eng in (("kept", kept), ("restarted", restarted)):
            acts[name] += [repr((a.kind, a.route, a.reason)) for a in eng.observe(sigs, now, {}, "fp8")]
    assert acts["kept"] == acts["restarted"]
    assert any("rollback" in a for a in acts["kept"])  # the run of 6 was judged, and so after each restart
    assert json.dumps(kept.verdicts(), sort_keys=True) == json.dumps(restarted.verdicts(), sort_keys=True)
    assert json.dumps(kept.export_state(), sort_keys=True) == json.dumps(restarted.export_state(), sort_keys=True)
    assert held_at_restart >= 3  # restarts fell inside runs of stalled windows


def _mix(lat: np.ndarray, prompt: np.ndarray) -> dict:
    f = FleetStats()
    f.buf = [(float(x), int(p), 100, "a") for x, p in zip(lat, prompt, strict=True)]
    return f.detail()["latency_mix"]


def test_the_shape_moves_with_a_pause_not_with_the_mix() -> None:
    rng = np.random.default_rng(3)

    def window(long_share: float, paused: float = 0.0) -> tuple[float, float]:
        n = 3000
        long = rng.random(n) < long_share
        prompt = np.where(long, 8000, 300)
        lat = np.where(long, 2000.0, 300.0) * np.exp(rng.normal(0, 0.25, n))
        lat[rng.random(n) < paused] *= 5.0
        got = within_tail_contrast(_mix(lat, prompt), stalls.SHAPE_P)
        assert got is not None
        return got

    base, more_long, paused = window(0.1), window(0.4), window(0.1, paused=0.05)
    assert abs(more_long[0] - base[0]) < 3 * math.sqrt(base[1] + more_long[1])
    assert paused[0] - base[0] > stalls.STALL_DEV
    assert within_tail_contrast({"cells": []}, stalls.SHAPE_P) is None  # a window without per-cell tails
