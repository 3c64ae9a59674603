"""Fast greedy decoding for Llama-shaped Hugging Face models (the torch engine's GPU path).

* Prefill: the whole prompt through ``probes.engines.fast_forward.forward_layer`` (the same
  numerics as the model's eager forward, compiled with dynamic batch and length on CUDA); FP8 layers
  count saturation here. ``hidden()`` is the same pass for teacher-forced scoring. ``own_forward =
  False`` uses the model's own transformers forward instead (kept for A/B measurement).
* The K/V are copied into a STATIC cache ``[B, kv_heads, T, head_dim]`` per layer; B and T are
  rounded up to buckets so a handful of shapes cover every batch.
* Decode attention reads only the live part of the cache: keys ``[0, live)``, ``live`` the current
  position rounded up to ``live_window`` (128), so the attended length grows with the step instead
  of always being T. Each (bucket, live) has its own compiled shape and CUDA graph.
* Decode: one Llama layer as a pure function of tensors (``decode_layer``), compiled once with
  ``torch.compile`` (static shapes) and called for every layer; the step (all layers, final norm,
  lm_head, log-softmax, greedy pick, per-row EOS flags, history write, position advance) is captured
  in ONE CUDA graph and replayed. FP8 linears use their static calibrated per-tensor activation
  scale; the divide/clamp/cast is fused by inductor into the preceding norm or SiLU*up kernel, and
  the product runs through ``torch._scaled_mm``. FP16 gets the same compile and graph.
* Prefill and scoring passes of at most ``PASS_GRAPH_MAX_ROWS`` positions are captured as CUDA graphs
  the second time their exact shape comes (``_pass``) and replayed after: at batch 16 those passes are
  bound by the host (the FP8 prefill launched ~960 kernels for ~30 ms of GPU work in ~48 ms of wall on
  an H100, docs/BENCHMARKS.md). A resident engine replaying the same golden set meets the same shapes
  every time; a one-off replay sees each shape once and captures nothing. The graphs share one memory
  pool per decoder (their outputs are read before the next pass runs), counted in ``cache_bytes``.
* FP8 prefill/scoring passes of at least ``FUSED_MIN_ROWS`` positions (every pass since 2026-12-07) quantise each linear's input and
  count its saturation in one kernel with the norm, residual add or SiLU*up before it
  (``probes.fp8_fused``; CUDA with Triton, layers with merged q/k/v and gate/up scales).
* Opt-in: ``set_options(kv_cache="fp8")`` keeps the cache in e4m3 with per-head scales and
  ``attention="triton"`` attends through ``probes.decode_attention`` (a GQA flash-decoding kernel).
* Stopping per row: EOS (flag computed in the graph), ``max_new_tokens``, and stop strings (checked
  on the host every ``check_every`` steps); the loop ends when every row is done.

Without CUDA (CI) the same functions run eagerly, no compile and no graph: their greedy tokens equal
the eager transformers path (tests/test_engines_torch.py). FP8 layers with per-row weight scales or
the CPU emulation use ``Fp8Linear``'s own product code inside the step.

Not covered (the engine falls back to its eager loop): non-Llama architectures, biases, rope scaling,
activations other than SiLU, dynamic FP8 activation scales.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from probes.decode_attention import FP8_KV, FP8_KV_STORE, decode_attention, quant_kv, store_prompt_kv
from probes.engines import fast_forward
from probes.engines.fast_forward import clipped, forward_layer, fused_here, sequence_inputs
from probes.engines.fast_layers import (
    COUNT_INPUT,
    lin_params,
    linear,
    merge_linears,
    picked_logprobs,
    projections,
    rms_norm,
    rotate_half,
)
from probes.fp8 import Fp8Linear, bind_counters

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral")
#: cache length is rounded up to a multiple of this (fewer compiled shapes and graphs)
T_BUCKET = 128
#: at most this many (batch, length) buckets keep their caches and graphs
MAX_BUCKETS = 3
#: prefill/scoring passes of at least this many positions (batch x width) quantise through
#: ``probes.fp8_fused``: faster on the H200 at batch 64 and 128 (~25k and ~51k positions, BENCHMARKS.md
#: sixth pass); at batch 16 (~5-6k positions) no faster while the pass was bound by the host (16,384 until
#: 2026-12-07), faster once the pass is a CUDA graph (0.621-0.622 -> 0.615-0.619 on an H100): every pass
FUSED_MIN_ROWS = 0
#: decode attends over the cache up to the current position rounded up to a multiple of this
LIVE_WINDOW = 128
#: prefill/scoring passes of at most this many positions (batch x width) are captured as CUDA graphs once
#: their shape repeats: below it the passes are bound by kernel launches, above it by the GPU (and a
#: graph's memory pool would hold the larger pass's activations and logits)
PASS_GRAPH_MAX_ROWS = 16384
#: captured passes kept per cache bucket (prefill) and per decoder (scoring), least recently used dropped
MAX_PASS_GRAPHS = 16
#: pass shapes remembered as seen once (the second sighting captures)
MAX_PASS_SEEN = 256


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot use the fast path (None when it can)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} is not silu"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return f"rope type {rope.get('rope_type')!r} is not supported"
    if getattr(cfg, "sliding_window", None):
        return "sliding-window attention is not supported"
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear):
            if mod.activation_mode != "static":
                return f"{name}: dynamic FP8 activation scales"
            if mod.bias is not None:
                return f"{name}: bias"
        elif isinstance(mod, nn.Linear) and mod.bias is not None:
            return f"{name}: bias"
    return None


def _rope_theta(cfg: Any) -> float:
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return float(rope["rope_theta"])
    return float(getattr(cfg, "rope_theta", 10000.0))


# -- the decode step as pure functions (what torch.compile traces) ---------------------------------
def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kmask: torch.Tensor) -> torch.Tensor:
    """Attention of one new query per row over the live part of the static cache: q [B, NH, D],
    kc/vc [B, KVH, T, D], kmask [B, live] (keys past ``live`` are not read). Through ``scaled_dot_product_attention`` like the eager transformers path (scores
    kept in float32 inside the kernel; rounding them to fp16 first flipped near-tied greedy picks)."""
    b, nh, d = q.shape
    live = kmask.shape[1]
    kc, vc = kc[:, :, :live], vc[:, :, :live]
    out = F.scaled_dot_product_attention(q[:, :, None, :], kc, vc, attn_mask=kmask[:, None, None, :],
                                         enable_gqa=nh != kc.shape[1])
    return out.reshape(b, nh * d)


def attend_gqa(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kmask: torch.Tensor) -> torch.Tensor:
    """``attend`` written as reductions inductor fuses: each K/V head read once for its ``rep`` query
    heads (no K/V repeated per head), the key mask applied in the softmax (no mask tensor for a kernel),
    scores, softmax and the weighted sum of V in float32."""
    b, nh, d = q.shape
    kvh, live = kc.shape[1], kmask.shape[1]
    k, v = kc[:, :, :live].float(), vc[:, :, :live].float()
    qg = q.view(b, kvh, nh // kvh, 1, d).float() * (d ** -0.5)
    s = (qg * k[:, :, None]).sum(-1)  # [B, KVH, rep, live]
    s = s.masked_fill(~kmask[:, None, None, :], float("-inf")).softmax(-1)
    out = (s[..., None] * v[:, :, None]).sum(-2)  # [B, KVH, rep, D]
    return out.to(q.dtype).reshape(b, nh * d)


def decode_layer(x: torch.Tensor, p: dict[str, Any], kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, kmask: torch.Tensor, eps: float,
                 pad: torch.Tensor | None = None, ks: torch.Tensor | None = None,
                 vs: torch.Tensor | None = None) -> torch.Tensor:
    """One Llama layer for one new token per row. x [B, hidden]; kc, vc [B, KVH, T, D] (written at
    ``slot``); cos, sin [B, D] of each row's position; kmask [B, live] keys each row may attend.
    An FP8 cache (e4m3 bits in uint8, per-head scales ``ks``/``vs`` [KVH]) or ``p["attention"] ==
    "triton"`` attends through ``probes.decode_attention`` (keys [pad[b], slot] of each row)."""
    b = x.shape[0]
    kvh, d = kc.shape[1], kc.shape[3]
    h = rms_norm(x, p["ln1"], eps)
    q, k, v = projections(h, p, "qkv", ("q", "k", "v"))
    q, k, v = q.view(b, -1, d), k.view(b, kvh, d), v.view(b, kvh, d)
    c, s = cos[:, None, :], sin[:, None, :]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    fp8_kv = kc.dtype == FP8_KV_STORE
    if fp8_kv:
        assert ks is not None and vs is not None
        kc.index_copy_(2, slot, quant_kv(k, ks).unsqueeze(2))
        vc.index_copy_(2, slot, quant_kv(v, vs).unsqueeze(2))
    else:
        kc.index_copy_(2, slot, k.unsqueeze(2))
        vc.index_copy_(2, slot, v.unsqueeze(2))
    if fp8_kv or p.get("attention") == "triton":
        assert pad is not None
        one = slot.new_ones(1, dtype=torch.float32)
        a = decode_attention(q, kc, vc, one if ks is None else ks, one if vs is None else vs, slot, pad,
                             kmask.shape[1])
    elif p.get("attention") == "gqa":
        a = attend_gqa(q, kc, vc, kmask)
    else:
        a = attend(q, kc, vc, kmask)
    x = x + linear(a, p["o"])
    h = rms_norm(x, p["ln2"], eps)
    gate, up = projections(h, p, "gu", ("gate", "up"))
    return x + linear(F.silu(gate) * up, p["down"])


def decode_head(x: torch.Tensor, ln: torch.Tensor, head: dict[str, Any],
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm, lm_head, greedy token and its log-probability."""
    lp = torch.log_softmax(linear(rms_norm(x, ln, eps), head).float(), dim=-1)
    tok = lp.argmax(dim=-1)
    return tok, lp.gather(1, tok[:, None])[:, 0]


