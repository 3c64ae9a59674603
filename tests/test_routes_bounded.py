"""Bounded routes without services: the caps in ``Ownership.fold``, what idle eviction keeps, the
``route-limit`` readiness reason, the config limits (watchdog/runtime/routes.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from watchdog.config.settings import load_config
from watchdog.core.events import InferenceEvent
from watchdog.core.metrics import Metrics
from watchdog.ingest.eventtime import Watermarks
from watchdog.policy import PolicyEngine
from watchdog.policy.state import ScopeState
from watchdog.runtime.health import Readiness
from watchdog.runtime.ownership import Ownership
from watchdog.runtime.routes import ROUTE_LIMIT_HOLD_S, RouteKeeper
from watchdog.state import partitions as P
from watchdog.windows.aggregator import WindowAggregator

T0 = 1_800_000_000.0
PK0, PK1 = ("t", 0), ("t", 1)


class World:
    def __init__(self, **windows: object) -> None:
        self.cfg = load_config(None, env={}, windows={"length_s": 10.0, **windows})
        self.now = T0
        self.metrics = Metrics(CollectorRegistry())
        self.readiness = Readiness(self.metrics, lambda *a: None, lambda *a: None)
        self.engine = PolicyEngine()
        self.wm = Watermarks(out_of_order_s=2.0, max_future_s=300.0)
        self.own = Ownership(self.cfg, self.engine, None, self.wm, self.readiness, None,  # type: ignore[arg-type]
                             lambda: self.now)
        for pk in (PK0, PK1):
            self.own.parts[pk] = P.Partition(pk, "tok", 0, WindowAggregator(length_s=10.0, grace_s=2.0,
                                                                           max_future_s=float("inf")))
            self.wm.assign(pk, None, self.now)
        self.flags: dict[P.Route, str] = {}
        self.pending: set[P.Route] = set()
        self.incidents: list[dict[str, object]] = []
        self.keeper = RouteKeeper(self.cfg, self.own, self.engine, self.readiness, self.metrics,
                                  lambda: self.flags, lambda: self.pending, lambda: self.incidents)

    def fold(self, route: str, pk: P.PartitionKey = PK0, ts: float | None = None, offset: int = 0) -> str | None:
        self.own.poll_now = self.now
        ev = InferenceEvent(f"{route}-{offset}", ts or self.now, "m", route, "fp8", "ok", 100.0)
        return self.own.fold(ev, pk, offset)


def test_new_routes_beyond_the_partition_cap_are_refused_known_ones_fold() -> None:
    w = World(max_routes_per_partition=3, max_routes=5)
    assert [w.fold(f"r{i}") for i in range(5)] == [None, None, None, "route_limit", "route_limit"]
    assert w.fold("r1") is None  # known: judged as before
    assert [w.fold(f"s{i}", PK1) for i in range(3)] == [None, None, "route_limit"]  # replica cap: 5
    assert w.own.route_limited == {"partition": 2, "replica": 1}
    assert len(w.own.route_part) == 5
    w.keeper.update(w.now)
    assert w.metrics.routes_active._value.get() == 5
    assert w.metrics.route_limit_events.labels("partition")._value.get() == 2
    assert any(p.startswith("route-limit:") for p in w.readiness.problems())
    w.now += ROUTE_LIMIT_HOLD_S + 1  # quiet for a minute: the reason clears
    w.keeper.update(w.now)
    assert not any(p.startswith("route-limit:") for p in w.readiness.problems())


def test_a_late_event_of_a_new_route_does_not_take_a_place() -> None:
    w = World(max_routes_per_partition=2)
    w.own.parts[PK0].agg.set_closed_end(int(T0 // 10))
    assert w.fold("late", ts=T0 - 100) == "late"
    assert w.own.parts[PK0].routes == set()


def test_idle_routes_are_forgotten_unless_something_holds_them() -> None:
    w = World(route_idle_s=60.0)
    names = ["idle", "flagged", "flipping", "incident", "st-pending", "st-alert", "st-serving", "open", "fresh"]
    for i, r in enumerate(names):
        w.fold(r, offset=i, ts=T0 - 100)  # their windows closed long ago...
        w.engine.states[("p", "m", r)] = ScopeState()
    w.own.parts[PK0].agg.close_due(T0)
    w.fold("open", offset=20, ts=T0 + 50)  # ... but for this one's, still open
    w.flags[("m", "flagged")] = "fp16"
    w.flags[("m", "idle")] = "fp8"  # a flag at the default does not hold a route
    w.pending.add(("m", "flipping"))
    w.incidents.append({"model": "m", "route": "incident"})
    w.engine.states[("p", "m", "st-pending")].pending = {"kind": "rollback", "precision": "fp16", "at": T0}
    w.engine.states[("p", "m", "st-alert")].open_alerts.add("rollback_blocked")
    w.engine.states[("p", "m", "st-serving")].serving = "fp16"
    w.now += 61
    w.fold("fresh", offset=30, ts=T0 + 55)
    assert w.keeper.sweep(w.now) == 1
    part = w.own.parts[PK0]
    assert part.routes == {("m", r) for r in names if r != "idle"}
    assert part.evicted == {("m", "idle")} and part.dirty
    assert ("p", "m", "idle") not in w.engine.states and ("m", "idle") not in w.own.route_part
    # the route comes back: a new route, and the next save no longer deletes its key
    assert w.fold("idle", offset=40, ts=T0 + 56) is None
    assert ("m", "idle") in part.routes and not part.evicted


@pytest.mark.parametrize("windows", [{"max_routes": 0}, {"max_routes_per_partition": -1}, {"route_idle_s": 0}])
def test_limits_are_validated(windows: dict[str, object]) -> None:
    with pytest.raises(Exception, match="greater than"):
        load_config(None, env={}, windows=windows)


def test_decisions_judge_at_most_max_routes_per_iteration_and_keep_each_routes_order() -> None:
    from watchdog.core.signals import Signal
    from watchdog.runtime.decisions import split_by_route

    def sig(route: str, end: float, model: str = "m") -> Signal:
        return Signal(source="live", model=model, route=route, precision="fp8", start=end - 10, end=end,
                      samples=1)

    signals = [sig("a", 10), sig("b", 10), sig("c", 10), sig("*", 10, "*"), sig("a", 20), sig("c", 20)]
    now, later = split_by_route(signals, 2)
    assert [(s.route, s.end) for s in now] == [("a", 10), ("b", 10), ("*", 10), ("a", 20)]
    assert [(s.route, s.end) for s in later] == [("c", 10), ("c", 20)]
    now, later = split_by_route(later + [sig("d", 30)], 2)
    assert [(s.route, s.end) for s in now] == [("c", 10), ("c", 20), ("d", 30)] and later == []


def test_routes_already_judged_go_before_new_ones() -> None:
    """A flood of new route names waits behind the routes the engine knows (their windows keep their
    order), so a real route's regression is judged in the iteration its window closes."""
    from watchdog.core.signals import Signal
    from watchdog.runtime.decisions import known_first, split_by_route

    def sig(route: str, end: float, model: str = "m") -> Signal:
        return Signal(source="live", model=model, route=route, precision="fp8", start=end - 10, end=end,
                      samples=1)

    flood = [sig(f"new{i}", 10) for i in range(300)]
    signals = flood[:150] + [sig("real", 10), sig("*", 10, "*")] + flood[150:] + [sig("real", 20)]
    ordered = known_first(signals, lambda m, r: r == "real")
    assert [(s.route, s.end) for s in ordered[:3]] == [("*", 10), ("real", 10), ("real", 20)]
    assert [s.route for s in ordered[3:]] == [s.route for s in flood]  # stable
    now, _later = split_by_route(ordered, 100)
    assert {("real", 10), ("real", 20)} <= {(s.route, s.end) for s in now}


@pytest.mark.parametrize("seed", range(5))
def test_route_chunks_take_what_splitting_again_and_again_took(seed: int) -> None:
    import random

    from watchdog.core.signals import Signal
    from watchdog.runtime.decisions import RouteChunks, split_by_route

    rng = random.Random(seed)
    signals = [Signal(source="live", model="*" if rng.random() < 0.03 else "m",
                      route=f"r{rng.randrange(40)}", precision=rng.choice(["fp8", "fp16"]), start=0.0,
                      end=float(i), samples=1) for i in range(rng.randrange(0, 300))]
    chunks, pending = RouteChunks(signals), signals
    while pending:
        n = rng.randrange(0, 9)
        want, pending = split_by_route(pending, n)
        assert chunks.take(n) == want
        assert chunks.rest() == pending
        assert chunks.rest_routes() == {(s.model, s.route) for s in pending}
        assert bool(chunks) == bool(pending)
