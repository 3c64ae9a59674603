"""Work spread over loop iterations so that many routes do not stall the loop: closing windows within
a budget (watchdog/runtime/closer.py: a route's precisions together, every event still counted
once) and the judgeability gauges read a chunk of scopes per iteration (runtime/decisions.py)."""

from __future__ import annotations

import json
import time

import pytest

from tests.daemon_harness import CountingProducer, make_config, recorded_windows, running_daemon, write_policy
from tests.helpers import wait_until
from watchdog.core.events import decode_event
from watchdog.core.metrics import Metrics
from watchdog.runtime import closer, decisions
from watchdog.runtime.stats import DaemonStats
from watchdog.windows.aggregator import WindowAggregator


def _event(route: str, precision: str, ts: float) -> object:
    return decode_event(json.dumps({"schema": 1, "request_id": f"{route}-{precision}-{ts}", "ts": ts, "model": "m",
                                    "route": route, "precision": precision, "status": "ok",
                                    "latency_ms": 5.0}).encode())


def test_a_limited_close_takes_the_oldest_whole_routes_and_the_rest_count_as_closed() -> None:
    agg = WindowAggregator(length_s=10.0, grace_s=1.0, max_future_s=float("inf"))
    for r in range(5):
        for prec in ("fp8", "fp16", "int4"):
            assert agg.add(_event(f"r{r}", prec, 1_000.0 + r), ("t", 0), r)
    first = agg.close_due(1_012.0, limit=4)
    # 4 windows asked: the second route's three precisions come whole
    assert [(s.route, s.precision) for s in first] == [(f"r{r}", p) for r in (0, 1) for p in ("fp16", "fp8", "int4")]
    assert agg.is_closed(1_003.0)  # its window is due: an event for it is late even though it is still open
    assert not agg.add(_event("r4", "fp8", 1_004.5), ("t", 0), 9)
    rest = agg.close_due(1_012.0)
    assert sorted({s.route for s in rest}) == ["r2", "r3", "r4"] and len(rest) == 9
    assert agg.close_due(1_012.0) == [] and agg.open_windows() == 0


@pytest.mark.services
def test_windows_closed_in_chunks_count_every_event_once(kafka_service, redis_service, redis_client, topic,
                                                         tmp_path, monkeypatch):
    monkeypatch.setattr(closer, "CLOSE_BUDGET_S", 0.0)  # every iteration closes one chunk, then stops
    monkeypatch.setattr(closer, "CLOSE_CHUNK", 7)
    behind = []
    closed_in: dict[tuple[str, str, float], int] = {}
    real = closer.WindowCloser.close_windows

    def spy(self, now):  # type: ignore[no-untyped-def]
        out = real(self, now)
        behind.append(self.behind)
        for s in out:  # a route's windows (fp8 and fp16) of one time close in one call
            assert closed_in.setdefault((s.model, s.route, s.end), len(behind)) == len(behind), s
        return out

    monkeypatch.setattr(closer.WindowCloser, "close_windows", spy)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3})
    prod = CountingProducer(kafka_service.address, topic, [f"r{i:03d}" for i in range(120)], rate=4.0).start()
    try:
        with running_daemon(cfg) as (daemon, _server):
            wait_until(lambda: daemon.stats.windows_closed >= 600, 60)
            prod.stop()
            wait_until(lambda: sum(recorded_windows(redis_client)[0].values()) >= prod.total(), 30)
            time.sleep(0.5)
    finally:
        if prod._thread.is_alive():
            prod.stop()
    seen, twice = recorded_windows(redis_client)
    assert twice == 0 and seen == dict(prod.acked)
    assert any(behind)  # the budget really split closes over iterations


@pytest.mark.services
def test_the_judgeability_gauges_fill_over_several_iterations(kafka_service, redis_service, topic, tmp_path,
                                                              monkeypatch):
    monkeypatch.setattr(decisions, "JUDGEABILITY_EVERY_S", 0.5)
    monkeypatch.setattr(decisions, "JUDGEABILITY_CHUNK", 2)  # 2 scopes per iteration: a pass takes several
    sizes: list[int] = []
    real = decisions.state_judgeability_rows

    def spy(policy_set, states):  # type: ignore[no-untyped-def]
        sizes.append(len(states))
        return real(policy_set, states)

    monkeypatch.setattr(decisions, "state_judgeability_rows", spy)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3})
    routes = [f"j{i}" for i in range(7)]
    prod = CountingProducer(kafka_service.address, topic, routes, rate=20.0).start()
    try:
        with running_daemon(cfg) as (daemon, _server):
            def exported() -> set[str]:
                fams = daemon.metrics.registry.collect()
                return {s.labels["route"] for f in fams if f.name == "llmwd_rule_judged" for s in f.samples}

            wait_until(lambda: exported() >= set(routes), 40, what="every route's judgeability exported")
            assert max(sizes) <= 2 and len(sizes) >= 4
    finally:
        prod.stop()


