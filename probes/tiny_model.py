"""A tiny Llama with a byte-level tokenizer, built and trained offline (never downloads anything).

Used by tests and the demo: a few seconds of CPU training make greedy decoding reproduce the given
(prompt, reference) pairs, so FP16-vs-FP8 drift and deliberately stale FP8 scales show up as real
changes in the generated text and in teacher-forced log-likelihoods.

    python -m probes.tiny_model --out /tmp/tiny --pairs pairs.jsonl --seconds 20

With ``fp8_margin`` (``--fp8-margin``) the training is FP8-aware and stops on a *margin*, not on a
loss or a step count: every other step runs the forward pass through emulated e4m3 (weights per
row, activations per tensor, straight-through gradients, as quantisation-aware training does), and
training ends when every reference token - in the last plain step and in the last FP8 step - leads
the best other token by at least ``fp8_margin`` nats. Greedy decoding then reproduces every
reference in FP16 and in calibrated FP8 alike, and no CPU's float kernels (differences of ~1e-6)
can move a logit by that much: the demo's healthy FP8 replay passes on any CPU, by construction.
The demo ships such a model (``probes/data/demo_code_model``, built by ``python -m
probes.tiny_model --set code --items 32 --fp8-margin 4 --out DIR``); ``reference_margins`` checks
the property on the machine at hand.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: marker in config.json / tokenizer_config.json: load the byte tokenizer without any files
BYTE_TOKENIZER = "ByT5Tokenizer"

DEFAULT_PAIRS: list[tuple[str, str]] = [
    ("Q: capital of France? A:", " Paris."),
    ("Q: 2+2? A:", " 4."),
    ("Q: colour of the sky? A:", " blue."),
    ("Translate to French: cat =>", " chat"),
    ("Q: opposite of hot? A:", " cold."),
    ("Q: 中国的首都? A:", " 北京。"),
    ("Q: largest planet? A:", " Jupiter."),
    ("Q: water formula? A:", " H2O."),
]


def byte_tokenizer():
    """A ByT5-style byte tokenizer (pad 0, eos 1, unk 2, bytes at 3..258); needs no files."""
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    tok.padding_side = "left"
    return tok


def tiny_config(vocab_size: int = 384, hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, max_positions: int = 512):
    from transformers import LlamaConfig

    # dimensions are multiples of 16 so the FP8 layers can use torch._scaled_mm on a GPU
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=None,
                       eos_token_id=1, tie_word_embeddings=False)


def _training_batch(tok, pairs: Sequence[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) with loss on the reference and its EOS only."""
    rows, labels = [], []
    for prompt, ref in pairs:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(ref, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, lb) in enumerate(zip(rows, labels, strict=True)):
        ids[i, -len(row):] = torch.tensor(row)  # left padding, as at inference
        mask[i, -len(row):] = 1
        lab[i, -len(row):] = torch.tensor(lb)
    return ids, mask, lab


def train(model, tok, pairs: Sequence[tuple[str, str]], *, max_seconds: float = 10.0, max_steps: int = 400,
          lr: float = 1e-2, target_loss: float = 0.01, fp8_margin: float | None = None) -> dict[str, float]:
    """Fit the pairs (full batch, Adam) until the loss is tiny or the time/step budget is spent;
    with ``fp8_margin``, FP8-aware until every reference token leads by that many nats
    (``train_fp8_margin``).

    Runs on one thread: on a shared 2-core machine more threads thrash (measured 15 ms vs 350 ms a step).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if fp8_margin is not None:
            return train_fp8_margin(model, tok, pairs, target_margin=fp8_margin, max_seconds=max_seconds,
                                    max_steps=max_steps, lr=lr)
        return _train(model, tok, pairs, max_seconds, max_steps, lr, target_loss)
    finally:
        torch.set_num_threads(threads)


def _train(model, tok, pairs, max_seconds, max_steps, lr, target_loss) -> dict[str, float]:
    ids, mask, labels = _training_batch(tok, pairs)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    start = time.perf_counter()
    loss_value = float("nan")
    step = 0
    for step in range(1, max_steps + 1):  # noqa: B007
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        loss_value = float(out.loss.item())
        if loss_value < target_loss or time.perf_counter() - start > max_seconds:
            break
    model.eval()
    return {"loss": loss_value, "steps": step, "seconds": time.perf_counter() - start}


def _fake_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Quantise to e4m3 and back with ``scale`` (what probes.fp8's emulation computes), with a
    straight-through gradient."""
    q = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale
    return x + (q - x).detach()


