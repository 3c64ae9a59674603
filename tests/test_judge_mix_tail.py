"""The tail contrast net of the request mix (``judge/fleet.py`` ``mix_tail_contrast``, ``adjust: mix`` on a
``tail: p, relative_to: mean`` rule): its variance against simulation, a router bias on a wide mix, a p99
regression on a wide mix, the fallbacks, and the windows' per-cell tail histograms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from watchdog.core.signals import Signal
from watchdog.policy.evaluate import evaluate_rule
from watchdog.policy.judge.fleet import FleetOptions, fleet_side, mix_tail_contrast
from watchdog.policy.judge.live import quantile_log_diff
from watchdog.policy.pooling import window_difference
from watchdog.policy.schema import Judge, Rule
from watchdog.windows.fleet import MAX_TAIL_BUCKETS, TAIL_WIDTH, FleetStats

LOG_G = math.log(1.01 / 0.99)


def _octave(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, np.floor(np.log2(np.maximum(x, 1))).astype(int) + 1, 0)


def _requests(rng: np.random.Generator, n: int, long_c: float = 0.20, p99: float = 0.0
              ) -> tuple[np.ndarray, np.ndarray]:
    """(log latency, mix cell) of n requests from a wide mix (the outside check's: 25 % long prompts,
    ``long_c`` long answers, latency linear in the tokens times lognormal(0.25) noise); with ``p99`` the
    quantile function is stretched from p90 to ``1 + p99`` at p99 by the request's rank (the median stays)."""
    long_p = rng.random(n) < 0.25
    long_a = rng.random(n) < long_c
    p_tok = np.maximum(np.round(np.exp(np.where(long_p, math.log(2500), math.log(250)) + 0.6 * rng.normal(size=n))), 1)
    c_tok = np.clip(np.round(np.exp(np.where(long_a, math.log(700), math.log(150)) + 0.5 * rng.normal(size=n))), 1, 8000)
    lat = (60 + 0.2 * p_tok + 22 * c_tok * (1 + p_tok / 10000)) * np.exp(0.25 * rng.normal(size=n))
    if p99:
        u = (np.argsort(np.argsort(lat)) + 0.5) / n
        lat *= 1.0 + p99 * np.clip((u - 0.9) / 0.09, 0.0, 1.0)
    return np.log(lat), (_octave(p_tok.astype(int)) << 6) | _octave(c_tok.astype(int))


def _detail(y: np.ndarray, cell: np.ndarray) -> dict:
    """A window's latency sketch and ``latency_mix`` (cells and tails) as ``FleetStats.detail`` writes them."""
    idx, cnt = np.unique(np.ceil(y / LOG_G).astype(int), return_counts=True)
    hist = {"relative_accuracy": 0.01, "min_value": 1e-3, "zero_count": 0, "count": int(y.size),
            "bins": [[int(i), int(c)] for i, c in zip(idx, cnt, strict=True)]}
    rows, tails = [], []
    b = np.ceil(y / TAIL_WIDTH).astype(int)
    for c in np.unique(cell):
        yc = y[cell == c]
        rows.append([int(c) >> 6, int(c) & 63, float(yc.size), float(yc.sum()), float((yc * yc).sum())])
        ks, cs = np.unique(b[cell == c], return_counts=True)
        tails.append([int(c) >> 6, int(c) & 63, [[int(k), int(n)] for k, n in zip(ks, cs, strict=True)]])
    return {"latency_hist": hist, "latency_mix": {"cells": rows, "tail_width": TAIL_WIDTH, "tails": tails}}


def _pair(rng: np.random.Generator, n8: int, n16: int, long8: float = 0.20, p99: float = 0.0) -> tuple[dict, dict]:
    return _detail(*_requests(rng, n8, long8, p99)), _detail(*_requests(rng, n16))


def _plain(d8: dict, d16: dict) -> tuple[float, float]:
    out = quantile_log_diff(d8["latency_hist"], d16["latency_hist"], 0.99, 0.95, "mean")
    assert out is not None
    return out


