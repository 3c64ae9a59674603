"""The shipped policies driven through realistic window sequences, the embedded demo's traffic and
the golden replays the demo and docs/POLICIES.md quote."""

from __future__ import annotations

import json
import random
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from watchdog.core.signals import Action, Signal
from watchdog.dev.traffic import Route, TrafficGenerator
from watchdog.policy import PolicyEngine, load_policy_files
from watchdog.policy.backtest import run_backtest

REPO = Path(__file__).resolve().parents[1]
M = "llama-3-8b"
T0 = 1_800_000_000.0
HEALTHY = {"error_rate": 0.01, "timeout_rate": 0.0, "latency_p50_ms": 60.0, "latency_p99_ms": 400.0,
           "shadow_rougeL": 0.97, "perplexity": 5.0, "empty_rate": 0.0}


def counts(values: dict[str, float], n: int = 1000) -> dict[str, int]:
    """The detail counts windows.py writes, consistent with the rates (judged rate rules read them)."""
    timeouts = round(values["timeout_rate"] * n)
    return {"events": n, "timeouts": timeouts, "errors": round(values["error_rate"] * n) - timeouts}


def live(route: str, t: float, **fp8: float) -> list[Signal]:
    base = dict(HEALTHY, latency_p50_ms=100.0)
    cand = dict(HEALTHY, **fp8)
    return [Signal("live", M, route, "fp8", t - 60, t, 1000, cand, detail=counts(cand)),
            Signal("live", M, route, "fp16", t - 60, t, 1000, base, detail=counts(base))]


def golden(route: str, t: float, n: int = 100) -> list[Signal]:
    """A passing golden replay: FP8 and FP16 answer every item the same."""
    values = {"rougeL": 0.7, "exact_match": 0.5}
    return [Signal("golden", M, route, "fp8", t - 30, t, n, dict(values),
                   paired={k: [0.0] * n for k in values}),
            Signal("golden", M, route, "fp16", t - 30, t, n, dict(values))]


def run(engine: PolicyEngine, flags: dict[tuple[str, str], str], signals: list[Signal], now: float) -> list[Action]:
    acts = engine.observe(signals, now, flags)
    for a in acts:
        if a.kind in ("rollback", "promote") and not a.dry_run:
            flags[(a.model, a.route)] = a.precision or ""
    return acts


def test_legal_route_rolls_back_at_once_and_stays_on_fp16() -> None:
    engine = PolicyEngine(load_policy_files([REPO / "policies"]))
    flags: dict[tuple[str, str], str] = {}
    route = "legal/contracts"
    assert run(engine, flags, live(route, T0), T0) == []
    # shadow agreement < 0.85 for 2 windows (min_samples counts shadow pairs; none given: events)
    assert run(engine, flags, live(route, T0 + 30, shadow_rougeL=0.70), T0 + 30) == []
    (a,) = run(engine, flags, live(route, T0 + 60, shadow_rougeL=0.70), T0 + 60)
    assert (a.kind, a.policy, a.precision, a.severity) == ("rollback", "fp8-strict-legal-medical", "fp16", "critical")
    assert flags[(M, route)] == "fp16"
    t, kinds = T0 + 60, []
    for i in range(40):  # 40 healthy minutes, past the default policy's 30m and 10 windows
        t += 60
        sigs = live(route, t) + (golden(route, t) if i % 10 == 9 else [])
        kinds += [(x.kind, x.policy, x.reason) for x in run(engine, flags, sigs, t)]
    assert not [k for k in kinds if k[0] == "promote"] and flags[(M, route)] == "fp16"
    # the strict policy counts passing golden replays only: the hint comes after the third
    hints = [(k, t) for k in kinds if k[0] == "alert" and "promote manually" in k[2]]
    assert [k[1] for k, _ in hints] == ["fp8-strict-legal-medical"] and "healthy for 3 windows" in hints[0][0][2]


