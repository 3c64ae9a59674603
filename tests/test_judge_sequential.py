"""The always-valid sequential test (watchdog/policy/judge/sequential.py), the long-term anchor
(watchdog/policy/judge/anchor.py) and what the engine shows of them (watchdog/policy/horizon.py,
/status, metrics): checked by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from watchdog.core.metrics import Metrics
from watchdog.core.signals import Signal
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.judge import sequential as sq
from watchdog.policy.judge.anchor import anchor_cap, update_anchor
from watchdog.policy.loader import PolicySet, load_policy_files
from watchdog.policy.schema import Policy
from watchdog.policy.status import judgeability_rows

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
SHIPPED = [ROOT / "policies" / "default.yaml", ROOT / "policies" / "strict-legal-medical.yaml"]


def _llr_paths(x: np.ndarray, w: np.ndarray, tol: float, gamma: float) -> np.ndarray:
    """log Lambda after every look of every path (numpy copy of ``log_mixture_lr``, checked
    against it below)."""
    from scipy.special import log_ndtr

    a = np.cumsum((x - tol) / w, axis=1)
    info = np.cumsum(1.0 / w, axis=1)
    p = 1.0 / gamma**2 + info
    z = a / np.sqrt(p)
    return math.log(2.0) - 0.5 * np.log1p(gamma**2 * info) + 0.5 * z * z + log_ndtr(z)


def test_closed_form_matches_numeric_mixture() -> None:
    from scipy import integrate

    a, info, gamma = 37.0, 900.0, 0.05

    def integrand(u: float) -> float:
        return 2.0 / gamma * math.exp(-0.5 * (u / gamma) ** 2) / math.sqrt(2 * math.pi) * math.exp(u * a - u * u * info / 2)

    numeric, _ = integrate.quad(integrand, 0, 1.0, limit=200)
    assert sq.log_mixture_lr(a, info, gamma) == pytest.approx(math.log(numeric), rel=1e-6)
    x = np.array([[0.1, -0.05, 0.2]])
    w = np.array([[0.01, 0.02, 0.015]])
    paths = _llr_paths(x, w, 0.02, 0.05)
    aa = np.cumsum((x - 0.02) / w)
    ii = np.cumsum(1 / w)
    for k in range(3):
        assert paths[0, k] == pytest.approx(sq.log_mixture_lr(float(aa[k]), float(ii[k]), 0.05))


@pytest.mark.parametrize("theta_minus_tol", [0.0, -0.5])
def test_always_valid_false_alarms_over_many_looks(theta_minus_tol: float) -> None:
    """At the boundary of H0 (theta = tolerance) and inside it, the chance that the test EVER
    rejects over 1,000 looks stays below alpha (Ville); a fixed-sample z test looked at after
    every window would be far above it."""
    rng = np.random.default_rng(7)
    runs, looks, alpha, tol, gamma = 10_000, 1000, 0.01, 0.05, 0.1
    w = rng.uniform(0.0005, 0.005, (1, looks)) * np.ones((runs, 1))  # heteroscedastic windows
    x = tol + theta_minus_tol * math.sqrt(0.002) + rng.normal(0, 1, (runs, looks)) * np.sqrt(w)
    llr = _llr_paths(x, w, tol, gamma)
    ever = float(np.mean((llr >= math.log(1 / alpha)).any(axis=1)))
    se = math.sqrt(alpha * (1 - alpha) / runs)
    assert ever <= alpha + 2 * se, ever
    # the naive alternative: a one-sided z test at alpha after every look
    a = np.cumsum((x - tol) / w, axis=1)
    info = np.cumsum(1 / w, axis=1)
    naive = float(np.mean((a / np.sqrt(info) > 2.326).any(axis=1)))
    if theta_minus_tol == 0.0:
        assert naive > 10 * alpha


def test_staggered_tests_false_alarms_per_window() -> None:
    """A new test every ``restart`` windows, each living ``windows`` windows: rejections per
    window stay below alpha / restart (union bound over started tests), over 600 windows."""
    rng = np.random.default_rng(11)
    alpha, restart, life, tol = 0.05, 6, 60, 0.01
    runs, n = 120, 500
    alarms = 0
    first_alarms = 0
    for _ in range(runs):
        st = sq.new_state()
        fired = False
        for t in range(n):
            v = 0.0004
            sq.update(st, tol + rng.normal(0, math.sqrt(v)), v, end=float(t + 1), between_sd=0.0,
                      restart=restart, windows=life)
            ev = sq.evaluate(st, alpha=alpha, gamma=0.02, tolerance=tol, windows=life)
            if ev["reject"]:
                alarms += 1
                if not fired:
                    first_alarms += 1
                fired = True
                st = sq.new_state() | {"count": st["count"], "end": st["end"]}  # as after a rollback
    per_window_bound = alpha / restart
    assert first_alarms / (runs * n) <= per_window_bound
    assert alarms / (runs * n) <= per_window_bound


def test_power_and_mde_against_simulation() -> None:
    """The MDE formula: a true difference at the MDE for information I lands beyond the
    boundary at one look at I with the stated power (80 %); the sequential test with every
    look before it detects it at least that often."""
    rng = np.random.default_rng(3)
    alpha, gamma, tol, w, k = 0.001, 0.05, 0.05, 0.0006, 20
    info = k / w
    m = sq.mde(info, alpha, gamma, tol, power=0.8)
    est = (m - tol) + rng.normal(0, 1 / math.sqrt(info), 20_000)
    single = float(np.mean(est >= sq.boundary(info, alpha, gamma)))
    assert single == pytest.approx(0.8, abs=0.015)
    x = m + rng.normal(0, math.sqrt(w), (4000, k))
    llr = _llr_paths(x, np.full_like(x, w), tol, gamma)
    seq_power = float(np.mean((llr >= math.log(1 / alpha)).any(axis=1)))
    assert seq_power >= 0.78
    # and a larger effect is caught sooner: +10 % latency at parity, tolerance 5 %, a
    # 1,000-request window (w ~ 0.00036 with between_sd 0.015): within 10 windows
    x = math.log(1.1) + rng.normal(0, math.sqrt(0.00036), (4000, 10))
    llr = _llr_paths(x, np.full_like(x, 0.00036), 0.05, 0.05)
    assert float(np.mean((llr >= math.log(1000)).any(axis=1))) >= 0.9


def test_mde_shrinks_with_information_and_is_infinite_without() -> None:
    assert sq.mde(0.0, 0.001, 0.05, 0.05) == math.inf
    a, b = sq.mde(1000.0, 0.001, 0.05, 0.05), sq.mde(100_000.0, 0.001, 0.05, 0.05)
    assert 0.05 < b < a


def test_update_ignores_replays_and_bad_values() -> None:
    st = sq.new_state()
    sq.update(st, 0.1, 0.001, end=10.0, between_sd=0.0, restart=2, windows=5)
    sq.update(st, 0.1, 0.001, end=10.0, between_sd=0.0, restart=2, windows=5)  # replay
    sq.update(st, math.nan, 0.001, end=11.0, between_sd=0.0, restart=2, windows=5)
    assert st["count"] == 1 and len(st["tests"]) == 1
    for t in range(2, 12):
        sq.update(st, 0.1, 0.001, end=10.0 + t, between_sd=0.0, restart=2, windows=5)
    assert len(st["tests"]) <= 3 and all(t[1] <= 5 for t in st["tests"])


# --- anchor ----------------------------------------------------------------------------------


def test_anchor_cannot_be_dragged_by_creep() -> None:
    hist = [0.0] * 24
    anchor = update_anchor(None, hist, 0.0, learn_min=24, halflife=2016, tolerance=0.1)
    assert anchor == {"level": 0.0, "n": 24}
    level = 0.0
    for _ in range(2016):
        level += 0.001  # +0.1 % per window: +2 in log over the half-life
        anchor = update_anchor(anchor, hist, level, learn_min=24, halflife=2016, tolerance=0.1)
    assert anchor is not None
    assert anchor["level"] <= 0.1 + 1e-9  # at most the tolerance per half-life, whatever the data
    assert anchor_cap(anchor, 0.1) == pytest.approx(anchor["level"] + 0.1)
    assert update_anchor(None, hist[:10], 0.0, learn_min=24, halflife=2016, tolerance=0.1) is None


# --- through the engine ----------------------------------------------------------------------


def _window(t: int, route: str, fp8_ms: float, n8: int, n16: int, rng: np.random.Generator,
            fp8_err: float = 0.01, fp16_ms: float = 800.0) -> list[Signal]:
    out = []
    for prec, n, med, p_err in (("fp8", n8, fp8_ms, fp8_err), ("fp16", n16, fp16_ms, 0.01)):
        lat = np.exp(math.log(med) + 0.35 * rng.normal(size=n))
        keys = np.ceil(np.log(lat) / math.log(1.01 / 0.99)).astype(int)
        u, c = np.unique(keys, return_counts=True)
        sk = {"relative_accuracy": 0.01, "min_value": 1e-3, "count": n, "zero_count": 0,
              "bins": [[int(a), int(b)] for a, b in zip(u, c, strict=True)]}
        errors = int(rng.binomial(n, p_err))
        detail = {"events": n, "ok": n - errors, "errors": errors, "timeouts": 0, "completions": n - errors,
                  "empty": 0, "logprob_tokens": 0, "latency_hist": sk}
        values = {"error_rate": errors / n, "timeout_rate": 0.0, "latency_p50_ms": float(np.median(lat))}
        start = 1_780_000_000.0 + 300.0 * t
        out.append(Signal("live", "m", route, prec, start, start + 300.0, n, values, None, None, detail))
    return out


def _run(engine: PolicyEngine, route: str, windows: int, fp8_ms: float, n8: int, n16: int, seed: int,
         fp8_err: float = 0.01) -> int | None:
    rng = np.random.default_rng(seed)
    flags = {("m", route): "fp8"}
    for t in range(windows):
        acts = engine.observe(_window(t, route, fp8_ms, n8, n16, rng, fp8_err), 1_780_000_000.0 + 300.0 * (t + 1) + 1,
                              flags)
        if any(a.kind == "rollback" for a in acts):
            return t
    return None


@pytest.fixture(scope="module")
def shipped() -> PolicySet:
    """The shipped policies (``latency-typical`` carries the horizon and the anchor)."""
    return load_policy_files([str(p) for p in SHIPPED])


def test_cold_start_regression_is_caught_by_the_tolerance(shipped: PolicySet) -> None:
    """A new route whose FP8 is already 10 % slower: before, it warmed up and learned the
    level; the horizon test against the 5 % tolerance catches it within 10 windows."""
    caught = [_run(PolicyEngine(shipped), "chat/new", 10, 880.0, 2000, 1000, seed) for seed in range(3)]
    assert all(t is not None and t < 10 for t in caught), caught
    healthy = _run(PolicyEngine(shipped), "chat/ok", 20, 800.0, 2000, 1000, 99)
    assert healthy is None


def test_low_traffic_route_is_judged_over_the_horizon(shipped: PolicySet) -> None:
    """50 requests per precision: no window reaches min_samples, /status says "horizon" with
    an MDE, and +30 % latency rolls back within 30 windows."""
    eng = PolicyEngine(shipped)
    assert _run(eng, "chat/small", 6, 800.0, 50, 50, 5) is None
    snap = eng.snapshot()
    scope = next(s for s in snap["scopes"] if s["policy"] == "fp8-default")
    jb = scope["rules"]["latency-typical"]["judgeability"]
    assert jb["judged"] == "horizon" and jb["horizon_mde"] is not None and math.isfinite(jb["horizon_mde"])
    assert scope["rules"]["latency-p99"]["judgeability"]["judged"] == "no"
    assert "too few" in scope["rules"]["latency-p99"]["judgeability"]["why"]
    rows = judgeability_rows(snap)
    assert {r["rule"] for r in rows if r["judged"] == 1} >= {"latency-typical", "error-rate"}
    m = Metrics(CollectorRegistry())
    m.set_judgeability(rows)
    labels = {"policy": "fp8-default", "model": "m", "route": "chat/small", "rule": "latency-typical"}
    assert m.registry.get_sample_value("llmwd_rule_judged", labels) == 1.0
    assert m.registry.get_sample_value("llmwd_rule_mde", labels | {"over": "horizon"}) == pytest.approx(jb["horizon_mde"])
    t = _run(PolicyEngine(shipped), "chat/small2", 30, 800.0 * 1.3, 50, 50, 6)
    assert t is not None and t < 30


def test_horizon_and_anchor_survive_export_import(shipped: PolicySet) -> None:
    eng = PolicyEngine(shipped)
    assert _run(eng, "chat/a", 40, 800.0, 2000, 1000, 8) is None
    key = ("fp8-default", "m", "chat/a")
    rs = eng.states[key].rules["latency-typical"]
    assert rs.horizon.get("anchor") and rs.horizon.get("seq", {}).get("tests")
    data = __import__("json").loads(__import__("json").dumps(eng.export_state()))
    eng2 = PolicyEngine(shipped)
    eng2.import_state(data)
    rs2 = eng2.states[key].rules["latency-typical"]
    # the same numbers (a live test is a tuple, a restored one a JSON list)
    assert rs2.horizon == __import__("json").loads(__import__("json").dumps(rs.horizon))
    # a flip empties the horizon tests (evidence about the old serving state), the anchor stays
    eng2.states[key].reset_pools()
    assert "seq" not in rs2.horizon and rs2.horizon["anchor"] == rs.horizon["anchor"]
    # states saved before horizons existed still load
    for sc in data["scopes"]:
        for r in sc["state"]["rules"].values():
            r.pop("horizon", None)
    eng3 = PolicyEngine(shipped)
    eng3.import_state(data)
    assert eng3.states[key].rules["latency-typical"].horizon == {}


def test_anchor_caps_the_learned_level() -> None:
    """With an anchor, the level a learned null credits stays within anchor + tolerance."""
    from watchdog.policy.horizon import level_cap

    pol = Policy.model_validate({"name": "p", "rules": [{"name": "lat", "metric": "latency_p50_ms", "judge": {
        "test": "quantile", "tail": 0.0, "effect": 0.0, "learn": 48, "level_cap": 0.10,
        "anchor": {"tolerance": 0.05}}}]})
    rule = pol.rules[0]
    assert level_cap(rule, {}) is None
    assert level_cap(rule, {"anchor": {"level": -0.4, "n": 30}}) == pytest.approx(-0.35)
    assert level_cap(rule, {"anchor": {"level": 0.2, "n": 30}}) == pytest.approx(0.10)


def _creep_then_restart(engine: PolicyEngine, route: str, fp8_after: float, seed: int) -> int | None:
    """60 windows at parity; FP16 alone 0.5 % slower per window for 80 windows (uptime creep, FP8
    unchanged at 800 ms); FP16 restarted back to 800 ms; 30 more windows with FP8 at ``fp8_after``.
    The window of the first rollback, or None."""
    rng = np.random.default_rng(seed)
    flags = {("m", route): "fp8"}
    for t in range(170):
        fp16 = 800.0 * math.exp(0.005 * min(max(t - 60, 0), 80)) if t < 140 else 800.0
        sigs = _window(t, route, 800.0 if t < 140 else fp8_after, 2000, 1000, rng, fp16_ms=fp16)
        if any(a.kind == "rollback" for a in engine.observe(sigs, 1_780_000_000.0 + 300.0 * (t + 1) + 1, flags)):
            return t
    return None


def test_a_baseline_that_crept_and_recovered_is_not_fp8s_regression(shipped: PolicySet) -> None:
    """bench/ordinary_days.py ``creep-fp16``: the learned level followed FP16's creep down to FP8
    looking 33 % faster, and FP16's restart back to parity was judged an FP8 regression of +0.4
    (646 false rollbacks in 6,000 windows). A level more than the anchor's tolerance below the
    anchor is judged as the anchor; an FP8 regression after the restart is still caught against it."""
    assert _creep_then_restart(PolicyEngine(shipped), "chat/creep", 800.0, 3) is None
    t = _creep_then_restart(PolicyEngine(shipped), "chat/creep-bad", 880.0, 3)
    assert t is not None and 140 <= t < 150, t


def _crept_from_the_start(engine: PolicyEngine, route: str, fp8_after: float, seed: int) -> int | None:
    """The watch begins while FP16 is already 40 windows into a 0.5 %-per-window uptime creep (so
    the anchor is learned at a crept level too); FP16 restarted back to 800 ms at window 100, FP8 at
    800 ms until then and ``fp8_after`` from the restart on. The window of the first rollback, or None."""
    rng = np.random.default_rng(seed)
    flags = {("m", route): "fp8"}
    for t in range(130):
        fp16 = 800.0 * math.exp(0.005 * (t + 40)) if t < 100 else 800.0
        sigs = _window(t, route, 800.0 if t < 100 else fp8_after, 2000, 1000, rng, fp16_ms=fp16)
        if any(a.kind == "rollback" for a in engine.observe(sigs, 1_780_000_000.0 + 300.0 * (t + 1) + 1, flags)):
            return t
    return None


def test_which_precision_moved_decides_when_the_anchor_was_learned_mid_creep(shipped: PolicySet) -> None:
    """bench/ordinary_days.py ``creep-fp16``, what the anchor left: a watch that began mid-creep
    learns a crept anchor, and FP16's restart is a shift of +0.7 against the level. FP16's own
    statistic fell by all of it and FP8's did not move, so the window passes (``baseline_moved``)
    and the level follows; FP8 10 % slower at the restart is still a regression of FP8's own."""
    engine = PolicyEngine(shipped)
    assert _crept_from_the_start(engine, "chat/mid-creep", 800.0, 5) is None
    rs = engine.states[("fp8-default", "m", "chat/mid-creep")].rules["latency-typical"]
    assert all("base" in x for x in rs.null[-50:])  # FP16's own statistic is learned with each window
    t = _crept_from_the_start(PolicyEngine(shipped), "chat/mid-creep-bad", 880.0, 5)
    assert t is not None and 100 <= t < 110, t


