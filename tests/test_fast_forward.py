"""The fast path's own full-sequence pass (prefill, scoring) and its live-window decode attention,
against the transformers forward and the whole-cache decode, on a tiny random Llama (CPU: float32, eager
functions; on a GPU the same code is compiled and graphed)."""

from __future__ import annotations

import copy

import pytest

from tests.test_engines_torch import _random_llama

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch

MIXED = ["a", "Q: a longer prompt than the others? A:", "def f(x):", "中文", "x" * 40, "The end.", "z"]
REFS = [" b", " yes.", "\n    return x", "文字", "y" * 9, " Fin", "!"]


def _engines(precision: str, **extra):
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.tiny_model import byte_tokenizer

    base = _random_llama(5)
    # the option tests start from an fp16 cache and head (on FP8 hardware "auto" makes both FP8)
    extra.setdefault("fp8_kv_cache", False)
    extra.setdefault("fp8_lm_head", False)
    if precision == "fp8" and "calibration" not in extra:
        cal = TorchEngine(precision="fp16", model=copy.deepcopy(base), tokenizer=byte_tokenizer(), fast="off")
        extra["calibration"] = calibrate_engine(cal, MIXED)
    eager = TorchEngine(
        precision=precision,
        model=copy.deepcopy(base),
        tokenizer=byte_tokenizer(),
        fast="off",
        batch_size=4,
        **extra,
    )
    fast = TorchEngine(
        precision=precision,
        model=copy.deepcopy(base),
        tokenizer=byte_tokenizer(),
        fast="on",
        batch_size=4,
        **extra,
    )
    return eager, fast


@pytest.mark.parametrize("precision", ["fp16", "fp8"])
def test_scoring_through_the_own_forward_equals_the_transformers_forward(precision: str) -> None:
    eager, fast = _engines(precision)
    if fast.device.startswith("cuda"):
        pytest.skip("compared at float32 on CPU; on a GPU the compiled pass rounds differently")
    assert fast.fast_decoder.own_forward
    want, got = eager.score(MIXED, REFS), fast.score(MIXED, REFS)
    assert want is not None and got is not None
    for w, g in zip(want, got, strict=True):
        assert g.n_tokens == w.n_tokens and g.error is None
        assert abs(g.logprob_sum - w.logprob_sum) < 1e-4
    ids_w, lp_w = eager.prompt_logprobs(MIXED[1])
    ids_g, lp_g = fast.prompt_logprobs(MIXED[1])
    assert ids_g == ids_w and lp_g[0] is None
    assert max(abs(a - b) for a, b in zip(lp_g[1:], lp_w[1:], strict=True)) < 1e-4
    # the switch back to the model's own forward gives the same numbers
    fast.fast_decoder.own_forward = False
    again = fast.score(MIXED, REFS)
    assert [round(s.logprob_sum, 3) for s in again] == [round(s.logprob_sum, 3) for s in got]


