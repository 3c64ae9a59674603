"""The full-sequence pass of a Llama-shaped model on the fast path's weights (prefill and scoring).

Replaces transformers' eager forward for the prompt pass of generation and for teacher-forced
scoring. One layer is one pure function (``forward_layer``), compiled once per engine on CUDA with
the batch and length dimensions dynamic, so inductor fuses what the eager forward runs as separate
kernels: the float32 RMSNorm (cast, square, mean, rsqrt, scale, cast back, weight), rotary
(mul, slice, neg, cat, mul, add), SiLU*up, the FP8 activation quantiser and the saturation count.
The numerics follow the eager module code op by op (rounding to the activation dtype where eager
does, ``emulate_precision_casts``); attention is the same eager ``scaled_dot_product_attention`` call
with K/V repeated per query head and a boolean mask, as transformers makes when a mask is present.

Left padding: a pad query attends to itself only, so no row of the attention is empty (an all-masked
row gives NaN, and a NaN at a pad position would poison the keys that valid queries mask out).
Saturation is counted on valid (non-pad) tokens only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from probes import fp8_fused
from probes.engines.fast_layers import linear, mm8, projections, rms_norm, rotate_half
from probes.fp8 import E4M3_MAX

#: the counts of a layer whose q/k/v and gate/up are merged FP8 entries (``FastDecoder``'s ``p["counts"]``,
#: in any order)
FUSED_COUNTS = (("h", "qkv"), ("a", "o"), ("h2", "gu"), ("m", "down"))


def clipped(x: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Per token, how many of ``x``'s values the FP8 quantiser of linear ``p`` clips ([..., ] int32)."""
    return ((x / p["sx_in"]).abs() > E4M3_MAX).sum(-1, dtype=torch.int32)


