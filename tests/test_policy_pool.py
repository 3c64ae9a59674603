"""Pooled judged rules: ``judge: {pool: k}`` on live windows, ``judge: {replays: 2}`` on golden
replays. Pools live in the engine state (bounded, JSON-able, reset after every flip) and survive
export/import; old saved states without pools still load."""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest

from tests.test_policy_judge import T0, M, R, policies, policy
from tests.test_policy_judge import Sim as TextSim
from watchdog.core.signals import Signal
from watchdog.policy import PolicyEngine, PolicySet, parse_policy_text
from watchdog.windows.sketch import QuantileSketch


def policy_set(rules: str, head: str = "") -> PolicySet:
    return policies(policy(rules, head=head))


def rate_rule(pool: int | None, for_: int = 1, min_samples: int = 1) -> str:
    extra = "" if pool is None else f", pool: {pool}"
    return f"""\
      - name: errors
        metric: error_rate
        judge: {{test: rate, effect: 0.01, alpha: 0.01, min_items: 100{extra}}}
        min_samples: {min_samples}
        for: {for_}
        action: rollback
"""


def latency_rule(pool: int | None) -> str:
    extra = "" if pool is None else f", pool: {pool}"
    return f"""\
      - name: latency
        metric: latency_p50_ms
        judge: {{test: mann_whitney, effect: 0.05, alpha: 0.01, min_items: 50{extra}}}
        action: rollback
"""


def golden_rule(replays: int | None, effect: float = 0.02) -> str:
    extra = "" if replays is None else f", replays: {replays}"
    return f"""\
      - name: golden
        source: golden
        metric: rougeL
        judge: {{test: paired, effect: {effect}, alpha: 0.01, min_items: 30{extra}}}
        action: rollback
"""


class Sim(TextSim):
    def __init__(self, ps: PolicySet) -> None:
        self.engine = PolicyEngine(ps)
        self.flags: dict[tuple[str, str], str] = {}

    def rule(self, name: str):
        return self.engine.states[("p", M, R)].rules[name]


def counts(t: float, errors: tuple[int, int], n: tuple[int, int] = (1000, 1000), length: float = 60.0) -> list[Signal]:
    return [Signal("live", M, R, prec, t - length, t, k, {"error_rate": e / k},
                   detail={"events": k, "errors": e, "timeouts": 0})
            for prec, e, k in (("fp8", errors[0], n[0]), ("fp16", errors[1], n[1]))]


def sketch(scale: float, n: int) -> dict:
    """A log-normal window without sampling noise (its quantiles), so a test does not hang on a seed."""
    sk = QuantileSketch()
    for i in range(n):
        sk.add(scale * math.exp(0.3 * NormalDist().inv_cdf((i + 0.5) / n)))
    return sk.to_dict()


def latencies(t: float, cand_scale: float, n: int = 150) -> list[Signal]:
    return [Signal("live", M, R, prec, t - 60, t, n, {"latency_p50_ms": scale},
                   detail={"latency_hist": sketch(scale, n)})
            for prec, scale in (("fp8", cand_scale), ("fp16", 100.0))]


def replay(t: float, diffs: list[float], golden_set: str = "code") -> list[Signal]:
    n = len(diffs)
    return [Signal("golden", M, R, "fp8", t - 30, t, n, {"rougeL": 0.6}, paired={"rougeL": list(diffs)},
                   detail={"golden_set": golden_set}),
            Signal("golden", M, R, "fp16", t - 30, t, n, {"rougeL": 0.6}, detail={"golden_set": golden_set})]


# --- live pools --------------------------------------------------------------------------------


