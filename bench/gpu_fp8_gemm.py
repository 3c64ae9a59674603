"""Decode's FP8 products alone at the Llama-3-8B shape: cuBLAS (``torch._scaled_mm``, as the engine calls
it) against the small-batch Triton kernel of ``probes/fp8_gemm.py`` over a sweep of launch configurations.

Each product is checked against the float32 product of the same FP8 values (max relative error over the
output), then timed in a CUDA graph of ``reps`` products over 3 weight copies (no weight re-read from L2):
ms per product and the weight bytes per second. Both produce the scaled fp16 output the engine uses
(merged linears: float32 + per-column scales for cuBLAS; the kernel scales in its epilogue); with more
than one K slice the Triton time includes the slice sum, scale and cast as eager ops, which fuse into
the next kernel of the compiled decode step (an upper bound). The fastest configuration per (M, N, K) is printed as a ``TUNED``
literal for ``probes/fp8_gemm.py`` and, with ``--json``, written out.

    python3 bench/gpu_fp8_gemm.py --batches 16,64,128 --json $OUT/gemm_tuned.json   # on the H200
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probes import fp8_gemm  # noqa: E402
from probes.fp8 import FP8_DTYPE  # noqa: E402

#: decode's products at the 8B shape (N, K); qkv and gate+up are the merged ones (float32 + column scales)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate+up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
BNS, BKS, STAGES, WARPS = (32, 64, 128), (128, 256), (3, 4, 6), (4,)


def timed(fn: Any, reps: int) -> float:
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i % 3)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    return statistics.median(ts)


def sweep(batches: list[int], reps: int = 20, say: Any = print) -> dict[tuple[int, int, int], Any]:
    """Time every product of ``SHAPES`` at each batch; returns the fastest Triton configuration per
    (M bucket, N, K), None where cuBLAS is faster (and fills ``fp8_gemm.TUNED`` with them)."""
    dev = "cuda"
    one = torch.ones((), device=dev)
    tuned: dict[tuple[int, int, int], Any] = {}
    failed: list[str] = []
    say("| product | M | cuBLAS ms (GB/s) | Triton best ms (GB/s) | config (split, BN, BK, warps, stages) "
        "| default config ms | max rel err cuBLAS / Triton / Triton float32 sum | cuBLAS / Triton |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (n, k) in SHAPES.items():
        ws = [(torch.randn(n, k, device=dev) * 0.05).to(FP8_DTYPE) for _ in range(3)]
        col = torch.rand(n, device=dev) + 0.5
        merged = name in ("qkv", "gate+up")
        for m in batches:
            x8 = (torch.randn(m, k, device=dev) * 2).to(FP8_DTYPE)
            ref = x8.float() @ ws[0].float().t()
            scale = col if merged else one

            def cublas(i: int, x8: torch.Tensor = x8, merged: bool = merged, scale: torch.Tensor = scale,
                       ws: list[torch.Tensor] = ws) -> Any:
                if merged:
                    return (torch._scaled_mm(x8, ws[i].t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
                            * scale).to(torch.float16)
                return torch._scaled_mm(x8, ws[i].t(), scale_a=one, scale_b=one, out_dtype=torch.float16)

            base = timed(cublas, reps)
            err_c = ((cublas(0).float() - ref * scale).abs().max() / (ref * scale).abs().max()).item()
            results = []
            for split, bn, bk, warps, stages in itertools.product((1, 2, 4, 8), BNS, BKS, WARPS, STAGES):
                if split not in fp8_gemm.splits_of(k, bk):
                    continue
                cfg = (split, bn, bk, warps, stages)
                try:
                    t = timed(lambda i, x8=x8, cfg=cfg, ws=ws, scale=scale: fp8_gemm.scaled_small_mm(
                        x8, ws[i], scale, torch.float16, cfg), reps)
                except Exception as exc:  # a configuration that does not compile or fit: skipped, counted
                    failed.append(f"{name} M={m} {cfg}: {type(exc).__name__}")
                    continue
                results.append((t, cfg))
            if not results:
                continue
            t, cfg = min(results)
            out = fp8_gemm.scaled_small_mm(x8, ws[0], scale, torch.float16, cfg).float()
            want = ref * scale
            err = ((out - want).abs().max() / want.abs().max()).item()
            acc = fp8_gemm.fp8_gemm_partials(x8, ws[0], *cfg).sum(0)
            err_acc = ((acc - ref).abs().max() / ref.abs().max()).item()
            dflt = fp8_gemm.default_config(m, n, k)
            t_dflt = next((r[0] for r in results if r[1] == dflt), float("nan"))
            gbs = n * k / 1e6
            say(f"| {name} {n}x{k} | {m} | {base:.4f} ({gbs / base:.0f}) | {t:.4f} ({gbs / t:.0f}) | {cfg} | "
                f"{t_dflt:.4f} | {err_c:.1e} / {err:.1e} / {err_acc:.1e} | {base / t:.2f} |")
            tuned[(fp8_gemm.m_bucket(m), n, k)] = cfg if t < base else None
        torch.cuda.empty_cache()
    fp8_gemm.TUNED.update(tuned)
    say(f"{len(failed)} configurations did not fit (shared memory) and were skipped")
    say("TUNED = {" + ", ".join(f"{key}: {cfg}" for key, cfg in sorted(tuned.items())) + "}")
    return tuned


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the tuned configurations here")
    ap.add_argument("--promote", type=int, default=fp8_gemm.PROMOTE_EVERY,
                    help="products of K between float32 promotions of the MMA accumulator")
    args = ap.parse_args(argv)
    fp8_gemm.PROMOTE_EVERY = args.promote
    if not torch.cuda.is_available():
        print("gpu_fp8_gemm: needs CUDA", file=sys.stderr)
        return 2
    tuned = sweep([int(b) for b in args.batches.split(",")], args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps([[list(k), v and list(v)] for k, v in tuned.items()]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
