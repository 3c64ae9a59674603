"""Back-pressure (watchdog/runtime/daemon.py ``_hold_reading``): while judging closed windows or saving the
partitions runs behind, reading from Kafka is held, so what the replica cannot judge and save in time waits in
Kafka, not in its memory; every event still counts once."""

from __future__ import annotations

import time

import pytest

from tests.daemon_harness import CountingProducer, make_config, recorded_windows, running_daemon, write_policy
from tests.helpers import wait_until
from watchdog.core.signals import Signal
from watchdog.ingest.consumer import Ingest
from watchdog.policy.engine import PolicyEngine
from watchdog.runtime import daemon as daemon_mod
from watchdog.runtime.decisions import Backlog
from watchdog.state.checkpoint import CheckpointStore


def _signal(route: str, precision: str = "fp8", end: float = 1.0) -> Signal:
    return Signal(source="live", model="m", route=route, precision=precision, start=end - 1.0, end=end, samples=1,
                  values={}, detail={})


def test_the_backlog_age_is_its_longest_waiting_route_whatever_its_rank(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("watchdog.runtime.decisions.time.monotonic", lambda: clock[0])
    backlog = Backlog(lambda model, route: 2 if route.startswith("new") else 1)
    assert backlog.age(100.0) == 0.0 and len(backlog) == 0
    backlog.add([_signal("new-a")])
    clock[0] = 103.0
    backlog.add([_signal("known-b"), _signal("new-a", "fp16")])  # new-a keeps its first arrival
    assert len(backlog) == 2
    assert backlog.age(110.0) == 10.0
    assert [s.route for s in backlog.take(1)] == ["known-b"]  # rank 1 first; new-a still waits
    assert backlog.age(110.0) == 10.0
    backlog.take(1)
    assert backlog.age(110.0) == 0.0 and len(backlog) == 0
    backlog.add([_signal("known-c")])
    backlog.drop({("m", "known-c")})
    assert backlog.age(200.0) == 0.0 and not backlog.since


def test_the_backlog_counts_a_routes_windows_not_its_precisions_signals() -> None:
    backlog = Backlog(lambda model, route: 1)
    backlog.add([_signal(r, p, 10.0) for r in ("a", "b") for p in ("fp8", "fp16")])
    assert backlog.windows == 2 and backlog.windows_per_route() == 1.0  # one window each, two precisions
    backlog.add([_signal("a", p, 20.0) for p in ("fp8", "fp16")])  # a's next window closed before it was judged
    assert backlog.windows == 3 and backlog.windows_per_route() == 1.5
    backlog.take(1)
    assert backlog.windows == 1 and backlog.windows_per_route() == 1.0
    backlog.drop({("m", "b")})
    assert backlog.windows == 0 and backlog.windows_per_route() == 0.0 and not backlog.ends


def _watch_reading(monkeypatch) -> tuple[list[int], list[bool]]:  # type: ignore[no-untyped-def]
    """Records read by each poll made while reading was held, and every hold(on) the daemon called."""
    real_poll, real_hold = Ingest.poll, Ingest.hold
    read_while_held: list[int] = []
    held: list[bool] = []

    def poll(self, timeout_ms: int = 200) -> int:  # type: ignore[no-untyped-def]
        was = self.held
        seen = real_poll(self, timeout_ms)
        if was:
            read_while_held.append(seen)
        return seen

    def hold(self, on: bool) -> None:  # type: ignore[no-untyped-def]
        held.append(on)
        real_hold(self, on)

    monkeypatch.setattr(Ingest, "poll", poll)
    monkeypatch.setattr(Ingest, "hold", hold)
    return read_while_held, held


@pytest.mark.services
def test_reading_is_held_while_judging_runs_behind_and_every_event_counts_once(kafka_service, redis_service,
                                                                               redis_client, topic, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setattr(daemon_mod, "HOLD_AFTER_MIN_S", 1.0)  # 1 s windows: hold once a window waited 1 s
    real_observe = PolicyEngine.observe

    def slow_observe(self, signals, *args, **kwargs):  # type: ignore[no-untyped-def]
        # judging 20 routes' windows takes ~3 s: three times a window, so judging falls behind
        time.sleep(0.15 * len({s.route for s in signals}))
        return real_observe(self, signals, *args, **kwargs)

    monkeypatch.setattr(PolicyEngine, "observe", slow_observe)
    read_while_held, held = _watch_reading(monkeypatch)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3})
    prod = CountingProducer(kafka_service.address, topic, [f"r{i:02d}" for i in range(20)], rate=5.0).start()
    ages: list[float] = []
    try:
        with running_daemon(cfg) as (daemon, _server):
            # 8 s of traffic, and on a slow machine on until reading was held (at most 30 s)
            t0 = time.monotonic()
            while time.monotonic() < t0 + 8.0 or (True not in held and time.monotonic() < t0 + 30.0):
                ages.append(daemon.metrics.registry.get_sample_value("llmwd_judging_backlog_seconds"))
                time.sleep(0.1)
            prod.stop()
            wait_until(lambda: sum(recorded_windows(redis_client)[0].values()) >= prod.total(), 60)
            wait_until(lambda: not daemon.ingest.held and not daemon.decisions.backlog, 30)
    finally:
        if prod._thread.is_alive():
            prod.stop()
    assert True in held, "judging three times slower than the windows close never held reading"
    assert read_while_held and sum(read_while_held) == 0, "records were read while reading was held"
    assert held[-1] is False  # reading again once the backlog was judged
    seen, twice = recorded_windows(redis_client)
    assert twice == 0 and seen == dict(prod.acked)
    # the wait is bounded by the hold (1 s) plus the judging of what one read closed; the metric showed it
    assert 1.0 < max(ages) < 8.0


