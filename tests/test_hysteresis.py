"""Hysteresis state machine: table tests of transitions."""

from __future__ import annotations

import json

import pytest

from watchdog.hysteresis import Hysteresis, HysteresisConfig, initial_state

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def run(cfg: HysteresisConfig, steps: list[tuple[float, str]], mode: str = "candidate"):
    hy = Hysteresis(cfg)
    state = initial_state(T0 - 10_000, mode)  # type: ignore[arg-type]
    out = []
    for dt, status in steps:
        state, tr = hy.step(state, status, T0 + dt)
        json.dumps(state)  # always JSON-able
        out.append(None if tr is None else (tr.kind, tr.reason))
    return state, out


@pytest.mark.parametrize(
    ("cfg", "steps", "expected_mode", "expected"),
    [
        # trip after 2 consecutive fails; a marginal in between breaks the streak
        (HysteresisConfig(trip_after=2, min_dwell_s=0),
         [(0, "fail"), (60, "marginal"), (120, "fail"), (180, "fail")], "rolled_back",
         [None, None, None, ("rollback", "2_consecutive_fails")]),
        # inconclusive and error never trip
        (HysteresisConfig(trip_after=1, min_dwell_s=0),
         [(0, "inconclusive"), (60, "error"), (120, "pass")], "candidate", [None, None, None]),
        # restore needs M passes AND the cooldown since the trip
        (HysteresisConfig(trip_after=1, restore_after=2, cooldown_s=600, min_dwell_s=0),
         [(0, "fail"), (60, "pass"), (120, "pass"), (700, "pass")], "candidate",
         [("rollback", "1_consecutive_fails"), None, None, ("restore", "3_consecutive_passes_after_cooldown")]),
        # marginal / inconclusive reset the pass streak
        (HysteresisConfig(trip_after=1, restore_after=2, cooldown_s=0, min_dwell_s=0),
         [(0, "fail"), (60, "pass"), (120, "marginal"), (180, "pass"), (240, "inconclusive"), (300, "pass"),
          (360, "pass")], "candidate",
         [("rollback", "1_consecutive_fails"), None, None, None, None, None,
          ("restore", "2_consecutive_passes_after_cooldown")]),
        # minimum dwell blocks a trip until it has elapsed
        (HysteresisConfig(trip_after=1, min_dwell_s=300),
         [(0, "pass")], "candidate", [None]),
        # manual roll-forward: restore_ready once, state stays rolled back
        (HysteresisConfig(trip_after=1, restore_after=1, cooldown_s=0, min_dwell_s=0, auto_restore=False),
         [(0, "fail"), (60, "pass"), (120, "pass")], "rolled_back",
         [("rollback", "1_consecutive_fails"), ("restore_ready", "manual_restore_required"), None]),
    ],
)
def test_transition_table(cfg, steps, expected_mode, expected) -> None:
    state, out = run(cfg, steps)
    assert out == expected
    assert state["mode"] == expected_mode


def test_min_dwell_blocks_then_allows() -> None:
    hy = Hysteresis(HysteresisConfig(trip_after=1, min_dwell_s=300))
    state = initial_state(T0)
    state, tr = hy.step(state, "fail", T0 + 100)
    assert tr is not None and (tr.kind, tr.reason) == ("blocked", "min_dwell") and state["mode"] == "candidate"
    state, tr = hy.step(state, "fail", T0 + 400)
    assert tr is not None and tr.kind == "rollback" and state["mode"] == "rolled_back"
    assert tr.detail["fails"] == 2 and tr.detail["status"] == "fail"


def test_daily_flip_budget_blocks_restore_not_rollback_and_resets_at_utc_midnight() -> None:
    cfg = HysteresisConfig(trip_after=1, restore_after=1, cooldown_s=0, min_dwell_s=0, max_flips_per_day=1)
    hy = Hysteresis(cfg)
    state = initial_state(T0)
    state, tr = hy.step(state, "fail", T0 + 1)
    assert tr.kind == "rollback" and state["flips_today"] == 1
    state, tr = hy.step(state, "pass", T0 + 2)
    assert (tr.kind, tr.reason) == ("blocked", "flip_budget_exhausted") and state["mode"] == "rolled_back"
    next_day = T0 + 86_400
    state, tr = hy.step(state, "pass", next_day)
    assert tr.kind == "restore" and state["flips_today"] == 1 and state["flip_day"] == "2027-01-16"
    # rollback is the safe direction: allowed even with the budget spent
    state, tr = hy.step(state, "fail", next_day + 1)
    assert tr.kind == "rollback" and state["flips_today"] == 2


def test_budget_can_block_rollback_when_configured() -> None:
    hy = Hysteresis(HysteresisConfig(trip_after=1, min_dwell_s=0, max_flips_per_day=0, budget_blocks_rollback=True))
    state, tr = hy.step(initial_state(T0), "fail", T0 + 1)
    assert (tr.kind, tr.reason) == ("blocked", "flip_budget_exhausted") and state["mode"] == "candidate"


def test_manual_restore_records_who() -> None:
    hy = Hysteresis(HysteresisConfig(trip_after=1, min_dwell_s=0, auto_restore=False))
    state, _ = hy.step(initial_state(T0), "fail", T0 + 1)
    state, tr = hy.manual_restore(state, T0 + 5, by="alice")
    assert tr is not None and (tr.kind, tr.reason, tr.detail["by"]) == ("restore", "manual_restore", "alice")
    assert state["mode"] == "candidate" and state["last"]["reason"] == "manual_restore"
    assert hy.manual_restore(state, T0 + 6)[1] is None  # nothing to restore


def test_state_round_trips_through_json() -> None:
    hy = Hysteresis(HysteresisConfig(trip_after=1, min_dwell_s=0))
    state, _ = hy.step(None, "fail", T0)
    again = json.loads(json.dumps(state))
    assert hy.step(again, "pass", T0 + 10) == hy.step(state, "pass", T0 + 10)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        HysteresisConfig(trip_after=0)
    with pytest.raises(ValueError):
        HysteresisConfig(cooldown_s=-1)
