"""Read raw GPU state through NVML (the I/O edge of the GPU probe).

``read_all()`` calls pynvml and returns a plain, JSON-serialisable *reading*: the exact values NVML
returned, field by field. A call that raises NotSupported (or is missing from the driver) leaves its
field absent and names it under ``not_supported``; any other NVML error is kept as text under
``errors``; ``NVMLError_GpuIsLost`` sets ``lost`` and stops reading that GPU. Interpreting the
values (margins, flags, problems) is the pure job of ``probes.gpu.decode_reading``.

pynvml is imported lazily so that importing this module never needs NVML.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Version of the reading layout below; bump when a field changes meaning.
READING_SCHEMA = 1

#: NVLink error counters read per active link (pynvml constant name -> field name).
NVLINK_COUNTERS = {
    "NVML_NVLINK_ERROR_DL_REPLAY": "replay",
    "NVML_NVLINK_ERROR_DL_RECOVERY": "recovery",
    "NVML_NVLINK_ERROR_DL_CRC_FLIT": "crc_flit",
    "NVML_NVLINK_ERROR_DL_CRC_DATA": "crc_data",
}


class GpuLost(Exception):
    """Raised inside the reader when NVML says the GPU is lost; ends the reading of that GPU."""


def load_nvml() -> Any:
    """Import pynvml (raises ImportError when nvidia-ml-py is not installed)."""
    import pynvml

    return pynvml


def unavailable_reading(reason: str, at: float | None = None) -> dict[str, Any]:
    """The reading for a host where NVML cannot be used at all (no library, no driver, no GPU)."""
    return {
        "schema": READING_SCHEMA,
        "time": time.time() if at is None else at,
        "nvml_available": False,
        "error": reason,
        "system": {},
        "gpus": [],
    }


def init_nvml(nvml: Any | None = None) -> tuple[Any | None, str | None]:
    """Initialise NVML. Returns (pynvml module, None) or (None, reason it is unavailable)."""
    try:
        nv = load_nvml() if nvml is None else nvml
    except ImportError as exc:
        return None, f"nvidia-ml-py not installed: {exc}"
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    except OSError as exc:  # a broken libnvidia-ml.so can fail to load at the ctypes level
        return None, f"NVML library failed to load: {exc}"
    return nv, None


class _FieldReader:
    """Calls NVML functions and files each result (or its absence) into one record."""

    def __init__(self, nv: Any, record: dict[str, Any]) -> None:
        self.nv = nv
        self.record = record
        record.setdefault("fields", {})
        record.setdefault("not_supported", [])
        record.setdefault("errors", {})

    def get(self, name: str, fn: Callable[..., Any], *args: Any,
            convert: Callable[[Any], Any] | None = None) -> Any:
        nv = self.nv
        try:
            value = fn(*args)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            self.record["not_supported"].append(name)
            return None
        except nv.NVMLError_GpuIsLost as exc:
            self.record["errors"][name] = f"{type(exc).__name__}: {exc}"
            self.record["lost"] = True
            raise GpuLost(name) from exc
        except nv.NVMLError as exc:
            self.record["errors"][name] = f"{type(exc).__name__}: {exc}"
            return None
        if convert is not None:
            value = convert(value)
        self.record["fields"][name] = value
        return value


def _memory(info: Any) -> dict[str, int]:
    return {"total": int(info.total), "free": int(info.free), "used": int(info.used)}


def _utilization(util: Any) -> dict[str, int]:
    return {"gpu": int(util.gpu), "memory": int(util.memory)}


def _pair(value: Any) -> list[int]:
    return [int(v) for v in value]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_system(nv: Any) -> dict[str, Any]:
    record: dict[str, Any] = {}
    r = _FieldReader(nv, record)
    r.get("driver_version", nv.nvmlSystemGetDriverVersion, convert=_text)
    r.get("cuda_driver_version", nv.nvmlSystemGetCudaDriverVersion, convert=int)
    r.get("nvml_version", nv.nvmlSystemGetNVMLVersion, convert=_text)
    r.get("device_count", nv.nvmlDeviceGetCount, convert=int)
    return record


def _read_nvlink(nv: Any, r: _FieldReader, handle: Any) -> None:
    """Per active link, the DL error counters. The first link answering NotSupported ends the scan."""
    links: dict[str, dict[str, int]] = {}
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            active = nv.nvmlDeviceGetNvLinkState(handle, link)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            if link == 0:
                r.record["not_supported"].append("nvlink")
                return
            break
        except nv.NVMLError_InvalidArgument:
            break
        except nv.NVMLError_GpuIsLost as exc:
            r.record["errors"]["nvlink"] = f"{type(exc).__name__}: {exc}"
            r.record["lost"] = True
            raise GpuLost("nvlink") from exc
        except nv.NVMLError as exc:
            r.record["errors"][f"nvlink_state_{link}"] = f"{type(exc).__name__}: {exc}"
            continue
        if not active:
            continue
        counters: dict[str, int] = {}
        for const, name in NVLINK_COUNTERS.items():
            try:
                counters[name] = int(nv.nvmlDeviceGetNvLinkErrorCounter(handle, link, getattr(nv, const)))
            except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
                continue
            except nv.NVMLError as exc:
                r.record["errors"][f"nvlink_{link}_{name}"] = f"{type(exc).__name__}: {exc}"
        links[str(link)] = counters
    r.record["fields"]["nvlink"] = links


def _read_device(nv: Any, handle: Any, record: dict[str, Any]) -> None:
    r = _FieldReader(nv, record)
    r.get("name", nv.nvmlDeviceGetName, handle, convert=_text)
    r.get("uuid", nv.nvmlDeviceGetUUID, handle, convert=_text)
    r.get("pci_bus_id", lambda h: nv.nvmlDeviceGetPciInfo(h).busId, handle, convert=_text)
    r.get("cuda_compute_capability", nv.nvmlDeviceGetCudaComputeCapability, handle, convert=_pair)
    r.get("temperature_gpu_c", nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU, convert=int)
    r.get("temperature_slowdown_c", nv.nvmlDeviceGetTemperatureThreshold, handle,
          nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, convert=int)
    r.get("temperature_shutdown_c", nv.nvmlDeviceGetTemperatureThreshold, handle,
          nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN, convert=int)
    r.get("power_usage_mw", nv.nvmlDeviceGetPowerUsage, handle, convert=int)
    r.get("power_limit_enforced_mw", nv.nvmlDeviceGetEnforcedPowerLimit, handle, convert=int)
    r.get("clock_sm_mhz", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM, convert=int)
    r.get("clock_mem_mhz", nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM, convert=int)
    # nvidia-ml-py < 12.535 only has the older name of the same call
    reasons_fn = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
    r.get("clocks_event_reasons", reasons_fn, handle, convert=int)
    r.get("ecc_mode", nv.nvmlDeviceGetEccMode, handle, convert=_pair)
    for counter, cname in ((nv.NVML_VOLATILE_ECC, "volatile"), (nv.NVML_AGGREGATE_ECC, "aggregate")):
        for etype, ename in ((nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, "corrected"),
                             (nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "uncorrected")):
            r.get(f"ecc_{ename}_{cname}", nv.nvmlDeviceGetTotalEccErrors, handle, etype, counter,
                  convert=int)
    r.get("remapped_rows", nv.nvmlDeviceGetRemappedRows, handle, convert=_pair)
    for cause, cname in ((nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, "sbe"),
                         (nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, "dbe")):
        r.get(f"retired_pages_{cname}", nv.nvmlDeviceGetRetiredPages, handle, cause, convert=len)
    r.get("retired_pages_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, handle, convert=int)
    r.get("pcie_replay_counter", nv.nvmlDeviceGetPcieReplayCounter, handle, convert=int)
    _read_nvlink(nv, r, handle)
    r.get("utilization", nv.nvmlDeviceGetUtilizationRates, handle, convert=_utilization)
    r.get("memory", nv.nvmlDeviceGetMemoryInfo, handle, convert=_memory)
    r.get("mig_mode", nv.nvmlDeviceGetMigMode, handle, convert=_pair)


def _read_mig_devices(nv: Any, handle: Any, record: dict[str, Any]) -> None:
    """MIG instances of a GPU whose current MIG mode is on: identity and their own memory."""
    mode = record["fields"].get("mig_mode")
    if not mode or mode[0] != 1:
        return
    migs: list[dict[str, Any]] = []
    try:
        count = int(nv.nvmlDeviceGetMaxMigDeviceCount(handle))
    except nv.NVMLError as exc:
        record["errors"]["mig_device_count"] = f"{type(exc).__name__}: {exc}"
        return
    for i in range(count):
        try:
            mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except nv.NVMLError_NotFound:
            continue
        except nv.NVMLError as exc:
            record["errors"][f"mig_{i}"] = f"{type(exc).__name__}: {exc}"
            continue
        mig: dict[str, Any] = {"index": i}
        r = _FieldReader(nv, mig)
        try:
            r.get("uuid", nv.nvmlDeviceGetUUID, mh, convert=_text)
            r.get("name", nv.nvmlDeviceGetName, mh, convert=_text)
            r.get("gpu_instance_id", nv.nvmlDeviceGetGpuInstanceId, mh, convert=int)
            r.get("compute_instance_id", nv.nvmlDeviceGetComputeInstanceId, mh, convert=int)
            r.get("memory", nv.nvmlDeviceGetMemoryInfo, mh, convert=_memory)
        except GpuLost:
            pass
        migs.append(mig)
    record["mig_devices"] = migs


def read_gpu(nv: Any, index: int) -> dict[str, Any]:
    """The raw reading of one GPU (and its MIG instances). Never raises for NVML errors."""
    record: dict[str, Any] = {"index": index, "lost": False, "fields": {}, "not_supported": [],
                              "errors": {}, "mig_devices": []}
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError_GpuIsLost as exc:
        record["lost"] = True
        record["errors"]["handle"] = f"{type(exc).__name__}: {exc}"
        return record
    except nv.NVMLError as exc:
        record["errors"]["handle"] = f"{type(exc).__name__}: {exc}"
        return record
    try:
        _read_device(nv, handle, record)
        _read_mig_devices(nv, handle, record)
    except GpuLost:
        log.error("GPU %d is lost (NVML GpuIsLost)", index)
    return record


def read_all(nvml: Any | None = None, *, initialised: bool = False) -> dict[str, Any]:
    """One reading of every GPU. Returns the unavailable reading when NVML cannot start.

    With ``initialised=True`` the caller owns nvmlInit/nvmlShutdown (the monitor keeps NVML
    open across samples); otherwise this call initialises and shuts NVML down itself.
    """
    at = time.time()
    if initialised:
        nv = nvml if nvml is not None else load_nvml()
    else:
        nv, reason = init_nvml(nvml)
        if nv is None:
            return unavailable_reading(reason or "nvml unavailable", at)
    try:
        system = _read_system(nv)
        count = system["fields"].get("device_count")
        gpus = [read_gpu(nv, i) for i in range(count or 0)]
        return {"schema": READING_SCHEMA, "time": at, "nvml_available": True, "error": None,
                "system": system, "gpus": gpus}
    finally:
        if not initialised:
            try:
                nv.nvmlShutdown()
            except nv.NVMLError as exc:
                log.warning("nvmlShutdown failed: %s", exc)
