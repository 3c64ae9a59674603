"""The NVML reader and the XID listener thread, on CPU.

There is no GPU in CI, so these tests drive the real reader code against ``ReplayNvml``: an object
with pynvml's function names that answers with the values recorded on an H200
(tests/data/nvml_h200.json) and raises pynvml's own NotSupported for fields recorded as absent.
The no-NVML path runs for real (pynvml raises NVMLError_LibraryNotFound on this machine).
"""

from __future__ import annotations

import copy
import ctypes
import json
import queue
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from probes.gpu import decode_reading
from probes.gpu_monitor import GpuMonitor
from probes.gpu_read import init_nvml, read_all
from probes.xid import EVENT_XID_CRITICAL, NO_INSTANCE, XidListener, XidLog

DATA = Path(__file__).parent / "data"


def recorded(name: str = "nvml_h200.json") -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


class ReplayNvml:
    """pynvml look-alike serving one recorded reading (one GPU per recorded GPU)."""

    def __init__(self, reading: dict[str, Any], lose_at: str | None = None) -> None:
        for k in dir(pynvml):
            if k.startswith(("NVML_", "NVMLError")):
                setattr(self, k, getattr(pynvml, k))
        self.sys = reading["system"]["fields"]
        self.gpus = reading["gpus"]
        self.lose_at = lose_at
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: list[tuple[int, int]] = []
        self.handles = [ctypes.c_void_p(1000 + i) for i in range(len(self.gpus))]

    # -- helpers
    def _gpu(self, h: Any) -> dict[str, Any]:
        return self.gpus[h.value - 1000]

    def _field(self, h: Any, name: str) -> Any:
        g = self._gpu(h)
        if name == self.lose_at:
            raise pynvml.NVMLError_GpuIsLost()
        if name in g["not_supported"]:
            raise pynvml.NVMLError_NotSupported()
        return g["fields"][name]

    # -- system
    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str: return self.sys["driver_version"]
    def nvmlSystemGetCudaDriverVersion(self) -> int: return self.sys["cuda_driver_version"]
    def nvmlSystemGetNVMLVersion(self) -> str: return self.sys["nvml_version"]
    def nvmlDeviceGetCount(self) -> int: return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any: return self.handles[i]

    # -- device
    def nvmlDeviceGetName(self, h: Any) -> str: return self._field(h, "name")
    def nvmlDeviceGetUUID(self, h: Any) -> str: return self._field(h, "uuid")
    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        return SimpleNamespace(busId=self._field(h, "pci_bus_id"))
    def nvmlDeviceGetCudaComputeCapability(self, h: Any) -> tuple[int, int]:
        return tuple(self._field(h, "cuda_compute_capability"))  # type: ignore[return-value]
    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        return self._field(h, "temperature_gpu_c")
    def nvmlDeviceGetTemperatureThreshold(self, h: Any, t: int) -> int:
        name = {pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "temperature_slowdown_c",
                pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "temperature_shutdown_c"}[t]
        return self._field(h, name)
    def nvmlDeviceGetPowerUsage(self, h: Any) -> int: return self._field(h, "power_usage_mw")
    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int: return self._field(h, "power_limit_enforced_mw")
    def nvmlDeviceGetClockInfo(self, h: Any, c: int) -> int:
        return self._field(h, {pynvml.NVML_CLOCK_SM: "clock_sm_mhz", pynvml.NVML_CLOCK_MEM: "clock_mem_mhz"}[c])
    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int: return self._field(h, "clocks_event_reasons")
    def nvmlDeviceGetEccMode(self, h: Any) -> tuple[int, int]: return tuple(self._field(h, "ecc_mode"))  # type: ignore[return-value]
    def nvmlDeviceGetTotalEccErrors(self, h: Any, etype: int, counter: int) -> int:
        e = {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: "corrected",
             pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "uncorrected"}[etype]
        c = {pynvml.NVML_VOLATILE_ECC: "volatile", pynvml.NVML_AGGREGATE_ECC: "aggregate"}[counter]
        return self._field(h, f"ecc_{e}_{c}")
    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, ...]: return tuple(self._field(h, "remapped_rows"))
    def nvmlDeviceGetRetiredPages(self, h: Any, cause: int) -> list[int]:
        name = "retired_pages_dbe" if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else "retired_pages_sbe"
        return list(range(self._field(h, name)))
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Any) -> int: return self._field(h, "retired_pages_pending")
    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int: return self._field(h, "pcie_replay_counter")
    def nvmlDeviceGetNvLinkState(self, h: Any, link: int) -> int:
        links = self._field(h, "nvlink")
        if str(link) not in links:
            raise pynvml.NVMLError_InvalidArgument()
        return 1
    def nvmlDeviceGetNvLinkErrorCounter(self, h: Any, link: int, counter: int) -> int:
        name = {pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay", pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
                pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit", pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data"}
        return self._field(h, "nvlink")[str(link)][name[counter]]
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any: return SimpleNamespace(**self._field(h, "utilization"))
    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any: return SimpleNamespace(**self._field(h, "memory"))
    def nvmlDeviceGetMigMode(self, h: Any) -> tuple[int, int]: return tuple(self._field(h, "mig_mode"))  # type: ignore[return-value]

    # -- events
    def nvmlEventSetCreate(self) -> object: return object()
    def nvmlEventSetFree(self, es: object) -> None: ...
    def nvmlDeviceGetSupportedEventTypes(self, h: Any) -> int: return 0xff9f  # mask the H200 reported
    def nvmlDeviceRegisterEvents(self, h: Any, mask: int, es: object) -> None:
        self.registered.append((h.value, mask))
    def nvmlEventSetWait_v2(self, es: object, timeout_ms: int) -> Any:
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError_Timeout() from None

    def emit(self, gpu: int, xid: int, event_type: int = EVENT_XID_CRITICAL) -> None:
        self.events.put(SimpleNamespace(device=self.handles[gpu], eventType=event_type, eventData=xid,
                                        gpuInstanceId=NO_INSTANCE, computeInstanceId=NO_INSTANCE))


