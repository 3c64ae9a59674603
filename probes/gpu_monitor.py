"""GpuMonitor: samples every GPU on a thread, listens for XIDs, hands out health and signals.

NVML is opened once (``nvmlInit``) and kept open while the monitor runs. Without NVML the monitor
stays in the "unavailable" state, retries ``nvmlInit`` every ``retry_s`` and its ``signals()``
carry error="nvml unavailable" (never a GPU failure).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from probes.gpu import GpuHealth, Scope, decode_reading, gpu_signals, rewindow
from probes.gpu_read import init_nvml, read_all, unavailable_reading
from probes.xid import XidListener, XidLog
from watchdog.core.signals import Signal

log = logging.getLogger(__name__)


class GpuMonitor:
    """Samples all GPUs every ``interval_s`` and keeps the latest ``GpuHealth`` per GPU.

    ``mapping`` is the GPU -> served (model, route) config of ``probes.gpu.gpu_signals``;
    ``gauges`` (a ``probes.gpu_metrics.GpuGauges``) is updated after every sample when given.
    ``nvml`` lets tests pass a module; by default pynvml is imported lazily.
    """

    def __init__(self, interval_s: float = 1.0, mapping: Mapping[str, Iterable[Any]] | None = None, *,
                 known_routes: Sequence[Scope] | None = None, gauges: Any | None = None,
                 listen_xids: bool = True, retry_s: float = 30.0, nvml: Any | None = None,
                 clock: Callable[[], float] = time.time, bandwidth_test: bool = False,
                 bandwidth_every_s: float = 3600.0,
                 bandwidth_fn: Callable[[list[int]], dict[int, dict[str, Any]]] | None = None) -> None:
        self.interval_s = interval_s
        #: device-to-device bandwidth self-test (imports torch): off unless configured
        self.bandwidth_test = bandwidth_test
        self.bandwidth_every_s = bandwidth_every_s
        self._bandwidth_fn = bandwidth_fn
        self._bandwidth: dict[int, dict[str, Any]] = {}
        self._bandwidth_at = -1.0
        self.mapping = dict(mapping or {})
        self.known_routes = known_routes
        self.gauges = gauges
        self.listen_xids = listen_xids
        self.retry_s = retry_s
        self.clock = clock
        self.xid_log = XidLog(consumers=("sample", "signals"))
        self.listener = XidListener(self.xid_log)
        self.samples = 0
        self.sample_errors = 0
        self._nvml_in = nvml
        self._nv: Any = None
        self._error: str | None = "not started"
        self._reading: dict[str, Any] = unavailable_reading("not started", 0.0)
        self._health: list[GpuHealth] = []
        self._last_sample_at = 0.0
        self._last_signals_at = 0.0
        self._last_init_try = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- NVML lifecycle --------------------------------------------------------------------------

    def _ensure_nvml(self) -> bool:
        if self._nv is not None:
            return True
        now = self.clock()
        if self._last_init_try and now - self._last_init_try < self.retry_s:
            return False
        self._last_init_try = now
        nv, reason = init_nvml(self._nvml_in)
        if nv is None:
            if self._error != reason:
                log.warning("NVML unavailable: %s", reason)
            self._error = reason
            return False
        self._nv, self._error = nv, None
        if self.listen_xids:
            n = self.listener.start(nv)
            log.info("XID listener registered on %d GPU(s): %s", n, self.listener.registrations)
        return True

    @property
    def available(self) -> bool:
        return self._nv is not None

    @property
    def error(self) -> str | None:
        return self._error

    # -- sampling ----------------------------------------------------------------------------------

    def _maybe_test_bandwidth(self, reading: Mapping[str, Any]) -> None:
        """Run the bandwidth self-test at start and every ``bandwidth_every_s`` (only when configured)."""
        now = self.clock()
        if not self.bandwidth_test or (self._bandwidth_at >= 0 and now - self._bandwidth_at < self.bandwidth_every_s):
            return
        self._bandwidth_at = now
        indices = [int(g.get("index", i)) for i, g in enumerate(reading.get("gpus", []))]
        try:
            if self._bandwidth_fn is not None:
                self._bandwidth = self._bandwidth_fn(indices)
            else:
                from probes.gpu_bandwidth import measure_all

                self._bandwidth = measure_all(indices)
        except Exception as exc:  # noqa: BLE001 - a failed self-test is a reading error, not a crash
            log.warning("bandwidth self-test failed: %s", exc)
            self._bandwidth = {i: {"error": f"{type(exc).__name__}: {exc}"} for i in indices}

    def sample_once(self) -> list[GpuHealth]:
        """Read every GPU now, decode, update gauges; returns the new health list."""
        if not self._ensure_nvml():
            reading = unavailable_reading(self._error or "nvml unavailable", self.clock())
            health: list[GpuHealth] = []
        else:
            try:
                reading = read_all(self._nv, initialised=True)
            except Exception as exc:  # an unexpected binding failure must not kill the thread
                self.sample_errors += 1
                log.exception("GPU sample failed")
                reading = unavailable_reading(f"sample failed: {exc}", self.clock())
            listening = any(v.startswith("registered") for v in self.listener.registrations.values())
            self._maybe_test_bandwidth(reading)
            health = decode_reading(reading, self.xid_log.take("sample"), since=self._last_sample_at,
                                    xid_listening=listening, bandwidth=self._bandwidth or None)
        with self._lock:
            self._reading, self._health = reading, health
            self._last_sample_at = float(reading.get("time", self.clock()))
            self.samples += 1
        if self.gauges is not None:
            self.gauges.update(health, nvml_available=bool(reading.get("nvml_available")),
                               xid_last={h.uuid: self.xid_log.last(h.uuid) for h in health if h.uuid})
        return health

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.sample_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> GpuMonitor:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="gpu-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
            self._thread = None
        self.listener.stop()
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError as exc:
                log.warning("nvmlShutdown failed: %s", exc)
            self._nv = None
            self._error = "stopped"

    # -- results -----------------------------------------------------------------------------------

    def latest(self) -> list[GpuHealth]:
        with self._lock:
            return list(self._health)

    def reading(self) -> dict[str, Any]:
        """The latest raw reading (what NVML returned)."""
        with self._lock:
            return self._reading

    def signals(self) -> list[Signal]:
        """Signals for every mapped route from the latest sample; XID counts cover the time since
        the previous ``signals()`` call, so no XID is lost between two policy evaluations."""
        with self._lock:
            health, reading = list(self._health), self._reading
        since = self._last_signals_at
        self._last_signals_at = float(reading.get("time", self.clock()))
        if not reading.get("nvml_available"):
            self.xid_log.take("signals")
            return gpu_signals([], self.mapping, known_routes=self.known_routes,
                               nvml_error=reading.get("error") or "nvml unavailable",
                               at=self._last_signals_at)
        xids = self.xid_log.take("signals")
        windowed = []
        for h in health:
            key = h.parent_uuid or h.uuid
            summary = xids.get(key) if key else None
            windowed.append(rewindow(h, summary.events if summary else [], since=since or h.since,
                                     last=self.xid_log.last(key) if key else None))
        return gpu_signals(windowed, self.mapping, known_routes=self.known_routes)