def test_baseline_moved_splits_the_shift_into_each_precisions_own_move() -> None:
    from watchdog.policy.judge.live import baseline_moved

    rng = np.random.default_rng(2)
    b16 = list(-6.7 + 0.01 * rng.normal(size=60))      # FP16's own mean log latency
    hist = [0.0 + 0.01 * rng.normal() for _ in b16]     # FP8 - FP16 at parity
    kw = {"recent": 3, "alpha": 1e-4, "prior_sd": 0.015, "effect": 0.0}
    level16 = float(np.mean(b16[-3:]))
    own8 = float(np.mean([h + b for h, b in zip(hist[-3:], b16[-3:], strict=True)]))
    # FP16 fell by 0.3, FP8 stayed: FP16's move, FP8's own move judged and not failed
    pool_b = [level16 - 0.3] * 3
    pool = [(own8 - b, 1e-4) for b in pool_b]
    out = baseline_moved(pool, pool_b, hist, b16, **kw)
    assert out is not None and not out["fails"]
    assert out["fp16_own"] == pytest.approx(-0.3) and abs(out["fp8_own"]) < 1e-9
    # FP16 fell by 0.3 and FP8 rose by 0.1: FP8's own move fails
    pool = [(own8 + 0.1 - b, 1e-4) for b in pool_b]
    out = baseline_moved(pool, pool_b, hist, b16, **kw)
    assert out is not None and out["fails"] and out["fp8_own"] == pytest.approx(0.1)
    # FP16 steady, FP8 0.1 slower: not FP16's move, the difference's judgement stands
    assert baseline_moved([(own8 + 0.1 - level16, 1e-4)] * 3, [level16] * 3, hist, b16, **kw) is None
    # a pool failed against a capped level (FP8 crept past its anchor): FP16's small move does not excuse it
    pool = [(own8 + 0.002 - b, 1e-4) for b in [level16 - 0.01] * 3]
    out = baseline_moved(pool, [level16 - 0.01] * 3, hist, b16, level_offset=0.15, **kw)
    assert out is not None and out["fails"] and out["fp8_own"] == pytest.approx(0.152)
    # FP16's statistic unknown for the level's windows (a state saved before it was kept)
    assert baseline_moved(pool, pool_b, hist, b16[:-3] + [math.nan] * 3, **kw) is None


