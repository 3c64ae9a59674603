"""FP8 x FP8 products at decode's small batch: a Triton kernel that puts the weight rows on the tensor
cores' long side ("swap AB") and splits K when the output alone is too few tiles to fill the GPU.

At decode a product is ``x [M, K] @ w[N, K].T`` with M the batch (16-128) and N, K in the thousands, so
its time is reading ``w``. cuBLAS's FP8 kernels tile M by 64 or more and reach ~2.8 TB/s there at
M = 16 (measured on the H200 with `bench/gpu_fp8_gemm.py`, docs/BENCHMARKS.md), against ~3.6 TB/s for the FP16 product of the same shape. Here each program computes
a ``[BN, BM]`` tile of the transposed product (``w`` tile ``[BN, BK]`` times ``x`` tile transposed, both
K-contiguous as Hopper's FP8 MMA wants them), over one of ``split`` slices of K.

Two ``torch.library`` custom ops (``scaled_small_mm`` picks): with one K slice, ``fp8_gemm_scaled``
applies the activation and weight scales (per column for merged linears) to the float32 accumulator and
writes the activation dtype; with more, ``fp8_gemm_partials`` writes float32 slices ``[split, M, N]``
that the caller sums in a fixed order and scales (inductor fuses that into the next kernel of a compiled
step), so the result is deterministic (no atomics). Without CUDA and Triton both are the float product (CI). Launch configurations per (M, N, K) were picked on the
H200 by ``bench/gpu_fp8_gemm.py``; shapes not in ``TUNED`` get ``default_config``.
"""

from __future__ import annotations

import torch

try:  # Triton is there with CUDA builds of torch; CPU-only installs run the float product
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

#: products with at most this many rows (the decode batch) may use the kernel
MAX_M = 128
SMS = 132
#: (M bucket, N, K) -> (split, BN, BK, warps, stages), or None where cuBLAS was the faster: the Llama-3-8B
#: shape's decode products, ``bench/gpu_fp8_gemm.py --batches 16,64 --promote 128`` on the H200
#: (2026-12-03; M = 128 from the same sweep with promotion every 32, where cuBLAS won every product)
TUNED: dict[tuple[int, int, int], tuple[int, int, int, int, int] | None] = {
    (16, 4096, 4096): None, (16, 4096, 14336): None, (16, 6144, 4096): (1, 64, 128, 4, 6),
    (16, 28672, 4096): (1, 64, 128, 4, 3), (16, 128256, 4096): (1, 128, 256, 4, 3),
    (64, 4096, 4096): None, (64, 4096, 14336): None, (64, 6144, 4096): (1, 64, 128, 4, 6),
    (64, 28672, 4096): (1, 64, 128, 4, 3), (64, 128256, 4096): (1, 64, 128, 4, 3),
    (128, 4096, 4096): None, (128, 4096, 14336): None, (128, 6144, 4096): None, (128, 28672, 4096): None,
    (128, 128256, 4096): None,
}


def m_bucket(m: int) -> int:
    """The kernel's BM: the rows padded to a power of two, at least 16 (the MMA's smallest N)."""
    return max(16, 1 << (m - 1).bit_length())


def splits_of(k: int, bk: int) -> list[int]:
    """K slices that divide K into whole BK blocks (1, 2, 4, 8, 16 where they fit)."""
    blocks = k // bk if k % bk == 0 else 0
    return [s for s in (1, 2, 4, 8, 16) if blocks and blocks % s == 0]


