"""Quality metrics for golden replays: ROUGE, BLEU, chrF, exact match, length ratio, perplexity.

Pure logic, no I/O. The numbers match Hugging Face ``evaluate``'s ``rouge``, ``sacrebleu`` and
``chrf`` metrics with their default arguments, because they are the same library calls with the
same defaults:

* ROUGE: ``rouge_score.rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"],
  use_stemmer=False)``; the value is the F-measure. ``evaluate`` aggregates with rouge-score's
  ``BootstrapAggregator`` (the median of 1,000 unseeded bootstrap means, i.e. a noisy estimate of
  the mean); we report the exact arithmetic mean of the per-item F-measures, the quantity that
  estimate converges to, so corpus ROUGE is deterministic.
* BLEU: corpus level is ``sacrebleu.corpus_bleu`` defaults (tokenize ``13a``, smooth ``exp``,
  no effective order, case-sensitive); per item it is ``sacrebleu.sentence_bleu`` defaults
  (effective order on). Scale 0-100, as sacrebleu and ``evaluate`` report it.
* chrF: ``sacrebleu.metrics.CHRF()`` defaults (char order 6, word order 0, beta 2). Scale 0-100.

CJK text: rouge-score's default tokenizer keeps only ``[a-z0-9]``, so Chinese scores ~0. When
either side of a pair contains CJK characters, ROUGE uses ``CjkTokenizer`` (each CJK character is
one token, Latin words/digits kept as on the default path) and BLEU uses sacrebleu's ``zh``
tokenizer, which does the same split and otherwise equals ``13a``. chrF is character based and
needs nothing special.
"""

from __future__ import annotations

import logging
import math
import os
import re
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from watchdog.core.text import CjkTokenizer, has_cjk

log = logging.getLogger(__name__)

_SPACE_RE = re.compile(r"\s+")

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
#: per-pair text metrics computed by ``Scorer.score``
TEXT_METRICS = (*ROUGE_TYPES, "bleu", "chrf", "exact_match", "length_ratio")
#: reference-likelihood metrics (need ``Engine.score``)
PERPLEXITY_METRICS = ("ppl", "word_perplexity", "byte_perplexity", "bits_per_byte")
#: FP8-vs-FP16 output agreement
AGREEMENT_METRICS = ("agreement_rougeL",)
#: every built-in metric name a golden-set manifest may list
KNOWN_METRICS = (*TEXT_METRICS, *PERPLEXITY_METRICS, *AGREEMENT_METRICS)
#: metrics where a lower value is better (drift ranking and signals need the direction)
LOWER_IS_BETTER = frozenset({*PERPLEXITY_METRICS, "error_rate"})

def normalize_for_exact_match(text: str) -> str:
    """Unicode NFKC, strip, collapse whitespace runs to one space. Case and punctuation are kept
    (code and clause numbers are case/punctuation sensitive)."""
    return _SPACE_RE.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def exact_match(reference: str, prediction: str) -> float:
    return float(normalize_for_exact_match(reference) == normalize_for_exact_match(prediction))


def count_words(text: str) -> int:
    """Words as lm-evaluation-harness counts them for word_perplexity (``re.split(r"\\s+")``)."""
    return len(re.split(r"\s+", text))


@dataclass(slots=True)
class ScoredBatch:
    """Per-pair scores plus the sacrebleu segment statistics a corpus score is summed from."""

    items: list[dict[str, float]]
    bleu_stats: list[list[int]]
    chrf_stats: list[list[int]]
    ref_tokens: int
    pred_tokens: int

    def extend(self, other: ScoredBatch) -> None:
        self.items += other.items
        self.bleu_stats += other.bleu_stats
        self.chrf_stats += other.chrf_stats
        self.ref_tokens += other.ref_tokens
        self.pred_tokens += other.pred_tokens


