"""GPU health: pure decoding of a raw NVML reading, and conversion to policy ``Signal`` objects.

Nothing here does I/O. ``probes.gpu_read.read_all`` produces the raw reading, ``probes.xid``
the XID events, ``probes.gpu_monitor.GpuMonitor`` samples both on a thread. This module turns them
into ``GpuHealth`` (flags, margins, problems with reasons) and into one ``Signal`` per
(model, route) a GPU serves. A field NVML could not give stays absent (None), never 0.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from probes.xid import XidEvent, XidSummary
from watchdog.core.signals import Severity, Signal

#: NVML clock-event ("throttle") reason bits (nvmlClocksEventReason*), checked against nvidia-ml-py 13.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
THERMAL_BITS = 0x20 | 0x40
POWER_CAP_BITS = 0x4 | 0x80

#: FP8 tensor-core GEMMs (cuBLASLt) arrived with CUDA 12.0 for Hopper (sm_90) and 12.1 for Ada (sm_89).
FP8_MIN_CC = (8, 9)
FP8_MIN_CUDA = {(8, 9): 12010, (9, 0): 12000}
FP8_MIN_CUDA_DEFAULT = 12000  # newer architectures (Blackwell 10.x/12.x) need newer CUDA anyway


@dataclass(slots=True)
class Problem:
    severity: Severity
    code: str
    reason: str


@dataclass(slots=True)
class GpuHealth:
    """Decoded health of one GPU (or one MIG instance, which shares its parent's device fields)."""

    index: int
    uuid: str | None
    name: str | None = None
    time: float = 0.0
    #: start of the interval the XID counts cover (previous sample), 0 when unknown
    since: float = 0.0
    parent_uuid: str | None = None
    mig_gpu_instance_id: int | None = None
    mig_compute_instance_id: int | None = None
    pci_bus_id: str | None = None
    compute_capability: tuple[int, int] | None = None
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    temperature_c: int | None = None
    slowdown_c: int | None = None
    shutdown_c: int | None = None
    temperature_margin_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    power_ratio: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    clock_event_reasons: int | None = None
    clock_event_names: list[str] = field(default_factory=list)
    ecc_enabled: bool | None = None
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    pcie_replay_counter: int | None = None
    nvlink_errors: dict[str, int] | None = None
    utilization_gpu_pct: int | None = None
    utilization_mem_pct: int | None = None
    fb_total_mib: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    mig_enabled: bool | None = None
    thermal_slowdown: bool | None = None
    hw_slowdown: bool | None = None
    power_capped: bool | None = None
    ecc_uncorrected: bool | None = None
    fp8_capable: bool | None = None
    fp8_reason: str = ""
    #: device-to-device bandwidth self-test (probes.gpu_bandwidth), absent unless configured
    d2d_bandwidth_gbps: float | None = None
    d2d_bandwidth_nominal_gbps: float | None = None
    d2d_bandwidth_ratio: float | None = None
    bandwidth_low: bool | None = None
    gpu_lost: bool = False
    xid_critical: int = 0
    xid_count: int = 0
    xid_last: int | None = None
    xid_events: list[XidEvent] = field(default_factory=list)
    xid_listening: bool = False
    critical: bool = False
    problems: list[Problem] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    read_errors: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.uuid or f"index:{self.index}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_clock_reasons(mask: int) -> list[str]:
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names


def fp8_guard(cc: Sequence[int] | None, cuda_driver_version: int | None) -> tuple[bool | None, str]:
    """Can this GPU run FP8 GEMMs? (None = cannot tell, because a needed field is absent).

    Needs compute capability >= 8.9 (FP8 tensor cores: Ada 8.9, Hopper 9.0, Blackwell) and a driver
    whose CUDA version is at least the one that brought FP8 GEMMs to that architecture: 12.1 on
    Ada, 12.0 on Hopper and newer. ``cuda_driver_version`` is NVML's encoding (12010 = 12.1).
    """
    if cc is None:
        return None, "compute capability unknown"
    major, minor = int(cc[0]), int(cc[1])
    if (major, minor) < FP8_MIN_CC:
        return False, f"sm_{major}{minor} has no FP8 tensor cores (needs compute capability >= 8.9)"
    need = FP8_MIN_CUDA.get((major, minor), FP8_MIN_CUDA_DEFAULT)
    if cuda_driver_version is None:
        return None, "CUDA driver version unknown"
    have = int(cuda_driver_version)
    if have < need:
        return False, (f"driver CUDA {have // 1000}.{have % 1000 // 10} < {need // 1000}.{need % 1000 // 10} "
                       f"needed for FP8 on sm_{major}{minor}")
    return True, f"sm_{major}{minor} with driver CUDA {have // 1000}.{have % 1000 // 10}"


def _mib(value: Any) -> float | None:
    return None if value is None else round(int(value) / (1024 * 1024), 1)


def _apply_xids(h: GpuHealth, xid: XidSummary | None, listening: bool) -> None:
    h.xid_listening = listening
    if xid is None:
        return
    events = [e for e in xid.events if _event_matches(h, e)]
    h.xid_events = events
    h.xid_critical = sum(1 for e in events if e.gpu_fault)
    h.xid_count = len(events)
    h.xid_last = events[-1].xid if events else xid.last


def _event_matches(h: GpuHealth, e: XidEvent) -> bool:
    """A MIG entry sees its own instance's XIDs plus device-wide ones; a full GPU sees all."""
    if h.mig_gpu_instance_id is None or e.gpu_instance_id is None:
        return True
    return e.gpu_instance_id == h.mig_gpu_instance_id


def _assess(h: GpuHealth) -> None:
    """Flags -> problems and the critical bit. Each problem says why."""
    add = h.problems.append
    if h.gpu_lost:
        add(Problem("critical", "gpu_lost", "NVML reports the GPU is lost (GpuIsLost)"))
    if h.remap_failure:
        add(Problem("critical", "remap_failure", "row remapping failed: drain the GPU (RMA)"))
    if h.ecc_uncorrected:
        add(Problem("critical", "ecc_uncorrected",
                    f"{h.ecc_uncorrected_volatile} uncorrected ECC errors since the last driver load"))
    if h.temperature_c is not None and h.shutdown_c is not None and h.temperature_c >= h.shutdown_c:
        add(Problem("critical", "temperature_shutdown",
                    f"{h.temperature_c} C at or above the shutdown threshold {h.shutdown_c} C"))
    for e in h.xid_events:
        sev: Severity = "critical" if e.gpu_fault else e.severity
        add(Problem(sev, f"xid_{e.xid}", f"XID {e.xid}: {e.name} (action: {e.action})"))
    if h.remap_pending:
        add(Problem("warning", "remap_pending", "row remapping pending: reset the GPU to apply it"))
    if h.retired_pages_pending:
        add(Problem("warning", "retired_pages_pending", "page retirement pending: reset the GPU"))
    if h.thermal_slowdown:
        add(Problem("warning", "thermal_slowdown",
                    f"clocks lowered for temperature ({h.temperature_c} C, slowdown at {h.slowdown_c} C)"))
    if h.hw_slowdown:
        add(Problem("warning", "hw_slowdown", "hardware slowdown (thermal or power brake) is active"))
    if h.power_capped:
        add(Problem("warning", "power_capped",
                    f"clocks lowered by the power cap ({h.power_w} W of {h.power_limit_w} W)"))
    if h.fp8_capable is False:
        add(Problem("info", "fp8_unsupported", h.fp8_reason))
    if h.bandwidth_low:
        add(Problem("warning", "bandwidth_low",
                    f"device-to-device copy {h.d2d_bandwidth_gbps:.0f} GB/s is {h.d2d_bandwidth_ratio:.0%} of "
                    f"the part's nominal {h.d2d_bandwidth_nominal_gbps:.0f} GB/s: FP8's speed-up may vanish"))
    for name, err in h.read_errors.items():
        add(Problem("warning", "read_error", f"{name}: {err}"))
    h.critical = any(p.severity == "critical" for p in h.problems)


def decode_gpu(raw: Mapping[str, Any], system: Mapping[str, Any], *, at: float = 0.0,
               since: float = 0.0, xid: XidSummary | None = None,
               xid_listening: bool = False) -> GpuHealth:
    """Pure: one GPU's raw reading (``probes.gpu_read`` layout) -> GpuHealth."""
    f = raw.get("fields", {})
    sf = system.get("fields", {})
    h = GpuHealth(index=int(raw.get("index", -1)), uuid=f.get("uuid"), name=f.get("name"), time=at,
                  since=since, pci_bus_id=f.get("pci_bus_id"),
                  driver_version=sf.get("driver_version"), cuda_driver_version=sf.get("cuda_driver_version"))
    cc = f.get("cuda_compute_capability")
    h.compute_capability = (int(cc[0]), int(cc[1])) if cc else None
    h.gpu_lost = bool(raw.get("lost", False))
    h.absent = list(raw.get("not_supported", []))
    h.read_errors = {k: v for k, v in raw.get("errors", {}).items() if not h.gpu_lost}
    h.temperature_c = f.get("temperature_gpu_c")
    h.slowdown_c = f.get("temperature_slowdown_c")
    h.shutdown_c = f.get("temperature_shutdown_c")
    if h.temperature_c is not None and h.slowdown_c is not None:
        h.temperature_margin_c = h.slowdown_c - h.temperature_c
    if f.get("power_usage_mw") is not None:
        h.power_w = f["power_usage_mw"] / 1000
    if f.get("power_limit_enforced_mw") is not None:
        h.power_limit_w = f["power_limit_enforced_mw"] / 1000
    if h.power_w is not None and h.power_limit_w:
        h.power_ratio = round(h.power_w / h.power_limit_w, 4)
    h.sm_clock_mhz = f.get("clock_sm_mhz")
    h.mem_clock_mhz = f.get("clock_mem_mhz")
    mask = f.get("clocks_event_reasons")
    if mask is not None:
        h.clock_event_reasons = int(mask)
        h.clock_event_names = decode_clock_reasons(int(mask))
        h.thermal_slowdown = bool(mask & THERMAL_BITS)
        h.power_capped = bool(mask & POWER_CAP_BITS)
        h.hw_slowdown = bool(mask & 0x8)
    if "ecc_mode" in f:
        h.ecc_enabled = bool(f["ecc_mode"][0])
    h.ecc_corrected_volatile = f.get("ecc_corrected_volatile")
    h.ecc_uncorrected_volatile = f.get("ecc_uncorrected_volatile")
    h.ecc_corrected_aggregate = f.get("ecc_corrected_aggregate")
    h.ecc_uncorrected_aggregate = f.get("ecc_uncorrected_aggregate")
    if h.ecc_uncorrected_volatile is not None:
        h.ecc_uncorrected = h.ecc_uncorrected_volatile > 0
    rows = f.get("remapped_rows")
    if rows is not None:
        h.remapped_rows_correctable, h.remapped_rows_uncorrectable = int(rows[0]), int(rows[1])
        h.remap_pending, h.remap_failure = bool(rows[2]), bool(rows[3])
    h.retired_pages_sbe = f.get("retired_pages_sbe")
    h.retired_pages_dbe = f.get("retired_pages_dbe")
    if f.get("retired_pages_pending") is not None:
        h.retired_pages_pending = bool(f["retired_pages_pending"])
    h.pcie_replay_counter = f.get("pcie_replay_counter")
    links = f.get("nvlink")
    if links is not None:
        totals: dict[str, int] = {}
        for counters in links.values():
            for name, value in counters.items():
                totals[name] = totals.get(name, 0) + int(value)
        h.nvlink_errors = totals
    util = f.get("utilization")
    if util is not None:
        h.utilization_gpu_pct, h.utilization_mem_pct = util["gpu"], util["memory"]
    mem = f.get("memory")
    if mem is not None:
        h.fb_total_mib, h.fb_used_mib, h.fb_free_mib = _mib(mem["total"]), _mib(mem["used"]), _mib(mem["free"])
    if f.get("mig_mode") is not None:
        h.mig_enabled = f["mig_mode"][0] == 1
    if not h.gpu_lost:
        h.fp8_capable, h.fp8_reason = fp8_guard(h.compute_capability, h.cuda_driver_version)
    _apply_xids(h, xid, xid_listening)
    _assess(h)
    return h


def _decode_mig(parent: GpuHealth, mig: Mapping[str, Any], xid: XidSummary | None,
                listening: bool) -> GpuHealth:
    """A MIG instance: its own identity and memory, the parent's device-level health."""
    f = mig.get("fields", {})
    h = replace(parent, problems=[], xid_events=[], clock_event_names=list(parent.clock_event_names),
                absent=list(parent.absent))
    h.parent_uuid, h.uuid, h.name = parent.uuid, f.get("uuid"), f.get("name", parent.name)
    h.mig_gpu_instance_id = f.get("gpu_instance_id")
    h.mig_compute_instance_id = f.get("compute_instance_id")
    mem = f.get("memory")
    if mem is not None:
        h.fb_total_mib, h.fb_used_mib, h.fb_free_mib = _mib(mem["total"]), _mib(mem["used"]), _mib(mem["free"])
    h.read_errors = dict(parent.read_errors) | {f"mig.{k}": v for k, v in mig.get("errors", {}).items()}
    _apply_xids(h, xid, listening)
    _assess(h)
    return h


def rewindow(h: GpuHealth, events: Sequence[XidEvent], *, since: float, last: int | None) -> GpuHealth:
    """The same health with the XIDs of another window (e.g. since the previous policy evaluation)."""
    out = replace(h, since=since, problems=[])
    out.xid_events = [e for e in events if _event_matches(out, e)]
    out.xid_critical = sum(1 for e in out.xid_events if e.gpu_fault)
    out.xid_count = len(out.xid_events)
    out.xid_last = last
    _assess(out)
    return out


def apply_bandwidth(h: GpuHealth, result: Mapping[str, Any] | None) -> None:
    """File a ``probes.gpu_bandwidth.measure_d2d`` result into ``h`` (and re-assess its problems)."""
    from probes.gpu_bandwidth import assess

    a = assess(dict(result) if result else None, h.name)
    h.d2d_bandwidth_gbps, h.d2d_bandwidth_nominal_gbps = a["gbps"], a["nominal_gbps"]
    h.d2d_bandwidth_ratio, h.bandwidth_low = a["ratio"], a["low"]
    if a["error"]:
        h.read_errors["d2d_bandwidth"] = a["error"]
    h.problems.clear()
    _assess(h)


def decode_reading(reading: Mapping[str, Any], xids: Mapping[str, XidSummary] | None = None, *,
                   since: float = 0.0, xid_listening: bool = False,
                   bandwidth: Mapping[int, Mapping[str, Any]] | None = None) -> list[GpuHealth]:
    """Pure: a whole reading -> one GpuHealth per GPU, plus one per MIG instance. [] if unavailable.

    ``bandwidth``: GPU index -> bandwidth self-test result (see ``apply_bandwidth``)."""
    if not reading.get("nvml_available"):
        return []
    at = float(reading.get("time", 0.0))
    system = reading.get("system", {})
    out: list[GpuHealth] = []
    for raw in reading.get("gpus", []):
        uuid = raw.get("fields", {}).get("uuid")
        summary = (xids or {}).get(uuid) if uuid else None
        h = decode_gpu(raw, system, at=at, since=since, xid=summary, xid_listening=xid_listening)
        if bandwidth and h.index in bandwidth:
            apply_bandwidth(h, bandwidth[h.index])
        out.append(h)
        for mig in raw.get("mig_devices", []):
            out.append(_decode_mig(h, mig, summary, xid_listening))
    return out


# --- signals -------------------------------------------------------------------------------------

#: How the values of several GPUs serving one route combine: the worst one wins.
SIGNAL_REDUCE: dict[str, str] = {
    "nvml_available": "min", "gpu_lost": "max", "critical": "max", "xid_critical": "sum",
    "xid_count": "sum", "xid_last": "latest", "ecc_uncorrected": "max", "ecc_uncorrected_volatile": "max",
    "ecc_corrected_volatile": "max", "remap_pending": "max", "remap_failure": "max",
    "remapped_rows_uncorrectable": "max", "thermal_slowdown": "max", "hw_slowdown": "max",
    "power_capped": "max", "temperature_c": "max", "temperature_margin_c": "min", "power_ratio": "max",
    "fp8_capable": "min", "pcie_replay_counter": "max", "utilization_gpu_pct": "max",
    "compute_capability": "min", "cuda_driver_version": "min", "d2d_bandwidth_gbps": "min",
    "d2d_bandwidth_ratio": "min", "bandwidth_low": "max",
}


def health_values(h: GpuHealth) -> dict[str, float]:
    """Signal values of one GPU; a value whose source field is absent is left out."""
    v: dict[str, float] = {"nvml_available": 1.0, "gpu_lost": float(h.gpu_lost),
                           "critical": float(h.critical)}
    if h.xid_listening or h.xid_count:
        v["xid_critical"] = float(h.xid_critical)
        v["xid_count"] = float(h.xid_count)
    optional: dict[str, Any] = {
        "xid_last": h.xid_last, "ecc_uncorrected": h.ecc_uncorrected,
        "ecc_uncorrected_volatile": h.ecc_uncorrected_volatile,
        "ecc_corrected_volatile": h.ecc_corrected_volatile, "remap_pending": h.remap_pending,
        "remap_failure": h.remap_failure, "remapped_rows_uncorrectable": h.remapped_rows_uncorrectable,
        "thermal_slowdown": h.thermal_slowdown, "hw_slowdown": h.hw_slowdown,
        "power_capped": h.power_capped, "temperature_c": h.temperature_c,
        "temperature_margin_c": h.temperature_margin_c, "power_ratio": h.power_ratio,
        "fp8_capable": h.fp8_capable, "pcie_replay_counter": h.pcie_replay_counter,
        "utilization_gpu_pct": h.utilization_gpu_pct,
        # FP8 stack guard inputs: 9.0 = sm_90; NVML's CUDA driver version as major.minor (13.0)
        "compute_capability": (h.compute_capability[0] + h.compute_capability[1] / 10
                               if h.compute_capability else None),
        "cuda_driver_version": (h.cuda_driver_version // 1000 + h.cuda_driver_version % 1000 / 100
                                if h.cuda_driver_version else None),
        "d2d_bandwidth_gbps": h.d2d_bandwidth_gbps, "d2d_bandwidth_ratio": h.d2d_bandwidth_ratio,
        "bandwidth_low": h.bandwidth_low,
    }
    for name, value in optional.items():
        if value is not None:
            v[name] = float(value)
    return v


def _reduce(name: str, items: list[tuple[float, float]]) -> float:
    """items: (value, time of the GPU's latest XID or sample)."""
    how = SIGNAL_REDUCE.get(name, "max")
    values = [v for v, _ in items]
    if how == "min":
        return min(values)
    if how == "sum":
        return sum(values)
    if how == "latest":
        return max(items, key=lambda it: it[1])[0]
    return max(values)


Scope = tuple[str, str]


def _entries(spec: Iterable[Any]) -> list[Scope]:
    out: list[Scope] = []
    for item in spec:
        if isinstance(item, Mapping):
            out.append((str(item["model"]), str(item["route"])))
        else:
            model, route = item
            out.append((str(model), str(route)))
    return out


def _expand(scope: Scope, known: Sequence[Scope] | None) -> list[Scope]:
    model, route = scope
    if known is None or not any(ch in model + route for ch in "*?["):
        return [scope]
    return [(m, r) for m, r in known if fnmatch.fnmatchcase(m, model) and fnmatch.fnmatchcase(r, route)]


def _gpu_keys(h: GpuHealth) -> set[str]:
    keys = {str(h.index), "*"}
    if h.uuid:
        keys.add(h.uuid)
    return keys


def gpu_signals(health: Sequence[GpuHealth], mapping: Mapping[str, Iterable[Any]], *,
                known_routes: Sequence[Scope] | None = None, nvml_error: str | None = None,
                at: float | None = None) -> list[Signal]:
    """One ``Signal`` (source="gpu", precision=None) per (model, route) served by a mapped GPU.

    ``mapping``: GPU key -> (model, route) pairs (tuples or {"model", "route"} dicts). A key is a
    GPU UUID, a MIG instance UUID, a GPU index as text, or "*" for every GPU. Pairs may use
    fnmatch globs, expanded against ``known_routes`` when given. When several GPUs serve a route
    their values combine by ``SIGNAL_REDUCE`` (the worst wins). ``nvml_error`` (NVML unavailable)
    gives every route a signal with error="nvml unavailable" and only ``nvml_available`` = 0.
    """
    served: dict[Scope, list[str]] = {}
    for key, spec in mapping.items():
        for scope in _entries(spec):
            for s in _expand(scope, known_routes):
                served.setdefault(s, []).append(key)
    end = at if at is not None else max((h.time for h in health), default=0.0)
    signals: list[Signal] = []
    for (model, route), keys in served.items():
        if nvml_error is not None:
            signals.append(Signal(source="gpu", model=model, route=route, precision=None, start=end,
                                  end=end, samples=0, values={"nvml_available": 0.0},
                                  error="nvml unavailable",
                                  detail={"state": "unavailable", "reason": nvml_error, "gpus": keys}))
            continue
        gpus = [h for h in health if _gpu_keys(h) & set(keys)]
        missing = [k for k in keys if k != "*" and not any(k in _gpu_keys(h) for h in gpus)]
        per: dict[str, list[tuple[float, float]]] = {}
        for h in gpus:
            last_at = h.xid_events[-1].time if h.xid_events else h.time
            for name, value in health_values(h).items():
                per.setdefault(name, []).append((value, last_at))
        values = {name: _reduce(name, items) for name, items in per.items()}
        error = f"gpu not found: {', '.join(missing)}" if missing else None
        if not gpus and error is None:
            error = "no GPU matched"
        signals.append(Signal(
            source="gpu", model=model, route=route, precision=None,
            start=min((h.since or h.time for h in gpus), default=end), end=end, samples=len(gpus),
            values=values, error=error,
            detail={"gpus": [h.label for h in gpus],
                    "problems": [f"{h.label}: {p.severity} {p.code}: {p.reason}" for h in gpus
                                 for p in h.problems if p.severity != "info"],
                    "xids": [e.to_dict() for h in gpus for e in h.xid_events]}))
    return signals
