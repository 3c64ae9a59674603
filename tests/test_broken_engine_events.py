"""An engine whose logits overflowed reports NaN or -inf log-probabilities: its events are counted
as the worst tokens there are, so the route rolls back, rather than dead-lettered and lost."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from watchdog.core.events import MIN_LOGPROB, InvalidEvent, decode_event
from watchdog.gateway.openai_io import StreamParser, parse_response
from watchdog.policy import PolicyEngine
from watchdog.policy.loader import load_policy_files
from watchdog.windows.aggregator import WindowAggregator

POLICIES = Path(__file__).resolve().parent.parent / "policies"
BASE = {"schema": 1, "request_id": "r1", "ts": 1_764_000_000.0, "model": "m", "route": "chat", "precision": "fp8",
        "status": "ok", "latency_ms": 120.0, "prompt_tokens": 10, "completion_tokens": 20, "completion": "an answer"}


def raw(**fields: Any) -> bytes:
    """As a Python server writes it: ``json.dumps`` puts NaN / Infinity / -Infinity literals in."""
    return json.dumps({**BASE, **fields}).encode()


@pytest.mark.parametrize("bad", [math.nan, -math.inf, -1e308, -2e4])
def test_non_finite_and_below_floor_logprobs_are_the_worst_token(bad: float) -> None:
    ev = decode_event(raw(completion_logprobs=[-0.1, bad, 0.0],
                          shadow={"precision": "fp16", "completion": "x", "completion_logprobs": [bad]}))
    assert ev.completion_logprobs == [-0.1, MIN_LOGPROB, 0.0]
    assert ev.shadow is not None and ev.shadow.completion_logprobs == [MIN_LOGPROB]


@pytest.mark.parametrize(("fields", "reason"), [
    ({"latency_ms": math.nan}, "bad_value:latency_ms"),
    ({"ttft_ms": math.inf}, "bad_value:ttft_ms"),
    ({"ts": math.nan}, "bad_value:ts"),
    ({"completion_logprobs": [math.inf]}, "bad_value:completion_logprobs"),  # +inf is no log-probability
    ({"completion_logprobs": [-0.1, 0.5]}, "bad_value:completion_logprobs"),
    ({"shadow": {"precision": "fp16", "latency_ms": math.nan}}, "bad_value:shadow.latency_ms"),
])
def test_non_finite_values_elsewhere_are_still_dead_letters(fields: dict[str, Any], reason: str) -> None:
    with pytest.raises(InvalidEvent) as exc:
        decode_event(raw(**fields))
    assert exc.value.reason == reason


def test_text_that_says_nan_is_not_a_number_and_broken_json_stays_not_json() -> None:
    ev = decode_event(raw(completion="NaN and Infinity", completion_logprobs=[-0.5]))
    assert ev.completion == "NaN and Infinity" and ev.completion_logprobs == [-0.5]
    with pytest.raises(InvalidEvent) as exc:
        decode_event(b'{"schema": 1, "latency_ms": NaN, ')
    assert exc.value.reason == "not_json"


def test_gateway_counts_an_upstream_answer_with_nan_logprobs() -> None:
    body = json.dumps({"choices": [{"index": 0, "message": {"content": "ok"},
                                    "logprobs": {"content": [{"logprob": math.nan}, {"logprob": -0.2},
                                                             {"logprob": -math.inf}]}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 3}}).encode()
    res = parse_response("chat", body)
    assert res.completion == "ok" and res.completion_tokens == 3
    assert res.logprobs == [MIN_LOGPROB, -0.2, MIN_LOGPROB]
    stream = StreamParser("completion")
    stream.feed(b'data: {"choices": [{"index": 0, "text": "a", "logprobs": {"token_logprobs": [NaN]}}]}\n\n'
                b'data: {"choices": [{"index": 0, "text": "b", "logprobs": {"token_logprobs": [-0.3]}}]}\n\n')
    assert stream.result.logprobs == [MIN_LOGPROB, -0.3]


def _window(k: int, rng: random.Random, broken: bool) -> list[bytes]:
    """One 10 s window of one route as raw events: 300 requests per precision, 40 logprobs each;
    FP8's engine reports NaN for ~1 token in 50 when ``broken`` (its text and latency look normal)."""
    out = []
    for prec in ("fp8", "fp16"):
        for i in range(300):
            lps: list[float] = [-rng.expovariate(2.0) for _ in range(40)]
            if broken and prec == "fp8" and i % 50 == 0:
                lps[rng.randrange(40)] = math.nan
            out.append(raw(request_id=f"{k}-{prec}-{i}", ts=k * 10.0 + rng.uniform(0.0, 10.0), route="legal/qa",
                           precision=prec, latency_ms=(70.0 if prec == "fp8" else 100.0) * rng.lognormvariate(0, 0.3), completion_tokens=40,
                           prompt_tokens=200, completion_logprobs=lps, replica=f"{prec}-{i % 4}"))
    return out


@pytest.mark.parametrize("policy", ["default.yaml", "strict-legal-medical.yaml"])
def test_an_fp8_engine_reporting_nan_logprobs_rolls_the_route_back(policy: str) -> None:
    engine = PolicyEngine(load_policy_files([str(POLICIES / policy)]))
    agg = WindowAggregator(length_s=10.0, grace_s=0.0)
    rng = random.Random(5)
    rolled_at = None
    for k in range(12):
        for ev in _window(k, rng, broken=k >= 6):
            agg.add(decode_event(ev))  # none is dead-lettered
        acts = engine.observe(agg.close_due((k + 1) * 10.0), (k + 1) * 10.0, {}, "fp8")
        assert k >= 6 or acts == [], f"healthy window {k}: {acts}"
        rollbacks = [a for a in acts if a.kind == "rollback"]
        if rollbacks:
            rolled_at = k
            assert "perplexity" in rollbacks[0].reason
            break
    assert rolled_at is not None and rolled_at <= 6 + 2  # perplexity-rise: 'for' 3 (default) / 2 (strict)