def test_chat_route_rolls_back_at_once_on_pooled_errors_and_auto_promotes() -> None:
    engine = PolicyEngine(load_policy_files([REPO / "policies"]))
    flags: dict[tuple[str, str], str] = {}
    route = "chat/general"
    # the judged error-rate rule (for 2: one-window bursts are not enough) and the plain
    # error-rate-absolute (for 2) both trip on the second window of 90/1000 vs 10/1000
    assert run(engine, flags, live(route, T0 - 60, error_rate=0.09), T0 - 60) == []
    (a,) = run(engine, flags, live(route, T0, error_rate=0.09), T0)
    assert (a.kind, a.policy, a.detail["channels"]) == ("rollback", "fp8-default", ["slack", "pagerduty"])
    assert a.detail["rules"] == ["error-rate", "error-rate-absolute"]
    judged = a.detail["verdicts"][0]["judgement"]
    assert judged["status"] == "fail" and judged["ci_low"] > 0.01
    state = engine.states[("fp8-default", M, route)]
    assert not any(rs.pool for rs in state.rules.values())  # a fresh pool after the flip
    t, promoted_at = T0, None
    while promoted_at is None and t < T0 + 7200:
        t += 60
        if any(x.kind == "promote" for x in run(engine, flags, live(route, t), t)):
            promoted_at = t
    assert promoted_at == T0 + 1800  # promote.after 30m dominates 10 healthy windows
    assert flags[(M, route)] == "fp8"
    assert not any(rs.pool for rs in state.rules.values())


def test_fp8_no_faster_alerts_without_flipping() -> None:
    engine = PolicyEngine(load_policy_files([REPO / "policies" / "default.yaml"]))
    flags: dict[tuple[str, str], str] = {}
    acts: list[Action] = []
    for i in range(5):
        acts += run(engine, flags, live("chat/x", T0 + 60 * i, latency_p50_ms=98.0), T0 + 60 * i)
    assert [(a.kind, a.detail.get("rule")) for a in acts] == [("alert", "fp8-no-faster")]
    assert flags == {}


# --- the embedded demo's traffic through the default policy ------------------------------------
# Events from watchdog/dev/traffic.py (15 % FP16 baseline slice, 30 % shadows, FP8 1.6x faster) at
# 60 requests/s per route, folded into windows and judged by policies/default.yaml exactly as the
# daemon does (watchdog.policy.backtest: WindowAggregator + PolicyEngine, flags simulated).

DEMO_MODEL = "llama-3.1-8b-instruct"
DEMO_ROUTE, OTHER_ROUTE = "legal/contracts", "support/chat"


def demo_lines(regression: str | None, inject_at: float, seconds: float, rate: float = 60.0) -> list[bytes]:
    routes = [Route(DEMO_MODEL, DEMO_ROUTE, rate=rate), Route(DEMO_MODEL, OTHER_ROUTE, rate=rate)]
    gen, arrivals = TrafficGenerator(routes, seed=3), random.Random(4)
    events = []
    for r in routes:
        t = T0
        while (t := t + arrivals.expovariate(r.rate)) < T0 + seconds:
            r.regression = regression if r.route == DEMO_ROUTE and t >= T0 + inject_at else None  # type: ignore[assignment]
            events.append(gen.event(r, now=round(t, 3)))
    events.sort(key=lambda e: e["ts"])
    return [json.dumps(e).encode() for e in events]


