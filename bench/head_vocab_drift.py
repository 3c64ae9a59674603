"""Does the FP8 lm_head hold on a model with a real vocabulary? A small Llama with a byte-level BPE vocabulary of
128,256 tokens (Llama 3's size), trained here on the machine's own text, then the FP8 engine with its head in FP16
against the same engine with the head in FP8.

The drift models of docs/DRIFT.md are byte-level (384 tokens), so the FP8 head's effect on a large vocabulary's
tail was not tested when the engine made the head FP8 by default on FP8 hardware (2026-12-06). The CPU is enough:
the engine emulates FP8 products there with the numerics of ``torch._scaled_mm`` (e4m3 inputs, float32 products
and sums), and ``fp8_lm_head=true`` turns the head on where "auto" would not.

1. Text: the Python sources and docs of the installed packages (``bench/train_drift.py``'s ``collect_text``),
   held-out files by a hash of their path.
2. Tokenizer: a byte-level BPE (the ``tokenizers`` library) trained on that text up to ``--vocab`` tokens; the model
   has ``--vocab`` rows whatever the BPE learned (a row it never learned is a never-seen token).
3. Model: a Llama of ``--hidden`` / ``--layers``, untied head, trained for ``--seconds`` (float32 on the CPU).
4. Engines (``probes.engines.torch_engine.TorchEngine``, calibrated on training text): FP16, FP8 with the head in
   FP16 (``fp8_lm_head=false``), FP8 with the head in FP8 (``true``). Measured on held-out items (a prompt of
   ``--prompt-tokens`` tokens and the reference that follows), paired item by item:
   * bits per byte of the reference, teacher-forced (``score``);
   * greedy continuations: ROUGE-L against the reference, and the share of items whose continuation is
     identical to the FP16-head engine's;
   * next-token distributions over every reference position: mean KL divergence from the FP16 engine and the
     share whose top token differs.

    python bench/head_vocab_drift.py --out /tmp/hv --seconds 900      # ~25 min on 2 cores
    python bench/head_vocab_drift.py --out /tmp/hv --smoke            # every step, tiny, ~1 min
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_drift import collect_text, mean_interval, optimise  # noqa: E402

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def tokenizer_for(train: list[bytes], vocab: int) -> tuple[Any, int]:
    """(a transformers fast tokenizer, the vocabulary the BPE learned) trained on ``train``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator((b.decode("utf-8", "replace") for b in train), vocab_size=vocab, min_frequency=2,
                            special_tokens=["<pad>", "<eos>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="<eos>")
    return tok, bpe.get_vocab_size()


def encode_all(tok: Any, files: list[bytes], max_tokens: int) -> torch.Tensor:
    ids: list[int] = []
    for f in files:
        ids.extend(tok(f.decode("utf-8", "replace"), add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.int64)


def items_from(tok: Any, held: list[bytes], n: int, prompt_tokens: int, ref_tokens: int) -> list[tuple[str, str]]:
    """(prompt, reference) texts: ``prompt_tokens`` tokens of a held-out file, then the ``ref_tokens`` after."""
    out: list[tuple[str, str]] = []
    for f in held:
        ids = tok(f.decode("utf-8", "replace"), add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - prompt_tokens - ref_tokens, prompt_tokens + ref_tokens):
            prompt = tok.decode(ids[start:start + prompt_tokens])
            ref = tok.decode(ids[start + prompt_tokens:start + prompt_tokens + ref_tokens])
            if prompt.strip() and ref.strip():
                out.append((prompt, ref))
            if len(out) >= n:
                return out
    return out


def build(vocab: int, hidden: int, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(2, hidden // 64)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=1024,
                      pad_token_id=0, bos_token_id=None, eos_token_id=1, tie_word_embeddings=False,
                      rms_norm_eps=1e-5)
    return LlamaForCausalLM(cfg)


def train(model: Any, data: torch.Tensor, seconds: float, batch: int, seq: int, lr: float) -> dict[str, float]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    t0, step, loss = time.perf_counter(), 0, torch.tensor(float("nan"))
    while time.perf_counter() - t0 < seconds:
        frac = (time.perf_counter() - t0) / seconds
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = data[starts[:, None] + torch.arange(seq + 1)[None, :]]
        loss = optimise(model, opt, x, None)  # float32: bfloat16 on a CPU without AMX is slower
        step += 1
        if step % 50 == 0 or step == 1:
            say(f"  step {step}: loss {float(loss.detach()):.3f} nats/token, {time.perf_counter() - t0:.0f} s")
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - t0, "train_loss": float(loss.detach())}


def next_token_stats(a: Any, b: Any, prompts: list[str], refs: list[str]) -> tuple[float, float]:
    """Over every reference position: mean KL(a || b) of the next-token distributions (nats), and the share
    of positions whose most likely token differs."""
    kl_sum, differ, n = 0.0, 0, 0
    with torch.inference_mode():
        for prompt, ref in zip(prompts, refs, strict=True):
            p_ids, r_ids = a.encode_prompt(prompt), a.encode_continuation(ref)
            ids = torch.tensor([p_ids + r_ids])
            la = torch.log_softmax(a.model(input_ids=ids).logits[0, len(p_ids) - 1:-1].float(), dim=-1)
            lb = torch.log_softmax(b.model(input_ids=ids).logits[0, len(p_ids) - 1:-1].float(), dim=-1)
            kl_sum += float((la.exp() * (la - lb)).sum())
            differ += int((la.argmax(-1) != lb.argmax(-1)).sum())
            n += la.shape[0]
    return kl_sum / max(1, n), differ / max(1, n)


def paired(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Mean of ys - xs, item by item, and its 95 % interval."""
    return mean_interval([y - x for x, y in zip(xs, ys, strict=True)])


def measure(model: Any, tok: Any, cal_texts: list[str], items: list[tuple[str, str]], max_new: int) -> dict[str, Any]:
    from probes.engines.torch_engine import TorchEngine, calibrate_engine
    from probes.metrics import score_pairs

    opts = {"tokenizer": tok, "device": "cpu", "batch_size": 8, "fast": "off"}
    fp16 = TorchEngine(precision="fp16", model=copy.deepcopy(model), **opts)
    amax = calibrate_engine(fp16, cal_texts)
    engines = {"fp16": fp16,
               "fp8, head fp16": TorchEngine(precision="fp8", model=copy.deepcopy(model), calibration=amax,
                                             fp8_lm_head=False, **opts),
               "fp8, head fp8": TorchEngine(precision="fp8", model=copy.deepcopy(model), calibration=amax,
                                            fp8_lm_head=True, **opts)}
    assert "lm_head" in engines["fp8, head fp8"].fp8_layers and "lm_head" not in engines["fp8, head fp16"].fp8_layers
    prompts, refs = [p for p, _ in items], [r for _, r in items]
    bpb: dict[str, list[float]] = {}
    rouge: dict[str, list[float]] = {}
    texts: dict[str, list[str]] = {}
    for name, eng in engines.items():
        scores = eng.score(prompts, refs)
        assert scores is not None
        bpb[name] = [-s.logprob_sum / math.log(2) / max(1, s.n_bytes) for s in scores]
        texts[name] = [g.text for g in eng.generate(prompts, max_new)]
        rouge[name] = [m["rougeL"] for m in score_pairs(refs, texts[name])]
    out: dict[str, Any] = {"items": len(items), "amax_lm_head": amax.get("lm_head")}
    for name in engines:
        out[name] = {"bits_per_byte": statistics.fmean(bpb[name]), "rougeL": statistics.fmean(rouge[name])}
    for a, b in (("fp16", "fp8, head fp16"), ("fp8, head fp16", "fp8, head fp8"), ("fp16", "fp8, head fp8")):
        kl, top1 = next_token_stats(engines[a], engines[b], prompts, refs)
        same = sum(x == y for x, y in zip(texts[a], texts[b], strict=True)) / len(items)
        out[f"{b} vs {a}"] = {"bits_per_byte": paired(bpb[a], bpb[b]), "rougeL": paired(rouge[a], rouge[b]),
                              "kl_nats": kl, "top1_differs": top1, "greedy_identical": same}
    sat = engines["fp8, head fp8"].saturation()
    out["head_saturation"] = sat.layers.get("lm_head") if sat is not None else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--text-mb", type=float, default=60.0, help="training text (the BPE and the model)")
    ap.add_argument("--tokens", type=int, default=8_000_000, help="training tokens kept after encoding")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=900.0, help="training budget")
    ap.add_argument("--items", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--ref-tokens", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="tiny everything: exercises every step")
    args = ap.parse_args(argv)
    if args.smoke:
        args.vocab, args.text_mb, args.tokens, args.hidden, args.layers = 2_000, 2.0, 200_000, 64, 1
        args.seconds, args.items = 10.0, 8
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_files, held = collect_text(int(args.text_mb * 1e6))
    tok, learned = tokenizer_for(train_files, args.vocab)
    say(f"# FP8 lm_head on a {args.vocab:,}-token vocabulary (torch {torch.__version__}, CPU, "
        f"{torch.get_num_threads()} threads)")
    say(f"text {sum(map(len, train_files)) / 1e6:.1f} MB in {len(train_files)} files, held out {len(held)}; "
        f"BPE learned {learned:,} tokens ({time.perf_counter() - t0:.0f} s)")
    data = encode_all(tok, train_files, args.tokens)
    model = build(args.vocab, args.hidden, args.layers)
    say(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters (hidden {args.hidden}, "
        f"{args.layers} layers, untied head {args.vocab} x {args.hidden}); {data.numel():,} training tokens")
    trained = train(model, data, args.seconds, batch=8, seq=128, lr=3e-3)
    say(f"trained {trained['steps']} steps in {trained['seconds']:.0f} s, final loss {trained['train_loss']:.3f}")
    cal = [f.decode("utf-8", "replace")[:2000] for f in train_files[:64]]
    items = items_from(tok, held, args.items, args.prompt_tokens, args.ref_tokens)
    result = measure(model, tok, cal, items, args.ref_tokens)
    result.update(trained=trained, learned_vocab=learned, vocab=args.vocab)
    say("")
    say(f"{result['items']} held-out items, {args.prompt_tokens}-token prompts, {args.ref_tokens}-token references")
    say("| engine | bits per byte | ROUGE-L (greedy) |")
    say("| --- | --- | --- |")
    for name in ("fp16", "fp8, head fp16", "fp8, head fp8"):
        say(f"| {name} | {result[name]['bits_per_byte']:.4f} | {result[name]['rougeL']:.4f} |")
    say("")
    say("| pair (b vs a) | bits/byte b - a [95 %] | ROUGE-L b - a [95 %] | KL(a‖b) nats/token | top-1 differs | "
        "greedy identical |")
    say("| --- | --- | --- | --- | --- | --- |")
    for key in ("fp8, head fp16 vs fp16", "fp8, head fp8 vs fp8, head fp16", "fp8, head fp8 vs fp16"):
        r = result[key]
        b, g = r["bits_per_byte"], r["rougeL"]
        say(f"| {key} | {b[0]:+.5f} [{b[1]:+.5f}, {b[2]:+.5f}] | {g[0]:+.4f} [{g[1]:+.4f}, {g[2]:+.4f}] | "
            f"{r['kl_nats']:.2e} | {r['top1_differs']:.4f} | {r['greedy_identical']:.3f} |")
    say(f"head input amax {result['amax_lm_head']}, its FP8 saturation {result['head_saturation']}")
    (out / "head_vocab_drift.json").write_text(json.dumps(result, indent=2))
    (out / "head_vocab_drift.txt").write_text("\n".join(LINES) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
