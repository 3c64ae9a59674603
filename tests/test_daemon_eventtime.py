"""Event time: watermarks over partitions, idle partitions, stalls, future and late events."""

from __future__ import annotations

import json
import signal
import time

import pytest
from kafka import KafkaConsumer

from tests.daemon_harness import (
    CountingProducer,
    make_config,
    recorded_windows,
    running_daemon,
    write_policy,
)
from tests.helpers import wait_until
from watchdog.ingest.eventtime import Watermarks

A, B, C = ("t", 0), ("t", 1), ("t", 2)


def test_close_time_is_the_slowest_active_partition_and_idle_ones_only_cap_it() -> None:
    wm = Watermarks(out_of_order_s=1.0, max_future_s=60.0)
    for pk in (A, B, C):
        wm.assign(pk, None, now=100.0)
    assert wm.close_time(200.0) is None  # nobody delivered yet: a backlog may be waiting
    wm.observe(A, 150.0, 200.0)
    wm.observe(B, 120.0, 200.0)
    assert wm.close_time(200.0) is None  # C may still hold records
    wm.confirm_caught_up(C, asked_at=199.0)
    assert wm.close_time(200.0) == 119.0  # min over A, B; C idle is excluded (its cap is 198)
    wm.observe(B, 160.0, 201.0)
    assert wm.close_time(201.0) == 149.0
    wm.confirm_caught_up(A, 201.0)
    wm.confirm_caught_up(B, 201.0)
    # all idle: the oldest broker confirmation bounds it (200), and the events' clock bounds that: the
    # newest event (160, read at 201) plus the second since, less the out-of-orderness
    assert wm.close_time(202.0) == 160.0
    # a record after the confirmation makes the partition active again
    wm.records_read({C}, 203.0)
    wm.observe(C, 202.5, 203.0)
    assert wm.close_time(203.0) == 200.0


def test_a_frozen_broker_is_a_stall_not_lateness() -> None:
    wm = Watermarks(out_of_order_s=1.0, max_future_s=60.0)
    wm.assign(A, None, now=0.0)
    wm.observe(A, 100.0, 100.0)
    wm.confirm_caught_up(A, 100.5)
    assert wm.close_time(100.6) == 99.5
    # no confirmation and no record for 30 s of wall clock: the close time does not move
    assert wm.close_time(130.0) == 99.5
    assert wm.close_time(130.0) == wm.close_time(1e9 + 5)


def test_watermark_restored_and_stuck_detection() -> None:
    wm = Watermarks(out_of_order_s=2.0, max_future_s=60.0)
    wm.assign(A, 500.0, now=1000.0)  # restored from a checkpoint
    assert wm.mark(A) == 498.0
    assert wm.is_future(1061.0, 1000.0) and not wm.is_future(1059.0, 1000.0)
    wm.records_read({A}, 1000.0)
    assert wm.stuck(1010.0, after_s=30.0) == []
    wm.records_read({A}, 1040.0)  # records keep coming, none moves the watermark (all late)
    assert wm.stuck(1040.0, after_s=30.0) == [A]
    wm.observe(A, 1039.0, 1040.0)
    assert wm.stuck(1040.0, after_s=30.0) == []


def test_a_watermark_pinned_ahead_by_an_accepted_future_event_is_not_stuck() -> None:
    # drill future-240s-restart: one event at now+240 s (inside max_future) pins max_ts; the events
    # behind it keep counting, so readiness must not say watermark-stuck until wall time passes it
    wm = Watermarks(out_of_order_s=2.0, max_future_s=300.0)
    wm.assign(A, None, now=1000.0)
    wm.observe(A, 1240.0, 1000.0)
    for t in range(1001, 1300):
        wm.records_read({A}, float(t))
        wm.observe(A, float(t), float(t))
        assert wm.stuck(float(t), after_s=30.0) == [], t
    # records that no longer move it (all late): stuck once it is after_s behind the wall clock
    wm.records_read({A}, 1329.0)
    assert wm.stuck(1329.0, after_s=30.0) == []
    wm.records_read({A}, 1330.0)
    assert wm.stuck(1330.0, after_s=30.0) == [A]


def _dlq_reasons(kafka_address: str, dlq_topic: str, want: int) -> list[str]:
    consumer = KafkaConsumer(dlq_topic, bootstrap_servers=kafka_address, auto_offset_reset="earliest",
                             consumer_timeout_ms=8000, group_id=None)
    out = []
    for rec in consumer:
        out.append(dict(rec.headers)["llmwd.reason"].decode())
        if len(out) >= want:
            break
    consumer.close()
    return out