def repeat_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, KVH, L, D] -> [B, KVH * rep, L, D], each K/V head repeated for its query heads."""
    if rep == 1:
        return t
    b, kvh, n, d = t.shape
    return t[:, :, None].expand(b, kvh, rep, n, d).reshape(b, kvh * rep, n, d)


#: whole-sequence attention reads each K/V head for its query heads (SDPA's ``enable_gqa``); False: K/V
#: repeated per query head first (a copy of K and V per layer, four times their size at the 8B shape)
SDPA_GQA = True


@torch.compiler.disable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, amask: torch.Tensor) -> torch.Tensor:
    """q [B, NH, L, D], k/v [B, KVH, L, D] -> [B, L, NH * D]. Left out of the compiled graph (eager
    SDPA picks its kernel and pads the mask itself; the compiled function splits around it)."""
    rep = q.shape[1] // k.shape[1]
    if SDPA_GQA and rep > 1:
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=amask, enable_gqa=True)
    else:
        a = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=amask)
    return a.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _merged(p: dict[str, Any], key: str) -> str:
    """Whole sequences use a merged GEMM only in FP16: the merged FP8 product writes float32, which
    made prefill and scoring slower on the H200 (a win only at decode's few rows)."""
    return key if key in p and p[key]["kind"] == "plain" else ""


def _shared(p: dict[str, Any], key: str) -> str:
    """The merged FP8 entry whose one activation scale quantises the input once (``p["share_quant"]``)."""
    return key if p.get("share_quant", False) and key in p and p[key]["kind"] == "fp8cols" else ""


def fused_here(p: dict[str, Any], device: torch.device) -> bool:
    """Whether the layer quantises through ``probes.fp8_fused`` on ``device``: CUDA with Triton, and ``fusable``."""
    return device.type == "cuda" and fp8_fused.HAVE_TRITON and fusable(p)


def fusable(p: dict[str, Any]) -> bool:
    """Whether the layer can quantise through ``probes.fp8_fused``: static per-tensor FP8 linears with one
    activation scale for q/k/v and one for gate/up (merged entries), counted as ``FUSED_COUNTS``."""
    return (
        all(p.get(k, {}).get("kind") == "fp8cols" for k in ("qkv", "gu"))
        and all(p[k]["kind"] == "fp8" for k in ("q", "k", "v", "o", "gate", "up", "down"))
        and set(p.get("counts", ())) == set(FUSED_COUNTS)
    )


def fused_layer(
    x: torch.Tensor,
    p: dict[str, Any],
    cos: torch.Tensor,
    sin: torch.Tensor,
    amask: torch.Tensor,
    eps: float,
    count: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``forward_layer`` for a ``fusable`` FP8 layer: each linear's input is quantised and counted by
    one ``probes.fp8_fused`` kernel with what precedes it (RMSNorm, the residual add, SiLU*up); q/k/v and
    gate/up read one quantised copy. Counts every token; ``count`` keeps every ``count``-th position."""
    b, n, dt = x.shape[0], x.shape[1], x.dtype
    d = cos.shape[-1]
    h8, c_h = fp8_fused.rms_quant(x, p["ln1"], p["qkv"]["sx_in"], eps)
    q, k, v = (mm8(h8, p[name], dt).view(b, n, -1, d).transpose(1, 2) for name in ("q", "k", "v"))
    c, s = cos[:, None], sin[:, None]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    a8, c_a = fp8_fused.quant_rows(attention(q, k, v, amask), p["o"]["sx_in"])
    x, h28, c_h2 = fp8_fused.add_rms_quant(x, mm8(a8, p["o"], dt), p["ln2"], p["gu"]["sx_in"], eps)
    m8, c_m = fp8_fused.silu_mul_quant(mm8(h28, p["gate"], dt), mm8(h28, p["up"], dt), p["down"]["sx_in"])
    x = x + mm8(m8, p["down"], dt)
    sat = None
    if count > 0:
        counts = {"h": c_h, "a": c_a, "h2": c_h2, "m": c_m}
        sat = torch.stack([counts[src][:, ::count] for src, _key in p["counts"]])
    return x, k, v, sat


def forward_layer(
    x: torch.Tensor,
    p: dict[str, Any],
    cos: torch.Tensor,
    sin: torch.Tensor,
    amask: torch.Tensor,
    eps: float,
    count: int,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One Llama layer over whole sequences. x [B, L, hidden]; cos, sin [B, L, D] of each position;
    amask [B, 1, L, L] (True: may attend). Returns (x, k, v, clipped) with k, v [B, KVH, L, D] after
    rotary and, when ``count`` > 0, the clipped values per counted token [len(p["counts"]), B, L']:
    one count per (input, linear) of ``p["counts"]`` (a merged q/k/v or gate/up is counted once), on
    every ``count``-th position (``[:, ::count]``, L' of them; 1: every token). ``p["fused_quant"]`` and
    ``fused``: through ``fused_layer``."""
    if fused and p.get("fused_quant", False):
        return fused_layer(x, p, cos, sin, amask, eps, count)
    b, n = x.shape[0], x.shape[1]
    d = cos.shape[-1]
    h = rms_norm(x, p["ln1"], eps)
    q, k, v = (
        t.view(b, n, -1, d).transpose(1, 2) for t in projections(
            h, p, _merged(p, "qkv"), ("q", "k", "v"), _shared(p, "qkv")
        )
    )
    c, s = cos[:, None], sin[:, None]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    a = attention(q, k, v, amask)
    x = x + linear(a, p["o"])
    h2 = rms_norm(x, p["ln2"], eps)
    gate, up = projections(h2, p, _merged(p, "gu"), ("gate", "up"), _shared(p, "gu"))
    m = F.silu(gate) * up
    x = x + linear(m, p["down"])
    sat = None
    if count > 0:
        inputs = {"h": h, "a": a, "h2": h2, "m": m}
        sat = torch.stack([clipped(inputs[src][:, ::count], p[key]) for src, key in p["counts"]])
    return x, k, v, sat


def sequence_inputs(
    mask: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a left-padded ``mask`` [B, L]: each position's rotary cos/sin [B, L, D] and the attention
    mask [B, 1, L, L] (causal over valid keys; a pad query sees itself)."""
    n = mask.shape[1]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    idx = torch.arange(n, device=mask.device)
    causal = idx[:, None] >= idx[None, :]
    amask = (causal[None] & mask.bool()[:, None, :]) | (idx[:, None] == idx[None, :])[None]
    return cos_t[pos], sin_t[pos], amask[:, None]
