"""XID events: the classification table (pure) and the NVML event listener thread (I/O).

The listener waits on an NVML event set with a timeout (so ``stop()`` is honoured within one
timeout), turns each event into an ``XidEvent`` through ``XidListener.handle`` and records it in an
``XidLog``. Tests and replays feed synthetic events through the same ``handle`` method.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from watchdog.core.signals import Severity

log = logging.getLogger(__name__)


#: NVML reports "no MIG instance" as 0xFFFFFFFF in gpuInstanceId / computeInstanceId.
NO_INSTANCE = 0xFFFFFFFF
#: nvmlEventTypeXidCriticalError (eventData carries the XID number).
EVENT_XID_CRITICAL = 0x8


@dataclass(frozen=True, slots=True)
class XidInfo:
    """What an XID means for serving: how bad, and what an operator should do."""

    xid: int
    name: str
    severity: Severity
    action: str
    #: True when the GPU itself (not just one application) is suspect: counts as ``xid_critical``.
    gpu_fault: bool


# Summarised from NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors) for Ampere/Hopper.
# Actions: restart_app (the app's context died, the GPU is fine), reset_gpu (GPU state needs a
# reset before it can be trusted), drain (take the GPU out of service; reset/reboot/RMA),
# check_app (usually an application bug), none (follows another XID; read that one).
XID_TABLE: dict[int, XidInfo] = {x.xid: x for x in (
    XidInfo(8, "GPU stopped processing (channel idle timeout)", "warning", "restart_app", False),
    XidInfo(13, "Graphics engine exception", "warning", "check_app", False),
    XidInfo(31, "GPU memory page fault", "warning", "check_app", False),
    XidInfo(32, "Invalid or corrupted push buffer stream", "warning", "restart_app", False),
    XidInfo(38, "Driver firmware error", "critical", "reset_gpu", True),
    XidInfo(43, "GPU stopped processing (reset channel)", "warning", "restart_app", False),
    XidInfo(45, "Preemptive cleanup due to previous errors", "info", "none", False),
    XidInfo(48, "Double-bit ECC error (DBE)", "critical", "reset_gpu", True),
    XidInfo(61, "Internal micro-controller breakpoint/warning", "critical", "reset_gpu", True),
    XidInfo(62, "Internal micro-controller halt", "critical", "reset_gpu", True),
    XidInfo(63, "Row remapping / page retirement recorded (reset to apply)", "warning", "reset_gpu", False),
    XidInfo(64, "Row remapping / page retirement failure", "critical", "drain", True),
    XidInfo(69, "Graphics engine class error", "warning", "restart_app", False),
    XidInfo(74, "NVLink error", "critical", "reset_gpu", True),
    XidInfo(79, "GPU has fallen off the bus", "critical", "drain", True),
    XidInfo(92, "High single-bit ECC error rate", "warning", "reset_gpu", False),
    XidInfo(94, "Contained ECC error (affected app killed)", "warning", "restart_app", False),
    XidInfo(95, "Uncontained ECC error", "critical", "reset_gpu", True),
    XidInfo(109, "Context switch timeout", "warning", "restart_app", False),
    XidInfo(119, "GSP RPC timeout", "critical", "reset_gpu", True),
    XidInfo(120, "GSP error", "critical", "reset_gpu", True),
    XidInfo(140, "Unrecovered ECC error", "critical", "reset_gpu", True),
    XidInfo(154, "GPU recovery action changed (read it with nvidia-smi -q)", "warning", "reset_gpu", False),
)}


def classify_xid(xid: int) -> XidInfo:
    """The table entry for ``xid``; an XID not in the table is a warning to be looked up."""
    info = XID_TABLE.get(xid)
    if info is not None:
        return info
    return XidInfo(xid, "unknown XID (see NVIDIA's Xid catalogue)", "warning", "investigate", False)


@dataclass(slots=True)
class XidEvent:
    """One XID reported by NVML for one GPU (and MIG instance, where the driver names one)."""

    uuid: str
    xid: int
    time: float
    severity: Severity
    name: str
    action: str
    gpu_fault: bool
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def event_from_nvml(uuid: str, event_type: int, event_data: int, gpu_instance_id: int,
                    compute_instance_id: int, at: float) -> XidEvent | None:
    """Pure: an NVML event record -> XidEvent (None for event types that carry no XID)."""
    if not event_type & EVENT_XID_CRITICAL:
        return None
    info = classify_xid(int(event_data))
    gi = None if gpu_instance_id in (NO_INSTANCE, None) else int(gpu_instance_id)
    ci = None if compute_instance_id in (NO_INSTANCE, None) else int(compute_instance_id)
    return XidEvent(uuid=uuid, xid=int(event_data), time=at, severity=info.severity, name=info.name,
                    action=info.action, gpu_fault=info.gpu_fault, gpu_instance_id=gi,
                    compute_instance_id=ci)


@dataclass(slots=True)
class XidSummary:
    """What happened on one GPU since the last ``XidLog.take``."""

    critical: int = 0
    total: int = 0
    last: int | None = None
    events: list[XidEvent] = field(default_factory=list)


class XidLog:
    """Thread-safe record of XID events per GPU UUID.

    Several readers each get every event once: ``take(consumer)`` hands over what came since that
    consumer's previous call (the sampler and the policy's ``signals()`` read at different paces).
    """

    def __init__(self, keep: int = 100, consumers: Iterable[str] = ("sample",)) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, list[XidEvent]]] = {c: {} for c in consumers}
        self._last: dict[str, int] = {}
        self.recent: deque[XidEvent] = deque(maxlen=keep)
        #: per UUID, per XID: count since start
        self.totals: dict[str, dict[int, int]] = {}

    def record(self, event: XidEvent) -> None:
        with self._lock:
            for pending in self._pending.values():
                pending.setdefault(event.uuid, []).append(event)
            self._last[event.uuid] = event.xid
            per = self.totals.setdefault(event.uuid, {})
            per[event.xid] = per.get(event.xid, 0) + 1
            self.recent.append(event)
        level = logging.ERROR if event.severity == "critical" else logging.WARNING
        log.log(level, "XID %d on %s: %s (action: %s)", event.xid, event.uuid, event.name, event.action)

    def last(self, uuid: str) -> int | None:
        with self._lock:
            return self._last.get(uuid)

    def take(self, consumer: str = "sample") -> dict[str, XidSummary]:
        """Events per UUID since this consumer's previous call (every UUID ever seen appears)."""
        with self._lock:
            pending = self._pending.get(consumer, {})
            self._pending[consumer] = {}
            out: dict[str, XidSummary] = {}
            for uuid, last in self._last.items():
                events = pending.get(uuid, [])
                out[uuid] = XidSummary(critical=sum(1 for e in events if e.gpu_fault), total=len(events),
                                       last=last, events=events)
            return out