def test_live_window_decode_gives_the_whole_cache_tokens() -> None:
    """Attending only keys [0, position rounded up to the window) is the same attention: the keys past
    the position are masked anyway. A window of 8 crosses several windows within 30 tokens."""
    _eager, fast = _engines("fp16")
    dec = fast.fast_decoder
    rows = [fast.encode_prompt(p) for p in MIXED[:4]]
    dec.live_window = 0
    whole = fast._generate_batch(rows, 30)
    assert dec._live(128, 5) == 128
    dec.live_window = 8
    assert [dec._live(128, s) for s in (0, 7, 8, 126, 127)] == [8, 8, 16, 128, 128]
    windowed = fast._generate_batch(rows, 30)
    assert [t for t, _ in windowed] == [t for t, _ in whole]
    for (_, a), (_, b) in zip(windowed, whole, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    assert all(len(t) == 30 for t, _ in windowed)


def test_own_forward_counts_fp8_saturation_on_valid_tokens() -> None:
    """Stale scales (x0.25) clip activations: the own pass counts them per layer like the eager
    Fp8Linear does. One unpadded prompt: every token is valid, so both count the same values."""
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.tiny_model import byte_tokenizer

    base = _random_llama(5)
    cal = TorchEngine(precision="fp16", model=copy.deepcopy(base), tokenizer=byte_tokenizer(), fast="off")
    amax = {k: v * 0.25 for k, v in calibrate_engine(cal, MIXED).items()}
    eager, fast = _engines("fp8", calibration=amax)
    prompt = MIXED[1]
    eager.prompt_logprobs(prompt)
    fast.prompt_logprobs(prompt)
    s_eager, s_fast = eager.saturation(), fast.saturation()
    assert s_fast.n_values == s_eager.n_values > 0
    assert s_eager.n_saturated > 0
    # float32 on CPU: the same activations; fp16 compiled on a GPU: values at the clip edge may round over
    tol = 0.01 if fast.device == "cpu" else 0.05
    assert abs(s_fast.n_saturated - s_eager.n_saturated) <= tol * s_eager.n_saturated + 2
    # padding adds values to count for the eager layers, not for the own pass
    fast.reset_saturation()
    fast.score([prompt, "a"], [" b", " c"])
    n_tokens = len(fast.encode_prompt(prompt)) + 2 + len(fast.encode_prompt("a")) + 2
    per_token = s_fast.n_values / len(fast.encode_prompt(prompt))
    assert fast.saturation().n_values == pytest.approx(n_tokens * per_token)
    # sampled (``saturation_stride``): every 2nd position of the left-padded batch, valid ones only
    fast.reset_saturation()
    assert fast.saturation().n_values == 0
    fast.fast_decoder.saturation_stride = 2
    ids = [fast.encode_prompt(p) + fast.encode_prompt(r) for p, r in ((prompt, " b"), ("a", " c"))]
    width = max(len(r) for r in ids)
    sampled = sum(1 for r in ids for pos in range(0, width, 2) if pos >= width - len(r))
    fast.score([prompt, "a"], [" b", " c"])
    assert fast.saturation().n_values == pytest.approx(sampled * per_token)
    fast.reset_saturation()
    fast.fast_decoder.saturation_stride = 1
    fast.prompt_logprobs(prompt)
    assert fast.saturation().n_saturated == s_fast.n_saturated


def test_an_fp8_lm_head_counts_its_saturation_on_the_fast_path() -> None:
    """The FP8 head (the default on FP8 hardware) counts the values its quantiser clips on the fast path
    as the eager ``Fp8Linear`` does: equal counts on one unpadded prompt, and only the kept, valid
    positions of a left-padded scoring batch."""
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.fp8 import saturation_report
    from probes.tiny_model import byte_tokenizer

    base = _random_llama(5)
    cal = TorchEngine(precision="fp16", model=copy.deepcopy(base), tokenizer=byte_tokenizer(), fast="off")
    amax = {k: v * 0.25 for k, v in calibrate_engine(cal, MIXED).items()}
    eager, fast = _engines("fp8", calibration=amax, fp8_lm_head=True)
    head = fast.model.lm_head
    prompt = MIXED[1]
    eager.prompt_logprobs(prompt)
    fast.prompt_logprobs(prompt)
    n_eager, sat_eager = eager.model.lm_head.saturation()
    n_fast, sat_fast = head.saturation()
    assert n_fast == n_eager == len(fast.encode_prompt(prompt)) * head.in_features
    assert sat_eager > 0
    tol = 0.01 if fast.device == "cpu" else 0.05
    assert abs(sat_fast - sat_eager) <= tol * sat_eager + 2
    assert saturation_report(fast.model).layers["lm_head"] == pytest.approx(sat_fast / n_fast)
    # scoring reads the head at the references' positions (and the one before): pad positions are not counted
    fast.reset_saturation()
    fast.score([prompt, "a"], [" bc", " c"])
    n_scored, _ = head.saturation()
    assert 0 < n_scored <= 2 * (len(fast.encode_continuation(" bc")) + 1) * head.in_features
    fast.fast_decoder.count_saturation = False
    fast.reset_saturation()
    fast.score([prompt], [" b"])
    assert head.saturation() == (0, 0)


def test_saturation_counts_added_in_one_store_equal_the_per_module_adds() -> None:
    """The counters of every FP8 linear are views of one store that a pass adds to at once; per layer
    the counts equal the per-module adds, and a decoder whose modules another decoder rebound (or a
    model whose counters were replaced) adds per module, losing nothing."""
    from probes.engines.fast_decode import FastDecoder
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.fp8 import saturation_report
    from probes.tiny_model import byte_tokenizer

    base = _random_llama(5)
    cal = TorchEngine(precision="fp16", model=copy.deepcopy(base), tokenizer=byte_tokenizer(), fast="off")
    amax = {k: v * 0.25 for k, v in calibrate_engine(cal, MIXED).items()}
    _eager, fast = _engines("fp8", calibration=amax)
    dec = fast.fast_decoder
    assert dec._sat_store is not None
    fast.score(MIXED[:3], REFS[:3])
    stored = saturation_report(fast.model)
    assert stored.n_saturated > 0 and dec._sat_store[1].sum().item() == stored.n_saturated
    fast.reset_saturation()
    assert dec._sat_store.abs().sum().item() == 0
    dec._sat_store = None  # the per-module adds
    fast.score(MIXED[:3], REFS[:3])
    assert saturation_report(fast.model) == stored
    # a second decoder over the same model takes the counters over; the engine's decoder still counts
    dec._bind_saturation()
    fast.reset_saturation()
    other = FastDecoder(fast.model)
    assert other._sat_store is not None and other._sat_store.data_ptr() != dec._sat_store.data_ptr()
    fast.score(MIXED[:3], REFS[:3])
    assert saturation_report(fast.model) == stored
    assert other._sat_store[1].sum().item() == stored.n_saturated
    assert dec._sat_store.abs().sum().item() == 0


def test_merged_linears_give_the_separate_products_and_keep_the_weights_shared() -> None:
    """q/k/v (and gate/up) as one GEMM: FP16-style plain weights are concatenated and the modules keep
    views of the merged tensor; FP8 linears with one activation scale multiply with float32 output and
    each one's weight scale on its own columns, which equals the separate ``_scaled_mm`` products."""
    import torch
    from torch import nn

    from probes.engines.fast_layers import lin_params, linear, merge_linears
    from probes.fp8 import Fp8Linear

    g = torch.Generator().manual_seed(1)
    plain = [nn.Linear(32, n, bias=False) for n in (32, 16, 16)]
    x = torch.randn(5, 32, generator=g)
    want = [m(x) for m in plain]
    merged = merge_linears(plain)
    assert merged is not None and merged["sizes"] == (32, 16, 16)
    got = linear(x, merged).split(merged["sizes"], dim=-1)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want, strict=True))
    base = merged["w"].untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == base for m in plain)

    fp8 = [
        Fp8Linear(torch.randn(n, 32, generator=g) * s, None, 3.0)
        for n, s in ((32, 0.1), (16, 1.0), (16, 0.01))
    ]
    for m in fp8:
        m.backend = "scaled_mm"  # CPU torch runs _scaled_mm too (float32 output)
    separate = [linear(x, lin_params(m)) for m in fp8]
    merged8 = merge_linears(fp8)
    if merged8 is None:
        pytest.skip("_scaled_mm with float32 output is not available on this device")
    got8 = linear(x, merged8).split(merged8["sizes"], dim=-1)
    for a, b in zip(got8, separate, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    stale = [Fp8Linear(torch.randn(16, 32, generator=g), None, amax) for amax in (3.0, 0.5)]
    for m in stale:
        m.backend = "scaled_mm"
    assert merge_linears(stale) is None  # different activation scales: no shared quantised input


def test_shared_quantised_input_gives_the_separate_fp8_products() -> None:
    """``share_quant``: q/k/v (gate/up) read ONE quantised copy of their input through the merged
    entry's scale; with equal calibrated scales that is the same FP8 tensor, so the same products."""
    import torch

    from probes.engines.fast_layers import lin_params, linear, merge_linears, projections
    from probes.fp8 import Fp8Linear

    g = torch.Generator().manual_seed(2)
    mods = [Fp8Linear(torch.randn(n, 32, generator=g) * s, None, 3.0) for n, s in ((32, 0.1), (16, 1.0), (16, 0.01))]
    for m in mods:
        m.backend = "scaled_mm"
    h = torch.randn(2, 5, 32, generator=g) * 2
    want = [linear(h, lin_params(m)) for m in mods]
    merged = merge_linears(mods)
    if merged is None:
        pytest.skip("_scaled_mm with float32 output is not available on this device")
    p = {"qkv": merged, **{n: lin_params(m) for n, m in zip("qkv", mods, strict=True)}}
    got = projections(h, p, "", ("q", "k", "v"), "qkv")
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # without the merged entry there is nothing to share: the plain per-linear path
    assert all(torch.equal(a, b) for a, b in zip(projections(h, p, "", ("q", "k", "v"), "gu"), want, strict=True))


def test_gqa_decode_attention_equals_sdpa() -> None:
    import torch

    from probes.engines.fast_decode import attend, attend_gqa

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 16, generator=g)
    kc, vc = torch.randn(3, 2, 40, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g)
    kmask = torch.rand(3, 24, generator=g) > 0.3
    kmask[:, 0] = True
    assert torch.allclose(attend_gqa(q, kc, vc, kmask), attend(q, kc, vc, kmask), atol=1e-5)
    kmask[:, 1:] = False  # one key: the output is its value, the masked keys contribute nothing
    out = attend_gqa(q, kc, vc, kmask).view(3, 2, 4, 16)
    assert torch.allclose(out, vc[:, :, None, 0].expand(3, 2, 4, 16), atol=1e-6)


