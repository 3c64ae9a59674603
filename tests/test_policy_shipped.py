"""The shipped policies driven through realistic window sequences."""

from __future__ import annotations

from pathlib import Path

from watchdog.policy import PolicyEngine, load_policy_files
from watchdog.signals import Action, Signal

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
    (a,) = run(engine, flags, live(route, T0 + 60, shadow_rougeL=0.85), T0 + 60)
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
    # the pooled error-rate judge (pool 3, for 1) is sure on the first window: 90/1000 vs 10/1000;
    # the plain error-rate-absolute (for 2) has failed once only
    (a,) = run(engine, flags, live(route, T0, error_rate=0.09), T0)
    assert (a.kind, a.policy, a.detail["channels"]) == ("rollback", "fp8-default", ["slack", "pagerduty"])
    assert a.detail["rules"] == ["error-rate"]
    judged = a.detail["verdicts"][0]["judgement"]
    assert judged["status"] == "fail" and judged["ci_low"] > 0.0025 and judged["detail"]["pooled_windows"] == 1
    state = engine.states[("fp8-default", M, route)]
    assert all(rs.pool == [] for rs in state.rules.values())  # a fresh pool after the flip
    t, promoted_at = T0, None
    while promoted_at is None and t < T0 + 7200:
        t += 60
        if any(x.kind == "promote" for x in run(engine, flags, live(route, t), t)):
            promoted_at = t
    assert promoted_at == T0 + 1800  # promote.after 30m dominates 10 healthy windows
    assert flags[(M, route)] == "fp8"
    assert all(rs.pool == [] for rs in state.rules.values())


def test_fp8_no_faster_alerts_without_flipping() -> None:
    engine = PolicyEngine(load_policy_files([REPO / "policies" / "default.yaml"]))
    flags: dict[tuple[str, str], str] = {}
    acts: list[Action] = []
    for i in range(5):
        acts += run(engine, flags, live("chat/x", T0 + 60 * i, latency_p50_ms=98.0), T0 + 60 * i)
    assert [(a.kind, a.detail.get("rule")) for a in acts] == [("alert", "fp8-no-faster")]
    assert flags == {}
