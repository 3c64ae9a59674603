"""Decode attention for the fast path: one new query per row over a static K/V cache, GQA-aware
(each K/V head read once for its query heads, no K/V repeated per head), with no mask tensor (each row's
valid keys are ``[pad[b], slot]``), and an optional FP8 (e4m3) cache with one scale per K/V head.

``decode_attention(q, kc, vc, ks, vs, slot, pad, live)`` is a ``torch.library`` custom op, so the
compiled decode step calls it as one opaque node and the CUDA graph captures its launches:

* CUDA: a Triton flash-decoding kernel. Grid (batch x K/V heads, splits of the key range); each program
  holds the ``rep`` query heads of one K/V head (padded to 16 rows for ``tl.dot``), walks its keys in
  blocks of 64 (only ``[pad, slot]``: the left padding and the keys past the position are not read),
  and keeps an online softmax in float32; FP8 keys/values are converted to fp16 in registers (the K
  scale is folded into the query, the V scale into the output). With more than one split, a second
  small kernel merges the partial results.
* Elsewhere (CPU, CI): the reference, K/V dequantised to the query dtype and
  ``scaled_dot_product_attention`` with the key mask, the same as ``fast_decode.attend``.

The FP8 cache quantiser (``quant_kv``) divides by the per-head scale in float32, clamps to +-448 and
casts (round to nearest even). The scale of each layer's K/V head is set when the prompt's K/V are
written (``kv_scales``: the prompt's max magnitude with 2x headroom), and decode writes clamp to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
FP8_KV = torch.float8_e4m3fn
#: an FP8 cache is stored as the e4m3 bits in uint8 (plain index_copy_ on every device, no dtype view of
#: a graph input in the compiled step)
FP8_KV_STORE = torch.uint8
#: per-head scale = prompt amax * KV_HEADROOM / 448 (decode tokens above that clamp)
KV_HEADROOM = 2.0
BLOCK_N = 64
REP_PAD = 16
#: launch configuration (keys per block, warps, pipeline stages, programs per SM the key-range splits aim
#: at); ``TUNED[(batch, fp8)]`` overrides it for one batch size. The entries: the fastest of
#: ``bench/gpu_profile_fp8.py --attn`` on the H200 (2026-12-03, two calls agreeing); ``--attn`` re-times
#: and replaces them.
CONFIG = (64, 4, 3, 2)
TUNED: dict[tuple[int, bool], tuple[int, int, int, int]] = {
    (16, False): (128, 4, 2, 2), (16, True): (128, 4, 2, 2), (64, False): (32, 4, 3, 2), (64, True): (32, 4, 3, 2),
    (128, False): (128, 4, 2, 2), (128, True): (64, 4, 3, 2),
}

try:  # Triton is there with CUDA builds of torch; CPU-only installs run the reference
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


def kv_scales(t: torch.Tensor) -> torch.Tensor:
    """Per-head float32 scales [KVH] of a K or V tensor [B, KVH, L, D]: max |t| * headroom / 448."""
    amax = t.abs().amax(dim=(0, 2, 3)).float()
    return (amax * KV_HEADROOM / E4M3_MAX).clamp(min=1e-6)


def quant_kv(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t [B, KVH, ..., D] / scale [KVH] per head -> e4m3 (clamped, round to nearest even) bits as uint8."""
    s = scale.view(1, -1, *([1] * (t.dim() - 2)))
    return (t.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_KV).view(FP8_KV_STORE)