def test_a_level_far_below_the_anchor_is_judged_as_the_anchor() -> None:
    from watchdog.policy.horizon import level_reset
    from watchdog.policy.judge.live import judge_learned

    pol = Policy.model_validate({"name": "p", "rules": [{"name": "lat", "metric": "latency_p50_ms", "judge": {
        "test": "quantile", "tail": 0.0, "effect": 0.0, "learn": 48, "level_cap": 0.10,
        "anchor": {"tolerance": 0.05}}}]})
    rule = pol.rules[0]
    assert level_reset(rule, {}) is None
    assert level_reset(rule, {"anchor": {"level": -0.4, "n": 30}}) == pytest.approx((-0.45, -0.4))
    hist = list(np.random.default_rng(1).normal(-0.3, 0.01, 48))   # a level that crept to -0.3
    kw = {"effect_threshold": 0.0, "alpha": 1e-4, "prior_sd": 0.015, "recent": 3, "level_cap": 0.10}
    assert judge_learned([(0.0, 1e-4)] * 3, hist, **kw).status == "fail"
    j = judge_learned([(0.0, 1e-4)] * 3, hist, level_reset=(-0.1, 0.0), **kw)
    assert j.status == "pass" and j.detail["level"] == 0.0
    assert judge_learned([(0.1, 1e-4)] * 3, hist, level_reset=(-0.1, 0.0), **kw).status == "fail"
    # a level within the anchor's band is used as it is (a healthy level wanders around the anchor)
    level = float(np.mean(hist[-3:]))
    assert judge_learned([(0.0, 1e-4)] * 3, hist, level_reset=(-0.4, -0.3), **kw).detail["level"] == pytest.approx(level)
    # the anchor is credited no higher than the cap
    assert judge_learned([(0.0, 1e-4)] * 3, hist, level_reset=(0.2, 0.3), **kw).detail["level"] == pytest.approx(0.10)


