"""Checkpoint JSON through orjson without losing a value (``core.exact_json``): a document whose
floats are all finite is written by orjson, one holding inf, -inf or NaN anywhere by ``json.dumps`` as
before (orjson writes them as null); engine states read back what was saved, those judged on thin
traffic (an MDE of inf) included; and engine states a previous release wrote (``json.dumps`` with
``Infinity`` tokens) still load after the upgrade."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.engine_pack import judged_states
from watchdog.core import exact_json
from watchdog.core.keys import Keys
from watchdog.policy import PolicyEngine
from watchdog.policy.evaluate import Verdict
from watchdog.policy.loader import load_policy_files
from watchdog.policy.state import RuleState, ScopeState, rule_fingerprint
from watchdog.state import partitions as P
from watchdog.state.checkpoint import PACKED, SCHEMA, CheckpointStore, engine_text

ROOT = Path(__file__).resolve().parent.parent
POLICY = "fp8-default"
INF, NAN = math.inf, math.nan


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, a tuple to the list JSON makes of it."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("doc", [
    {"a": 1.5, "b": [1, 2.25, None, True, "x"], "c": {"d": (0.1, -3e-7)}},
    [1e-05, 1e16, 5e-324, 1.7976931348623157e308, -0.0],
    {"route": "support/チャット", "reason": "p99 +12 %, fails: 3", "n": 2**63 - 1},
    {},
])
def test_a_document_of_finite_floats_is_written_by_orjson_and_reads_back_equal(doc: Any) -> None:
    text = exact_json.dumps(doc)
    assert text == orjson.dumps(doc).decode()
    assert _same(json.loads(text), doc)


@pytest.mark.parametrize("doc", [
    {"extra": {"horizon_mde": INF, "horizon_mde_full": INF}},
    {"a": [1.0, {"b": (2.0, -INF)}]},
    {"x": NAN},
    [[[[NAN]]]],
    INF,
])
def test_a_non_finite_float_anywhere_is_written_by_json_dumps_and_reads_back(doc: Any) -> None:
    assert not exact_json.finite(doc)
    text = exact_json.dumps(doc)
    assert text == json.dumps(doc)  # Infinity / -Infinity / NaN, as every release wrote them
    assert _same(json.loads(text), doc)


def test_what_orjson_would_write_differently_goes_to_json_dumps() -> None:
    class Name(str):
        pass

    @dataclasses.dataclass
    class Thing:
        x: int = 1

    class Level(float, enum.Enum):  # orjson writes an enum's value: inf would be null
        TOP = INF

    class Size(enum.IntEnum):
        BIG = 3

    for doc in ({1: "int key"}, {"a": Name("x")}, {"a": 2**70}, {"a": "\ud800"}, {"a": [Level.TOP]},
                {"a": (Size.BIG,)}):
        assert exact_json.dumps(doc) == json.dumps(doc)
    assert not exact_json.finite({"a": [Level.TOP]}) and not exact_json.finite({"a": Name("x")})
    assert json.loads(exact_json.dumps({"a": [Level.TOP]}))["a"] == [INF]
    for bad in ({"a": Thing()}, {"a": object()}):
        with pytest.raises(TypeError):
            exact_json.dumps(bad)


def _engine() -> PolicyEngine:
    return PolicyEngine(load_policy_files([str(ROOT / "policies" / "default.yaml")]))


def _state(engine: PolicyEngine) -> ScopeState:
    """A route's engine state with non-finite floats where the judges put them and elsewhere (its
    rule is the default policy's, so that loading it into ``engine`` keeps it)."""
    policy = engine.policy_set.get(POLICY)
    assert policy is not None
    fingerprint = rule_fingerprint(policy.rule("latency-typical"))  # type: ignore[arg-type]
    last = Verdict("latency-typical", "inconclusive", "no baseline signal in this window", "live", "latency_p50_ms",
                   1800000120.0, 1800000130.0, candidate=518.09, samples=2,
                   extra={"horizon_windows": 0.0, "horizon_log_lr": 0.0, "horizon_mde": INF, "horizon_mde_full": INF},
                   judgement={"status": "inconclusive", "estimate": None, "ci_low": -INF, "ci_high": INF,
                              "detail": {"horizon": {"mde_now": INF, "mde_horizon": INF, "se": NAN}}})
    rule = RuleState(fingerprint, last=last, ref={"candidate": 1.0, "baseline": NAN},
                     pool=[{"end": 1800000120.0, "e": -0.42, "v": 0.0}],
                     horizon={"seq": {"count": 0, "tests": [], "end": None, "w": 0.0}})
    return ScopeState(rules={**_fresh_rules(policy), "latency-typical": rule}, last_end={"live": 1800000130.0},
                      healthy=3, serving="fp8")


