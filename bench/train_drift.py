"""Train a small byte-level Llama on the machine's own text, then measure FP8 drift through replay.

On the GPU (nothing is downloaded): the training text is the Python sources and docs of the installed
packages (site-packages); files are split into train / held-out by a hash of their path. A golden set
is cut from held-out files (prompt = 192 bytes, reference = the next 64). Then, through the product's
own path (``probes.golden_replay.replay`` with two ``TorchEngine``s, the fast decode path):

* FP16 vs FP8 with calibrated static scales, per-tensor weights; per-row weights; stale scales x0.25;
* output agreement, ROUGE-L / chrF / exact-match drift vs the reference and its item-level
  distribution, bits per byte of the reference (teacher-forced), FP8 saturation;
* fast path vs the eager transformers loop, FP16 greedy tokens.

Writes ``--out``/fp8_drift_trained.json (per-item deltas, the noise model for bench/decisions.py),
drift.txt and, with ``--small``, drift_tiny.tar: a smaller model trained in the same run (fp16
safetensors + its FP8 calibration), small enough to ship.

    python bench/train_drift.py --out $OUT --seconds 200 --small          # on the GPU
    python bench/train_drift.py --out /tmp/d --smoke                      # CPU: every code path, tiny
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import shutil
import statistics
import sys
import sysconfig
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_replay import token_agreement  # noqa: E402
from probes.engines.torch_engine import TorchEngine, calibrate_engine  # noqa: E402
from probes.tiny_model import byte_tokenizer  # noqa: E402

LINES: list[str] = []
BYTE_OFFSET = 3  # ByT5 layout: pad 0, eos 1, unk 2, byte b -> b + 3
OUT: Path | None = None


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    if OUT is not None:
        (OUT / "drift.txt").write_text("\n".join(LINES) + "\n")


# -- data ------------------------------------------------------------------------------------------
def collect_text(max_bytes: int, max_file: int = 200_000) -> tuple[list[bytes], list[bytes]]:
    """(train files, held-out files) from site-packages: .py/.md/.rst/.txt, split by path hash (1 in 40)."""
    root = Path(sysconfig.get_paths()["purelib"])
    train: list[bytes] = []
    held: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".md", ".rst", ".txt") or not path.is_file():
            continue
        try:
            data = path.read_bytes()[:max_file]
        except OSError:
            continue
        if len(data) < 512 or b"\0" in data:
            continue
        bucket = int(hashlib.sha1(str(path.relative_to(root)).encode()).hexdigest(), 16) % 40
        (held if bucket == 0 else train).append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return train, held


def make_items(held: list[bytes], n: int, prompt_len: int, ref_len: int, seed: int) -> list[dict[str, str]]:
    """Golden items from held-out files: a prompt starting at a line start, and the bytes that follow."""
    import random

    rng = random.Random(seed)
    items: list[dict[str, str]] = []
    tries = 0
    while len(items) < n and tries < 50 * n:
        tries += 1
        data = rng.choice(held)
        if len(data) < prompt_len + ref_len + 2:
            continue
        start = data.find(b"\n", rng.randrange(0, len(data) - prompt_len - ref_len - 1)) + 1
        chunk = data[start:start + prompt_len + ref_len]
        if len(chunk) < prompt_len + ref_len:
            continue
        try:
            prompt, ref = chunk[:prompt_len].decode(), chunk[prompt_len:].decode()
        except UnicodeDecodeError:
            continue
        if ref.strip() and prompt.strip():
            items.append({"id": f"heldout-{len(items):04d}", "prompt": prompt, "reference": ref})
    return items


def golden_set(items: list[dict[str, str]], max_new: int) -> Any:
    from probes.golden import GoldenItem, GoldenSet, Manifest

    manifest = Manifest.model_validate({
        "schema": 1, "name": "drift-heldout", "domain": "code",
        "description": "held-out Python sources and docs of the GPU machine's installed packages",
        "languages": ["en"], "routes": ["drift/*"], "template": "{prompt}", "generation": {"max_new_tokens": max_new},
        "metrics": ["rougeL", "chrf", "exact_match", "bits_per_byte", "agreement_rougeL"]})
    gi = tuple(GoldenItem(id=it["id"], prompt=it["prompt"], reference=it["reference"]) for it in items)
    return GoldenSet(path=Path("drift-heldout"), manifest=manifest, items=gi)


# -- training --------------------------------------------------------------------------------------
def build(hidden: int, layers: int, heads: int, kv: int, inter: int, device: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=384, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=1024,
                      pad_token_id=0, bos_token_id=None, eos_token_id=1, tie_word_embeddings=False,
                      rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg).to(device)


def optimise(model: Any, opt: Any, x: torch.Tensor, amp: str | None) -> torch.Tensor:
    """One optimiser step on the next-token loss of ``x`` (gradients clipped at 1); ``amp``: the device type to
    autocast to bfloat16 on, None for float32. Returns the loss."""
    if amp is None:
        loss = model(input_ids=x, labels=x).loss
    else:
        with torch.autocast(device_type=amp, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def train(model: Any, data: torch.Tensor, *, seconds: float, max_steps: int, batch: int, seq: int,
          lr: float, device: str, label: str) -> dict[str, float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    warm, t0, step, loss_v = 100, time.perf_counter(), 0, float("nan")
    est_steps = max_steps
    while step < max_steps:
        elapsed = time.perf_counter() - t0
        if elapsed > seconds:
            break
        if step == 50:  # from the measured speed, the number of steps the budget allows (for the schedule)
            est_steps = min(max_steps, int(50 * seconds / max(elapsed, 1e-3)))
        frac = min(1.0, step / max(1, est_steps))
        scale = min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(seq + 1)[None, :]
        x = (data[idx].long() + BYTE_OFFSET).to(device, non_blocking=True)
        loss = optimise(model, opt, x, "cuda" if device == "cuda" else "cpu")
        step += 1
        if step % 250 == 0 or step == 1:
            loss_v = float(loss.item())
            say(f"  {label} step {step}: loss {loss_v:.3f} ({loss_v / math.log(2):.3f} bits/byte), "
                f"{time.perf_counter() - t0:.0f} s")
    loss_v = float(loss.item())
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - t0, "train_loss": loss_v,
            "train_bits_per_byte": loss_v / math.log(2)}


# -- drift -----------------------------------------------------------------------------------------
def dist(deltas: list[float]) -> dict[str, Any]:
    n = len(deltas)
    absd = sorted((abs(d) for d in deltas), reverse=True)
    mass = sum(absd)
    top = max(1, n // 10)
    q = statistics.quantiles(deltas, n=20) if n >= 20 else []
    return {"n": n, "mean": statistics.fmean(deltas) if n else None,
            "share_zero": sum(1 for d in deltas if abs(d) < 1e-12) / max(1, n),
            "share_below_-0.2": sum(1 for d in deltas if d < -0.2) / max(1, n),
            "share_above_+0.2": sum(1 for d in deltas if d > 0.2) / max(1, n),
            "p05": q[0] if q else None, "p95": q[-1] if q else None,
            "top10pct_share_of_abs_mass": sum(absd[:top]) / mass if mass else 0.0}


def _decode_all(engine: Any, rows: list[list[int]], batch: int, max_new: int) -> list[list[int]]:
    return [t for i in range(0, len(rows), batch) for t, _ in engine._generate_batch(rows[i:i + batch], max_new)]


def _attend_fp16_scores(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kmask: torch.Tensor) -> torch.Tensor:
    """The fast path's attention before 2026-12-01 (scores rounded to fp16 before the softmax), for comparison."""
    b, nh, d = q.shape
    kvh = kc.shape[1]
    scores = torch.matmul(q.view(b, kvh, nh // kvh, d), kc.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(~kmask[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), vc).reshape(b, nh * d)


def fast_equivalence(fp16: Any, rows: list[list[int]], batch: int, max_new: int, label: str) -> dict[str, Any]:
    """FP16 greedy tokens of the fast path vs the eager transformers loop on the same weights, beside
    the eager loop's own batch-size sensitivity and the previous attention kernel; for each row that
    diverges, the eager top-1 minus top-2 log-probability where it did (a near-tie or a real gap)."""
    from probes.engines import fast_decode

    eager = copy.copy(fp16)
    eager.fast_decoder = None
    got = _decode_all(fp16, rows, batch, max_new)
    want = _decode_all(eager, rows, batch, max_new)
    fast = token_agreement(got, want)
    floor = token_agreement(_decode_all(eager, rows, 8, max_new), want)
    gaps = []
    with torch.inference_mode():
        for row, x, y in zip(rows, got, want, strict=True):
            k = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), None)
            if k is None:
                continue
            ids = torch.tensor([row + y[:k]], device=fp16.device)
            top = torch.log_softmax(fp16.model(input_ids=ids).logits[0, -1].float(), -1).topk(2).values
            gaps.append(float(top[0] - top[1]))
    old_fn, prev = fast_decode.attend, None
    try:  # the same decoder with the previous attention (recompiled: dynamo guards on the global)
        torch._dynamo.reset()
        fast_decode.attend = _attend_fp16_scores
        old = copy.copy(fp16)
        old.fast_decoder = None
        old._setup_fast("on", None, None)
        prev = token_agreement(_decode_all(old, rows, batch, max_new), want)
    finally:
        fast_decode.attend = old_fn
        torch._dynamo.reset()
    gaps.sort()
    say(f"{label}: fast vs eager FP16 greedy tokens, {len(rows)} prompts x {max_new}: same token at {fast[0]:.2%} "
        f"of positions, {fast[1]:.2%} before each row's first difference, {fast[2]:.2%} of the decisions made from "
        f"the same history; {len(gaps)} rows diverge, eager top-1 - top-2 logprob there: median "
        f"{gaps[len(gaps) // 2] if gaps else float('nan'):.4f}, max {max(gaps, default=float('nan')):.4f}")
    say(f"{label}: floor, the eager loop at batch 8 vs batch {batch}: {floor[0]:.2%} / {floor[1]:.2%} / {floor[2]:.2%}; "
        f"previous fast attention (fp16-rounded scores) vs eager: {prev[0]:.2%} / {prev[1]:.2%} / {prev[2]:.2%}")
    keys = ("same_position", "before_first_diff", "same_history_decisions")
    return {**dict(zip(keys, fast, strict=True)), "eager_batch8_floor": dict(zip(keys, floor, strict=True)),
            "previous_attention": dict(zip(keys, prev, strict=True)), "diverged_rows": len(gaps),
            "first_diff_top2_gaps": gaps, "prompts": len(rows), "new_tokens": max_new}


