"""The fused FP8 quantisers of ``probes.fp8_fused`` (prefill and scoring on the fast path) against the
separate steps they replace. On CUDA with Triton the kernels: the e4m3 bytes equal the reference's but for
a stated fraction one e4m3 step away (``TOLERANCE``), and the per-row saturation counts equal. On CPU the
ops are the reference itself."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def _cuda_triton() -> bool:
    import torch

    from probes import fp8_fused

    return torch.cuda.is_available() and fp8_fused.HAVE_TRITON


def _inputs(rows: int, cols: int, dtype, device: str, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype).to(device)
    r = torch.randn(rows, cols, generator=g).to(dtype).to(device)
    w = (torch.rand(cols, generator=g) + 0.5).to(dtype).to(device)
    return x, r, w


def _references(x, r, w, eps):
    """Each op's separate steps, as ``fast_forward.forward_layer`` runs them: (name, op args, reference)."""
    import torch.nn.functional as F

    from probes.engines.fast_forward import clipped
    from probes.engines.fast_layers import quant, rms_norm

    sx = x.new_tensor([0.004])  # amax 1.8: a few percent of the normed values clip
    sr = x.new_tensor([0.01])  # amax 4.5 for silu(x) * r and x itself

    def ref(h, s):
        return quant(h, s), clipped(h, {"sx_in": s})

    s = x + r
    return [
        ("rms_quant", (x, w, sx, eps), ref(rms_norm(x, w, eps), sx)),
        ("add_rms_quant", (x, r, w, sx, eps), (s, *ref(rms_norm(s, w, eps), sx))),
        ("silu_mul_quant", (x, r, sr), ref(F.silu(x) * r, sr)),
        ("quant_rows", (x, sr), ref(x, sr)),
    ]


#: fraction of e4m3 values allowed one step from the reference: the norms add their sum of squares in
#: another order; SiLU uses Triton's fast exp and division (eager: the accurate ones); the division by the
#: scale is correctly rounded in all four
TOLERANCE = {"rms_quant": 1e-4, "add_rms_quant": 1e-4, "silu_mul_quant": 1e-5, "quant_rows": 0.0}


def _one_step_apart(a, b) -> bool:
    """Every differing e4m3 value is the neighbouring code of the other (same sign; -0 equals +0)."""
    import torch

    ia, ib = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    return bool((((ia - ib).abs() <= 1) | (a.float() == b.float())).all())


def _check(name, got, want) -> None:
    import torch

    *res, q, c = got
    *res_w, q_w, c_w = want
    for a, b in zip(res, res_w, strict=True):
        assert torch.equal(a, b), name
    assert q.dtype == q_w.dtype and q.shape == q_w.shape and c.dtype == torch.int32
    differ = (q.float() != q_w.float()).float().mean().item()  # -0 and +0 are one value to the product
    assert differ <= TOLERANCE[name], (name, differ)
    assert _one_step_apart(q, q_w), name
    assert torch.equal(c, c_w), (name, (c - c_w).abs().sum().item())
    assert c_w.sum() > 0, name  # the inputs do clip


def test_the_ops_equal_the_separate_steps_on_cpu() -> None:
    import torch

    from probes import fp8_fused

    x, r, w = _inputs(7, 96, torch.float32, "cpu")
    for name, args, want in _references(x, r, w, 1e-5):
        _check(name, getattr(fp8_fused, name)(*args), want)


@pytest.mark.parametrize("cols", [64, 4096, 14336])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_kernels_equal_the_separate_steps_on_cuda(cols: int, dtype: str) -> None:
    import torch

    from probes import fp8_fused

    if not _cuda_triton():
        pytest.skip("needs CUDA and Triton")
    x, r, w = _inputs(333, cols, getattr(torch, dtype), "cuda", seed=cols)
    for name, args, want in _references(x, r, w, 1e-5):
        if "rms" in name and cols > fp8_fused.MAX_NORM_COLS:
            continue
        _check(name, getattr(fp8_fused, name)(*args), want)


def test_the_ops_compile_with_dynamic_shapes_on_cuda() -> None:
    """Inside ``torch.compile`` (dynamic rows, as the prefill layer is compiled) the ops give what they
    give eagerly."""
    import torch

    from probes import fp8_fused

    if not _cuda_triton():
        pytest.skip("needs CUDA and Triton")

    def layer(x, r, w, sx):
        h8, c1 = fp8_fused.rms_quant(x, w, sx, 1e-5)
        s, h28, c2 = fp8_fused.add_rms_quant(x, r, w, sx, 1e-5)
        m8, c3 = fp8_fused.silu_mul_quant(x * 2, r, sx)
        a8, c4 = fp8_fused.quant_rows(s, sx)
        return h8, h28, m8, a8, s, torch.stack([c1, c2, c3, c4])

    compiled = torch.compile(layer, dynamic=True)
    for rows in (5, 77):
        x, r, w = _inputs(rows, 256, torch.float16, "cuda", seed=rows)
        sx = x.new_tensor([0.004])
        for a, b in zip(compiled(x, r, w, sx), layer(x, r, w, sx), strict=True):
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                               b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
