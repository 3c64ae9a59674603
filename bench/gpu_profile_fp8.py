"""FP8 vs FP16 engine time per component at the Llama-3-8B shape with a 128,256-token vocabulary.

One process, random weights (``bench.gpu_replay.random_llama``: lm_head rows past the byte
tokenizer's 384 are zero, so the lm_head and the log-softmax do the full vocabulary's work while
greedy picks stay byte ids), the torch engine as ``replay`` builds it (fast decode: compiled step in
a CUDA graph; FP8 with static calibrated per-tensor scales), except that the FP8 engine starts with its
lm_head in FP16 and an fp16 K/V cache: variant options ``head8`` and ``kv8`` add them, so
``new+auto+head8+kv8`` is the engine as shipped on FP8 hardware since 2026-12-06.

For each batch (16, 64, 128), on 2 x batch prompts of the repository's golden sets, 64 new
tokens, no stop strings: a warm-up round (compile, graph capture), two timed rounds (generate +
teacher-forced scoring, as a replay does; the engines alternate first), then one round of each
engine under ``torch.profiler``: CUDA kernel time by component (kernel-name classes: GEMM,
attention, FP8 quantisation, norm/rope/elementwise, log-softmax/argmax, copies) and host time
(wall minus kernel time). The lm_head's share is timed apart (its GEMM alone, in a CUDA graph).

    python bench/gpu_profile_fp8.py --out $OUT/profile.txt        # on the GPU
    python bench/gpu_profile_fp8.py --smoke                         # tiny, CPU (paths only)

``--variants new,new+q1,new+q1+gqa+head8`` adds options to a variant (see ``OPTIONS``).
``--variants old,own,new`` times engine variants in the same process, one after the other per batch
(each with its own warm-up round): ``old`` = prefill and scoring through transformers' forward and
decode attention over the whole cache bucket (the engine before issue 22 item 1, except that the
merged q/k/v and gate/up decode GEMMs are fixed when the engine is built), ``own`` = prefill
and scoring through the fast path's own compiled layer, ``new`` = that plus decode attention over the
live part of the cache (the shipped default). The profile and the agreement checks use the last one.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_replay import Shape, golden_set_of, random_llama, token_agreement  # noqa: E402
from probes.engines.fast_decode import FUSED_MIN_ROWS, PASS_GRAPH_MAX_ROWS  # noqa: E402

LINES: list[str] = []

CLASSES = (  # first match wins; names lowercased
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention", "softmax_warp")),
    ("FP8 quantisation", ("quant_count", "clamp", "quant_kernel")),
    ("log-softmax / argmax", ("log_softmax", "logsumexp", "argmax", "_softmax", "max_", "gather")),
    ("GEMM", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "matmul", "splitk", "sm90", "wgmma", "_mm_")),
    ("copy / cat / index", ("copy", "cat", "index", "fill", "memcpy", "memset", "embedding", "where")),
    ("norm / rope / elementwise", ("triton", "elementwise", "vectorized", "reduce", "mean", "pow", "rsqrt")),
)


OUT_FILE: Path | None = None


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    if OUT_FILE is not None:  # written as it goes: a call cut off at its limit still returns what ran
        OUT_FILE.write_text("\n".join(LINES) + "\n")


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


VARIANTS = {"old": (False, 0), "own": (True, 0), "new": (True, 128)}  # (own_forward, live_window)
#: options added to a variant with "+" (without one: off): q1 = one quantised input for q/k/v and gate/up
#: in prefill/scoring (``share_quant``), gqa = decode attention ``attend_gqa`` (else ``attend``), head8 =
#: FP8 lm_head (FP8 engine only), nocount = no saturation count (a bound on what counting costs)
#: s8 = saturation counted on every 8th position (``saturation_stride``; else every token)
#: tri = decode attention through the Triton kernel of ``probes.decode_attention`` (fp16 cache, both engines);
#: kv8 = FP8 K/V cache with per-head scales for the FP8 engine (its decode attention: that kernel; the
#: FP16 engine keeps its fp16 cache and SDPA unless ``tri``)
#: tg = the FP8 engine's decode products through the Triton kernel of ``probes.fp8_gemm`` (else cuBLAS)
#: fq = prefill/scoring quantise each FP8 input in one kernel with its norm, residual add or SiLU*up and
#: count it there (``probes.fp8_fused``), in every pass; else inductor's kernels and the separate count.
#: The engine's default since 2026-12-04: fq in passes of ``FUSED_MIN_ROWS`` positions and more (at
#: this bench's prompts: batch 64 and 128 = "new+fq", batch 16 = "new")
#: loop = each pass's saturation counts added per FP8 module (2 small adds each, the engine before the
#: one counter store of 2026-12-04); else in one store
#: auto = the fused quantisers where the engine's own rule puts them (passes of ``FUSED_MIN_ROWS`` positions
#: and more; 0 since 2026-12-07, so "auto" is "fq" now): "new+auto" is the engine as shipped at every batch
#: rkv = prefill/scoring attention on K/V repeated per query head (the engine before 2026-12-06's SDPA
#: ``enable_gqa``, ``fast_forward.SDPA_GQA``)
#: nopg = prefill and scoring passes never captured as CUDA graphs (the engine before 2026-12-07's pass
#: graphs; else a pass of at most ``PASS_GRAPH_MAX_ROWS`` positions is captured when its shape repeats)
OPTIONS = ("q1", "gqa", "head8", "nocount", "s8", "tri", "kv8", "tg", "fq", "loop", "auto", "rkv", "nopg")
HEADS: dict[int, tuple[Any, Any]] = {}  # id(engine) -> (its own lm_head module, the FP8 one)


def set_variant(engines: list[Any], name: str) -> None:
    from probes.engines import fast_forward

    base, *opts = name.split("+")
    own, window = VARIANTS[base]
    for o in opts:
        if o not in OPTIONS:
            raise ValueError(f"unknown variant option {o!r} (one of {OPTIONS})")
    fast_forward.SDPA_GQA = "rkv" not in opts
    for eng in engines:
        fd = eng.fast_decoder
        if fd is None:
            continue
        fd.own_forward, fd.live_window = own, window
        fd.count_saturation = "nocount" not in opts
        fd.saturation_stride = 8 if "s8" in opts else 1
        fd._bind_saturation()
        if "loop" in opts:
            fd._sat_store = None
        # every option set explicitly: a variant does not inherit the previous one's
        attn = "gqa" if "gqa" in opts else "triton" if "tri" in opts else "sdpa"
        kv = "fp8" if "kv8" in opts and eng.precision == "fp8" else "auto"
        fd.set_options(share_quant="q1" in opts, attention=attn, kv_cache=kv,
                       gemm="triton" if "tg" in opts else "cublas", fused_quant="fq" in opts or "auto" in opts)
        # "fq": every pass; "auto": the engine's default, passes of FUSED_MIN_ROWS positions and more
        fd.fused_min_rows = FUSED_MIN_ROWS if "auto" in opts else 0
        fd.pass_graph_max_rows = 0 if "nopg" in opts else PASS_GRAPH_MAX_ROWS
        if id(eng) in HEADS:
            own_head, head8 = HEADS[id(eng)]
            mod = head8 if "head8" in opts else own_head
            eng.model.lm_head = mod  # the eager path (the agreement check) uses the same head
            fd.set_head(mod)


def gemm_table(batches: list[int], reps: int = 20) -> None:
    """Each decode GEMM of the 8B shape alone (CUDA graph of ``reps`` products over 3 weight copies,
    so no weight is re-read from L2): FP16 ``F.linear`` vs FP8 ``_scaled_mm`` (fp16 out; float32 out as
    the merged decode GEMMs use; fast accumulation), ms and weight GB/s."""
    from bench.gpu_fp8_gemm import timed
    from probes.fp8 import FP8_DTYPE

    dev = "cuda"
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate+up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    one = torch.ones(1, device=dev)

    say("| GEMM | M | FP16 ms (GB/s) | FP8 fp16-out ms (GB/s) | FP8 fp32-out ms | FP8 fast-accum ms | FP16/FP8 |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (n, k) in shapes.items():
        w16 = [torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for _ in range(3)]
        w8 = [w.to(FP8_DTYPE) for w in w16]
        for m in batches:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            x8 = x.to(FP8_DTYPE)

            def f16(i: int = 0, x: torch.Tensor = x, w: list[torch.Tensor] = w16) -> torch.Tensor:
                return torch.nn.functional.linear(x, w[i])

            def f8(i: int = 0, x8: torch.Tensor = x8, w: list[torch.Tensor] = w8, out: Any = torch.float16,
                   fast: bool = False) -> torch.Tensor:
                return torch._scaled_mm(x8, w[i].t(), scale_a=one, scale_b=one, out_dtype=out, use_fast_accum=fast)

            t16, t8 = timed(f16, reps), timed(f8, reps)
            t8f = timed(lambda i=0: f8(i, out=torch.float32), reps)
            t8a = timed(lambda i=0: f8(i, fast=True), reps)
            say(f"| {name} {n}x{k} | {m} | {t16:.4f} ({2 * n * k / t16 / 1e6:.0f}) | {t8:.4f} ({n * k / t8 / 1e6:.0f}) | "
                f"{t8f:.4f} | {t8a:.4f} | {t16 / t8:.2f} |")
    torch.cuda.empty_cache()


#: launch configurations (keys per block, warps, stages) timed by ``attention_table``
#: (and programs per SM the key-range splits aim at)
ATTN_CONFIGS = ((64, 4, 3, 2), (32, 4, 3, 2), (64, 4, 4, 2), (32, 4, 4, 2), (128, 4, 2, 2), (64, 4, 3, 8),
                (32, 4, 3, 8), (64, 4, 3, 16))


def attention_table(batches: list[int], live: int = 512, reps: int = 20) -> None:
    """The decode attention alone at the 8B shape (32 query / 8 K/V heads of 128), keys [pad, slot] of
    [0, live) with random left pads: cuDNN SDPA as the engine calls it (``attend``, K/V fp16, mask
    tensor), the Triton kernel on the fp16 cache, and on an FP8 cache. Each checked against a float64
    reference on fresh random inputs (max abs error; FP8 against the dequantised cache and the fp16
    one), then timed in a CUDA graph of ``reps`` calls over 3 cache copies (ms per call, and GB/s
    of the K/V bytes the valid keys hold)."""
    import probes.decode_attention as da
    from bench.gpu_fp8_gemm import timed
    from probes.decode_attention import decode_attention, dequant_kv, kv_scales, quant_kv
    from probes.engines.fast_decode import attend

    dev, nh, kvh, d = "cuda", 32, 8, 128
    rows: list[str] = []
    for b in batches:
        g = torch.Generator(device=dev).manual_seed(b)
        q = torch.randn(b, nh, d, device=dev, dtype=torch.float16, generator=g)
        kc = [torch.randn(b, kvh, live, d, device=dev, dtype=torch.float16, generator=g) * 2 for _ in range(3)]
        vc = [torch.randn(b, kvh, live, d, device=dev, dtype=torch.float16, generator=g) for _ in range(3)]
        ks = [kv_scales(k) for k in kc]
        vs = [kv_scales(v) for v in vc]
        k8 = [quant_kv(k, s) for k, s in zip(kc, ks, strict=True)]
        v8 = [quant_kv(v, s) for v, s in zip(vc, vs, strict=True)]
        slot = torch.tensor([live - 5], device=dev)
        pad = torch.randint(0, live // 2, (b,), device=dev, generator=g)
        idx = torch.arange(live, device=dev)
        kmask = (idx[None] >= pad[:, None]) & (idx[None] <= slot)
        one = torch.ones(1, device=dev)

        def ref64(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qq = q.double().view(b, kvh, nh // kvh, d)  # noqa: B023
            sc = torch.einsum("bhrd,bhtd->bhrt", qq, k.double()) * d ** -0.5
            sc = sc.masked_fill(~kmask[:, None, None], float("-inf")).softmax(-1)  # noqa: B023
            return torch.einsum("bhrt,bhtd->bhrd", sc, v.double()).reshape(b, nh * d)  # noqa: B023

        r16 = ref64(kc[0], vc[0])
        r8 = ref64(dequant_kv(k8[0], ks[0]), dequant_kv(v8[0], vs[0]))
        outs = {}
        for name, fn in (("sdpa", lambda i: attend(q, kc[i], vc[i], kmask)),  # noqa: B023 - called at once
                         ("t16", lambda i: decode_attention(q, kc[i], vc[i], one, one, slot, pad, live)),  # noqa: B023 - called at once
                         ("t8", lambda i: decode_attention(q, k8[i], v8[i], ks[i], vs[i], slot, pad, live))):  # noqa: B023 - called at once
            o = fn(0)
            torch.cuda.synchronize()
            assert torch.isfinite(o).all(), name
            outs[name] = o.double()
        e_s = (outs["sdpa"] - r16).abs().max().item()
        e_16 = (outs["t16"] - r16).abs().max().item()
        e_8 = (outs["t8"] - r8).abs().max().item()
        e_816 = (outs["t8"] - r16).abs().max().item()

        t_s = timed(lambda i: attend(q, kc[i], vc[i], kmask), reps)  # noqa: B023 - called at once
        best: dict[bool, tuple[float, tuple[int, int, int, int]]] = {}
        tries = []
        for cfg in ATTN_CONFIGS:  # pick each batch's launch configuration (used by the engines after this)
            for fp8, fn in ((False, lambda i: decode_attention(q, kc[i], vc[i], one, one, slot, pad, live)),  # noqa: B023 - called at once
                            (True, lambda i: decode_attention(q, k8[i], v8[i], ks[i], vs[i], slot, pad, live))):  # noqa: B023 - called at once
                da.TUNED[(b, fp8)] = cfg
                t = timed(fn, reps)
                tries.append(f"{'fp8' if fp8 else 'fp16'} {cfg} {t:.4f}")
                if fp8 not in best or t < best[fp8][0]:
                    best[fp8] = (t, cfg)
        da.TUNED[(b, False)], da.TUNED[(b, True)] = best[False][1], best[True][1]
        say(f"batch {b} configs (block, warps, stages, programs per SM) ms: " + "; ".join(tries))
        t_16, t_8 = best[False][0], best[True][0]
        valid = int(kmask.sum().item())
        kv16 = valid * kvh * d * 2 * 2  # K and V, fp16
        rows.append(f"| {b} | {live} | {valid / b:.0f} per row | {t_s:.4f} | {t_16:.4f} ({kv16 / t_16 / 1e6:.0f}) "
            f"{best[False][1]} | {t_8:.4f} ({kv16 / 2 / t_8 / 1e6:.0f}) {best[True][1]} | {e_s:.2e} / {e_16:.2e} / {e_8:.2e} / {e_816:.2e} | "
            f"{t_s / t_8:.2f} |")
    say("| batch | live | valid keys | SDPA ms | Triton fp16 ms (GB/s) config | Triton FP8 ms (GB/s) config | "
        "max err SDPA / Triton fp16 / FP8 vs dequant / FP8 vs fp16 | SDPA / FP8 |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        say(r)
    torch.cuda.empty_cache()


def prefill_attention_table(reps: int = 10) -> None:
    """The whole-sequence attention alone at the 8B shape (32 query / 8 K/V heads of 128), left-padded
    rows with the engine's mask (``fast_forward.sequence_inputs``): K/V repeated per query head (the
    engine before) vs SDPA's ``enable_gqa``; max difference over valid positions, ms per call, and the
    kernels each runs (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    from probes.engines import fast_forward as ff

    dev, nh, kvh, d = "cuda", 32, 8, 128
    say("| batch | length | repeated K/V ms | enable_gqa ms | ratio | max diff (valid) | kernels (enable_gqa) |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    for b, n in ((16, 128), (16, 336), (64, 400), (128, 400), (128, 464)):
        g = torch.Generator(device=dev).manual_seed(b * n)
        q = torch.randn(b, nh, n, d, device=dev, dtype=torch.float16, generator=g)
        k = torch.randn(b, kvh, n, d, device=dev, dtype=torch.float16, generator=g)
        v = torch.randn(b, kvh, n, d, device=dev, dtype=torch.float16, generator=g)
        mask = torch.ones(b, n, dtype=torch.long, device=dev)
        pads = torch.randint(0, n // 2, (b,), device=dev, generator=g)
        mask[torch.arange(n, device=dev)[None] < pads[:, None]] = 0
        cos_t = torch.ones(n, d, device=dev, dtype=torch.float16)
        _, _, amask = ff.sequence_inputs(mask, cos_t, cos_t)
        res, ms = {}, {}
        for gqa in (False, True):
            ff.SDPA_GQA = gqa
            res[gqa] = ff.attention(q, k, v, amask)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                ff.attention(q, k, v, amask)
            torch.cuda.synchronize()
            ms[gqa] = (time.perf_counter() - t0) / reps * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ff.attention(q, k, v, amask)
            torch.cuda.synchronize()
        names = sorted({e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"})
        valid = mask.bool()[:, :, None]
        diff = ((res[True] - res[False]).abs() * valid).max().item()
        say(f"| {b} | {n} | {ms[False]:.3f} | {ms[True]:.3f} | {ms[True] / ms[False]:.2f} | {diff:.2e} | "
            f"{'; '.join(names)} |")
    ff.SDPA_GQA = True
    torch.cuda.empty_cache()


def kv_store_check() -> None:
    """The FP8 cache's prompt writer on the GPU (``store_prompt_kv``: Triton) against the eager formula
    (``quant_kv_pair``) on fresh random K/V in forward_layer's layout: scales and bits equal?"""
    from probes.decode_attention import quant_kv_pair, store_prompt_kv

    g = torch.Generator(device="cuda").manual_seed(7)
    for b, n in ((16, 333), (128, 401)):
        k = (torch.randn(b, n, 8, 128, device="cuda", dtype=torch.float16, generator=g) * 3).transpose(1, 2)
        v = torch.randn(b, 8, n, 128, device="cuda", dtype=torch.float16, generator=g)
        kc = torch.zeros(b, 8, 512, 128, device="cuda", dtype=torch.uint8)
        vc = torch.zeros_like(kc)
        ks, vs = torch.zeros(8, device="cuda"), torch.zeros(8, device="cuda")
        store_prompt_kv(k, v, kc, vc, ks, vs)
        k8, v8, s_k, s_v = quant_kv_pair(k, v)
        diff = int((kc[:, :, :n] != k8).sum()) + int((vc[:, :, :n] != v8).sum())
        say(f"FP8 cache prompt writer (Triton) vs eager formula, batch {b} x {n} tokens: scales equal "
            f"{torch.equal(ks, s_k) and torch.equal(vs, s_v)}, bits differing {diff} of {2 * k8.numel()}, "
            f"tail untouched {int(kc[:, :, n:].sum()) == 0}")


def run_round(engine: Any, prompts: list[str], refs: list[str], new_tokens: int, batch: int) -> tuple[float, float]:
    """(generate s, score s) over ``prompts`` in chunks of ``batch`` (as replay chunks them)."""
    gen = sco = 0.0
    for s in range(0, len(prompts), batch):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts[s:s + batch], new_tokens)
        t1 = time.perf_counter()
        engine.score(prompts[s:s + batch], refs[s:s + batch])
        t2 = time.perf_counter()
        gen += t1 - t0
        sco += t2 - t1
    return gen, sco


def profile_round(engine: Any, prompts: list[str], refs: list[str], new_tokens: int, batch: int
                  ) -> tuple[float, dict[str, float], list[tuple[str, float]]]:
    """(wall s, kernel s by class, top kernels) of one round under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        run_round(engine, prompts, refs, new_tokens, batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    by_cls: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is None or "CUDA" not in str(dev):
            continue
        us = float(ev.time_range.elapsed_us())
        by_cls[classify(ev.name)] += us / 1e6
        by_name[ev.name] += us / 1e6
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return wall, dict(by_cls), top


def _kernels(fn: Any) -> tuple[float, dict[str, list[float]]]:
    """(wall s, {kernel name: [calls, s]}) of ``fn()`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is None or "CUDA" not in str(dev):
            continue
        out[ev.name][0] += 1
        out[ev.name][1] += float(ev.time_range.elapsed_us()) / 1e6
    return wall, dict(out)


def phase_kernels(eng: Any, label: str, prompts: list[str], refs: list[str], new_tokens: int, b: int,
                  top: int = 22) -> None:
    """Kernels of one batch per phase: prefill (generate 1 token), decode (generate ``new_tokens`` minus
    that, per step), scoring; each kernel's calls and ms; host time = wall - kernel time. Also the
    prefill's host time alone (the loop returning before the GPU is done)."""
    ps, rs = prompts[:b], refs[:b]
    eng.generate(ps, 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.generate(ps, 1)
    t_host = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_all = time.perf_counter() - t0
    w1, k1 = _kernels(lambda: eng.generate(ps, 1))
    wn, kn = _kernels(lambda: eng.generate(ps, new_tokens))
    ws, ks = _kernels(lambda: eng.score(ps, rs))
    steps = max(1, new_tokens - 1)
    dec = {k: [v[0] - k1.get(k, [0, 0])[0], v[1] - k1.get(k, [0, 0])[1]] for k, v in kn.items()}
    for phase, wall, ks_, per in (("prefill", w1, k1, 1), ("decode per step", (wn - w1) / steps, dec, steps),
                                  ("scoring", ws, ks, 1)):
        tot = sum(v[1] for v in ks_.values()) / per
        say(f"{label} batch {b} {phase}: wall {wall * 1e3:.2f} ms, kernels {tot * 1e3:.2f} ms, "
            f"{sum(v[0] for v in ks_.values()) / per:.0f} launches"
            + (f"; prefill alone: host loop {t_host * 1e3:.1f} ms of {t_all * 1e3:.1f} ms" if phase == "prefill" else ""))
        for name, (calls, sec) in sorted(ks_.items(), key=lambda kv: -kv[1][1])[:top]:
            say(f"    {sec / per * 1e3:8.3f} ms {calls / per:6.0f}x  {name[:110]}")


def lm_head_ms(head: torch.Tensor, batch: int, reps: int = 20) -> float:
    """ms of the FP16 lm_head GEMM for ``batch`` rows (CUDA graph of ``reps`` products)."""
    if not torch.cuda.is_available():
        return 0.0
    x = torch.randn(batch, head.shape[1], device=head.device, dtype=head.dtype)
    torch.nn.functional.linear(x, head)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            torch.nn.functional.linear(x, head)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (5 * reps)


def check_against_eager(eng: Any, label: str, prompts: list[str], refs: list[str], variant: str) -> None:
    """Greedy tokens of the fast path vs the eager transformers loop (same weights, 16 prompts x 16
    tokens), and the scoring pass vs transformers' forward (nats per token)."""
    eager = copy.copy(eng)
    eager.fast_decoder = None
    rows = [eng.encode_prompt(p) for p in prompts[:16]]
    fast_out, eager_out = eng._generate_batch(rows, 16), eager._generate_batch(rows, 16)
    agree = token_agreement([t for t, _ in fast_out], [t for t, _ in eager_out])
    first = sum(f[0][0] == e[0][0] for f, e in zip(fast_out, eager_out, strict=True)) / len(rows)
    lp0 = max(abs(f[1][0] - e[1][0]) for f, e in zip(fast_out, eager_out, strict=True))
    own = eng.score(prompts[:16], refs[:16])
    eng.fast_decoder.own_forward = False
    ref_scores = eng.score(prompts[:16], refs[:16])
    set_variant([eng], variant)
    d_tok = [abs(a.logprob_sum - c.logprob_sum) / max(1, a.n_tokens) for a, c in zip(own, ref_scores, strict=True)]
    say(f"{label} ({variant}) fast vs eager, {len(rows)} prompts x 16 tokens: first token {first:.3f} (max "
        f"|dlogprob| {lp0:.4f}), same-history decisions {agree[2]:.4f}, positions {agree[0]:.4f}; scoring own pass "
        f"vs transformers forward: mean |d| {statistics.mean(d_tok):.5f}, max {max(d_tok):.5f} nats/token")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64,128")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-batches", default=None, help="profile only these batches (default: all)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default="new", help="comma-separated: old, own, new (see the docstring)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--gemm", action="store_true", help="first, each decode GEMM alone (FP16 vs FP8)")
    ap.add_argument("--attn", action="store_true", help="first, the decode attention kernels alone (checked)")
    ap.add_argument("--prefill-attn", action="store_true",
                    help="first, the prefill/scoring attention alone: K/V repeated vs SDPA enable_gqa")
    ap.add_argument("--tune-gemm", action="store_true",
                    help="first, bench/gpu_fp8_gemm.py's sweep (its fastest configurations used by +tg)")
    ap.add_argument("--kernels", default="", help="per-phase kernel lists at these batches (last variant)")
    args = ap.parse_args(argv)
    global OUT_FILE
    OUT_FILE = Path(args.out) if args.out else None
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.tiny_model import byte_tokenizer

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = Shape(64, 128, 2, 4, 2, 512) if args.smoke else Shape(4096, 14336, 32, 32, 8, 128256)
    batches = [2, 4] if args.smoke else [int(b) for b in args.batches.split(",")]
    dtype = torch.float16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = random_llama(shape, device, dtype)
    tok = byte_tokenizer()
    dt = str(dtype).split(".")[1]
    fp16 = TorchEngine(precision="fp16", model=model, tokenizer=tok, device=device, dtype=dt,
                       batch_size=max(batches), name="fp16", fast="on")
    gs, pool = golden_set_of(2 * max(batches), args.new_tokens, stop=())
    prompts_all = [gs.render(it) for it in gs.items]
    refs_all = [it.reference for it in gs.items]
    amax = calibrate_engine(fp16, [p + r for p, r in zip(prompts_all[:pool], refs_all[:pool], strict=True)])
    # the FP8 lm_head and K/V cache (the engine's defaults on CUDA since 2026-12-06) are variant options here
    fp8 = TorchEngine(precision="fp8", model=copy.deepcopy(model), tokenizer=tok, device=device, dtype=dt,
                      batch_size=max(batches), calibration=amax, name="fp8", fast="on", fp8_lm_head=False,
                      fp8_kv_cache=False)
    if any("head8" in v for v in args.variants.split(",")):
        from probes.fp8 import Fp8Linear

        HEADS[id(fp8)] = (fp8.model.lm_head, Fp8Linear.from_linear(fp8.model.lm_head, amax["lm_head"], name="lm_head"))
    say(f"# FP8 vs FP16 per component ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch "
        f"{torch.__version__}); shape hidden {shape.hidden}, {shape.layers} layers, inter {shape.inter}, "
        f"{shape.heads}/{shape.kv_heads} heads, vocab {shape.vocab}; built in {time.perf_counter() - t0:.1f} s; "
        f"{args.new_tokens} new tokens, no stop strings; engine: {fp8.fast_reason}")
    if args.gemm and device == "cuda":
        gemm_table(batches)
    if args.attn and device == "cuda":
        attention_table(batches)
    if args.prefill_attn and device == "cuda":
        prefill_attention_table()
    if args.tune_gemm and device == "cuda":
        from bench.gpu_fp8_gemm import sweep

        sweep(batches, say=say)
    if "kv8" in args.variants and device == "cuda":
        kv_store_check()
    summary = []
    variants = args.variants.split(",")
    for b in batches:
        n = 2 * b
        prompts, refs = prompts_all[:n], refs_all[:n]
        for eng in (fp16, fp8):
            eng.batch_size = b
            if eng.fast_decoder is not None:
                eng.fast_decoder.max_batch = b
        for variant in variants:
            set_variant([fp16, fp8], variant)
            t_w = time.perf_counter()
            for _ in range(2):  # warm-up: compile + capture (a pass is captured when its shape comes again)
                run_round(fp16, prompts, refs, args.new_tokens, b)
                run_round(fp8, prompts, refs, args.new_tokens, b)
            t_w = time.perf_counter() - t_w
            for eng in (fp16, fp8):
                if eng.fast_decoder is not None:
                    eng.fast_decoder.stats = dict.fromkeys(eng.fast_decoder.stats, 0.0)
            times: dict[str, list[tuple[float, float]]] = {"fp16": [], "fp8": []}
            for r in range(args.rounds):
                order = (("fp16", fp16), ("fp8", fp8)) if r % 2 == 0 else (("fp8", fp8), ("fp16", fp16))
                for name, eng in order:
                    times[name].append(run_round(eng, prompts, refs, args.new_tokens, b))
            med = {k: (statistics.median(g for g, _s in v), statistics.median(s for _g, s in v))
                   for k, v in times.items()}
            st = {k: e.fast_decoder.stats if e.fast_decoder else {} for k, e in (("fp16", fp16), ("fp8", fp8))}
            # decode_s / steps: the time of one step of the whole batch (each step serves every row)
            ms_step = {k: (s["decode_s"] / s["steps"] * 1000 if s.get("steps") else 0.0) for k, s in st.items()}
            pre = {k: s.get("prefill_s", 0.0) / max(1, args.rounds) for k, s in st.items()}
            ratios = [sum(g8) / sum(g16) for g8, g16 in zip(times["fp8"], times["fp16"], strict=True)]
            eng16, eng8 = sum(med["fp16"]), sum(med["fp8"])
            say(f"batch {b} variant {variant}: FP16 {eng16:.3f} s (generate {med['fp16'][0]:.3f}, of it prefill "
                f"{pre['fp16']:.3f} / score {med['fp16'][1]:.3f}), FP8 {eng8:.3f} s (generate {med['fp8'][0]:.3f}, "
                f"prefill {pre['fp8']:.3f} / score {med['fp8'][1]:.3f}): FP8/FP16 {eng8 / eng16:.3f}, rounds "
                f"{', '.join(f'{x:.3f}' for x in ratios)}; decode ms/step {ms_step['fp16']:.2f} / "
                f"{ms_step['fp8']:.2f}; warm-up rounds {t_w:.1f} s; passes replayed as graphs "
                f"{st['fp16'].get('pass_replays', 0):.0f} / {st['fp8'].get('pass_replays', 0):.0f}")
            summary.append((b, n, variant, eng16, eng8, ms_step, ratios))
            if (b == batches[0] and variant != variants[-1] and any(o in variant for o in ("tri", "kv8", "tg"))
                    and device == "cuda"):
                for label, eng in (("FP16", fp16), ("FP8", fp8)):
                    check_against_eager(eng, label, prompts, refs, variant)
        if device == "cuda" and str(b) in args.kernels.split(","):
            for label, eng in (("FP16", fp16), ("FP8", fp8)):
                phase_kernels(eng, label, prompts, refs, args.new_tokens, b)
        if b == batches[0]:  # the same 16 prompts at every batch: checked once
            for label, eng in (("FP16", fp16), ("FP8", fp8)):
                check_against_eager(eng, label, prompts, refs, variants[-1])
        profile_these = [int(x) for x in args.profile_batches.split(",")] if args.profile_batches else batches
        if not args.no_profile and b in profile_these:
            head = fp16.model.lm_head.weight
            say(f"lm_head GEMM alone (FP16, {shape.vocab} x {shape.hidden}): {lm_head_ms(head, b):.3f} ms per step "
                f"at batch {b}")
            rows_out = {}
            for name, eng in (("fp16", fp16), ("fp8", fp8)):
                rows_out[name] = profile_round(eng, prompts, refs, args.new_tokens, b)
            classes = [c for c, _k in CLASSES] + ["other"]
            say("| component (kernel s) | FP16 | FP8 | FP16/FP8 |")
            say("| --- | --- | --- | --- |")
            for c in classes:
                a, f = rows_out["fp16"][1].get(c, 0.0), rows_out["fp8"][1].get(c, 0.0)
                if a or f:
                    say(f"| {c} | {a:.3f} | {f:.3f} | {a / f if f else float('inf'):.2f} |")
            k16, k8 = sum(rows_out["fp16"][1].values()), sum(rows_out["fp8"][1].values())
            say(f"| all kernels | {k16:.3f} | {k8:.3f} | {k16 / k8 if k8 else 0:.2f} |")
            w16, w8 = rows_out["fp16"][0], rows_out["fp8"][0]
            say(f"| host / idle (wall {w16:.2f} / {w8:.2f} minus kernels) | {w16 - k16:.3f} | {w8 - k8:.3f} | |")
            for name in ("fp16", "fp8"):
                say(f"top {name} kernels: " + "; ".join(f"{k[:70]} {v:.3f}" for k, v in rows_out[name][2]))
    say("\n| batch | prompts | variant | FP16 engine s | FP8 engine s | FP8 / FP16 (rounds) | speed-up | "
        "decode ms/step FP16 / FP8 |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for b, n, variant, e16, e8, ms, ratios in summary:
        say(f"| {b} | {n} | {variant} | {e16:.2f} | {e8:.2f} | {e8 / e16:.3f} ({', '.join(f'{x:.3f}' for x in ratios)})"
            f" | {e16 / e8:.2f}x | {ms['fp16']:.2f} / {ms['fp8']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
