"""The small-batch FP8 product of ``probes.fp8_gemm`` (decode's products on the fast path): the op's
slices sum to the float product of the FP8 values, the scales are applied as ``_scaled_mm`` applies them,
configurations cut K into whole blocks, and the engine option routes decode through it. On CUDA with
Triton the kernel itself is checked against the float product; on CPU the op is that product."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.torch

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def _fp8(shape, seed, scale=1.0, device="cpu"):
    import torch

    from probes.fp8 import FP8_DTYPE

    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(FP8_DTYPE).to(device)


@pytest.mark.parametrize("split", [1, 2])
def test_the_ops_slices_sum_to_the_float_product(split: int) -> None:
    import torch

    from probes.fp8_gemm import fp8_gemm_partials, scaled_small_mm

    x8, w8 = _fp8((5, 256), 1), _fp8((96, 256), 2, 0.1)
    want = x8.float() @ w8.float().t()
    part = fp8_gemm_partials(x8, w8, split, 64, 128, 4, 3)
    assert part.shape == (split, 5, 96) and part.dtype == torch.float32
    assert torch.allclose(part.sum(0), want, rtol=1e-6, atol=1e-5)
    cols = torch.rand(96) + 0.5
    out = scaled_small_mm(x8, w8, torch.tensor(0.5) * cols, torch.float16, (split, 64, 128, 4, 3))
    assert out.dtype == torch.float16
    assert torch.allclose(out.float(), (want * 0.5 * cols).half().float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("m", [1, 16, 64, 128])
def test_default_configurations_cut_k_into_whole_blocks(m: int) -> None:
    from probes.fp8_gemm import default_config, m_bucket

    for n, k in [*SHAPES_8B, (192, 64), (64, 128)]:
        split, bn, bk, warps, stages = default_config(m, n, k)
        assert k % (split * bk) == 0 and bn in (32, 64, 128) and warps in (4, 8) and stages >= 2
    assert [m_bucket(v) for v in (1, 16, 17, 64, 65, 128)] == [16, 16, 32, 64, 128, 128]


def test_cpu_and_prefill_shapes_stay_on_cublas() -> None:
    import torch

    from probes.fp8_gemm import MAX_M, chosen

    w8 = _fp8((64, 128), 3)
    assert chosen(_fp8((4, 128), 4), w8) is None  # CPU
    if torch.cuda.is_available():
        wc = w8.cuda()
        assert chosen(_fp8((MAX_M + 1, 128), 4, device="cuda"), wc) is None
        assert chosen(_fp8((4, 96), 4, device="cuda"), _fp8((64, 96), 3, device="cuda")) is None  # K % 64


@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
@pytest.mark.parametrize(("m", "n", "k", "cfg"), [
    (16, 4096, 4096, (4, 64, 128, 4, 4)), (3, 200, 256, (2, 64, 64, 4, 3)), (128, 6144, 4096, (1, 128, 128, 4, 3)),
    (64, 4096, 14336, (8, 32, 128, 4, 4)), (16, 512, 1024, (1, 64, 256, 4, 3)),
])
def test_the_kernel_equals_the_float_product_on_cuda(m, n, k, cfg) -> None:

    from probes import fp8_gemm

    if not fp8_gemm.HAVE_TRITON:
        pytest.skip("Triton is not installed")
    import torch

    x8, w8 = _fp8((m, k), 5, 2.0, "cuda"), _fp8((n, k), 6, 0.05, "cuda")
    want = x8.float() @ w8.float().t()
    got = fp8_gemm.fp8_gemm_partials(x8, w8, *cfg).sum(0)
    # promoted out of the MMA's reduced-precision accumulator every 128 products: ~1.3e-4 of the range on
    # the H200, against ~4e-3 without promotion
    assert ((got - want).abs().max() / want.abs().max()).item() < 5e-4
    cols = torch.rand(n, device="cuda") + 0.5
    scaled = fp8_gemm.fp8_gemm_scaled(x8, w8, cols * 0.25, torch.float16, *cfg[1:]).float()
    ref = want * cols * 0.25
    assert ((scaled - ref).abs().max() / ref.abs().max()).item() < 1e-3  # fp16 rounding of the output


def test_the_engine_option_routes_decode_through_the_kernel() -> None:
    """``fp8_gemm="triton"`` sets the FP8 engine's decoder (layers and lm_head), keeps the eager greedy
    tokens (CPU: the products stay on the emulation, so exactly), and a bad value is refused."""
    from tests.test_fast_forward import MIXED, _engines

    eager, fast = _engines("fp8", fp8_gemm="triton")
    dec = fast.fast_decoder
    assert dec.gemm == "triton" and "Triton FP8 decode GEMMs" in fast.fast_reason
    assert all(p["gemm"] == "triton" and p["o"]["gemm"] == "triton" for p in dec.layers)
    assert dec.head["gemm"] == "triton"
    rows = [fast.encode_prompt(p) for p in MIXED[:4]]
    want = eager._generate_batch(rows, 10)
    got = fast._generate_batch(rows, 10)
    if not fast.device.startswith("cuda"):
        assert [t for t, _ in got] == [t for t, _ in want]
    else:  # summation order differs from cuBLAS: the first token comes from prefill (cuBLAS) in both
        assert [t[0] for t, _ in got] == [t[0] for t, _ in want]
    dec.set_options(gemm="cublas")
    assert all(p["gemm"] == "cublas" for p in dec.layers)
    with pytest.raises(ValueError):
        dec.set_options(gemm="cutlass")
    _e, plain = _engines("fp16", fp8_gemm="triton")
    assert plain.fast_decoder.gemm == "cublas"
    with pytest.raises(ValueError, match="fp8_gemm must be cublas or triton"):
        _engines("fp8", fp8_gemm="cutlass")