def test_decoder_options_and_fp8_lm_head_keep_the_eager_tokens() -> None:
    """The FP8 lm_head (``fp8_lm_head``) on the fast path gives the eager path's greedy tokens (CPU:
    exact emulation), and switching the decode attention drops the captured steps, not the answer."""
    from probes.fp8 import Fp8Linear

    eager, fast = _engines("fp8", fp8_lm_head=True)
    assert isinstance(fast.model.lm_head, Fp8Linear) and "lm_head" in fast.fp8_layers
    assert fast.fast_decoder.head["kind"] != "plain"
    rows = [fast.encode_prompt(p) for p in MIXED[:4]]
    want = eager._generate_batch(rows, 12)
    got = fast._generate_batch(rows, 12)
    if not fast.device.startswith("cuda"):
        assert [t for t, _ in got] == [t for t, _ in want]
    dec = fast.fast_decoder
    assert not any(p["share_quant"] for p in dec.layers)
    dec.set_options(attention="gqa", share_quant=True)
    assert all(p["attention"] == "gqa" and p["share_quant"] for p in dec.layers)
    assert all(not bk.graphs for bk in dec._buckets.values())
    again = fast._generate_batch(rows, 12)
    assert [t for t, _ in again] == [t for t, _ in got]
    with pytest.raises(ValueError):
        dec.set_options(attention="flash")


