"""Benchmark: cost of scoring one differing shadow pair (ROUGE-L + sentence BLEU), before/after.

Two pair sets: the heavy ingest mix's differing pairs (``bench/ingest.py``'s ``heavy_event``: 40 words,
three replaced) and the golden sets' references vs perturbed predictions (``bench/scoring.py``;
English, Chinese, code). For each, in one run and interleaved: sacrebleu's
``BLEU(tokenize="13a"|"zh", effective_order=True).sentence_score(hyp, [ref])`` (what the windows
called before; its tokenizer caches cleared before every pass, since live completions never
repeat), the windows' own ``sentence_bleu_tokens`` path, and the whole ``pair_scores`` (ROUGE-L +
BLEU). Checks the BLEU scores are identical and prints µs per pair with the load average.

    .venv/bin/python bench/shadow_cost.py [--pairs 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest import _WORDS  # noqa: E402
from scoring import golden_pairs  # noqa: E402

from watchdog.core.text import has_cjk  # noqa: E402
from watchdog.windows.shadow import _agreement_scorer, pair_scores  # noqa: E402


def heavy_pairs(n: int, seed: int = 11) -> list[tuple[str, str]]:
    """(completion, shadow) pairs that differ, as ``bench/ingest.py``'s heavy mix makes them."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        words = [rng.choice(_WORDS) for _ in range(40)]
        shadow = words[:]
        for _ in range(3):
            shadow[rng.randrange(40)] = rng.choice(_WORDS)
        if shadow != words:
            out.append((" ".join(words), " ".join(shadow)))
    return out


def golden(n: int) -> list[tuple[str, str]]:
    refs, preds = golden_pairs(n)
    return [(p.strip(), r.strip()) for p, r in zip(preds, refs, strict=True) if p.strip() != r.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from sacrebleu.metrics import BLEU
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
    from sacrebleu.tokenizers.tokenizer_re import TokenizerRegexp
    from sacrebleu.tokenizers.tokenizer_zh import TokenizerZh

    b13, bzh = BLEU(tokenize="13a", effective_order=True), BLEU(tokenize="zh", effective_order=True)
    scorer = _agreement_scorer()

    def clear() -> None:
        for fn in (Tokenizer13a.__call__, TokenizerZh.__call__, TokenizerRegexp.__call__):
            fn.cache_clear()  # type: ignore[attr-defined]

    def sacre(pairs: list[tuple[str, str]]) -> list[float]:
        return [(bzh if has_cjk(a) or has_cjk(b) else b13).sentence_score(a, [b]).score for a, b in pairs]

    def ours(pairs: list[tuple[str, str]]) -> list[float]:
        return [scorer.bleu(a, b) for a, b in pairs]

    def whole_old(pairs: list[tuple[str, str]]) -> list[Any]:
        return [(scorer.pair(a, b, False)[0], (bzh if has_cjk(a) or has_cjk(b) else b13).sentence_score(a, [b]).score)
                for a, b in pairs]

    def whole_new(pairs: list[tuple[str, str]]) -> list[Any]:
        return [pair_scores(a, b) for a, b in pairs]

    def rouge_only(pairs: list[tuple[str, str]]) -> list[Any]:
        return [pair_scores(a, b, False) for a, b in pairs]

    variants = [("BLEU, sacrebleu sentence_score", sacre), ("BLEU, windows' path", ours),
                ("ROUGE-L only", rouge_only),
                ("pair (ROUGE-L + BLEU), before", whole_old), ("pair (ROUGE-L + BLEU), after", whole_new)]
    ok = True
    for name, pairs in (("heavy mix", heavy_pairs(args.pairs)), ("golden sets", golden(args.pairs))):
        times: dict[str, list[float]] = {v: [] for v, _ in variants}
        if sacre(pairs) != ours(pairs):
            ok = False
            print(f"{name}: BLEU scores DIFFER from sacrebleu")
        for _ in range(args.repeats):
            for v, fn in variants:
                clear()
                t = time.perf_counter()
                fn(pairs)
                times[v].append((time.perf_counter() - t) / len(pairs) * 1e6)
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"\n{name}: {len(pairs)} differing pairs, median of {args.repeats}, load {load}")
        base = statistics.median(times[variants[0][0]])
        for v, _ in variants:
            med = statistics.median(times[v])
            print(f"  {v:34s} {med:8.1f} µs/pair   (÷ sacrebleu BLEU {med / base:.3f})")
        print(f"  BLEU scores identical to sacrebleu: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
