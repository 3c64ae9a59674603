"""Judged rules, marginal verdicts, Holm combination, restore hysteresis, cause-aware inhibition,
NVML-unavailable and suspicion -> confirm: table tests of the pure engine (time passed in)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from watchdog.core.signals import Action, Signal
from watchdog.policy import PolicyEngine, PolicySet, parse_policy_text
from watchdog.policy.evaluate import Verdict, combine_window, evaluate_rule
from watchdog.windows.sketch import QuantileSketch

M, R = "llama-3-8b", "chat/general"
T0 = 1_800_000_000.0  # 2027-01-15 08:00 UTC


def policies(text: str) -> PolicySet:
    found, errors = parse_policy_text(text, "t.yaml")
    assert errors == []
    return PolicySet(tuple(found))


def policy(rules: str, *, head: str = "") -> str:
    return f"""\
policies:
  - name: p
    cooldown: 0s
    promote: {{mode: auto, healthy_windows: 2, after: 0s}}
{head}    rules:
{rules}"""


class Sim:
    def __init__(self, text: str, flags: Mapping[tuple[str, str], str] | None = None) -> None:
        self.engine = PolicyEngine(policies(text))
        self.flags: dict[tuple[str, str], str] = dict(flags or {})

    def step(self, signals: list[Signal], now: float) -> list[Action]:
        acts = self.engine.observe(signals, now, self.flags)
        for a in acts:
            if a.kind in ("rollback", "promote") and not a.dry_run:
                self.flags[(a.model, a.route)] = a.precision or ""
        return acts


def kinds(acts: list[Action]) -> list[str]:
    return [a.kind for a in acts]


# --- signal builders --------------------------------------------------------------------------


def live_counts(t: float, errors: tuple[int, int], n: tuple[int, int] = (500, 500), route: str = R,
                **extra: tuple[float, float]) -> list[Signal]:
    out = []
    for prec, e, k, side in (("fp8", errors[0], n[0], 0), ("fp16", errors[1], n[1], 1)):
        values = {"error_rate": e / k, **{m: v[side] for m, v in extra.items()}}
        out.append(Signal("live", M, route, prec, t - 60, t, k, values,
                          detail={"events": k, "errors": e, "timeouts": 0}))
    return out


def live_values(t: float, metric: str, cand: float, base: float, samples: int = 500) -> list[Signal]:
    return [Signal("live", M, R, "fp8", t - 60, t, samples, {metric: cand}),
            Signal("live", M, R, "fp16", t - 60, t, samples, {metric: base})]


def latency_hist(scale: float, n: int = 400, seed: int = 1) -> dict:
    sk = QuantileSketch()
    for x in np.random.default_rng(seed).lognormal(np.log(scale), 0.3, n):
        sk.add(float(x))
    return sk.to_dict()


def golden(t: float, mean: float, *, n: int = 200, sd: float = 0.05, error: str | None = None) -> list[Signal]:
    diffs = list(np.random.default_rng(int(t) % 1000).normal(mean, sd, n))
    cand = Signal("golden", M, R, "fp8", t - 30, t, n, {"rougeL": 0.60 + mean}, paired={"rougeL": diffs},
                  error=error)
    base = Signal("golden", M, R, "fp16", t - 30, t, n, {"rougeL": 0.60})
    return [cand, base]


def gpu(t: float, route: str = R, unavailable: bool = False, **values: float) -> Signal:
    if unavailable:
        return Signal("gpu", M, route, None, t, t, 0, {"nvml_available": 0.0}, error="nvml unavailable",
                      detail={"state": "unavailable", "reason": "NVML Shared Library Not Found"})
    return Signal("gpu", M, route, None, t, t, 1, {"nvml_available": 1.0, **values})


# --- judged verdicts ------------------------------------------------------------------------------

GOLDEN_RULE = """\
      - name: golden
        source: golden
        metric: rougeL
        judge: {test: paired, direction: higher_is_better, effect: 0.02, alpha: 0.01, min_items: 30}
        action: rollback