def test_decode_attention_op_matches_sdpa_and_the_fp8_cache_dequantised() -> None:
    """``probes.decode_attention``: on an fp16/float cache the op equals ``attend`` with the key mask of
    [pad, slot]; on an FP8 cache (e4m3 bits, per-head scales) it equals ``attend`` on the dequantised
    cache, and stays within the e4m3 rounding of the unquantised one."""
    import torch

    from probes.decode_attention import decode_attention, dequant_kv, kv_scales, quant_kv
    from probes.engines.fast_decode import attend

    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 8, 16, generator=g)
    kc, vc = torch.randn(3, 2, 40, 16, generator=g), torch.randn(3, 2, 40, 16, generator=g)
    slot, pad = torch.tensor([30]), torch.tensor([0, 7, 30])
    idx = torch.arange(32)
    kmask = (idx[None] >= pad[:, None]) & (idx[None] <= slot)
    one = torch.ones(1)
    want = attend(q, kc, vc, kmask)
    assert torch.allclose(decode_attention(q, kc, vc, one, one, slot, pad, 32), want, atol=1e-6)
    ks, vs = kv_scales(kc), kv_scales(vc)
    k8, v8 = quant_kv(kc, ks), quant_kv(vc, vs)
    assert k8.dtype == torch.uint8 and ks.shape == (2,)
    got = decode_attention(q, k8, v8, ks, vs, slot, pad, 32)
    deq = attend(q, dequant_kv(k8, ks), dequant_kv(v8, vs), kmask)
    assert torch.allclose(got, deq, atol=1e-5)
    assert (dequant_kv(k8, ks) - kc).abs().max() <= kc.abs().max() * 2 / 16  # half an e4m3 step at 2x headroom
    assert (got - want).abs().max() < 0.25
    # a row whose only key is its own token: the output is that token's value
    assert torch.allclose(got.view(3, 2, 4, 16)[2], dequant_kv(v8, vs)[2, :, 30][:, None].expand(2, 4, 16), atol=1e-6)


