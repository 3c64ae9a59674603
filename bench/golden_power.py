"""Golden power and healthy checks of bench/decisions.py alone, for iterating on the golden judge.

The same calls as ``bench/decisions.py --parts power`` (``run_golden`` through the shipped
``PolicyEngine.observe`` and policies/*.yaml), with the seed and the route counts as arguments:

  python bench/golden_power.py onset --model golden-200 --routes 200 --label legal --seed 9
      diffuse and concentrated -0.03 from replay 40 (40 healthy replays first), within 2 replays
  python bench/golden_power.py first --routes 30 --label legal --seed 9
      concentrated damage present from the first replay on golden-200 / -rotated / -500 / -sampled
  python bench/golden_power.py healthy --model golden-200-sampled --routes 120 --label chat --seed 2000
      healthy replays (80 per route): false rollbacks

``--seed`` is the benchmark's base seed (decisions.py adds 300 / 350 for the power runs); for
``healthy`` it is the simulator's seed itself.
"""

from __future__ import annotations

import argparse
import time

from bench.decisions import GOLDEN_MODELS, ROOT, TRAINED_MODELS, power, run_golden
from watchdog.policy.loader import load_policy_files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["onset", "first", "healthy"])
    ap.add_argument("--model", default="golden-200")
    ap.add_argument("--routes", type=int, default=30)
    ap.add_argument("--label", default="legal", help="route prefix: legal (both policies) or chat (default)")
    ap.add_argument("--seed", type=int, default=9)
    args = ap.parse_args(argv)
    ps = load_policy_files(sorted(str(p) for p in (ROOT / "policies").glob("*.yaml")))
    models = {g.name: g for g in GOLDEN_MODELS + TRAINED_MODELS}
    t0 = time.perf_counter()
    if args.what == "onset":
        tgs = run_golden(ps, models[args.model], args.routes, 42, args.seed + 300, args.label,
                         damages=("diffuse", "concentrated"), onset=40)
        for damage, tg in zip(("diffuse", "concentrated"), tgs, strict=True):
            print(f"{args.label} {args.model} -0.03 {damage} within 2 replays: {power(tg, 40, 2):.3f} "
                  f"({args.routes} routes) {tg.by_rule}")
    elif args.what == "first":
        for g in (GOLDEN_MODELS[1], GOLDEN_MODELS[3], GOLDEN_MODELS[2], GOLDEN_MODELS[4]):
            tg = run_golden(ps, g, args.routes, 2, args.seed + 350, args.label, damages=("concentrated",), onset=0)[0]
            print(f"{args.label} {g.name} -0.03 concentrated from the first replay, within 2 replays: "
                  f"{power(tg, 0, 2):.3f} ({args.routes} routes) {tg.by_rule}")
    else:
        tg = run_golden(ps, models[args.model], args.routes, 80, args.seed, args.label)[0]
        print(f"{args.label} {args.model} healthy: {tg.rollbacks} rollbacks in {tg.windows} replays {tg.by_rule}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
