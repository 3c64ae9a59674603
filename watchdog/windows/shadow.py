"""Agreement of a completion with its shadow (the same request answered at the other precision).

A window scores its sampled FP8-vs-FP16 shadow pairs here: ROUGE-L F-measure and sentence BLEU,
the shadow completion being the reference. Texts are tokenised with watchdog/core/text.py's
CjkTokenizer (each CJK character one token, otherwise exactly rouge-score's default tokenizer
without stemming), so Chinese pairs score like golden replays do; BLEU uses sacrebleu's ``zh``
tokenizer on CJK pairs, ``13a`` otherwise, as probes/metrics.py does. ROUGE-L is computed with a
bit-parallel LCS: the same numbers as rouge-score's ``rougeL`` F-measure (tests compare them),
without importing rouge-score, whose nltk import pulls scipy (~80 MB of RSS and ~2 s) into the
daemon; sacrebleu is imported at the first scoring (or by ``preload_scorers``).
"""

from __future__ import annotations

import functools

__all__ = ["lcs_length", "pair_scores", "preload_scorers", "rouge_l", "shadow_agreement"]


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists (bit-parallel, Hyyrö 2004)."""
    masks: dict[str, int] = {}
    bit = 1
    for tok in a:
        masks[tok] = masks.get(tok, 0) | bit
        bit <<= 1
    full = bit - 1
    v = full
    for tok in b:
        m = masks.get(tok)
        if m:
            u = v & m
            v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def rouge_l(target: list[str], prediction: list[str]) -> float:
    """ROUGE-L F-measure of token lists, computed as rouge-score's ``_score_lcs`` does."""
    if not target or not prediction:
        return 0.0
    lcs = lcs_length(target, prediction)
    precision = lcs / len(prediction)
    recall = lcs / len(target)
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


class _AgreementScorer:
    """ROUGE-L F-measure and sentence BLEU of a completion against its shadow (the reference)."""

    def __init__(self) -> None:
        from sacrebleu.metrics import BLEU

        from watchdog.core.text import CjkTokenizer, has_cjk

        self._tokenize = CjkTokenizer().tokenize
        self._has_cjk = has_cjk
        # sacrebleu.sentence_bleu's defaults (13a, smooth exp, effective order), and its zh variant
        self._bleu = BLEU(tokenize="13a", effective_order=True)
        self._bleu_zh = BLEU(tokenize="zh", effective_order=True)

    def pair(self, completion: str, shadow: str, with_bleu: bool = True) -> tuple[float, float | None]:
        score = rouge_l(self._tokenize(shadow), self._tokenize(completion))
        if not with_bleu:
            return float(score), None
        cjk = self._has_cjk(completion) or self._has_cjk(shadow)
        bleu = (self._bleu_zh if cjk else self._bleu).sentence_score(completion, [shadow]).score
        return float(score), min(max(float(bleu), 0.0), 100.0)


@functools.lru_cache(maxsize=1)
def _agreement_scorer() -> _AgreementScorer:
    return _AgreementScorer()


def preload_scorers() -> None:
    """Import the agreement scorers now (sacrebleu, ~0.3 s) rather than at the first window close."""
    _agreement_scorer()


def pair_scores(completion: str, shadow: str, with_bleu: bool = True) -> tuple[float, float | None]:
    """(ROUGE-L F-measure in [0, 1], sentence BLEU in [0, 100] or None without ``with_bleu``)."""
    a, b = completion.strip(), shadow.strip()
    if a == b:  # identical (including both empty): full agreement, and no scorer cost
        return 1.0, 100.0
    if not a or not b:
        return 0.0, 0.0
    return _agreement_scorer().pair(a, b, with_bleu)


def shadow_agreement(pairs: list[tuple[str, str]]) -> tuple[float, float]:
    """Mean ROUGE-L F-measure and mean sentence BLEU of (completion, shadow completion) pairs.

    The shadow completion is the reference. Pairs must be non-empty. CJK pairs are tokenised per
    character (see ``watchdog.core.text``).
    """
    if not pairs:
        raise ValueError("no pairs to score")
    rouge_sum = 0.0
    bleu_sum = 0.0
    for completion, shadow in pairs:
        r, b = pair_scores(completion, shadow)
        rouge_sum += r
        bleu_sum += b or 0.0
    return rouge_sum / len(pairs), bleu_sum / len(pairs)
