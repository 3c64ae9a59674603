"""Request mix, replicas, deploys (watchdog/policy/judge/fleet.py, watchdog/policy/changes.py): the
statistics against simulation, the outlier-replica rule, the deploy bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest

from watchdog.core.signals import Signal
from watchdog.policy.changes import build_signature, change_entry, mark_maintenance
from watchdog.policy.evaluate import evaluate_rule
from watchdog.policy.judge.fleet import FleetOptions, _contrast_rows, clean_side, fleet_inputs, mix_log_diff
from watchdog.policy.judge.live import quantile_log_diff, sketch_log_tail_contrast
from watchdog.policy.schema import Judge, Rule

LOG_G = math.log(1.01 / 0.99)
# request types: (prompt octave, completion octave, mean log latency)
TYPES = [(9, 8, 8.0), (9, 9, 8.5), (12, 8, 8.4), (12, 9, 8.9)]


def _cells(rng: np.random.Generator, n: int, long_share: float, shift: float = 0.0, sd: float = 0.3,
           long_effect: float = 0.4):
    """Mix-cell rows and log latencies of n requests: half short / long completions, ``long_share``
    long prompts (``long_effect`` slower in log units); within-cell log latency normal(mu, sd)."""
    probs = np.array([(1 - long_share) / 2, (1 - long_share) / 2, long_share / 2, long_share / 2])
    counts = rng.multinomial(n, probs)
    rows, ys = [], []
    for (po, co, mu), k in zip(TYPES, counts, strict=True):
        if k:
            y = rng.normal(mu + shift + (long_effect - 0.4) * (po == 12), sd, k)
            rows.append([po, co, float(k), float(y.sum()), float((y * y).sum())])
            ys.append(y)
    return rows, np.concatenate(ys)


def test_mix_estimate_unbiased_under_router_bias_and_variance_matches_simulation():
    rng = np.random.default_rng(1)
    est, var, raw = [], [], []
    for _ in range(2000):
        rc, yc = _cells(rng, 3000, 0.40)  # FP8 gets 25 points more long prompts
        rb, yb = _cells(rng, 600, 0.15)
        e, v, _ = mix_log_diff(rc, rb)
        est.append(e)
        var.append(v)
        raw.append(yc.mean() - yb.mean())
    est, var = np.array(est), np.array(var)
    assert abs(est.mean()) < 3 * est.std() / math.sqrt(est.size)       # no bias from the mix
    assert np.mean(raw) > 0.05                                            # the unadjusted one is biased
    assert 0.9 < var.mean() / est.var() < 1.1                             # stated variance = observed


def test_mix_estimate_sees_a_per_request_slowdown():
    rng = np.random.default_rng(2)
    est = [mix_log_diff(_cells(rng, 3000, 0.40, shift=math.log(1.1))[0], _cells(rng, 600, 0.15)[0])[0]
           for _ in range(300)]
    assert abs(np.mean(est) - math.log(1.1)) < 0.005


def test_mix_estimate_needs_common_cells():
    assert mix_log_diff([[1, 1, 5, 5.0, 6.0]], [[2, 2, 5, 5.0, 6.0]]) is None
    assert mix_log_diff([], []) is None


def _bins(y: np.ndarray) -> list[list[int]]:
    keys, counts = np.unique(np.ceil(y / LOG_G).astype(int), return_counts=True)
    return np.column_stack((keys, counts)).tolist()


def _hist(y: np.ndarray) -> dict:
    return {"relative_accuracy": 0.01, "min_value": 1e-3, "zero_count": 0, "count": int(y.size), "bins": _bins(y)}


def _side(rng, n: int, replicas: int, stall: float = 0.0, mult: float = 10.0, p99: float = 0.0,
          offsets: np.ndarray | None = None):
    """A precision's window: total sketch and per-replica sketches; ``stall``: share of the side's
    requests, all on replica 0, ``mult`` times slower; ``p99``: a tail-only regression on every replica."""
    rep = rng.integers(0, replicas, n)
    y = math.log(800) + 0.35 * rng.normal(size=n)
    if offsets is not None:
        y += offsets[rep]
    if p99:
        u = (np.argsort(np.argsort(y)) + 0.5) / n
        y += np.log1p(p99 * np.clip((u - 0.9) / 0.09, 0, 1))
    if stall:
        on = np.flatnonzero(rep == 0)[: int(stall * n)]
        y[on] += math.log(mult)
    reps = {f"r{i}": {"latency_hist": _hist(y[rep == i]), "cells": []} for i in range(replicas)}
    return {"latency_hist": _hist(y), "replicas": reps}


def test_vectorised_contrast_equals_the_sketch_contrast():
    rng = np.random.default_rng(3)
    side = _side(rng, 3000, 3)
    from watchdog.policy.judge.fleet import _matrix

    ids, x, mat, _, _ = _matrix(side["replicas"])
    c, v = _contrast_rows(x, mat, 0.95)
    for i, rid in enumerate(ids):
        c1, v1 = sketch_log_tail_contrast(side["replicas"][rid]["latency_hist"], 0.95)
        assert c[i] == pytest.approx(c1, abs=1e-9) and v[i] == pytest.approx(v1, rel=1e-9)


def test_a_stalled_replica_is_left_out_and_nothing_else():
    rng = np.random.default_rng(4)
    opts = FleetOptions(replicas="robust")
    offsets = rng.normal(0, 0.02, 8)  # replicas differ a little by themselves
    healthy_drops = sum(bool(clean_side(_side(rng, 6000, 8, offsets=offsets)["replicas"], opts)) for _ in range(300))
    assert healthy_drops <= 1
    for share, mult in ((0.02, 10.0), (0.06, 5.0), (0.005, 20.0)):
        assert clean_side(_side(rng, 6000, 8, stall=share, mult=mult)["replicas"], opts) == ["r0"]
    # a tail regression on every replica: nobody is an outlier
    assert sum(bool(clean_side(_side(rng, 6000, 8, p99=0.3)["replicas"], opts)) for _ in range(100)) <= 1
    # a whole replica 10x slower (its shape unchanged) is a location outlier
    off = np.zeros(8)
    off[0] = math.log(10)
    assert clean_side(_side(rng, 6000, 8, offsets=off)["replicas"], opts) == ["r0"]
    # the overflow and unnamed entries are never left out; one replica alone is never judged
    side = _side(rng, 6000, 8, stall=0.05)
    side["replicas"]["_other"] = side["replicas"].pop("r0")
    assert clean_side(side["replicas"], opts) == []
    assert clean_side({"r0": side["replicas"]["r1"]}, opts) == []


def test_robust_tail_contrast_under_stalls_matches_the_clean_distribution():
    """The window statistic of the latency-p99 rule (tail contrast at 0.95, FP8 - FP16) with a stall
    on one FP8 replica in every window: after leaving the stalled replica out its mean and variance
    are those of stall-free windows, and its stated variance is the observed one."""
    rng = np.random.default_rng(5)
    opts = FleetOptions(replicas="robust")

    def window(stall: float) -> tuple[float, float]:
        c, b = _side(rng, 6000, 8, stall=stall), _side(rng, 1050, 2)
        (hc, _, _), (hb, _, _) = fleet_inputs(c, opts), fleet_inputs(b, opts)
        return quantile_log_diff(hc, hb, 0.99, 0.95, "mean")

    clean = np.array([window(0.0) for _ in range(600)])
    stalled = np.array([window(0.04) for _ in range(600)])
    sd = clean[:, 0].std()
    assert abs(stalled[:, 0].mean() - clean[:, 0].mean()) < 0.25 * sd
    assert 0.8 < stalled[:, 0].var() / clean[:, 0].var() < 1.25
    assert 0.85 < clean[:, 1].mean() / clean[:, 0].var() < 1.15
    assert 0.85 < stalled[:, 1].mean() / stalled[:, 0].var() < 1.2
    # without the replica rule the same stall moves the statistic by many sd
    raw = np.mean([quantile_log_diff(_side(rng, 6000, 8, stall=0.04)["latency_hist"],
                                     _side(rng, 1050, 2)["latency_hist"], 0.99, 0.95, "mean")[0] for _ in range(20)])
    assert raw - clean[:, 0].mean() > 10 * sd


def test_robust_statistic_keeps_the_power_for_a_tail_regression():
    rng = np.random.default_rng(6)
    opts = FleetOptions(replicas="robust")
    shifts = []
    for _ in range(100):
        c, b = _side(rng, 6000, 8, p99=0.10), _side(rng, 1050, 2)
        (hc, _, dc), (hb, _, _) = fleet_inputs(c, opts), fleet_inputs(b, opts)
        assert dc == []
        shifts.append(quantile_log_diff(hc, hb, 0.99, 0.95, "mean")[0])
    assert np.mean(shifts) > 0.06  # the regression's shift of the contrast (~0.076) is all there


# --- deploys and maintenance --------------------------------------------------------------------


def _sig(prec: str, t: int, builds: dict | None = None, maint: bool = False, mu: float = 0.0) -> Signal:
    rng = np.random.default_rng(t * 2 + (prec == "fp8"))
    y = math.log(800) + mu + 0.35 * rng.normal(size=3000)
    detail = {"latency_hist": _hist(y), "events": 3000}
    if builds:
        detail["builds"] = builds
    if maint:
        detail["maintenance"] = True
    return Signal("live", "m", "r", prec, t * 300.0, (t + 1) * 300.0, 3000, {}, None, None, detail)


def test_build_signature_ignores_stray_events():
    assert build_signature(_sig("fp8", 0, {"a": 990, "b": 2})) == "a"
    assert build_signature(_sig("fp8", 0, {"a": 500, "b": 500})) == "a+b"
    assert build_signature(_sig("fp8", 0)) == ""


def test_change_entry_counts_windows_since_the_last_change():
    pool: list[dict] = []
    e = change_entry(pool, _sig("fp8", 0, {"a": 100}), _sig("fp16", 0, {"a": 100}), 4)
    assert e["since"] == 4  # no history: taken as settled
    pool.append(e)
    e = change_entry(pool, _sig("fp8", 1, {"b": 100}), _sig("fp16", 1, {"a": 100}), 4)
    assert e["since"] == 0 and "build change" in e["why"]
    pool.append(e)
    e = change_entry(pool, _sig("fp8", 2, {"b": 100}), _sig("fp16", 2, {"a": 100}), 4)
    assert e["since"] == 1
    pool.append(e)
    e = change_entry(pool, _sig("fp8", 3, {"b": 100}), _sig("fp16", 3, {"a": 50, "b": 50}), 4)
    assert e["since"] == 0 and "mixed" in e["why"]
    e = change_entry(pool, _sig("fp8", 3, {"b": 100}), _sig("fp16", 3, {"b": 100}, maint=True), 4)
    assert e["since"] == 0 and e["why"] == "maintenance"


def test_mark_maintenance_marks_overlapping_live_windows():
    sigs = [_sig("fp8", t) for t in range(4)]
    assert mark_maintenance(sigs, {("*", "r"): [(400.0, 650.0)]}) == 2
    assert [bool(s.detail.get("maintenance")) for s in sigs] == [False, True, True, False]


def _rule(settle: int) -> Rule:
    return Rule(name="lat", metric="latency_p50_ms", min_samples=100,
                judge=Judge(test="quantile", tail=0.0, effect=0.0, alpha=0.001, min_items=100, pool=2, learn=96,
                            settle=settle))


def test_staggered_deploy_is_not_judged_until_both_sides_settled():
    rule = _rule(3)
    pool: list[dict] = []
    statuses = []
    # FP8 moves to build b (+20 % latency) at window 1, FP16 follows at window 3
    for t in range(9):
        b8 = {"b": 3000} if t >= 1 else {"a": 3000}
        b16 = {"b": 3000} if t >= 3 else {"a": 3000}
        v = evaluate_rule(rule, _sig("fp8", t, b8, mu=0.18 if t >= 1 else 0.0),
                          _sig("fp16", t, b16, mu=0.18 if t >= 3 else 0.0), pool, [])
        statuses.append((v.status, "settling" in v.reason))
    assert all(s == ("inconclusive", True) for s in statuses[1:6])  # windows 1-5: not judged
    assert statuses[6][1] is False  # 3 windows after FP16's change: judged again
    assert all(int(e["since"]) > 0 for e in pool)  # the change windows are not pooled


def test_horizon_skips_a_deploys_settling_windows():
    """The sequential test sees the windows the per-window judge sees: a staggered deploy whose
    FP8 side runs a 20 % slower new build for 2 windows before FP16 follows (and a settling time
    after) feeds it nothing; without build names on the events the same windows are fed (and the
    per-window judge fails them: nothing says a deploy is under way)."""
    from watchdog.policy.schema import Horizon

    def run(named: bool) -> tuple[int, list[str]]:
        rule = Rule(name="lat", metric="latency_p50_ms", min_samples=100,
                    judge=Judge(test="quantile", tail=0.0, effect=0.0, alpha=0.001, min_items=100, pool=2, learn=96,
                                settle=3, horizon=Horizon(tolerance=0.05, alpha=0.0005, restart=6)))
        pool: list[dict] = []
        horizon: dict = {}
        reasons = []
        for t in range(8):
            b8 = {"b": 3000} if t >= 1 else {"a": 3000}
            b16 = {"b": 3000} if t >= 3 else {"a": 3000}
            v = evaluate_rule(rule, _sig("fp8", t, b8 if named else None, mu=0.18 if t >= 1 else 0.0),
                              _sig("fp16", t, b16 if named else None, mu=0.18 if t >= 3 else 0.0), pool, [], horizon)
            reasons.append(v.reason)
        return int(horizon["seq"]["count"]), reasons

    fed, reasons = run(named=True)
    assert fed == 8 - 5  # windows 1-5 (the change, FP16's change 2 windows later, 3 settling) are not fed
    assert not any(": fail" in r for r in reasons)
    fed, reasons = run(named=False)
    assert fed == 8 and any(": fail" in r for r in reasons)  # unnamed: FP8 alone 20 % slower for 2 windows


def test_settle_is_validated():
    with pytest.raises(ValueError):
        Judge(test="paired", effect=0.0, settle=3)
    with pytest.raises(ValueError):
        Judge(test="quantile", tail=0.95, effect=0.0, adjust="mix")
    Judge(test="quantile", tail=0.0, effect=0.0, adjust="mix", replicas="robust", settle=6)


def test_maintenance_spans_from_key_values():
    from watchdog.core.keys import Keys
    from watchdog.policy.changes import maintenance_spans

    assert Keys().maintenance("m", "a:b") == "llmwd:maintenance:m:a%3Ab"
    spans = maintenance_spans({("m", "r"): '{"start": 10, "until": 70, "reason": "deploy"}', ("m", "x"): "nope",
                               ("m", "y"): b'{"start": 5}'})
    assert spans == {("m", "r"): [(10.0, 70.0)]}


def test_mix_shift_is_zero_for_equal_mixes_and_sees_router_bias():
    from watchdog.policy.judge.fleet import mix_shift

    rng = np.random.default_rng(8)
    draws = [mix_shift(_cells(rng, 3000, 0.3, shift=0.2)[0], _cells(rng, 600, 0.3)[0]) for _ in range(300)]
    same = np.array([m for m, _ in draws])  # type: ignore[misc]
    assert abs(same.mean()) < 0.003 and same.std() < 0.02  # a speed difference is not a mix shift
    # the stated variance is the shift's spread when both precisions draw from one mix (within 15 %)
    stated = math.sqrt(float(np.mean([v for _, v in draws])))  # type: ignore[misc]
    assert same.std() == pytest.approx(stated, rel=0.15)
    biased = np.array([mix_shift(_cells(rng, 3000, 0.4)[0], _cells(rng, 600, 0.15)[0])[0]  # type: ignore[index]
                       for _ in range(100)])
    assert biased.min() > 0.03  # 25 points more long prompts (+0.4 log each): ~0.05


def test_a_wide_mix_drawn_twice_is_comparable_and_a_small_bias_over_the_pool_is_not():
    """The mix gate counts a shift only beyond its own sampling noise: a wide mix (half the requests
    long, +1.5 log each) at 500 FP16 requests moves the shift by ~0.07 per window by chance, past the
    plain 0.03; a 5-point bias (~+0.075) shows over a pool of 5 windows where one window mostly hides it."""
    rule = Rule(name="p99", metric="latency_p99_ms", min_samples=100,
                judge=Judge(test="quantile", tail=0.95, relative_to="mean", null_model="sampling", effect=0.0,
                            alpha=0.001, min_items=100, pool=5, learn=96, max_mix_shift=0.03))
    rng = np.random.default_rng(12)

    def sig(prec: str, long_share: float, t: int) -> Signal:
        rows, y = _cells(rng, 3000 if prec == "fp8" else 500, long_share, long_effect=1.5)
        d = {"latency_hist": _hist(y), "latency_mix": {"cells": rows}}
        return Signal("live", "m", "r", prec, 300.0 * t, 300.0 * (t + 1), y.size, {}, None, None, d)

    pool: list[dict] = []
    reasons = [evaluate_rule(rule, sig("fp8", 0.5, t), sig("fp16", 0.5, t), pool, []).reason for t in range(40)]
    assert sum("request mixes differ" in r for r in reasons) <= 1, reasons
    pool = []
    reasons = [evaluate_rule(rule, sig("fp8", 0.55, t), sig("fp16", 0.5, t), pool, []).reason for t in range(40)]
    assert sum("request mixes differ" in r for r in reasons[5:]) >= 28, reasons
    assert sum("request mixes differ over the pool" in r for r in reasons[5:]) >= 15, reasons


def test_shape_rule_is_not_judged_across_different_mixes():
    rule = Rule(name="p99", metric="latency_p99_ms", min_samples=100,
                judge=Judge(test="quantile", tail=0.95, relative_to="mean", null_model="sampling", effect=0.0,
                            alpha=0.001, min_items=100, pool=2, learn=96, max_mix_shift=0.03))
    rng = np.random.default_rng(9)

    def sig(prec: str, long_share: float) -> Signal:
        rows, y = _cells(rng, 3000 if prec == "fp8" else 600, long_share)
        d = {"latency_hist": _hist(y), "latency_mix": {"cells": rows}}
        return Signal("live", "m", "r", prec, 0.0, 300.0, y.size, {}, None, None, d)

    v = evaluate_rule(rule, sig("fp8", 0.4), sig("fp16", 0.15), [], [])
    assert v.status == "inconclusive" and "request mixes differ" in v.reason
    v = evaluate_rule(rule, sig("fp8", 0.3), sig("fp16", 0.3), [], [])
    assert "request mixes" not in v.reason


def _side_multi(rng, n: int, replicas: int, stalled: int, share: float, mult: float = 20.0):
    """As ``_side``, with ``stalled`` replicas (r0, r1, ...) each stalling ``share`` of the side's requests."""
    rep = rng.integers(0, replicas, n)
    y = math.log(800) + 0.35 * rng.normal(size=n)
    for k in range(stalled):
        y[np.flatnonzero(rep == k)[: int(share * n)]] += math.log(mult)
    reps = {f"r{i}": {"latency_hist": _hist(y[rep == i]), "cells": []} for i in range(replicas)}
    return {"latency_hist": _hist(y), "replicas": reps}


