"""The FP8 activation quantiser fused with what precedes it, for the full-sequence pass (prefill, scoring).

Each op reads its inputs once and writes the e4m3 activation (one byte a value) and the per-row count of
values whose scaled magnitude exceeds 448 (the saturation statistic, counted per token so that padding
can be left out):

* ``rms_quant(x, w, sx, eps)``: RMSNorm + static quantisation + count (the q/k/v input);
* ``add_rms_quant(x, r, w, sx, eps)``: the residual add ``x + r`` (returned), then the same (gate/up);
* ``silu_mul_quant(g, u, sx)``: ``silu(g) * u`` + quantisation + count (the down projection's input);
* ``quant_rows(x, sx)``: quantisation + count (the o projection's input).

Under ``torch.compile`` inductor fused these steps too, but the count re-read (or recomputed) the
activation, q/k/v and gate/up each got their own quantised copy, and its reductions over 4,096-14,336
columns ran at 1.3-2.2 TB/s on the H200 (batch 128 prefill: 137 ms of norm/quantise/count kernels against
FP16's 81 ms of norm/SiLU*up, BENCHMARKS.md). Here one program handles one row (token).

The numbers follow the eager module code op by op, rounding to the activation dtype where it does: the
float32 RMSNorm rounded before the weight (its sum of squares added in another order than eager's),
SiLU as ``g / (1 + exp(-g))`` and its product with ``u`` each rounded (Triton's fast exp and division:
eager's accurate ones give another float32 quotient now and then, which rarely survives the rounding to
fp16 and then to e4m3), the division by the scale correctly rounded in float32 (a reciprocal and one FMA
correction), then rounded, as ``probes.fp8_triton`` does. On CUDA with Triton these are
``torch.library.triton_op``s, so a compiled layer launches the kernels from its own generated code (no
Python per call); elsewhere the torch reference below (CI).
"""

from __future__ import annotations

import torch

from probes.fp8 import E4M3_MAX, FP8_DTYPE

try:  # Triton is there with CUDA builds of torch; CPU-only installs run the torch reference
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
    from triton.language.extra import libdevice

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

#: widest row the norm kernels hold in registers (Llama hidden sizes are 4,096-8,192)
MAX_NORM_COLS = 16384
#: columns per step of the row loop in the pointwise kernels
ROW_BLOCK = 2048


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``fast_layers.rms_norm``: float32 norm rounded to x's dtype, then the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def quant_ref(h: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``h / sx`` clamped and cast to e4m3, and per row the values past +-448 (int32)."""
    scaled = h / sx
    counts = (scaled.abs() > E4M3_MAX).sum(-1, dtype=torch.int32)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), counts


def _fits(x: torch.Tensor, *others: torch.Tensor, norm: bool = False) -> bool:
    return (
        HAVE_TRITON
        and x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and all(t.dtype == x.dtype and t.shape[-1] == x.shape[-1] and t.is_cuda for t in others)
        and (not norm or x.shape[-1] <= MAX_NORM_COLS)
    )


