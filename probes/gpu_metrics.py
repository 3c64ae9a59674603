"""Prometheus gauges for GPU health, named like NVIDIA dcgm-exporter where they mean the same.

Gauges are registered into the registry passed in (never the global one), with dcgm-exporter's
labels ``gpu`` (index), ``UUID`` and ``modelName``. Units follow dcgm-exporter: W, MHz, °C, MiB.
MIG instances are not exported separately (their device fields are the parent's).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from probes.gpu import GpuHealth

log = logging.getLogger(__name__)

LABELS = ("gpu", "UUID", "modelName")

#: gauge name -> (help, GpuHealth attribute or callable)
GAUGES: dict[str, tuple[str, Any]] = {
    "DCGM_FI_DEV_GPU_TEMP": ("GPU temperature (in C).", "temperature_c"),
    "DCGM_FI_DEV_POWER_USAGE": ("Power draw (in W).", "power_w"),
    "DCGM_FI_DEV_SM_CLOCK": ("SM clock frequency (in MHz).", "sm_clock_mhz"),
    "DCGM_FI_DEV_MEM_CLOCK": ("Memory clock frequency (in MHz).", "mem_clock_mhz"),
    "DCGM_FI_DEV_GPU_UTIL": ("GPU utilization (in %).", "utilization_gpu_pct"),
    "DCGM_FI_DEV_FB_USED": ("Framebuffer memory used (in MiB).", "fb_used_mib"),
    "DCGM_FI_DEV_FB_FREE": ("Framebuffer memory free (in MiB).", "fb_free_mib"),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("Total number of single-bit volatile ECC errors.",
                                      "ecc_corrected_volatile"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("Total number of double-bit volatile ECC errors.",
                                      "ecc_uncorrected_volatile"),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("Number of remapped rows for correctable errors.",
                                              "remapped_rows_correctable"),
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("Number of remapped rows for uncorrectable errors.",
                                                "remapped_rows_uncorrectable"),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": ("Whether remapping of rows has failed.", "remap_failure"),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": ("Whether remapping of rows is pending (reset needed).", "remap_pending"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": ("Current clock event (throttle) reasons, NVML bitmask.",
                                         "clock_event_reasons"),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("Total number of PCIe retries.", "pcie_replay_counter"),
    "llmwd_gpu_fp8_capable": ("1 when the GPU and driver can run FP8 GEMMs (cc >= 8.9, CUDA new enough).",
                              "fp8_capable"),
    "llmwd_gpu_temperature_margin_celsius": ("Degrees below the slowdown threshold.", "temperature_margin_c"),
    "llmwd_gpu_power_ratio": ("Power draw / enforced power limit.", "power_ratio"),
    "llmwd_gpu_lost": ("1 when NVML reports the GPU is lost.", "gpu_lost"),
    "llmwd_gpu_critical": ("1 when the GPU has a critical problem.", "critical"),
}


class GpuGauges:
    """Holds the gauges; ``update(health)`` sets them from the latest sample."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Gauge

        self.gauges = {name: Gauge(name, doc, LABELS, registry=registry) for name, (doc, _) in GAUGES.items()}
        self.xid = Gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", LABELS,
                         registry=registry)
        self.nvml_available = Gauge("llmwd_gpu_nvml_available", "1 when NVML could be initialised.",
                                    registry=registry)
        self._seen: set[tuple[str, str, str]] = set()

    def update(self, health: Sequence[GpuHealth], *, nvml_available: bool = True,
               xid_last: Mapping[str, int | None] | None = None) -> None:
        self.nvml_available.set(1 if nvml_available else 0)
        current: set[tuple[str, str, str]] = set()
        for h in health:
            if h.parent_uuid is not None:
                continue
            labels = (str(h.index), h.uuid or "", h.name or "")
            current.add(labels)
            for name, (_, attr) in GAUGES.items():
                value = getattr(h, attr)
                if value is None:
                    # absent in NVML: drop the series rather than export a fake 0
                    self._remove(self.gauges[name], labels)
                else:
                    self.gauges[name].labels(*labels).set(float(value))
            last = (xid_last or {}).get(h.uuid or "", h.xid_last)
            if h.xid_listening or last is not None:
                self.xid.labels(*labels).set(float(last or 0))
        for labels in self._seen - current:
            for g in [*self.gauges.values(), self.xid]:
                self._remove(g, labels)
        self._seen = current

    @staticmethod
    def _remove(gauge: Any, labels: tuple[str, str, str]) -> None:
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)