def _adjusted(d8: dict, d16: dict) -> tuple[float, float]:
    out = mix_tail_contrast(d8["latency_mix"], d16["latency_mix"], 0.95)
    assert out is not None
    return out[0], out[1]


def test_stated_variance_matches_simulation_and_is_below_the_plain_contrasts_on_a_wide_mix():
    """600 healthy windows of the wide mix (3,000 FP8 / 600 FP16 requests): the standardised contrast's
    stated variance is its observed one within 15 %; the multinomial noise of which requests are long is
    gone, so it is well below the plain contrast's (measured: ~0.45 of its variance)."""
    rng = np.random.default_rng(21)
    adj, plain = [], []
    for _ in range(600):
        d8, d16 = _pair(rng, 3000, 600)
        adj.append(_adjusted(d8, d16))
        plain.append(_plain(d8, d16))
    e, v = np.array(adj).T
    pe, pv = np.array(plain).T
    assert abs(e.mean()) < 3 * e.std() / math.sqrt(e.size)
    assert v.mean() / e.var() == pytest.approx(1.0, abs=0.15)
    assert pv.mean() / pe.var() == pytest.approx(1.0, abs=0.15)
    assert e.var() < 0.7 * pe.var()


def test_a_router_bias_on_a_wide_mix_does_not_move_it():
    """FP8 gets 25 points more long answers: the plain contrast moves by ~1 sd per window (on a pool
    of 5 that is ~2 sd), the standardised one stays within its own standard error of 0."""
    rng = np.random.default_rng(22)
    adj, plain = [], []
    for _ in range(300):
        d8, d16 = _pair(rng, 3000, 600, long8=0.45)
        adj.append(_adjusted(d8, d16)[0])
        plain.append(_plain(d8, d16)[0])
    adj_a, plain_a = np.array(adj), np.array(plain)
    assert abs(adj_a.mean()) < 3 * adj_a.std() / math.sqrt(adj_a.size)
    assert abs(plain_a.mean()) > 0.5 * plain_a.std()


def _rule(adjust: str | None) -> Rule:
    return Rule(name="latency-p99", metric="latency_p99_ms", min_samples=300,
                judge=Judge(test="quantile", tail=0.95, relative_to="mean", null_model="sampling", effect=0.0,
                            alpha=0.001, min_items=300, pool=5, learn=96, recent=48, level_cap=0.05,
                            between_sd=0.02, adjust=adjust, replicas="robust", max_mix_shift=0.03))  # type: ignore[arg-type]


def _sig(prec: str, t: int, d: dict) -> Signal:
    return Signal("live", "m", "r", prec, 300.0 * t, 300.0 * (t + 1), d["latency_hist"]["count"], {}, None, None, d)


def _first_fail(rule: Rule, seed: int, n8: int, n16: int, onset: int = 60, within: int = 5) -> int | None:
    """The window after ``onset`` in which the rule first fails (None if not within ``within``)."""
    rng = np.random.default_rng(seed)
    pool: list[dict] = []
    null: list[dict] = []
    for t in range(onset + within):
        d8, d16 = _pair(rng, n8, n16, p99=0.10 if t >= onset else 0.0)
        v = evaluate_rule(rule, _sig("fp8", t, d8), _sig("fp16", t, d16), pool, null)
        if t >= onset and v.status == "fail":
            return t - onset
        assert v.status != "fail", v.reason
        est = (v.judgement or {}).get("detail", {}).get("window_estimate")
        if isinstance(est, list) and t < onset:  # the engine learns every healthy window judged
            null.append({"end": v.end, "e": est[0], "v": est[1]})
    return None


def test_a_p99_regression_on_a_wide_mix_is_caught_net_of_the_mix():
    """+10 % p99 (median unchanged) on FP8 over the wide mix at 6,000 / 3,000 requests per window (alpha
    1e-3, 60 healthy windows learned): judged net of the mix the rule fails within 5 windows on each of 4
    routes; the plain contrast, whose noise on this mix is mostly the long answers' count, on 1 of them."""
    caught = [_first_fail(_rule("mix"), s, 6000, 3000) for s in (31, 32, 33, 34)]
    assert all(c is not None for c in caught), caught
    plain = [_first_fail(_rule(None), s, 6000, 3000) for s in (31, 32, 33, 34)]
    assert sum(c is None for c in plain) >= 2, plain