@pytest.mark.parametrize(("regression", "window_s", "seconds", "rule", "within_s"), [
    # the demo: 2 s windows; shadow agreement trips after 3 windows, asks for a golden replay,
    # and (no golden job guards this route) rolls back after confirm_timeout 6 more windows
    ("quality", 2.0, 60.0, "shadow-agreement", 30.0),
    (None, 2.0, 60.0, None, None),
    # 10 s windows: the pooled error and timeout judges have enough FP16 requests (3 x ~90)
    ("errors", 10.0, 120.0, "error-rate", 30.0),
    ("timeouts", 10.0, 120.0, "timeout-rate", 30.0),
    (None, 10.0, 120.0, None, None),
])
def test_demo_traffic_through_the_default_policy(regression: str | None, window_s: float, seconds: float,
                                                 rule: str | None, within_s: float | None) -> None:
    inject_at = seconds / 3
    r = run_backtest(load_policy_files([REPO / "policies" / "default.yaml"]),
                     demo_lines(regression, inject_at, seconds), window_s=window_s, grace_s=0.5)
    assert r.bad_lines == 0 and r.late == 0
    assert not [a for a in r.actions if a.route == OTHER_ROUTE], "the healthy route must be left alone"
    flips = [a for a in r.actions if a.flip]
    if rule is None:
        assert r.actions == [] and r.flips == 0
        return
    assert within_s is not None
    first = flips[0]
    assert (first.kind, first.route) == ("rollback", DEMO_ROUTE)
    assert first.rule in (rule, "error-rate-absolute")  # timeouts count as errors too
    assert T0 + inject_at < first.at <= T0 + inject_at + within_s, first.at - T0 - inject_at
    assert not [a for a in r.actions if a.at <= T0 + inject_at]
    if regression == "quality":
        # realistic signals: FP8 answers agree ~0.35-0.45 with their FP16 shadows, perplexity ~3x
        fp8 = [p for p in r.timeline if p["route"] == DEMO_ROUTE and p["precision"] == "fp8"
               and T0 + inject_at + window_s < p["t"] <= first.at]
        fp16 = {p["t"]: p for p in r.timeline if p["route"] == DEMO_ROUTE and p["precision"] == "fp16"}
        agree = [p["values"]["shadow_rougeL"] for p in fp8]
        ratio = [p["values"]["perplexity"] / fp16[p["t"]]["values"]["perplexity"] for p in fp8 if p["t"] in fp16]
        assert 0.25 < float(np.median(agree)) < 0.5 and 2.0 < float(np.median(ratio)) < 4.0, (agree, ratio)
        kinds = [(a.kind, a.rule) for a in r.actions if a.at <= first.at]
        assert kinds[0] == ("alert", "shadow-agreement")  # the suspicion, asking for a golden replay


# --- how the default golden rule judges a 32-item replay (numbers quoted in docs/POLICIES.md) ---

GOLDEN_N = 32


def golden_replay(t: float, diffs: list[float], route: str = "code/assist") -> list[Signal]:
    values = {"rougeL": 0.7}
    return [Signal("golden", M, route, "fp8", t - 30, t, len(diffs), dict(values), paired={"rougeL": list(diffs)},
                   detail={"golden_set": "code"}),
            Signal("golden", M, route, "fp16", t - 30, t, len(diffs), dict(values), detail={"golden_set": "code"})]


#: a stale FP8 calibration: every item drops, -0.4 +- 0.2 (normal quantiles, clipped to [-1, 0])
STALE = [min(0.0, -0.4 + 0.2 * NormalDist().inv_cdf((i + 0.5) / GOLDEN_N)) for i in range(GOLDEN_N)]


@pytest.mark.parametrize(("name", "diffs", "status", "ci"), [
    # 5 of 32 items destroyed: neither the mean (interval straddles 0) nor the exact broken-items
    # test (5/32 vs the prior null 6/400, Fisher exact p 5.5e-4 > broken.alpha 1e-4) is sure on 32 items
    ("5 items at -0.5", [-0.5] * 5 + [0.0] * 27, "pass", (-0.2190, 0.0628)),
    # 10 of 32: the broken-items test fails; the interval shown is that of the broken shares
    ("10 items at -0.3", [-0.3] * 10 + [0.0] * 22, "fail", (0.0831, 0.6274)),
    # 3 of 32: neither test is sure at alpha 0.001 on 32 items (straddle: pass)
    ("3 items at -0.5", [-0.5] * 3 + [0.0] * 29, "pass", (-0.1696, 0.0759)),
    ("stale calibration, -0.4 +- 0.2", STALE, "fail", (-0.5485, -0.2534)),
    ("identical", [0.0] * GOLDEN_N, "pass", (-0.0799, 0.0799)),
])
def test_default_golden_rule_on_a_32_item_replay(name: str, diffs: list[float], status: str,
                                                 ci: tuple[float, float]) -> None:
    engine = PolicyEngine(load_policy_files([REPO / "policies" / "default.yaml"]))
    flags: dict[tuple[str, str], str] = {}
    acts = run(engine, flags, golden_replay(T0, diffs), T0)
    v = engine.states[("fp8-default", M, "code/assist")].rules["golden-rougeL"].last
    assert v is not None and v.status == status, (name, v.reason)
    assert [a.kind for a in acts] == (["rollback"] if status == "fail" else [])
    assert (v.extra["ci_low"], v.extra["ci_high"]) == pytest.approx(ci, abs=1e-4)