def test_validation_refuses_horizon_on_golden_and_anchor_without_learn(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from watchdog.policy.loader import PolicyError

    f = tmp_path / "p.yaml"
    f.write_text("""policies:
  - name: p
    rules:
      - name: g
        source: golden
        metric: rougeL
        judge: {test: paired, effect: 0.0, horizon: {tolerance: 0.01}}
      - name: l
        metric: latency_p50_ms
        judge: {test: quantile, tail: 0.0, effect: 0.0, anchor: {tolerance: 0.1}}
""")
    with pytest.raises(PolicyError) as exc:
        load_policy_files([str(f)])
    text = str(exc.value)
    assert "horizon accumulates live windows" in text and "anchor caps a learned null" in text


def test_judgeability_gauges_are_bounded_and_forget_old_rows() -> None:
    """At most ``max_rows`` series, the unjudged rules first; a row no longer exported loses its series."""
    m = Metrics(CollectorRegistry())
    rows = [{"policy": "p", "model": "m", "route": f"r{i}", "rule": "x", "judged": i % 2, "mde": 0.01 * i,
             "horizon_mde": None} for i in range(10)]
    m.set_judgeability(rows, max_rows=4)
    judged = {s.labels["route"]: s.value for f in m.registry.collect() if f.name == "llmwd_rule_judged"
              for s in f.samples}
    assert judged == {"r8": 0.0, "r6": 0.0, "r4": 0.0, "r2": 0.0}  # not judged first, largest MDE first
    m.set_judgeability(rows[:3], max_rows=4)
    judged = {s.labels["route"] for f in m.registry.collect() if f.name == "llmwd_rule_judged" for s in f.samples}
    mde = {s.labels["route"] for f in m.registry.collect() if f.name == "llmwd_rule_mde" for s in f.samples}
    assert judged == mde == {"r0", "r1", "r2"}


def test_state_judgeability_rows_equal_the_snapshot_rows(shipped: PolicySet) -> None:
    """The daemon's metric export skips the snapshot; its rows are the same."""
    from watchdog.policy.status import state_judgeability_rows

    eng = PolicyEngine(shipped)
    _run(eng, "chat/small", 6, 800.0, 50, 50, 5)
    _run(eng, "chat/big", 4, 800.0, 2000, 1000, 6)
    rows = state_judgeability_rows(eng.policy_set, eng.states)
    assert rows and rows == judgeability_rows(eng.snapshot())


def _burst_then_normal(cap: tuple[float, float] | None) -> bool:
    """One window 4.5 points above FP16 (a replica restarting), then normal windows 0.3 points
    above, on a 1-point tolerance: whether any look rejects."""
    st = sq.new_state()
    v = 0.003 ** 2
    for t, x in enumerate([0.045] + [0.003] * 20):
        sq.update(st, x, v, end=float(t + 1), between_sd=0.0, restart=6, windows=288, cap=cap)
        if sq.evaluate(st, alpha=0.0005, gamma=0.03, tolerance=0.01, windows=288)["reject"]:
            return True
    return False


def test_one_window_burst_does_not_reject_with_bounded_influence() -> None:
    """The bound on one window's influence is what keeps a one-window burst (which a rule's ``for``
    dismisses) from rolling back through the horizon; without it the same windows reject."""
    assert _burst_then_normal(None)
    assert not _burst_then_normal((0.01, 3.0))


def test_bounded_influence_keeps_a_lasting_excess_and_the_size() -> None:
    """A lasting excess of 2 sd beyond the tolerance is still caught, and at the tolerance the capped
    test stays below alpha over many looks (capping only lowers the evidence)."""
    rng = np.random.default_rng(5)
    tol, v, alpha = 0.01, 0.003 ** 2, 0.05
    caught = 0
    for _ in range(40):
        st = sq.new_state()
        for t in range(30):
            sq.update(st, tol + 0.006 + rng.normal(0, 0.003), v, end=float(t + 1), between_sd=0.0, restart=6,
                      windows=288, cap=(tol, 3.0))
            if sq.evaluate(st, alpha=alpha, gamma=0.01, tolerance=tol, windows=288)["reject"]:
                caught += 1
                break
    assert caught == 40
    alarms = 0
    for _ in range(300):
        st = sq.new_state()
        for t in range(200):
            sq.update(st, tol + rng.normal(0, 0.003), v, end=float(t + 1), between_sd=0.0, restart=1000,
                      windows=1000, cap=(tol, 3.0))
            if sq.evaluate(st, alpha=alpha, gamma=0.01, tolerance=tol, windows=1000)["reject"]:
                alarms += 1
                break
    assert alarms / 300 <= alpha


def test_evaluate_with_a_memo_gives_the_same_numbers() -> None:
    """``memo`` (``RuleState.seq_memo``) remembers the two MDEs with their inputs: every look gives the
    numbers a look without it gives, bit for bit, whether the tests moved in between or not."""
    import random

    from watchdog.policy.judge import sequential as seq_mod

    rng = random.Random(5)
    state = seq_mod.new_state()
    memo: list[object] = []
    for k in range(300):
        if rng.random() < 0.6:  # a window that feeds the tests; else one that does not (one side empty)
            seq_mod.update(state, rng.gauss(0.01, 0.05), rng.uniform(1e-4, 1e-2), end=float(k), between_sd=0.02,
                           restart=6, windows=48)
        tol = rng.choice([0.05, 0.05, 0.10])
        plain = seq_mod.evaluate(state, alpha=0.0005, gamma=0.03, tolerance=tol, windows=48)
        kept = seq_mod.evaluate(state, alpha=0.0005, gamma=0.03, tolerance=tol, windows=48, memo=memo)
        assert repr(kept) == repr(plain)
