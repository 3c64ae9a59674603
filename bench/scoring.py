"""Benchmark: score 1,000 golden (reference, prediction) pairs with every text metric.

Pairs come from the shipped golden sets (cycled to 1,000), each prediction a deterministic
perturbation of its reference (dropped / swapped / replaced words, or unchanged), so English,
Chinese and code all appear. Measures one process and a process pool of 2, checks the scores are
identical, and also times the corpus-level pass and FP8-vs-FP16 agreement.

    .venv/bin/python bench/scoring.py [--pairs 1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probes.golden import list_golden_sets, load_golden_set  # noqa: E402
from probes.metrics import Scorer, score_batch  # noqa: E402


def perturb(text: str, rng: random.Random) -> str:
    kind = rng.randrange(4)
    words = text.split(" ")
    if kind == 0 or len(words) < 3:
        return text if " " in text or kind == 0 else text[: max(1, len(text) - 3)]
    if kind == 1:
        del words[rng.randrange(len(words))]
    elif kind == 2:
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    else:
        words[rng.randrange(len(words))] = "approximately"
    return " ".join(words)


def golden_pairs(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    refs = [i.reference for p in list_golden_sets() for i in load_golden_set(p).items]
    rng = random.Random(seed)
    chosen = [refs[k % len(refs)] for k in range(n)]
    return chosen, [perturb(r, rng) for r in chosen]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    refs, preds = golden_pairs(args.pairs)
    scorer = Scorer()
    rows = []
    one_s, one = timed(lambda: scorer.batch(refs, preds), args.repeats)
    rows.append(("per-pair metrics, 1 process", one_s, True))
    two_s, two = timed(lambda: score_batch(refs, preds, workers=2), args.repeats)
    same = two.items == one.items and scorer.corpus_from(two) == scorer.corpus_from(one)
    rows.append(("per-pair metrics, pool of 2", two_s, same))
    corpus_s, _ = timed(lambda: scorer.corpus_from(one), args.repeats)
    rows.append(("corpus ROUGE/BLEU/chrF from the same statistics", corpus_s, True))
    agree_s, _ = timed(
        lambda: [scorer.agreement(r, p) for r, p in zip(refs, preds, strict=True)], args.repeats
    )
    rows.append(("agreement ROUGE-L", agree_s, True))

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scoring {len(refs)} golden pairs (median of {args.repeats})")
    for col in ("what", "seconds", "pairs/s", "identical to 1 process"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for what, secs, same in rows:
        table.add_row(what, f"{secs:.3f}", f"{len(refs) / secs:,.0f}", "yes" if same else "NO")
    full = min(one_s, two_s) + corpus_s + agree_s
    table.caption = f"all metrics incl. corpus and agreement, best path: {full:.3f} s (target <= 2 s)"
    Console().print(table)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