def test_pooled_rate_trips_where_single_windows_stay_marginal() -> None:
    # 3.2 % vs 0.8 % on 1000 requests each: one window's 99 % interval straddles 1 point
    single, pooled = Sim(policy_set(rate_rule(None))), Sim(policy_set(rate_rule(3)))
    for i in range(4):
        assert single.step(counts(T0 + 60 * i, (32, 8)), T0 + 60 * i) == []
    assert single.rule("errors").last.status == "marginal"
    assert pooled.step(counts(T0, (32, 8)), T0) == []
    assert pooled.rule("errors").last.status == "marginal" and len(pooled.rule("errors").pool) == 1
    (a,) = pooled.step(counts(T0 + 60, (32, 8)), T0 + 60)
    j = a.detail["verdicts"][0]["judgement"]
    assert a.kind == "rollback" and j["status"] == "fail" and j["detail"]["pooled_windows"] == 2
    assert j["ci_low"] > 0.01 and a.detail["verdicts"][0]["extra"]["pooled"] == 2.0
    assert not pooled.rule("errors").pool  # a fresh pool after the flip


def test_pool_keeps_only_the_last_k_windows_and_is_json() -> None:
    sim = Sim(policy_set(rate_rule(3)))
    for i in range(6):
        sim.step(counts(T0 + 60 * i, (10, 10)), T0 + 60 * i)
    pool = sim.rule("errors").pool
    assert [e["end"] for e in pool] == [T0 + 180, T0 + 240, T0 + 300]
    assert pool[-1]["candidate"] == [10, 1000] and list(pool[-1]["samples"]) == [1000, 1000]
    assert sim.rule("errors").last.judgement["detail"]["pooled_windows"] == 3
    json.dumps(sim.engine.export_state(), allow_nan=False)
    # /status shows how many windows are pooled, not their contents
    (scope,) = sim.engine.snapshot()["scopes"]
    assert scope["rules"]["errors"]["pooled"] == 3 and "pool" not in scope["rules"]["errors"]


def test_a_gap_in_traffic_starts_the_pool_over() -> None:
    sim = Sim(policy_set(rate_rule(3)))
    sim.step(counts(T0, (10, 10)), T0)
    sim.step(counts(T0 + 60, (10, 10)), T0 + 60)
    sim.step(counts(T0 + 3600, (10, 10)), T0 + 3600)  # an hour later: old windows are not pooled
    assert [e["end"] for e in sim.rule("errors").pool] == [T0 + 3600]
    sim.step(counts(T0 + 3660, (10, 10)), T0 + 3660)
    assert len(sim.rule("errors").pool) == 2


def test_pooled_min_samples_counts_the_pool() -> None:
    sim = Sim(policy_set(rate_rule(3, min_samples=250)))
    sim.step(counts(T0, (3, 1), n=(100, 100)), T0)
    v = sim.rule("errors").last
    assert v.status == "inconclusive" and "100/100 < min_samples 250" in v.reason
    sim.step(counts(T0 + 60, (3, 1), n=(100, 100)), T0 + 60)
    assert sim.rule("errors").last.status == "inconclusive"
    sim.step(counts(T0 + 120, (3, 1), n=(100, 100)), T0 + 120)
    v = sim.rule("errors").last
    assert v.status != "inconclusive" or "min_samples" not in v.reason, v.reason
    assert v.judgement is not None and v.judgement["detail"]["pooled_windows"] == 3


def test_unreadable_window_is_inconclusive_and_not_pooled() -> None:
    sim = Sim(policy_set(rate_rule(3)))
    sim.step(counts(T0, (10, 10)), T0)
    sigs = counts(T0 + 60, (10, 10))
    sigs[1].detail = {}
    sim.step(sigs, T0 + 60)
    assert sim.rule("errors").last.status == "inconclusive" and len(sim.rule("errors").pool) == 1
    bad = counts(T0 + 120, (10, 10))
    bad[0].error = "consumer lag"
    sim.step(bad, T0 + 120)
    assert sim.rule("errors").last.status == "error" and len(sim.rule("errors").pool) == 1


def test_pooled_latency_catches_what_one_window_cannot() -> None:
    single, pooled = Sim(policy_set(latency_rule(None))), Sim(policy_set(latency_rule(3)))
    got_single, got_pooled = [], []
    for i in range(3):
        t = T0 + 60 * i
        single.step(latencies(t, 112.0), t)
        got_single.append(single.rule("latency").last.status)
        acts = pooled.step(latencies(t, 112.0), t)
        got_pooled.append(pooled.rule("latency").last.status)
        if acts:
            break
    assert got_single == ["marginal"] * 3 and got_pooled == ["marginal", "marginal", "fail"], (got_single, got_pooled)
    assert got_pooled[-1] == "fail" and pooled.flags[(M, R)] == "fp16", got_pooled
    j = pooled.rule("latency").last.judgement
    assert j["detail"]["pooled_windows"] == len(got_pooled) > 1 and j["ci_low"] > 0.05