def step_inputs(slot: torch.Tensor, pad: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor,
                key_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's rotary cos/sin at its position (slot - left pad) and its key mask [B, len(key_idx)]."""
    pos = slot - pad
    kmask = (key_idx[None, :] >= pad[:, None]) & (key_idx[None, :] <= slot)
    return cos_t[pos], sin_t[pos], kmask


@dataclass
class _PassGraph:
    """A captured prefill or scoring pass: its static inputs and the outputs each replay rewrites."""

    graph: Any
    ids: torch.Tensor
    mask: torch.Tensor
    outputs: tuple[torch.Tensor, ...]


@dataclass
class _Bucket:
    """Static tensors (and the captured graph) of one (batch, cache length) shape."""

    b: int
    t: int
    kc: list[torch.Tensor]
    vc: list[torch.Tensor]
    tokens: torch.Tensor
    slot: torch.Tensor
    pad: torch.Tensor
    step_i: torch.Tensor
    hist_tok: torch.Tensor
    hist_lp: torch.Tensor
    done: torch.Tensor
    graphs: dict[int, Any] = field(default_factory=dict)  # live length -> captured step
    eos: torch.Tensor | None = None
    #: per layer, the FP8 cache's per-head K and V scales [KVH] float32 (empty lists: fp16 cache)
    ks: list[torch.Tensor] = field(default_factory=list)
    vs: list[torch.Tensor] = field(default_factory=list)
    #: captured prefill passes that write this bucket's cache (they go with it)
    passes: OrderedDict[Any, _PassGraph] = field(default_factory=OrderedDict)

    def store_kv(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``i``'s prompt K/V [B, KVH, L, D] into positions [0, L) of the cache; an FP8 cache
        takes its per-head scales from them first (``probes.decode_attention.store_prompt_kv``)."""
        n = k.shape[2]
        if self.kc[i].dtype == FP8_KV_STORE:
            store_prompt_kv(k, v, self.kc[i], self.vc[i], self.ks[i], self.vs[i])
            return
        self.kc[i][:, :, :n].copy_(k)
        self.vc[i][:, :, :n].copy_(v)


class FastDecoder:
    """Greedy decoding of a Llama-shaped HF model (fp16/bf16/fp32 or with ``Fp8Linear`` layers)."""

    def __init__(self, model: nn.Module, *, compile: bool | str | None = None, cuda_graphs: bool | None = None,
                 check_every: int = 8, max_batch: int = 16, merge: bool = True) -> None:
        """``compile``: None (on CUDA: everything), True, False, or "decode" - the decode step only, the
        prefill and scoring passes eager. Their trace has dynamic shapes and costs seconds per process
        (FP8 more than FP16), which a one-off replay of a few batches never earns back; the decode
        step's trace is one small static-shape function, reused for every step."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fast decode not supported: {reason}")
        self.model = model
        cfg = model.config  # type: ignore[attr-defined]
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        on_cuda = self.device.type == "cuda"
        if compile not in (None, True, False, "decode"):
            raise ValueError(f"compile must be true, false or decode, not {compile!r}")
        self.compile = on_cuda if compile is None else bool(compile)
        #: the prefill and scoring passes compiled too (not with compile="decode")
        self.compile_passes = self.compile and compile != "decode"
        self.cuda_graphs = on_cuda if cuda_graphs is None else (bool(cuda_graphs) and on_cuda)
        self.check_every = max(1, int(check_every))
        self.max_batch = max(1, int(max_batch))
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        inner = model.model  # type: ignore[attr-defined]
        self.embed = inner.embed_tokens.weight
        self.final_ln = inner.norm.weight
        self.layers: list[dict[str, Any]] = []
        #: per layer, groups of Fp8Linear modules sharing one saturation count (``p["counts"]`` order)
        self._sat_mods: list[list[list[Fp8Linear]]] = []
        for lay in inner.layers:
            a, m = lay.self_attn, lay.mlp
            qkv = merge_linears([a.q_proj, a.k_proj, a.v_proj]) if merge else None
            gu = merge_linears([m.gate_proj, m.up_proj]) if merge else None
            p = {"ln1": lay.input_layernorm.weight, "ln2": lay.post_attention_layernorm.weight,
                 "q": lin_params(a.q_proj), "k": lin_params(a.k_proj), "v": lin_params(a.v_proj), "o": lin_params(a.o_proj),
                 "gate": lin_params(m.gate_proj), "up": lin_params(m.up_proj), "down": lin_params(m.down_proj)}
            groups = {"q": [a.q_proj], "k": [a.k_proj], "v": [a.v_proj], "o": [a.o_proj], "gate": [m.gate_proj],
                      "up": [m.up_proj], "down": [m.down_proj]}
            if qkv is not None:
                p["qkv"] = qkv
                groups["qkv"] = [groups.pop(k)[0] for k in ("q", "k", "v")]
            if gu is not None:
                p["gu"] = gu
                groups["gu"] = [groups.pop(k)[0] for k in ("gate", "up")]
            # which input each saturation count reads, and through whose scale (see fast_forward.forward_layer)
            p["counts"] = tuple((COUNT_INPUT[k], k) for k in groups)
            # True: prefill/scoring quantise q/k/v's (gate/up's) input once; no gain measured on the H200
            p["share_quant"] = False
            # prefill/scoring quantise and count each FP8 input in one kernel with its norm, residual add
            # or SiLU*up (``probes.fp8_fused``; CUDA with Triton)
            p["fused_quant"] = fused_here(p, self.device)
            self.layers.append(p)
            mods = [x for g in groups.values() for x in g]
            if all(isinstance(x, Fp8Linear) and x.track_saturation for x in mods):
                self._sat_mods.append(list(groups.values()))
        self._bind_saturation()
        self.head = lin_params(model.lm_head)  # type: ignore[attr-defined]
        self._head_mod = _counted(model.lm_head)  # type: ignore[attr-defined]
        #: prefill and scoring through ``fast_forward`` (False: the model's transformers forward)
        self.own_forward = True
        #: decode attention over keys [0, position rounded up to this); 0: the whole cache bucket
        self.live_window = LIVE_WINDOW
        #: prefill and scoring count FP8 saturation (False: not counted; for measuring what counting costs)
        self.count_saturation = True
        #: decode K/V cache dtype: None = the activation dtype; ``FP8_KV`` = e4m3 with per-head scales
        #: (``set_options(kv_cache="fp8")``; decode attention then runs ``probes.decode_attention``)
        self.kv_dtype: torch.dtype | None = None
        #: decode's FP8 products: "cublas" (``_scaled_mm``) or "triton" (``probes.fp8_gemm``)
        self.gemm = "cublas"
        #: layers marked ``fused_quant`` take that path in passes of at least this many positions
        self.fused_min_rows = FUSED_MIN_ROWS
        #: ... on every this-many-th position of each sequence (1: every token; n > 1: an unbiased sample of
        #: the positions, measured on the H200 as no faster beyond noise, so not the default)
        self.saturation_stride = 1
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.theta = _rope_theta(cfg)
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._buckets: OrderedDict[tuple[int, int], _Bucket] = OrderedDict()
        self._layer_fn: Callable[..., Any] = decode_layer
        self._head_fn: Callable[..., Any] = decode_head
        self._inputs_fn: Callable[..., Any] = step_inputs
        self._forward_fn: Callable[..., Any] = forward_layer
        if self.compile:
            import torch._inductor.config as inductor_config

            # round fused intermediates to the activation dtype where eager does (RMSNorm output, the
            # SiLU*up product before FP8 quantisation): compiled and eager steps then agree to rounding
            inductor_config.emulate_precision_casts = True
            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, knob):
                    setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
            self._layer_fn = torch.compile(decode_layer, dynamic=False, fullgraph=True)
            self._head_fn = torch.compile(decode_head, dynamic=False, fullgraph=True)
            self._inputs_fn = torch.compile(step_inputs, dynamic=False, fullgraph=True)
        if self.compile_passes:
            # batch and length are marked dynamic per call (``hidden``): one compile serves every shape;
            # two graphs per layer, split around the (eager) attention
            self._forward_fn = torch.compile(forward_layer)
        self.warmup_seconds = 0.0  # compile + capture time spent so far (reported, not hidden)
        #: seconds in prefill / decode steps (each ends on a host read, so no extra syncs), steps run;
        #: prefill and scoring passes captured and replayed as graphs
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "steps": 0.0, "batches": 0.0,
                      "pass_captures": 0.0, "pass_replays": 0.0}
        #: passes of at most this many positions are graphed once their shape repeats (0: never; needs
        #: ``cuda_graphs``)
        self.pass_graph_max_rows = PASS_GRAPH_MAX_ROWS
        self._pass_graphs: OrderedDict[Any, _PassGraph] = OrderedDict()  # scoring passes
        self._pass_seen: OrderedDict[Any, None] = OrderedDict()
        self._pass_pool: Any = None
        #: bytes the captured passes' shared memory pool reserved (grown at each capture)
        self.pass_pool_bytes = 0
        self.cache_arg = "past_key_values"
        self._lock = threading.Lock()  # the static caches and graphs serve one batch at a time

    def set_options(self, *, share_quant: bool | None = None, attention: str | None = None,
                    kv_cache: str | None = None, gemm: str | None = None,
                    fused_quant: bool | None = None) -> None:
        """``share_quant``: prefill/scoring quantise q/k/v's (gate/up's) input once for their separate FP8
        GEMMs. ``attention``: decode attention "sdpa" (``attend``), "gqa" (``attend_gqa``) or "triton"
        (``probes.decode_attention``). ``kv_cache``: "fp8" (e4m3, per-head scales; attention through
        ``probes.decode_attention``) or "auto" (the activation dtype). ``gemm``: decode's FP8 products
        through "cublas" (``_scaled_mm``) or "triton" (``probes.fp8_gemm``, lm_head included when it is
        FP8). ``fused_quant``: prefill/scoring quantise FP8 inputs through ``probes.fp8_fused`` (where the
        layer is ``fusable`` and Triton runs). Captured step graphs are dropped (they hold the previous choice); a new cache dtype drops
        the buckets."""
        if gemm is not None:
            if gemm not in ("cublas", "triton"):
                raise ValueError(f"decode gemm must be cublas or triton, not {gemm!r}")
            self.gemm = gemm
        if attention is not None and attention not in ("sdpa", "gqa", "triton"):
            raise ValueError(f"decode attention must be sdpa, gqa or triton, not {attention!r}")
        if kv_cache is not None:
            if kv_cache not in ("fp8", "auto"):
                raise ValueError(f"kv_cache must be fp8 or auto, not {kv_cache!r}")
            want = FP8_KV if kv_cache == "fp8" else None
            if want != self.kv_dtype:
                self.kv_dtype = want
                self._buckets.clear()
        for p in self.layers:
            if share_quant is not None:
                p["share_quant"] = bool(share_quant)
            if fused_quant is not None:
                p["fused_quant"] = bool(fused_quant) and fused_here(p, self.device)
            if attention is not None:
                p["attention"] = attention
        self._apply_gemm()
        self.clear_graphs()

    def _apply_gemm(self) -> None:
        for p in (self.head, *self.layers):
            for q in (p, *(v for v in p.values() if isinstance(v, dict))):
                q["gemm"] = self.gemm

    def set_head(self, module: nn.Module) -> None:
        """Use ``module`` (an ``nn.Linear`` or ``Fp8Linear``) as the lm_head; drops captured graphs."""
        self.head = lin_params(module)
        self._head_mod = _counted(module)
        self._apply_gemm()
        self.clear_graphs()

    def clear_graphs(self) -> None:
        for bk in self._buckets.values():
            bk.graphs.clear()
            bk.passes.clear()
        self._pass_graphs.clear()
        self._pass_seen.clear()
        self._pass_pool, self.pass_pool_bytes = None, 0  # the old pool goes with its graphs

    def cache_bytes(self) -> int:
        """Bytes of the static K/V caches and step tensors the kept buckets hold, and of the captured
        passes' memory pool."""
        total = self.pass_pool_bytes
        for bk in self._buckets.values():
            for t in (*bk.kc, *bk.vc, bk.hist_tok, bk.hist_lp):
                total += t.numel() * t.element_size()
        return total

    # -- shapes ---------------------------------------------------------------------------------
    def _rope_table(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if t not in self._rope:
            d = self.head_dim
            inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=self.device).float() / d))
            ang = torch.outer(torch.arange(t, device=self.device, dtype=torch.float32), inv)
            emb = torch.cat((ang, ang), dim=-1)
            self._rope[t] = (emb.cos().to(self.dtype), emb.sin().to(self.dtype),
                             torch.arange(t, device=self.device))
        return self._rope[t]

    def _bucket(self, b: int, t: int) -> _Bucket:
        key = (b, t)
        bk = self._buckets.get(key)
        if bk is not None:
            self._buckets.move_to_end(key)
            return bk
        while len(self._buckets) >= MAX_BUCKETS:
            self._buckets.popitem(last=False)
        dev, dt = self.device, self.dtype
        kdt = dt if self.kv_dtype is None else FP8_KV_STORE
        shape = (b, self.kv_heads, t, self.head_dim)
        bk = _Bucket(b, t, [torch.zeros(shape, device=dev, dtype=kdt) for _ in self.layers],
                     [torch.zeros(shape, device=dev, dtype=kdt) for _ in self.layers],
                     torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                     torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                     torch.zeros(b, t, dtype=torch.long, device=dev), torch.zeros(b, t, dtype=torch.float32,
                                                                                  device=dev),
                     torch.zeros(b, dtype=torch.bool, device=dev))
        if self.kv_dtype is not None:
            bk.ks = [torch.ones(self.kv_heads, device=dev, dtype=torch.float32) for _ in self.layers]
            bk.vs = [torch.ones(self.kv_heads, device=dev, dtype=torch.float32) for _ in self.layers]
        self._buckets[key] = bk
        return bk

    def _live(self, t: int, slot: int) -> int:
        """Keys a step writing at ``slot`` attends: [0, live), live >= slot + 1, a multiple of the window."""
        if self.live_window <= 0:
            return t
        return min(t, -(-(slot + 1) // self.live_window) * self.live_window)

    def _step(self, bk: _Bucket, eos: torch.Tensor, live: int) -> None:
        """One decode step on the bucket's static tensors (eager, compiled or captured), attending
        keys [0, live)."""
        cos_t, sin_t, key_idx = self._rope_table(bk.t)
        cos, sin, kmask = self._inputs_fn(bk.slot, bk.pad, cos_t, sin_t, key_idx[:live])
        x = F.embedding(bk.tokens, self.embed)
        for i, p in enumerate(self.layers):
            if bk.ks:
                x = self._layer_fn(x, p, bk.kc[i], bk.vc[i], bk.slot, cos, sin, kmask, self.eps, bk.pad,
                                   bk.ks[i], bk.vs[i])
            else:
                x = self._layer_fn(x, p, bk.kc[i], bk.vc[i], bk.slot, cos, sin, kmask, self.eps, bk.pad)
        tok, lp = self._head_fn(x, self.final_ln, self.head, self.eps)
        bk.tokens.copy_(tok)
        bk.hist_tok.index_copy_(1, bk.step_i, tok[:, None])
        bk.hist_lp.index_copy_(1, bk.step_i, lp[:, None])
        bk.done.logical_or_((tok[:, None] == eos[None, :]).any(-1))
        bk.slot.add_(1)
        bk.step_i.add_(1)

    def _capture(self, bk: _Bucket, eos: torch.Tensor, live: int) -> Any:
        """Compile (on a side stream, as capture requires) and capture the step attending [0, live);
        state is restored after (the K/V written at the next slots are rewritten before they are read)."""
        t0 = time.perf_counter()
        saved = (bk.tokens.clone(), bk.slot.clone(), bk.step_i.clone(), bk.done.clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._step(bk, eos, live)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        bk.eos = eos  # the graph reads this tensor: keep it alive
        with torch.cuda.graph(graph):
            self._step(bk, eos, live)
        for dst, src in zip((bk.tokens, bk.slot, bk.step_i, bk.done), saved, strict=True):
            dst.copy_(src)
        torch.cuda.synchronize()
        bk.graphs[live] = graph
        self.warmup_seconds += time.perf_counter() - t0
        log.info("fast decode: captured batch %d x cache %d (live %d) in %.1f s", bk.b, bk.t, live,
                 time.perf_counter() - t0)
        return graph

    # -- generation -------------------------------------------------------------------------------
    def generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos_ids: Sequence[int],
                 stop_check: Callable[[int, list[int]], bool] | None = None, pad_id: int = 0
                 ) -> list[tuple[list[int], list[float]]]:
        """Greedy tokens (EOS excluded) and their logprobs for a left-padded batch ``ids``/``mask``.

        ``stop_check(row, tokens_so_far)`` -> True once that row hit a stop string."""
        with self._lock:
            return self._generate(ids, mask, max_new_tokens, eos_ids, stop_check, pad_id)

    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, eos_ids: Sequence[int],
                  stop_check: Callable[[int, list[int]], bool] | None, pad_id: int
                  ) -> list[tuple[list[int], list[float]]]:
        n, width = ids.shape
        if max_new_tokens <= 0:
            return [([], []) for _ in range(n)]
        b = n if n > self.max_batch else min(self.max_batch, 1 << (n - 1).bit_length())
        t = -(-(width + max_new_tokens) // T_BUCKET) * T_BUCKET
        bk = self._bucket(b, t)
        if b > n:  # filler rows: one valid token each, outputs discarded
            extra = b - n
            ids = torch.cat([ids, torch.full((extra, width), pad_id, dtype=ids.dtype, device=ids.device)])
            fill = torch.zeros((extra, width), dtype=mask.dtype, device=mask.device)
            fill[:, -1] = 1
            mask = torch.cat([mask, fill])
        eos = bk.eos if bk.eos is not None else torch.tensor(list(eos_ids) or [-1], device=self.device)
        with torch.inference_mode():
            t0 = time.perf_counter()
            first_tok, first_lp = self._prefill(bk, ids, mask)
            tokens = [[int(x)] for x in first_tok[:n].tolist()]
            lps = [[float(x)] for x in first_lp[:n].tolist()]
            t1 = time.perf_counter()
            self.stats["prefill_s"] += t1 - t0
            self.stats["batches"] += 1
            w0 = self.warmup_seconds
            eos_set = set(eos_ids)
            done = [tokens[r][0] in eos_set for r in range(n)]
            if stop_check is not None:
                done = [d or stop_check(r, tokens[r]) for r, d in enumerate(done)]
            steps = 0
            total = max_new_tokens - 1
            if not all(done) and total > 0:
                while steps < total:
                    chunk = min(self.check_every, total - steps)
                    for j in range(steps, steps + chunk):
                        live = self._live(bk.t, width + j)
                        if self.cuda_graphs:
                            graph = bk.graphs.get(live) or self._capture(bk, eos, live)
                            graph.replay()
                        else:
                            self._step(bk, eos, live)
                    steps += chunk
                    flags = bk.done[:n].tolist()
                    if stop_check is not None:
                        new = bk.hist_tok[:n, :steps].tolist()
                        done = [d or f or stop_check(r, tokens[r] + new[r]) for r, (d, f) in
                                enumerate(zip(done, flags, strict=True))]
                    else:
                        done = [d or f for d, f in zip(done, flags, strict=True)]
                    if all(done):
                        break
            hist_t = bk.hist_tok[:n, :steps].tolist()
            hist_l = bk.hist_lp[:n, :steps].tolist()
            t2 = time.perf_counter()
            self.stats["decode_s"] += t2 - t1 - (self.warmup_seconds - w0)  # capture is reported apart
            self.stats["steps"] += steps
        out: list[tuple[list[int], list[float]]] = []
        for r in range(n):
            row_t, row_l = tokens[r] + hist_t[r], lps[r] + hist_l[r]
            keep_t: list[int] = []
            keep_l: list[float] = []
            for tk, lv in zip(row_t, row_l, strict=True):
                if tk in eos_set:
                    break
                keep_t.append(tk)
                keep_l.append(lv)
            out.append((keep_t, keep_l))
        return out

    def hidden(self, ids: torch.Tensor, mask: torch.Tensor, keep: int, kv_into: _Bucket | None = None
               ) -> torch.Tensor:
        """Final-norm hidden states [B, keep, hidden] of the last ``keep`` positions of a left-padded
        batch (``fast_forward.forward_layer`` per layer); with ``kv_into``, each layer's K/V are copied
        into that bucket's static cache. FP8 layers count saturation over the valid tokens."""
        width = ids.shape[1]
        cos_t, sin_t, _ = self._rope_table(-(-width // T_BUCKET) * T_BUCKET)
        cos, sin, amask = sequence_inputs(mask, cos_t, sin_t)
        count = max(1, int(self.saturation_stride)) if (
            self.count_saturation and len(self._sat_mods) == len(self.layers)) else 0
        x = F.embedding(ids, self.embed)
        fused = ids.shape[0] * width >= self.fused_min_rows
        sats = []
        for i, p in enumerate(self.layers):
            if self.compile_passes:
                for t in (x, cos, sin, amask):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                    torch._dynamo.maybe_mark_dynamic(t, 1 if t is not amask else 2)
                torch._dynamo.maybe_mark_dynamic(amask, 3)
            x, k, v, sat = self._forward_fn(x, p, cos, sin, amask, self.eps, count, fused)
            if kv_into is not None:
                kv_into.store_kv(i, k, v)
            if sat is not None:
                sats.append(sat)
        if sats:
            self._add_saturation(torch.stack(sats), mask[:, ::count])
        return rms_norm(x[:, -keep:], self.final_ln, self.eps)

    def head_logits(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The lm_head over hidden states [..., hidden]. An FP8 head counts the values its quantiser clips,
        as the eager ``Fp8Linear`` does, on the positions ``mask`` marks valid (None: all of them)."""
        mod = self._head_mod
        if mod is not None and self.count_saturation:
            n_clipped = clipped(h, self.head).to(torch.float64)
            if mask is None:
                mod._n_saturated += n_clipped.sum()
                mod._n_values += n_clipped.numel() * h.shape[-1]
            else:
                valid = mask.to(torch.float64)
                mod._n_saturated += (n_clipped * valid).sum()
                mod._n_values += valid.sum() * h.shape[-1]
        return linear(h, self.head)

    def _bind_saturation(self) -> None:
        """Every counted Fp8Linear's counters as views of one store (``probes.fp8.bind_counters``), with
        each module's row in a pass's flattened counts and its input width: ``_add_saturation`` then adds
        a whole pass in a few kernels. The 2 x 7 small adds per layer it replaces were ~670 launches per
        8B-shape pass, host time the GPU waited for at batch 16 (docs/BENCHMARKS.md)."""
        self._sat_store: torch.Tensor | None = None
        if not self._sat_mods or len(self._sat_mods) != len(self.layers):
            return
        flat = [mod for groups in self._sat_mods for group in groups for mod in group]
        rows = [i * len(groups) + g for i, groups in enumerate(self._sat_mods)
                for g, group in enumerate(groups) for _ in group]
        self._sat_store = bind_counters(flat)
        self._sat_first = flat[0]
        self._sat_rows = torch.tensor(rows, device=self._sat_store.device)
        self._sat_width = torch.tensor([m.in_features for m in flat], dtype=torch.float64,
                                       device=self._sat_store.device)

    def _add_saturation(self, sats: torch.Tensor, mask: torch.Tensor) -> None:
        """sats [layers, counts, B, L'] clipped values per counted token -> the Fp8Linear counters (valid
        tokens; ``mask`` [B, L'] of the counted positions)."""
        valid = mask.to(torch.float64)
        per_count = (sats.to(torch.float64) * valid).sum((2, 3))
        n_valid = valid.sum()
        store = self._sat_store
        # the modules' counters are still this store's views (another decoder over the model rebinds them)
        if store is not None and self._sat_first._n_values.data_ptr() == store.data_ptr():
            store[0] += n_valid * self._sat_width
            store[1] += per_count.reshape(-1).index_select(0, self._sat_rows)
            return
        for groups, row in zip(self._sat_mods, per_count, strict=True):
            for group, n_sat in zip(groups, row, strict=True):
                for mod in group:
                    mod._n_saturated += n_sat
                    mod._n_values += n_valid * mod.in_features

    def token_logprobs(self, ids: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
        """For the last ``keep`` positions of a left-padded batch, the float32 log-probability of each
        next token [B, keep - 1] (``hidden``, the lm_head, a float log-softmax in row chunks)."""
        def run(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor]:
            logits = self.head_logits(self.hidden(ids, mask, keep), mask[:, -keep:])
            targets = ids[:, ids.shape[1] - keep + 1:]
            picked = torch.empty(targets.shape, dtype=torch.float32, device=ids.device)
            for s in range(0, ids.shape[0], 16):  # bounded memory: 16 rows of float logits at a time
                picked[s:s + 16] = picked_logprobs(logits[s:s + 16, :-1, :], targets[s:s + 16])
            return (picked,)

        # the passes' graphs share one memory pool with the prefill's, and a replay's output is rewritten by
        # the next pass: one pass at a time, and a copy out
        with self._lock:
            return self._pass(self._pass_graphs, ("score", keep), run, ids, mask)[0].clone()

    def _first_token(self, bk: _Bucket, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' pass with K/V into ``bk``'s cache; the greedy first token and its logprob."""
        logits = self.head_logits(self.hidden(ids, mask, 1, kv_into=bk)[:, -1])
        return first_token(logits)

    def _pass_key(self, ids: torch.Tensor, what: Any) -> Any | None:
        """The key a pass over ``ids`` is captured under (None: run it eagerly). It holds what the captured
        kernels read from the host at capture time: the shape, the counting choices and the counters'
        storage (another decoder over the same model rebinds them; a graph would add to the old ones)."""
        if not (self.cuda_graphs and self.own_forward and ids.numel() <= self.pass_graph_max_rows):
            return None
        first = getattr(self, "_sat_first", None)  # unset when not every layer is counted (nothing is)
        sat = first._n_values.data_ptr() if first is not None else 0
        head = self._head_mod._n_saturated.data_ptr() if self._head_mod is not None else 0
        return (what, tuple(ids.shape), self.count_saturation, self.saturation_stride, self.fused_min_rows,
                fast_forward.SDPA_GQA, id(self.head), sat, head)

    def _pass(self, graphs: OrderedDict[Any, _PassGraph], what: Any,
              run: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
              ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``run(ids, mask)``: eagerly the first time its shape comes, captured as a CUDA graph the second
        (the first run did every lazy set-up a capture cannot: compiling, loading kernels, cuBLAS handles)
        and replayed after. The outputs of a replay are valid until the next pass of this decoder."""
        key = self._pass_key(ids, what)
        if key is None:
            return run(ids, mask)
        g = graphs.get(key)
        if g is not None:
            graphs.move_to_end(key)
            g.ids.copy_(ids)
            g.mask.copy_(mask)
            g.graph.replay()
            self.stats["pass_replays"] += 1
            return g.outputs
        if key not in self._pass_seen:
            self._pass_seen[key] = None
            while len(self._pass_seen) > MAX_PASS_SEEN:
                self._pass_seen.popitem(last=False)
            return run(ids, mask)
        t0 = time.perf_counter()
        if self._pass_pool is None:
            self._pass_pool = torch.cuda.graph_pool_handle()
        while len(graphs) >= MAX_PASS_GRAPHS:
            graphs.popitem(last=False)
        static_ids, static_mask = ids.clone(), mask.clone()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as the capture does first: the growth below is then the pool's alone
        reserved = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pass_pool):
                outputs = run(static_ids, static_mask)
        except RuntimeError as exc:  # a capture the stack cannot take: eager from now on, said once
            log.warning("fast decode: passes left eager, capturing a %s pass failed: %s", what, exc)
            self.pass_graph_max_rows = 0
            return run(ids, mask)
        self.pass_pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        g = graphs[key] = _PassGraph(graph, static_ids, static_mask, outputs)
        g.graph.replay()  # capture records; this computes
        self.stats["pass_captures"] += 1
        self.warmup_seconds += time.perf_counter() - t0
        log.info("fast decode: captured a %s pass of %s in %.2f s", what[0] if isinstance(what, tuple) else what,
                 tuple(ids.shape), time.perf_counter() - t0)
        return g.outputs

    def _prefill(self, bk: _Bucket, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts' forward (``hidden``, or the model's own with ``own_forward`` off); K/V into the
        static cache; the first token."""
        width = ids.shape[1]
        if self.own_forward:
            tok, lp = self._pass(bk.passes, "prefill", lambda i, m: self._first_token(bk, i, m), ids, mask)
        else:
            tok, lp = first_token(self._model_prefill(bk, ids, mask))
        pad = (mask == 0).sum(-1)
        bk.tokens.copy_(tok)
        bk.slot.fill_(width)
        bk.pad.copy_(pad)
        bk.step_i.zero_()
        bk.done.copy_(torch.isin(tok, torch.tensor([-1], device=tok.device)))
        return tok, lp

    def _model_prefill(self, bk: _Bucket, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The model's own (transformers) forward; K/V into the static cache; last position's logits."""
        from transformers import DynamicCache

        from probes.fp8 import QUANT_MEMO

        width = ids.shape[1]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         logits_to_keep=1, **{self.cache_arg: cache})
        for i in range(len(self.layers)):
            k, v = _layer_kv(cache, i)
            bk.store_kv(i, k[:, :, :width], v[:, :, :width])
        QUANT_MEMO.clear()
        return out.logits[:, -1, :]


def first_token(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy token of each row's logits [B, V] and its float log-probability."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tok = lp.argmax(dim=-1)
    return tok, lp.gather(1, tok[:, None])[:, 0]


def _counted(module: nn.Module) -> Fp8Linear | None:
    """The lm_head whose FP8 input the passes count (an ``Fp8Linear`` tracking saturation), else None."""
    return module if isinstance(module, Fp8Linear) and module.track_saturation else None


def _layer_kv(cache: Any, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[i].keys, layers[i].values
    return cache.key_cache[i], cache.value_cache[i]