def quant_kv_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's prompt K/V [B, KVH, L, D] -> (K bits, V bits, K scales, V scales): the per-head scales
    from their own values (``kv_scales``), then ``quant_kv``. One pure function, compiled by the decoder
    (two fused kernels per tensor instead of a dozen eager ones)."""
    ks, vs = kv_scales(k), kv_scales(v)
    return quant_kv(k, ks), quant_kv(v, vs), ks, vs


def dequant_kv(t8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of an FP8 cache slice [B, KVH, ..., D] (uint8 bits) with per-head ``scale``."""
    return t8.view(FP8_KV).float() * scale.view(1, -1, *([1] * (t8.dim() - 2)))


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
              slot: torch.Tensor, pad: torch.Tensor, live: int) -> torch.Tensor:
    """q [B, NH, D]; kc/vc [B, KVH, T, D] (e4m3 bits in uint8 with scales ks/vs [KVH], or the query
    dtype: scales unused); keys [pad[b], slot] of [0, live) attended. -> [B, NH * D]."""
    b, nh, d = q.shape
    k, v = kc[:, :, :live], vc[:, :, :live]
    if k.dtype == FP8_KV_STORE:
        k = dequant_kv(k, ks).to(q.dtype)
        v = dequant_kv(v, vs).to(q.dtype)
    idx = torch.arange(live, device=q.device)
    kmask = (idx[None, :] >= pad[:, None]) & (idx[None, :] <= slot)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=kmask[:, None, None, :],
                                         enable_gqa=nh != k.shape[1])
    return out.reshape(b, nh * d)


