"""State-machine cases of the pure policy engine: no services, time passed in."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from watchdog.core.signals import Action, Signal
from watchdog.policy import PolicyEngine, PolicySet, parse_policy_text

M, R = "llama-3-8b", "chat/general"
DAY0 = 1_800_000_000.0  # 2027-01-15 08:00 UTC


def policy_set(text: str) -> PolicySet:
    policies, errors = parse_policy_text(text, "t.yaml")
    assert errors == []
    return PolicySet(tuple(policies))


def make_policy(*, rule_for: int = 2, dry_run: bool = False, cooldown: str = "0s", budget: int = 6,
                min_time: str = "0s", promote: str = "auto", healthy: int = 3, after: str = "0s",
                action: str = "rollback", name: str = "p", routes: str = '["*"]', extra_rules: str = "") -> str:
    return f"""\
policies:
  - name: {name}
    scope: {{models: ["llama-*"], routes: {routes}}}
    dry_run: {str(dry_run).lower()}
    cooldown: {cooldown}
    min_time_in_state: {min_time}
    max_flips_per_day: {budget}
    promote: {{mode: {promote}, healthy_windows: {healthy}, after: {after}}}
    actions: {{notify: [slack], page: [pagerduty]}}
    rules:
      - name: err
        metric: error_rate
        fail_if: candidate - baseline > 0.02
        min_samples: 100
        for: {rule_for}
        severity: critical
        action: {action}
{extra_rules}"""


def window(t: float, cand: float | None, base: float | None = 0.01, *, samples: int = 500,
           error: str | None = None, route: str = R, source: str = "live", metric: str = "error_rate") -> list[Signal]:
    out = []
    for prec, val in (("fp8", cand), ("fp16", base)):
        if val is None and error is None:
            continue
        values = {} if val is None else {metric: val}
        out.append(Signal(source=source, model=M, route=route, precision=prec, start=t - 60, end=t,  # type: ignore[arg-type]
                          samples=samples, values=values, error=error if prec == "fp8" else None))
    return out


class Sim:
    """Feeds windows and applies rollback/promote actions to the flags like the actuator would."""

    def __init__(self, text: str, flags: Mapping[tuple[str, str], str] | None = None) -> None:
        self.engine = PolicyEngine(policy_set(text))
        self.flags: dict[tuple[str, str], str] = dict(flags or {})
        self.log: list[Action] = []

    def step(self, signals: list[Signal], now: float, apply: bool = True) -> list[Action]:
        acts = self.engine.observe(signals, now, self.flags)
        for a in acts:
            if apply and a.kind in ("rollback", "promote") and not a.dry_run:
                self.flags[(a.model, a.route)] = a.precision or ""
        self.log += acts
        return acts


def kinds(acts: list[Action]) -> list[str]:
    return [a.kind for a in acts]


def test_trips_after_for_consecutive_failing_windows() -> None:
    sim = Sim(make_policy(rule_for=2))
    assert sim.step(window(DAY0, 0.10), DAY0) == []
    (a,) = sim.step(window(DAY0 + 60, 0.10), DAY0 + 60)
    assert (a.kind, a.precision, a.policy, a.model, a.route, a.severity) == ("rollback", "fp16", "p", M, R, "critical")
    assert a.at == DAY0 + 60 and "err failed 2 window(s)" in a.reason
    assert a.detail["channels"] == ["slack", "pagerduty"] and a.detail["rules"] == ["err"]
    assert sim.flags[(M, R)] == "fp16"
    # serving the baseline now: failing again does not roll back twice
    assert "rollback" not in kinds(sim.step(window(DAY0 + 120, 0.10), DAY0 + 120))


def test_pass_between_failures_resets_the_streak() -> None:
    sim = Sim(make_policy(rule_for=2))
    for i, v in enumerate([0.10, 0.01, 0.10, 0.01, 0.10]):
        assert sim.step(window(DAY0 + 60 * i, v), DAY0 + 60 * i) == []


def test_inconclusive_does_not_trip_or_reset() -> None:
    sim = Sim(make_policy(rule_for=2))
    # too few samples, missing baseline, missing metric: all inconclusive
    assert sim.step(window(DAY0, 0.5, samples=10), DAY0) == []
    assert sim.step(window(DAY0 + 60, 0.5, None), DAY0 + 60) == []
    assert sim.step(window(DAY0 + 120, None, 0.01), DAY0 + 120) == []
    fp8_without_metric = Signal(source="live", model=M, route=R, precision="fp8", start=DAY0 + 90,
                                end=DAY0 + 150, samples=500, values={"timeout_rate": 0.0})
    assert sim.step([fp8_without_metric, *window(DAY0 + 150, None, 0.01)], DAY0 + 150) == []
    v = {x["rule"]: x for x in sim.engine.verdicts()}["err"]
    assert v["status"] == "inconclusive" and "error_rate not measured for candidate" in v["verdict"]["reason"]
    assert v["consecutive_fails"] == 0
    # a failure, an inconclusive window, a failure: still two failures in a row
    assert sim.step(window(DAY0 + 180, 0.5), DAY0 + 180) == []
    assert sim.step(window(DAY0 + 240, 0.5, samples=5), DAY0 + 240) == []
    assert kinds(sim.step(window(DAY0 + 300, 0.5), DAY0 + 300)) == ["rollback"]


def test_replayed_window_is_not_counted_twice() -> None:
    sim = Sim(make_policy(rule_for=2))
    w = window(DAY0, 0.10)
    assert sim.step(w, DAY0) == []
    assert sim.step(w, DAY0 + 5) == []
    assert sim.step(window(DAY0 - 60, 0.10), DAY0 + 6) == []  # older window: ignored too
    assert sim.engine.verdicts()[0]["consecutive_fails"] == 1
    assert kinds(sim.step(window(DAY0 + 60, 0.10), DAY0 + 60)) == ["rollback"]


def test_flags_respected_route_already_on_baseline() -> None:
    sim = Sim(make_policy(rule_for=1, promote="manual"), flags={(M, R): "fp16"})
    assert sim.step(window(DAY0, 0.10), DAY0) == []
    # default precision applies to routes absent from flags
    other = Sim(make_policy(rule_for=1))
    assert other.engine.observe(window(DAY0, 0.10), DAY0, {}, default_precision="fp16") == []
    assert kinds(Sim(make_policy(rule_for=1)).step(window(DAY0, 0.10), DAY0)) == ["rollback"]


def test_out_of_scope_routes_ignored() -> None:
    sim = Sim(make_policy(rule_for=1, routes='["legal/*"]'))
    assert sim.step(window(DAY0, 0.10), DAY0) == []
    assert kinds(sim.step(window(DAY0, 0.10, route="legal/nda"), DAY0)) == ["rollback"]


def test_dry_run_alerts_once_and_never_flips() -> None:
    sim = Sim(make_policy(rule_for=1, dry_run=True))
    (a,) = sim.step(window(DAY0, 0.10), DAY0)
    assert (a.kind, a.dry_run, a.precision) == ("alert", True, "fp16")
    assert a.reason.startswith("dry run: would roll back to fp16")
    assert sim.step(window(DAY0 + 60, 0.10), DAY0 + 60) == []  # once per incident
    assert (M, R) not in sim.flags
    (r,) = sim.step(window(DAY0 + 120, 0.01), DAY0 + 120)
    assert r.kind == "resolve"


def test_cooldown_blocks_flip_with_alert_then_allows() -> None:
    sim = Sim(make_policy(rule_for=1, cooldown="10m"))
    assert kinds(sim.step(window(DAY0, 0.10), DAY0)) == ["rollback"]
    assert sim.step(window(DAY0 + 30, 0.01), DAY0 + 30) == []  # the engine sees fp16 served
    sim.flags[(M, R)] = "fp8"  # then an operator flips it back by hand: the rollback's incident resolves
    res, a = sim.step(window(DAY0 + 60, 0.10), DAY0 + 60)
    assert res.kind == "resolve"
    assert a.kind == "alert" and "blocked (cooldown: last flip 60s ago, cooldown 600s)" in a.reason
    assert a.detail["blocked"].startswith("cooldown")
    assert sim.step(window(DAY0 + 120, 0.10), DAY0 + 120) == []  # the blocked alert is not repeated
    assert kinds(sim.step(window(DAY0 + 660, 0.10), DAY0 + 660)) == ["rollback"]


def test_min_time_in_state_counts_from_external_change() -> None:
    sim = Sim(make_policy(rule_for=1, min_time="5m"), flags={(M, R): "fp16"})
    assert sim.step(window(DAY0, 0.01), DAY0) == []
    sim.flags[(M, R)] = "fp8"
    (a,) = sim.step(window(DAY0 + 60, 0.10), DAY0 + 60)
    assert "min_time_in_state: serving fp8 for 0s, minimum 300s" in a.reason
    assert kinds(sim.step(window(DAY0 + 360, 0.10), DAY0 + 360)) == ["rollback"]


def test_flip_budget_per_utc_day() -> None:
    sim = Sim(make_policy(rule_for=1, budget=1))
    assert kinds(sim.step(window(DAY0, 0.10), DAY0)) == ["rollback"]
    assert sim.step(window(DAY0 + 30, 0.01), DAY0 + 30) == []
    sim.flags[(M, R)] = "fp8"
    res, a = sim.step(window(DAY0 + 60, 0.10), DAY0 + 60)
    assert res.kind == "resolve"
    assert a.kind == "alert" and "flip budget spent: 1 flips today (max_flips_per_day: 1)" in a.reason
    tomorrow = DAY0 + 86400
    assert kinds(sim.step(window(tomorrow, 0.10), tomorrow)) == ["rollback"]
    assert sim.engine.snapshot()["scopes"][0]["flips_today"] == 1


def test_auto_promote_after_healthy_windows_and_cooldown() -> None:
    sim = Sim(make_policy(rule_for=1, healthy=3, after="10m"))
    assert kinds(sim.step(window(DAY0, 0.10), DAY0)) == ["rollback"]
    t = DAY0
    for _ in range(3):  # three healthy windows, but within 10 minutes of the rollback
        t += 60
        assert sim.step(window(t, 0.01), t) == []
    t = DAY0 + 600
    (a,) = sim.step(window(t, 0.01), t)
    assert (a.kind, a.precision, a.reason) == ("promote", "fp8", "4 consecutive healthy windows")
    assert sim.flags[(M, R)] == "fp8"


def test_failure_resets_healthy_count() -> None:
    sim = Sim(make_policy(rule_for=3, healthy=2), flags={(M, R): "fp16"})
    assert sim.step(window(DAY0, 0.01), DAY0) == []
    assert sim.step(window(DAY0 + 60, 0.10), DAY0 + 60) == []  # fails (not tripped) -> reset
    assert sim.step(window(DAY0 + 120, 0.01), DAY0 + 120) == []
    assert kinds(sim.step(window(DAY0 + 180, 0.01), DAY0 + 180)) == ["promote"]


def test_manual_promote_only_alerts_once() -> None:
    sim = Sim(make_policy(rule_for=1, promote="manual", healthy=2), flags={(M, R): "fp16"})
    sim.step(window(DAY0, 0.01), DAY0)
    (a,) = sim.step(window(DAY0 + 60, 0.01), DAY0 + 60)
    assert (a.kind, a.severity) == ("alert", "info") and "promote manually" in a.reason
    assert sim.step(window(DAY0 + 120, 0.01), DAY0 + 120) == []
    assert sim.flags[(M, R)] == "fp16"


def test_alert_rule_once_per_incident_then_resolve() -> None:
    text = make_policy(rule_for=1, action="alert")
    sim = Sim(text)
    (a,) = sim.step(window(DAY0, 0.10), DAY0)
    assert (a.kind, a.severity, a.detail["rule"]) == ("alert", "critical", "err")
    assert sim.step(window(DAY0 + 60, 0.10), DAY0 + 60) == []
    assert sim.step(window(DAY0 + 120, 0.10, samples=1), DAY0 + 120) == []  # inconclusive: still open
    (r,) = sim.step(window(DAY0 + 180, 0.01), DAY0 + 180)
    assert r.kind == "resolve" and r.incident_key == f"{M}/{R}/p"
    assert (M, R) not in sim.flags


def test_source_errors_trip_after_errors_trip_after() -> None:
    sim = Sim(make_policy(rule_for=1))
    for i in range(2):
        assert sim.step(window(DAY0 + 60 * i, None, error="engine timeout"), DAY0 + 60 * i) == []
    v = sim.engine.verdicts()[0]
    assert v["status"] == "error" and "candidate source failed: engine timeout" in v["verdict"]["reason"]
    (a,) = sim.step(window(DAY0 + 120, None, error="engine timeout"), DAY0 + 120)
    assert a.kind == "rollback" and "source failed 3 time(s)" in a.reason


def test_errors_never_trip_when_disabled() -> None:
    text = make_policy(rule_for=1).replace("        action: rollback\n", "        action: rollback\n        errors_trip_after: null\n")
    sim = Sim(text)
    for i in range(5):
        assert sim.step(window(DAY0 + 60 * i, None, error="boom"), DAY0 + 60 * i) == []


def test_unapplied_rollback_is_retried_without_spending_budget() -> None:
    sim = Sim(make_policy(rule_for=1, budget=1, cooldown="1h"))
    assert kinds(sim.step(window(DAY0, 0.10), DAY0, apply=False)) == ["rollback"]
    (a,) = sim.step(window(DAY0 + 60, 0.10), DAY0 + 60, apply=False)
    assert a.kind == "rollback" and a.detail["retry"] is True
    assert sim.engine.snapshot()["scopes"][0]["flips_today"] == 1
    # still not applied an hour later (e.g. the route is pinned): a new flip, and the budget says no
    (b,) = sim.step(window(DAY0 + 3700, 0.10), DAY0 + 3700, apply=False)
    assert b.kind == "alert" and "flip budget spent" in b.reason
    assert sim.step(window(DAY0 + 3760, 0.10), DAY0 + 3760, apply=False) == []


def test_speedup_alert_and_gpu_wildcard_signal() -> None:
    extra = """\
      - name: fp8-no-faster
        metric: latency_p50_ms
        fail_if: baseline / candidate < 1.1
        severity: info
      - name: xid
        source: gpu
        metric: xid_critical
        fail_if: value > 0
        severity: critical