@pytest.mark.services
def test_future_and_late_events_are_dead_lettered_and_counting_stays_exact_across_a_restart(
        kafka_service, redis_service, redis_client, topic, tmp_path):
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3, "max_future_s": 60.0})
    prod = CountingProducer(kafka_service.address, topic, ["a", "b"], rate=60.0).start()
    r = prod.gen.routes[0]
    try:
        with running_daemon(cfg) as (daemon, _server):
            wait_until(lambda: daemon.stats.windows_closed >= 4, 30)
            prod.send(*prod.gen.encoded(r, now=time.time() + 240), counted=False)  # a skewed producer clock
            prod.send(*prod.gen.encoded(r, now=time.time() - 120), counted=False)  # its window closed long ago
            closed = daemon.stats.windows_closed
            wait_until(lambda: daemon.stats.windows_closed >= closed + 6, 30)
            assert daemon.metrics.dlq.labels("future")._value.get() == 1
            assert daemon.metrics.dlq.labels("late")._value.get() == 1
        # restart; the very first event read is ten years ahead
        prod.send(*prod.gen.encoded(r, now=time.time() + 10 * 365 * 86400), counted=False)
        with running_daemon(cfg) as (daemon, _server):
            wait_until(lambda: daemon.metrics.dlq.labels("future")._value.get() == 1, 30)
            closed = daemon.stats.windows_closed
            wait_until(lambda: daemon.stats.windows_closed >= closed + 4, 30)
            prod.stop()
            total = prod.total()
            wait_until(lambda: sum(recorded_windows(redis_client)[0].values()) >= total, 20)
            assert not daemon.problems(), daemon.problems()
    finally:
        if prod._thread.is_alive():
            prod.stop()
    seen, twice = recorded_windows(redis_client)
    assert twice == 0
    assert seen == dict(prod.acked)
    assert sorted(_dlq_reasons(kafka_service.address, cfg.kafka.dead_letter_topic, 3)) == ["future", "future", "late"]


@pytest.mark.services
def test_broker_frozen_for_seconds_loses_nothing(kafka_service, redis_service, redis_client, topic, tmp_path):
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    prod = CountingProducer(kafka_service.address, topic, ["a", "b"], rate=60.0).start()
    try:
        with running_daemon(cfg) as (daemon, _server):
            wait_until(lambda: daemon.stats.windows_closed >= 4, 30)
            kafka_service.proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(6.0)
                frozen_closed = daemon.stats.windows_closed
                time.sleep(2.0)
                # windows do not close on the wall clock while the broker cannot be read
                assert daemon.stats.windows_closed == frozen_closed
            finally:
                kafka_service.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: daemon.stats.windows_closed >= frozen_closed + 8, 40)
            prod.stop()
            total = prod.total()
            wait_until(lambda: sum(recorded_windows(redis_client)[0].values()) >= total, 30)
            late = daemon.metrics.dlq.labels("late")._value.get()
    finally:
        kafka_service.proc.send_signal(signal.SIGCONT)
        if prod._thread.is_alive():
            prod.stop()
    seen, twice = recorded_windows(redis_client)
    assert (late, twice, prod.failed) == (0, 0, 0)
    assert seen == dict(prod.acked), json.dumps({"seen": sum(seen.values()), "acked": prod.total()})


@pytest.mark.services
def test_a_zeroed_or_week_old_timestamp_is_stale_on_a_daemon_without_a_checkpoint(
        kafka_service, redis_service, redis_client, topic, tmp_path):
    # the first events a fresh daemon reads: nothing is closed yet, so without a bound on age these
    # would open 1970 windows of their own and be counted
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3})
    prod = CountingProducer(kafka_service.address, topic, ["a"], rate=40.0)
    r = prod.gen.routes[0]
    prod.send(*prod.gen.encoded(r, now=0.0), counted=False)
    prod.send(*prod.gen.encoded(r, now=time.time() - 8 * 86400), counted=False)
    prod.start()
    try:
        with running_daemon(cfg) as (daemon, _server):
            wait_until(lambda: daemon.stats.windows_closed >= 3, 30)
            prod.stop()
            wait_until(lambda: sum(recorded_windows(redis_client)[0].values()) >= prod.total(), 20)
            assert daemon.metrics.dlq.labels("stale")._value.get() == 2
    finally:
        if prod._thread.is_alive():
            prod.stop()
    seen, twice = recorded_windows(redis_client)
    assert twice == 0 and seen == dict(prod.acked)
    assert sorted(_dlq_reasons(kafka_service.address, cfg.kafka.dead_letter_topic, 2)) == ["stale", "stale"]


@pytest.mark.services
def test_an_old_backlog_is_not_clock_skew_but_a_live_producer_running_behind_is(
        kafka_service, redis_service, topic, tmp_path):
    # a new consumer group on a topic whose newest event was 8 min old, then no traffic: readiness said
    # "clock-skew: host clock +480 s from the events' clock" (and paged) until traffic came back
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3})
    prod = CountingProducer(kafka_service.address, topic, ["a"], rate=40.0)
    r = prod.gen.routes[0]
    old = time.time() - 480
    for i in range(40):
        prod.send(*prod.gen.encoded(r, now=old + i * 0.05), counted=False)
    prod.producer.flush(timeout=10)

    def skew() -> list[str]:
        return [p for p in daemon.problems() if "clock-skew" in p]

    try:
        with running_daemon(cfg) as (daemon, _server):
            wait_until(lambda: daemon.ingest is not None and sum(daemon.ingest.next_offset.values()) >= 40, 30)
            time.sleep(3.0)  # the clock is checked every loop iteration
            assert skew() == []
            # live events from a producer whose clock runs 480 s behind: that is skew
            deadline = time.monotonic() + 20
            while not skew():
                assert time.monotonic() < deadline, "a live producer 480 s behind was not named"
                prod.send(*prod.gen.encoded(r, now=time.time() - 480), counted=False)
                time.sleep(0.05)
            assert "events' clock" in skew()[0]
    finally:
        prod.producer.close(timeout=5)