def test_external_flag_change_resets_the_pool() -> None:
    sim = Sim(policy_set(rate_rule(3)))
    sim.step(counts(T0, (10, 10)), T0)
    sim.step(counts(T0 + 60, (10, 10)), T0 + 60)
    sim.flags[(M, R)] = "fp16"  # an operator pinned the route
    sim.step(counts(T0 + 120, (10, 10)), T0 + 120)
    assert [e["end"] for e in sim.rule("errors").pool] == [T0 + 120]


def test_promote_resets_the_pool() -> None:
    sim = Sim(policy_set(rate_rule(3)))
    sim.flags[(M, R)] = "fp16"
    kinds = []
    t = T0
    for _ in range(4):
        kinds += [a.kind for a in sim.step(counts(t, (20, 20), n=(5000, 5000)), t)]
        t += 60
    assert "promote" in kinds and sim.flags[(M, R)] == "fp8"
    assert len(sim.rule("errors").pool) < 3


# --- persistence -------------------------------------------------------------------------------


def test_export_import_continues_the_pool() -> None:
    ps = policy_set(rate_rule(3))
    a = Sim(ps)
    a.step(counts(T0, (32, 8)), T0)
    saved = json.loads(json.dumps(a.engine.export_state()))
    b = Sim(ps)
    b.engine.import_state(saved)
    assert len(b.rule("errors").pool) == 1
    (act,) = b.step(counts(T0 + 60, (32, 8)), T0 + 60)
    assert act.kind == "rollback" and act.detail["verdicts"][0]["judgement"]["detail"]["pooled_windows"] == 2


def test_old_state_without_pools_still_loads() -> None:
    ps = policy_set(rate_rule(3))
    a = Sim(ps)
    a.step(counts(T0, (10, 10)), T0)
    saved = a.engine.export_state()
    for scope in saved["scopes"]:
        for r in scope["state"]["rules"].values():
            del r["pool"]  # as saved before pooled rules existed
    b = Sim(ps)
    b.engine.import_state(saved)
    assert not b.rule("errors").pool and b.engine.states[("p", M, R)].last_end["live"] == T0
    b.step(counts(T0 + 60, (10, 10)), T0 + 60)
    assert len(b.rule("errors").pool) == 1


def test_changed_pool_setting_drops_the_rule_state_on_reload() -> None:
    sim = Sim(policy_set(rate_rule(3)))
    sim.step(counts(T0, (10, 10)), T0)
    sim.engine.set_policy_set(policy_set(rate_rule(5)))
    sim.step(counts(T0 + 60, (10, 10)), T0 + 60)
    assert len(sim.rule("errors").pool) == 1


# --- golden replays ----------------------------------------------------------------------------


def flips(n: int, k: int, size: float) -> list[float]:
    """``k`` of ``n`` items drop by ``size``, the rest are identical (FP8 rarely changes an answer)."""
    return [-size] * k + [0.0] * (n - k)


def test_two_replays_pool_item_by_item() -> None:
    # 200 items, 11.5 % drop by 0.35 in each replay (different items): each replay alone straddles
    # 2 points; their per-item mean is sure the mean drop (4.0 points) is beyond 2
    rng = np.random.default_rng(3)
    first = flips(200, 23, 0.35)
    second = list(rng.permutation(first))
    single, pooled = Sim(policy_set(golden_rule(None))), Sim(policy_set(golden_rule(2)))
    for sim in (single, pooled):
        assert sim.step(replay(T0, first), T0) == []
        assert sim.rule("golden").last.status == "marginal"
    assert single.step(replay(T0 + 3600, second), T0 + 3600) == []
    (a,) = pooled.step(replay(T0 + 3600, second), T0 + 3600)
    j = a.detail["verdicts"][0]["judgement"]
    assert a.kind == "rollback" and j["method"] == "t_replays" and j["detail"]["pooled_replays"] == 2
    assert set(j["detail"]["looks"]) == {"latest", "pooled2"} and j["ci_high"] < -0.02