"""
RATE_RULE = """\
      - name: errors
        metric: error_rate
        judge: {test: rate, effect: 0.01, min_items: 100}
        action: rollback
"""
LATENCY_RULE = """\
      - name: latency
        metric: latency_p50_ms
        judge: {test: mann_whitney, direction: lower_is_better, effect: 0.10, min_items: 50}
        action: rollback
"""


def rule_of(rules: str):
    return policies(policy(rules)).policies[0].rules[0]


def with_hist(sigs: list[Signal], cand_scale: float, base_scale: float, n: int = 400) -> list[Signal]:
    for s, scale, seed in ((sigs[0], cand_scale, 1), (sigs[1], base_scale, 2)):
        s.detail["latency_hist"] = latency_hist(scale, n, seed)
        s.values["latency_p50_ms"] = scale
    return sigs


@pytest.mark.parametrize(("rules", "signals", "status", "reason_part"), [
    (GOLDEN_RULE, golden(T0, -0.06), "fail", "significant_regression"),
    (GOLDEN_RULE, golden(T0, -0.02), "marginal", "straddles_threshold"),
    (GOLDEN_RULE, golden(T0, 0.0), "pass", "within_effect_threshold"),
    (GOLDEN_RULE, golden(T0, -0.06, n=10), "inconclusive", "too_few_items"),
    (GOLDEN_RULE, golden(T0, -0.06, error="engine timeout"), "error", "candidate source failed"),
    (RATE_RULE, live_counts(T0, (60, 3)), "fail", "significant_regression"),
    (RATE_RULE, live_counts(T0, (30, 30), n=(5000, 5000)), "pass", "within_effect_threshold"),
    (RATE_RULE, live_counts(T0, (3, 3)), "marginal", "straddles_threshold"),  # 500 requests: too little to pass
    (RATE_RULE, live_counts(T0, (9, 0), n=(60, 60)), "inconclusive", "too_few_items"),
    (LATENCY_RULE, with_hist(live_values(T0, "latency_p50_ms", 0, 0), 600.0, 400.0), "fail", "significant_regression"),
    (LATENCY_RULE, with_hist(live_values(T0, "latency_p50_ms", 0, 0), 400.0, 400.0), "pass", "within"),
    (LATENCY_RULE, live_values(T0, "latency_p50_ms", 600.0, 400.0), "inconclusive", "no latency_hist"),
])
def test_judged_verdicts(rules: str, signals: list[Signal], status: str, reason_part: str) -> None:
    rule = rule_of(rules)
    cand = next(s for s in signals if s.precision == "fp8")
    base = next(s for s in signals if s.precision == "fp16")
    v = evaluate_rule(rule, cand, base)
    assert v.status == status, v.reason
    assert reason_part in v.reason or reason_part in (v.judgement or {}).get("reason", "")
    if status in ("fail", "pass", "marginal"):
        assert v.judgement is not None and "ci_low" in v.extra and "p_value" in v.extra


def test_judge_with_fail_if_guard_makes_an_immaterial_fail_marginal() -> None:
    rules = RATE_RULE.replace("        action", "        fail_if: candidate > 0.5\n        action")
    v = evaluate_rule(rule_of(rules), *live_counts(T0, (60, 3)))
    assert v.status == "marginal" and "fail_if (candidate > 0.5) is false" in v.reason


def test_marginal_neither_trips_nor_counts_as_healthy() -> None:
    sim = Sim(policy(GOLDEN_RULE), flags={(M, R): "fp16"})
    assert sim.step(golden(T0, 0.0), T0) == []           # healthy 1
    assert sim.step(golden(T0 + 60, -0.02), T0 + 60) == []  # marginal: resets
    st = sim.engine.states[("p", M, R)]
    assert st.healthy == 0 and st.rules["golden"].last.status == "marginal"
    assert sim.step(golden(T0 + 120, 0.0), T0 + 120) == []
    assert kinds(sim.step(golden(T0 + 180, 0.0), T0 + 180)) == ["promote"]
    # on the candidate, marginal replays never roll back
    sim2 = Sim(policy(GOLDEN_RULE))
    for i in range(5):
        assert sim2.step(golden(T0 + 60 * i, -0.02), T0 + 60 * i) == []
    assert sim2.engine.snapshot()["scopes"][0]["status"] == "marginal"


def test_judged_golden_rule_rolls_back_with_numbers() -> None:
    sim = Sim(policy(GOLDEN_RULE))
    (a,) = sim.step(golden(T0, -0.06), T0)
    assert (a.kind, a.detail["rule"], a.detail["source"], a.detail["cause"]) == ("rollback", "golden", "golden", "candidate")
    j = a.detail["verdicts"][0]["judgement"]
    assert j["status"] == "fail" and j["ci_high"] < -0.02 and j["method"] == "t"


# --- Holm combination and critical rules ---------------------------------------------------------

def judged(name: str, status: str, p: float, critical: bool = False) -> tuple:
    text = policy(f"""\
      - name: {name}
        metric: error_rate
        judge: {{test: rate, effect: 0.01}}
        critical: {str(critical).lower()}
