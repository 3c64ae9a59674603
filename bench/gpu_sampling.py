"""CPU cost of GPU health sampling: a GpuMonitor at 1 Hz (XID listener on) for --seconds.

Reports process CPU time / wall time (percent of one core), the time one ``read_all`` takes,
and how many samples ran. Run: ``python bench/gpu_sampling.py --seconds 20``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from probes.gpu_monitor import GpuMonitor  # noqa: E402
from probes.gpu_read import init_nvml, read_all  # noqa: E402


def read_latency_ms(n: int) -> dict[str, float] | None:
    nv, _ = init_nvml()
    if nv is None:
        return None
    try:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            read_all(nv, initialised=True)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        nv.nvmlShutdown()
    return {"n": n, "median_ms": round(statistics.median(times), 3), "max_ms": round(max(times), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--reads", type=int, default=20, help="back-to-back read_all calls timed first")
    args = ap.parse_args()

    latency = read_latency_ms(args.reads)
    mon = GpuMonitor(interval_s=args.interval, mapping={"*": [("bench", "default")]})
    cpu0, wall0 = time.process_time(), time.perf_counter()
    mon.start()
    time.sleep(args.seconds)
    mon.stop()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    result = {
        "nvml_available": latency is not None,
        "nvml_error": None if latency is not None else mon.reading().get("error"),
        "interval_s": args.interval, "wall_s": round(wall, 3), "cpu_s": round(cpu, 4),
        "cpu_pct_of_one_core": round(100 * cpu / wall, 4), "samples": mon.samples,
        "gpus": len(mon.latest()), "xid_registrations": mon.listener.registrations,
        "read_all_latency": latency,
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