"""
    sim = Sim(make_policy(rule_for=1, extra_rules=extra), flags={(M, R): "fp8", (M, "legal/x"): "fp8"})
    acts = sim.step(window(DAY0, 100.0, 104.0, metric="latency_p50_ms"), DAY0)
    assert [(a.kind, a.detail.get("rule"), a.severity) for a in acts] == [("alert", "fp8-no-faster", "info")]
    gpu = Signal(source="gpu", model=M, route="*", precision=None, start=DAY0, end=DAY0 + 1, samples=1,
                 values={"xid_critical": 1.0})
    acts = sim.step([gpu], DAY0 + 1)
    assert sorted((a.route, a.detail.get("rule")) for a in acts) == [("chat/general", "xid"), ("legal/x", "xid")]


def test_rollback_wins_and_manual_policy_holds_back_auto_promote() -> None:
    auto = make_policy(rule_for=1, healthy=1, name="auto")
    manual = make_policy(rule_for=1, promote="manual", healthy=1, name="strict", routes='["chat/*"]')
    text = auto + manual.replace("policies:\n", "")
    sim = Sim(text)
    acts = sim.step(window(DAY0, 0.10), DAY0)
    assert kinds(acts) == ["rollback"] and acts[0].detail["also"][0]["policy"] == "strict"
    acts = sim.step(window(DAY0 + 60, 0.01), DAY0 + 60)
    assert "promote" not in kinds(acts) and sim.flags[(M, R)] == "fp16"
    assert any(a.kind == "alert" and "promote manually" in a.reason for a in acts)


def test_a_window_begun_before_the_rollback_is_no_healthy_window_after_it() -> None:
    # the daemon closes a window after its allowed lateness: the rollback decided 10 s after window 0 ended
    # comes 10 s into window 1, whose FP8 traffic was mostly served before the flip; before, that window
    # counted as healthy and promoted one window after the rollback (a flaky daemon test under load)
    sim = Sim(make_policy(rule_for=1, healthy=1))
    assert kinds(sim.step(window(DAY0, 0.10), DAY0 + 10)) == ["rollback"]
    assert sim.step(window(DAY0 + 60, 0.01), DAY0 + 70) == []  # began at DAY0, before the flip
    saved = json.loads(json.dumps(sim.engine.export_state()))
    sim.engine = PolicyEngine(policy_set(make_policy(rule_for=1, healthy=1)))
    sim.engine.import_state(saved)  # the change's time is kept across a restart
    assert sim.step(window(DAY0 + 60, 0.01), DAY0 + 71) == []
    assert kinds(sim.step(window(DAY0 + 120, 0.01), DAY0 + 130)) == ["promote"]


def test_export_import_state_continues_counting() -> None:
    text = make_policy(rule_for=3)
    sim = Sim(text)
    sim.step(window(DAY0, 0.10), DAY0)
    sim.step(window(DAY0 + 60, 0.10), DAY0 + 60)
    saved = json.loads(json.dumps(sim.engine.export_state()))
    fresh = PolicyEngine(policy_set(text))
    fresh.import_state(saved)
    assert fresh.observe(window(DAY0 + 60, 0.10), DAY0 + 61, {}) == []  # replay after restart
    (a,) = fresh.observe(window(DAY0 + 120, 0.10), DAY0 + 120, {})
    assert a.kind == "rollback"
    json.dumps(fresh.snapshot())
    json.dumps(fresh.verdicts())


def test_reload_keeps_state_of_unchanged_rules_only() -> None:
    text = make_policy(rule_for=2, extra_rules="""\
      - name: tmo
        metric: timeout_rate
        fail_if: candidate > 0.5