""")
    rule = policies(text).policies[0].rules[0]
    v = Verdict(name, status, "r", "live", "error_rate", judgement={"p_value": p, "status": status})  # type: ignore[arg-type]
    return rule, v


@pytest.mark.parametrize(("items", "combine", "expected"), [
    # alone, p=0.008 < alpha: stays a fail
    ([("a", "fail", 0.008)], "", ["fail"]),
    # with a second judged rule Holm doubles it to 0.016 > 0.01: marginal
    ([("a", "fail", 0.008), ("b", "pass", 0.6)], "", ["marginal", "pass"]),
    # strong evidence survives the adjustment
    ([("a", "fail", 0.0001), ("b", "pass", 0.6)], "", ["fail", "pass"]),
    # a critical rule is not adjusted: it fails alone
    ([("a", "fail", 0.008, True), ("b", "pass", 0.6), ("c", "pass", 0.7)], "", ["fail", "pass", "pass"]),
    # method none: no adjustment
    ([("a", "fail", 0.008), ("b", "pass", 0.6)], "    combine: {method: none}\n", ["fail", "pass"]),
    # k=2: one failing rule is not enough, two are
    ([("a", "fail", 0.0001), ("b", "pass", 0.6)], "    combine: {k: 2}\n", ["marginal", "pass"]),
    ([("a", "fail", 0.0001), ("b", "fail", 0.0002)], "    combine: {k: 2}\n", ["fail", "fail"]),
])
def test_holm_combination(items: list, combine: str, expected: list[str]) -> None:
    pol = policies(policy("      - {name: x, metric: error_rate, fail_if: candidate > 1}\n", head=combine)).policies[0]
    pairs = [judged(*i) for i in items]
    combine_window(pol, pairs)
    assert [v.status for _, v in pairs] == expected
    if expected[0] == "marginal" and items[0][1] == "fail":
        assert "adjusted p" in pairs[0][1].reason or "combine.k" in pairs[0][1].reason


def test_holm_in_the_engine_downgrades_a_weak_fail_among_several_judged_rules() -> None:
    rules = RATE_RULE + RATE_RULE.replace("name: errors", "name: errors2")
    # 2 judged rules on the same counts: each p is the same; strong evidence still trips both
    sim = Sim(policy(rules))
    (a,) = sim.step(live_counts(T0, (80, 3)), T0)
    assert a.kind == "rollback" and a.detail["rules"] == ["errors", "errors2"]
    v = sim.engine.states[("p", M, R)].rules["errors"].last
    assert v is not None and v.extra["adjusted_p"] >= v.extra["p_value"]


# --- restore hysteresis ---------------------------------------------------------------------------

def test_restore_if_is_stricter_than_fail_if() -> None:
    rules = """\
      - name: err
        metric: error_rate
        fail_if: candidate - baseline > 0.05
        restore_if: candidate - baseline < 0.01
        action: rollback
