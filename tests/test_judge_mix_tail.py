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


# --- the list formulation gives the numpy formulation's bits -----------------------------------------------


def _numpy_tails(mix: dict) -> tuple[dict, float] | None:
    """``fleet._tails_now`` as it was written with numpy (before 2026-12-07): the reference for the bits."""
    width = float(mix.get("tail_width") or 0.0)
    if not width > 0:
        return None
    out = {}
    for row in mix["tails"]:
        arr = np.asarray(row[2], dtype=float).reshape(-1, 2)
        arr = arr[arr[:, 1] > 0]
        if arr.size:
            out[(int(row[0]), int(row[1]))] = (arr[:, 0], arr[:, 1])
    return (out, width) if out else None


def _numpy_mixture_contrast(x, mats, n, w, p):
    g = (w / n) @ mats
    need = 1.0 - p
    above = np.cumsum(g[::-1])[::-1]
    t = np.clip(need - (above - g), 0.0, g)
    tail = float((t * x).sum() / need)
    first = int(np.argmax(t > 0))
    q = float(x[first])
    mean = float((g * x).sum())
    frac = np.divide(t, g, out=np.zeros_like(t), where=g > 0)
    infl = frac * (x - q) / need + q - tail - (x - mean)
    s1 = mats @ infl
    ss = mats @ (infl * infl) - s1 * s1 / n
    ss = np.maximum(ss, 0.0)
    multi = n >= 2
    pooled = float(ss[multi].sum() / (n[multi] - 1).sum()) if multi.any() else float((g * infl * infl).sum())
    s2 = np.where(multi, ss / np.maximum(n - 1, 1.0), pooled)
    return tail - mean, float((w * w * s2 / n).sum())


def _numpy_mix_tail_contrast(cand_mix: dict, base_mix: dict, p: float):
    """``fleet._mix_tail_contrast`` as it was written with numpy (before 2026-12-07)."""
    ta, tb = _numpy_tails(cand_mix), _numpy_tails(base_mix)
    if ta is None or tb is None or ta[1] != tb[1] or not 0.0 < p < 1.0:
        return None
    (a, width), (b, _) = ta, tb
    common = sorted(a.keys() & b.keys())
    if not common:
        return None
    keys = np.unique(np.concatenate([a[c][0] for c in common] + [b[c][0] for c in common]))
    x = (keys - 0.5) * width
    side = []
    for cells in (a, b):
        mats = np.zeros((len(common), len(keys)))
        for i, c in enumerate(common):
            mats[i, np.searchsorted(keys, cells[c][0])] = cells[c][1]
        side.append((mats, mats.sum(axis=1)))
    na, nb = side[0][1], side[1][1]
    h = na * nb / (na + nb)
    w = h / h.sum()
    (ca, va), (cb, vb) = (_numpy_mixture_contrast(x, m, n, w, p) for m, n in side)
    tot_a = sum(float(v[1].sum()) for v in a.values())
    tot_b = sum(float(v[1].sum()) for v in b.values())
    return ca - cb, va + vb, {"cells": len(common), "support": [float(na.sum()) / tot_a, float(nb.sum()) / tot_b],
                              "effective_n": float(h.sum())}


def _bits(v):
    """A result with every float as its bit pattern (so -0.0 != 0.0 and NaN == NaN)."""
    import struct

    if isinstance(v, float):
        return struct.pack("<d", v)
    if isinstance(v, dict):
        return {k: _bits(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_bits(x) for x in v]
    return v


def _random_mix(rng: np.random.Generator, cells: list[tuple[int, int]]) -> dict:
    tails = []
    for po, co in cells:
        m = int(rng.choice([1, 1, 2, 3, 5, 9, 20, 64, 150]))
        lo = int(rng.integers(-40, 160))
        idx = sorted({int(i) for i in lo + rng.integers(0, max(m, 2) * 2, size=m)})
        # mostly ones (a light window), sometimes many requests, now and then a zero count
        cnt = [int(rng.choice([0, 1, 1, 1, 2, 3, 7, 40, 5000])) for _ in idx]
        tails.append([po, co, [[i, c] for i, c in zip(idx, cnt, strict=True)]])
    return {"cells": [], "tail_width": TAIL_WIDTH, "tails": tails}


def test_the_list_formulation_gives_the_numpy_formulations_bits():
    """``mix_tail_contrast`` adds and picks as numpy did (pairwise sums, running sums, clip, maximum; only its
    matrix-vector products are numpy): every number of 3,000 random window pairs - one to 30 cells, one
    to 150 buckets a cell, counts of 0 to 5,000, p from 0.5 to 0.999 - has the numpy formulation's bits,
    and so has ``within_tail_contrast`` of every window."""
    from watchdog.policy.judge import fleet

    rng = np.random.default_rng(7)
    grid = [(po, co) for po in range(4, 14) for co in range(1, 10)]
    seen = 0
    for k in range(3000):
        n_cells = int(rng.choice([1, 2, 3, 5, 8, 12, 30]))
        pick = [grid[i] for i in rng.choice(len(grid), size=2 * n_cells, replace=True)]
        a = _random_mix(rng, sorted(set(pick[:n_cells])))
        b = _random_mix(rng, sorted(set(pick[n_cells // 2:n_cells // 2 + n_cells])))
        p = float(rng.choice([0.5, 0.9, 0.95, 0.95, 0.99, 0.999]))
        got, want = fleet.mix_tail_contrast(a, b, p), _numpy_mix_tail_contrast(a, b, p)
        assert _bits(got) == _bits(want), (k, got, want)
        seen += got is not None
        for mix in (a, b):
            t_new, t_old = fleet._tails_now(mix), _numpy_tails(mix)
            assert (t_new is None) == (t_old is None)
            if t_new is not None:
                assert {c: (list(i), list(n)) for c, (i, n) in t_old[0].items()} == t_new[0]
    assert seen > 2000
    for xs in ([], [-0.0], [0.1] * 7, [0.1] * 8, list(rng.normal(size=300)), list(rng.lognormal(0, 4, size=1000))):
        assert _bits(fleet._fsum(xs)) == _bits(float(np.asarray(xs, dtype=float).sum()))