def test_default_golden_rule_demo_sequence() -> None:
    """A healthy replay (1 of 32 items differs) stays on FP8, replaying it unchanged stays on FP8
    (identical replays: one look), then a stale calibration rolls back on the first look."""
    engine = PolicyEngine(load_policy_files([REPO / "policies" / "default.yaml"]))
    flags: dict[tuple[str, str], str] = {}
    healthy = [-0.5] * 1 + [0.0] * 31
    assert run(engine, flags, golden_replay(T0, healthy), T0) == []
    assert run(engine, flags, golden_replay(T0 + 600, healthy), T0 + 600) == []
    (a,) = run(engine, flags, golden_replay(T0 + 1200, STALE), T0 + 1200)
    j = a.detail["verdicts"][0]["judgement"]
    assert (a.kind, a.detail["rule"]) == ("rollback", "golden-rougeL")
    assert j["detail"]["looks"]["latest"]["status"] == "fail"
    assert j["detail"]["looks"]["latest"]["alpha"] == pytest.approx((0.001 - 0.0001) * 0.1)  # broken.alpha for the broken test


def _replica_window(route: str, t: float, fp8_fails: list[int]) -> list[Signal]:
    """1,000 requests per precision over 8 FP8 / 3 FP16 replicas; FP16 has 1 % errors spread evenly, FP8
    the given failures per replica."""
    out = []
    for prec, fails in (("fp8", fp8_fails), ("fp16", [4, 3, 3])):
        per = 1000 // len(fails)
        rf = {f"{prec}-{i}": [per - f, f, 0] for i, f in enumerate(fails)}
        n, err = per * len(fails), sum(fails)
        values = dict(HEALTHY, error_rate=err / n, latency_p50_ms=100.0 if prec == "fp16" else 60.0)
        out.append(Signal("live", M, route, prec, t - 60, t, n, values,
                          detail={"events": n, "errors": err, "timeouts": 0, "replica_fails": rf}))
    return out


@pytest.mark.parametrize("policy", ["default.yaml", "strict-legal-medical.yaml"])
def test_one_replica_that_crashed_is_left_out_and_errors_on_every_replica_still_roll_back(policy: str) -> None:
    """One FP8 replica of 8 fails all its requests for two windows (a crash, an out-of-memory restart):
    the error rules count FP8 without it (``replica_failures: leave_out``) and nothing rolls back - before,
    error-rate and error-rate-absolute both did (12.5 % of FP8's requests). The same number of failures
    spread over all FP8 replicas is the precision's and rolls back."""
    route = "legal/contracts"
    for fails, rolls in (([125, 1, 1, 1, 1, 1, 1, 1], False), ([17, 17, 17, 16, 16, 16, 16, 16], True)):
        engine = PolicyEngine(load_policy_files([REPO / "policies" / policy]))
        flags: dict[tuple[str, str], str] = {}
        acts: list[Action] = []
        for i in range(3):
            t = T0 + 60 * i
            acts += run(engine, flags, _replica_window(route, t, fails if i else [1] * 8), t)
        rolled = [a for a in acts if a.kind == "rollback"]
        assert bool(rolled) == rolls, (fails, [a.detail.get("rules") for a in rolled])
        if not rolls:
            state = next(s for k, s in engine.states.items() if k[2] == route)
            assert state.rules["error-rate-absolute"].last.status == "pass"
