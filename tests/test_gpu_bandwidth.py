"""The device-to-device bandwidth self-test and the FP8 stack guard as GPU-source signal values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from probes.gpu import decode_reading, gpu_signals
from probes.gpu_bandwidth import LOW_RATIO, assess, measure_d2d, nominal_gbps
from probes.gpu_monitor import GpuMonitor

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]


def recorded() -> dict[str, Any]:
    return json.loads((DATA / "nvml_h200.json").read_text())


def test_nominal_table_and_assessment() -> None:
    assert nominal_gbps("NVIDIA H200") == 4800 and nominal_gbps("NVIDIA H100 80GB HBM3") == 3350
    assert nominal_gbps("NVIDIA H100 PCIe") == 2000 and nominal_gbps("Tesla T4 (unknown)") is None
    ok = assess({"gbps": 4300.0}, "NVIDIA H200")
    assert ok["low"] is False and ok["ratio"] == pytest.approx(4300 / 4800)
    low = assess({"gbps": 4800 * (LOW_RATIO - 0.01)}, "NVIDIA H200")
    assert low["low"] is True
    assert assess({"gbps": 100.0}, "mystery GPU")["low"] is None  # no nominal figure: unknown, not fine
    assert assess({"error": "no CUDA device 0"}, "NVIDIA H200")["error"] == "no CUDA device 0"


def test_low_bandwidth_is_a_warning_and_a_signal_value() -> None:
    rec = recorded()
    idx = int(rec["gpus"][0].get("index", 0))
    [h] = decode_reading(rec, bandwidth={idx: {"gbps": 2000.0}})
    assert h.bandwidth_low is True and not h.critical
    assert any(p.code == "bandwidth_low" and p.severity == "warning" for p in h.problems)
    [s] = gpu_signals([h], {"*": [("llama", "chat")]})
    assert s.values["bandwidth_low"] == 1.0 and s.values["d2d_bandwidth_ratio"] == pytest.approx(2000 / 4800)
    assert s.values["compute_capability"] == pytest.approx(9.0) and s.values["fp8_capable"] == 1.0
    assert s.values["cuda_driver_version"] >= 12.0
    [fine] = decode_reading(rec, bandwidth={idx: {"gbps": 4300.0}})
    assert fine.bandwidth_low is False and not any(p.code == "bandwidth_low" for p in fine.problems)
    [untested] = decode_reading(rec)
    [s2] = gpu_signals([untested], {"*": [("llama", "chat")]})
    assert "bandwidth_low" not in s2.values and "d2d_bandwidth_ratio" not in s2.values


def test_monitor_runs_the_self_test_only_when_configured() -> None:
    from tests.test_gpu_read import ReplayNvml

    calls: list[list[int]] = []

    def fake_test(indices: list[int]) -> dict[int, dict[str, Any]]:
        calls.append(indices)
        return {i: {"gbps": 1000.0} for i in indices}

    off = GpuMonitor(nvml=ReplayNvml(recorded()), listen_xids=False, bandwidth_fn=fake_test)
    off.sample_once()
    assert calls == [] and off.latest()[0].bandwidth_low is None
    on = GpuMonitor(nvml=ReplayNvml(recorded()), listen_xids=False, bandwidth_test=True, bandwidth_fn=fake_test,
                    mapping={"*": [("m", "r")]})
    on.sample_once()
    on.sample_once()  # once per bandwidth_every_s, not every sample
    assert len(calls) == 1 and on.latest()[0].bandwidth_low is True
    assert on.signals()[0].values["bandwidth_low"] == 1.0


def test_daemon_path_does_not_import_torch() -> None:
    code = ("import sys, probes.gpu, probes.gpu_monitor, probes.gpu_bandwidth; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_measure_without_or_with_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    res = measure_d2d(0, size_mib=256, reps=5)
    if not torch.cuda.is_available():
        assert "error" in res and "no CUDA device" in res["error"]
        return
    assert res["gbps"] > 100  # any real GPU copies far faster than this
    name = torch.cuda.get_device_name(0)
    a = assess(res, name)
    print(f"{name}: {res['gbps']:.0f} GB/s, nominal {a['nominal_gbps']}, ratio {a['ratio']}")


def test_daemon_config_keys_reach_the_monitor() -> None:
    from prometheus_client import CollectorRegistry
    from pydantic import ValidationError

    from tests.test_gpu_read import ReplayNvml
    from watchdog.config.settings import GpuConfig
    from watchdog.sources.gpu import GpuSource

    def monitor(g: GpuConfig) -> GpuMonitor:
        source = GpuSource.from_config(g, CollectorRegistry(), ReplayNvml(recorded()))
        assert source is not None
        return source.monitor

    on = monitor(GpuConfig(enabled=True, bandwidth_test=True, bandwidth_every_s=600))
    assert on.bandwidth_test is True and on.bandwidth_every_s == 600
    assert monitor(GpuConfig(enabled=True)).bandwidth_test is False  # off by default: no torch import
    with pytest.raises(ValidationError, match="bandwidth_every_s"):
        GpuConfig(enabled=True, bandwidth_test=True, bandwidth_every_s=5)
