"""The CI subset of the fault drills (short forms; the full set is bench/drills.py).

Each drill runs real Tansu, redis-server, an alert sink and this checkout's daemon as a subprocess,
and asserts the spine's targets: 0 events lost, 0 counted twice, the expected flips and no guard
violation, exactly the expected pages, and readiness false exactly while something is wrong
(10 s tolerance around each fault edge and after each daemon start). ``LLMWD_DRILL_ROOT`` points
the drills at another checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.drills.catalog import CI_DRILLS, DRILLS
from tests.drills.runner import SESSION_ENV

pytestmark = [pytest.mark.services, pytest.mark.slow]
ROOT = Path(os.environ.get("LLMWD_DRILL_ROOT") or Path(__file__).resolve().parent.parent)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", CI_DRILLS)
def test_drill(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a 2 s Kafka session: each daemon start's group join takes 1 s instead of 3 s (bench/drills.py,
    # whose runs docs/RELIABILITY.md records, keeps 6 s)
    monkeypatch.setenv(SESSION_ENV, "2000")
    result = DRILLS[name](ROOT, tmp_path, False)
    assert result.produced > 0, f"{name}: no traffic was acked ({result.notes})"
    assert result.passed, f"{name}: " + "; ".join(result.failures() + result.notes)


@pytest.mark.timeout(150)
def test_sigkill_loop_with_packed_engine_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``redis.pack_engine_state`` on (the daemons read it from the environment): every restart restores
    the routes' engine state from packed values, and the counts stay exact."""
    monkeypatch.setenv("LLMWD_REDIS__PACK_ENGINE_STATE", "true")
    test_drill("sigkill-loop", tmp_path, monkeypatch)


def test_ledger_counts_a_lost_and_a_doubled_window_exactly() -> None:
    """The comparison itself, on hand-made counts: a window short by 3, one doubled, one beyond
    the cutoff (ignored)."""
    from collections import Counter

    from tests.drills.ledger import Result, compare_counts

    produced = Counter({("r0", "fp8", 10.0): 20, ("r0", "fp8", 11.0): 5, ("r1", "fp16", 10.0): 7,
                        ("r1", "fp16", 99.0): 4})
    samples = Counter({("r0", "fp8", 10.0): 17, ("r0", "fp8", 11.0): 10, ("r1", "fp16", 10.0): 7})
    records = Counter({("r0", "fp8", 10.0): 1, ("r0", "fp8", 11.0): 2, ("r1", "fp16", 10.0): 1})
    r = Result(drill="t")
    compare_counts(r, produced, samples, records, cutoff=50.0)
    assert (r.produced, r.recorded, r.lost, r.twice, r.windows_recorded_twice) == (32, 34, 3, 5, 1)


def test_guards_are_checked_against_audit_times() -> None:
    from tests.drills.harness import Guards
    from tests.drills.ledger import Expect, Result, check_flips

    flips = [{"route": "r0", "kind": "rollback", "at": 100.0, "previous": "fp8", "mode": "policy", "by": "a"},
             {"route": "r0", "kind": "promote", "at": 117.0, "previous": "fp16", "mode": "policy", "by": "b"},
             {"route": "r0", "kind": "rollback", "at": 300.0, "previous": "", "mode": "policy", "by": "a"}]
    r = Result(drill="t")
    check_flips(r, flips, Expect(flips={"r0": ["rollback", "promote"]}), Guards())
    assert r.flips_applied == 3 and r.flips_expected == 2
    assert any("promoted 17.0 s after rollback" in v for v in r.guard_violations)
    assert any("cooldown" in v for v in r.guard_violations)


def test_readiness_is_judged_against_fault_intervals_with_tolerance() -> None:
    """Ready during a fault counts as false-ready, not-ready outside as false-unready; samples within
    5 s of a fault edge or 10 s after a start are not judged."""
    from tests.drills.harness import Sample
    from tests.drills.ledger import Expect, Result, check_readiness

    samples = [Sample(float(t), "a", ready, []) for t, ready in
               [(12, True), (22, True), (30.5, True), (31, False), (40, False), (52, False), (58, True), (70, True)]]
    expect = Expect(faults=[(25.0, 55.0, "broker frozen", None)])
    r = Result(drill="t")
    check_readiness(r, samples, expect, {"a": [[0.0, 1.0]]}, 0.5)
    # judged: 12 (ok), 30.5 ready in the fault (wrong), 31 and 40 (ok), 70 (ok); 22, 52 and 58 lie
    # within 5 s of an edge
    assert (r.ready_samples, r.false_ready_s, r.false_unready_s) == (5, 0.5, 0.0)