def test_more_stalled_replicas_than_may_be_left_out_make_the_window_not_comparable():
    """Two of 8 FP8 replicas stalling together (GC pauses, x20, 2 % of the side's requests each): one may
    be left out, the other would carry the tail contrast to a rollback-sized shift (bench/outside_check.py
    ``stall-2of8``: 3 false rollbacks through latency-p99 in 240 windows). The window is not judged."""
    rng = np.random.default_rng(11)
    rule = Rule(name="p99", metric="latency_p99_ms", min_samples=100,
                judge=Judge(test="quantile", tail=0.95, relative_to="mean", null_model="sampling", effect=0.0,
                            alpha=0.001, min_items=100, pool=1, learn=96, replicas="robust"))

    def sig(prec: str, side: dict) -> Signal:
        return Signal("live", "m", "r", prec, 0.0, 300.0, side["latency_hist"]["count"], {}, None, None, side)

    v = evaluate_rule(rule, sig("fp8", _side_multi(rng, 6000, 8, 2, 0.02)), sig("fp16", _side(rng, 1050, 2)), [], [])
    assert v.status == "inconclusive" and "replicas stand out" in v.reason
    v = evaluate_rule(rule, sig("fp8", _side_multi(rng, 6000, 8, 1, 0.02)), sig("fp16", _side(rng, 1050, 2)), [], [])
    assert "replicas stand out" not in v.reason
    from watchdog.policy.judge.fleet import outlier_replicas

    opts = FleetOptions(replicas="robust")
    dropped, excess = outlier_replicas(_side_multi(rng, 6000, 8, 2, 0.02)["replicas"], opts)
    assert len(dropped) == 1 and excess
    assert outlier_replicas(_side_multi(rng, 6000, 8, 1, 0.02)["replicas"], opts) == (["r0"], False)
    # healthy windows and a tail regression on every replica never make a window "not comparable"
    assert sum(outlier_replicas(_side(rng, 6000, 8)["replicas"], opts)[1] for _ in range(100)) == 0
    assert sum(outlier_replicas(_side(rng, 6000, 8, p99=0.3)["replicas"], opts)[1] for _ in range(100)) == 0


def test_after_settling_the_level_is_compared_at_its_distance():
    """The windows judged after a deploy's settling time lie several windows after the level learned
    before the change: the judgement says how far (``gap``, the residual model's lag); between
    deploys the pool follows the learned windows directly (gap 0)."""
    rule = _rule(3)
    pool: list[dict] = []
    null: list[dict] = []
    gaps = []
    for t in range(40):
        b = {"a": 3000} if t < 30 else {"b": 3000}
        v = evaluate_rule(rule, _sig("fp8", t, b), _sig("fp16", t, b), pool, null)
        est = (v.judgement or {}).get("detail", {}).get("window_estimate")
        if isinstance(est, list) and v.status in ("pass", "inconclusive") and t < 30:
            null.append({"end": v.end, "e": est[0], "v": est[1]})
        gaps.append((v.judgement or {}).get("detail", {}).get("gap"))
    assert gaps[29] == 0
    assert gaps[34] is not None and gaps[34] >= 3  # change at 30, settled at 33, pool from 32-33
