"""FP8 vs FP16 decode at the Llama-3-8B shape, with the non-GEMM work fused: where the time goes.

PROTOTYPE: a decoder of its own, not the product path. Its ideas (one compiled layer, the step in one
CUDA graph, static FP8 scales) now live in probes/engines/fast_decode.py, which the torch engine uses
for replay, calibrate and the OpenAI-compatible server; bench/gpu_replay.py measures that path.
This script stays for its per-component times (GEMMs, attention, lm_head, the rest).

The first decode benchmark (bench/gpu_replay.py section 2) ran an unfused decoder in a CUDA graph:
FP8/FP16 = 1.15x, because ~3.5 ms of a 7.5 ms step were small unfused kernels (RMSNorm, rotary,
residuals, masked GQA attention through SDPA's math path, the quantisers) that FP8 does not shrink.
This script gives FP16 and FP8 the SAME treatment and measures both:

* one transformer layer is a pure function of tensors (``layer``), compiled once with torch.compile
  (inductor, default mode, static shapes) and called for all 32 layers; the whole decode step
  (embedding, 32 layers, lm_head, greedy argmax, position advance) is then captured in one CUDA graph;
* each layer ends with the NEXT layer's RMSNorm and, for FP8, its static activation quantisation, so
  the quantiser is fused into the norm (and into the SiLU*up product before down_proj);
* attention for the one new token over the static KV cache, sized to the context (prompt + steps):
  ``bmm`` (two batched GEMMs + fused softmax) or ``reduce`` (inductor reductions); the faster of the
  two on FP16 KV is used for every FP16 and FP8 row;
* FP8 variants: linear layers (static calibrated per-tensor scales, as ``probes.fp8.Fp8Linear``;
  weights through ``probes.fp8.quantize_weight``), + lm_head in FP8, + FP8 (e4m3) KV cache with
  static per-head scales (``reduce`` attention, which dequantises inside the kernel).

Per-component time comes from CUDA graphs of the parts alone (layer GEMMs, attention, lm_head);
"other" = step - those (norms, rotary, residuals, quantisers, SiLU, KV-cache writes, embedding, argmax).

    python bench/gpu_decode.py --out decode.txt        # on the GPU
    python bench/gpu_decode.py --smoke                 # tiny shape on CPU: every code path, compiled too
    python bench/gpu_decode.py --numerics              # CPU: compiled vs eager FP8 rounding (see numerics_check)
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_replay import Shape, StaticDecoder, rel_err  # noqa: E402
from probes.fp8 import E4M3_MAX, quantize_weight  # noqa: E402

FP8 = torch.float8_e4m3fn
EPS = 1e-5
AUTOTUNE = "max-autotune-no-cudagraphs"
LINES: list[str] = []
OUT_PATH: Path | None = None


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    if OUT_PATH is not None:  # written as we go: a run cut short still leaves its rows
        OUT_PATH.write_text("\n".join(LINES) + "\n")


# -- the decode step as pure functions (what torch.compile traces) ------------------------------
def quant(x: torch.Tensor, sx: torch.Tensor | None) -> torch.Tensor:
    """GEMM input: unchanged (FP16) or divided by the static scale, clamped and cast to e4m3."""
    if sx is None:
        return x
    return (x.float() / sx).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def prep(x: torch.Tensor, ln: torch.Tensor, sx: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm (as the checked StaticDecoder computes it) and, for FP8, the quantiser: one kernel when compiled."""
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * ln
    return quant(h, sx)