def test_fp8_kv_cache_and_triton_attention_options() -> None:
    """``set_options(kv_cache="fp8")`` gives the decoder an e4m3 cache with per-head scales (the first
    token, from the unquantised prefill, is the eager one); ``attention="triton"`` on the fp16 cache is
    the eager path's decode (CPU: the op's reference, the same SDPA), and both drop the captured steps."""
    import torch

    eager, fast = _engines("fp8")
    rows = [fast.encode_prompt(p) for p in MIXED[:4]]
    want = eager._generate_batch(rows, 10)
    dec = fast.fast_decoder
    dec.set_options(attention="triton")
    got = fast._generate_batch(rows, 10)
    if not fast.device.startswith("cuda"):
        assert [t for t, _ in got] == [t for t, _ in want]
    dec.set_options(kv_cache="fp8")
    assert dec.kv_dtype is not None and not dec._buckets
    got8 = fast._generate_batch(rows, 10)
    bk = next(iter(dec._buckets.values()))
    assert bk.kc[0].dtype == torch.uint8 and len(bk.ks) == len(dec.layers) and bool((bk.ks[0] > 0).all())
    assert [t[0] for t, _ in got8] == [t[0] for t, _ in want]
    assert all(len(t) <= 10 for t, _ in got8)
    dec.set_options(kv_cache="auto")
    assert dec.kv_dtype is None and not dec._buckets
    with pytest.raises(ValueError):
        dec.set_options(kv_cache="int4")
    # the engine option (``-o fp8_kv_cache=true``) sets it on the FP8 engine's decoder, not on FP16's
    _e, opt = _engines("fp8", fp8_kv_cache="true")
    assert opt.fast_decoder.kv_dtype is not None and "FP8 K/V cache" in opt.fast_reason
    _e, plain = _engines("fp16", fp8_kv_cache=True)
    assert plain.fast_decoder.kv_dtype is None


def test_fp8_lm_head_and_kv_cache_are_on_where_fp8_runs_natively() -> None:
    """``fp8_lm_head`` and ``fp8_kv_cache`` default to "auto": the head in FP8 where the products run on
    FP8 tensor cores (and the calibration has its input scale), the K/V cache in e4m3 there with the
    fast decoder (and Triton); on CPU (the emulated engine of the tests and the demo) both stay off. A calibration
    written without the head's scale keeps the head in high precision under "auto"; asked for, it is an error."""
    from torch import nn

    from probes.engines.torch_engine import _auto_flag, _fp8_kv_native
    from probes.fp8 import Fp8Linear, scaled_mm_supported

    eager, fast = _engines("fp8", fp8_kv_cache="auto", fp8_lm_head="auto")
    native = scaled_mm_supported(fast.device)
    assert isinstance(fast.model.lm_head, Fp8Linear) is native and fast.fp8_lm_head is native
    assert ("FP8 lm_head" in fast.fast_reason) is native
    assert (fast.fast_decoder.kv_dtype is not None) is (native and _fp8_kv_native(fast.device))
    assert eager.fast_decoder is None and isinstance(eager.model.lm_head, Fp8Linear) is native
    _e, forced = _engines("fp8", fp8_lm_head="true", fp8_kv_cache="on")
    assert isinstance(forced.model.lm_head, Fp8Linear) and forced.fast_decoder.kv_dtype is not None
    _e, off = _engines("fp8", fp8_lm_head="off")
    assert type(off.model.lm_head) is nn.Linear and "FP8 lm_head" not in off.fast_reason
    assert [_auto_flag(v, True) for v in ("auto", " AUTO", "false", False)] == [True, True, False, False]
    assert _auto_flag("auto", False) is False
    with pytest.raises(ValueError):
        _auto_flag("automatic", True)
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.tiny_model import byte_tokenizer

    cal = calibrate_engine(TorchEngine(precision="fp16", model=_random_llama(5), tokenizer=byte_tokenizer(),
                                       fast="off"), MIXED)
    assert "lm_head" in cal
    del cal["lm_head"]
    _e, no_head = _engines("fp8", calibration=cal, fp8_lm_head="auto")
    assert type(no_head.model.lm_head) is nn.Linear
    with pytest.raises(KeyError, match="lm_head"):
        _engines("fp8", calibration=cal, fp8_lm_head=True)