"""
    sim = Sim(policy(rules))
    assert kinds(sim.step(live_values(T0, "error_rate", 0.10, 0.01), T0)) == ["rollback"]
    t = T0
    for _ in range(4):  # dead band: not failing, not good enough to restore
        t += 60
        assert sim.step(live_values(t, "error_rate", 0.04, 0.01), t) == []
    assert sim.engine.states[("p", M, R)].healthy == 0
    t += 60
    assert sim.step(live_values(t, "error_rate", 0.015, 0.01), t) == []
    t += 60
    (a,) = sim.step(live_values(t, "error_rate", 0.015, 0.01), t)
    assert a.kind == "promote" and sim.flags[(M, R)] == "fp8"


def test_healthy_sources_restore_only_after_passing_replays() -> None:
    rules = RATE_RULE + GOLDEN_RULE.replace("name: golden", "name: g")
    head = "    min_time_in_state: {candidate: 0s, baseline: 2m}\n"
    text = policy(rules, head=head).replace("healthy_windows: 2, after: 0s}",
                                            "healthy_windows: 2, after: 0s, healthy_sources: [golden]}")
    sim = Sim(text)
    assert kinds(sim.step(live_counts(T0, (80, 3)), T0)) == ["rollback"]
    t = T0
    for _ in range(5):  # passing live windows do not count toward the restore
        t += 10
        assert sim.step(live_counts(t, (30, 30), n=(5000, 5000)), t) == []
    assert sim.engine.states[("p", M, R)].rules["errors"].last.status == "pass"
    assert sim.engine.states[("p", M, R)].healthy == 0
    t += 10
    assert sim.step(golden(t, 0.0), t) == []
    t += 10
    (a,) = sim.step(golden(t, 0.0), t)  # two passing replays, but min time on fp16 is 2m
    assert a.kind == "alert" and "min_time_in_state: serving fp16 for 70s, minimum 120s" in a.reason
    t = T0 + 130
    assert kinds(sim.step(golden(t, 0.0), t)) == ["promote"]


# --- cause-aware inhibition -----------------------------------------------------------------------

PLAIN_ERR = """\
      - name: err
        metric: error_rate
        fail_if: candidate > 0.05
        severity: critical
        action: rollback
"""


def test_input_shift_alerts_with_cause_instead_of_rolling_back() -> None:
    sim = Sim(policy(PLAIN_ERR))
    assert sim.step(live_values(T0, "error_rate", 0.01, 0.01), T0) == []  # reference window
    (a,) = sim.step(live_values(T0 + 60, "error_rate", 0.10, 0.09), T0 + 60)
    assert (a.kind, a.severity, a.detail["cause"], a.detail["rule"], a.detail["source"]) == \
        ("alert", "critical", "input_shift", "err", "live")
    assert "baseline degraded too" in a.reason and (M, R) not in sim.flags
    assert sim.step(live_values(T0 + 120, "error_rate", 0.10, 0.09), T0 + 120) == []  # once per incident
    # the baseline recovers, the candidate does not: now FP8 is to blame
    (b,) = sim.step(live_values(T0 + 180, "error_rate", 0.10, 0.01), T0 + 180)
    assert (b.kind, b.detail["cause"]) == ("rollback", "candidate") and sim.flags[(M, R)] == "fp16"


def test_pairwise_agreement_drop_is_not_taken_for_an_input_shift() -> None:
    # the FP16 window's shadow is the FP8 answer: when FP8 breaks, both windows' agreement drops
    sim = Sim(policy("""\
      - name: agree
        metric: shadow_rougeL
        fail_if: candidate < 0.8
        severity: critical
        action: rollback
