"""``golden.reports_dir`` is bounded: each job keeps its newest ``reports_keep`` reports (and none older
than ``reports_max_age_s`` when set); ``latest.json``, ``summary.txt`` and files it did not write stay.

Before, every replay added a ``report-<time>.json`` (about 100 KB for a 54-item set) and nothing ever
deleted one: about 880 MB a year for one hourly job. Real files, written by the scheduler's own save."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from probes.drift import prune_reports
from tests.test_golden_source import job, table_replay
from watchdog.config.settings import GoldenConfig
from watchdog.sources.golden import GoldenJob, GoldenScheduler

HOUR = 3600.0


def _stamp(t: float) -> str:
    return time.strftime("report-%Y%m%dT%H%M%SZ.json", time.gmtime(t))


def hourly(root: Path, first: float):
    """A replay of the mini set whose reports finish an hour apart from ``first`` on."""
    plain = table_replay(root)
    n = 0

    def run(j: GoldenJob):
        nonlocal n
        report = plain(j)
        report.finished_at = first + n * HOUR
        n += 1
        return report
    return run


def test_each_job_keeps_its_newest_reports_and_latest(tmp_path: Path) -> None:
    now = time.time()
    first = now - 9 * HOUR
    reports = tmp_path / "reports"
    sched = GoldenScheduler([job()], replay_fn=hourly(tmp_path, first), reports_dir=reports, reports_keep=3)
    out = reports / "mini"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("an operator's file")
    (out / "report-draft.json").write_text("{}")  # not a name save writes: not ours to delete
    for _ in range(8):
        assert sched.run_job("mini")
    kept = sorted(p.name for p in out.glob("report-*.json") if p.name != "report-draft.json")
    assert kept == [_stamp(first + k * HOUR) for k in (5, 6, 7)]
    latest = json.loads((out / "latest.json").read_text())
    assert latest["finished_at"] == first + 7 * HOUR
    assert (out / "summary.txt").is_file() and (out / "notes.txt").is_file() and (out / "report-draft.json").is_file()


def test_reports_older_than_the_max_age_go_at_the_next_replay(tmp_path: Path) -> None:
    """A daily job (the count alone would keep years of them) with ``reports_max_age_s`` of 30 days."""
    now = time.time()
    reports = tmp_path / "reports"
    sched = GoldenScheduler([job()], replay_fn=hourly(tmp_path, now - 40 * 24 * HOUR), reports_dir=reports,
                            reports_keep=1000, reports_max_age_s=30 * 24 * HOUR)
    assert sched.run_job("mini")  # 40 days old when written: the one report, but past the age
    out = reports / "mini"
    assert list(out.glob("report-*.json")) == []
    assert json.loads((out / "latest.json").read_text())["finished_at"] == now - 40 * 24 * HOUR
    sched.replay_fn = hourly(tmp_path, now - 29 * 24 * HOUR)
    assert sched.run_job("mini")
    assert [p.name for p in out.glob("report-*.json")] == [_stamp(now - 29 * 24 * HOUR)]


def test_prune_reports_by_count_and_age(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    for k in range(10):
        (tmp_path / _stamp(now - k * 86400)).write_text("{}")
    (tmp_path / "latest.json").write_text("{}")
    (tmp_path / "report-20261399T000000Z.json").write_text("{}")  # no such date: left alone
    gone = prune_reports(tmp_path, keep=6, max_age_s=3.5 * 86400, now=now)
    assert sorted(p.name for p in gone) == sorted(_stamp(now - k * 86400) for k in range(4, 10))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [_stamp(now - k * 86400) for k in range(4)] + ["latest.json", "report-20261399T000000Z.json"])
    assert prune_reports(tmp_path, keep=6, max_age_s=3.5 * 86400, now=now) == []


def test_the_setting_defaults_bounds_and_reaches_the_scheduler() -> None:
    base = {"jobs": [{"name": "j", "set": "s", "model": "m", "routes": ["r"],
                      "candidate": {"kind": "table", "precision": "fp8"},
                      "baseline": {"kind": "table", "precision": "fp16"}}], "reports_dir": "/tmp/r"}
    cfg = GoldenConfig.model_validate(base)
    assert cfg.reports_keep == 720 and cfg.reports_max_age_s is None
    sched = GoldenScheduler.from_config(GoldenConfig.model_validate(
        {**base, "reports_keep": 24, "reports_max_age_s": 86400}))
    assert sched is not None and (sched.reports_keep, sched.reports_max_age_s) == (24, 86400)
    for bad in ({"reports_keep": 0}, {"reports_max_age_s": 0}):
        with pytest.raises(ValidationError):
            GoldenConfig.model_validate({**base, **bad})