def default_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """BN 64, BK 128 (64 where K is not a multiple of 128); the fewest K slices that give about two
    programs per SM."""
    bn, bk = 64, 128 if k % 128 == 0 else 64
    tiles = -(-n // bn)
    split = 1
    for s in splits_of(k, bk):
        split = s
        if tiles * s >= 2 * SMS:
            break
    return split, bn, bk, 4, 4


def config(m: int, n: int, k: int) -> tuple[int, int, int, int, int] | None:
    """The launch configuration for this product, None where cuBLAS measured faster."""
    key = (m_bucket(m), n, k)
    return TUNED[key] if key in TUNED else default_config(m, n, k)


def chosen(x2: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """The configuration the kernel runs ``x2 [M, K] @ w[N, K].T`` with, or None for cuBLAS: the kernel
    needs CUDA with Triton, M a concrete int <= MAX_M (prefill's symbolic row count stays on cuBLAS), K
    a whole number of 64-blocks and K-contiguous weight rows."""
    m, k = x2.shape
    if not (HAVE_TRITON and x2.is_cuda and isinstance(m, int) and isinstance(k, int) and 0 < m <= MAX_M
            and k % 64 == 0 and w.stride(1) == 1):
        return None
    return config(m, w.shape[0], k)


if HAVE_TRITON:

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, o_ptr, M, N, sxm, swn, ss, sos, som, k_chunk,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALED: tl.constexpr,
                         PROMOTE: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        rk = pid_s * k_chunk + tl.arange(0, BK)
        nmask = rn < N
        mmask = rm < M
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * swn + rk[None, :]
        x_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for _ in range(0, k_chunk, BK):
            w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE)
            w_ptrs += BK
            x_ptrs += BK
        o_ptrs = o_ptr + pid_s * sos + rm[None, :] * som + rn[:, None]
        if SCALED:
            acc = acc * tl.load(s_ptr + rn * ss, mask=nmask, other=0.0)[:, None]
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


#: Hopper's FP8 MMA accumulates in reduced precision; the kernel adds its result into the float32
#: accumulator every this many products of K. Measured on the H200 (max error of the float32 sum over
#: the output's range): never promoted (Triton's default on Hopper) ~4e-3; every 128 ~1.3e-4; every 32
#: ~4e-5 but 25-60 % slower. After the cast to fp16 (rounding ~3-5e-4) 128 and 32 equal cuBLAS's error.
PROMOTE_EVERY = 128


def _launch(x8: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor, split: int, bn: int,
            bk: int, warps: int, stages: int) -> torch.Tensor:
    m, k = x8.shape
    n = w8.shape[0]
    x8 = x8.contiguous()
    s = scale if scale is not None else out
    ss = 0 if scale is None or scale.numel() == 1 else scale.stride(0)
    sos = out.stride(0) if out.dim() == 3 else 0
    _fp8_gemm_kernel[(triton.cdiv(n, bn), split)](
        x8, w8, s, out, m, n, x8.stride(0), w8.stride(0), ss, sos, out.stride(-2), k // split,
        BM=m_bucket(m), BN=bn, BK=bk, SCALED=scale is not None, PROMOTE=min(PROMOTE_EVERY, bk),
        num_warps=warps, num_stages=stages,
    )
    return out


def _on_gpu(x8: torch.Tensor) -> bool:
    return HAVE_TRITON and x8.is_cuda


@torch.library.custom_op("llmwd::fp8_gemm_partials", mutates_args=())
def fp8_gemm_partials(x8: torch.Tensor, w8: torch.Tensor, split: int, bn: int, bk: int, warps: int,
                      stages: int) -> torch.Tensor:
    """Float32 partial products ``[split, M, N]`` of ``x8 [M, K] @ w8[N, K].T`` (both float8_e4m3fn),
    K cut into ``split`` equal slices; no scales applied."""
    m, n = x8.shape[0], w8.shape[0]
    if not _on_gpu(x8):
        part = (x8.float() @ w8.float().t()).reshape(1, m, n)
        return torch.cat([part, part.new_zeros(split - 1, m, n)])
    out = torch.empty((split, m, n), dtype=torch.float32, device=x8.device)
    return _launch(x8, w8, None, out, split, bn, bk, warps, stages)


@fp8_gemm_partials.register_fake
def _(x8, w8, split, bn, bk, warps, stages):  # noqa: ANN001, ANN202 - the op's shape function
    return x8.new_empty((split, x8.shape[0], w8.shape[0]), dtype=torch.float32)


@torch.library.custom_op("llmwd::fp8_gemm_scaled", mutates_args=())
def fp8_gemm_scaled(x8: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, bn: int,
                    bk: int, warps: int, stages: int) -> torch.Tensor:
    """``x8 @ w8.T * scale`` in ``out_dtype`` in one pass (no K slices): ``scale`` float32, one value or
    one per output column, applied to the float32 accumulator before the cast."""
    if not _on_gpu(x8):
        return ((x8.float() @ w8.float().t()) * scale.float()).to(out_dtype)
    out = torch.empty((x8.shape[0], w8.shape[0]), dtype=out_dtype, device=x8.device)
    return _launch(x8, w8, scale.float().reshape(-1).contiguous(), out, 1, bn, bk, warps, stages)


@fp8_gemm_scaled.register_fake
def _(x8, w8, scale, out_dtype, bn, bk, warps, stages):  # noqa: ANN001, ANN202 - the op's shape function
    return x8.new_empty((x8.shape[0], w8.shape[0]), dtype=out_dtype)


def scaled_small_mm(x8: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                    cfg: tuple[int, int, int, int, int]) -> torch.Tensor:
    """``x8 @ w8.T * scale`` in ``out_dtype`` launched with ``cfg``: ``scale`` is the activation scale
    times the weight scale (a scalar, or one per output column for merged linears). One K slice: scaled
    and cast in the kernel; more: float32 slices summed in a fixed order, then scaled (in a compiled
    step that sum fuses into the next kernel)."""
    split, bn, bk, warps, stages = cfg
    if split == 1:
        return fp8_gemm_scaled(x8, w8, scale, out_dtype, bn, bk, warps, stages)
    return (fp8_gemm_partials(x8, w8, *cfg).sum(0) * scale).to(out_dtype)