def e4m3_kv_in_scoring(engine: Any) -> None:
    """The engine's teacher-forced scoring attends over K/V rounded to e4m3 with the FP8 cache's per-head
    scales (``probes.decode_attention.kv_scales`` over the pass), so bits per byte measure what the
    FP8 K/V cache does to each next-token probability; its generation is unchanged."""
    from probes.decode_attention import dequant_kv, kv_scales, quant_kv
    from probes.engines import fast_forward

    plain = fast_forward.attention

    calls = [0]

    @torch.compiler.disable
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, amask: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        ks, vs = kv_scales(k), kv_scales(v)
        return plain(q, dequant_kv(quant_kv(k, ks), ks).to(k.dtype), dequant_kv(quant_kv(v, vs), vs).to(v.dtype),
                     amask)

    score = engine.score

    def scored(*args: Any, **kwargs: Any) -> Any:
        fast_forward.attention = attention
        try:
            return score(*args, **kwargs)
        finally:
            fast_forward.attention = plain

    engine.score = scored
    engine.kv_scoring_calls = calls


def measure(model: Any, label: str, items: list[dict[str, str]], cal_texts: list[str], max_new: int,
            batch: int, device: str, only: tuple[str, ...] = ()) -> dict[str, Any]:
    from probes.fp8 import Fp8Linear
    from probes.golden_replay import replay

    gs = golden_set(items, max_new)
    tok = byte_tokenizer()
    dt = "float16" if device == "cuda" else "float32"
    model16 = copy.deepcopy(model).to(getattr(torch, dt))
    fp16 = TorchEngine(precision="fp16", model=model16, tokenizer=tok, device=device, dtype=dt, batch_size=batch,
                       name=f"{label}:fp16")
    amax = calibrate_engine(fp16, cal_texts)
    say(f"{label}: engine {fp16.fast_reason}; calibrated {len(amax)} layers over {len(cal_texts)} texts")
    rows = [fp16.encode_prompt(gs.render(it)) for it in gs.items]
    equiv = fast_equivalence(fp16, rows, batch, max_new, label)
    variants = {"fp8 per-tensor": {"fp8_weight_scale": "tensor"}, "fp8 per-row": {"fp8_weight_scale": "row"},
                "fp8 stale x0.25": {"fp8_weight_scale": "tensor", "scale_multiplier": 0.25},
                "fp8 per-tensor + FP8 lm_head": {"fp8_weight_scale": "tensor", "fp8_lm_head": True},
                "fp8 per-tensor + FP8 K/V cache": {"fp8_weight_scale": "tensor", "fp8_kv_cache": True},
                "fp8 per-tensor + Triton decode GEMMs": {"fp8_weight_scale": "tensor", "fp8_gemm": "triton"},
                "fp8 per-tensor + FP8 lm_head + K/V cache + Triton GEMMs": {
                    "fp8_weight_scale": "tensor", "fp8_lm_head": True, "fp8_kv_cache": True, "fp8_gemm": "triton"},
                "fp8 per-tensor + FP8 lm_head + K/V cache": {
                    "fp8_weight_scale": "tensor", "fp8_lm_head": True, "fp8_kv_cache": True},
                # bits/byte see the K/V cache only here: the scoring pass attends over e4m3 K/V too
                "fp8 per-tensor + FP8 K/V cache; K/V e4m3 in scoring": {
                    "fp8_weight_scale": "tensor", "fp8_kv_cache": True, "kv_in_scoring": True},
                "fp8 per-tensor + FP8 lm_head + K/V cache; K/V e4m3 in scoring": {
                    "fp8_weight_scale": "tensor", "fp8_lm_head": True, "fp8_kv_cache": True, "kv_in_scoring": True},
                # the engine's own choice (since 2026-12-06 the head and the K/V cache in FP8 on FP8 hardware)
                "fp8 as shipped": {"fp8_lm_head": "auto", "fp8_kv_cache": "auto"}}
    if only:
        variants = {k: v for k, v in variants.items() if k in only}
    out: dict[str, Any] = {"fast_vs_eager_fp16": equiv,
                           "calibration_texts": len(cal_texts), "variants": {}}
    for name, opts in variants.items():
        # a variant names the options it adds: the head and the K/V cache stay off unless it does (the engine's
        # "auto" turns them on on FP8 hardware)
        opts = {"fp8_lm_head": False, "fp8_kv_cache": False, **opts}
        kv_in_scoring = opts.pop("kv_in_scoring", False)
        fp8 = TorchEngine(precision="fp8", model=copy.deepcopy(model).to(getattr(torch, dt)), tokenizer=tok,
                          device=device, dtype=dt, batch_size=batch, calibration=amax, name=f"{label}:{name}",
                          **opts)
        if kv_in_scoring:
            e4m3_kv_in_scoring(fp8)
        backends = sorted({m.backend for m in fp8.model.modules() if isinstance(m, Fp8Linear)})
        t0 = time.perf_counter()
        rep = replay(gs, fp8, fp16, batch_size=batch, progress=False)
        wall = time.perf_counter() - t0
        sat = fp8.saturation()
        if kv_in_scoring:
            say(f"{name}: {fp8.kv_scoring_calls[0]} layer passes of the scoring attended over e4m3 K/V")
        ok = [it for it in rep.items if not it.failed]
        per_item = []
        for it in ok:
            c, b = it.candidate.scores, it.baseline.scores
            per_item.append({"id": it.id, "rougeL_fp8": c.get("rougeL"), "rougeL_fp16": b.get("rougeL"),
                             "delta_rougeL": c.get("rougeL", 0.0) - b.get("rougeL", 0.0),
                             "delta_chrf": c.get("chrf", 0.0) - b.get("chrf", 0.0),
                             "delta_exact_match": c.get("exact_match", 0.0) - b.get("exact_match", 0.0),
                             "delta_bits_per_byte": c.get("bits_per_byte", 0.0) - b.get("bits_per_byte", 0.0),
                             "agreement_rougeL": it.agreement, "identical": it.candidate.output == it.baseline.output})
        summ = {}
        for metric in ("agreement_rougeL", "rougeL", "chrf", "exact_match", "bits_per_byte"):
            m = rep.summary(metric)
            if m is not None:
                summ[metric] = {"fp8": m.candidate, "fp16": m.baseline, "diff": m.diff_mean, "ci": [m.ci_low, m.ci_high]}
        agree = [p["agreement_rougeL"] for p in per_item if p["agreement_rougeL"] is not None]
        row = {"backend": backends, "wall_s": wall, "measured": rep.measured, "errors": rep.errors,
               "identical_share": sum(p["identical"] for p in per_item) / max(1, len(per_item)),
               "agreement_mean": statistics.fmean(agree) if agree else float("nan"),
               "agreement_p10": statistics.quantiles(agree, n=10)[0] if len(agree) >= 10 else float("nan"),
               "saturation_total": sat.total if sat else None,
               "saturation_max_layer": max(sat.layers.values()) if sat and sat.layers else None,
               "summary": summ, "rougeL_delta_distribution": dist([p["delta_rougeL"] for p in per_item]),
               "chrf_delta_distribution": dist([p["delta_chrf"] for p in per_item]), "items": per_item}
        out["variants"][name] = row
        d = row["rougeL_delta_distribution"]
        bpb = summ.get("bits_per_byte", {})
        if "rougeL" not in summ:
            say(f"| {label} | {name} | no items measured: errors {rep.errors} |")
            out["variants"][name] = row
            fp8.close()
            continue
        say(f"| {label} | {name} | {row['identical_share']:.1%} | {row['agreement_mean']:.3f} / "
            f"{row['agreement_p10']:.3f} | {summ['rougeL']['diff']:+.4f} [{summ['rougeL']['ci'][0]:+.4f}, "
            f"{summ['rougeL']['ci'][1]:+.4f}] | {d['share_zero']:.1%} / {d['share_below_-0.2']:.1%} / "
            f"{d['share_above_+0.2']:.1%} | {d['top10pct_share_of_abs_mass']:.0%} | "
            f"{summ.get('chrf', {}).get('diff', float('nan')):+.3f} | {summ.get('exact_match', {}).get('diff', 0):+.4f} | "
            f"{bpb.get('fp16', float('nan')):.4f} -> {bpb.get('fp8', float('nan')):.4f} | "
            f"{row['saturation_total'] or 0:.3%} (max layer {row['saturation_max_layer'] or 0:.3%}) | {wall:.1f} s |")
        fp8.close()
    fp16.close()
    paired_against(out["variants"], "fp8 per-tensor")
    out["amax"] = amax
    return out