def test_large_drop_fails_on_the_first_look_and_the_pool_restarts_after() -> None:
    sim = Sim(policy_set(golden_rule(2)))
    sim.step(replay(T0, [0.0] * 32), T0)
    stale = list(np.clip(np.random.default_rng(1).normal(-0.4, 0.2, 32), -1, 0))
    (a,) = sim.step(replay(T0 + 600, stale), T0 + 600)
    j = a.detail["verdicts"][0]["judgement"]
    assert a.kind == "rollback" and j["detail"]["pooled_replays"] == 1 and j["detail"]["looks"]["latest"]["status"] == "fail"
    assert not sim.rule("golden").pool
    sim.step(replay(T0 + 1200, stale), T0 + 1200)
    assert len(sim.rule("golden").pool) == 1
    assert sim.rule("golden").last.judgement["detail"]["pooled_replays"] == 1


def test_replays_of_another_golden_set_are_not_pooled() -> None:
    sim = Sim(policy_set(golden_rule(2)))
    sim.step(replay(T0, [0.0] * 40, "code"), T0)
    sim.step(replay(T0 + 600, [0.0] * 40, "legal"), T0 + 600)
    assert [e["set"] for e in sim.rule("golden").pool] == ["legal"]
    sim.step(replay(T0 + 1200, [0.0] * 40, "legal"), T0 + 1200)
    assert [e["set"] for e in sim.rule("golden").pool] == ["legal", "legal"]
    sim.step(replay(T0 + 1800, [0.0] * 40, "legal"), T0 + 1800)
    assert len(sim.rule("golden").pool) == 2  # bounded by replays


def test_nan_items_survive_the_json_round_trip() -> None:
    ps = policy_set(golden_rule(2))
    a = Sim(ps)
    a.step(replay(T0, [0.0] * 39 + [float("nan")]), T0)
    saved = json.dumps(a.engine.export_state(), allow_nan=False)
    b = Sim(ps)
    b.engine.import_state(json.loads(saved))
    b.step(replay(T0 + 600, [0.0] * 40), T0 + 600)
    last = b.rule("golden").last
    # 40 items: the interval (with its spread prior) is too wide to pass 2 points, but not a fail
    assert last.status == "marginal" and last.judgement["detail"]["pooled_replays"] == 2


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "key", "expected"), [
    (golden_rule(None).replace("min_items: 30", "min_items: 30, pool: 3"), "pool", "judge: pool sums live windows"),
    (rate_rule(None).replace("min_items: 100", "min_items: 100, replays: 2"), "replays",
     "judge: replays pools golden replays"),
    (rate_rule(0), "pool", "policies[0].rules[0].judge.pool: Input should be greater than or equal to 1"),
    (golden_rule(3), "replays", "policies[0].rules[0].judge.replays: Input should be less than or equal to 2"),
])
def test_pool_keys_validated_with_positions(rule: str, key: str, expected: str) -> None:
    text = f"policies:\n  - name: p\n    cooldown: 0s\n    promote: {{mode: auto}}\n    rules:\n{rule}"
    found, errors = parse_policy_text(text, "t.yaml")
    line = next(i for i, x in enumerate(text.splitlines(), 1) if f"{key}: " in x)
    col = text.splitlines()[line - 1].index(f"{key}: ") + len(key) + 3  # the value, 1-based
    assert found == [] and len(errors) == 1 and errors[0].startswith(f"t.yaml:{line}:{col}: {expected}"), errors