""")
    engine = PolicyEngine(policy_set(text))
    engine.observe(window(DAY0, 0.10), DAY0, {})
    assert engine.states[("p", M, R)].rules["err"].fails == 1
    engine.set_policy_set(policy_set(text.replace("candidate > 0.5", "candidate > 0.4")))
    assert engine.states[("p", M, R)].rules["err"].fails == 1
    assert "tmo" not in engine.states[("p", M, R)].rules
    assert kinds(engine.observe(window(DAY0 + 60, 0.10), DAY0 + 60, {})) == ["rollback"]
    engine.set_policy_set(policy_set(make_policy(name="other")))
    # a removed policy is forgotten, except its rollback (pending here): a retired scope without rules
    # follows it until the route leaves FP16 (tests/test_policy_midincident.py)
    assert list(engine.states) == [("p", M, R)] and engine.states[("p", M, R)].rules == {}
    assert engine.states[("p", M, R)].retired["why"] == "removed"  # type: ignore[index]
    engine.states[("p", M, R)].pending = None  # had the rollback been refused, nothing is in force
    engine.states[("p", M, R)].retired = None
    engine.set_policy_set(policy_set(make_policy(name="other")))
    assert engine.states == {}


@pytest.mark.parametrize(("cand", "samples", "status"), [(0.10, 500, "fail"), (0.02, 500, "pass"), (0.10, 99, "inconclusive")])
def test_verdict_numbers_visible(cand: float, samples: int, status: str) -> None:
    engine = PolicyEngine(policy_set(make_policy()))
    engine.observe(window(DAY0, cand, samples=samples), DAY0, {})
    (v,) = engine.verdicts()
    assert v["status"] == status
    assert v["verdict"]["samples"] == samples
    if status != "inconclusive":
        assert v["verdict"]["candidate"] == cand and v["verdict"]["baseline"] == 0.01


def _thin_windows(k: int, routes: int, seed: int) -> list[Signal]:
    """Window ``k`` of ``routes`` thin routes (shipped policy): 0-3 events per precision, one side often empty,
    every 7th route slower on FP8 (its horizon test accumulates across windows)."""
    import random

    from watchdog.core.events import InferenceEvent
    from watchdog.windows.aggregator import WindowAggregator

    rng = random.Random(seed * 1000 + k)
    agg = WindowAggregator(length_s=10.0, grace_s=0.0)
    for r in range(routes):
        for prec in ("fp8", "fp16"):
            slow = 1.6 if prec == "fp8" and r % 7 == 0 else 1.0
            for i in range(rng.choice([0, 0, 1, 1, 2, 3])):
                status = "error" if rng.random() < 0.02 else "ok"
                agg.add(InferenceEvent(request_id=f"{r}-{k}-{prec}-{i}", ts=k * 10.0 + rng.uniform(0, 10), model="m",
                                       route=f"r{r}", precision=prec, status=status,
                                       latency_ms=100.0 * slow * rng.lognormvariate(0, 0.2), prompt_tokens=300,
                                       completion_tokens=150, ttft_ms=20.0, replica=f"{prec}-{rng.randrange(3)}"))
    return agg.close_due((k + 1) * 10.0)


def test_thin_routes_restarted_from_a_checkpoint_decide_as_without_the_restart() -> None:
    """Thin routes (every rule below min_samples, the horizon tests fed): an engine restored from its
    exported state (what a checkpoint holds; ``RuleState.seq_memo`` is not in it) gives the same actions,
    verdicts and state, bit for bit, as one that kept running."""
    from pathlib import Path

    from watchdog.policy.loader import load_policy_files

    ps = load_policy_files([str(Path(__file__).resolve().parent.parent / "policies" / "default.yaml")])
    kept, restarted = PolicyEngine(ps), PolicyEngine(ps)
    acts: dict[str, list[str]] = {"kept": [], "restarted": []}
    for k in range(40):
        sigs = _thin_windows(k, 30, seed=1)
        if k % 9 == 4:  # a restart: the state as saved, into a new engine
            state = json.loads(json.dumps(restarted.export_state()))
            restarted = PolicyEngine(ps)
            restarted.import_state(state)
        for name, eng in (("kept", kept), ("restarted", restarted)):
            acts[name] += [repr((a.kind, a.route, a.reason)) for a in eng.observe(sigs, (k + 1) * 10.0, {}, "fp8")]
    assert acts["kept"] == acts["restarted"]
    assert json.dumps(kept.verdicts(), sort_keys=True) == json.dumps(restarted.verdicts(), sort_keys=True)
    assert json.dumps(kept.export_state(), sort_keys=True) == json.dumps(restarted.export_state(), sort_keys=True)
    horizons = [rs.horizon.get("seq", {}).get("count", 0) for st in kept.states.values() for rs in st.rules.values()]
    assert max(horizons) >= 10  # the thin routes' horizon tests were fed across the windows


def test_an_operator_restoring_fp8_after_a_rollback_resolves_its_incident() -> None:
    # the rollback's critical incident stayed open at the pager after `flags set ... fp8` (no promote
    # action ever came for it)
    from watchdog.alerting.incidents import IncidentBook

    book = IncidentBook()
    sim = Sim(make_policy(rule_for=1, promote="manual"))
    (rb,) = sim.step(window(DAY0, 0.10), DAY0)
    book.on_action(rb)
    assert rb.kind == "rollback" and len(book) == 1
    assert sim.step(window(DAY0 + 60, 0.01), DAY0 + 60) == []
    sim.flags[(M, R)] = "fp8"  # the operator
    (a,) = sim.step(window(DAY0 + 120, 0.01), DAY0 + 120)
    assert (a.kind, a.reason) == ("resolve", "fp8 restored outside the watchdog (flags)")
    (msg,) = book.on_action(a)
    assert msg.status == "resolved" and len(book) == 0
    assert sim.step(window(DAY0 + 180, 0.01), DAY0 + 180) == []  # once


def test_route_policies_names_the_first_policy_holding_state_for_each_route() -> None:
    """``route_policies`` (read every second by the precision gauge) names, per route, the policy of its
    first state in state order, and None for a policy the set no longer has."""
    from watchdog.policy.state import ScopeState

    ps = policy_set(make_policy(name="a") + make_policy(name="b").split("policies:\n", 1)[1])
    engine = PolicyEngine(ps)
    for key in (("b", "llama-1", "r1"), ("a", "llama-1", "r1"), ("gone", "llama-1", "r2"), ("a", "llama-2", "r2")):
        engine.states[key] = ScopeState()
    assert {route: p.name if p else None for route, p in engine.route_policies().items()} == {
        ("llama-1", "r1"): "b", ("llama-1", "r2"): None, ("llama-2", "r2"): "a"}


def test_judging_rank_puts_a_route_whose_state_says_a_rollback_may_be_near_first() -> None:
    """``judging_rank`` (the daemon judges lower ranks first): 2 for a route no policy has seen, 1 once
    judged, 0 while a rule's streak is under way or a sequential test's last look reached
    ``NEAR_REJECT_SHARE`` of its rejection threshold."""
    import math
    from pathlib import Path

    from watchdog.policy.engine import NEAR_REJECT_SHARE
    from watchdog.policy.loader import load_policy_files

    ps = load_policy_files([Path(__file__).resolve().parent.parent / "policies" / "default.yaml"])
    engine = PolicyEngine(ps)
    assert engine.judging_rank(M, "a") == 2
    for route in ("a", "b", "c"):
        engine.observe(window(100.0, 0.01, route=route, samples=3), 101.0, {})
    assert [engine.judging_rank(M, r) for r in ("a", "b", "c")] == [1, 1, 1]
    policy = ps.policies[0]
    engine.states[(policy.name, M, "b")].rules["error-rate"].fails = 1
    rule = policy.rule("latency-typical")
    assert rule is not None and rule.judge is not None and rule.judge.horizon is not None
    near = NEAR_REJECT_SHARE * math.log(1.0 / rule.judge.horizon.alpha)
    last = engine.states[(policy.name, M, "c")].rules["latency-typical"].last
    assert last is not None
    last.extra["horizon_log_lr"] = near - 1e-9
    assert engine.judging_rank(M, "c") == 1
    last.extra["horizon_log_lr"] = near
    assert [engine.judging_rank(M, r) for r in ("a", "b", "c", "new")] == [1, 0, 0, 2]


def test_nearness_orders_the_routes_of_rank_zero_streaks_first_then_by_the_share_of_the_threshold() -> None:
    """``nearness`` (the daemon closes and judges the routes near a rollback nearest first) is given for
    exactly the routes of ``judging_rank`` 0: a streak under way before any sequential test's share, and
    a higher share of the rejection threshold before a lower one."""
    import math
    from pathlib import Path

    from watchdog.policy.engine import NEAR_REJECT_SHARE
    from watchdog.policy.loader import load_policy_files

    ps = load_policy_files([Path(__file__).resolve().parent.parent / "policies" / "default.yaml"])
    engine = PolicyEngine(ps)
    routes = ("a", "b", "c", "d", "e")
    for route in routes:
        engine.observe(window(100.0, 0.01, route=route, samples=3), 101.0, {})
    policy = ps.policies[0]
    rule = policy.rule("latency-typical")
    assert rule is not None and rule.judge is not None and rule.judge.horizon is not None
    reject = math.log(1.0 / rule.judge.horizon.alpha)
    engine.states[(policy.name, M, "b")].rules["error-rate"].fails = 1
    for route, share in (("c", 0.95), ("d", NEAR_REJECT_SHARE), ("e", NEAR_REJECT_SHARE / 2)):
        last = engine.states[(policy.name, M, route)].rules["latency-typical"].last
        assert last is not None
        last.extra["horizon_log_lr"] = share * reject
    near = {r: engine.nearness(M, r) for r in (*routes, "new")}
    assert {r for r, v in near.items() if v is not None} == {r for r in near if engine.judging_rank(M, r) == 0}
    assert near["a"] is None and near["e"] is None and near["new"] is None
    assert near["b"] is not None and near["c"] is not None and near["d"] is not None
    assert near["b"] > near["c"] > near["d"]
    assert near["c"] == pytest.approx(0.95)


def test_a_backlog_handed_over_in_one_call_decides_after_every_window_as_one_window_per_call_does() -> None:
    """Found comparing the daemon with a backtest of its recorded topic: catching up a backlog, the
    daemon handed the engine several windows of a route in one call and it decided once, after the
    last: the flip came a window later, and a rule that tripped and passed again did not flip at all."""
    shapes = ([0.10, 0.10, 0.10], [0.10, 0.10, 0.01], [0.10, 0.01, 0.10, 0.10, 0.01])
    for values in shapes:
        one = Sim(make_policy(rule_for=2))
        for i, v in enumerate(values):
            one.step(window(DAY0 + 60 * i, v), DAY0 + 60 * i)
        batch = Sim(make_policy(rule_for=2))
        got = batch.step([s for i, v in enumerate(values) for s in window(DAY0 + 60 * i, v)], DAY0 + 60 * len(values))
        assert [(a.kind, a.at, a.reason) for a in got] == [(a.kind, a.at, a.reason) for a in one.log], values
        assert [a.kind for a in got] == ["rollback"]