class Scorer:
    """Reusable scorer objects (building a RougeScorer or BLEU object per pair is wasted work).

    Sentence and corpus BLEU/chrF come from one pass: sacrebleu computes both from per-segment
    n-gram statistics (``corpus_score`` sums them), so each pair's statistics are extracted once,
    scored alone for the per-item value and summed for the corpus value. Tests check both against
    the public ``sentence_bleu``/``corpus_bleu``/``sentence_chrf``/``corpus_chrf`` calls."""

    def __init__(self) -> None:
        from rouge_score import rouge_scorer
        from sacrebleu.metrics import BLEU, CHRF

        self._rouge = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False)
        self._rouge_cjk = rouge_scorer.RougeScorer(
            list(ROUGE_TYPES), use_stemmer=False, tokenizer=CjkTokenizer()
        )
        self._rouge_l = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
        self._rouge_l_cjk = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=CjkTokenizer())
        # sentence_bleu defaults: effective order on, smooth exp; corpus_bleu: effective order off
        self._bleu = BLEU(tokenize="13a", effective_order=True)
        self._bleu_zh = BLEU(tokenize="zh", effective_order=True)
        self._bleu_corpus = BLEU(tokenize="13a", effective_order=False)
        self._chrf = CHRF()
        self._words = CjkTokenizer()

    def _pair(
        self, reference: str, prediction: str
    ) -> tuple[dict[str, float], list[int], list[int], int, int]:
        cjk = has_cjk(reference) or has_cjk(prediction)
        scores = (self._rouge_cjk if cjk else self._rouge).score(reference, prediction)
        out = {name: float(scores[name].fmeasure) for name in ROUGE_TYPES}
        bleu = self._bleu_zh if cjk else self._bleu
        bstats = bleu._extract_corpus_statistics([prediction], [[reference]])
        out["bleu"] = float(bleu._aggregate_and_compute(bstats).score)
        cstats = self._chrf._extract_corpus_statistics([prediction], [[reference]])
        out["chrf"] = float(self._chrf._aggregate_and_compute(cstats).score)
        out["exact_match"] = exact_match(reference, prediction)
        ref_len = len(self._words.tokenize(reference))
        pred_len = len(self._words.tokenize(prediction))
        if ref_len:
            out["length_ratio"] = pred_len / ref_len
        return out, bstats[0], cstats[0], ref_len, pred_len

    def score(self, reference: str, prediction: str) -> dict[str, float]:
        """All text metrics for one (reference, prediction) pair."""
        return self._pair(reference, prediction)[0]

    def batch(self, references: Sequence[str], predictions: Sequence[str]) -> ScoredBatch:
        _check_lengths(references, predictions)
        out = ScoredBatch([], [], [], 0, 0)
        for r, p in zip(references, predictions, strict=True):
            item, bstats, cstats, rl, pl = self._pair(r, p)
            out.items.append(item)
            out.bleu_stats.append(bstats)
            out.chrf_stats.append(cstats)
            out.ref_tokens += rl
            out.pred_tokens += pl
        return out

    def score_pairs(self, references: Sequence[str], predictions: Sequence[str]) -> list[dict[str, float]]:
        return self.batch(references, predictions).items

    def agreement(self, a: str, b: str) -> float:
        """ROUGE-L F-measure between two outputs (symmetric): FP8-vs-FP16 agreement."""
        cjk = has_cjk(a) or has_cjk(b)
        return float((self._rouge_l_cjk if cjk else self._rouge_l).score(a, b)["rougeL"].fmeasure)

    def corpus_from(self, batch: ScoredBatch) -> dict[str, float]:
        """Corpus-level scores of a scored batch: mean ROUGE F-measure and exact match,
        corpus BLEU and chrF with ``evaluate``'s defaults (summed segment statistics), and total
        predicted / total reference tokens as the length ratio."""
        if not batch.items:
            return {}
        n = len(batch.items)
        out = {name: sum(i[name] for i in batch.items) / n for name in (*ROUGE_TYPES, "exact_match")}
        out["bleu"] = float(self._bleu_corpus._aggregate_and_compute(batch.bleu_stats).score)
        out["chrf"] = float(self._chrf._aggregate_and_compute(batch.chrf_stats).score)
        if batch.ref_tokens:
            out["length_ratio"] = batch.pred_tokens / batch.ref_tokens
        return out

    def corpus(self, references: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
        """Corpus-level scores of pairs (see ``corpus_from``). Each segment is tokenised for BLEU
        like its per-item score (``zh`` when the pair has CJK, else ``13a``); on a corpus without
        CJK this is exactly ``sacrebleu.corpus_bleu`` with its defaults."""
        return self.corpus_from(self.batch(references, predictions))


def _check_lengths(references: Sequence[str], predictions: Sequence[str]) -> None:
    if len(references) != len(predictions):
        raise ValueError(f"{len(references)} references but {len(predictions)} predictions")


_worker_scorer: Scorer | None = None


def _score_chunk(chunk: tuple[list[str], list[str]]) -> ScoredBatch:
    global _worker_scorer
    if _worker_scorer is None:
        _worker_scorer = Scorer()
    return _worker_scorer.batch(*chunk)


def score_batch(
    references: Sequence[str],
    predictions: Sequence[str],
    *,
    scorer: Scorer | None = None,
    workers: int = 1,
) -> ScoredBatch:
    """Score every pair (one scorer object for the whole batch); ``workers > 1`` splits the
    batch into contiguous chunks over a process pool and joins them in order (same scores)."""
    _check_lengths(references, predictions)
    if workers <= 1 or len(references) < 2 * workers:
        return (scorer or Scorer()).batch(references, predictions)
    size = math.ceil(len(references) / workers)
    chunks = [
        (list(references[i : i + size]), list(predictions[i : i + size]))
        for i in range(0, len(references), size)
    ]
    out = ScoredBatch([], [], [], 0, 0)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for part in pool.map(_score_chunk, chunks):
            out.extend(part)
    return out


def score_pairs(
    references: Sequence[str],
    predictions: Sequence[str],
    *,
    scorer: Scorer | None = None,
    workers: int = 1,
) -> list[dict[str, float]]:
    """Text metrics for each pair, in order (see ``score_batch``)."""
    return score_batch(references, predictions, scorer=scorer, workers=workers).items


# --- perplexity (lm-evaluation-harness definitions) ---------------------------------------------


#: the largest log-perplexity (nats per token, word or byte) a report carries. A reference the engine
#: gives (almost) no probability - logits scaled far off, overflowing or NaN, a garbage model - has a
#: per-unit NLL of hundreds or thousands of nats, past ``math.exp``'s range (~709); it gets this
#: capped worst value instead of an ``OverflowError``: finite, so the report stays strict JSON and
#: the paired statistics stay defined. e^100 is far beyond any working model (a uniform guess over a
#: 128k vocabulary is e^11.8 per token).
MAX_LOG_PERPLEXITY = 100.0
#: the worst perplexity a report carries (``exp(MAX_LOG_PERPLEXITY)``, about 2.7e43)
PERPLEXITY_CAP = math.exp(MAX_LOG_PERPLEXITY)


@dataclass(slots=True, frozen=True)
class Likelihood:
    """Teacher-forced log-likelihood (natural log) of one reference and its sizes."""

    logprob_sum: float
    n_tokens: int
    n_bytes: int
    n_words: int


def _capped_exp(nll_per_unit: float) -> float:
    """``exp(nll)`` for a perplexity, never raising: NaN or anything past the cap is the cap."""
    if not nll_per_unit <= MAX_LOG_PERPLEXITY:  # also NaN
        return PERPLEXITY_CAP
    return math.exp(nll_per_unit)


def perplexity(items: Sequence[Likelihood]) -> dict[str, float]:
    """Pooled perplexities as lm-evaluation-harness computes them (``weighted_perplexity``:
    ``exp(-sum(logprob) / sum(count))``) per token, per word and per byte, plus
    ``bits_per_byte = -sum(logprob) / (sum(bytes) * ln 2)``. A count of zero leaves its metric
    out (unmeasurable is absent, never 0). For a single item pass a one-element list.

    Never raises and never returns NaN or inf: a log-likelihood that is NaN, -inf or so low that
    the perplexity overflows (a catastrophically broken engine) gives the capped worst value,
    ``PERPLEXITY_CAP`` (``bits_per_byte``: ``MAX_LOG_PERPLEXITY / ln 2``), so it counts as the
    worst item instead of failing the replay."""
    total = sum(i.logprob_sum for i in items)
    out: dict[str, float] = {}
    for name, count in (
        ("ppl", sum(i.n_tokens for i in items)),
        ("word_perplexity", sum(i.n_words for i in items)),
        ("byte_perplexity", sum(i.n_bytes for i in items)),
    ):
        if count > 0:
            out[name] = _capped_exp(-total / count)
    n_bytes = sum(i.n_bytes for i in items)
    if n_bytes > 0:
        nll = -total / n_bytes
        out["bits_per_byte"] = (nll if nll <= MAX_LOG_PERPLEXITY else MAX_LOG_PERPLEXITY) / math.log(2)
    return out


def worst_value(metric: str) -> float | None:
    """The worst value a built-in metric can take (what a NaN or infinite score counts as), or
    None for a metric without one (custom metrics, ``length_ratio``)."""
    if metric in PERPLEXITY_METRICS:
        return MAX_LOG_PERPLEXITY / math.log(2) if metric == "bits_per_byte" else PERPLEXITY_CAP
    if metric in (*ROUGE_TYPES, "bleu", "chrf", "exact_match", *AGREEMENT_METRICS):
        return 0.0
    return None


# --- custom metrics through evaluate.load(<local script>) ---------------------------------------


class CustomMetric:
    """A metric script loaded with ``evaluate.load(path)``; ``compute`` returns its numeric outputs.

    ``evaluate`` is imported lazily (it pulls in ~300 MB of dependencies) and run offline:
    ``HF_EVALUATE_OFFLINE=1`` is set unless the caller set it (``HF_HUB_OFFLINE`` alone does not stop
    its network look-ups)."""

    def __init__(self, path: str | os.PathLike[str], **load_kwargs: Any) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"metric script not found: {self.path}")
        os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
        import evaluate

        self.name = self.path.stem
        self._metric = evaluate.load(str(self.path), **load_kwargs)

    def compute(
        self, references: Sequence[str], predictions: Sequence[str], **kwargs: Any
    ) -> dict[str, float]:
        result = (
            self._metric.compute(predictions=list(predictions), references=list(references), **kwargs) or {}
        )
        return {
            k: float(v) for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
