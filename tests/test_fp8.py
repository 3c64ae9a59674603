"""FP8 numerics on CPU: quantisation, exact emulation, static/dynamic scales, saturation, calibration."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from probes.fp8 import (  # noqa: E402
    E4M3_MAX,
    FP8_DTYPE,
    Fp8Linear,
    calibrate,
    load_calibration,
    quantize_model,
    quantize_weight,
    reset_saturation,
    saturation_report,
    save_calibration,
    scaled_mm_supported,
)

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("mode", ["tensor", "row"])
def test_weight_quantisation_round_trip(mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 64, generator=g) * torch.linspace(0.1, 5, 48)[:, None]  # rows of very different size
    w_fp8, scale = quantize_weight(w, mode)
    assert w_fp8.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == ((1,) if mode == "tensor" else (48,))
    assert float(w_fp8.float().abs().max()) <= E4M3_MAX
    deq = w_fp8.float() * (scale if mode == "tensor" else scale[:, None])
    err = rel_err(deq, w)
    assert 0 < err < 0.05
    if mode == "row":  # per-row scales keep the small rows precise too
        small = slice(0, 4)
        assert rel_err(deq[small], w[small]) < 0.05


def test_emulation_is_the_documented_formula_and_matches_scaled_mm() -> None:
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(64, 32, bias=True)
    x = torch.randn(5, 64, generator=g) * 3
    amax = float(x.abs().max())
    layer = Fp8Linear.from_linear(lin, amax)
    assert layer.backend == "emulated" and not scaled_mm_supported("cpu")
    out = layer(x)
    # independent reference: quantise-dequantise both operands with the same scales, float32 matmul
    sa = amax / E4M3_MAX
    xq = (x / sa).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).float() * sa
    w = lin.weight.detach()
    sw = float(w.abs().max()) / E4M3_MAX
    wq = (w / sw).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).float() * sw
    ref = xq @ wq.t() + lin.bias
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    # torch._scaled_mm runs on CPU in this torch: the emulation must agree with the real kernel
    x_fp8 = (x / sa).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    real = torch._scaled_mm(x_fp8, layer.weight_fp8.t(), scale_a=layer.act_scale, scale_b=layer.weight_scale,
                            out_dtype=torch.float32) + lin.bias
    assert torch.allclose(out, real, rtol=1e-4, atol=1e-4)
    # and fp8 is an approximation of the float layer, not a copy of it
    exact = lin(x)
    assert 1e-4 < rel_err(out, exact) < 0.08


def test_dynamic_per_token_scales_need_no_calibration() -> None:
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(32, 16, bias=False)
    x = torch.randn(4, 32, generator=g) * torch.tensor([[0.01], [1.0], [100.0], [1000.0]])
    dyn = Fp8Linear.from_linear(lin, None, activation_mode="dynamic", weight_mode="row")
    exact = lin(x)
    out = dyn(x)
    for i in range(4):  # every token keeps its relative precision whatever its magnitude
        assert rel_err(out[i], exact[i]) < 0.08
    assert saturation_report(nn.Sequential(dyn)).total == 0.0
    with pytest.raises(ValueError):
        Fp8Linear.from_linear(lin, None)  # static needs a calibrated amax


def test_saturation_counts_clipped_values_and_stale_scales_hurt() -> None:
    g = torch.Generator().manual_seed(4)
    lin = nn.Linear(64, 64)
    x = torch.randn(64, 64, generator=g)
    amax = float(x.abs().max())
    good = Fp8Linear.from_linear(lin, amax, name="good")
    stale = Fp8Linear.from_linear(lin, amax, scale_multiplier=0.1, name="stale")
    model = nn.ModuleDict({"good": good, "stale": stale})
    exact = lin(x)
    err_good, err_stale = rel_err(good(x), exact), rel_err(stale(x), exact)
    rep = saturation_report(model)
    assert rep.layers["good"] == 0.0
    expected = float(((x / (amax * 0.1 / E4M3_MAX)).abs() > E4M3_MAX).float().mean())
    assert rep.layers["stale"] == pytest.approx(expected)
    assert 0.05 < rep.layers["stale"] < 1.0
    assert rep.total == pytest.approx(rep.n_saturated / rep.n_values)
    assert err_stale > 5 * err_good
    # traffic beyond the calibrated range saturates a good layer too
    good(x * 4)
    assert saturation_report(model).layers["good"] > 0
    reset_saturation(model)
    assert saturation_report(model).n_values == 0


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.lm_head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.up(x)))


def test_calibrate_quantize_model_and_files(tmp_path) -> None:
    torch.manual_seed(5)
    model = TwoLayer()
    batches = [torch.randn(3, 16), torch.randn(2, 16) * 5, {"x": torch.randn(1, 16)}]
    amax = calibrate(model, batches)
    assert set(amax) == {"up", "lm_head"}
    assert amax["up"] == pytest.approx(max(float(b.abs().max()) if torch.is_tensor(b) else float(b["x"].abs().max())
                                           for b in batches))
    path = save_calibration(tmp_path, amax, {"set": "unit"})
    assert path.name == "fp8_calibration.json"
    assert load_calibration(tmp_path) == pytest.approx(amax)
    ref_out = model(batches[1])
    replaced = quantize_model(model, load_calibration(path))
    assert replaced == ["up"] and isinstance(model.up, Fp8Linear) and isinstance(model.lm_head, nn.Linear)
    assert rel_err(model(batches[1]), ref_out) < 0.1
    with pytest.raises(KeyError):
        quantize_model(TwoLayer(), {"lm_head": 1.0})
    (tmp_path / "bad.json").write_text('{"version": 99}')
    with pytest.raises(ValueError):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        calibrate(model, [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton quantiser)")
def test_triton_quantiser_equals_the_eager_one_bit_for_bit() -> None:
    from probes.fp8 import fused_static_quant_count, quant_count_eager

    fused = fused_static_quant_count()
    for dtype in (torch.float16, torch.bfloat16):
        for shape in ((3, 64), (517, 4096), (64, 14336)):
            x = torch.randn(shape, device="cuda", dtype=dtype) * 3
            x[0, :5] = torch.tensor([1000.0, -1000.0, 0.0, 447.0, -0.001])
            scale = torch.tensor([0.0137], device="cuda").to(dtype)
            got, n_got = fused(x, scale)
            want, n_want = quant_count_eager(x, scale)
            assert got.dtype == want.dtype == torch.float8_e4m3fn
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            assert int(n_got) == int(n_want) > 0
