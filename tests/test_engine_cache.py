"""Resident golden-replay engines (watchdog/sources/engine_cache.py): loads counted, hits, release
on config change, idle timeout, bounds, and the scheduler keeping the tiny torch engines between
scheduled replays."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from tests.helpers import write_golden_set
from watchdog.config.settings import GoldenConfig, GoldenJobConfig
from watchdog.core.metrics import Metrics
from watchdog.sources.engine_cache import EngineBuildError, EngineCache, engine_key
from watchdog.sources.golden import GoldenJob, GoldenScheduler


class FakeEngine:
    def __init__(self, options: dict[str, Any], size: int = 0) -> None:
        self.options = options
        self.name = f"fake:{options.get('precision')}"
        self.precision = str(options.get("precision"))
        self.closed = False
        self.size = size

    def memory_bytes(self) -> int:
        return self.size

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fake_cache(**kw: Any) -> tuple[EngineCache, list[FakeEngine]]:
    built: list[FakeEngine] = []

    def build(options: dict[str, Any]) -> FakeEngine:
        built.append(FakeEngine(options, size=int(options.get("size", 0))))
        return built[-1]

    return EngineCache(build, **kw), built


FP8 = {"kind": "fake", "precision": "fp8"}
FP16 = {"kind": "fake", "precision": "fp16"}


def sample(metrics: Metrics, name: str, labels: str = "") -> float:
    text = generate_latest(metrics.registry).decode()
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} not exported")


def test_second_lease_is_a_hit_not_a_load() -> None:
    metrics = Metrics()
    cache, built = fake_cache(metrics=metrics)
    with cache.lease("job", [FP8, FP16]) as (a, b):
        assert (a.precision, b.precision) == ("fp8", "fp16")
    with cache.lease("job", [FP8, FP16]) as (a2, b2):
        assert a2 is a and b2 is b
    assert (cache.loads, cache.hits, len(built), len(cache)) == (2, 2, 2, 2)
    assert not any(e.closed for e in built)
    assert sample(metrics, "llmwd_golden_engine_loads_total") == 2
    assert sample(metrics, "llmwd_golden_engine_hits_total") == 2
    assert sample(metrics, "llmwd_golden_engines_resident") == 2


def test_a_config_change_releases_the_old_engine_before_loading_the_new() -> None:
    metrics = Metrics()
    cache, built = fake_cache(metrics=metrics)
    with cache.lease("job", [FP8, FP16]) as (old_cand, old_base):
        pass
    changed = {**FP8, "scale_multiplier": 0.5}
    with cache.lease("job", [changed, FP16]) as (cand, base):
        assert old_cand.closed and not old_base.closed  # old candidate gone, baseline kept
        assert cand is built[2] and base is old_base
    assert len(cache) == 2 and cache.releases == {"config": 1}
    assert sample(metrics, "llmwd_golden_engine_releases_total", '{reason="config"}') == 1


def test_the_fp8_engine_is_built_after_the_unquantised_one_it_may_share_weights_with() -> None:
    cache, built = fake_cache()
    with cache.lease("job", [FP8, FP16]) as (cand, base):
        assert (cand.precision, base.precision) == ("fp8", "fp16")
    assert [e.precision for e in built] == ["fp16", "fp8"]


def test_an_engine_another_job_still_uses_survives_a_config_change() -> None:
    cache, built = fake_cache()
    with cache.lease("a", [FP8, FP16]) as (cand, _base):
        pass
    with cache.lease("b", [FP8, FP16]):
        pass
    with cache.lease("a", [{**FP8, "batch_size": 4}, FP16]):
        pass
    assert not cand.closed  # job b still uses it
    assert cache.loads == 3 and len(cache) == 3


def test_idle_engines_are_released_and_reloaded_on_next_use() -> None:
    clock = Clock()
    metrics = Metrics()
    cache, built = fake_cache(idle_s=600.0, clock=clock, metrics=metrics)
    with cache.lease("job", [FP8, FP16]):
        pass
    clock.t += 599
    assert cache.sweep() == 0 and len(cache) == 2
    clock.t += 2
    assert cache.sweep() == 2 and len(cache) == 0
    assert all(e.closed for e in built)
    assert sample(metrics, "llmwd_golden_engines_resident") == 0
    assert sample(metrics, "llmwd_golden_engine_releases_total", '{reason="idle"}') == 2
    with cache.lease("job", [FP8, FP16]):
        pass
    assert cache.loads == 4


def test_sweep_never_touches_a_running_replay() -> None:
    clock = Clock()
    cache, built = fake_cache(idle_s=1.0, clock=clock)
    with cache.lease("job", [FP8]):
        clock.t += 100
        assert cache.sweep() == 0  # the replay holds the cache: the loop does not wait, nor release
        assert not built[0].closed


def test_count_and_memory_bounds_evict_least_recently_used_but_never_the_leased() -> None:
    cache, built = fake_cache(max_engines=2)
    for p in ("a", "b", "c"):
        with cache.lease(p, [{"kind": "fake", "precision": p}]):
            pass
    assert [e.closed for e in built] == [True, False, False] and cache.releases == {"bound": 1}
    cache, built = fake_cache(max_engines=10, max_bytes=100)
    with cache.lease("j", [{**FP8, "size": 60}]):
        pass
    with cache.lease("k", [{**FP16, "size": 60}]):  # 120 > 100: the older one goes
        pass
    assert built[0].closed and not built[1].closed
    # one engine over the byte bound on its own still serves the replay that asked for it
    with cache.lease("big", [{**FP16, "size": 500}]) as (big,):
        assert not big.closed


def test_close_while_a_replay_runs_releases_when_it_ends() -> None:
    cache, built = fake_cache()
    with cache.lease("job", [FP8, FP16]):
        cache.close()  # lease lost mid-replay: the daemon's loop must not block on it
        assert not any(e.closed for e in built)
    assert all(e.closed for e in built) and len(cache) == 0
    cache.close()  # idempotent


def test_a_rewritten_model_file_is_a_new_key(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    opts = {"kind": "torch", "model_path": str(tmp_path), "precision": "fp8"}
    before = engine_key(opts)
    assert engine_key(dict(opts)) == before
    cal = tmp_path / "fp8_calibration.json"
    cal.write_text("{}")
    os.utime(cal, ns=(1, 1))
    assert engine_key(opts) != before  # a new calibration file: the resident engine is stale


def test_a_failed_build_raises_and_keeps_what_was_built() -> None:
    def build(options: dict[str, Any]) -> FakeEngine:
        if options["precision"] == "fp8":  # built after the FP16 engine
            raise RuntimeError("out of memory")
        return FakeEngine(options)

    cache = EngineCache(build)
    with pytest.raises(EngineBuildError) as failed, cache.lease("job", [FP8, FP16]):
        pass
    assert len(cache) == 1 and cache.loads == 1
    # which config failed (the golden scheduler blames that side), and why
    assert failed.value.index == 0 and failed.value.options == FP8
    assert isinstance(failed.value.__cause__, RuntimeError) and str(failed.value) == "RuntimeError: out of memory"


def test_config_section_builds_a_bounded_cache_and_can_turn_it_off() -> None:
    job = {"name": "j", "set": "s", "model": "m", "routes": ["r"], "candidate": FP8, "baseline": FP16}
    sched = GoldenScheduler.from_config(GoldenConfig.model_validate(
        {"jobs": [job], "engines": {"max_engines": 3, "max_gb": 40, "idle_s": 7200}}))
    assert sched is not None and sched.engines is not None
    assert (sched.engines.max_engines, sched.engines.max_bytes, sched.engines.idle_s) == (3, 40 * 10**9, 7200)
    off = GoldenScheduler.from_config(GoldenConfig.model_validate({"jobs": [job], "engines": {"resident": False}}))
    assert off is not None and off.engines is None


def test_config_compile_cache_keeps_the_triton_kernels_and_an_unusable_one_is_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    job = {"name": "j", "set": "s", "model": "m", "routes": ["r"], "candidate": FP8, "baseline": FP16}
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "ops-chose-this"))  # the environment's wins
    GoldenScheduler.from_config(GoldenConfig.model_validate(
        {"jobs": [job], "engines": {"compile_cache_dir": str(tmp_path / "cc")}}))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "ops-chose-this")
    (tmp_path / "a-file").write_text("")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    sched = GoldenScheduler.from_config(GoldenConfig.model_validate(
        {"jobs": [job], "engines": {"compile_cache_dir": str(tmp_path / "a-file" / "cc")}}))
    assert sched is not None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "compile_cache_dir" in caplog.text and "cannot be used" in caplog.text


# -- the scheduler with the tiny in-process engines (CPU or GPU, whichever is there) ----------------
def tiny_set(tmp_path: Path) -> Path:
    from probes.tiny_model import DEFAULT_PAIRS

    set_dir = write_golden_set(tmp_path / "tiny", DEFAULT_PAIRS[:4], max_new_tokens=8)
    return set_dir


def counting_build(counts: dict[str, int]):
    from probes.engines import get_engine

    def build(options: dict[str, Any]) -> Any:
        counts[options["precision"]] = counts.get(options["precision"], 0) + 1
        return get_engine(**options)

    return build


def test_scheduled_replays_keep_the_torch_engines_resident(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = {"kind": "torch", "model_path": str(tiny_model_dir), "batch_size": 4}
    spec = GoldenJobConfig.model_validate({
        "name": "tiny", "set": str(tiny_set(tmp_path)), "model": "tiny", "routes": ["qa"], "every_s": None,
        "repeat_baseline": False, "candidate": {**engine, "precision": "fp8"},
        "baseline": {**engine, "precision": "fp16"}})
    counts: dict[str, int] = {}
    metrics = Metrics()
    clock = Clock()
    cache = EngineCache(counting_build(counts), idle_s=600.0, metrics=metrics, clock=clock)
    sched = GoldenScheduler([GoldenJob(spec)], engines=cache)
    assert sched.run_job("tiny") and sched.run_job("tiny")
    assert counts == {"fp8": 1, "fp16": 1}  # the second scheduled replay loaded nothing
    assert (cache.loads, cache.hits) == (2, 2)
    status = sched.engines_status()
    assert status is not None and len(status["resident"]) == 2 and status["resident"][0]["bytes"] > 0
    assert all(r["jobs"] == ["tiny"] and r["hits"] == 1 for r in status["resident"])
    runs = sched.drain_runs()
    assert len(runs) == 2 and all(not s.error for _n, sigs in runs for s in sigs)
    # the second run's saturation is its own, not accumulated over both runs
    assert sched.jobs["tiny"].last_extra["fp8_saturation"] < 0.01
    # the job's candidate config changes: its old FP8 engine goes, the FP16 baseline stays
    old_fp8 = next(r.engine for r in cache._engines.values() if r.engine.precision == "fp8")
    sched.jobs["tiny"].spec.candidate["scale_multiplier"] = 0.05
    assert sched.run_job("tiny")
    assert counts == {"fp8": 2, "fp16": 1} and old_fp8.model is None  # closed
    # each FP8 engine quantised the resident FP16 engine's weights instead of reading the files again
    new_fp8 = next(r.engine for r in cache._engines.values() if r.engine.precision == "fp8")
    assert "shared_s" in old_fp8.timings and "shared_s" in new_fp8.timings
    assert cache.releases == {"config": 1} and len(cache) == 2
    # idle: drain (the daemon's loop) sweeps them away
    clock.t += 601
    sched.drain_runs()
    assert len(cache) == 0 and cache.releases == {"config": 1, "idle": 2}
    assert sample(metrics, "llmwd_golden_engines_resident") == 0
    assert sample(metrics, "llmwd_golden_engine_loads_total") == 3
    assert sample(metrics, "llmwd_golden_engine_hits_total") == 3


def test_without_a_cache_each_replay_builds_and_closes(tmp_path: Path, tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import probes.engines

    engine = {"kind": "torch", "model_path": str(tiny_model_dir), "batch_size": 4}
    spec = GoldenJobConfig.model_validate({
        "name": "tiny", "set": str(tiny_set(tmp_path)), "model": "tiny", "routes": ["qa"], "every_s": None,
        "repeat_baseline": False, "candidate": {**engine, "precision": "fp8"},
        "baseline": {**engine, "precision": "fp16"}})
    built: list[Any] = []
    real = probes.engines.get_engine

    def spy(**kw: Any) -> Any:
        built.append(real(**kw))
        return built[-1]

    monkeypatch.setattr(probes.engines, "get_engine", spy)
    sched = GoldenScheduler([GoldenJob(spec)])
    assert sched.engines is None
    assert sched.run_job("tiny") and sched.run_job("tiny")
    assert len(built) == 4 and all(e.model is None for e in built)


def test_stop_releases_resident_engines_from_another_thread() -> None:
    cache, built = fake_cache()
    sched = GoldenScheduler([], engines=cache)
    with cache.lease("job", [FP8]):
        pass
    t = threading.Thread(target=sched.stop)
    t.start()
    t.join(5)
    assert built[0].closed and len(cache) == 0
