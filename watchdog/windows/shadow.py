"""Agreement of a completion with its shadow (the same request answered at the other precision).

A window scores its sampled FP8-vs-FP16 shadow pairs here: ROUGE-L F-measure and sentence BLEU,
the shadow completion being the reference. Texts are tokenised with watchdog/core/text.py's
CjkTokenizer (each CJK character one token, otherwise exactly rouge-score's default tokenizer
without stemming), so Chinese pairs score like golden replays do; BLEU uses sacrebleu's ``zh``
tokenizer on CJK pairs, ``13a`` otherwise, as probes/metrics.py does. ROUGE-L is computed with a
bit-parallel LCS: the same numbers as rouge-score's ``rougeL`` F-measure (tests compare them),
without importing rouge-score, whose nltk import pulls scipy (~80 MB of RSS and ~2 s) into the
daemon. Sentence BLEU is computed here from sacrebleu's own tokenizers (without their caches) with
the sufficient statistics and arithmetic of ``BLEU(effective_order=True).sentence_score`` (smooth
"exp", 4-grams, one reference): bit-identical scores (tests compare them on a varied corpus) at a
fraction of the per-pair cost. sacrebleu is imported at the first scoring (or by
``preload_scorers``); if its tokenizers' layout ever differs, its cached tokenizers are used as they are.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

__all__ = [
    "lcs_length",
    "pair_scores",
    "preload_scorers",
    "rouge_l",
    "sentence_bleu_tokens",
    "shadow_agreement",
]


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


def _ngram_counts(tokens: list[str]) -> list[Counter[Any]]:
    """Counts of the 1- to 4-grams of ``tokens`` (order n at index n - 1)."""
    t = tokens
    return [
        Counter(t),
        Counter(zip(t, t[1:], strict=False)),
        Counter(zip(t, t[1:], t[2:], strict=False)),
        Counter(zip(t, t[1:], t[2:], t[3:], strict=False)),
    ]


def sentence_bleu_tokens(hyp: list[str], ref: list[str]) -> float:
    """sacrebleu 2.x ``BLEU(effective_order=True).sentence_score(hyp, [ref]).score`` of tokenised texts.

    The same sufficient statistics as sacrebleu's ``_compute_segment_statistics`` with one
    reference (clipped n-gram matches and totals for orders 1-4, reference length = the reference's)
    and the same arithmetic, in the same order, as its ``compute_bleu`` with ``smooth_method="exp"``
    and effective order, so the scores are bit-identical (tests compare them on a large corpus);
    without sacrebleu's per-call objects (Counter of tuple slices, caches, BLEUScore).
    """
    sys_len, ref_len = len(hyp), len(ref)
    if not sys_len or not ref_len:
        return 0.0  # no hypothesis n-gram matches: sacrebleu's early stop (#141)
    hyp_counts = _ngram_counts(hyp)
    ref_counts = _ngram_counts(ref)
    correct = [0, 0, 0, 0]
    for n in range(4):
        rc = ref_counts[n]
        matched = 0
        for gram, count in hyp_counts[n].items():
            r = rc.get(gram)
            if r:
                matched += count if count < r else r
        correct[n] = matched
    if not correct[0]:  # no unigram match implies no higher-order match
        return 0.0
    bp = math.exp(1 - ref_len / sys_len) if sys_len < ref_len else 1.0
    logs = []
    smooth_mteval = 1.0
    for n in range(4):
        total = sys_len - n
        if total <= 0:
            break
        if correct[n] == 0:
            smooth_mteval *= 2
            logs.append(math.log(100.0 / (smooth_mteval * total)))
        else:
            logs.append(math.log(100.0 * correct[n] / total))
    return bp * math.exp(sum(logs) / len(logs))


# sacrebleu 2.x TokenizerRegexp's rules (used by 13a and zh), checked against the installed copy
_POST_RULES = [
    (r"([\{-\~\[-\` -\&\(-\+\:-\@\/])", r" \1 "),
    (r"([^0-9])([\.,])", r"\1 \2 "),
    (r"([\.,])([^0-9])", r" \1 \2"),
    (r"([0-9])(-)", r"\1 \2 "),
]
# rule 1 without the space: rule 1 maps each character on its own (a space to three spaces), so
# rule 1 == this rule after ``replace(" ", "   ")``, without a regex match per space
_RULE1_NO_SPACE = re.compile(r"([\{-\~\[-\`!-\&\(-\+\:-\@\/])")


class _PostTokenizer:
    """sacrebleu's ``TokenizerRegexp.__call__`` (the 13a/zh post-tokenizer), same output, cheaper:
    no ``lru_cache`` (live completions never repeat; the cache would keep 65,536 texts alive), rule 1
    without a match per space, and rules 2-4 skipped when the characters they need are absent (a
    ``re.sub`` without a match returns its input)."""

    def __init__(self, rules: list[tuple[re.Pattern[str], str]]) -> None:
        self._r2, self._r3, self._r4 = (rx for rx, _ in rules[1:])

    def __call__(self, line: str) -> str:
        line = _RULE1_NO_SPACE.sub(r" \1 ", line.replace(" ", "   "))
        if "." in line or "," in line:
            line = self._r3.sub(r" \1 \2", self._r2.sub(r"\1 \2 ", line))
        if "-" in line:
            line = self._r4.sub(r"\1 \2 ", line)
        return " ".join(line.split())


def _fast_tokenizer(tokenizer: Any) -> Callable[[str], str]:
    """sacrebleu's ``13a``/``zh`` tokenizer with ``_PostTokenizer`` and without its own ``lru_cache``;
    the tokenizer itself, unchanged, if the installed sacrebleu's layout or rules differ."""
    outer = getattr(type(tokenizer).__call__, "__wrapped__", None)
    post = getattr(tokenizer, "_post_tokenizer", None)
    rules = getattr(post, "_re", None)
    if outer is None or not isinstance(rules, list) or [(rx.pattern, repl) for rx, repl in rules] != _POST_RULES:
        return cast("Callable[[str], str]", tokenizer)
    tokenizer._post_tokenizer = _PostTokenizer(rules)
    return functools.partial(outer, tokenizer)


class _AgreementScorer:
    """ROUGE-L F-measure and sentence BLEU of a completion against its shadow (the reference)."""

    def __init__(self) -> None:
        from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
        from sacrebleu.tokenizers.tokenizer_zh import TokenizerZh

        from watchdog.core.text import CjkTokenizer, has_cjk

        self._tokenize = CjkTokenizer().tokenize
        self._has_cjk = has_cjk
        # sacrebleu.sentence_bleu's tokenizers (13a, and zh on CJK pairs): private instances, so
        # their changed post-tokenizer does not touch sacrebleu's own BLEU objects
        self._tok_13a = _fast_tokenizer(Tokenizer13a())
        self._tok_zh = _fast_tokenizer(TokenizerZh())

    def bleu(self, completion: str, shadow: str) -> float:
        """sacrebleu ``BLEU(tokenize="13a"|"zh", effective_order=True).sentence_score(completion, [shadow])``."""
        tok = self._tok_zh if self._has_cjk(completion) or self._has_cjk(shadow) else self._tok_13a
        # BLEU._preprocess_segment: rstrip, tokenize (lowercase off); extract_all_word_ngrams: split
        return sentence_bleu_tokens(tok(completion.rstrip()).split(), tok(shadow.rstrip()).split())

    def pair(self, completion: str, shadow: str, with_bleu: bool = True) -> tuple[float, float | None]:
        score = rouge_l(self._tokenize(shadow), self._tokenize(completion))
        if not with_bleu:
            return float(score), None
        bleu = self.bleu(completion, shadow)
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