def mean_interval(d: list[float]) -> tuple[float, float, float]:
    """Mean of ``d`` and its 95 % interval (normal; at least two values)."""
    m = statistics.fmean(d)
    half = 1.96 * statistics.stdev(d) / math.sqrt(len(d))
    return m, m - half, m + half


def paired_against(variants: dict[str, Any], base_name: str) -> None:
    """Each variant minus ``base_name``, item by item (the same items, the same FP16 baseline): mean and
    95 % interval of the bits-per-byte and ROUGE-L deltas. What an option adds to FP8's own drift."""
    base = variants.get(base_name)
    if base is None:
        return
    ref = {it["id"]: it for it in base["items"]}
    say(f"paired against '{base_name}' (mean [95% CI] over items): bits/byte delta | ROUGE-L delta")
    for name, row in variants.items():
        if name == base_name:
            continue
        cells = []
        for key in ("delta_bits_per_byte", "delta_rougeL"):
            d = [it[key] - ref[it["id"]][key] for it in row["items"] if it["id"] in ref]
            if len(d) < 2:
                cells.append("n/a")
                continue
            m, lo, hi = mean_interval(d)
            cells.append(f"{m:+.5f} [{lo:+.5f}, {hi:+.5f}]")
        say(f"  {name}: {cells[0]} | {cells[1]}")


