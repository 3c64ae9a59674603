"""What the evidence recorder keeps at steady traffic: ``--routes`` routes of healthy traffic (fp8 and
fp16, ``--events`` ok events each per 10 s window, 4 replicas), ``--windows`` windows each, closed by the
daemon's ``WindowAggregator`` and judged by policies/default.yaml, the recorder observing after each
engine call as the daemon's loop does. Reported: the Python heap held at the end (tracemalloc, after
``gc.collect``) with the recorder on or off, and the recorder's ``history`` status. Run it on another
checkout with ``--code`` to compare (``history`` is absent before the recorder was bounded).

    .venv/bin/python bench/evidence_history.py --routes 800 --windows 13 --recorder on
    .venv/bin/python bench/evidence_history.py --routes 800 --windows 13 --recorder off
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tracemalloc
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--routes", type=int, default=800)
ap.add_argument("--windows", type=int, default=13)
ap.add_argument("--events", type=int, default=10, help="ok events per precision per route per window")
ap.add_argument("--recorder", choices=("on", "off"), default="on")
ap.add_argument("--code", default=str(Path(__file__).resolve().parent.parent), help="checkout to import")
args = ap.parse_args()
sys.path.insert(0, args.code)

from watchdog.config.settings import EvidenceConfig  # noqa: E402
from watchdog.core.events import InferenceEvent  # noqa: E402
from watchdog.core.keys import Keys  # noqa: E402
from watchdog.policy import PolicyEngine  # noqa: E402
from watchdog.policy.loader import load_policy_files  # noqa: E402
from watchdog.runtime.evidence import EvidenceRecorder  # noqa: E402
from watchdog.windows.aggregator import WindowAggregator  # noqa: E402

L = 10.0


def main() -> int:
    engine = PolicyEngine(load_policy_files([str(Path(args.code) / "policies" / "default.yaml")]))
    recorder = EvidenceRecorder(EvidenceConfig(), Keys("bench"), None, engine, "bench")
    agg = WindowAggregator(length_s=L, grace_s=2.0, max_future_s=float("inf"))
    rng = random.Random(1)
    routes = [f"r-{i:05d}" for i in range(args.routes)]
    t_base = 1_800_000_000.0
    tracemalloc.start()
    gc.collect()
    start = tracemalloc.get_traced_memory()[0]
    offset = 0
    for w in range(args.windows):
        for route in routes:
            for precision in ("fp8", "fp16"):
                for i in range(args.events):
                    ts = t_base + w * L + rng.uniform(0, L - 0.01)
                    ev = InferenceEvent(
                        f"{route}-{w}-{precision}-{i}",
                        ts,
                        "m",
                        route,
                        precision,
                        "ok",
                        rng.lognormvariate(6.0, 0.4),
                        ttft_ms=rng.lognormvariate(4.5, 0.3),
                        prompt_tokens=100,
                        completion_tokens=50,
                        replica=f"replica-{i % 4}",
                        build="b1",
                    )
                    agg.add(ev, ("t", 0), offset)
                    offset += 1
        now = t_base + (w + 1) * L + 2.0
        signals = agg.close_due(now)
        engine.observe(signals, now, {}, "fp8")
        if args.recorder == "on":
            recorder.observe(signals, {(s.model, s.route) for s in signals}, now)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - start
    print(
        f"code {args.code}: {args.routes} routes x {args.windows} windows, recorder {args.recorder}: "
        f"{len(engine.states)} engine scopes, heap held {held / 2**20:.1f} MB, "
        f"recorder history {recorder.status().get('history')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