@pytest.mark.services
def test_judging_a_route_per_chunk_and_windows_encoded_ahead_count_every_event_once(
        kafka_service, redis_service, redis_client, topic, tmp_path, monkeypatch):
    """The judging backlog kept between iterations (one route per chunk, so it spans many) and open
    windows encoded ahead of their saves (a few per slice, saves waiting for them), through a graceful
    restart mid-traffic: every event is in exactly one recorded window."""
    from watchdog.runtime import checkpointer

    monkeypatch.setattr(decisions, "DECIDE_CHUNK_S", 1e-9)  # one route per chunk
    monkeypatch.setattr(decisions, "DECIDE_BUDGET_S", 0.0)  # and one chunk per iteration
    monkeypatch.setattr(checkpointer, "PREENCODE_MAX_WINDOWS", 6)
    monkeypatch.setattr(checkpointer, "PREENCODE_SLICE", 2)
    backlog: list[int] = []
    encoded: list[int] = []
    real_decide = decisions.Decisions.decide
    real_ahead = WindowAggregator.encode_ahead

    def decide(self, signals, now):  # type: ignore[no-untyped-def]
        real_decide(self, signals, now)
        backlog.append(len(self.deferred_routes))

    def encode_ahead(self, n):  # type: ignore[no-untyped-def]
        done = real_ahead(self, n)
        encoded.append(done)
        return done

    monkeypatch.setattr(decisions.Decisions, "decide", decide)
    monkeypatch.setattr(WindowAggregator, "encode_ahead", encode_ahead)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3})
    prod = CountingProducer(kafka_service.address, topic, [f"r{i:02d}" for i in range(40)], rate=6.0).start()
    try:
        with running_daemon(cfg) as (daemon, _server):
            wait_until(lambda: daemon.stats.windows_closed >= 200 and daemon.stats.checkpoints >= 4, 60)
        with running_daemon(cfg) as (daemon, _server):  # resumes from the checkpoints the first one wrote
            wait_until(lambda: daemon.stats.windows_closed >= 200, 60)
            prod.stop()
            wait_until(lambda: sum(recorded_windows(redis_client)[0].values()) >= prod.total(), 30)
            time.sleep(0.5)
    finally:
        if prod._thread.is_alive():
            prod.stop()
    seen, twice = recorded_windows(redis_client)
    assert twice == 0 and seen == dict(prod.acked)
    assert max(backlog) > 1  # routes really waited over iterations to be judged
    assert sum(encoded) > 0  # and windows were encoded ahead of saves


class _Watermark:
    """The watermark ``WindowCloser.close_windows`` reads, set by the test."""

    def __init__(self) -> None:
        self.t: float | None = None

    def close_time(self, now: float) -> float | None:
        return self.t

    def mark(self, pk: object) -> None:
        return None


def test_closed_at_is_the_iteration_in_which_the_watermark_passed_the_windows_end(tmp_path) -> None:
    cfg = make_config("127.0.0.1:1", 1, "t", write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 10.0, "grace_s": 2.0})
    wm = _Watermark()
    ownership = type("Parts", (), {"parts": {}})()
    c = closer.WindowCloser(cfg, wm, ownership, Metrics(), DaemonStats(), clock=lambda: 0.0)  # type: ignore[arg-type]
    assert c.closed_at(1_000.0) is None  # no watermark yet
    for now, t in ((100.0, 1_005.0), (101.0, 1_009.9), (103.0, 1_010.5), (104.0, 1_019.0)):
        wm.t = t
        c.close_windows(now)
    # the watermark is event time less the grace: it passed 1,000 (and every earlier end) by the first iteration
    assert c.closed_at(990.0) == c.closed_at(1_000.0) == 100.0
    assert c.closed_at(1_010.0) == 103.0  # not 101: the watermark was still short of it there
    assert c.closed_at(1_020.0) is None
    for i in range(closer.CLOSINGS_KEPT):
        wm.t = 1_030.0 + 10 * i
        c.close_windows(200.0 + i)
    assert c.closed_at(1_010.0) is None  # before the boundaries kept: not a time to count from
    assert c.closed_at(1_030.0) == 200.0
    assert c.closed_at(1_030.0 + 10 * (closer.CLOSINGS_KEPT - 1)) == 200.0 + closer.CLOSINGS_KEPT - 1


class _QuietIngest:
    """What ``WindowCloser.confirm_idle`` reads of ``Ingest``: no record handed over this poll from either
    partition, both read up to the log end the broker answers; records of ``waiting`` still in the buffer."""

    held = False

    def __init__(self, waiting: set[tuple[str, int]]) -> None:
        self.broker_wait = type("Wait", (), {"last_s": 0.0})()
        self.last_polled: set[tuple[str, int]] = set()
        self.next_offset = {("t", 0): 500, ("t", 1): 500}
        self.waiting = waiting

    def end_offsets(self, pkeys: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
        return {pk: 500 for pk in pkeys}

    def holds(self, pk: tuple[str, int]) -> bool:
        return pk in self.waiting

    def position(self, pk: tuple[str, int]) -> int:
        return self.next_offset[pk]


def test_a_partition_with_records_in_the_buffer_is_not_confirmed_caught_up(tmp_path) -> None:
    """Tansu can answer a log end (the start of the last batch + 1) that a position inside that batch has
    passed: a partition whose records still wait in ``Ingest``'s buffer is not idle, whatever it answers."""
    cfg = make_config("127.0.0.1:1", 1, "t", write_policy(tmp_path / "p.yaml"), None)
    confirmed: list[object] = []
    wm = type("Wm", (), {"confirm_caught_up": lambda self, pk, asked: confirmed.append(pk)})()
    ownership = type("Parts", (), {"parts": {("t", 0): None, ("t", 1): None}, "check_topic_id": lambda self, now: None})()
    c = closer.WindowCloser(cfg, wm, ownership, Metrics(), DaemonStats(), clock=lambda: 0.0)  # type: ignore[arg-type]
    c.attach(_QuietIngest(waiting={("t", 1)}))  # type: ignore[arg-type]
    c.confirm_idle(1_000.0)
    assert confirmed == [("t", 0)]