def test_without_tails_or_with_a_replica_left_out_the_plain_contrast_is_judged():
    rng = np.random.default_rng(23)
    d8, d16 = _pair(rng, 3000, 600)
    rule = _rule("mix")
    both = window_difference(rule, _sig("fp8", 0, d8), _sig("fp16", 0, d16))
    assert both == pytest.approx(_adjusted(d8, d16))
    bare8 = {**d8, "latency_mix": {"cells": d8["latency_mix"]["cells"]}}  # a window from before the tails
    assert window_difference(rule, _sig("fp8", 0, bare8), _sig("fp16", 0, d16)) == pytest.approx(_plain(d8, d16))
    # a replica left out: the tails are not kept per replica, so the plain contrast without it
    y, cell = _requests(rng, 3000)
    y = y.copy()
    rep = np.arange(y.size) % 8
    y[(rep == 3) & (np.arange(y.size) < 300)] += math.log(20.0)  # replica 3 stalls
    d8 = _detail(y, cell)
    d8["replicas"] = {f"r{i}": _detail(y[rep == i], cell[rep == i]) for i in range(8)}
    for r in d8["replicas"].values():
        r["cells"] = r.pop("latency_mix")["cells"]
    out = window_difference(rule, _sig("fp8", 0, d8), _sig("fp16", 0, d16))
    assert d8.get("replicas_left_out", {}).get("latency-p99") == [["r3"], []]
    cleaned = fleet_side(d8, FleetOptions("mix", "robust"))[0]
    assert cleaned is not None
    # the plain tail contrast without the stalled replica - not the mix-adjusted mean (a bug once)
    assert out == pytest.approx(quantile_log_diff(cleaned, d16["latency_hist"], 0.99, 0.95, "mean"))


def test_schema_accepts_mix_adjustment_of_the_tail_contrast_only():
    Judge(test="quantile", effect=0.0, tail=0.95, relative_to="mean", adjust="mix")
    Judge(test="quantile", effect=0.0, tail=0.0, adjust="mix")
    with pytest.raises(ValueError):
        Judge(test="quantile", effect=0.0, tail=0.95, adjust="mix")  # the tail mean alone is not a shape


def test_windows_keep_bounded_per_cell_tails_that_survive_a_checkpoint():
    f = FleetStats()
    rng = np.random.default_rng(24)
    lat = np.exp(rng.normal(6.0, 2.0, 3000))  # a spread far beyond MAX_TAIL_BUCKETS buckets
    f.buf = [(float(x), 300, 100, "a") for x in lat]  # the buffer is the empty tuple until a request comes
    f.buf.append((0.0, 300, 100, "a"))  # no log: not in the cells, nor in the tails
    d = f.detail()["latency_mix"]
    assert d["tail_width"] == TAIL_WIDTH
    ((po, co, bins),) = d["tails"]
    assert (po, co) == ((300).bit_length(), (100).bit_length())
    assert len(bins) == MAX_TAIL_BUCKETS
    assert sum(c for _, c in bins) == 3000 == d["cells"][0][2]
    top = max(math.ceil(math.log(x) / TAIL_WIDTH) for x in lat)
    assert bins[-1][0] == top  # the high tail keeps its buckets; the lowest are folded
    g = FleetStats.from_export(f.export())
    assert g.tails == f.tails and g.cells == f.cells
    assert FleetStats.from_export({"cells": [], "rep": {}, "bld": {}}).tails == {}  # an older checkpoint
    assert f.copy().tails == f.tails


def test_tail_packing_is_exact_for_any_count_and_index():
    from watchdog.windows.fleet import pack_tails, unpack_tails

    for tails in ({}, {5: {-14000: 1}}, {0: {1: 255}, 4095: {-3: 70_000, 2: 1, 14000: 65_536}},
                  {k: {b: b * b + 1 for b in range(-32, 32)} for k in range(31 * 64)}):
        assert unpack_tails(pack_tails(tails)) == tails