def _fp8_forward_hooks(model, enabled: dict[str, bool]) -> list:
    """Hooks that run every linear layer but ``lm_head`` in emulated FP8 while ``enabled['on']``:
    e4m3 weights with a per-row scale, e4m3 activations with a per-tensor scale (the amax of the
    batch, standing in for the calibrated static scale)."""
    import torch.nn.functional as F

    def hook(mod, inputs, _output):
        if not enabled["on"]:
            return None
        x, w = inputs[0], mod.weight
        sx = x.detach().abs().amax().clamp(min=1e-8) / 448.0
        sw = w.detach().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 448.0
        return F.linear(_fake_fp8(x, sx), _fake_fp8(w, sw), mod.bias)

    return [mod.register_forward_hook(hook) for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and name != "lm_head"]


def _token_margins(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per position: the target's logit minus the best other logit (> 0: greedy picks the target)."""
    chosen = logits.gather(1, targets[:, None])[:, 0]
    return chosen - logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values


def train_fp8_margin(model, tok, pairs: Sequence[tuple[str, str]], *, target_margin: float = 4.0,
                     max_seconds: float = 900.0, max_steps: int = 2000, lr: float = 1e-2,
                     late_lr: float = 3e-3, late_after: int = 200) -> dict[str, float]:
    """FP8-aware training until every reference token leads by ``target_margin`` nats.

    Odd steps run the linear layers in emulated FP8 (``_fp8_forward_hooks``), even steps plainly;
    the loss is taken on the reference tokens and their EOS only (the lm_head runs on those
    positions alone: ~4x less head work than on every position). Adam at ``lr``, then ``late_lr``
    after ``late_after`` steps (the margin needs a settled optimiser, not a spiky one). Stops when
    the smallest margin of the last plain step and of the last FP8 step both reach the target, or
    at the step/time budget (``reached`` says which)."""
    import torch.nn.functional as F

    ids, mask, labels = _training_batch(tok, pairs)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = labels[:, 1:] != -100
    targets = labels[:, 1:][keep]
    fp8 = {"on": False}
    hooks = _fp8_forward_hooks(model, fp8)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    last = {False: float("-inf"), True: float("-inf")}
    model.train()
    start = time.perf_counter()
    step, loss_value = 0, float("nan")
    try:
        for step in range(1, max_steps + 1):  # noqa: B007
            if step == late_after + 1:
                for group in opt.param_groups:
                    group["lr"] = late_lr
            fp8["on"] = bool(step % 2)
            hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
            logits = model.lm_head(hidden[:, :-1][keep]).float()
            loss = F.cross_entropy(logits, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_value = float(loss.item())
            with torch.no_grad():
                last[fp8["on"]] = float(_token_margins(logits, targets).min())
            if min(last.values()) >= target_margin or time.perf_counter() - start > max_seconds:
                break
    finally:
        for h in hooks:
            h.remove()
        model.eval()
    return {"loss": loss_value, "steps": step, "seconds": time.perf_counter() - start,
            "margin_plain": last[False], "margin_fp8": last[True], "target_margin": target_margin,
            "reached": float(min(last.values()) >= target_margin)}


def reference_margins(model, tok, pairs: Sequence[tuple[str, str]]) -> list[float]:
    """For each pair, the smallest logit margin along its reference (and EOS), teacher-forced: how
    far the model is from greedy decoding leaving the reference at any step, in nats. Negative:
    greedy decoding does not reproduce that reference. Works on any model of the same tokenizer
    (an FP8-quantised one too)."""
    ids, mask, labels = _training_batch(tok, pairs)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    out = []
    for row in range(ids.shape[0]):
        keep = labels[row, 1:] != -100
        out.append(float(_token_margins(logits[row, :-1][keep], labels[row, 1:][keep]).min()))
    return out


def build_tiny_model(out_dir: str | Path, pairs: Sequence[tuple[str, str]] | None = None, *,
                     train_seconds: float = 10.0, seed: int = 0, max_steps: int = 400,
                     fp8_margin: float | None = None, **config_kwargs) -> Path:
    """Build (and train on ``pairs`` unless ``train_seconds`` is 0) a tiny Llama; save it as an HF dir.

    Training stops at ``max_steps``, a tiny loss or ``train_seconds``, whichever comes first; give a
    generous time budget to get the same model on any machine (the step count then decides). With
    ``fp8_margin`` it is FP8-aware and stops on the margin (``train_fp8_margin``)."""
    from transformers import LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = byte_tokenizer()
    model = LlamaForCausalLM(tiny_config(**config_kwargs))
    stats: dict[str, float] = {}
    if pairs is None:
        pairs = DEFAULT_PAIRS
    if train_seconds > 0 and pairs:
        with torch.enable_grad():
            stats = train(model, tok, pairs, max_seconds=train_seconds, max_steps=max_steps,
                          fp8_margin=fp8_margin)
        log.info("tiny model trained: %s", stats)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "tiny_model.json").write_text(json.dumps({"tokenizer": BYTE_TOKENIZER, "train": stats, "seed": seed,
                                                     "fp8_margin": fp8_margin, "pairs": [list(p) for p in pairs]},
                                                    ensure_ascii=False))
    return out


def ensure_tiny_model(cache_root: str | Path, pairs: Sequence[tuple[str, str]] | None = None, *,
                      train_seconds: float = 30.0, seed: int = 0, max_steps: int = 400,
                      fp8_margin: float | None = None) -> Path:
    """A trained tiny model under ``cache_root``, built once per (pairs, seed, recipe) and reused after."""
    import hashlib

    pairs = list(pairs if pairs is not None else DEFAULT_PAIRS)
    recipe: list = [pairs, seed, max_steps] + ([{"fp8_margin": fp8_margin}] if fp8_margin is not None else [])
    key = hashlib.sha256(json.dumps(recipe, ensure_ascii=False).encode()).hexdigest()[:12]
    target = Path(cache_root) / f"tiny-{key}"
    if (target / "tiny_model.json").exists():
        return target
    tmp = Path(cache_root) / f".tiny-{key}-{os.getpid()}"
    build_tiny_model(tmp, pairs, train_seconds=train_seconds, seed=seed, max_steps=max_steps,
                     fp8_margin=fp8_margin)
    try:
        tmp.rename(target)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_pairs(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, reference) pairs from a JSONL file of objects with 'prompt' and 'reference'."""
    pairs = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            pairs.append((str(item["prompt"]), str(item["reference"])))
    return pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build a tiny offline Llama with a byte tokenizer")
    ap.add_argument("--out", required=True)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--pairs", help="JSONL with prompt/reference (default: a built-in set)")
    src.add_argument("--set", help="a golden set (name or directory): its rendered prompts and references")
    ap.add_argument("--items", type=int, default=None, help="with --set: its first N items")
    ap.add_argument("--seconds", type=float, default=20.0, help="CPU training budget")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8-margin", type=float, default=None,
                    help="FP8-aware training until every reference token leads by this many nats")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    pairs = load_pairs(args.pairs) if args.pairs else None
    if args.set:
        from probes.golden import find_golden_set, load_golden_set

        golden = load_golden_set(find_golden_set(args.set))
        pairs = (golden.head(args.items) if args.items else golden).pairs()
    print(build_tiny_model(args.out, pairs, train_seconds=args.seconds, seed=args.seed, max_steps=args.max_steps,
                           fp8_margin=args.fp8_margin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
