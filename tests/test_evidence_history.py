"""The evidence recorder's per-route windows stay bounded (issue 18 item 3): a flood of routes whose
rules all pass keeps at most ``evidence.history_routes`` of them, a failing route keeps its windows
whatever the flood, a record whose windows were cut says so, and a route forgotten as idle
(``RouteKeeper.sweep``) leaves nothing behind in the recorder."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from tests.daemon_harness import write_policy
from tests.test_routes_bounded import PK0, T0, World
from watchdog.config.settings import EvidenceConfig
from watchdog.core.evidence_page import render_record
from watchdog.core.keys import Keys
from watchdog.core.metrics import Metrics
from watchdog.core.signals import Action, Signal
from watchdog.policy import PolicyEngine
from watchdog.policy.loader import load_policy_files
from watchdog.runtime.evidence import EvidenceRecorder

MODEL = "m"
RULES = ("shadow-agreement", "error-rate")


class Judge:
    """The test policy's engine and a recorder on it, fed one 10 s window per call as the daemon
    feeds them (``Decisions._decide_now``)."""

    def __init__(self, tmp: Path, engine: PolicyEngine | None = None, **evidence: int) -> None:
        self.engine = engine or PolicyEngine()
        self.engine.set_policy_set(load_policy_files([write_policy(tmp / "p.yaml")]))
        self.metrics = Metrics(CollectorRegistry())
        self.recorder = EvidenceRecorder(
            EvidenceConfig(**evidence),
            Keys("t"),
            None,
            self.engine,
            "i1",
            on_evict=self.metrics.evidence_history_evictions.inc,
        )
        self.flags: dict[tuple[str, str], str] = {}
        self.actions: list[Action] = []

    def window(self, routes: list[str], t0: float, bad: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        sigs = [
            Signal(
                source="live",
                model=MODEL,
                route=r,
                precision=p,
                start=t0,
                end=t0 + 10,
                samples=100,
                values={"error_rate": 0.2 if (r in bad and p == "fp8") else 0.01, "shadow_rougeL": 0.95},
            )
            for r in routes
            for p in ("fp8", "fp16")
        ]
        actions = self.engine.observe(sigs, t0 + 10, self.flags)
        self.recorder.observe(sigs, {(MODEL, r) for r in routes}, t0 + 10)
        for a in actions:
            self.recorder.decided(a, self.flags.get((a.model, a.route)))
            self.actions.append(a)
            if a.kind == "rollback":
                self.flags[(a.model, a.route)] = "fp16"

    def record_of(self, route: str) -> dict:
        (a,) = [a for a in self.actions if a.kind == "rollback" and a.route == route]
        return self.recorder._queue[a.detail["evidence"]]  # built, not written (no Redis here)

    def evictions(self) -> float:
        return self.metrics.evidence_history_evictions._value.get()


def statuses(record: dict, rule: str = "error-rate") -> list[str]:
    return [w["status"] for w in next(r for r in record["rules"] if r["name"] == rule)["before"]]


def test_a_flood_of_passing_routes_keeps_at_most_history_routes(tmp_path: Path) -> None:
    j = Judge(tmp_path, history_routes=40, windows_before=4)
    flood = [f"flood-{i:04d}" for i in range(1000)]
    for k in range(6):  # six windows of every route: more than windows_before
        j.window(flood, T0 + 10 * k)
    assert len(j.engine.states) == 1000  # the engine keeps them all (the route cap is not the recorder's)
    assert j.recorder.history_size() == (0, 40)
    assert j.evictions() == 6 * (1000 - 40) == j.recorder.history_evicted  # 960 per window
    kept = [ring for hist in j.recorder._calm.values() for ring in hist.values()]
    assert len(kept) == 40 * len(RULES) and {len(ring) for ring in kept} == {4}
    j.window(["late-1", "late-2"], T0 + 60)  # the least recently judged go first
    assert (
        {(MODEL, "late-1"), (MODEL, "late-2")}
        < j.recorder.routes_kept()
        < {(MODEL, r) for r in [*flood, "late-1", "late-2"]}
    )
    assert j.recorder.status()["history"] == {"watched": 0, "calm": 40, "max_calm": 40, "evicted": 5762}


def test_a_failing_route_keeps_its_windows_through_a_flood_and_a_cut_one_says_so(tmp_path: Path) -> None:
    j = Judge(tmp_path, history_routes=10, windows_before=6)
    flood = [f"flood-{i:04d}" for i in range(200)]
    for k in range(3):  # both judged healthy three times
        j.window(["steady", "cut"], T0 + 10 * k)
    j.window(["steady"], T0 + 30, bad={"steady"})  # steady starts failing: watched from now on
    j.window(flood, T0 + 30)  # the flood pushes "cut" (calm) out; "steady" stays
    assert (MODEL, "steady") in j.recorder.routes_kept() and (MODEL, "cut") not in j.recorder.routes_kept()
    assert j.recorder.history_size() == (1, 10)
    j.window(["steady"], T0 + 40, bad={"steady"})
    for k in (3, 4):
        j.window(["cut"], T0 + 10 * k, bad={"cut"})

    whole = j.record_of("steady")
    assert statuses(whole) == ["pass", "pass", "pass", "fail", "fail"]
    assert not whole["history_cut"] and {r["before_missing"] for r in whole["rules"]} == {0}

    cut = j.record_of("cut")
    assert statuses(cut) == ["fail", "fail"]  # its three passing windows were dropped by the flood ...
    assert cut["history_cut"] is True  # ... and the record says how many it misses
    assert {r["name"]: r["before_missing"] for r in cut["rules"]} == {"shadow-agreement": 3, "error-rate": 3}
    assert "3 earlier windows of this rule were judged but not kept" in render_record(cut, None, "no chart")
    assert "earlier windows" not in render_record(whole, None, "no chart")
    # rolled back, both serve the baseline: watched until they are promoted again
    assert {k[1:] for k in j.recorder._watched} == {(MODEL, "steady"), (MODEL, "cut")}


def test_a_route_forgotten_as_idle_leaves_nothing_in_the_recorder(tmp_path: Path) -> None:
    w = World(route_idle_s=60.0)
    j = Judge(tmp_path, engine=w.engine, history_routes=100)
    w.keeper.forget = j.recorder.forget  # what the daemon wires (Daemon.__init__)
    for i, r in enumerate(("idle", "busy", "failing")):
        w.fold(r, offset=i, ts=T0 - 100)
    w.own.parts[PK0].agg.close_due(T0)
    j.window(["idle", "busy", "failing"], T0 - 100)
    j.window(["failing"], T0 - 90, bad={"failing"})  # one failing window: watched, no incident yet
    assert j.recorder.routes_kept() == {(MODEL, "idle"), (MODEL, "busy"), (MODEL, "failing")}
    w.now += 61
    w.fold("busy", offset=10, ts=T0 + 55)
    assert w.keeper.sweep(w.now) == 2  # idle and failing (a failing streak alone holds no route)
    assert ("e2e", MODEL, "idle") not in w.engine.states
    assert j.recorder.routes_kept() == {(MODEL, "busy")}
    assert j.recorder.history_size() == (0, 1)
    # a revoked partition's routes leave the engine elsewhere (Ownership.forget): the next prune,
    # which runs from the loop's flush whether windows are judged or not, drops them too
    w.own.forget(PK0)
    assert not w.engine.states
    j.recorder.flush(T0 + 10_000)
    assert j.recorder.routes_kept() == set()