if HAVE_TRITON:

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slot_ptr, pad_ptr, o_ptr, po_ptr, pm_ptr,
                       sqb, sqh, skb, skh, skt, sob, poh, qk_scale, chunk,
                       KVH: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                       RP: tl.constexpr, NSPLIT: tl.constexpr, FP8: tl.constexpr):
        pid = tl.program_id(0)
        sp = tl.program_id(1)
        b = pid // KVH
        h = pid % KVH
        slot = tl.load(slot_ptr)
        pad = tl.load(pad_ptr + b)
        start = tl.maximum(pad, sp * chunk)
        end = tl.minimum(slot + 1, (sp + 1) * chunk)
        rows = tl.arange(0, RP)
        dd = tl.arange(0, D)
        rmask = rows < REP
        qh = h * REP + rows
        q = tl.load(q_ptr + b * sqb + qh[:, None] * sqh + dd[None, :], mask=rmask[:, None], other=0.0)
        scale = qk_scale
        if FP8:
            scale = scale * tl.load(ks_ptr + h)
        q = (q.to(tl.float32) * scale).to(tl.float16)
        m_i = tl.full([RP], float("-inf"), tl.float32)
        l_i = tl.zeros([RP], tl.float32)
        acc = tl.zeros([RP, D], tl.float32)
        base = b.to(tl.int64) * skb + h * skh
        first = (start // BLOCK) * BLOCK
        for n0 in range(first, end, BLOCK):
            offs = n0 + tl.arange(0, BLOCK)
            kmask = (offs >= start) & (offs < end)
            kv_off = base + offs[:, None].to(tl.int64) * skt + dd[None, :]
            if FP8:
                k = tl.load(k_ptr + kv_off, mask=kmask[:, None], other=0)
                v = tl.load(v_ptr + kv_off, mask=kmask[:, None], other=0)
                k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                v = v.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                k = tl.load(k_ptr + kv_off, mask=kmask[:, None], other=0.0).to(tl.float16)
                v = tl.load(v_ptr + kv_off, mask=kmask[:, None], other=0.0).to(tl.float16)
            s = tl.dot(q, tl.trans(k))
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            m_i = m_new
        vsc = 1.0
        if FP8:
            vsc = tl.load(vs_ptr + h)
        if NSPLIT == 1:
            out = acc * (vsc / l_i)[:, None]
            tl.store(o_ptr + b * sob + qh[:, None] * D + dd[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=rmask[:, None])
        else:
            # partial (m, l, acc * vsc) per (row, head, split)
            prow = (b * KVH * REP + qh) * NSPLIT + sp
            tl.store(po_ptr + prow[:, None] * D + dd[None, :], acc * vsc, mask=rmask[:, None])
            tl.store(pm_ptr + prow * 2, m_i, mask=rmask)
            tl.store(pm_ptr + prow * 2 + 1, l_i, mask=rmask)

    @triton.jit
    def _merge_kernel(po_ptr, pm_ptr, o_ptr, NH: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                      SP: tl.constexpr, sob):
        pid = tl.program_id(0)  # b * NH + head
        b = pid // NH
        hd = pid % NH
        sps = tl.arange(0, SP)
        smask = sps < NSPLIT
        dd = tl.arange(0, D)
        m = tl.load(pm_ptr + (pid * NSPLIT + sps) * 2, mask=smask, other=float("-inf"))
        lsum = tl.load(pm_ptr + (pid * NSPLIT + sps) * 2 + 1, mask=smask, other=0.0)
        mx = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp2(m - mx), 0.0)
        o = tl.load(po_ptr + (pid * NSPLIT + sps)[:, None] * D + dd[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(lsum * w, 0)
        tl.store(o_ptr + b * sob + hd * D + dd, out.to(o_ptr.dtype.element_ty))


    @triton.jit
    def _kv_amax_kernel(k_ptr, v_ptr, amax_ptr, L, skb, skh, skl, svb, svh, svl,
                        KVH: tl.constexpr, D: tl.constexpr, BL: tl.constexpr):
        b = tl.program_id(0)
        rows = tl.program_id(1) * BL + tl.arange(0, BL)
        r3 = rows[:, None, None]
        h3 = tl.arange(0, KVH)[None, :, None]
        d3 = tl.arange(0, D)[None, None, :]
        m = (r3 < L) & (h3 < KVH) & (d3 < D)
        k = tl.load(k_ptr + b.to(tl.int64) * skb + h3 * skh + r3.to(tl.int64) * skl + d3, mask=m, other=0.0)
        v = tl.load(v_ptr + b.to(tl.int64) * svb + h3 * svh + r3.to(tl.int64) * svl + d3, mask=m, other=0.0)
        hs = tl.arange(0, KVH)
        tl.atomic_max(amax_ptr + hs, tl.max(tl.max(tl.abs(k.to(tl.float32)), 2), 0))
        tl.atomic_max(amax_ptr + KVH + hs, tl.max(tl.max(tl.abs(v.to(tl.float32)), 2), 0))

    @triton.jit
    def _kv_quant_kernel(k_ptr, v_ptr, amax_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, L, skb, skh, skl, svb, svh,
                         svl, scb, sch, scl, HEADROOM: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                         BL: tl.constexpr):
        b = tl.program_id(0)
        blk = tl.program_id(1)
        rows = blk * BL + tl.arange(0, BL)
        r3 = rows[:, None, None]
        h3 = tl.arange(0, KVH)[None, :, None]
        d3 = tl.arange(0, D)[None, None, :]
        m = (r3 < L) & (h3 < KVH) & (d3 < D)
        hs = tl.arange(0, KVH)
        ksc = tl.maximum(tl.math.div_rn(tl.load(amax_ptr + hs) * HEADROOM, 448.0), 1e-6)
        vsc = tl.maximum(tl.math.div_rn(tl.load(amax_ptr + KVH + hs) * HEADROOM, 448.0), 1e-6)
        if (b == 0) & (blk == 0):
            tl.store(ks_ptr + hs, ksc)
            tl.store(vs_ptr + hs, vsc)
        c_off = b.to(tl.int64) * scb + h3 * sch + r3.to(tl.int64) * scl + d3
        k = tl.load(k_ptr + b.to(tl.int64) * skb + h3 * skh + r3.to(tl.int64) * skl + d3, mask=m, other=0.0)
        k = tl.math.div_rn(k.to(tl.float32), ksc[None, :, None])
        k = tl.minimum(tl.maximum(k, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(kc_ptr + c_off, k, mask=m)
        v = tl.load(v_ptr + b.to(tl.int64) * svb + h3 * svh + r3.to(tl.int64) * svl + d3, mask=m, other=0.0)
        v = tl.math.div_rn(v.to(tl.float32), vsc[None, :, None])
        v = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(vc_ptr + c_off, v, mask=m)


def store_prompt_kv(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor,
                    vs: torch.Tensor) -> None:
    """A layer's prompt K/V [B, KVH, L, D] (any strides, D contiguous) into positions [0, L) of an FP8
    cache kc/vc [B, KVH, T, D] (uint8 bits), with the per-head scales written to ks/vs [KVH]: on CUDA two
    Triton kernels (per-head max by atomics, then quantise straight into the cache: 3 launches per
    layer); elsewhere ``quant_kv_pair``. Same numbers either way (float32 division, round to nearest)."""
    b, kvh, n, d = k.shape
    ok = (k.is_cuda and HAVE_TRITON and k.stride(3) == 1 and v.stride(3) == 1 and kc.stride(3) == 1
          and kc.stride() == vc.stride() and kvh & (kvh - 1) == 0 and d & (d - 1) == 0 and n > 0)
    if not ok:
        k8, v8, s_k, s_v = quant_kv_pair(k, v)
        ks.copy_(s_k)
        vs.copy_(s_v)
        kc[:, :, :n].copy_(k8)
        vc[:, :, :n].copy_(v8)
        return
    amax = torch.zeros(2 * kvh, dtype=torch.float32, device=k.device)
    bl = max(1, 4096 // (kvh * d))
    grid = (b, triton.cdiv(n, bl))
    _kv_amax_kernel[grid](k, v, amax, n, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
                          v.stride(2), KVH=kvh, D=d, BL=bl, num_warps=4)
    _kv_quant_kernel[grid](k, v, amax, kc, vc, ks, vs, n, k.stride(0), k.stride(1), k.stride(2), v.stride(0),
                           v.stride(1), v.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
                           HEADROOM=KV_HEADROOM, KVH=kvh, D=d, BL=bl, num_warps=4)


def n_splits(b: int, kvh: int, live: int, sms: int = 132, block: int = BLOCK_N, per_sm: int = 2) -> int:
    """Key-range splits so the grid covers the GPU at small batch: about ``per_sm`` programs per SM,
    each split at least 2 key blocks."""
    want = -(-per_sm * sms // max(1, b * kvh))
    return max(1, min(want, live // (2 * block), 16))


def _triton_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                      slot: torch.Tensor, pad: torch.Tensor, live: int) -> torch.Tensor:
    b, nh, d = q.shape
    kvh = kc.shape[1]
    rep = nh // kvh
    fp8 = kc.dtype == FP8_KV_STORE
    block, warps, stages, per_sm = TUNED.get((b, fp8), CONFIG)
    q = q.contiguous()
    out = torch.empty((b, nh * d), dtype=q.dtype, device=q.device)
    ns = n_splits(b, kvh, live, block=block, per_sm=per_sm)
    chunk = -(-live // ns)
    chunk = -(-chunk // block) * block
    ns = -(-live // chunk)
    if ns > 1:
        po = torch.empty((b * nh * ns, d), dtype=torch.float32, device=q.device)
        pm = torch.empty((b * nh * ns, 2), dtype=torch.float32, device=q.device)
    else:
        po = pm = out
    qk_scale = (d ** -0.5) * 1.4426950408889634  # softmax in base 2
    _decode_kernel[(b * kvh, ns)](
        q, kc, vc, ks, vs, slot, pad, out, po, pm,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), out.stride(0), 0, qk_scale, chunk,
        KVH=kvh, REP=rep, D=d, BLOCK=block, RP=max(REP_PAD, triton.next_power_of_2(rep)), NSPLIT=ns, FP8=fp8,
        num_warps=warps, num_stages=stages,
    )
    if ns > 1:
        _merge_kernel[(b * nh,)](po, pm, out, NH=nh, D=d, NSPLIT=ns, SP=triton.next_power_of_2(ns),
                                 sob=out.stride(0), num_warps=4)
    return out


@torch.library.custom_op("llmwd::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                     slot: torch.Tensor, pad: torch.Tensor, live: int) -> torch.Tensor:
    """[B, NH * D] attention of q [B, NH, D] over keys [pad[b], slot] of kc/vc [B, KVH, T, D] (e4m3 bits
    in uint8 with per-head scales ks/vs [KVH] float32, or fp16/bf16 with the scales unused) within [0, live)."""
    if q.is_cuda and HAVE_TRITON and q.dtype in (torch.float16, torch.bfloat16) and kc.stride(3) == 1:
        return _triton_attention(q, kc, vc, ks, vs, slot, pad, live)
    return reference(q, kc, vc, ks, vs, slot, pad, live)


@decode_attention.register_fake
def _(q, kc, vc, ks, vs, slot, pad, live):  # noqa: ANN001, ANN202 - the op's shape function
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