def _handle_key(handle: Any) -> int | None:
    """A stable key for an NVML device handle (a ctypes pointer)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class XidListener:
    """Background thread waiting for NVML XID events on every GPU.

    ``start(nv)`` needs an initialised NVML; ``registrations`` says per UUID whether registration
    worked (or why not). ``handle()`` is the single path from an NVML event to the ``XidLog``.
    """

    def __init__(self, xid_log: XidLog, timeout_ms: int = 500) -> None:
        self.log = xid_log
        self.timeout_ms = timeout_ms
        self.registrations: dict[str, str] = {}
        self.error: str | None = None
        self._uuid_by_handle: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self._nv: Any = None

    def handle(self, uuid: str, event_type: int, event_data: int, gpu_instance_id: int = NO_INSTANCE,
               compute_instance_id: int = NO_INSTANCE, at: float | None = None) -> XidEvent | None:
        event = event_from_nvml(uuid, event_type, event_data, gpu_instance_id, compute_instance_id,
                                time.time() if at is None else at)
        if event is not None:
            self.log.record(event)
        return event

    def register(self, nv: Any) -> int:
        """Create the event set and register each GPU for XID events. Returns how many registered."""
        self._nv = nv
        self._event_set = nv.nvmlEventSetCreate()
        ok = 0
        for i in range(int(nv.nvmlDeviceGetCount())):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = nv.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            except nv.NVMLError as exc:
                self.registrations[f"index:{i}"] = f"{type(exc).__name__}: {exc}"
                continue
            try:
                supported = int(nv.nvmlDeviceGetSupportedEventTypes(h))
                if not supported & EVENT_XID_CRITICAL:
                    self.registrations[uuid] = f"XID events not supported (mask {supported:#x})"
                    continue
                nv.nvmlDeviceRegisterEvents(h, EVENT_XID_CRITICAL, self._event_set)
            except nv.NVMLError as exc:
                self.registrations[uuid] = f"{type(exc).__name__}: {exc}"
                continue
            key = _handle_key(h)
            if key is not None:
                self._uuid_by_handle[key] = uuid
            self.registrations[uuid] = f"registered (supported mask {supported:#x})"
            ok += 1
        return ok

    def start(self, nv: Any) -> int:
        try:
            ok = self.register(nv)
        except nv.NVMLError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("XID listener not started: %s", self.error)
            return 0
        if ok:
            self._thread = threading.Thread(target=self._run, name="xid-listener", daemon=True)
            self._thread.start()
        return ok

    def _uuid_of(self, device: Any) -> str:
        key = _handle_key(device)
        if key is not None and key in self._uuid_by_handle:
            return self._uuid_by_handle[key]
        try:
            uuid = self._nv.nvmlDeviceGetUUID(device)
            return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        except self._nv.NVMLError:
            return "unknown"

    def _run(self) -> None:
        nv = self._nv
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, self.timeout_ms)
            except nv.NVMLError_Timeout:
                continue
            except nv.NVMLError as exc:
                # GpuIsLost here still leaves the sampler to report the lost GPU; keep listening.
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("XID wait failed: %s", self.error)
                self._stop.wait(self.timeout_ms / 1000)
                continue
            self.handle(self._uuid_of(data.device), int(data.eventType), int(data.eventData),
                        int(data.gpuInstanceId), int(data.computeInstanceId))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_ms / 1000 + 2)
            self._thread = None
        if self._event_set is not None and self._nv is not None:
            try:
                self._nv.nvmlEventSetFree(self._event_set)
            except self._nv.NVMLError as exc:
                log.warning("nvmlEventSetFree failed: %s", exc)
            self._event_set = None
