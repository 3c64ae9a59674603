"""Cron schedules of golden jobs: they start, read crontab's weekdays (Sunday = 0) in the job's zone (UTC by
default, not the host's), and a bad line or zone is a config error at its file:line:col."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from tests.test_golden_source import job, table_replay
from watchdog.config.settings import ConfigError, load_config
from watchdog.core.schedule import cron_trigger, weekdays
from watchdog.sources.golden import GoldenScheduler

UTC = dt.UTC


def next_fire(spec: str, zone: str, after: dt.datetime) -> dt.datetime:
    return cron_trigger(spec, zone, 0.0).get_next_fire_time(None, after)


def test_a_cron_job_starts_and_is_scheduled_in_utc(tmp_path: Path) -> None:
    sched = GoldenScheduler([job(cron="17 3 * * *")], replay_fn=table_replay(tmp_path)).start()
    try:
        nxt = sched._scheduler.get_job("mini").next_run_time.astimezone(UTC)
    finally:
        sched.stop()
    assert (nxt.hour, nxt.minute) == (3, 17)
    assert dt.timedelta(0) < nxt - dt.datetime.now(UTC) <= dt.timedelta(days=1)


@pytest.mark.parametrize(("field", "days"), [
    ("0", {"Sunday"}), ("7", {"Sunday"}), ("1-5", {"Monday", "Tuesday", "Wednesday", "Thursday", "Friday"}),
    ("sat,sun", {"Saturday", "Sunday"}), ("*/3", {"Sunday", "Wednesday", "Saturday"}),
])
def test_weekday_numbers_are_crontabs(field: str, days: set[str]) -> None:
    t = dt.datetime(2027, 1, 1, tzinfo=UTC)
    seen = set()
    for _ in range(len(days)):
        t = next_fire(f"0 2 * * {field}", "UTC", t + dt.timedelta(seconds=1))
        seen.add(t.strftime("%A"))
    assert seen == days


def test_the_zone_sets_the_instant_and_its_daylight_saving_days() -> None:
    berlin = "Europe/Berlin"
    winter = next_fire("30 2 * * *", berlin, dt.datetime(2027, 1, 10, 12, tzinfo=UTC))
    assert winter == dt.datetime(2027, 1, 11, 1, 30, tzinfo=UTC)
    # spring forward (28 March 2027): 02:30 does not exist there, the run comes once, an hour later
    t, runs = dt.datetime(2027, 3, 27, 12, tzinfo=UTC), []
    while t < dt.datetime(2027, 3, 29, 12, tzinfo=UTC):
        t = next_fire("30 2 * * *", berlin, t + dt.timedelta(seconds=1))
        runs.append(t.astimezone(UTC))
    assert [r.date() for r in runs[:2]] == [dt.date(2027, 3, 28), dt.date(2027, 3, 29)]


@pytest.mark.parametrize(("line", "why"), [
    ("cron: '61 * * * *'", "golden.jobs.0.cron: .*higher than the maximum value"),
    ("cron: '0 2 * *'", "golden.jobs.0.cron: .*4 fields, expected 5"),
    ("cron: '0 2 * * 8'", "golden.jobs.0.cron: .*weekday '8'"),
    ("timezone: Mars/Olympus", "golden.jobs.0.timezone: .*unknown time zone 'Mars/Olympus'"),
])
def test_a_bad_schedule_is_a_config_error_at_its_line(tmp_path: Path, line: str, why: str) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text("golden:\n  jobs:\n    - name: j\n      set: s\n      model: m\n      routes: [r]\n"
                   "      candidate: {kind: openai, base_url: 'http://127.0.0.1:1/v1', model: m, precision: fp8}\n"
                   "      baseline: {kind: openai, base_url: 'http://127.0.0.1:1/v1', model: m, precision: fp16}\n"
                   f"      {line}\n")
    with pytest.raises(ConfigError, match=f"config.yaml:9:7: {why}"):
        load_config(cfg)


def test_weekday_field_errors() -> None:
    for bad in ("5-1", "*/0", "x", "1/"):
        with pytest.raises(ValueError, match="weekday"):
            weekdays(bad)
