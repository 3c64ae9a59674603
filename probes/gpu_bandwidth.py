"""Device-to-device memory bandwidth self-test (needs torch with CUDA; imported only when configured).

FP8 decode is memory-bound: its gain over FP16 is the halved weight bytes, so a GPU whose HBM runs far
below its part's nominal bandwidth (a degraded stack, a mis-clocked or shared part) loses FP8's
advantage first. ``measure_d2d`` times large device-to-device copies with CUDA events and counts bytes
read plus bytes written; ``assess`` compares the result with the part's nominal (datasheet) figure.
Below ``LOW_RATIO`` of nominal the GPU gets the ``bandwidth_low`` flag. Measured on an H200 here:
about 4.3 TB/s of its nominal 4.8 (0.9).

Without torch or CUDA the test returns an error string, never raises.
"""

from __future__ import annotations

import time
from typing import Any

#: fraction of nominal below which the bandwidth counts as low
LOW_RATIO = 0.70

#: nominal HBM/GDDR bandwidth, GB/s, by a distinctive part of NVML's device name (first match wins)
NOMINAL_GBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4000.0), ("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
    ("H800", 3350.0), ("B200", 8000.0), ("B100", 8000.0), ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0), ("L40S", 864.0), ("L40", 864.0), ("L4", 300.0), ("A10G", 600.0), ("A10", 600.0),
    ("RTX 6000 Ada", 960.0), ("RTX 4090", 1008.0),
)


def nominal_gbps(name: str | None) -> float | None:
    if not name:
        return None
    for key, gbps in NOMINAL_GBPS:
        if key.lower() in name.lower():
            return gbps
    return None


def measure_d2d(device_index: int = 0, size_mib: int = 1024, reps: int = 20) -> dict[str, Any]:
    """{'gbps': float, 'seconds': float, 'bytes': int} or {'error': str}. Median of ``reps`` copies."""
    try:
        import torch
    except ImportError as exc:
        return {"error": f"torch not installed: {exc}"}
    if not torch.cuda.is_available() or device_index >= torch.cuda.device_count():
        return {"error": f"no CUDA device {device_index}"}
    t0 = time.perf_counter()
    try:
        dev = torch.device("cuda", device_index)
        n = size_mib * 1024 * 1024 // 4
        src = torch.randn(n, device=dev)  # random data, not zeros
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        times = []
        with torch.cuda.device(dev):
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1000.0)
        if not torch.equal(dst[:1024], src[:1024]):
            return {"error": "copy check failed"}
        times.sort()
        sec = times[len(times) // 2]
        moved = 2 * src.numel() * src.element_size()
        del src, dst
        torch.cuda.empty_cache()
        return {"gbps": moved / sec / 1e9, "seconds": sec, "bytes": moved, "test_s": time.perf_counter() - t0}
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def assess(measured: dict[str, Any] | None, name: str | None) -> dict[str, Any]:
    """Pure: a ``measure_d2d`` result + the device name -> gbps, nominal, ratio, low (None: unknown)."""
    out: dict[str, Any] = {"gbps": None, "nominal_gbps": nominal_gbps(name), "ratio": None, "low": None,
                           "error": None}
    if not measured:
        return out
    if measured.get("error"):
        out["error"] = str(measured["error"])
        return out
    out["gbps"] = float(measured["gbps"])
    if out["nominal_gbps"]:
        out["ratio"] = out["gbps"] / out["nominal_gbps"]
        out["low"] = out["ratio"] < LOW_RATIO
    return out


def measure_all(indices: list[int], size_mib: int = 1024) -> dict[int, dict[str, Any]]:
    return {i: measure_d2d(i, size_mib) for i in indices}
