"""Benchmark: does the demo's golden part decide the same on any CPU? (issue 17, item 7)

The demo's healthy FP8 replay must pass and its stale one (activation scales x0.05) must roll
``code/assist`` back, on whatever CPU runs it. A CPU changes the float kernels: the reduction order
of a matmul (thread count, SIMD width), the internal precision it may use, the last bits of every
activation. This script runs the demo's golden part under perturbations that do the same or far
more, and judges every replay with the shipped default policy's golden rule, as the daemon does:

* ``threads=N``: torch.set_num_threads(N) (other blockings and reduction orders);
* ``matmul=high|medium``: torch.set_float32_matmul_precision (reduced-precision internal products
  where the CPU has them);
* ``noise=S seed=K``: every weight of the checkpoint times (1 + S * N(0, 1)), the same noisy
  checkpoint under both engines, calibrated as shipped - 1e-4 is ~1,000x the kernels' rounding,
  1e-2 is a different model.

For each: how far the perturbation moved the FP16 logits along the references (max |change|
against the unperturbed run), the teacher-forced margins (the smallest lead of a reference token
over the next best, FP16 and healthy FP8; how many references greedy FP8 and stale FP8 reproduce),
then a healthy and a
stale replay of the 32 items through ``probes.golden_replay.replay`` and a fresh
``PolicyEngine`` with policies/default.yaml: the verdict and its distance from the rollback line.

    .venv/bin/python bench/demo_robustness.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from probes.engines.torch_engine import TorchEngine, calibrate_model  # noqa: E402
from probes.golden import find_golden_set, load_golden_set  # noqa: E402
from probes.golden_replay import replay  # noqa: E402
from probes.tiny_model import _training_batch, reference_margins  # noqa: E402
from watchdog.dev.demo_golden import (  # noqa: E402
    FP8_OPTIONS,
    ITEMS,
    RULE,
    SET,
    STALE_MULTIPLIER,
    demo_model,
    describe_margin,
)
from watchdog.policy import PolicyEngine, load_policy_files  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def perturbations(quick: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "as shipped, 1 thread"}]
    out += [{"name": f"threads={n}", "threads": n} for n in ((2,) if quick else (2, 4))]
    out += [{"name": f"matmul={p}", "matmul": p} for p in ((("medium",)) if quick else ("high", "medium"))]
    scales = (1e-3, 1e-2) if quick else (1e-4, 1e-3, 3e-3, 1e-2)
    seeds = (1,) if quick else (1, 2, 3)
    out += [{"name": f"noise={s:g} seed={k}", "noise": s, "seed": k} for s in scales for k in seeds]
    return out


def _noisy(model: Any, scale: float, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=gen))
    return noisy


def _judge(report: Any) -> tuple[str, list[str], float]:
    engine = PolicyEngine(load_policy_files([REPO / "policies" / "default.yaml"]))
    engine.observe(report.to_signals("llama-demo", "code/assist"), 1_800_000_000.0, {})
    (st,) = [s for (p, _m, _r), s in engine.states.items() if p == "fp8-default"]
    verdict = st.rules[RULE].last
    policy = engine.policy_set.get("fp8-default")
    assert verdict is not None and policy is not None
    rouge = report.summary("rougeL")
    return verdict.status, describe_margin(verdict, policy.rule(RULE)), rouge.diff_mean if rouge else float("nan")


def reference_logits(model: Any, tok: Any, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """The logits at every reference position (teacher-forced), one row per position."""
    ids, mask, labels = _training_batch(tok, pairs)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    return logits[:, :-1][labels[:, 1:] != -100]


def run_one(model_dir: Path, golden: Any, pairs: list[tuple[str, str]], p: dict[str, Any],
            reference: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor]:
    threads, precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    torch.set_num_threads(int(p.get("threads", 1)))
    torch.set_float32_matmul_precision(p.get("matmul", "highest"))
    try:
        started = time.perf_counter()
        base_model = TorchEngine(model_dir, "fp16", fast="off").model
        if p.get("noise"):
            base_model = _noisy(base_model, float(p["noise"]), int(p["seed"]))

        def engine(**opts: Any) -> TorchEngine:
            return TorchEngine(model_dir, model=copy.deepcopy(base_model), fast="off", **opts)

        engines = {"fp16": engine(precision="fp16"), "fp8": engine(**FP8_OPTIONS),
                   "stale": engine(**FP8_OPTIONS, scale_multiplier=STALE_MULTIPLIER)}
        margins = {k: reference_margins(e.model, e.tokenizer, pairs) for k, e in engines.items()}
        logits = reference_logits(engines["fp16"].model, engines["fp16"].tokenizer, pairs)
        shift = float((logits - reference).abs().max()) if reference is not None else 0.0
        row: dict[str, Any] = {
            "perturbation": p["name"], "logit_shift": shift,
            "fp16_margin": min(margins["fp16"]), "fp8_margin": min(margins["fp8"]),
            "fp8_items": sum(m > 0 for m in margins["fp8"]), "stale_items": sum(m > 0 for m in margins["stale"])}
        for kind in ("fp8", "stale"):
            report = replay(golden, engines[kind], engines["fp16"], progress=False)
            status, lines, diff = _judge(report)
            row[kind] = {"status": status, "rougeL_diff": diff, "margin": lines}
        row["seconds"] = time.perf_counter() - started
        return row, logits
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 perturbations instead of 17")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    golden = load_golden_set(find_golden_set(SET)).head(ITEMS)
    pairs = golden.pairs()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, origin = demo_model(Path(tmp), pairs)
        calibrate_model(model_dir, [p + r for p, r in pairs])
        print(f"demo model ({origin}): {model_dir}", flush=True)
        rows: list[dict[str, Any]] = []
        reference = None
        for p in perturbations(args.quick):
            row, logits = run_one(model_dir, golden, pairs, p, reference)
            reference = logits if reference is None else reference
            rows.append(row)
            print(f"{row['perturbation']:<22} FP16 logits moved {row['logit_shift']:.1e} | margins FP16 {row['fp16_margin']:5.2f} FP8 {row['fp8_margin']:5.2f} "
                  f"| FP8 reproduces {row['fp8_items']}/{len(pairs)}, stale {row['stale_items']}/{len(pairs)} "
                  f"| healthy {row['fp8']['status']} (diff {row['fp8']['rougeL_diff']:+.3f}), "
                  f"stale {row['stale']['status']} (diff {row['stale']['rougeL_diff']:+.3f}) "
                  f"| {row['seconds']:.0f} s", flush=True)
            for kind in ("fp8", "stale"):
                for line in row[kind]["margin"]:
                    print(f"    {'healthy' if kind == 'fp8' else 'stale'}: {line}", flush=True)
    ok = all(r["fp8"]["status"] == "pass" and r["stale"]["status"] == "fail" for r in rows)
    print(f"{sum(r['fp8']['status'] == 'pass' for r in rows)}/{len(rows)} healthy replays passed, "
          f"{sum(r['stale']['status'] == 'fail' for r in rows)}/{len(rows)} stale replays rolled back; "
          f"smallest healthy FP8 margin {min(r['fp8_margin'] for r in rows):.2f} nats")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