@pytest.mark.services
def test_reading_is_held_while_checkpoints_run_behind_and_every_event_counts_once(kafka_service, redis_service,
                                                                                  redis_client, topic, tmp_path,
                                                                                  monkeypatch, caplog):
    monkeypatch.setattr(daemon_mod, "HOLD_AFTER_MIN_S", 1.0)  # 1 s windows, and unsaved for 3 s holds reading
    monkeypatch.setattr(daemon_mod, "HOLD_UNSAVED_FACTOR", 3.0)
    real_save = CheckpointStore.save

    def slow_save(self, partition, token, save):  # type: ignore[no-untyped-def]
        # every save lands 0.5 s after it was built, and saves are spaced by 10x their cost: changes wait > 3 s
        time.sleep(0.5)
        return real_save(self, partition, token, save)

    monkeypatch.setattr(CheckpointStore, "save", slow_save)
    read_while_held, held = _watch_reading(monkeypatch)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3})
    prod = CountingProducer(kafka_service.address, topic, [f"r{i:02d}" for i in range(5)], rate=5.0).start()
    ages: list[float] = []
    caplog.set_level("WARNING", logger="watchdog.runtime.daemon")
    try:
        with running_daemon(cfg) as (daemon, _server):
            def sample() -> bool:
                ages.extend(s.value for s in daemon.metrics.checkpoint_age.collect()[0].samples)
                return True

            t_end = time.monotonic() + 10.0
            while time.monotonic() < t_end:
                sample()
                time.sleep(0.1)
            prod.stop()
            # sampled until the end too: on a loaded machine (CI) the start took longer and the hold came
            # after the first 10 s, its wait (3.2 s logged) never in the samples
            wait_until(lambda: sample() and sum(recorded_windows(redis_client)[0].values()) >= prod.total(), 60)
            wait_until(lambda: sample() and not daemon.ingest.held, 30)
    finally:
        if prod._thread.is_alive():
            prod.stop()
    assert True in held, "saves spaced 5 s apart never held reading"
    assert any("checkpoints run behind" in r.getMessage() for r in caplog.records)
    assert read_while_held and sum(read_while_held) == 0, "records were read while reading was held"
    assert held[-1] is False  # reading again once the partitions were saved
    seen, twice = recorded_windows(redis_client)
    assert twice == 0 and seen == dict(prod.acked)
    assert 3.0 < max(ages) < 15.0  # the metric showed the wait, and the hold bounded it