def test_a_pooled_rule_attributes_against_the_last_passing_window_before_its_pool() -> None:
    """A pool with one regressed window still passes; the cause check must not take that window
    as "before", or FP16's own window-to-window noise explains the regression away."""
    from watchdog.policy.causes import attribute_rule
    from watchdog.policy.evaluate import Verdict
    from watchdog.policy.loader import parse_policy_text
    from watchdog.policy.state import RuleState

    text = """
policies:
  - name: p
    rules:
      - name: lat
        metric: latency_p50_ms
        judge: {test: quantile, tail: 0.0, effect: 0.0, alpha: 0.001, pool: 3, learn: 96}
        action: rollback
"""
    (policy,), errors = parse_policy_text(text, "p.yaml")
    assert not errors
    rule = policy.rules[0]
    rs = RuleState("f")
    # passing windows ending at 300..1500; the regression (+80 ms on FP8) started in the window
    # ending at 1500, which passed; FP16 moved +30 ms by noise since the one before
    rs.ref = {"candidate": 880.0, "baseline": 830.0,
              "recent": [[300.0 * i, 800.0, 800.0] for i in range(1, 5)] + [[1500.0, 880.0, 830.0]]}
    rs.pool = [{"start": 1200.0 + 300 * i, "end": 1500.0 + 300 * i, "e": 0.1, "v": 1e-4} for i in range(3)]
    rs.last = Verdict(rule="lat", status="fail", reason="", source="live", metric="latency_p50_ms",
                      start=1800.0, end=2100.0, candidate=885.0, baseline=835.0)
    a = attribute_rule(policy, rule, rs, [])
    assert a.cause == "candidate", a  # against the window ending at 1200: +85 ms vs +35 ms
    rs.pool = rs.pool[-1:]  # a pool of one: the latest passing window, as for unpooled rules
    assert attribute_rule(policy, rule, rs, []).cause == "input_shift"


def test_a_rules_fingerprint_ignores_keys_left_at_their_defaults() -> None:
    """Saved rule state is keyed by the rule's fingerprint: a release that adds a key with a default (here a
    subclass of the rule model with one more field) keeps it, so an upgrade does not relearn every rule's
    nulls; a changed value still changes it."""
    from watchdog.policy.state import rule_fingerprint

    rule = policy_set(latency_rule(None)).policies[0].rules[0]
    newer = type("NewerRule", (type(rule),), {"__annotations__": {"future_key": int}, "future_key": 7})
    assert rule_fingerprint(newer.model_validate(rule.model_dump(by_alias=True))) == rule_fingerprint(rule)
    assert rule_fingerprint(policy_set(latency_rule(3)).policies[0].rules[0]) != rule_fingerprint(rule)


def test_a_reworded_description_keeps_the_rules_learned_state_and_an_upgrade_keeps_the_older_key() -> None:
    """An ML lead who rewords a rule's description (hot-reloaded) kept nothing of it: the fingerprint
    that keys saved state included the text. State saved before, under the fingerprint with the text,
    is still the rule's on upgrade and is saved under today's key from then on."""
    import hashlib

    from watchdog.policy import PolicyEngine
    from watchdog.policy.state import rule_fingerprint

    described = latency_rule(None).replace("      - name: latency\n", "      - name: latency\n        description: p50\n")
    first = policy_set(described)
    engine = PolicyEngine(first)
    engine._state(first.policies[0], "m", "r").rules["latency"].judged = 7
    reworded = policy_set(described.replace("description: p50", "description: the median, FP8 against FP16"))
    engine.set_policy_set(reworded)
    rs = engine.states[(first.policies[0].name, "m", "r")].rules["latency"]
    assert rs.judged == 7 and rs.fingerprint == rule_fingerprint(reworded.policies[0].rules[0])
    engine.set_policy_set(policy_set(described.replace("effect: 0.05", "effect: 0.06")))
    assert "latency" not in engine.states[(first.policies[0].name, "m", "r")].rules  # a judging key changed
    rule = reworded.policies[0].rules[0]
    older = hashlib.sha256(rule.model_dump_json(by_alias=True, exclude_defaults=True).encode()).hexdigest()[:16]
    engine = PolicyEngine(reworded)
    saved = engine._state(reworded.policies[0], "m", "r").rules["latency"]
    saved.fingerprint, saved.fails = older, 3
    engine.import_state(engine.export_state())
    rs = engine.states[(reworded.policies[0].name, "m", "r")].rules["latency"]
    assert rs.fails == 3 and rs.fingerprint == rule_fingerprint(rule) != older

