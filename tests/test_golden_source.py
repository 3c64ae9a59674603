"""Golden replays as a signal source: APScheduler jobs, no overlapping runs, on-demand replays,
errors as signals, and the whole path through the daemon with the in-process FP8 engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from probes.golden import GoldenItem, GoldenSet, Manifest
from probes.golden_replay import replay
from tests.daemon_harness import make_config, running_daemon
from tests.helpers import wait_until, write_golden_set
from tests.test_replay import TableEngine
from watchdog.config.settings import GoldenJobConfig
from watchdog.sources.golden import GoldenJob, GoldenScheduler

ANSWERS = {f"q{i}?": f"answer {i}" for i in range(6)}


def mini_set(root: Path) -> GoldenSet:
    manifest = Manifest.model_validate({"name": "mini", "domain": "d", "description": "d", "languages": ["en"],
                                        "routes": ["*"], "generation": {"max_new_tokens": 8, "stop": ["\n"]},
                                        "metrics": ["exact_match", "rougeL"]})
    items = tuple(GoldenItem(f"i{i}", q, a) for i, (q, a) in enumerate(ANSWERS.items()))
    return GoldenSet(root, manifest, items)


def job(**kw) -> GoldenJob:
    base = {"name": "mini", "set": "mini", "model": "m", "routes": ["r1", "r2"],
            "candidate": {"kind": "table", "precision": "fp8"}, "baseline": {"kind": "table", "precision": "fp16"},
            "every_s": None, "jitter_s": 0.0}
    return GoldenJob(GoldenJobConfig.model_validate({**base, **kw}))


def table_replay(root: Path, delay: float = 0.0, calls: list[float] | None = None):
    def run(j: GoldenJob):
        if calls is not None:
            calls.append(time.monotonic())
        time.sleep(delay)
        return replay(mini_set(root), TableEngine("fp8", ANSWERS, perturb={"q0?": "nonsense"}),
                      TableEngine("fp16", ANSWERS), progress=False)
    return run


def test_job_report_becomes_golden_signals_for_every_guarded_route(tmp_path: Path) -> None:
    sched = GoldenScheduler([job()], replay_fn=table_replay(tmp_path), reports_dir=tmp_path / "reports")
    assert sched.run_job("mini")
    sigs = sched.drain()
    assert {(s.route, s.precision) for s in sigs} == {("r1", "fp8"), ("r1", "fp16"), ("r2", "fp8"), ("r2", "fp16")}
    cand = next(s for s in sigs if s.route == "r1" and s.precision == "fp8")
    assert cand.source == "golden" and cand.paired is not None and len(cand.paired["exact_match"]) == 6
    assert cand.values["exact_match"] == pytest.approx(5 / 6)
    saved = json.loads((tmp_path / "reports" / "mini" / "latest.json").read_text())
    assert saved["schema"] == 1 and saved["n_items"] == 6
    assert sched.drain() == []


def test_interval_schedule_fires_and_one_job_never_runs_twice_at_once(tmp_path: Path) -> None:
    calls: list[float] = []
    sched = GoldenScheduler([job(every_s=0.2)], replay_fn=table_replay(tmp_path, delay=0.5, calls=calls)).start()
    try:
        wait_until(lambda: len(calls) >= 2, 10)
        # a manual run while the scheduled one holds the job is skipped, not queued
        wait_until(lambda: sched.jobs["mini"].lock.locked(), 5)
        assert sched.run_job("mini") is False
    finally:
        sched.stop()
    starts = sorted(calls)
    assert all(b - a >= 0.45 for a, b in zip(starts, starts[1:], strict=False))  # runs never overlap


def test_suspicion_triggers_a_replay_once_per_debounce(tmp_path: Path) -> None:
    calls: list[float] = []
    sched = GoldenScheduler([job(), job(name="other", routes=["r3"])],
                            replay_fn=table_replay(tmp_path, calls=calls), debounce_s=60)
    assert sched.request("m", "r2", "live rule tripped", now=1000.0) == ["mini"]
    assert sched.request("m", "r2", "again", now=1010.0) == []  # debounced
    assert sched.request("m", "unguarded", "x", now=1000.0) == []
    wait_until(lambda: len(calls) == 1 and not sched.jobs["mini"].lock.locked(), 10)
    assert sched.request("m", "r1", "later", now=1100.0) == ["mini"]


def test_a_failing_replay_is_an_error_signal_not_a_crash(tmp_path: Path) -> None:
    def broken(j: GoldenJob):
        raise TimeoutError("engine timed out after 30 s")

    sched = GoldenScheduler([job()], replay_fn=broken)
    assert sched.run_job("mini") is False
    sigs = sched.drain()
    assert len(sigs) == 2 and all(s.error and "timed out" in s.error and s.source == "golden" for s in sigs)
    assert sched.status()[0]["last_error"].startswith("engine timed out")


GOLDEN_POLICY = """\
policies:
  - name: golden-guard
    cooldown: 0s
    rules:
      - name: exact-match-drop
        source: golden
        metric: exact_match
        fail_if: "paired_mean < -0.25"
        min_samples: 5
        severity: critical
        action: rollback
"""


@pytest.mark.torch
@pytest.mark.services
def test_daemon_rolls_back_on_a_stale_fp8_calibration(kafka_service, redis_service, redis_client, topic,
                                                      tmp_path: Path, tiny_model_dir: Path) -> None:
    from probes.tiny_model import DEFAULT_PAIRS

    set_dir = write_golden_set(tmp_path / "tiny", DEFAULT_PAIRS)
    policy = tmp_path / "golden.yaml"
    policy.write_text(GOLDEN_POLICY)
    engine = {"kind": "torch", "model_path": str(tiny_model_dir), "batch_size": 8}
    cfg = make_config(kafka_service.address, redis_service.port, topic, policy, None, golden={
        "jobs": [{"name": "tiny", "set": str(set_dir), "model": "tiny-llama", "routes": ["qa"], "every_s": 3600,
                  "candidate": {**engine, "precision": "fp8"}, "baseline": {**engine, "precision": "fp16"}}],
        "reports_dir": str(tmp_path / "reports")})
    with running_daemon(cfg) as (daemon, _server):
        scheduler = daemon.golden
        assert scheduler.run_job("tiny")  # calibrated FP8: same answers as FP16
        time.sleep(1.0)
        assert daemon.flags.precision_for("tiny-llama", "qa") == "fp8"
        scheduler.jobs["tiny"].spec.candidate["scale_multiplier"] = 0.05  # the calibration went stale
        assert scheduler.run_job("tiny")
        wait_until(lambda: daemon.flags.precision_for("tiny-llama", "qa") == "fp16", 15)
        verdicts = json.dumps(daemon.status()["verdicts"])
    assert "exact-match-drop" in verdicts
    audit = redis_client.xrange("llmwd:audit")
    assert len(audit) == 1 and audit[0][1]["policy"] == "golden-guard"
    report = json.loads((tmp_path / "reports" / "tiny" / "latest.json").read_text())
    assert report["candidate"]["precision"] == "fp8"
    # both replays are in the recorded history, with the FP8 saturation rate of each
    recorded = [json.loads(f["json"]) for _id, f in redis_client.xrange("llmwd:windows")]
    sat = [w["values"]["fp8_saturation"] for w in recorded if w["source"] == "golden" and w["precision"] == "fp8"]
    assert len(sat) == 2 and sat[0] < 0.01 < 0.1 < sat[1]