def test_the_eager_loop_with_an_fp8_kv_cache_gives_the_fast_paths_tokens() -> None:
    """``fp8_kv_cache`` on the eager loop (``torch_engine.e4m3_cache``) keeps the fast decoder's numerics:
    the same per-head scales from the prompt, the prompt's own attention unrounded, every later step over
    e4m3 K/V. CPU (float32): the same greedy tokens and logprobs to rounding, and logprobs that differ
    from the eager loop's fp16 cache (the rounding is applied, not skipped)."""
    eager, fast = _engines("fp8", fp8_kv_cache=True)
    assert eager.fast_decoder is None and eager.fp8_kv_cache and "FP8 K/V cache" in eager.fast_reason
    assert fast.fast_decoder.kv_dtype is not None
    _e, plain = _engines("fp8")
    rows = [fast.encode_prompt(p) for p in MIXED[:4]]
    want = eager._generate_batch(rows, 12)
    if fast.device.startswith("cuda"):  # compiled fp16 rounds differently; the first token is the prefill's
        assert [t[0] for t, _ in fast._generate_batch(rows, 12)] == [t[0] for t, _ in want]
        return
    got = fast._generate_batch(rows, 12)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lg), (_, lw) in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(lg, lw, strict=True)) < 1e-4
    unrounded = plain._generate_batch(rows, 12)
    assert [lp[0] for _, lp in unrounded] == pytest.approx([lp[0] for _, lp in want], abs=1e-5)  # prefill: same
    gaps = [abs(a - b) for (_, la), (_, lb) in zip(unrounded, want, strict=True) for a, b in zip(la[1:], lb[1:], strict=False)]
    assert max(gaps) > 1e-5


