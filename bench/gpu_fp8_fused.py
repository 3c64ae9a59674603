"""The fused FP8 quantisers of ``probes.fp8_fused`` alone at the Llama-3-8B widths (hidden 4,096, MLP
14,336), on as many rows (tokens) as prefill at batch 16 and 128 holds: each checked against the separate
steps (eager; e4m3 values one step away, per-row counts) and timed against the same steps compiled by
inductor (what the unfused layer gets, counting included), with the bytes each must move at least.

    python bench/gpu_fp8_fused.py --rows 6144,49152      # on the GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn: Any, reps: int = 20) -> float:
    """ms per call (CUDA events, after two warm-up calls)."""
    fn()
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def cases(rows: int, eps: float = 1e-5) -> list[tuple[str, Any, Any, tuple, int]]:
    """(name, fused op, separate steps, args, bytes moved at least)."""
    import torch.nn.functional as F

    from probes import fp8_fused
    from probes.engines.fast_forward import clipped
    from probes.engines.fast_layers import quant, rms_norm

    dev, dt = "cuda", torch.float16
    hid, inter = 4096, 14336
    x = torch.randn(rows, hid, device=dev, dtype=dt) * 3
    r = torch.randn(rows, hid, device=dev, dtype=dt)
    w = (torch.rand(hid, device=dev) + 0.5).to(dt)
    g = torch.randn(rows, inter, device=dev, dtype=dt) * 2
    u = torch.randn(rows, inter, device=dev, dtype=dt) * 2
    sx = torch.tensor([0.004], device=dev, dtype=dt)
    sm = torch.tensor([0.01], device=dev, dtype=dt)

    def ref(h: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quant(h, s), clipped(h, {"sx_in": s})

    def rms_sep(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, eps: float) -> Any:
        return ref(rms_norm(x, w, eps), s)

    def add_sep(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, s: torch.Tensor, eps: float) -> Any:
        y = x + r
        return (y, *ref(rms_norm(y, w, eps), s))

    def silu_sep(g: torch.Tensor, u: torch.Tensor, s: torch.Tensor) -> Any:
        return ref(F.silu(g) * u, s)

    n, m = rows * hid, rows * inter
    return [
        ("rms_quant", fp8_fused.rms_quant, rms_sep, (x, w, sx, eps), 3 * n),
        ("add_rms_quant", fp8_fused.add_rms_quant, add_sep, (x, r, w, sx, eps), 7 * n),
        ("silu_mul_quant", fp8_fused.silu_mul_quant, silu_sep, (g, u, sm), 5 * m),
        ("quant_rows", fp8_fused.quant_rows, ref, (x, sm), 3 * n),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="6144,49152")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("| op | rows | e4m3 values one step off | max code diff | counts equal (clipped) | fused ms (TB/s) "
          "| inductor ms (TB/s) | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows in (int(v) for v in args.rows.split(",")):
        for name, op, sep, a, nbytes in cases(rows):
            got, want = op(*a), sep(*a)
            q, c, qw, cw = got[-2], got[-1], want[-2], want[-1]
            codes = (q.view(torch.uint8).int() - qw.view(torch.uint8).int()).abs()
            codes[q.float() == qw.float()] = 0  # -0 vs +0: one value
            same_res = all(torch.equal(x, y) for x, y in zip(got[:-2], want[:-2], strict=True))
            comp = torch.compile(sep, dynamic=False)
            t_f, t_c = timed(lambda op=op, a=a: op(*a)), timed(lambda comp=comp, a=a: comp(*a))
            print(f"| {name} | {rows} | {(codes > 0).float().mean().item():.2e} | {codes.max().item()}"
                  f"{'' if same_res else ' (residual differs)'} | {torch.equal(c, cw)} ({int(cw.sum())}) "
                  f"| {t_f:.3f} ({nbytes / t_f / 1e9:.2f}) | {t_c:.3f} ({nbytes / t_c / 1e9:.2f}) | {t_c / t_f:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
