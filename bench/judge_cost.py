"""CPU per route-window of closing windows and judging them (``PolicyEngine.observe``), one checkout
against another in the same run (issue 19, "per route-window cost").

Windows are built the way the daemon builds them: synthetic ``InferenceEvent``s folded into a
``WindowAggregator`` and closed with ``close_due``; the signals go to ``PolicyEngine.observe`` with
the shipped ``policies/default.yaml`` in chunks of 100 routes (``runtime/decisions.py``'s
``DECIDE_CHUNK_ROUTES``), windows in time order, as the daemon hands them over.

Shapes:
  thin     every route gets ``--thin-events`` events per precision per window (default 2), folded
           for real for every route: most rules are below min_samples, the horizon tests run
  sparse   0, 0, 1 or 2 events per precision per window, drawn per route (what 10,000 routes at
           2,000 events/s give): many windows have one precision only, the horizon tests then look
           without being fed; a route with no event in a window closes none
  light    the ingest bench's light mix (``bench/ingest_process.py --mix light``: ``TrafficGenerator``,
           30 % shadowed, encoded and decoded with ``decode_event`` as the daemon reads them):
           ``--light-events`` per route and window on average (default 20, i.e. 200,000 events over
           1,000 routes and 10 windows: ~10 per precision, shadows included), routes drawn at random,
           folded and closed for real for every route
  typical  300-3,000 requests per precision per window (errors ~1 %, timeouts ~0.3 %, replicas,
           request mix, TTFT). Folding millions of events per window would dominate the bench, so
           ``--templates`` routes are folded and closed for real per window and every other route
           judges a copy of one of them under its own name (its own engine state)

The heap is collected (``gc.collect``, not timed) before each timed close and observe: a full
collection that happens to fall into one (the bench allocates millions of events) is the process's
cost, not the close's; with it a typical close measured 3 ms per route-window instead of 0.7.

Each (checkout, shape) runs in its own child process (``--code`` puts that checkout first on
sys.path), repeated ``--repeats`` times, interleaved. The child prints process CPU seconds for the
close and for observe, and a digest of every action, every last verdict and the exported engine
state: the digests of two checkouts must be equal (same decisions, bit for bit).

Run:
  nice -n 10 env PYTHONPATH=. .venv/bin/python bench/judge_cost.py --code /path/to/before --code .
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
WINDOW_S = 10.0
CHUNK = 100


def _events(rng: random.Random, ev_cls: Any, route: str, precision: str, k: int, n: int,
            slow: float) -> list[Any]:
    out = []
    t0 = k * WINDOW_S
    for i in range(n):
        u = rng.random()
        status = "error" if u < 0.01 else "timeout" if u < 0.013 else "ok"
        prompt = int(rng.lognormvariate(5.7, 0.6))
        completion = int(rng.lognormvariate(5.0, 0.3))
        lat = (100 + 0.3 * prompt + 20 * completion) * rng.lognormvariate(0.0, 0.2) * slow
        out.append(ev_cls(request_id=f"{route}-{precision}-{k}-{i}", ts=t0 + WINDOW_S * (i + 0.5) / n,
                          model="m", route=route, precision=precision, status=status, latency_ms=lat,
                          prompt_tokens=prompt, completion_tokens=completion, ttft_ms=20 + 0.05 * prompt,
                          replica=f"{precision}-{rng.randrange(4 if precision == 'fp8' else 2)}"))
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, args.code)
    from watchdog.core.events import InferenceEvent, decode_event
    from watchdog.dev.traffic import Route, TrafficGenerator
    from watchdog.policy.engine import PolicyEngine
    from watchdog.policy.loader import load_policy_files
    from watchdog.windows.aggregator import WindowAggregator

    ps = load_policy_files([str(HERE / "policies" / "default.yaml")])
    engine = PolicyEngine(ps)
    agg = WindowAggregator(length_s=WINDOW_S, grace_s=0.0)
    rng = random.Random(args.seed)
    routes = [f"r{i:05d}" for i in range(args.routes)]
    real = args.shape in ("thin", "sparse", "light")  # every route folded and closed for real
    built = routes if real else routes[:args.templates]
    digest = hashlib.sha256()
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    close_s = observe_s = 0.0
    timed = 0
    gen = TrafficGenerator([Route("m", r, shadow_share=0.3) for r in routes], seed=args.seed)
    for k in range(args.windows):
        if args.shape == "light":  # as bench/common.produce_events: a route drawn at random per event
            n = args.light_events * len(routes)
            for i in range(n):
                _, raw = gen.encoded(gen.routes[gen.rng.randrange(len(routes))],
                                     now=round(k * WINDOW_S + WINDOW_S * (i + 0.5) / n, 3))
                agg.add(decode_event(raw))
        for r in built if args.shape != "light" else ():
            for prec in ("fp8", "fp16"):
                n = args.thin_events if args.shape == "thin" else rng.choice((0, 0, 1, 2)) \
                    if args.shape == "sparse" else rng.randint(300, 3000)
                for e in _events(rng, InferenceEvent, r, prec, k, n, 1.0):
                    agg.add(e)
        gc.collect()  # a collection of the whole heap (events, engine state) is nobody's close
        c0 = time.process_time()
        sigs = agg.close_due((k + 1) * WINDOW_S)
        c1 = time.process_time()
        if not real:  # every other route judges a copy of a template route's window
            by_route: dict[str, list[Any]] = {}
            for s in sigs:
                by_route.setdefault(s.route, []).append(s)
            sigs = []
            for i, r in enumerate(routes):
                for s in by_route[built[i % len(built)]]:
                    c = copy.copy(s)
                    c.route = r
                    c.detail = copy.deepcopy(s.detail)
                    sigs.append(c)
        now = (k + 1) * WINDOW_S
        gc.collect()
        if prof is not None and k >= args.warmup:
            prof.enable()
        o0 = time.process_time()
        for i in range(0, len(sigs), 2 * CHUNK):
            for a in engine.observe(sigs[i:i + 2 * CHUNK], now, {}, "fp8"):
                digest.update(repr((a.kind, a.model, a.route, a.policy, a.precision, a.reason)).encode())
        o1 = time.process_time()
        if prof is not None:
            prof.disable()
        if k >= args.warmup:
            close_s += c1 - c0
            observe_s += o1 - o0
            timed += 1
    if prof is not None:
        prof.dump_stats(args.profile)
    digest.update(json.dumps(engine.verdicts(), sort_keys=True, default=repr).encode())
    digest.update(json.dumps(engine.export_state(), sort_keys=True, default=repr).encode())
    n_close = len(built) * timed
    return {"code": args.code, "shape": args.shape, "routes": args.routes, "windows_timed": timed,
            "close_us_per_route_window": 1e6 * close_s / max(1, n_close),
            "observe_us_per_route_window": 1e6 * observe_s / max(1, args.routes * timed),
            "digest": digest.hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", action="append", help="checkout to import (repeat to compare; default: this one)")
    ap.add_argument("--shapes", default="thin,light,typical")
    ap.add_argument("--routes", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="windows not timed at the start")
    ap.add_argument("--templates", type=int, default=20, help="typical: routes folded for real per window")
    ap.add_argument("--thin-events", type=int, default=2)
    ap.add_argument("--light-events", type=int, default=20, help="light: events per route and window on average")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json")
    ap.add_argument("--profile", help="child only: cProfile the timed observe calls into this file, e.g. "
                    "judge_cost.py --child --shape light --profile /tmp/observe.prof")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="thin", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.code = str(Path(args.code[0] if args.code else HERE).resolve())
        print(json.dumps(child(args)))
        return 0
    codes = [str(Path(c).resolve()) for c in (args.code or [str(HERE)])]
    rows: list[dict[str, Any]] = []
    print(f"load average {os.getloadavg()}")
    for shape in args.shapes.split(","):
        for rep in range(args.repeats):
            for code in codes:  # interleaved, so a busy neighbour hits every checkout alike
                cmd = [sys.executable, __file__, "--child", "--code", code, "--shape", shape,
                       "--routes", str(args.routes), "--windows", str(args.windows), "--warmup", str(args.warmup),
                       "--templates", str(args.templates), "--thin-events", str(args.thin_events),
                       "--light-events", str(args.light_events),
                       "--seed", str(args.seed)]
                env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=code)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["repeat"] = rep
                rows.append(row)
                print(f"{shape:8} {code:30} close {row['close_us_per_route_window']:8.1f} us  "
                      f"observe {row['observe_us_per_route_window']:8.1f} us  digest {row['digest'][:12]}",
                      flush=True)
    print(f"load average {os.getloadavg()}")
    summary = {}
    for shape in args.shapes.split(","):
        best = {c: {m: min(r[m] for r in rows if r["shape"] == shape and r["code"] == c)
                    for m in ("close_us_per_route_window", "observe_us_per_route_window")} for c in codes}
        digests = {r["digest"] for r in rows if r["shape"] == shape}
        summary[shape] = {"best": best, "same_decisions": len(digests) == 1}
        line = f"{shape}: same decisions {len(digests) == 1}"
        if len(codes) > 1:
            b, a = best[codes[0]], best[codes[-1]]
            line += (f"; observe {b['observe_us_per_route_window']:.0f} -> {a['observe_us_per_route_window']:.0f} us "
                     f"({b['observe_us_per_route_window'] / a['observe_us_per_route_window']:.2f}x), "
                     f"close {b['close_us_per_route_window']:.0f} -> {a['close_us_per_route_window']:.0f} us "
                     f"({b['close_us_per_route_window'] / a['close_us_per_route_window']:.2f}x)")
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0 if all(s["same_decisions"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