"""))
    assert sim.step(live_values(T0, "shadow_rougeL", 0.98, 0.98), T0) == []
    (a,) = sim.step(live_values(T0 + 60, "shadow_rougeL", 0.35, 0.40), T0 + 60)
    assert (a.kind, a.detail["cause"]) == ("rollback", "candidate") and sim.flags[(M, R)] == "fp16"


def test_input_shift_can_be_switched_off() -> None:
    sim = Sim(policy(PLAIN_ERR, head="    inhibit: {input_shift: false}\n"))
    sim.step(live_values(T0, "error_rate", 0.01, 0.01), T0)
    assert kinds(sim.step(live_values(T0 + 60, "error_rate", 0.10, 0.09), T0 + 60)) == ["rollback"]


@pytest.mark.parametrize(("reading", "age", "expected"), [
    ({"thermal_slowdown": 1.0}, 30, "gpu_health"),
    ({"xid_critical": 2.0}, 30, "gpu_health"),
    ({"critical": 1.0, "gpu_lost": 1.0}, 30, "gpu_health"),
    ({"thermal_slowdown": 0.0, "xid_critical": 0.0}, 30, "rollback"),  # healthy GPU: blame FP8
    ({"thermal_slowdown": 1.0}, 3600, "rollback"),  # a stale reading explains nothing
])
def test_gpu_health_inhibits_rollback(reading: dict, age: float, expected: str) -> None:
    sim = Sim(policy(PLAIN_ERR))
    t = T0 + 4000
    assert sim.step([gpu(t - age, **reading)], t - age) == []
    acts = sim.step(live_values(t, "error_rate", 0.10, 0.01), t)
    if expected == "rollback":
        assert kinds(acts) == ["rollback"]
    else:
        (a,) = acts
        assert (a.kind, a.detail["cause"], a.detail["rule"]) == ("alert", "gpu_health", "err")
        assert a.detail["attribution"]["gpu_problems"] and (M, R) not in sim.flags


def test_gpu_wildcard_signal_in_the_same_call_inhibits() -> None:
    sim = Sim(policy(PLAIN_ERR))
    star = Signal("gpu", M, "*", None, T0, T0, 1, {"xid_critical": 1.0})
    (a,) = sim.step([star, *live_values(T0, "error_rate", 0.10, 0.01)], T0)
    assert a.detail["cause"] == "gpu_health"
    # the GPU recovers: the next failing window rolls back
    clean = Signal("gpu", M, R, None, T0 + 30, T0 + 30, 1, {"xid_critical": 0.0})
    assert kinds(sim.step([clean, *live_values(T0 + 60, "error_rate", 0.10, 0.01)], T0 + 60)) == ["rollback"]


def test_nvml_unavailable_is_inconclusive_never_error() -> None:
    rules = """\
      - name: xid
        source: gpu
        metric: xid_critical
        fail_if: value > 0
        errors_trip_after: 1
        severity: critical
        action: rollback
"""
    sim = Sim(policy(rules))
    for i in range(6):
        assert sim.step([gpu(T0 + 10 * i, unavailable=True)], T0 + 10 * i) == []
    (v,) = sim.engine.verdicts()
    assert v["status"] == "inconclusive" and "telemetry unavailable" in v["verdict"]["reason"]
    assert v["consecutive_errors"] == 0 and (M, R) not in sim.flags
    # and an unavailable reading does not wipe out a known GPU problem either
    sim2 = Sim(policy(PLAIN_ERR))
    sim2.step([gpu(T0, thermal_slowdown=1.0)], T0)
    sim2.step([gpu(T0 + 10, unavailable=True)], T0 + 10)
    (a,) = sim2.step(live_values(T0 + 20, "error_rate", 0.10, 0.01), T0 + 20)
    assert a.detail["cause"] == "gpu_health"


# --- suspicion -> confirm -------------------------------------------------------------------------

CONFIRM = """\
      - name: live-err
        metric: error_rate
        fail_if: candidate - baseline > 0.02
        severity: critical
        action: rollback
        confirm_with: golden
        confirm_timeout: 3
      - name: golden
        source: golden
        metric: rougeL
        judge: {test: paired, effect: 0.02}
        severity: critical
        action: alert
