"""Benchmark: a route's policy-engine state as JSON against its packed form (``redis.pack_engine_state``).

Thin routes (two events per route and window, the traffic of a 10,000-route replica at 2,000 events/s)
are judged on policies/default.yaml for ``--windows`` windows; then every route's state is encoded as a
save does (``partitions.engine_json``), packed (zstd level 1 and base64, ``partitions.engine_value``) and
read back (``checkpoint.engine_text`` + ``json.loads``), each timed over all routes, best of
``--repeats``. The JSON encoding is the baseline: packing's cost is quoted as a share of it.

    PYTHONPATH=. .venv/bin/python bench/engine_pack.py --routes 1000 --windows 30
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_note, table  # noqa: E402
from watchdog.core.events import decode_event  # noqa: E402
from watchdog.dev.traffic import Route, TrafficGenerator  # noqa: E402
from watchdog.policy import PolicyEngine  # noqa: E402
from watchdog.policy.loader import load_policy_files  # noqa: E402
from watchdog.state import partitions as P  # noqa: E402
from watchdog.state.checkpoint import engine_text  # noqa: E402
from watchdog.windows.aggregator import WindowAggregator  # noqa: E402


def judged_states(n_routes: int, windows: int) -> dict[P.Route, dict[str, Any]]:
    """Engine states of routes judged on the default policy with two events per route and window (the
    traffic of a 10,000-route replica at 2,000 events/s): some routes' horizon tests have no information."""
    routes = [Route("m", f"r-{i:05d}", rate=1.0, regression="quality" if i % 50 == 7 else None)
              for i in range(n_routes)]
    gen = TrafficGenerator(routes)
    engine = PolicyEngine(load_policy_files([str(ROOT / "policies" / "default.yaml")]))
    agg = WindowAggregator(length_s=10.0, grace_s=2.0, max_future_s=math.inf)
    flags = {("m", r.route): "fp8" for r in routes}
    ts, step, close = 1_800_000_000.0, 10.0 / (2 * n_routes), 1_800_000_012.0
    for i in range(2 * n_routes * windows):
        agg.add(decode_event(gen.encoded(routes[i % n_routes], ts)[1]), ("t", 0), i)
        ts += step
        if ts >= close:
            engine.observe(agg.close_due(ts), ts, flags, "fp8")
            close += 10.0
    return P.engine_states_by_route(engine)


def best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("machine:", machine_note(), flush=True)
    states = list(judged_states(args.routes, args.windows).values())
    plain = [P.engine_json(s) for s in states]
    packed = [P.engine_value(s, packed=True) for s in states]
    assert [engine_text(p) for p in packed] == plain
    n = len(states)
    t_json = best(lambda: [P.engine_json(s) for s in states], args.repeats)
    t_pack = best(lambda: [P.engine_value(s, packed=True) for s in states], args.repeats)
    t_read_json = best(lambda: [json.loads(engine_text(t)) for t in plain], args.repeats)
    t_read_packed = best(lambda: [json.loads(engine_text(t)) for t in packed], args.repeats)
    size_plain, size_packed = sum(map(len, plain)) / n, sum(map(len, packed)) / n
    rows = [["JSON (engine_json)", f"{size_plain:,.0f}", "1.00", f"{t_json / n * 1e6:.1f}", "1.00",
             f"{t_read_json / n * 1e6:.1f}"],
            ["packed (engine_value, zstd 1 + base64)", f"{size_packed:,.0f}", f"{size_plain / size_packed:.2f}",
             f"{t_pack / n * 1e6:.1f}", f"{t_pack / t_json:.2f}", f"{t_read_packed / n * 1e6:.1f}"]]
    print(f"{n:,} routes judged over {args.windows} windows (two events per route and window), best of "
          f"{args.repeats}")
    print(table(["form", "bytes per route", "JSON ÷ form", "write µs per route", "÷ JSON's",
                 "read µs per route"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
