"""The windows' shadow-pair BLEU equals sacrebleu's sentence BLEU, bit for bit, on a varied corpus."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from sacrebleu.metrics import BLEU
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
from sacrebleu.tokenizers.tokenizer_zh import TokenizerZh

from probes.golden import list_golden_sets, load_golden_set
from watchdog.core.text import has_cjk
from watchdog.windows.shadow import _agreement_scorer, _fast_tokenizer, pair_scores

BLEU_13A = BLEU(tokenize="13a", effective_order=True)
BLEU_ZH = BLEU(tokenize="zh", effective_order=True)

PUNCT = list(".,;:!?-'\"()[]{}<>/\\|@#$%^&*_+=~`") + ["&amp;", "&quot;", "&lt;", "&gt;", "<skipped>", "-\n", "\n", "\t", "..."]
UNICODE = ["café", "naïve", "Ελληνικά", "Привет", "—", "…", "“quoted”", "½", "١٢٣", "🙂", "\u00a0", "\u2009", "Σ"]
CJK = list("中文的模型返回一个简短答案关于合同发票") + ["日本語", "한국어", "，", "。", "！"]
NUMBERS = ["3.14", "1,000", "-5", "2026-12-02", "10.5%", "$4.99", "v1.2.3", "0", "42."]


def sacre(hyp: str, ref: str) -> float:
    bleu = BLEU_ZH if has_cjk(hyp) or has_cjk(ref) else BLEU_13A
    return float(bleu.sentence_score(hyp, [ref]).score)


def perturb(words: list[str], rng: random.Random) -> list[str]:
    w = words[:]
    for _ in range(rng.randrange(1, 5)):
        kind = rng.randrange(7)
        if not w:
            w.append(rng.choice(PUNCT + NUMBERS))
        elif kind == 0:
            del w[rng.randrange(len(w))]
        elif kind == 1 and len(w) > 1:
            i = rng.randrange(len(w) - 1)
            w[i], w[i + 1] = w[i + 1], w[i]
        elif kind == 2:
            w.insert(rng.randrange(len(w) + 1), rng.choice(PUNCT + NUMBERS + UNICODE))
        elif kind == 3:
            w[rng.randrange(len(w))] = rng.choice(words or ["x"])
        elif kind == 4:
            rng.shuffle(w)
        elif kind == 5:
            i = rng.randrange(len(w))
            w[i] = w[i] + rng.choice(PUNCT)
        else:
            w.insert(rng.randrange(len(w) + 1), rng.choice(CJK))
    return w


def corpus() -> Iterator[tuple[str, str]]:
    rng = random.Random(19)
    refs = [i.reference for p in list_golden_sets() for i in load_golden_set(p).items]
    for ref in refs:
        words = ref.split(" ")
        for _ in range(6):
            yield " ".join(perturb(words, rng)), ref
            yield ref, " ".join(perturb(words, rng))
    alphabet = PUNCT + UNICODE + CJK + NUMBERS + ["a", "b", "the", "cat", "1", "2", " ", "  "]
    for _ in range(1500):  # punctuation soup, with and without spaces
        a = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        b = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        yield a, b
        yield a, " ".join(perturb(a.split(" "), rng))
    words = [w for r in refs for w in r.split()]
    for n in (1, 2, 3, 4, 5, 500, 3000):  # short (below the 4-gram order) and very long texts
        for _ in range(5):
            a = [rng.choice(words) for _ in range(n)]
            yield " ".join(a), " ".join(perturb(a, rng))
    yield from [("a", "b"), ("a", "a a"), (".", ","), ("x .", "x ."), ("1-2", "1 - 2"), ("中", "文"), ("a\n-b", "a-\nb")]


def test_bleu_is_sacrebleu_bit_for_bit() -> None:
    scorer = _agreement_scorer()
    n = 0
    for hyp, ref in corpus():
        hyp, ref = hyp.strip(), ref.strip()
        if not hyp or not ref:
            continue
        assert scorer.bleu(hyp, ref) == sacre(hyp, ref), (hyp, ref)
        n += 1
    assert n > 4000


@pytest.mark.parametrize("cls", [Tokenizer13a, TokenizerZh])
def test_fast_tokenizer_is_sacrebleus(cls: type) -> None:
    rng = random.Random(7)
    alphabet = PUNCT + UNICODE + CJK + NUMBERS + ["a", "Z", "9", " ", "   ", "\t"]
    fast, ref = _fast_tokenizer(cls()), cls()
    assert fast is not ref and not isinstance(fast, cls)  # the fast path is in use
    for _ in range(5000):
        line = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert fast(line) == ref(line), line


def test_pair_scores_clamps_and_short_circuits() -> None:
    assert pair_scores("same text", " same text ") == (1.0, 100.0)
    assert pair_scores("text", "") == (0.0, 0.0)
    rouge, bleu = pair_scores("the cat sat on the mat", "the cat sat on a mat")
    assert bleu == pytest.approx(sacre("the cat sat on the mat", "the cat sat on a mat"), abs=0)
    assert rouge == 5 / 6
    assert pair_scores("the cat sat on the mat", "the cat sat on a mat", False)[1] is None