def _fresh_rules(policy: Any) -> dict[str, RuleState]:
    """A state for every rule of ``policy``, as the engine keeps them (a saved scope that lacks one of the
    policy's rules was saved before that rule was added: its healthy count restarts when it loads)."""
    return {r.name: RuleState(rule_fingerprint(r)) for r in policy.rules}


def test_an_engine_state_with_inf_and_nan_reads_back_what_was_saved() -> None:
    engine = _engine()
    st = _state(engine)
    text = P.engine_json({POLICY: st.to_json()})
    assert "Infinity" in text and "NaN" in text and "null" not in text.split('"extra"')[1][:100]
    P.load_engine_states(engine, {("m", "r"): json.loads(text)})
    back = engine.states[(POLICY, "m", "r")]
    assert _same(back.to_json(), st.to_json())
    assert back.rules["latency-typical"].last.extra["horizon_mde"] == INF  # type: ignore[union-attr]


def test_packed_engine_states_read_back_exactly_and_are_a_third_of_the_size() -> None:
    """``redis.pack_engine_state``: zstd and base64 over the same text; what a replica reads back is the
    text that was packed, and the judged states of a thin 10,000-route replica shrink about 3x."""
    states = judged_states(100, 10)
    plain = [P.engine_json(scopes) for scopes in states.values()]
    packed = [P.engine_value(scopes, packed=True) for scopes in states.values()]
    assert all(p.startswith(PACKED) and p.isascii() for p in packed)
    assert [engine_text(p) for p in packed] == plain
    assert [engine_text(t) for t in plain] == plain  # the JSON form reads as itself
    assert engine_text(packed[0].encode()) == plain[0]  # a client that does not decode replies
    ratio = sum(map(len, plain)) / sum(map(len, packed))
    assert ratio > 2.5, ratio


def test_judged_engine_states_read_back_exactly_and_only_those_with_inf_use_json_dumps() -> None:
    states = judged_states(200, 10)
    nonfinite = 0
    for scopes in states.values():
        doc = {"schema": SCHEMA, "scopes": scopes}
        text = P.engine_json(scopes)
        assert _same(json.loads(text), doc)
        if exact_json.finite(doc):
            assert text == orjson.dumps(doc).decode()
        else:
            nonfinite += 1
            assert text == json.dumps(doc) and "Infinity" in text
    assert 0 < nonfinite < len(states) // 2, nonfinite


@pytest.mark.services
def test_engine_states_a_previous_release_wrote_still_load(redis_client) -> None:
    """A rolling restart: the previous release wrote every engine state with ``json.dumps`` (spaces,
    ``Infinity``); this one writes orjson's text where it can. A replica reads either, and what it
    reads is the state that was saved."""
    keys = Keys()
    engine = _engine()
    rules = _fresh_rules(engine.policy_set.get(POLICY))
    old, new = _state(engine), ScopeState(rules=rules, last_end={"live": 1800000130.0}, healthy=5)
    redis_client.set(keys.engine("g", "m", "old"), json.dumps({"schema": SCHEMA, "scopes": {POLICY: old.to_json()}},
                                                               check_circular=False))
    redis_client.set(keys.engine("g", "m", "new"), P.engine_json({POLICY: new.to_json()}))
    redis_client.set(keys.engine("g", "m", "packed"), P.engine_value({POLICY: old.to_json()}, packed=True))
    assert ": " in redis_client.get(keys.engine("g", "m", "old")) and ": " not in redis_client.get(keys.engine("g", "m", "new"))
    store = CheckpointStore(redis_client, keys, "g", "t", "reader")
    saved = store.load_engines([("m", "new"), ("m", "old"), ("m", "packed")])
    assert _same(saved[("m", "packed")], saved[("m", "old")])  # a value packed by a replica that has it on
    P.load_engine_states(engine, saved)
    assert _same(engine.states[(POLICY, "m", "new")].to_json(), new.to_json())
    assert _same(engine.states[(POLICY, "m", "old")].to_json(), old.to_json())
    assert engine.states[(POLICY, "m", "old")].rules["latency-typical"].last.extra["horizon_mde"] == INF  # type: ignore[union-attr]
