"""Live windows over inference events, and the quantile sketch they keep latencies in."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson
import pytest

from watchdog.core.events import InferenceEvent, ShadowResult
from watchdog.core.signals import Signal
from watchdog.windows.aggregator import WindowAggregator
from watchdog.windows.shadow import preload_scorers, shadow_agreement
from watchdog.windows.sketch import QuantileSketch

# --- sketch -----------------------------------------------------------------------------------

QS = [0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0]


def heavy_tailed(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        return rng.lognormal(mean=5.0, sigma=1.5, size=n)
    if kind == "pareto":  # tail index 1.2: infinite variance
        return (rng.pareto(1.2, size=n) + 1.0) * 20.0
    if kind == "bimodal":
        return np.concatenate([rng.normal(50, 5, n // 2).clip(0.01), rng.lognormal(8, 1, n - n // 2)])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["lognormal", "pareto", "bimodal"])
@pytest.mark.parametrize("alpha", [0.01, 0.02])
def test_relative_accuracy_against_numpy(kind: str, alpha: float) -> None:
    data = heavy_tailed(kind, 20_000, seed=7)
    sk = QuantileSketch(relative_accuracy=alpha)
    for x in data.tolist():
        sk.add(x)
    got = sk.quantiles(QS)
    # the sketch uses the nearest-rank definition
    want = np.quantile(data, QS, method="inverted_cdf")
    for q, g, w in zip(QS, got, want, strict=True):
        assert g is not None
        assert abs(g - w) <= alpha * w * (1 + 1e-9), (q, g, w)
    assert sk.count == len(data)
    assert sk.mean == pytest.approx(float(data.mean()))
    assert len(sk) < 1000  # a few hundred buckets for ~6 decades


def test_merge_equals_one_sketch_of_everything() -> None:
    a_data, b_data = heavy_tailed("pareto", 3000, 1), heavy_tailed("lognormal", 3000, 2)
    a, b, both = QuantileSketch(), QuantileSketch(), QuantileSketch()
    for x in a_data.tolist():
        a.add(x)
        both.add(x)
    for x in b_data.tolist():
        b.add(x)
        both.add(x)
    a.merge(b)
    assert a.buckets == both.buckets and a.count == both.count
    assert (a.min, a.max) == (both.min, both.max)
    assert a.quantiles(QS) == both.quantiles(QS)
    with pytest.raises(ValueError):
        a.merge(QuantileSketch(relative_accuracy=0.05))


def test_empty_and_invalid() -> None:
    sk = QuantileSketch()
    assert sk.quantile(0.5) is None and sk.mean is None and len(sk) == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            sk.add(bad)
    with pytest.raises(ValueError):
        sk.quantile(1.5)
    with pytest.raises(ValueError):
        QuantileSketch(relative_accuracy=0.0)


def test_zero_bucket_and_weights() -> None:
    sk = QuantileSketch(min_value=1e-3)
    sk.add(0.0, n=3)
    sk.add(100.0, n=7)
    assert sk.count == 10 and sk.zero_count == 3
    assert sk.quantile(0.0) == 0.0
    assert sk.quantile(0.2) == 0.0
    assert sk.quantile(0.5) == pytest.approx(100.0, rel=0.01)
    assert sk.quantile(1.0) == 100.0  # clamped to the exact max


def test_bucket_count_is_bounded_and_tail_stays_accurate() -> None:
    sk = QuantileSketch(relative_accuracy=0.01, max_buckets=64)
    data = np.geomspace(1e-2, 1e6, 50_000)  # spans far more than 64 buckets
    for x in data.tolist():
        sk.add(x)
    assert len(sk.buckets) <= 64
    assert sk.count == len(data)
    p99 = sk.quantile(0.99)
    want = float(np.quantile(data, 0.99, method="inverted_cdf"))
    assert p99 is not None and abs(p99 - want) <= 0.01 * want


def test_export_round_trip_and_alignment() -> None:
    a, b = QuantileSketch(), QuantileSketch()
    for x in (0.0, 1.0, 10.0, 10.0, 500.0):
        a.add(x)
    for x in (10.0, 20.0):
        b.add(x)
    d = orjson.loads(orjson.dumps(a.to_dict()))
    back = QuantileSketch.from_dict(d)
    assert back.buckets == a.buckets and back.zero_count == 1 and back.count == 5
    assert back.quantiles(QS) == a.quantiles(QS)
    values, ca, cb = a.aligned_counts(b)
    assert values == sorted(values) and values[0] == 0.0
    assert sum(ca) == 5 and sum(cb) == 2 and len(values) == len(ca) == len(cb)
    assert ca[0] == 1 and cb[0] == 0
    ten = min(range(len(values)), key=lambda i: abs(values[i] - 10.0))
    assert ca[ten] == 2 and cb[ten] == 1


@pytest.mark.parametrize("values", [[], [0.0], [5.0], [0.0, 1.0, 10.0, 10.0, 500.0], [1e-4, 0.5, 3.0] * 400,
                                    [float(x) for x in range(1, 3000)] + [1e6] * 70000])
def test_pack_round_trips_exactly_and_is_smaller(values: list[float]) -> None:
    """Checkpoint form (issue 19 item 1): the same sketch back, in fewer bytes than ``to_dict``."""
    sk = QuantileSketch()
    for x in values:
        sk.add(x)
    packed = sk.pack()
    back = QuantileSketch.load(orjson.loads(orjson.dumps(packed)))
    assert back.to_dict() == sk.to_dict()
    assert back.quantiles(QS) == sk.quantiles(QS)
    if len(sk.buckets) > 2:  # counts up to 255 take one byte each; larger ones two or four
        small = max(sk.buckets.values()) < 256
        assert len(orjson.dumps(packed)) < len(orjson.dumps(sk.to_dict())) * (0.5 if small else 1.0)


def test_sketch_load_reads_the_dict_form_of_older_checkpoints() -> None:
    sk = QuantileSketch()
    for x in (0.0, 2.0, 40.0, 40.0, 900.0):
        sk.add(x)
    assert QuantileSketch.load(orjson.loads(orjson.dumps(sk.to_dict()))).to_dict() == sk.to_dict()


# --- windows ----------------------------------------------------------------------------------


def ev(ts: float = 1000.0, **over: Any) -> InferenceEvent:
    fields: dict[str, Any] = {
        "request_id": f"r-{ts}",
        "ts": ts,
        "model": "m",
        "route": "a",
        "precision": "fp8",
        "status": "ok",
        "latency_ms": 100.0,
    }
    shadow = over.pop("shadow", None)
    fields.update(over)
    e = InferenceEvent(**fields)
    if shadow is not None:
        e.shadow = ShadowResult(precision="fp16", completion=shadow)
    return e


def one_signal(events: list[InferenceEvent], **kw: Any) -> Signal:
    agg = WindowAggregator(**kw)
    for e in events:
        assert agg.add(e)
    signals = agg.close_all()
    assert len(signals) == 1
    return signals[0]


METRIC_CASES = [
    # (name, events, expected values (approx), metrics that must be absent)
    (
        "status rates",
        [ev(status="ok"), ev(status="ok"), ev(status="error"), ev(status="timeout")],
        {"error_rate": 0.5, "timeout_rate": 0.25},
        {"empty_rate", "perplexity", "shadow_rougeL", "shadow_bleu", "ttft_p99_ms"},
    ),
    (
        "only failures: no latency or token metrics",
        [ev(status="error"), ev(status="timeout", latency_ms=30000.0)],
        {"error_rate": 1.0, "timeout_rate": 0.5},
        {"latency_p50_ms", "latency_p99_ms", "tokens_per_s", "mean_completion_tokens"},
    ),
    (
        "tokens per second over ok requests",
        [
            ev(latency_ms=500.0, completion_tokens=50),
            ev(latency_ms=1500.0, completion_tokens=150),
            ev(status="error", latency_ms=1.0, completion_tokens=0),
        ],
        {"tokens_per_s": 100.0, "mean_completion_tokens": 100.0},
        set(),
    ),
    (
        "empty rate only over events that carry a completion",
        [ev(completion="hi"), ev(completion="  \n"), ev(completion=""), ev(), ev(status="error", completion="")],
        {"empty_rate": 2 / 3},
        set(),
    ),
    (
        "perplexity from logprobs",
        [ev(completion_logprobs=[-1.0, -1.0]), ev(completion_logprobs=[-2.0, 0.0]), ev(completion_logprobs=[])],
        {"perplexity": math.exp(1.0)},
        set(),
    ),
    (
        "ttft p99",
        [ev(ttft_ms=10.0), ev(ttft_ms=20.0), ev()],
        {"ttft_p99_ms": 20.0},
        set(),
    ),
    (
        "latency quantiles",
        [ev(latency_ms=float(x)) for x in range(1, 101)],
        {"latency_p50_ms": 50.0, "latency_p95_ms": 95.0, "latency_p99_ms": 99.0},
        set(),
    ),
    (
        "identical shadow completions agree fully",
        [ev(completion="the cat sat", shadow="the cat sat"), ev(completion="", shadow=" ")],
        {"shadow_rougeL": 1.0, "shadow_bleu": 100.0},
        set(),
    ),
    (
        "disjoint and one-sided empty shadows",
        [ev(completion="alpha beta gamma", shadow="one two three"), ev(completion="x", shadow="")],
        {"shadow_rougeL": 0.0, "shadow_bleu": 0.0},
        set(),
    ),
    (
        # LCS of 'the cat sat on the mat' / 'the cat sat on a mat' is 5 of 6 tokens: F = 5/6
        "partial shadow agreement",
        [ev(completion="the cat sat on the mat", shadow="the cat sat on a mat")],
        {"shadow_rougeL": 5 / 6},
        set(),
    ),
    (
        "shadow without a primary completion is not a pair",
        [ev(shadow="the cat")],
        {},
        {"shadow_rougeL", "shadow_bleu"},
    ),
]


@pytest.mark.parametrize(("name", "events", "expected", "absent"), METRIC_CASES, ids=[c[0] for c in METRIC_CASES])
def test_window_metrics(name: str, events: list[InferenceEvent], expected: dict[str, float], absent: set[str]) -> None:
    sig = one_signal(events)
    assert sig.source == "live" and sig.samples == len(events)
    for metric, want in expected.items():
        tol = 0.01 * want if metric.startswith(("latency_", "ttft_")) else 1e-9
        assert sig.values[metric] == pytest.approx(want, abs=tol), metric
    for metric in absent:
        assert metric not in sig.values, metric
    assert all(math.isfinite(v) for v in sig.values.values())


def test_partial_bleu_is_between_bounds() -> None:
    sig = one_signal([ev(completion="the quick brown fox jumps over the dog", shadow="the quick brown fox jumped over the dog")])
    assert 0.0 < sig.values["shadow_bleu"] < 100.0
    assert 0.0 < sig.values["shadow_rougeL"] < 1.0


def test_signal_shape_and_keys() -> None:
    agg = WindowAggregator(length_s=10.0, grace_s=2.0)
    agg.add(ev(ts=1005.0))
    agg.add(ev(ts=1009.999, precision="fp16"))
    agg.add(ev(ts=1010.0))  # a window boundary belongs to the next window
    agg.add(ev(ts=1011.0, route="b", model="m2"))
    assert agg.open_windows() == 4
    signals = agg.close_all()
    got = [(s.start, s.end, s.model, s.route, s.precision, s.samples) for s in signals]
    assert got == [
        (1000.0, 1010.0, "m", "a", "fp16", 1),
        (1000.0, 1010.0, "m", "a", "fp8", 1),
        (1010.0, 1020.0, "m", "a", "fp8", 1),
        (1010.0, 1020.0, "m2", "b", "fp8", 1),
    ]
    assert agg.open_windows() == 0 and agg.windows_closed == 4
    hist = QuantileSketch.from_dict(signals[0].detail["latency_hist"])
    assert hist.count == 1 and hist.quantile(0.5) == pytest.approx(100.0, rel=0.01)
    assert signals[0].detail["events"] == 1 and signals[0].detail["ok"] == 1


def test_grace_and_lateness() -> None:
    agg = WindowAggregator(length_s=10.0, grace_s=2.0)
    assert agg.add(ev(ts=1001.0))
    assert agg.add(ev(ts=1012.0))
    assert agg.close_due(1011.999) == []  # end 1010 + grace 2 not yet reached
    closed = agg.close_due(1012.0)
    assert [(s.start, s.samples) for s in closed] == [(1000.0, 1)]
    assert agg.closed_until == 1010.0
    # late for the closed window, whatever the scope (even one that never had an event)
    assert not agg.add(ev(ts=1009.0))
    assert not agg.add(ev(ts=1003.0, route="other"))
    assert agg.late == 2
    assert agg.add(ev(ts=1015.0))  # the next window is still open
    assert agg.close_due(1012.5) == []  # the clock moving a little does not close it
    closed = agg.close_due(1030.0)
    assert [(s.start, s.samples) for s in closed] == [(1010.0, 2)]
    assert agg.folded == 3 and agg.open_windows() == 0
    assert agg.close_due(1000.0) == []  # a clock going backwards does not reopen windows
    assert not agg.add(ev(ts=1019.0)) and agg.late == 3


def test_skip_before_drops_replayed_events() -> None:
    agg = WindowAggregator(length_s=10.0)
    agg.skip_before = 1020.0
    results = [agg.add(ev(ts=t)) for t in (1005.0, 1019.99, 1020.0, 1025.0)]
    assert results == [False, False, True, True]
    assert (agg.replayed, agg.late, agg.folded) == (2, 0, 2)
    assert [s.samples for s in agg.close_all()] == [2]


def test_events_far_in_the_future_are_dropped() -> None:
    agg = WindowAggregator(length_s=10.0, max_future_s=60.0)
    assert agg.add(ev(ts=99999.0))  # no clock seen yet: nothing to compare with
    agg.close_due(1000.0)
    assert agg.add(ev(ts=1059.0))
    assert not agg.add(ev(ts=1061.0))
    assert (agg.future, agg.folded) == (1, 2)


def test_min_open_offsets_follow_window_closes() -> None:
    agg = WindowAggregator(length_s=10.0, grace_s=0.0)
    assert agg.min_open_offsets() == {}
    p0, p1 = ("logs", 0), ("logs", 1)
    agg.add(ev(ts=1001.0), p0, 100)
    agg.add(ev(ts=1002.0, route="b"), p0, 99)
    agg.add(ev(ts=1003.0), p1, 7)
    agg.add(ev(ts=1011.0), p0, 101)
    agg.add(ev(ts=1012.0), p1, 8)
    agg.add(ev(ts=1013.0))  # no offset (e.g. a backtest): tracked nowhere
    assert agg.min_open_offsets() == {p0: 99, p1: 7}
    agg.close_due(1010.0)
    assert agg.min_open_offsets() == {p0: 101, p1: 8}
    agg.close_due(1020.0)
    assert agg.min_open_offsets() == {}


def test_bounded_memory_in_a_busy_window() -> None:
    agg = WindowAggregator(length_s=10.0, shadow_max_pairs=50, shadow_max_chars=40)
    rng = np.random.default_rng(3)
    latencies = rng.lognormal(5, 1.2, 100_000).tolist()
    long_text = "word " * 100
    for i, lat in enumerate(latencies):
        e = InferenceEvent(f"r{i}", 1000.0 + i * 1e-4, "m", "a", "fp8", "ok", lat, completion_tokens=10,
                           completion=long_text, shadow=ShadowResult(completion=long_text))
        agg.add(e, ("t", 0), i)
    (w,) = agg._open.values()
    assert len(w.latency.buckets) < 1000
    assert len(w.pairs) == 50  # scores of the 50 sampled pairs are kept, not their texts
    (sig,) = agg.close_all()
    assert sig.samples == 100_000
    assert sig.detail["shadow_seen"] == 100_000 and sig.detail["shadow_pairs"] == 50
    want = float(np.quantile(latencies, 0.99, method="inverted_cdf"))
    assert abs(sig.values["latency_p99_ms"] - want) <= 0.01 * want


def test_shadow_sampling_rate_is_deterministic_per_request() -> None:
    def pairs(rate: float) -> int:
        agg = WindowAggregator(shadow_sample_rate=rate, shadow_max_pairs=10_000)
        for i in range(2000):
            agg.add(ev(ts=1000.0, request_id=f"req-{i}", completion="a b", shadow="a b"))
        (sig,) = agg.close_all()
        assert sig.detail["shadow_seen"] == 2000
        return int(sig.detail["shadow_pairs"])

    assert pairs(0.0) == 0
    assert pairs(1.0) == 2000
    half = pairs(0.5)
    assert 850 < half < 1150 and half == pairs(0.5)
    no_pairs = one_signal([ev(completion="a", shadow="a")], shadow_max_pairs=0)
    assert "shadow_rougeL" not in no_pairs.values and no_pairs.detail["shadow_seen"] == 1


def test_pair_sample_is_the_smallest_request_hashes_of_the_whole_window_in_any_order() -> None:
    import random
    import zlib

    ids = [f"q{i}" for i in range(2000)]
    smallest = sorted(zlib.crc32(i.encode()) for i in ids)[:20]
    for order_seed in (1, 2):
        shuffled = ids[:]
        random.Random(order_seed).shuffle(shuffled)
        agg = WindowAggregator(shadow_max_pairs=20)
        for rid in shuffled:
            agg.add(ev(ts=1000.0, request_id=rid, completion=f"c {rid}", shadow="s"))
        (w,) = agg._open.values()
        assert sorted(-h for h, _ in w.pairs) == smallest  # uniform over the window, replay-proof


@pytest.mark.parametrize(
    ("kwargs"),
    [{"length_s": 0}, {"grace_s": -1}, {"shadow_sample_rate": 1.5}, {"shadow_max_pairs": -1}],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        WindowAggregator(**kwargs)


def test_shadow_agreement_helper() -> None:
    preload_scorers()
    assert shadow_agreement([("a b c", "a b c"), ("x", "y")]) == (0.5, 50.0)
    with pytest.raises(ValueError):
        shadow_agreement([])


# --- CJK shadow agreement (scored through probes.metrics) ------------------------------------

ZH_REF = "合同的通知期为三十天。"
ZH_CLOSE = "合同的通知期为九十天。"  # one character of ten differs
ZH_OTHER = "患者按到达时间分诊。"  # no character in common with ZH_REF


def test_chinese_pairs_score_per_character() -> None:
    import sacrebleu

    from probes.metrics import Scorer

    rouge_l, bleu = shadow_agreement([(ZH_CLOSE, ZH_REF)])
    # LCS of 9 CJK characters over 10 and 10: P = R = F = 0.9 (the old [a-z0-9] tokenizer gave 0)
    assert rouge_l == pytest.approx(0.9)
    assert rouge_l == pytest.approx(Scorer().agreement(ZH_REF, ZH_CLOSE))
    assert bleu == pytest.approx(sacrebleu.sentence_bleu(ZH_CLOSE, [ZH_REF], tokenize="zh").score)
    assert 30.0 < bleu < 100.0
    other_rouge, other_bleu = shadow_agreement([(ZH_OTHER, ZH_REF)])
    assert other_rouge == 0.0 and other_bleu < 10.0  # only the final "。" is shared (smoothed BLEU)


def test_mixed_chinese_english_pair() -> None:
    rouge_l, bleu = shadow_agreement([("使用 VPN token 重置", "使用 VPN token 重新设置")])
    # tokens: 使 用 vpn token 重 置  vs  使 用 vpn token 重 新 设 置 -> LCS 6, P 6/6, R 6/8
    assert rouge_l == pytest.approx(2 * 1.0 * 0.75 / 1.75)
    assert 0.0 < bleu < 100.0


def test_chinese_regression_shows_in_the_window() -> None:
    healthy = [ev(request_id=f"h{i}", completion=ZH_CLOSE if i % 4 == 0 else ZH_REF, shadow=ZH_REF)
               for i in range(40)]
    broken = [ev(request_id=f"b{i}", completion=ZH_OTHER if i % 2 else ZH_REF, shadow=ZH_REF)
              for i in range(40)]
    good, bad = one_signal(healthy), one_signal(broken)
    assert good.values["shadow_rougeL"] == pytest.approx((30 * 1.0 + 10 * 0.9) / 40)
    assert bad.values["shadow_rougeL"] == pytest.approx(0.5)
    assert good.values["shadow_bleu"] > bad.values["shadow_bleu"]
    # the shipped policy's shadow rule (value < 0.80) trips on the broken window only
    assert good.values["shadow_rougeL"] >= 0.80 > bad.values["shadow_rougeL"]


def test_rouge_l_equals_rouge_score_on_random_and_real_pairs() -> None:
    import random

    from rouge_score import rouge_scorer

    from probes.metrics import CjkTokenizer, Scorer
    from watchdog.windows.shadow import lcs_length, rouge_l

    reference = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=CjkTokenizer())
    scorer = Scorer()
    rng = random.Random(3)
    vocab = ["a", "b", "c", "d", "e", "合", "同", "天"]
    for _ in range(300):
        t = [rng.choice(vocab) for _ in range(rng.randrange(0, 90))]
        p = [rng.choice(vocab) for _ in range(rng.randrange(0, 90))]
        assert rouge_l(t, p) == reference.score(" ".join(t), " ".join(p))["rougeL"].fmeasure
        # plain DP as a second reference for the bit-parallel LCS
        dp = [[0] * (len(p) + 1) for _ in range(len(t) + 1)]
        for i, x in enumerate(t):
            for j, y in enumerate(p):
                dp[i + 1][j + 1] = dp[i][j] + 1 if x == y else max(dp[i][j + 1], dp[i + 1][j])
        assert lcs_length(t, p) == dp[-1][-1]
    for a, b in [("The notice period is thirty days.", "The notice period is ninety days!"),
                 (ZH_CLOSE, ZH_REF), ("使用 VPN token 重置", "使用 VPN token 重新设置"),
                 ("Café déjà vu 42", "cafe deja vu 42")]:
        assert shadow_agreement([(a, b)])[0] == pytest.approx(scorer.agreement(b, a), abs=1e-12)


def test_open_windows_survive_a_checkpoint_round_trip_exactly() -> None:
    import json

    def feed(agg: WindowAggregator, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            agg.add(ev(ts=1000.0 + i * 0.01, request_id=f"r{i}", latency_ms=100.0 + i,
                       completion=f"the cat {i % 7}", shadow="the cat 3", status="error" if i % 13 == 0 else "ok"),
                    ("t", 0), i)

    straight = WindowAggregator(length_s=10.0, shadow_max_pairs=30)
    feed(straight, 0, 600)
    half = WindowAggregator(length_s=10.0, shadow_max_pairs=30)
    feed(half, 0, 300)
    restored = WindowAggregator(length_s=10.0, shadow_max_pairs=30)
    restored.import_open(json.loads(json.dumps(half.export_open())))
    feed(restored, 300, 600)
    a, b = straight.close_all(), restored.close_all()
    assert [(s.route, s.samples, s.values, s.detail) for s in a] == [(s.route, s.samples, s.values, s.detail) for s in b]
    assert a[0].samples == 600 and a[0].detail["shadow_pairs"] == 30


# --- request mix, replicas, builds (watchdog/windows/fleet.py) ----------------------------------


def _fleet_event(i: int, latency: float, prompt: int, completion: int, replica: str | None, build: str | None,
                 status: str = "ok") -> InferenceEvent:
    return InferenceEvent(f"q{i}", 1000.0 + i * 0.01, "m", "r", "fp8", status, latency, prompt, completion,
                          replica=replica, build=build)


def test_window_keeps_mix_cells_replicas_and_builds() -> None:
    agg = WindowAggregator(length_s=60.0)
    rng = np.random.default_rng(0)
    lats: dict[tuple[int, int], list[float]] = {}
    for i in range(600):
        p, c = int(rng.choice([30, 3000])), int(rng.choice([10, 200]))
        lat = float(rng.lognormal(6, 0.3))
        agg.add(_fleet_event(i, lat, p, c, f"pod-{i % 3}", "v1" if i < 500 else "v2"))
        lats.setdefault((p.bit_length(), c.bit_length()), []).append(lat)
    agg.add(_fleet_event(999, 5.0, 1, 1, None, "v2", status="error"))
    (sig,) = agg.close_all()
    cells = {(int(r[0]), int(r[1])): r[2:] for r in sig.detail["latency_mix"]["cells"]}
    assert cells.keys() == lats.keys()
    for k, xs in lats.items():
        y = np.log(xs)
        assert cells[k][0] == len(xs)
        assert cells[k][1] == pytest.approx(y.sum()) and cells[k][2] == pytest.approx((y * y).sum())
    reps = sig.detail["replicas"]
    assert sorted(reps) == ["pod-0", "pod-1", "pod-2"]
    assert sum(r["latency_hist"]["count"] for r in reps.values()) == 600
    assert sum(row[2] for r in reps.values() for row in r["cells"]) == 600
    assert sig.detail["builds"] == {"v1": 500, "v2": 101}  # every event names its build, errors too


def test_replicas_and_builds_are_bounded_and_checkpointed() -> None:
    from watchdog.windows.fleet import MAX_BUILDS, MAX_REPLICAS

    agg = WindowAggregator(length_s=60.0)
    for i in range(200):
        agg.add(_fleet_event(i, 100.0 + i, 10, 10, f"pod-{i}", f"b{i}"))
    agg.add(_fleet_event(500, 100.0, 10, 10, None, None))
    data = agg.export_open()
    again = WindowAggregator(length_s=60.0)
    again.import_open(orjson.loads(orjson.dumps(data)))
    # the form checkpoints had before the packed one (issue 19 item 1) loads to the same window
    from watchdog.windows.fleet import cell_list, unpack_cells

    (old,) = orjson.loads(orjson.dumps(data))
    old["lat"] = QuantileSketch.unpack(old["lat"]).to_dict()
    fleet = old["fleet"]
    fleet["cells"] = cell_list(unpack_cells(fleet["cells"]))
    fleet["rep"] = {k: {"lat": QuantileSketch.unpack(r["lat"]).to_dict(), "cells": cell_list(unpack_cells(r["cells"]))}
                    for k, r in fleet["rep"].items()}
    older = WindowAggregator(length_s=60.0)
    older.import_open([old])
    (a,), (b,), (c,) = agg.close_all(), again.close_all(), older.close_all()
    assert a.detail == b.detail == c.detail
    reps = a.detail["replicas"]
    # MAX_REPLICAS named, then one shared entry (the unnamed request lands there too, the table is full)
    assert len(reps) == MAX_REPLICAS + 1 and reps["_other"]["latency_hist"]["count"] == 200 - MAX_REPLICAS + 1
    assert len(a.detail["builds"]) == MAX_BUILDS + 1 and a.detail["builds"]["_other"] == 200 - MAX_BUILDS


def test_events_without_replica_or_build_add_only_the_mix() -> None:
    agg = WindowAggregator(length_s=60.0)
    agg.add(_fleet_event(0, 100.0, 10, 10, None, None))
    (sig,) = agg.close_all()
    assert "replicas" not in sig.detail and "builds" not in sig.detail
    assert sig.detail["latency_mix"]["cells"] == [[4, 4, 1.0, math.log(100.0), math.log(100.0) ** 2]]
    # an old checkpoint (no "fleet" entry) still loads
    w = WindowAggregator(length_s=60.0)
    w.add(_fleet_event(1, 100.0, 10, 10, None, None))
    (d,) = w.export_open()
    d.pop("fleet")
    d["lat"] = QuantileSketch.unpack(d["lat"]).to_dict()  # and sketches in the form before ``pack``
    w2 = WindowAggregator(length_s=60.0)
    w2.import_open([d])
    (s2,) = w2.close_all()
    assert "latency_mix" not in s2.detail and s2.detail["events"] == 1


def test_cancelled_client_error_and_rate_limited_are_not_fp8_errors() -> None:
    """Issue 20 §3: a client that hangs up, sends a bad request or is throttled says nothing about
    the precision: counted apart (``not_judged``), never in ``error_rate`` nor in ``samples``."""
    from watchdog.core.events import decode_event, encode_event
    from watchdog.windows.window import Window

    agg = WindowAggregator(length_s=10, grace_s=0)
    base = {"schema": 1, "ts": 5.0, "model": "m", "route": "r", "precision": "fp8", "latency_ms": 10.0}
    statuses = ["ok", "ok", "error", "cancelled", "client_error", "rate_limited", "CANCELLED"]
    for i, status in enumerate(statuses):
        assert agg.add(decode_event(encode_event({**base, "request_id": f"r{i}", "status": status})), ("t", 0), i)
    (key,) = agg._open
    restored = Window.from_export(agg._open[key].export(key))
    assert restored.not_judged == {"cancelled": 2, "client_error": 1, "rate_limited": 1}
    (sig,) = agg.close_all()
    assert sig.samples == 3 and sig.values["error_rate"] == pytest.approx(1 / 3)
    assert sig.detail["not_judged"] == {"cancelled": 2, "client_error": 1, "rate_limited": 1}


def test_a_snapshot_exports_like_its_window_and_does_not_follow_it() -> None:
    """Checkpoints are built as snapshots on the loop and encoded later (issue 19 item 1): a snapshot
    exports exactly what its window did at that moment, whatever the window takes afterwards."""
    agg = WindowAggregator(length_s=60.0)
    for i in range(30):
        agg.add(ev(1200.0 + i, request_id=f"q{i}", latency_ms=50.0 + 3 * i, ttft_ms=5.0 + i, prompt_tokens=10 * i,
                   completion=f"the cat sat {i}", shadow=f"the cat sat {i % 3}", replica=f"pod-{i % 3}", build="b1",
                   status="ok" if i % 7 else "cancelled"), ("t", 0), i)
    (key,) = agg._open
    w = agg._open[key]
    before = orjson.dumps(w.export(key))
    snap = w.snapshot()
    for i in range(30, 60):
        agg.add(ev(1200.0 + i / 2, request_id=f"q{i}", latency_ms=900.0, completion="x", shadow="y",
                   replica=f"pod-{i}", build="b2", status="cancelled" if i % 5 == 0 else "ok"), ("t", 0), 0)
    w.flush()
    assert orjson.dumps(snap.export(key)) == before
    assert orjson.dumps(w.export(key)) != before


def _close_due_reference(agg: WindowAggregator, now: float, limit: int) -> list[tuple[int, str, str, str]]:
    """The keys ``close_due(now, limit)`` closed before its due keys were kept sorted between calls."""
    upto = math.floor((now - agg.grace_s) / agg.length_s)
    closed_end = upto if agg.closed_end is None else max(agg.closed_end, upto)
    due = sorted(k for k in agg._open if k[0] + 1 <= closed_end)
    if len(due) > limit:
        cut = max(limit, 1)
        while cut < len(due) and due[cut][:3] == due[cut - 1][:3]:
            cut += 1
        due = due[:cut]
    return due


@pytest.mark.parametrize("limit", [0, 1, 3, 7, 50])
def test_close_due_in_chunks_closes_what_sorting_every_call_closed(limit: int) -> None:
    import random

    rng = random.Random(limit)
    agg = WindowAggregator(length_s=10.0, grace_s=0.0)
    now = 0.0
    for step in range(40):
        for _ in range(rng.randrange(0, 30)):  # events for this window and the next (and some late)
            t = now + rng.uniform(-5.0, 15.0)
            agg.add(InferenceEvent(request_id=f"q{step}-{_}", ts=t, model="m", route=f"r{rng.randrange(12)}",
                                   precision=rng.choice(["fp8", "fp16"]), status="ok", latency_ms=100.0))
        if step % 9 == 8:  # a checkpoint restore in between
            data = agg.export_open()
            agg._open.clear()
            agg.import_open(data)
        now += rng.choice([0.0, 2.5, 10.0, 20.0])
        for _ in range(rng.randrange(1, 4)):
            want = _close_due_reference(agg, now, limit)
            got = agg.close_due(now, limit=limit)
            assert [(int(s.start // 10), s.model, s.route, s.precision) for s in got] == want
    agg.close_all()


@pytest.mark.parametrize("n", [1, 2, 255, 256, 1000])
def test_a_one_bucket_sketch_and_a_one_cell_mix_pack_to_the_general_layout(n: int) -> None:
    """The short paths of ``QuantileSketch.pack`` and ``pack_cells`` (a near-empty window) give the bytes
    of the general layout: typecodes + base64 of little-endian gaps and counts / uint16 keys + float64."""
    import base64
    from array import array

    from watchdog.windows.fleet import pack_cells, unpack_cells

    sk = QuantileSketch()
    for _ in range(n):
        sk.add(123.4)
    (key, count), = sk.buckets.items()
    tc = "B" if count < 0x100 else "H"
    packed = sk.pack()
    assert packed[7] == key
    assert packed[8] == "B" + tc + base64.b64encode(array(tc, [count]).tobytes()).decode("ascii")
    back = QuantileSketch.unpack(packed)
    assert (back.buckets, back.count, back.sum, back.min, back.max) == (sk.buckets, sk.count, sk.sum, sk.min, sk.max)
    cells = {(3 << 6) | 7: [float(n), 4.81 * n, 23.2 * n]}
    raw = array("H", list(cells)).tobytes() + array("d", cells[(3 << 6) | 7]).tobytes()
    assert pack_cells(cells) == base64.b64encode(raw).decode("ascii")
    assert unpack_cells(pack_cells(cells)) == cells


@pytest.mark.parametrize("values", [[120.0], [100.0, 100.4], [100.0, 100.4, 100.2, 100.1], [5.0] * 300])
def test_quantiles_of_a_one_bucket_sketch_are_its_clamped_bucket_value(values: list[float]) -> None:
    sk = QuantileSketch()
    for v in values:
        sk.add(v)
    assert len(sk.buckets) == 1 and not sk.zero_count
    (key,) = sk.buckets
    want = min(max(sk.bucket_value(key), min(values)), max(values))
    assert sk.quantiles([0.5, 0.0, 1.0, 0.99]) == [want] * 4
    if len(set(values)) == 1:
        assert sk.quantile(0.99) == values[0]
    with pytest.raises(ValueError):
        sk.quantiles([1.5])


@pytest.mark.parametrize("limit", [1, 3, 50])
def test_close_due_closes_the_routes_asked_first_first_and_the_same_windows_as_without(limit: int) -> None:
    """``first`` changes only the order: the routes asked close ahead of the others (with ``first_only``,
    alone), each route's windows oldest first and its precisions in one call, and every due window closes
    once, as ``close_due`` without ``first`` closes it."""
    import random

    rng = random.Random(limit)
    agg = WindowAggregator(length_s=10.0, grace_s=0.0)
    plain = WindowAggregator(length_s=10.0, grace_s=0.0)
    now = 0.0

    def key(s: Signal) -> tuple[float, str, str | None, int]:
        return (s.end, s.route, s.precision, s.samples)

    for step in range(40):
        events = [InferenceEvent(request_id=f"q{step}-{i}", ts=now + rng.uniform(-5.0, 15.0), model="m",
                                 route=f"r{rng.randrange(12)}", precision=rng.choice(["fp8", "fp16"]), status="ok",
                                 latency_ms=100.0) for i in range(rng.randrange(0, 30))]
        for ev_ in events:
            assert agg.add(ev_, ("t", 0), 0) == plain.add(ev_, ("t", 0), 0)
        now += rng.choice([0.0, 2.5, 10.0, 20.0])
        first = {("m", f"r{i}") for i in rng.sample(range(12), 3)}
        want = plain.close_due(now)
        calls: list[list[Signal]] = []
        while calls == [] or calls[-1]:
            calls.append(agg.close_due(now, limit=limit, first=first, first_only=True))
        ahead = [s for c in calls for s in c]
        rest: list[list[Signal]] = []
        while rest == [] or rest[-1]:
            rest.append(agg.close_due(now, limit=limit, first=first))
        assert sorted(map(key, ahead)) == sorted(key(s) for s in want if ("m", s.route) in first)
        assert sorted(key(s) for c in rest for s in c) == sorted(key(s) for s in want if ("m", s.route) not in first)
        closed_in: dict[tuple[str, float], int] = {}
        last: dict[str, float] = {}
        for i, c in enumerate(calls + rest):
            for s in c:
                assert closed_in.setdefault((s.route, s.end), i) == i  # a route's precisions in one call
                assert s.end >= last.get(s.route, -1.0)  # a route's windows oldest first
                last[s.route] = s.end
    agg.close_all()


def test_close_due_does_not_look_over_the_open_windows_again_until_the_close_mark_moves() -> None:
    """Once the due windows of a close mark are closed, the next calls for that mark (the loop makes
    one per partition per iteration) find nothing due without a pass over every open window; a new mark,
    a restore and ``set_closed_end`` look again. What closes is what sorting every call closed
    (``test_close_due_in_chunks_closes_what_sorting_every_call_closed``)."""

    class Counted(dict):  # type: ignore[type-arg]
        passes = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            Counted.passes += 1
            return super().__iter__()

    agg = WindowAggregator(length_s=10.0, grace_s=0.0)
    agg._open = Counted()
    for i in range(50):
        for t in (5.0, 15.0):
            agg.add(InferenceEvent(request_id=f"q{i}-{t}", ts=t, model="m", route=f"r{i}", precision="fp8",
                                   status="ok", latency_ms=100.0))
    closed = []
    while True:
        got = agg.close_due(10.0, limit=7)
        closed += got
        if not got:
            break
    assert len(closed) == 50 and Counted.passes == 1
    for _ in range(20):
        assert agg.close_due(11.0, limit=7) == [] and agg.close_due(12.0, limit=7, first={("m", "r3")},
                                                                    first_only=True) == []
    assert Counted.passes == 1 and len(agg._open) == 50
    assert not agg.add(InferenceEvent(request_id="late", ts=9.0, model="m", route="r9", precision="fp16",
                                      status="ok", latency_ms=1.0))  # late: nothing joins the due set
    assert len(agg.close_due(20.0, limit=100)) == 50 and Counted.passes == 2  # the next mark: one more look
    agg.import_open([])
    assert agg.close_due(20.0, limit=100) == [] and Counted.passes == 3


def test_failures_are_counted_per_replica_and_survive_a_checkpoint() -> None:
    """Errors and timeouts are counted per replica (``replica_fails``: [ok, errors, timeouts]), a replica
    that only failed included, so a rate rule can leave out one replica's crash; the counts come back
    from a checkpoint exactly and a window without a failure carries none."""
    import json

    agg = WindowAggregator(length_s=60.0)
    for i in range(300):
        rep = f"fp8-{i % 3}"
        status = "error" if rep == "fp8-0" and i < 150 else ("timeout" if i % 50 == 1 else "ok")
        agg.add(_fleet_event(i, 100.0, 30, 10, rep, None, status), ("t", 0), i)
    agg.add(_fleet_event(400, 100.0, 30, 10, "fp8-9", None, "error"), ("t", 0), 400)  # only failed
    restored = WindowAggregator(length_s=60.0)
    restored.import_open(json.loads(json.dumps(agg.export_open())))
    (sig,), (again,) = agg.close_all(), restored.close_all()
    fails = sig.detail["replica_fails"]
    assert fails == again.detail["replica_fails"]
    assert fails["fp8-0"] == [49, 50, 1] and fails["fp8-9"] == [0, 1, 0]  # request 201 timed out on it
    assert fails["fp8-1"][2] + fails["fp8-2"][2] + fails["fp8-0"][2] == sig.detail["timeouts"]
    assert sum(f[1] for f in fails.values()) == sig.detail["errors"]
    quiet = WindowAggregator(length_s=60.0)
    for i in range(30):
        quiet.add(_fleet_event(i, 100.0, 30, 10, f"fp8-{i % 3}", None), ("t", 0), i)
    assert "replica_fails" not in quiet.close_all()[0].detail