def table_header() -> None:
    say("| model | variant | identical outputs | FP8-vs-FP16 ROUGE-L mean / p10 | ROUGE-L vs ref, FP8 - FP16 [95% CI] "
        "| items with delta = 0 / < -0.2 / > +0.2 | top 10% items' share of total abs delta | chrF delta "
        "| exact-match delta | bits/byte FP16 -> FP8 | saturation | replay wall |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def save_small(model: Any, amax: dict[str, float], info: dict[str, Any], out: Path) -> Path:
    from probes.fp8 import save_calibration

    d = out / "drift_tiny"
    d.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    (d / "tiny_model.json").write_text(json.dumps({"tokenizer": "ByT5Tokenizer", "train": info}))
    save_calibration(d, amax, {"source": "bench/train_drift.py", "n_texts": info.get("calibration_texts")})
    tar = out / "drift_tiny.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(d, arcname="drift_tiny")
    shutil.rmtree(d)  # one file back from the device, not a folder of them
    return tar


def main(argv: list[str] | None = None) -> int:
    global OUT  # noqa: PLW0603
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=200.0, help="training budget of the main model")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--small", action="store_true", help="also train the small shippable model")
    ap.add_argument("--small-seconds", type=float, default=45.0)
    ap.add_argument("--items", type=int, default=256)
    ap.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny everything")
    args = ap.parse_args(argv)
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if args.smoke:
        device, max_bytes, batch, seq, n_items, max_new, prompt_len = "cpu", 2_000_000, 8, 128, 12, 16, 96
        big = {"hidden": 64, "layers": 2, "heads": 4, "kv": 2, "inter": 128}
        seconds, steps = 5.0, 30
    else:
        device, max_bytes, batch, seq, n_items, max_new, prompt_len = "cuda", 60_000_000, 96, 512, args.items, 64, 192
        big = {"hidden": 768, "layers": 8, "heads": 12, "kv": 4, "inter": 2048}
        seconds, steps = args.seconds, args.max_steps
    small = {"hidden": 256, "layers": 4, "heads": 4, "kv": 2, "inter": 640}
    train_files, held = collect_text(max_bytes)
    data = torch.frombuffer(bytearray(b"\n".join(train_files)), dtype=torch.uint8)
    items = make_items(held, n_items, prompt_len, 64, seed=1)
    cal_items = make_items(train_files, 32, 448, 64, seed=2)
    cal_texts = [it["prompt"] + it["reference"] for it in cal_items]
    say(f"# FP8 drift on a trained byte-level Llama ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})")
    say(f"text: {len(train_files)} train files ({data.numel() / 1e6:.1f} MB), {len(held)} held-out files; "
        f"{len(items)} golden items ({prompt_len}-byte prompt, 64-byte reference), {max_new} greedy new bytes")
    torch.manual_seed(0)
    results: dict[str, Any] = {"meta": {"device": device, "torch": torch.__version__, "items": len(items),
                                        "prompt_bytes": prompt_len, "reference_bytes": 64, "new_tokens": max_new,
                                        "golden_items": items}, "models": {}}
    specs = [("main", big, seconds, steps)] + ([("small", small, args.small_seconds, 100_000)] if args.small else [])
    header = False
    for label, spec, secs, max_steps in specs:
        model = build(device=device, **spec)
        n_params = sum(p.numel() for p in model.parameters())
        say(f"## {label}: {n_params / 1e6:.1f}M params {spec}; AdamW 1.5e-3, batch {batch} x {seq} bytes, bf16 "
            f"autocast, budget {secs:.0f} s")
        info = train(model, data, seconds=secs, max_steps=max_steps, batch=batch, seq=seq, lr=1.5e-3, device=device,
                     label=label)
        info.update({"params": n_params, **spec})
        say(f"{label}: {info['steps']} steps in {info['seconds']:.0f} s, final train loss {info['train_bits_per_byte']:.3f} "
            f"bits/byte")
        if not header:
            table_header()
            header = True
        only = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        res = measure(model, label, items, cal_texts, max_new, 128 if device == "cuda" else 4, device, only)
        res["train"] = info
        results["models"][label] = res
        if label == "small":
            info["calibration_texts"] = len(cal_texts)
            tar = save_small(model, res["amax"], info, OUT)
            say(f"small model saved: {tar} ({tar.stat().st_size / 1e6:.1f} MB)")
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    (OUT / "fp8_drift_trained.json").write_text(json.dumps(results, indent=1))
    say(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
