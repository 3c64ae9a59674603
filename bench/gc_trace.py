"""Run a module with every pass of the cyclic collector written to a file, whatever tree it comes from.

    python bench/gc_trace.py OUT -m MODULE [ARGS...]

Each line of OUT: ``<time.time()> <generation> <seconds> <collected>``, one per pass on any thread.
``bench/growth.py`` runs the daemons of both trees of an A/B through it (``read`` sums a span), so
the collector's pauses are measured the same way in a tree that does not export them.
"""

from __future__ import annotations

import gc
import runpy
import sys
import time
from pathlib import Path
from typing import Any


def install(path: Path) -> None:
    out = open(path, "w", buffering=1)  # noqa: SIM115 - open for the life of the process
    started = [0.0]

    def trace(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            out.write(f"{time.time():.3f} {info['generation']} {time.perf_counter() - started[0]:.6f} "
                      f"{info['collected']}\n")

    gc.callbacks.append(trace)


def read(path: Path, t0: float, t1: float) -> dict[int, tuple[list[float], int]]:
    """Seconds of each pass between wall times ``t0`` and ``t1`` and the objects they collected, by generation."""
    seconds: dict[int, list[float]] = {0: [], 1: [], 2: []}
    collected = {0: 0, 1: 0, 2: 0}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and t0 <= float(parts[0]) <= t1:
            seconds[int(parts[1])].append(float(parts[2]))
            collected[int(parts[1])] += int(parts[3])
    return {g: (seconds[g], collected[g]) for g in seconds}


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    install(Path(sys.argv[1]))
    from heap_census import install_from_env  # this script's folder is sys.path[0]

    install_from_env()
    del sys.path[0]  # this script's folder: the module comes from the tree on PYTHONPATH
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
