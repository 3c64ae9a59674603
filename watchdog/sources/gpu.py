"""GPU health through NVML as a signal source: ``GpuSource`` adapts ``probes.gpu_monitor.GpuMonitor``.

The monitor samples every GPU in its own thread (``probes.gpu_monitor``); this source hands the
daemon's main loop the monitor's ``source: gpu`` signals at most once per ``interval_s``. The
``gpu`` section of the daemon config (``watchdog.config.settings.GpuConfig``) is read here only.
``probes.gpu_*`` import pynvml lazily: without NVML the monitor reports "unavailable", it never
raises, and the GPU rules stay inconclusive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from watchdog.config.settings import GpuConfig
from watchdog.core.signals import Signal

if TYPE_CHECKING:
    from probes.gpu_monitor import GpuMonitor


def gpu_monitor(cfg: GpuConfig, registry: Any, nvml: Any = None) -> GpuMonitor:
    """The monitor ``cfg`` describes, its gauges in ``registry``. ``nvml`` replaces the pynvml module
    (tests replay readings recorded on an H200)."""
    from probes.gpu_metrics import GpuGauges
    from probes.gpu_monitor import GpuMonitor

    mapping = {gpu: [tuple(entry.split("/", 1)) for entry in entries] for gpu, entries in cfg.routes.items()}
    return GpuMonitor(interval_s=cfg.interval_s, mapping=mapping, gauges=GpuGauges(registry), nvml=nvml,
                      bandwidth_test=cfg.bandwidth_test, bandwidth_every_s=cfg.bandwidth_every_s)


class GpuSource:
    """A daemon signal source (``(now) -> signals``): the monitor's signals, once per ``interval_s``."""

    def __init__(self, monitor: GpuMonitor, interval_s: float) -> None:
        self.monitor = monitor
        self.interval_s = interval_s
        self._last = 0.0

    @classmethod
    def from_config(cls, cfg: GpuConfig, registry: Any, nvml: Any = None) -> GpuSource | None:
        """The source of the config's ``gpu`` section; None when it is not enabled."""
        if not cfg.enabled:
            return None
        return cls(gpu_monitor(cfg, registry, nvml), cfg.interval_s)

    def __call__(self, now: float) -> list[Signal]:
        if now - self._last < self.interval_s:
            return []
        self._last = now
        return self.monitor.signals()
