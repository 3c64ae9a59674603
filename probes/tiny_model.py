"""A tiny Llama with a byte-level tokenizer, built and trained offline (never downloads anything).

Used by tests and the demo: a few seconds of CPU training make greedy decoding reproduce the given
(prompt, reference) pairs, so FP16-vs-FP8 drift and deliberately stale FP8 scales show up as real
changes in the generated text and in teacher-forced log-likelihoods.

    python -m probes.tiny_model --out /tmp/tiny --pairs pairs.jsonl --seconds 20
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
          lr: float = 1e-2, target_loss: float = 0.01) -> dict[str, float]:
    """Fit the pairs (full batch, Adam) until the loss is tiny or the time/step budget is spent.

    Runs on one thread: on a shared 2-core machine more threads thrash (measured 15 ms vs 350 ms a step).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
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


def build_tiny_model(out_dir: str | Path, pairs: Sequence[tuple[str, str]] | None = None, *,
                     train_seconds: float = 10.0, seed: int = 0, max_steps: int = 400,
                     **config_kwargs) -> Path:
    """Build (and train on ``pairs`` unless ``train_seconds`` is 0) a tiny Llama; save it as an HF dir.

    Training stops at ``max_steps``, a tiny loss or ``train_seconds``, whichever comes first; give a
    generous time budget to get the same model on any machine (the step count then decides)."""
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
            stats = train(model, tok, pairs, max_seconds=train_seconds, max_steps=max_steps)
        log.info("tiny model trained: %s", stats)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "tiny_model.json").write_text(json.dumps({"tokenizer": BYTE_TOKENIZER, "train": stats,
                                                     "pairs": [list(p) for p in pairs]}, ensure_ascii=False))
    return out


def ensure_tiny_model(cache_root: str | Path, pairs: Sequence[tuple[str, str]] | None = None, *,
                      train_seconds: float = 30.0, seed: int = 0, max_steps: int = 400) -> Path:
    """A trained tiny model under ``cache_root``, built once per (pairs, seed) and reused after."""
    import hashlib

    pairs = list(pairs if pairs is not None else DEFAULT_PAIRS)
    key = hashlib.sha256(json.dumps([pairs, seed, max_steps], ensure_ascii=False).encode()).hexdigest()[:12]
    target = Path(cache_root) / f"tiny-{key}"
    if (target / "tiny_model.json").exists():
        return target
    tmp = Path(cache_root) / f".tiny-{key}-{os.getpid()}"
    build_tiny_model(tmp, pairs, train_seconds=train_seconds, seed=seed, max_steps=max_steps)
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
    ap.add_argument("--pairs", help="JSONL with prompt/reference (default: a built-in set)")
    ap.add_argument("--seconds", type=float, default=20.0, help="CPU training budget")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    pairs = load_pairs(args.pairs) if args.pairs else None
    print(build_tiny_model(args.out, pairs, train_seconds=args.seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
