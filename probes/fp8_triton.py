"""The static FP8 activation quantiser as one Triton kernel (CUDA only; imported lazily by probes.fp8).

Same numbers as the eager ``(x / scale).clamp(-448, 448).to(float8_e4m3fn)`` with ``scale`` in the
activation dtype: the quotient is computed in float32 with round-to-nearest division and rounded to
the activation dtype, then clamped and cast (round to nearest even). It also counts the values whose
scaled magnitude exceeds 448 (the saturation statistic) with one atomic add per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
BLOCK = 4096


@triton.jit
def _quant_count_kernel(x_ptr, out_ptr, scale_ptr, count_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    x = tl.load(x_ptr + offs, mask=live, other=0.0)
    s = tl.load(scale_ptr).to(tl.float32)
    y = tl.math.div_rn(x.to(tl.float32), s).to(x.dtype)
    sat = tl.sum(((tl.abs(y.to(tl.float32)) > 448.0) & live).to(tl.int32), axis=0)
    tl.atomic_add(count_ptr, sat)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(out_ptr + offs, y.to(tl.float8e4nv), mask=live)


def quant_count(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 of x's shape, number of clipped values as an int32 0-dim tensor). ``scale``: 1 element."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.numel() >= 2 ** 31:
        scaled = x / scale
        return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), (scaled.abs() > E4M3_MAX).sum()
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    count = torch.zeros((), dtype=torch.int32, device=x.device)
    n = x.numel()
    if n:
        _quant_count_kernel[(triton.cdiv(n, BLOCK),)](x, out, scale, count, n, BLOCK=BLOCK, num_warps=8)
    return out, count
