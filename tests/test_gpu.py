"""Pure GPU health decoding, the FP8 guard, XID classification, signals, gauges and the CLI.

Readings are the ones recorded on an NVIDIA H200 (tests/data/nvml_h200*.json); failure scenarios
are copies of them with one field changed in the test, and XIDs go through XidListener.handle,
the path the NVML listener thread uses.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from probes import gpu_cli
from probes.gpu import decode_clock_reasons, decode_reading, fp8_guard, gpu_signals
from probes.gpu_metrics import GpuGauges
from probes.gpu_monitor import GpuMonitor
from probes.xid import EVENT_XID_CRITICAL, XID_TABLE, XidListener, XidLog, classify_xid, event_from_nvml

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent


def recorded(name: str = "nvml_h200.json") -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def fields(reading: dict[str, Any]) -> dict[str, Any]:
    return reading["gpus"][0]["fields"]


def uuid_of(reading: dict[str, Any]) -> str:
    return fields(reading)["uuid"]


# --- decoding of the recorded H200 readings ------------------------------------------------------

def test_idle_h200_decodes_healthy_and_fp8_capable() -> None:
    rec = recorded()
    f = fields(rec)
    [h] = decode_reading(rec)
    assert h.uuid == f["uuid"] and h.name == f["name"]
    assert h.compute_capability == tuple(f["cuda_compute_capability"])
    assert h.fp8_capable is True
    assert h.temperature_margin_c == f["temperature_slowdown_c"] - f["temperature_gpu_c"]
    assert h.power_ratio == pytest.approx(f["power_usage_mw"] / f["power_limit_enforced_mw"], abs=1e-4)
    assert h.clock_event_names == decode_clock_reasons(f["clocks_event_reasons"])
    assert not h.critical and [p for p in h.problems if p.severity != "info"] == []
    # Hopper: retired pages NotSupported -> absent, never 0
    assert h.retired_pages_dbe is None and h.retired_pages_pending is None and h.nvlink_errors is None
    assert "retired_pages_dbe" in h.absent


def test_loaded_h200_at_its_power_cap_is_power_capped_not_critical() -> None:
    rec = recorded("nvml_h200_load.json")
    [h] = decode_reading(rec)
    assert h.clock_event_reasons is not None and h.clock_event_reasons & 0x4
    assert h.power_capped is True and "sw_power_cap" in h.clock_event_names
    assert "power_capped" in [p.code for p in h.problems]
    assert not h.critical


def test_clock_reason_names() -> None:
    assert decode_clock_reasons(0) == []
    assert decode_clock_reasons(0x1 | 0x40) == ["gpu_idle", "hw_thermal_slowdown"]
    assert decode_clock_reasons(0x200) == ["unknown_0x200"]


def _with(reading: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(reading)
    fields(out).update(changes)
    return out


def _remap(pending: int = 0, failure: int = 0, unc: int = 0) -> list[int]:
    rows = list(fields(recorded())["remapped_rows"])
    rows[1] += unc
    rows[2], rows[3] = pending, failure
    return rows


@pytest.mark.parametrize(("change", "flag", "critical"), [
    ({"remapped_rows": _remap(pending=1)}, "remap_pending", False),
    ({"remapped_rows": _remap(failure=1, unc=1)}, "remap_failure", True),
    ({"ecc_uncorrected_volatile": 1}, "ecc_uncorrected", True),
    ({"clocks_event_reasons": 0x40}, "thermal_slowdown", False),
    ({"clocks_event_reasons": 0x80}, "power_capped", False),
    ({"clocks_event_reasons": 0x8}, "hw_slowdown", False),
])
def test_failure_scenarios_derived_from_the_recording(change: dict[str, Any], flag: str, critical: bool) -> None:
    [h] = decode_reading(_with(recorded(), **change))
    assert getattr(h, flag) is True
    assert h.critical is critical
    assert flag in [p.code for p in h.problems]
    [s] = gpu_signals([h], {"*": [("m", "r")]})
    assert s.values[flag] == 1 and s.values["critical"] == float(critical)


def test_temperature_at_shutdown_threshold_is_critical() -> None:
    rec = recorded()
    [h] = decode_reading(_with(rec, temperature_gpu_c=fields(rec)["temperature_shutdown_c"]))
    assert h.critical and "temperature_shutdown" in [p.code for p in h.problems]
    assert h.temperature_margin_c is not None and h.temperature_margin_c < 0


def test_lost_gpu_is_critical_and_its_unread_fields_absent() -> None:
    rec = recorded()
    g = rec["gpus"][0]
    g["lost"] = True
    g["errors"] = {"temperature_gpu_c": "NVMLError_GpuIsLost: GPU is lost"}
    g["fields"] = {k: g["fields"][k] for k in ("name", "uuid", "pci_bus_id", "cuda_compute_capability")}
    [h] = decode_reading(rec)
    assert h.gpu_lost and h.critical and h.temperature_c is None and h.fp8_capable is None
    [s] = gpu_signals([h], {h.uuid: [("m", "r")]})
    assert s.error is None and s.values["gpu_lost"] == 1 and "temperature_c" not in s.values


def test_other_read_errors_become_warnings() -> None:
    rec = recorded()
    rec["gpus"][0]["errors"] = {"pcie_replay_counter": "NVMLError_NoPermission: Insufficient Permissions"}
    del fields(rec)["pcie_replay_counter"]
    [h] = decode_reading(rec)
    assert not h.critical and h.pcie_replay_counter is None
    assert [p.code for p in h.problems] == ["read_error"]


def test_mig_instances_decode_with_parent_device_fields() -> None:
    rec = recorded()
    g = rec["gpus"][0]
    g["fields"]["mig_mode"] = [1, 1]
    half = {k: v // 2 for k, v in g["fields"]["memory"].items()}
    g["mig_devices"] = [
        {"index": i, "fields": {"uuid": f"MIG-{i}", "name": "MIG 3g", "gpu_instance_id": i + 1,
                                "compute_instance_id": 0, "memory": half}, "not_supported": [], "errors": {}}
        for i in range(2)]
    log = XidLog()
    XidListener(log).handle(g["fields"]["uuid"], EVENT_XID_CRITICAL, 94, gpu_instance_id=2,
                            compute_instance_id=0)
    health = decode_reading(rec, log.take(), xid_listening=True)
    full, mig1, mig2 = health
    assert mig1.parent_uuid == full.uuid and mig1.uuid == "MIG-0"
    assert mig1.temperature_c == full.temperature_c and mig1.fp8_capable is True
    assert mig1.fb_total_mib == pytest.approx(full.fb_total_mib / 2, abs=0.1)
    assert mig1.xid_count == 0 and mig2.xid_count == 1 and full.xid_count == 1
    sig = gpu_signals(health, {"MIG-1": [("m", "r1")], "MIG-0": [("m", "r0")]})
    by_route = {s.route: s for s in sig}
    assert by_route["r1"].values["xid_count"] == 1 and by_route["r0"].values["xid_count"] == 0


# --- FP8 guard and XID table ----------------------------------------------------------------------

@pytest.mark.parametrize(("cc", "cuda", "expected"), [
    ((8, 0), 13000, False),      # A100: no FP8 tensor cores
    ((8, 6), 12080, False),
    ((8, 9), 12000, False),      # Ada needs CUDA 12.1
    ((8, 9), 12010, True),
    ((9, 0), 11080, False),      # Hopper needs CUDA 12.0
    ((9, 0), 12000, True),
    ((10, 0), 12080, True),
    (None, 13000, None),
    ((9, 0), None, None),
])
def test_fp8_guard(cc: tuple[int, int] | None, cuda: int | None, expected: bool | None) -> None:
    ok, reason = fp8_guard(cc, cuda)
    assert ok is expected and reason


def test_fp8_guard_on_the_recording_with_an_old_driver() -> None:
    rec = recorded()
    rec["system"]["fields"]["cuda_driver_version"] = 11080
    [h] = decode_reading(rec)
    assert h.fp8_capable is False and "12.0" in h.fp8_reason
    assert "fp8_unsupported" in [p.code for p in h.problems] and not h.critical
    [s] = gpu_signals([h], {"*": [("m", "r")]})
    assert s.values["fp8_capable"] == 0


@pytest.mark.parametrize(("xid", "severity", "gpu_fault"), [
    (13, "warning", False), (31, "warning", False), (43, "warning", False), (45, "info", False),
    (48, "critical", True), (61, "critical", True), (62, "critical", True), (63, "warning", False),
    (64, "critical", True), (74, "critical", True), (79, "critical", True), (92, "warning", False),
    (94, "warning", False), (95, "critical", True), (119, "critical", True), (120, "critical", True),
    (140, "critical", True),
])
def test_xid_table(xid: int, severity: str, gpu_fault: bool) -> None:
    info = classify_xid(xid)
    assert info is XID_TABLE[xid]
    assert (info.severity, info.gpu_fault) == (severity, gpu_fault) and info.action


def test_unknown_xid_and_non_xid_events() -> None:
    assert classify_xid(9999).action == "investigate"
    assert event_from_nvml("GPU-x", 0x2, 0, 0xFFFFFFFF, 0xFFFFFFFF, 0.0) is None  # DBE event type, no XID
    e = event_from_nvml("GPU-x", EVENT_XID_CRITICAL, 63, 0xFFFFFFFF, 0xFFFFFFFF, 1.0)
    assert e is not None and e.gpu_instance_id is None and not e.gpu_fault


# --- signals --------------------------------------------------------------------------------------

def test_injected_xid_79_makes_the_route_signal_critical() -> None:
    rec = recorded()
    log = XidLog()
    XidListener(log).handle(uuid_of(rec), EVENT_XID_CRITICAL, 79)
    health = decode_reading(rec, log.take(), xid_listening=True)
    [s] = gpu_signals(health, {uuid_of(rec): [("llama", "chat")]})
    assert (s.source, s.model, s.route, s.precision) == ("gpu", "llama", "chat", None)
    assert s.values["xid_critical"] == 1 and s.values["xid_last"] == 79 and s.values["critical"] == 1
    assert s.detail["xids"][0]["action"] == "drain"
    # next sample: the XID is not counted again, but the last one is remembered
    [s2] = gpu_signals(decode_reading(rec, log.take(), xid_listening=True), {uuid_of(rec): [("llama", "chat")]})
    assert s2.values["xid_critical"] == 0 and s2.values["xid_last"] == 79 and s2.values["critical"] == 0


def test_signal_values_leave_absent_fields_out() -> None:
    rec = recorded()
    [s] = gpu_signals(decode_reading(rec), {"0": [("m", "r")]})
    f = fields(rec)
    assert s.values["temperature_margin_c"] == f["temperature_slowdown_c"] - f["temperature_gpu_c"]
    assert s.values["nvml_available"] == 1 and s.values["gpu_lost"] == 0
    assert "xid_critical" not in s.values  # no listener ran: unmeasured, not 0
    assert "xid_last" not in s.values


def test_routes_served_by_several_gpus_take_the_worst_value() -> None:
    rec = recorded()
    second = copy.deepcopy(rec["gpus"][0])
    second["index"] = 1
    second["fields"]["uuid"] = uuid_of(rec) + "-copy"
    second["fields"]["remapped_rows"] = _remap(pending=1)
    second["fields"]["temperature_gpu_c"] += 10
    rec["gpus"].append(second)
    health = decode_reading(rec)
    mapping = {uuid_of(rec): [("llama", "chat")], second["fields"]["uuid"]: [{"model": "llama", "route": "chat"}]}
    [s] = gpu_signals(health, mapping)
    assert s.samples == 2 and s.values["remap_pending"] == 1
    assert s.values["temperature_margin_c"] == min(h.temperature_margin_c for h in health)


def test_globs_expand_against_known_routes_and_missing_gpus_are_errors() -> None:
    rec = recorded()
    health = decode_reading(rec)
    known = [("llama", "chat"), ("llama", "code"), ("qwen", "chat")]
    sig = gpu_signals(health, {uuid_of(rec): [("llama", "*")]}, known_routes=known)
    assert sorted(s.route for s in sig) == ["chat", "code"] and all(s.error is None for s in sig)
    [missing] = gpu_signals(health, {"GPU-not-here": [("qwen", "chat")]})
    assert missing.error == "gpu not found: GPU-not-here"


def test_nvml_unavailable_signal_is_an_error_but_not_a_gpu_failure() -> None:
    [s] = gpu_signals([], {"*": [("llama", "chat")]}, nvml_error="NVMLError_LibraryNotFound", at=5.0)
    assert s.error == "nvml unavailable" and s.values == {"nvml_available": 0.0}
    assert s.detail["state"] == "unavailable"


def _nvml_here() -> bool:
    from probes.gpu_read import init_nvml

    nv, _reason = init_nvml()
    if nv is not None:
        nv.nvmlShutdown()
    return nv is not None


NVML_HERE = _nvml_here()


def test_monitor_on_this_machine() -> None:
    """Without NVML: every route gets an 'nvml unavailable' signal. With NVML: real readings."""
    mon = GpuMonitor(interval_s=0.05, mapping={"*": [("llama", "chat")]})
    mon.start()
    try:
        while mon.samples < 2:
            mon._stop.wait(0.01)
        available, latest = mon.available, mon.latest()
    finally:
        mon.stop()
    [s] = mon.signals()
    if NVML_HERE:
        assert available and latest
        assert s.error is None and s.values["nvml_available"] == 1.0 and s.samples >= 1
        return
    assert mon.latest() == [] and not mon.available
    assert s.error == "nvml unavailable" and s.values == {"nvml_available": 0.0}
    assert "LibraryNotFound" in s.detail["reason"]


# --- gauges ---------------------------------------------------------------------------------------

def test_gauges_use_dcgm_names_and_a_private_registry() -> None:
    rec = recorded()
    reg = CollectorRegistry()
    gauges = GpuGauges(reg)
    log = XidLog()
    XidListener(log).handle(uuid_of(rec), EVENT_XID_CRITICAL, 48)
    health = decode_reading(rec, log.take(), xid_listening=True)
    gauges.update(health)
    f = fields(rec)
    labels = {"gpu": "0", "UUID": f["uuid"], "modelName": f["name"]}
    assert reg.get_sample_value("DCGM_FI_DEV_GPU_TEMP", labels) == f["temperature_gpu_c"]
    assert reg.get_sample_value("DCGM_FI_DEV_POWER_USAGE", labels) == f["power_usage_mw"] / 1000
    assert reg.get_sample_value("DCGM_FI_DEV_ROW_REMAP_FAILURE", labels) == f["remapped_rows"][3]
    assert reg.get_sample_value("DCGM_FI_DEV_XID_ERRORS", labels) == 48
    assert reg.get_sample_value("llmwd_gpu_fp8_capable", labels) == 1
    assert reg.get_sample_value("llmwd_gpu_nvml_available") == 1
    text = generate_latest(reg).decode()
    assert "DCGM_FI_DEV_PCIE_REPLAY_COUNTER{" in text
    assert REGISTRY.get_sample_value("DCGM_FI_DEV_GPU_TEMP", labels) is None
    # a GPU that disappears drops its series; NVML going away is visible
    gauges.update([], nvml_available=False)
    assert reg.get_sample_value("DCGM_FI_DEV_GPU_TEMP", labels) is None
    assert reg.get_sample_value("llmwd_gpu_nvml_available") == 0


# --- CLI ------------------------------------------------------------------------------------------

def test_cli_json_on_this_machine() -> None:
    """Without NVML: exit 0 and 'unavailable'. With NVML: the GPUs, exit 0 unless one is critical."""
    out = subprocess.run([sys.executable, "-m", "probes.gpu_cli", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    data = json.loads(out.stdout)
    if NVML_HERE:
        assert data["nvml_available"] is True and data["gpus"]
        critical = any(g.get("critical") for g in data["gpus"])
        assert out.returncode == (2 if critical else 0)
        return
    assert out.returncode == 0
    assert data["nvml_available"] is False and "LibraryNotFound" in data["error"] and data["gpus"] == []


def test_cli_table_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    gpu_cli.add_gpu_commands(parser.add_subparsers())
    args = parser.parse_args(["gpu"])
    rc = args.func(args)
    out = capsys.readouterr().out
    if NVML_HERE:
        assert rc in (0, 2) and "NVML unavailable" not in out
        return
    assert rc == 0
    assert "NVML unavailable" in out


def test_cli_exit_code_2_on_a_critical_gpu(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rec = _with(recorded(), remapped_rows=_remap(failure=1))
    monkeypatch.setattr(gpu_cli, "snapshot", lambda: (rec, decode_reading(rec)))
    assert gpu_cli.main(["--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["gpus"][0]["remap_failure"] is True
    assert gpu_cli.main([]) == 2
    assert "CRITICAL" in capsys.readouterr().out
