"""An ``every_s`` golden job across restarts and lease handovers. APScheduler's interval trigger first
fires ``every_s`` after the scheduler starts, so a daemon restarted (a deploy, an eviction, an OOM kill)
or a golden lease handed over more often than ``every_s`` pushed the next replay back each time and never
replayed. Now the first run comes ``every_s`` after the job's last run on any replica (read from the
golden stream in Redis), or ``FIRST_RUN_S`` from the start when none is known or it is overdue."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pytest

from tests.test_golden_source import job, table_replay
from watchdog.core.keys import Keys
from watchdog.sources.golden import FIRST_RUN_S, GoldenLeader, GoldenScheduler
from watchdog.state.golden_stream import GoldenStream

UTC = dt.UTC


def _first_in(sched: GoldenScheduler, name: str = "mini") -> float:
    return (sched._scheduler.get_job(name).next_run_time - dt.datetime.now(UTC)).total_seconds()


class _Held:
    def tick(self, now: float) -> bool:
        return True

    def release(self) -> None:
        pass


@pytest.mark.services
def test_an_hourly_job_runs_an_hour_after_its_last_run_on_any_replica_not_after_each_start(
        tmp_path: Path, redis_client) -> None:
    stream = GoldenStream(redis_client, Keys(), "g")
    hourly = job(every_s=3600.0)
    # no run known (a first deploy, or the stream trimmed): soon, not in an hour
    leader = GoldenLeader(GoldenScheduler([hourly], replay_fn=table_replay(tmp_path)), _Held(),
                          last_runs=stream.last_runs)
    leader.tick(time.time())
    try:
        assert 0 < _first_in(leader.scheduler) <= FIRST_RUN_S + 1
    finally:
        leader.stop()
    # a replay published 600 s ago (another replica, or this one before its restart): 3,000 s from now
    secs, _micros = redis_client.time()
    redis_client.xadd(stream.key, {"json": '{"schema": 1, "job": "mini", "signals": []}'},
                      id=f"{(int(secs) - 600) * 1000}-0")
    for _ in range(50):  # newer entries of another job: the reader pages back to find this one
        stream.publish([("other", [])])
    assert 599 <= stream.last_runs({"mini", "gone"})["mini"] <= 602
    leader = GoldenLeader(GoldenScheduler([job(every_s=3600.0)], replay_fn=table_replay(tmp_path)), _Held(),
                          last_runs=stream.last_runs)
    leader.tick(time.time())
    try:
        assert 2990 <= _first_in(leader.scheduler) <= 3001
    finally:
        leader.stop()


def test_an_overdue_or_short_job_runs_soon_and_redis_away_means_soon(tmp_path: Path) -> None:
    sched = GoldenScheduler([job(every_s=3600.0)], replay_fn=table_replay(tmp_path)).start({"mini": 7200.0})
    try:
        assert 0 < _first_in(sched) <= FIRST_RUN_S + 1  # overdue: soon
    finally:
        sched.stop()
    sched = GoldenScheduler([job(every_s=5.0)], replay_fn=table_replay(tmp_path)).start()
    try:
        assert 0 < _first_in(sched) <= 5.5  # every_s shorter than FIRST_RUN_S: every_s, as before
    finally:
        sched.stop()

    def away(_jobs: set[str]) -> dict[str, float]:
        import redis

        raise redis.ConnectionError("Redis is away")

    leader = GoldenLeader(GoldenScheduler([job(every_s=3600.0)], replay_fn=table_replay(tmp_path)), _Held(),
                          last_runs=away)
    leader.tick(time.time())
    try:
        assert 0 < _first_in(leader.scheduler) <= FIRST_RUN_S + 1
    finally:
        leader.stop()