if HAVE_TRITON:

    @triton.jit
    def _quant_store(h, s, inv, live, q_ptrs):
        """``h / s`` in float32 (``h * inv`` with one FMA correction: the correctly rounded quotient, without
        the cost of an IEEE division per value), rounded to h's dtype; store the clamped e4m3 value and
        return the saturated lanes (int32)."""
        hf = h.to(tl.float32)
        y0 = hf * inv
        y = tl.fma(tl.fma(-y0, s, hf), inv, y0)
        y = tl.where(y0 == 0.0, y0, y).to(h.dtype).to(tl.float32)  # keep -0's sign, as a division does
        sat = ((tl.abs(y) > 448.0) & live).to(tl.int32)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(q_ptrs, y.to(q_ptrs.dtype.element_ty), mask=live)
        return sat

    @triton.jit
    def _scale(s_ptr):
        s = tl.load(s_ptr).to(tl.float32)
        return s, tl.math.div_rn(s * 0.0 + 1.0, s)

    @triton.jit
    def _rms_quant_kernel(x_ptr, r_ptr, w_ptr, s_ptr, xo_ptr, q_ptr, c_ptr, N: tl.constexpr,
                          EPS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        live = cols < N
        at = row * N + cols
        x = tl.load(x_ptr + at, mask=live, other=0.0)
        if RESIDUAL:
            r = tl.load(r_ptr + at, mask=live, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(xo_ptr + at, x, mask=live)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) * (1.0 / N)  # as ATen's mean: the sum times 1/N
        y = (xf * libdevice.rsqrt(var + EPS)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=live, other=0.0)
        h = (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)
        s, inv = _scale(s_ptr)
        sat = _quant_store(h, s, inv, live, q_ptr + at)
        tl.store(c_ptr + row, tl.sum(sat, axis=0))

    @triton.jit
    def _rows_quant_kernel(g_ptr, u_ptr, s_ptr, q_ptr, c_ptr, N: tl.constexpr, GATED: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s, inv = _scale(s_ptr)
        n = tl.zeros([BLOCK], dtype=tl.int32)
        for start in tl.static_range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < N
            at = row * N + cols
            g = tl.load(g_ptr + at, mask=live, other=0.0)
            if GATED:  # silu(g) * u, each rounded to g's dtype as eager rounds them
                gf = g.to(tl.float32)
                a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
                u = tl.load(u_ptr + at, mask=live, other=0.0)
                g = (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
            n += _quant_store(g, s, inv, live, q_ptr + at)
        tl.store(c_ptr + row, tl.sum(n, axis=0))

    def _warps(cols: int) -> int:
        return 8 if cols >= 4096 else 4 if cols >= 1024 else 1

    def _outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
                torch.empty(x.shape[:-1], dtype=torch.int32, device=x.device))

    def _norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, sx: torch.Tensor, xo: torch.Tensor,
              eps: float, residual: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q, c = _outputs(x)
        cols = x.shape[-1]
        block = triton.next_power_of_2(cols)
        wrap_triton(_rms_quant_kernel)[(x.numel() // cols,)](
            x, r, w, sx, xo, q, c, N=cols, EPS=float(eps), RESIDUAL=residual, BLOCK=block,
            num_warps=_warps(block),
        )
        return q, c

    @torch.library.triton_op("llmwd::rms_quant", mutates_args={})
    def _rms_quant_op(x: torch.Tensor, w: torch.Tensor, sx: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm(x, x, w, sx, x, eps, False)

    @torch.library.triton_op("llmwd::add_rms_quant", mutates_args={})
    def _add_rms_quant_op(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, sx: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xo = torch.empty_like(x)
        q, c = _norm(x, r, w, sx, xo, eps, True)
        return xo, q, c

    @torch.library.triton_op("llmwd::rows_quant", mutates_args={})
    def _rows_quant_op(g: torch.Tensor, u: torch.Tensor, sx: torch.Tensor,
                       gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q, c = _outputs(g)
        cols = g.shape[-1]
        block = min(ROW_BLOCK, triton.next_power_of_2(cols))
        wrap_triton(_rows_quant_kernel)[(g.numel() // cols,)](
            g, u, sx, q, c, N=cols, GATED=gated, BLOCK=block, num_warps=_warps(block)
        )
        return q, c


def rms_quant(x: torch.Tensor, w: torch.Tensor, sx: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 of ``rms(x, w, eps) / sx``, per-row count of values past +-448). ``sx``: one value, x's dtype."""
    if _fits(x, w, norm=True):
        return torch.ops.llmwd.rms_quant(x.contiguous(), w.contiguous(), sx, eps)
    return quant_ref(rms(x, w, eps), sx)


def add_rms_quant(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, sx: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``x + r``, then ``rms_quant`` of it): the residual stream and the next linear's e4m3 input."""
    if _fits(x, r, w, norm=True):
        return torch.ops.llmwd.add_rms_quant(x.contiguous(), r.contiguous(), w.contiguous(), sx, eps)
    s = x + r
    return (s, *quant_ref(rms(s, w, eps), sx))


def silu_mul_quant(g: torch.Tensor, u: torch.Tensor,
                   sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 of ``silu(g) * u / sx``, per-row count of values past +-448)."""
    if _fits(g, u):
        return torch.ops.llmwd.rows_quant(g.contiguous(), u.contiguous(), sx, True)
    return quant_ref(torch.nn.functional.silu(g) * u, sx)


def quant_rows(x: torch.Tensor, sx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 of ``x / sx``, per-row count of values past +-448)."""
    if _fits(x):
        x = x.contiguous()
        return torch.ops.llmwd.rows_quant(x, x, sx, False)
    return quant_ref(x, sx)