def gemm(h: torch.Tensor, w: torch.Tensor, sw: torch.Tensor | None, sx: torch.Tensor | None) -> torch.Tensor:
    if sw is None:
        return F.linear(h, w)
    return torch._scaled_mm(h, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.float16)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def write_cache(cache: torch.Tensor, val: torch.Tensor, scale: torch.Tensor | None, pos: torch.Tensor) -> None:
    """val [B, KVH, D] into cache [B, KVH, T, D] at ``pos``; an FP8 cache is stored as uint8 bits."""
    if scale is None:
        cache.index_copy_(2, pos, val.unsqueeze(2))
        return
    q8 = (val.float() / scale[None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    cache.index_copy_(2, pos, q8.view(torch.uint8).unsqueeze(2))


def read_cache(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return cache
    return cache.view(FP8).float() * scale[None, :, None, None]


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor | None, vs: torch.Tensor | None,
           pos: torch.Tensor, key_pos: torch.Tensor, form: str) -> torch.Tensor:
    """One query token per sequence, GQA over the whole static cache with positions > pos masked out.

    q [B, H, D]; kc, vc [B, KVH, T, D] -> [B, H*D]."""
    b, nh, d = q.shape
    kvh = kc.shape[1]
    qg = q.view(b, kvh, nh // kvh, d)
    k, v = read_cache(kc, ks), read_cache(vc, vs)
    if form == "bmm":
        scores = torch.matmul(qg, k.to(q.dtype).transpose(-1, -2)).float()
    else:
        scores = (qg.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1)
    scores = (scores * (1.0 / math.sqrt(d))).masked_fill(key_pos > pos, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if form == "bmm":
        out = torch.matmul(p.to(q.dtype), v.to(q.dtype))
    else:
        out = (p[..., None] * v.float()[:, :, None, :, :]).sum(-2)
    return out.to(q.dtype).reshape(b, nh * d)


def layer(x: torch.Tensor, h: torch.Tensor, p: dict[str, Any], kc: torch.Tensor, vc: torch.Tensor,
          ks: torch.Tensor | None, vs: torch.Tensor | None, pos: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, key_pos: torch.Tensor, next_ln: torch.Tensor, next_sx: torch.Tensor | None,
          form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One Llama layer for one new token. x [B, hidden] residual stream, h = this layer's normed (and
    quantised) qkv input. Returns (x, the next layer's normed/quantised input)."""
    b = x.shape[0]
    kvh, d = kc.shape[1], kc.shape[3]
    qkv = gemm(h, p["qkv_w"], p["qkv_sw"], p["qkv_sx"])
    nh = qkv.shape[-1] // d - 2 * kvh
    q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(b, nh, d), k.view(b, kvh, d), v.view(b, kvh, d)
    c, s = cos[pos], sin[pos]  # [1, D]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    write_cache(kc, k, ks, pos)
    write_cache(vc, v, vs, pos)
    att = attend(q, kc, vc, ks, vs, pos, key_pos, form)
    x = x + gemm(quant(att, p["o_sx"]), p["o_w"], p["o_sw"], p["o_sx"])
    g, u = gemm(prep(x, p["ln2"], p["gu_sx"]), p["gu_w"], p["gu_sw"], p["gu_sx"]).chunk(2, dim=-1)
    x = x + gemm(quant(F.silu(g) * u, p["down_sx"]), p["down_w"], p["down_sw"], p["down_sx"])
    return x, prep(x, next_ln, next_sx)


def first(tokens: torch.Tensor, embed: torch.Tensor, ln: torch.Tensor,
          sx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = F.embedding(tokens, embed)
    return x, prep(x, ln, sx)


# -- weights ---------------------------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    fp8_linears: bool = False
    fp8_head: bool = False
    fp8_kv: bool = False
    compiled: bool = True
    form: str = "bmm"
    mode: str = "default"  # torch.compile mode of the layer function


@dataclass
class Model:
    """Weights and caches of one variant for one batch size."""

    layers: list[dict[str, Any]]
    embed: torch.Tensor
    final_ln: torch.Tensor
    head: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    kc: list[torch.Tensor]
    vc: list[torch.Tensor]
    ks: list[torch.Tensor | None]
    vs: list[torch.Tensor | None]
    cos: torch.Tensor
    sin: torch.Tensor
    key_pos: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)


def act_scale(amax: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([max(amax, 1e-8) / E4M3_MAX], dtype=torch.float32, device=device)


def fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_weight(w, "tensor")


@torch.no_grad()
def calibrate_step(dec: StaticDecoder, batch: int, prompt_len: int, device: str) -> dict[str, float]:
    """Input absmax of every linear over a prefill and two decode steps (StaticDecoder, FP16)."""
    amax: dict[str, float] = {}
    handles = []
    for name, mod in dec.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def hook(_m: Any, inp: tuple[torch.Tensor, ...], name: str = name) -> None:
                amax[name] = max(amax.get(name, 0.0), float(inp[0].abs().amax().float()))
            handles.append(mod.register_forward_pre_hook(hook))
    gen = torch.Generator(device=device).manual_seed(2)
    try:
        ids = torch.randint(0, dec.s.vocab, (batch, prompt_len), device=device, generator=gen)
        logits = dec(ids, torch.arange(prompt_len, device=device))
        tok = logits[:, -1:].argmax(-1)
        for i in range(2):
            tok = dec(tok, torch.tensor([prompt_len + i], device=device))[:, -1:].argmax(-1)
    finally:
        for h in handles:
            h.remove()
    return amax


def build_model(dec: StaticDecoder, var: Variant, batch: int, amax: dict[str, float],
                cache16: tuple[torch.Tensor, torch.Tensor], kv_amax: tuple[torch.Tensor, torch.Tensor],
                fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Model:
    """Functional view of ``dec`` for one variant; caches are copies of the prefilled FP16 cache rows."""
    dev = dec.embed.weight.device
    layers = []
    for i, blk in enumerate(dec.blocks):
        p: dict[str, Any] = {"ln2": blk.ln2}
        for key, lin in (("qkv", blk.qkv), ("o", blk.o), ("gu", blk.gate_up), ("down", blk.down)):
            name = {"qkv": "qkv", "o": "o", "gu": "gate_up", "down": "down"}[key]
            if var.fp8_linears:
                w8, sw = fp8_weights[f"blocks.{i}.{name}"]
                p.update({f"{key}_w": w8, f"{key}_sw": sw, f"{key}_sx": act_scale(amax[f"blocks.{i}.{name}"], dev)})
            else:
                p.update({f"{key}_w": lin.weight, f"{key}_sw": None, f"{key}_sx": None})
        p["ln1"] = blk.ln1
        layers.append(p)
    if var.fp8_head:
        w8, sw = fp8_weights["lm_head"]
        head = (w8, sw, act_scale(amax["lm_head"], dev))
    else:
        head = (dec.lm_head.weight, None, None)
    kc16, vc16 = cache16
    kc, vc, ks, vs = [], [], [], []
    for i in range(len(dec.blocks)):
        if var.fp8_kv:
            k_s = (kv_amax[0][i] / E4M3_MAX).float().clamp(min=1e-8)
            v_s = (kv_amax[1][i] / E4M3_MAX).float().clamp(min=1e-8)
            kc.append((kc16[i, :batch].float() / k_s[None, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX)
                      .to(FP8).view(torch.uint8).contiguous())
            vc.append((vc16[i, :batch].float() / v_s[None, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX)
                      .to(FP8).view(torch.uint8).contiguous())
            ks.append(k_s.contiguous())
            vs.append(v_s.contiguous())
        else:
            kc.append(kc16[i, :batch].clone())
            vc.append(vc16[i, :batch].clone())
            ks.append(None)
            vs.append(None)
    return Model(layers, dec.embed.weight, dec.norm, head, kc, vc, ks, vs, dec.cos, dec.sin, dec.key_pos)


def _compile(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    if mode == "default":
        return torch.compile(fn, dynamic=False, fullgraph=True)
    return torch.compile(fn, mode=mode, dynamic=False, fullgraph=True)


class Runner:
    """The decode step of one Model: eager functions or compiled ones; tokens/pos advance in place."""

    def __init__(self, m: Model, var: Variant, tokens: torch.Tensor, pos: torch.Tensor,
                 compiled: dict[str, Callable[..., Any]]) -> None:
        self.m, self.var, self.tokens, self.pos = m, var, tokens, pos
        lay = functools.partial(layer, form=var.form)
        self.layer_fn = compiled.setdefault(f"layer/{var.form}/{var.mode}", _compile(lay, var.mode)) \
            if var.compiled else lay
        self.first_fn = compiled.setdefault("first", _compile(first, "default")) if var.compiled else first

    def layer0_update(self) -> torch.Tensor:
        """What layer 0 adds to the residual stream (one layer: no amplification through depth)."""
        m = self.m
        x, h = self.first_fn(self.tokens, m.embed, m.layers[0]["ln1"], m.layers[0]["qkv_sx"])
        nxt = m.layers[1] if len(m.layers) > 1 else {"ln1": m.final_ln, "qkv_sx": m.head[2]}
        out, _ = self.layer_fn(x, h, m.layers[0], m.kc[0], m.vc[0], m.ks[0], m.vs[0], self.pos, m.cos, m.sin,
                               m.key_pos, nxt["ln1"], nxt["qkv_sx"])
        return (out - x).float()

    def logits(self) -> torch.Tensor:
        m = self.m
        x, h = self.first_fn(self.tokens, m.embed, m.layers[0]["ln1"], m.layers[0]["qkv_sx"])
        n = len(m.layers)
        for i, p in enumerate(m.layers):
            nxt_ln, nxt_sx = (m.layers[i + 1]["ln1"], m.layers[i + 1]["qkv_sx"]) if i + 1 < n else (m.final_ln,
                                                                                                    m.head[2])
            x, h = self.layer_fn(x, h, p, m.kc[i], m.vc[i], m.ks[i], m.vs[i], self.pos, m.cos, m.sin, m.key_pos,
                                 nxt_ln, nxt_sx)
        return gemm(h, *m.head)

    def step(self) -> None:
        out = self.logits()
        self.tokens.copy_(out.argmax(-1))
        self.pos.add_(1)


# -- timing ----------------------------------------------------------------------------------------
def time_fn(fn: Callable[[], Any], device: str, reset: Callable[[], None], reps: int = 40,
            rounds: int = 3, spread: list[float] | None = None) -> float:
    """Median ms per call: CUDA graph replays timed with events (GPU); plain calls on CPU.
    ``spread`` receives every round's ms."""
    if device != "cuda":
        reset()
        fn()
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1000
        if spread is not None:
            spread.append(ms)
        return ms
    reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(rounds):
        reset()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    if spread is not None:
        spread.extend(times)
    return statistics.median(times)


# -- the benchmark ---------------------------------------------------------------------------------
def run(device: str, shape: Shape, batches: list[int], prompt_len: int, steps: int, reps: int,
        autotune: bool) -> None:
    dtype = torch.float16  # on CPU too: the smoke run takes the GPU's code paths
    cache_len = prompt_len + steps
    say(f"## Decode step, Llama shape {shape.params() / 1e9:.2f}B params (hidden {shape.hidden}, {shape.layers} "
        f"layers, inter {shape.inter}, vocab {shape.vocab}, {shape.heads}/{shape.kv_heads} heads), random weights; "
        f"prompt {prompt_len} prefilled, KV cache sized to prompt + {steps} generated = {cache_len} positions")
    t0 = time.perf_counter()
    max_b = max(batches)
    torch.manual_seed(0)
    dec = StaticDecoder(shape, max_b, cache_len, device, dtype)
    with torch.no_grad():
        for prm in dec.parameters():
            if prm.dim() == 2:
                prm.normal_(0.0, 0.02)
    amax = calibrate_step(dec, max_b, prompt_len, device)  # prefill fills dec's FP16 cache rows 0..prompt+1
    fp8_weights = {name: fp8_weight(mod.weight) for name, mod in dec.named_modules()
                   if isinstance(mod, torch.nn.Linear)}
    cache16 = (dec.k_cache, dec.v_cache)
    kv_amax = (dec.k_cache[:, :, :, :prompt_len].abs().amax(dim=(1, 3, 4)).float(),
               dec.v_cache[:, :, :, :prompt_len].abs().amax(dim=(1, 3, 4)).float())  # [L, KVH]
    if device == "cuda":
        torch.cuda.synchronize()
    say(f"built, prefilled (batch {max_b}) and calibrated in {time.perf_counter() - t0:.1f} s")
    accuracy(dec, amax, fp8_weights, cache16, kv_amax, prompt_len, device)

    compiled: dict[str, Callable[..., Any]] = {}
    rows: list[tuple[int, str, float, dict[str, float]]] = []
    for b in batches:
        tokens = torch.randint(0, shape.vocab, (b,), device=device)
        pos = torch.tensor([prompt_len], device=device)
        start_tokens = tokens.clone()

        def reset(pos: torch.Tensor = pos, tokens: torch.Tensor = tokens, start: torch.Tensor = start_tokens) -> None:
            pos.fill_(prompt_len)
            tokens.copy_(start)

        # attention alone (32 layers) on FP16 KV, both forms; the faster one is used for every row
        base16 = build_model(dec, Variant("fp16"), b, amax, cache16, kv_amax, fp8_weights)
        attn_ms: dict[str, float] = {}
        q = torch.randn(b, shape.heads, shape.head_dim, device=device, dtype=dtype)
        for form, model in (("bmm", base16), ("reduce", base16)):
            attn_ms[form] = time_attention(model, q, pos, form, compiled, device, reset, reps)
        form16 = min(attn_ms, key=attn_ms.__getitem__)
        if autotune:
            try:
                attn_ms["bmm, max-autotune"] = time_attention(base16, q, pos, "bmm", compiled, device, reset, reps,
                                                              mode=AUTOTUNE)
            except Exception as exc:
                say(f"attention with max-autotune failed: {type(exc).__name__}: {exc}")
        kv8 = build_model(dec, Variant("kv8", fp8_kv=True), b, amax, cache16, kv_amax, fp8_weights)
        attn_ms["reduce, fp8 KV"] = time_attention(kv8, q, pos, "reduce", compiled, device, reset, reps)
        del kv8
        say(f"batch {b}: attention alone, 32 layers, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in attn_ms.items())
            + f" -> FP16-KV rows use '{form16}'")
        variants = [Variant("fp16, not compiled", compiled=False, form=form16),
                    Variant("fp8, not compiled", fp8_linears=True, compiled=False, form=form16),
                    Variant("fp16", form=form16),
                    Variant("fp8 linears", fp8_linears=True, form=form16),
                    Variant("fp8 linears + lm_head", fp8_linears=True, fp8_head=True, form=form16),
                    Variant("fp8 linears + lm_head + fp8 KV", fp8_linears=True, fp8_head=True, fp8_kv=True,
                            form="reduce")]
        if autotune:  # last: the slowest to compile; a run cut short keeps the rows above
            variants += [Variant("fp16, max-autotune", form=form16, mode=AUTOTUNE),
                         Variant("fp8 linears + lm_head, max-autotune", fp8_linears=True, fp8_head=True,
                                 form=form16, mode=AUTOTUNE)]
        for var in variants:
            t0 = time.perf_counter()
            try:
                model = build_model(dec, var, b, amax, cache16, kv_amax, fp8_weights)
                runner = Runner(model, var, tokens, pos, compiled)
                check = ""
                with torch.no_grad():
                    if var.compiled:  # same state, same inputs: the compiled step must match the eager one
                        eager = Runner(model, replace(var, compiled=False), tokens, pos, {})
                        reset()
                        got1, got = runner.layer0_update(), runner.logits().float()
                        reset()
                        want1, want = eager.layer0_update(), eager.logits().float()
                        check = (f" | compiled vs eager rel err: layer-0 update {rel_err(got1, want1):.1e}, "
                                 f"logits {rel_err(got, want):.1e}")
                    rounds: list[float] = []
                    step_ms = time_fn(runner.step, device, reset, reps, spread=rounds)
                    if var.compiled:
                        attn = attn_ms["reduce, fp8 KV"] if var.fp8_kv else attn_ms[form16]
                        if var.mode != "default":
                            attn = time_attention(model, q, pos, var.form, compiled, device, reset, reps, var.mode)
                    else:
                        attn = time_attention(model, q, pos, var.form, None, device, reset, reps)
                    parts = components(model, b, dtype, device, reset, reps, attn)
                parts["other"] = step_ms - sum(parts.values())
                rows.append((b, var.name, step_ms, parts))
                say(f"batch {b} | {var.name} | step {step_ms:.3f} ms (rounds {min(rounds):.3f}-{max(rounds):.3f}) | "
                    f"{b / step_ms * 1000:,.0f} tok/s | "
                    + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
                    + check + f" | {time.perf_counter() - t0:.0f} s incl. compile")
                del model, runner
            except Exception:
                say(f"batch {b} | {var.name} FAILED:\n{traceback.format_exc()}")
            if device == "cuda":
                torch.cuda.empty_cache()
    table(rows)


def time_attention(m: Model, q: torch.Tensor, pos: torch.Tensor, form: str,
                   compiled: dict[str, Callable[..., Any]] | None, device: str, reset: Callable[[], None],
                   reps: int, mode: str = "default") -> float:
    """ms of attention alone over all layers' caches; ``compiled`` None runs the eager function."""
    fn: Callable[..., Any] = functools.partial(attend, form=form)
    if compiled is not None:
        fn = compiled.setdefault(f"attend/{form}/{mode}", _compile(fn, mode))

    def all_layers() -> None:
        for i in range(len(m.kc)):
            fn(q, m.kc[i], m.vc[i], m.ks[i], m.vs[i], pos, m.key_pos)

    with torch.no_grad():
        return time_fn(all_layers, device, reset, reps)


def components(m: Model, b: int, dtype: torch.dtype, device: str, reset: Callable[[], None],
               reps: int, attn: float) -> dict[str, float]:
    """ms of the layer GEMMs alone (inputs already quantised), the lm_head GEMM + argmax, and attention."""
    def inp(w: torch.Tensor, sw: torch.Tensor | None) -> torch.Tensor:
        x = torch.randn(b, w.shape[1], device=device, dtype=dtype)
        return x if sw is None else x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)

    args = [(inp(p[f"{k}_w"], p[f"{k}_sw"]), p[f"{k}_w"], p[f"{k}_sw"], p[f"{k}_sx"])
            for p in m.layers for k in ("qkv", "o", "gu", "down")]
    head_x = inp(m.head[0], m.head[1])

    def gemms() -> None:
        for a in args:
            gemm(*a)

    def head() -> None:
        gemm(head_x, *m.head).argmax(-1)

    return {"layer GEMMs": time_fn(gemms, device, reset, reps), "attention": attn,
            "lm_head+argmax": time_fn(head, device, reset, reps)}


def table(rows: list[tuple[int, str, float, dict[str, float]]]) -> None:
    say("")
    say("| batch | variant | ms/step | tok/s | vs fp16 (same batch, same compile) | layer GEMMs ms | attention ms "
        "| lm_head+argmax ms | other ms (norms, rotary, residual, quant, SiLU, cache write) |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {(b, name): ms for b, name, ms, _ in rows if name.startswith("fp16")}
    for b, name, ms, parts in rows:
        key = "fp16, not compiled" if "not compiled" in name else "fp16, max-autotune" if "autotune" in name else "fp16"
        ref = base.get((b, key))
        ratio = f"{ref / ms:.2f}x" if ref else "n/a"
        say(f"| {b} | {name} | {ms:.3f} | {b / ms * 1000:,.0f} | {ratio} | {parts['layer GEMMs']:.3f} | "
            f"{parts['attention']:.3f} | {parts['lm_head+argmax']:.3f} | {parts['other']:.3f} |")


@torch.no_grad()
def accuracy(dec: StaticDecoder, amax: dict[str, float], fp8_weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
             cache16: tuple[torch.Tensor, torch.Tensor], kv_amax: tuple[torch.Tensor, torch.Tensor],
             prompt_len: int, device: str) -> None:
    """Eager functional step vs StaticDecoder (FP16); each FP8 variant's logits vs the FP16 step's."""
    b = 4
    tokens = torch.randint(0, dec.s.vocab, (b,), device=device)
    out: dict[str, torch.Tensor] = {}
    upd: dict[str, torch.Tensor] = {}
    for var in (Variant("fp16", compiled=False), Variant("fp16 reduce", compiled=False, form="reduce"),
                Variant("fp8", fp8_linears=True, compiled=False),
                Variant("fp8+head", fp8_linears=True, fp8_head=True, compiled=False),
                Variant("fp8+head+kv", fp8_linears=True, fp8_head=True, fp8_kv=True, compiled=False,
                        form="reduce")):
        m = build_model(dec, var, b, amax, cache16, kv_amax, fp8_weights)
        pos = torch.tensor([prompt_len], device=device)
        runner = Runner(m, var, tokens.clone(), pos, {})
        upd[var.name] = runner.layer0_update()
        out[var.name] = runner.logits().float()
        del m
    # reference: the checked StaticDecoder on a copy of its cache rows (its forward writes the cache)
    saved = (dec.k_cache[:, :b].clone(), dec.v_cache[:, :b].clone())
    ref = _sliced(dec, b)(tokens[:, None], torch.tensor([prompt_len], device=device))[:, -1]
    dec.k_cache[:, :b].copy_(saved[0])
    dec.v_cache[:, :b].copy_(saved[1])
    ref = ref.float()
    say(f"functional decode step vs StaticDecoder (itself checked against transformers): rel err of logits "
        f"{rel_err(out['fp16'], ref):.2e} (bmm attention), {rel_err(out['fp16 reduce'], ref):.2e} (reduce)")
    say("one layer (layer 0's update of the residual stream) vs fp16: " + ", ".join(
        f"{k} {rel_err(v, upd['fp16']):.4f}" for k, v in upd.items() if k != "fp16")
        + "  (random weights amplify any perturbation through 32 layers; compare one layer)")
    top = ref.argmax(-1)
    say("logits vs fp16 (rel err / same greedy token of " + str(b) + "): " + ", ".join(
        f"{k} {rel_err(v, ref):.4f} / {int((v.argmax(-1) == top).sum())}"
        for k, v in out.items() if k.startswith("fp8")))
    # lm_head alone: GEMM error vs a float64 reference on the final hidden states' scale
    w = dec.lm_head.weight
    x = torch.randn(16, w.shape[1], device=device, dtype=w.dtype)
    ref64 = x.double() @ w.double().t()
    w8, sw = fp8_weights["lm_head"]
    sx = act_scale(float(x.abs().amax()), x.device)
    say(f"lm_head GEMM rel err vs float64: fp16 {rel_err(F.linear(x, w), ref64):.2e}, "
        f"fp8 {rel_err(gemm(quant(x, sx), w8, sw, sx), ref64):.4f}")


@torch.no_grad()
def numerics_check() -> None:
    """CPU: why compiled FP8 differs from eager FP8. Inductor keeps fused intermediates in float32
    (``emulate_precision_casts`` off), so a value eager rounds to fp16 before the e4m3 cast can land
    on the other side of an e4m3 rounding boundary. With the casts emulated the two must be identical."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    s, prompt, b = Shape(1024, 3584, 2, 16, 4, 1024), 64, 4
    dec = StaticDecoder(s, b, prompt + 16, "cpu", torch.float16)
    for prm in dec.parameters():
        if prm.dim() == 2:
            prm.normal_(0.0, 0.02)
    amax = calibrate_step(dec, b, prompt, "cpu")
    w8 = {n: fp8_weight(m.weight) for n, m in dec.named_modules() if isinstance(m, torch.nn.Linear)}
    kv = (dec.k_cache[:, :, :, :prompt].abs().amax(dim=(1, 3, 4)).float(),
          dec.v_cache[:, :, :, :prompt].abs().amax(dim=(1, 3, 4)).float())
    tokens = torch.randint(0, s.vocab, (b,))
    for emulate in (False, True):
        inductor_config.emulate_precision_casts = emulate
        torch._dynamo.reset()
        upd = {}
        for var in (Variant("fp16"), Variant("fp8", fp8_linears=True)):
            m = build_model(dec, var, b, amax, (dec.k_cache, dec.v_cache), kv, w8)
            for comp in (False, True):
                runner = Runner(m, replace(var, compiled=comp), tokens.clone(), torch.tensor([prompt]), {})
                upd[(var.name, comp)] = runner.layer0_update()
        say(f"emulate_precision_casts={emulate}: layer-0 update rel err, compiled vs eager: fp16 "
            f"{rel_err(upd[('fp16', True)], upd[('fp16', False)]):.1e}, fp8 "
            f"{rel_err(upd[('fp8', True)], upd[('fp8', False)]):.1e}; fp8 vs fp16: eager "
            f"{rel_err(upd[('fp8', False)], upd[('fp16', False)]):.4f}, compiled "
            f"{rel_err(upd[('fp8', True)], upd[('fp16', True)]):.4f}")


def _sliced(dec: StaticDecoder, b: int) -> StaticDecoder:
    import copy

    sub = copy.copy(dec)
    sub._buffers = dict(dec._buffers)
    sub._buffers["k_cache"] = dec.k_cache[:, :b]
    sub._buffers["v_cache"] = dec.v_cache[:, :b]
    return sub


def main(argv: list[str] | None = None) -> int:
    global OUT_PATH  # noqa: PLW0603
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (checks every code path)")
    ap.add_argument("--out", default=None, help="also write the report here (updated line by line)")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--no-autotune", action="store_true", help="skip the max-autotune-no-cudagraphs rows")
    ap.add_argument("--numerics", action="store_true", help="only the CPU compiled-vs-eager FP8 rounding check")
    args = ap.parse_args(argv)
    OUT_PATH = Path(args.out) if args.out else None
    for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 256)
    start = time.perf_counter()
    if args.numerics:
        numerics_check()
        return 0
    if args.smoke:
        device, shape, batches, prompt, steps, reps = "cpu", Shape(128, 256, 2, 4, 2, 512), [2, 4], 16, 16, 2
    else:
        device, shape, prompt, steps, reps = "cuda", Shape(4096, 14336, 32, 32, 8, 128256), args.prompt, args.steps, 40
        batches = [int(b) for b in args.batches.split(",")]
    say(f"# FP8 vs FP16 decode, fused step, on {torch.cuda.get_device_name() if device == 'cuda' else 'CPU (smoke)'}")
    say(f"torch {torch.__version__}; torch.compile (inductor, default mode, static shapes) per layer; "
        f"whole step in one CUDA graph" if device == "cuda" else f"torch {torch.__version__}; CPU: no graphs")
    try:
        run(device, shape, batches, prompt, steps, reps, not args.no_autotune)
    except Exception:
        say(f"FAILED:\n{traceback.format_exc()}")
        return 1
    finally:
        say(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