"""


def test_confirm_with_golden_requests_replay_then_rolls_back_on_golden_fail() -> None:
    sim = Sim(policy(CONFIRM))
    (a,) = sim.step(live_values(T0, "error_rate", 0.10, 0.01), T0)
    assert (a.kind, a.severity) == ("alert", "critical")
    assert a.detail["request_replay"] is True and a.detail["rule"] == "live-err" and a.detail["source"] == "live"
    assert (M, R) not in sim.flags
    assert sim.step(live_values(T0 + 60, "error_rate", 0.10, 0.01), T0 + 60) == []  # one request per suspicion
    acts = sim.step(golden(T0 + 90, -0.06), T0 + 90)
    assert kinds(acts) == ["alert", "rollback"]
    rb = acts[1]
    assert "confirmed by golden rule(s) golden" in rb.reason and rb.detail["rule"] == "live-err"
    assert sim.flags[(M, R)] == "fp16"


def test_confirm_with_golden_not_confirmed_rolls_back_after_timeout() -> None:
    sim = Sim(policy(CONFIRM))
    assert kinds(sim.step(live_values(T0, "error_rate", 0.10, 0.01), T0)) == ["alert"]
    assert sim.step(golden(T0 + 30, 0.0), T0 + 30) == []  # the replay passes: keep FP8
    t = T0
    for _ in range(2):
        t += 60
        assert sim.step(live_values(t, "error_rate", 0.10, 0.01), t) == []
    t += 60
    (rb,) = sim.step(live_values(t, "error_rate", 0.10, 0.01), t)
    assert rb.kind == "rollback" and "not confirmed by golden, still failing after 3 more window(s)" in rb.reason


def test_confirm_with_suspicion_ends_with_resolve() -> None:
    sim = Sim(policy(CONFIRM))
    sim.step(live_values(T0, "error_rate", 0.10, 0.01), T0)
    (r,) = sim.step(live_values(T0 + 60, "error_rate", 0.01, 0.01), T0 + 60)
    assert r.kind == "resolve"


# --- validation of the new keys -------------------------------------------------------------------

BAD = """\
policies:
  - name: p
    min_time_in_state: {candidate: 5m, baseline: 1 hour}
    rules:
      - name: a
        metric: error_rate
      - name: b
        metric: latency_p99_ms
        judge: {test: paired, effect: 0.1, marginal: 0.2}
        restore_if: candidate <> 3
      - name: c
        metric: error_rate
        judge: {test: rate, effect: 0.1, direction: higher_is_better, alpah: 0.1}
        action: alert
        confirm_with: golden
      - name: d
        source: gpu
        metric: xid_critical
        judge: {test: mann_whitney, effect: 0.1}
"""


def test_new_keys_validated_with_positions() -> None:
    _, errors = parse_policy_text(BAD, "bad.yaml")
    expected = [
        "bad.yaml:3:50: policies[0].min_time_in_state.baseline: bad duration '1 hour'",
        "bad.yaml:5:9: rule 'a' needs fail_if, judge or both",
        "bad.yaml:9:23: judge: test paired needs per-item values: use it on source: golden",
        "bad.yaml:9:54: judge: marginal (0.2) must not exceed effect (0.1)",
        "bad.yaml:10:32: restore_if: expected a number",
        "bad.yaml:13:53: judge: a rate (errors, timeouts) is lower_is_better",
        "bad.yaml:13:71: unknown key 'alpah' (did you mean 'alpha'?)",
        "bad.yaml:15:23: confirm_with: only a rule with action: rollback has a rollback to confirm",
        "bad.yaml:15:23: confirm_with: policy 'p' has no golden rule to confirm with",
        "bad.yaml:19:16: judge: gpu signals have no baseline to judge against",
    ]
    assert len(errors) == len(expected), errors
    for got, want in zip(errors, expected, strict=True):
        assert got.startswith(want), (got, want)
