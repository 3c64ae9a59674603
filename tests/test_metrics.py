"""Metric definitions, parity with evaluate's defaults, CJK handling, perplexity."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
from rouge_score import rouge_scorer, scoring

from probes.metrics import (
    MAX_LOG_PERPLEXITY,
    PERPLEXITY_CAP,
    CjkTokenizer,
    Likelihood,
    Scorer,
    count_words,
    exact_match,
    has_cjk,
    normalize_for_exact_match,
    perplexity,
    score_batch,
    score_pairs,
    worst_value,
)

REFS = [
    "The notice period is thirty days.",
    "Liability is capped at the fees paid in the previous twelve months.",
    "This agreement is governed by the laws of Ireland.",
    "Reset the VPN token from the self-service portal.",
    "Employees accrue 1.5 days of leave per month.",
]
PREDS = [
    "The notice period is 30 days.",
    "Liability is capped at fees paid during the previous twelve months.",
    "This agreement is governed by the laws of Ireland.",
    "Restart the VPN client, then reset the token.",
    "Employees get 18 days of leave a year.",
]


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    return Scorer()


def test_hand_computed_values(scorer: Scorer) -> None:
    # ref tokens: the cat sat on the mat / pred: the cat sat on a mat
    s = scorer.score("the cat sat on the mat", "the cat sat on a mat")
    assert s["rouge1"] == pytest.approx(5 / 6)  # 5 clipped unigram matches of 6
    assert s["rouge2"] == pytest.approx(3 / 5)  # the-cat, cat-sat, sat-on
    assert s["rougeL"] == pytest.approx(5 / 6)  # LCS "the cat sat on mat"
    assert s["rougeLsum"] == pytest.approx(5 / 6)
    # n-gram precisions 5/6, 3/5, 2/4, 1/3, brevity penalty 1 -> (1/12) ** (1/4)
    assert s["bleu"] == pytest.approx(100 * (1 / 12) ** 0.25)
    assert s["exact_match"] == 0.0
    assert s["length_ratio"] == 1.0
    assert 0 < s["chrf"] < 100


def test_rouge_matches_evaluate_defaults(scorer: Scorer) -> None:
    # evaluate's rouge: RougeScorer(rouge_types, use_stemmer=False, tokenizer=None), fmeasure
    direct = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=False)
    items = scorer.score_pairs(REFS, PREDS)
    for ref, pred, item in zip(REFS, PREDS, items, strict=True):
        expected = direct.score(ref, pred)
        for key in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
            assert item[key] == expected[key].fmeasure
    corpus = scorer.corpus(REFS, PREDS)
    # evaluate aggregates with BootstrapAggregator().mid: a bootstrap estimate of this mean
    np.random.seed(0)
    agg = scoring.BootstrapAggregator()
    for ref, pred in zip(REFS, PREDS, strict=True):
        agg.add_scores(direct.score(ref, pred))
    boot = agg.aggregate()
    for key in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
        assert corpus[key] == pytest.approx(float(np.mean([i[key] for i in items])), abs=1e-12)
        assert corpus[key] == pytest.approx(boot[key].mid.fmeasure, abs=0.03)
        assert boot[key].low.fmeasure <= corpus[key] <= boot[key].high.fmeasure


def test_bleu_chrf_match_evaluate_defaults(scorer: Scorer) -> None:
    corpus = scorer.corpus(REFS, PREDS)
    # evaluate's sacrebleu: corpus_bleu(preds, [refs], smooth_method="exp", smooth_value=None,
    # force=False, lowercase=False, use_effective_order=False), default tokenizer 13a
    expected = sacrebleu.corpus_bleu(
        PREDS,
        [REFS],
        smooth_method="exp",
        smooth_value=None,
        force=False,
        lowercase=False,
        tokenize="13a",
        use_effective_order=False,
    )
    assert corpus["bleu"] == expected.score
    # evaluate's chrf: CHRF(6, 0, 2, lowercase=False, whitespace=False, eps_smoothing=False)
    assert corpus["chrf"] == sacrebleu.corpus_chrf(PREDS, [REFS], char_order=6, word_order=0, beta=2).score
    items = scorer.score_pairs(REFS, PREDS)
    for ref, pred, item in zip(REFS, PREDS, items, strict=True):
        assert item["bleu"] == sacrebleu.sentence_bleu(pred, [ref]).score
        assert item["chrf"] == sacrebleu.sentence_chrf(pred, [ref]).score
    # evaluate's documented example: identical texts -> 100
    assert scorer.corpus(["hello there general kenobi"], ["hello there general kenobi"])[
        "bleu"
    ] == pytest.approx(100.0)


def test_chinese(scorer: Scorer) -> None:
    ref = "员工每年享有十五天带薪年假。"
    same = scorer.score(ref, ref)
    for key in ("rouge1", "rouge2", "rougeL", "rougeLsum", "exact_match"):
        assert same[key] == 1.0
    assert same["bleu"] == pytest.approx(100.0)
    assert same["chrf"] == pytest.approx(100.0)
    diff = scorer.score(ref, "员工每年享有十天带薪病假。")
    for key in ("rouge1", "rouge2", "rougeL", "bleu", "chrf"):
        assert 0 < diff[key] < (100 if key in ("bleu", "chrf") else 1)
    # why the tokenizer is needed: rouge-score's default keeps only [a-z0-9]
    plain = rouge_scorer.RougeScorer(["rouge1"]).score(ref, ref)["rouge1"].fmeasure
    assert plain == 0.0
    assert CjkTokenizer().tokenize("使用VPN-2连接") == ["使", "用", "vpn", "2", "连", "接"]
    assert has_cjk("年假") and not has_cjk("annual leave")
    # sacrebleu's zh tokenizer splits the characters, so the per-item BLEU is the zh one
    assert diff["bleu"] == sacrebleu.sentence_bleu("员工每年享有十天带薪病假。", [ref], tokenize="zh").score
    assert scorer.agreement(ref, ref) == 1.0


def test_cjk_tokenizer_equals_default_on_latin() -> None:
    from rouge_score import tokenize

    for text in REFS + ["Ünïcode, punctuation! and CAPS 42", "  "]:
        assert CjkTokenizer().tokenize(text) == tokenize.tokenize(text, None)


def test_exact_match_normalisation() -> None:
    assert exact_match("return  a + b\n", " return a + b") == 1.0
    assert exact_match("ＡＢＣ", "ABC") == 1.0  # NFKC folds full-width forms
    assert exact_match("Return a", "return a") == 0.0  # case kept
    assert normalize_for_exact_match("a\t b\n\nc ") == "a b c"


def test_length_ratio_and_empty(scorer: Scorer) -> None:
    s = scorer.score("one two three four", "one two")
    assert s["length_ratio"] == 0.5
    empty = scorer.score("one two", "")
    assert empty["rougeL"] == 0.0 and empty["bleu"] == 0.0 and empty["length_ratio"] == 0.0
    assert "length_ratio" not in scorer.score("", "anything")  # undefined, so absent
    with pytest.raises(ValueError):
        scorer.score_pairs(["a"], [])


def test_agreement_is_rougeL_between_outputs(scorer: Scorer) -> None:
    a, b = "the cat sat on the mat", "the cat sat on a mat"
    assert scorer.agreement(a, b) == pytest.approx(5 / 6)
    assert scorer.agreement(a, b) == scorer.agreement(b, a)


def test_process_pool_gives_identical_scores(scorer: Scorer) -> None:
    refs = REFS * 8
    preds = PREDS[1:] + PREDS[:1]
    preds = preds * 8
    assert score_pairs(refs, preds, workers=2) == score_pairs(refs, preds)
    two, one = score_batch(refs, preds, workers=2), score_batch(refs, preds)
    assert scorer.corpus_from(two) == scorer.corpus_from(one) == scorer.corpus(refs, preds)


def test_corpus_bleu_on_chinese_is_zh_tokenised(scorer: Scorer) -> None:
    refs = [
        "员工每年享有十五天带薪年假。",
        "临时权限的最长有效期为二十四小时。",
        "先关闭电源，等待三十秒后重新启动。",
    ]
    preds = [
        "员工每年享有十天带薪年假。",
        "临时权限的有效期为二十四小时。",
        "先关闭电源，等待三十秒后重新启动。",
    ]
    corpus = scorer.corpus(refs, preds)
    assert corpus["bleu"] == sacrebleu.corpus_bleu(preds, [refs], tokenize="zh").score
    assert 0 < corpus["bleu"] < 100
    assert corpus["chrf"] == sacrebleu.corpus_chrf(preds, [refs]).score
    # a mixed corpus: each segment tokenised like its per-item score (13a == zh on these English)
    mixed = scorer.corpus(REFS + refs, PREDS + preds)
    assert mixed["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(PREDS + preds, [REFS + refs], tokenize="zh").score
    )


def test_perplexity_lm_eval_definitions() -> None:
    one = perplexity([Likelihood(logprob_sum=-6.0, n_tokens=3, n_bytes=12, n_words=2)])
    assert one["ppl"] == pytest.approx(math.exp(2.0))
    assert one["word_perplexity"] == pytest.approx(math.exp(3.0))
    assert one["byte_perplexity"] == pytest.approx(math.exp(0.5))
    assert one["bits_per_byte"] == pytest.approx(6.0 / (12 * math.log(2)))
    # pooled, weighted by counts (lm-eval weighted_perplexity), not a mean of per-item values
    two = perplexity([Likelihood(-6.0, 3, 12, 2), Likelihood(-2.0, 1, 4, 1)])
    assert two["ppl"] == pytest.approx(math.exp(8.0 / 4))
    assert two["byte_perplexity"] == pytest.approx(math.exp(8.0 / 16))
    assert perplexity([Likelihood(0.0, 0, 0, 0)]) == {}  # unmeasurable: absent, never 0
    assert count_words("a  b\tc") == 3


@pytest.mark.parametrize("logprob_sum", [-2e6, -1e4 * 7, -math.inf, math.nan])
def test_perplexity_of_a_garbage_engine_is_capped_never_raised(logprob_sum: float) -> None:
    """Issue 17: a per-word NLL past ~709 nats made math.exp raise OverflowError inside replay. A
    reference the engine gives no probability (overflowing, -inf or NaN log-likelihoods) is the
    worst finite value instead."""
    out = perplexity([Likelihood(logprob_sum, 7, 30, 5)])
    assert out["ppl"] == out["word_perplexity"] == out["byte_perplexity"] == PERPLEXITY_CAP
    assert out["bits_per_byte"] == pytest.approx(MAX_LOG_PERPLEXITY / math.log(2))
    assert all(math.isfinite(v) for v in out.values())
    # pooled with healthy items: one destroyed reference makes the pooled value the worst too
    pooled = perplexity([Likelihood(-3.0, 3, 12, 2), Likelihood(logprob_sum, 7, 30, 5)])
    assert pooled["ppl"] == PERPLEXITY_CAP
    # just below the cap it is still the exact value
    assert perplexity([Likelihood(-99.0, 1, 1, 1)])["ppl"] == pytest.approx(math.exp(99.0))
    assert worst_value("ppl") == PERPLEXITY_CAP and worst_value("rougeL") == 0.0
    assert worst_value("length_ratio") is None and worst_value("my_custom") is None


@pytest.mark.skipif(importlib.util.find_spec("evaluate") is None, reason="evaluate not installed")
def test_custom_metric_through_evaluate(tmp_path, monkeypatch) -> None:
    from probes.metrics import CustomMetric

    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    script = tmp_path / "char_len_ratio.py"
    script.write_text((Path(__file__).parent / "data" / "char_len_ratio.py").read_text())
    metric = CustomMetric(script)
    assert metric.compute(["abcd"], ["ab"]) == {"char_len_ratio": 0.5}


def test_a_revoked_partitions_series_are_removed() -> None:
    from prometheus_client import generate_latest

    from watchdog.core.metrics import Metrics

    m = Metrics()
    for p in (0, 1):
        m.lag.labels(str(p)).set(5)
        m.watermark.labels(str(p)).set(1.0)
        m.checkpoint_bytes.labels(str(p)).set(10)
    m.forget_partition(1)
    m.forget_partition(7)  # never exported: nothing to remove, no error
    text = generate_latest(m.registry).decode()
    assert 'partition="0"' in text and 'partition="1"' not in text
