"""The building blocks of one Llama layer on the fast path, shared by the decode step
(``fast_decode``) and the full-sequence pass (``fast_forward``): pure functions of tensors that
``torch.compile`` traces, and the weight dicts they read (``lin_params``, ``merge_linears``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from probes import fp8_gemm
from probes.fp8 import E4M3_MAX, FP8_DTYPE, Fp8Linear

#: the input (of ``fast_forward.forward_layer``) each linear, or merged pair/triple, reads
COUNT_INPUT = {
    "q": "h",
    "k": "h",
    "v": "h",
    "qkv": "h",
    "o": "a",
    "gate": "h2",
    "up": "h2",
    "gu": "h2",
    "down": "m",
}


def quant(x: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
    """Static FP8 activation quantisation, as ``Fp8Linear`` does it (divide in the activation dtype)."""
    return (x / sx).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def linear(x: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """One GEMM over the last dim of ``x``. ``p['kind']``: fp16 (plain), fp8 (static per-tensor,
    _scaled_mm) or module (an ``Fp8Linear``'s own quantise + product: per-row weights, CPU emulation).
    ``p['gemm'] == "triton"``: FP8 products of at most ``fp8_gemm.MAX_M`` rows (decode) go through
    ``probes.fp8_gemm`` instead of ``_scaled_mm``."""
    kind = p["kind"]
    if kind == "plain":
        return F.linear(x, p["w"])
    x2 = x.reshape(-1, x.shape[-1])
    cfg = fp8_gemm.chosen(x2, p["w"]) if kind in ("fp8", "fp8cols") and p.get("gemm") == "triton" else None
    if cfg is not None:
        scale = p["sx"] * (p["sw"] if kind == "fp8" else p["sw_cols"])
        out = fp8_gemm.scaled_small_mm(quant(x2, p["sx_in"]), p["w"], scale, x.dtype, cfg)
    elif kind == "fp8":
        out = mm8(quant(x2, p["sx_in"]), p, x.dtype)
    elif kind == "fp8cols":  # merged FP8 linears: each one's per-tensor weight scale applied to its columns
        out = torch._scaled_mm(
            quant(x2, p["sx_in"]), p["w"].t(), scale_a=p["sx"], scale_b=p["one"], out_dtype=torch.float32
        )
        out = (out * p["sw_cols"]).to(x.dtype)
    else:
        mod: Fp8Linear = p["mod"]
        x8, sa = quant(x2, p["sx_in"]), mod.act_scale
        out = mod._matmul_scaled_mm(x8, sa) if mod.backend == "scaled_mm" else mod._matmul_emulated(x8, sa)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def projections(
    h: torch.Tensor, p: dict[str, Any], merged: str, names: tuple[str, ...], share: str = ""
) -> list[torch.Tensor]:
    """The outputs of linears ``names`` that read ``h``: one GEMM when the layer has them ``merged``;
    with ``share`` (the key of their merged FP8 entry), separate FP8 GEMMs on ONE quantised copy of
    ``h`` (each linear's own scale object would otherwise make inductor write one copy per linear)."""
    if merged in p:
        return list(linear(h, p[merged]).split(p[merged]["sizes"], dim=-1))
    if share in p and all(p[n]["kind"] == "fp8" for n in names):
        h8 = quant(h.reshape(-1, h.shape[-1]), p[share]["sx_in"])
        return [mm8(h8, p[n], h.dtype).reshape(*h.shape[:-1], -1) for n in names]
    return [linear(h, p[n]) for n in names]


def mm8(x8: torch.Tensor, p: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    """The FP8 product of an already quantised input ``x8`` [..., K] with linear ``p`` (kind fp8)."""
    out = torch._scaled_mm(x8.reshape(-1, x8.shape[-1]), p["w"].t(), scale_a=p["sx"], scale_b=p["sw"],
                           out_dtype=dtype)
    return out.reshape(*x8.shape[:-1], out.shape[-1])


def picked_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., target] in float32: [B, L, V] logits (any float dtype), [B, L] targets.

    Eager on purpose: compiling it (the float32 up-cast fused into the reductions) was measured on
    the H200 at the 8B/128k-vocabulary shape and saved 1-2 % of scoring time, less than the compile
    it adds to a cold replay (docs/BENCHMARKS.md, "replay through the CLI")."""
    lg = logits.float()
    return lg.gather(2, targets[:, :, None])[:, :, 0] - lg.logsumexp(-1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def lin_params(mod: nn.Module) -> dict[str, Any]:
    if isinstance(mod, Fp8Linear):
        sx_in = mod._scale_in(mod.out_dtype)
        if mod.backend == "scaled_mm" and mod.weight_mode == "tensor":
            return {
                "kind": "fp8",
                "w": mod.weight_fp8,
                "sw": mod.weight_scale,
                "sx": mod.act_scale,
                "sx_in": sx_in,
            }
        return {"kind": "module", "mod": mod, "sx_in": sx_in}
    assert isinstance(mod, nn.Linear)
    return {"kind": "plain", "w": mod.weight}


def _fp32_scaled_mm(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` gives float32 output here (what a merged FP8 product needs)."""
    try:
        a = torch.zeros(16, 16, device=device).to(FP8_DTYPE)
        one = torch.ones(1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def merge_linears(mods: list[nn.Module]) -> dict[str, Any] | None:
    """One GEMM for linears that read the same input (q/k/v, gate/up): their weights concatenated, the
    modules left holding views of the merged tensor (no memory added; the eager path reads the same
    values). FP8 needs one activation scale for all and float32 output from ``_scaled_mm`` (each
    per-tensor weight scale is then applied to its own columns). None when they cannot be merged."""
    sizes = tuple(int(m.out_features) for m in mods)
    if all(type(m) is nn.Linear and m.bias is None for m in mods):
        w = torch.cat([m.weight.detach() for m in mods])
        for m, part in zip(mods, w.split(sizes), strict=True):
            m.weight = nn.Parameter(part, requires_grad=False)
        return {"kind": "plain", "w": w, "sizes": sizes}
    fp8 = [
        m
        for m in mods
        if isinstance(m, Fp8Linear)
        and m.backend == "scaled_mm"
        and m.weight_mode == "tensor"
        and m.bias is None
    ]
    if (
        len(fp8) < len(mods)
        or len({m.act_amax for m in fp8}) != 1
        or not _fp32_scaled_mm(fp8[0].weight_fp8.device)
    ):
        return None
    w = torch.cat([m.weight_fp8 for m in fp8])
    for m, part in zip(fp8, w.split(sizes), strict=True):
        m.weight_fp8 = part
    first = fp8[0]
    return {
        "kind": "fp8cols",
        "w": w,
        "sizes": sizes,
        "sx": first.act_scale,
        "sx_in": first._scale_in(first.out_dtype),
        "one": torch.ones(1, device=w.device),
        "sw_cols": torch.cat([m.weight_scale.float().expand(m.out_features) for m in fp8]),
    }