def test_fused_fp8_quantisers_give_the_separate_steps() -> None:
    """``fused_layer`` (``probes.fp8_fused``: RMSNorm, residual add or SiLU*up with the FP8 quantiser and
    its per-token count in one op) gives ``forward_layer``'s separate steps: hidden states and saturation
    counts. On CPU the ops are their torch reference, so equal to the bit (the CUDA kernels against the
    reference: tests/test_fp8_fused.py). Stale scales (x0.25) so that values clip."""
    import torch

    from probes.engines.fast_decode import FastDecoder
    from probes.engines.fast_forward import fusable
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.fp8 import Fp8Linear, reset_saturation, saturation_report
    from probes.tiny_model import byte_tokenizer

    base = _random_llama(5)
    cal = TorchEngine(precision="fp16", model=copy.deepcopy(base), tokenizer=byte_tokenizer(), fast="off")
    amax = {k: v * 0.25 for k, v in calibrate_engine(cal, MIXED).items()}
    _eager, fast = _engines("fp8", calibration=amax)
    if fast.device != "cpu":
        pytest.skip("CPU: the ops' torch reference (the kernels: tests/test_fp8_fused.py, the engine's tokens: "
                    "tests/test_engines_torch.py)")
    for m in fast.model.modules():
        if isinstance(m, Fp8Linear):
            m.backend = "scaled_mm"  # CPU torch runs _scaled_mm too: the layers take the FP8 product path
    dec = FastDecoder(fast.model)
    dec.fused_min_rows = 0  # every pass (the default since 2026-12-07; set here in case it changes)
    if not all(fusable(p) for p in dec.layers):
        pytest.skip("_scaled_mm with float32 output is not available on this device")
    assert not any(p["fused_quant"] for p in dec.layers)  # CUDA with Triton only, unless set here
    rows = [fast.encode_prompt(t) for t in MIXED[:4]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    got = {}
    for fused in (False, True):
        for p in dec.layers:
            p["fused_quant"] = fused
        reset_saturation(fast.model)
        got[fused] = dec.hidden(ids, mask, width), saturation_report(fast.model)
    assert torch.equal(got[True][0], got[False][0])
    assert got[True][1].n_saturated == got[False][1].n_saturated > 0
    assert got[True][1].layers == got[False][1].layers
    assert got[True][1].n_values == got[False][1].n_values


def test_compile_decode_only_leaves_the_passes_eager() -> None:
    """``compile="decode"`` compiles the decode step and leaves prefill and scoring eager (a one-off replay
    never earns back their dynamic-shape trace); any other word is refused in one line."""
    from probes.engines.fast_decode import FastDecoder, decode_layer, forward_layer

    model = _random_llama(5)
    dec = FastDecoder(model, compile="decode")
    assert dec.compile and not dec.compile_passes
    assert dec._forward_fn is forward_layer and dec._layer_fn is not decode_layer
    whole = FastDecoder(model, compile=True)
    assert whole.compile_passes and whole._forward_fn is not forward_layer
    assert not FastDecoder(model, compile=False).compile_passes
    with pytest.raises(ValueError, match="compile must be"):
        FastDecoder(model, compile="fast")


def test_repeated_passes_replay_captured_graphs_with_the_same_numbers_and_counts() -> None:
    """On CUDA a prefill or scoring pass whose shape comes a second time is captured as a graph and
    replayed from then on (``FastDecoder._pass``): the tokens, logprobs, scores and FP8 saturation counts
    of every replay equal the first, eager, run's; a pass above ``pass_graph_max_rows`` stays eager."""
    import torch

    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.fp8 import saturation_report
    from probes.tiny_model import byte_tokenizer

    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU (on CPU the passes are eager, as every other test here runs them)")
    base = _random_llama(5)
    cal = TorchEngine(precision="fp16", model=copy.deepcopy(base), tokenizer=byte_tokenizer(), fast="off")
    amax = {k: v * 0.25 for k, v in calibrate_engine(cal, MIXED).items()}  # stale: values clip, counts move
    _eager, fast = _engines("fp8", calibration=amax)
    dec = fast.fast_decoder
    assert dec is not None and dec.cuda_graphs
    runs, counts = [], []
    for _ in range(3):
        fast.reset_saturation()
        before = dict(dec.stats)
        gens = fast.generate(MIXED, 8)
        scores = fast.score(MIXED, REFS)
        rep = saturation_report(fast.model)
        runs.append(([(g.text, g.token_logprobs) for g in gens], [s.logprob_sum for s in scores],
                     rep.n_values, rep.n_saturated))
        counts.append({k: dec.stats[k] - before[k] for k in ("pass_captures", "pass_replays", "batches")})
    assert runs[0][3] > 0
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert counts[1]["pass_captures"] >= 2  # prefill and scoring batches, seen once before
    assert counts[2]["pass_captures"] == 0 and counts[2]["pass_replays"] >= counts[2]["batches"] + 1
    assert dec.cache_bytes() >= dec.pass_pool_bytes > 0
    dec.pass_graph_max_rows = 0
    before = dict(dec.stats)
    fast.reset_saturation()
    gens = fast.generate(MIXED, 8)
    assert [(g.text, g.token_logprobs) for g in gens] == runs[0][0]
    assert dec.stats["pass_replays"] == before["pass_replays"]
    dec.clear_graphs()
    assert not dec._pass_graphs and not any(bk.passes for bk in dec._buckets.values())