def _strip_time(reading: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(reading)
    out.pop("time")
    return out


@pytest.mark.parametrize("name", ["nvml_h200.json", "nvml_h200_load.json"])
def test_reader_reproduces_the_recorded_h200_reading(name: str) -> None:
    rec = recorded(name)
    again = read_all(ReplayNvml(rec))
    assert _strip_time(again) == _strip_time(rec)


def test_not_supported_fields_are_absent_not_zero() -> None:
    reading = read_all(ReplayNvml(recorded()))
    gpu = reading["gpus"][0]
    for name in ("retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending", "nvlink"):
        assert name in gpu["not_supported"]
        assert name not in gpu["fields"]


def test_gpu_is_lost_stops_reading_that_gpu_and_marks_it_lost() -> None:
    reading = read_all(ReplayNvml(recorded(), lose_at="power_usage_mw"))
    gpu = reading["gpus"][0]
    assert gpu["lost"] is True
    assert "GpuIsLost" in gpu["errors"]["power_usage_mw"]
    assert "temperature_gpu_c" in gpu["fields"]          # read before the loss
    assert "memory" not in gpu["fields"]                  # never read after it
    [h] = decode_reading(reading)
    assert h.gpu_lost and h.critical and h.fp8_capable is None


def test_nvlink_counters_are_read_per_active_link() -> None:
    rec = recorded()
    g = rec["gpus"][0]
    g["not_supported"].remove("nvlink")
    g["fields"]["nvlink"] = {"0": {"replay": 0, "recovery": 0, "crc_flit": 2, "crc_data": 0},
                             "1": {"replay": 1, "recovery": 0, "crc_flit": 0, "crc_data": 0}}
    reading = read_all(ReplayNvml(rec))
    assert reading["gpus"][0]["fields"]["nvlink"] == g["fields"]["nvlink"]
    [h] = decode_reading(reading)
    assert h.nvlink_errors == {"replay": 1, "recovery": 0, "crc_flit": 2, "crc_data": 0}


def test_this_machines_nvml_state_is_clear_either_way() -> None:
    """Without NVML (CI): a clear unavailable state. With it (a GPU host): a real reading of every GPU."""
    nv, reason = init_nvml()
    reading = read_all()
    if nv is None:
        assert reason is not None and "LibraryNotFound" in reason
        assert reading["nvml_available"] is False and reading["gpus"] == []
        assert decode_reading(reading) == []
        return
    try:
        count = nv.nvmlDeviceGetCount()
    finally:
        nv.nvmlShutdown()
    assert reason is None and reading["nvml_available"] is True and len(reading["gpus"]) == count >= 1
    health = decode_reading(reading)
    assert len(health) >= count and all(h.uuid and h.name for h in health)
    assert all(h.fp8_capable is not None for h in health)


def test_listener_thread_delivers_xid_79_and_stops_within_its_timeout() -> None:
    nv = ReplayNvml(recorded())
    xlog = XidLog()
    listener = XidListener(xlog, timeout_ms=50)
    assert listener.start(nv) == 1
    assert nv.registered == [(1000, EVENT_XID_CRITICAL)]
    nv.emit(0, 79)
    deadline = time.time() + 3
    while not xlog.recent and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    listener.stop()
    assert time.monotonic() - t0 < 1.0
    summary = xlog.take()[recorded()["gpus"][0]["fields"]["uuid"]]
    assert summary.critical == 1 and summary.last == 79
    assert summary.events[0].action == "drain"


def test_monitor_end_to_end_with_replayed_h200_and_a_listener_xid() -> None:
    rec = recorded()
    uuid = rec["gpus"][0]["fields"]["uuid"]
    nv = ReplayNvml(rec)
    mon = GpuMonitor(interval_s=0.05, mapping={uuid: [("llama", "chat")]}, nvml=nv)
    mon.start()
    try:
        deadline = time.time() + 3
        while mon.samples < 2 and time.time() < deadline:
            time.sleep(0.01)
        [before] = mon.signals()
        assert before.error is None and before.values["xid_critical"] == 0
        assert before.values["fp8_capable"] == 1 and before.values["critical"] == 0
        nv.emit(0, 79)
        deadline = time.time() + 3
        while not mon.xid_log.recent and time.time() < deadline:
            time.sleep(0.01)
        while mon.samples < 6 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        mon.stop()
    [after] = mon.signals()
    assert after.values["xid_critical"] == 1 and after.values["xid_last"] == 79
    assert after.values["critical"] == 1
    [later] = mon.signals()  # counted once per signals() window
    assert later.values["xid_critical"] == 0 and later.values["xid_last"] == 79
