"""Backtest of rollback decisions: this judge (+ hysteresis) vs Flagger- and Kayenta-style baselines.

Simulates, with a seed, three kinds of evidence with realistic FP8 noise and injected regressions:

* golden   200-item replays; per item ROUGE-L in [0, 1]; most items identical, a per-replay
           fraction (5-35 %) flips with heavy-tailed (Student t3) score changes and a slight
           FP8 bias (mean drift about -0.002); regressions degrade ~25 % of items by an
           exponential amount so the mean drift is -0.01/-0.02/-0.03/-0.05 before clipping;
* latency  live windows with 50-3000 requests per precision (diurnal), lognormal latencies with
           a 3 % Pareto tail and a window load factor shared by both precisions; regressions
           multiply candidate latency by 1.05/1.10/1.20;
* errors   live windows with 200-20000 requests per precision, base error rate ~1 % varying
           by window (shared); regressions add 0.5/1/2 points to the candidate.

For each, it reports false rollbacks per 10,000 windows without regression (long streams; a
detector restarts after each rollback), and for each regression size the power (fraction of
runs rolled back within the scenario's horizon H of the regression's start) and the mean delay
(windows until rollback, among runs rolled back within 6). Power runs start with ``LEAD`` clean
windows, so detectors that pool several windows see the clean past diluting the regression, as
they would in production. Baselines are tuned fairly: every configuration of a grid (pooling
included) runs on the same data, and the one with the fewest false rollbacks among those whose
power at the reference size is at least ours (minus 0.005 of Monte-Carlo slack) is reported.
Our own rules are fixed in ``GOLDEN_RULES``/``LATENCY_RULES``/``ERROR_RULES`` (chosen on another
seed, not tuned here); the extra "judge ..." rows show the alternatives and the previous rule.

Run:  .venv/bin/python -m bench.decisions            (docs/JUDGE.md has the table and timing)
      .venv/bin/python -m bench.decisions --quick    (smaller, for a smoke test)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from bench import baselines as bl
from watchdog import judge_stats as st
from watchdog.hysteresis import Hysteresis, HysteresisConfig, initial_state

H_MAX = 6
#: clean windows before the regression starts in every power run: as many as the longest pool
#: looks back, so pooled detectors see the clean past diluting a fresh regression
LEAD = {"golden": 1, "latency": 2, "errors": 2}
GAMMA = 1.01 / 0.99  # the sketch's gamma at 1 % relative accuracy
KAYENTA_BUCKETS = 60
CHUNK_STREAMS = 200  # null streams generated at a time (bounds memory)


@dataclass
class Sizes:
    golden_null_streams: int
    live_null_streams: int
    stream_len: int
    power_runs: int
    golden_power_runs: int


@dataclass
class Result:
    scenario: str
    detector: str
    config: str
    false_per_10k: float
    null_windows: int
    null_rollbacks: int
    power: dict[float, float]
    delay: dict[float, float]


@dataclass(frozen=True)
class Rule:
    """One of our rules: pool ``pool`` windows (golden: replays), interval level(s), effect
    threshold ``delta`` (harm units), hysteresis ``trip``. ``alphas`` are the two-sided levels of
    the looks (golden: latest replay, then the per-item average of the latest two)."""

    name: str
    delta: float
    alphas: tuple[float, ...]
    pool: int = 1
    trip: int = 1

    def label(self, scenario: str) -> str:
        if scenario == "golden":
            looks = (f"latest replay at {1 - self.alphas[0]:.4g}, per-item mean of latest 2 at "
                     f"{1 - self.alphas[1]:.4g}" if len(self.alphas) == 2 else f"each look at {1 - self.alphas[0]:.4g}")
            return f"paired bootstrap CI, {looks}; fail if CI beyond -{self.delta}, trip {self.trip}"
        what = ("MW/Hodges-Lehmann ratio CI on sketch buckets" if scenario == "latency"
                else "Newcombe CI of rate difference")
        thr = f"+{self.delta:.0%}" if scenario == "latency" else f"+{self.delta * 100:.2g} pts"
        return (f"{what}, {1 - self.alphas[0]:.4g} level, pool of last {self.pool} window(s), "
                f"fail if CI beyond {thr}, trip {self.trip}")


# alpha 0.01 (one-sided 0.005 at the threshold) spent 10 % on the latest replay, 90 % on the pool
GOLDEN_RULES = [
    Rule("judge+hysteresis", 0.0075, (0.001, 0.009)),
    Rule("judge: same spending, delta 0.01", 0.01, (0.001, 0.009)),
    Rule("judge: previous rule", 0.01, (0.01, 0.01)),
]
LATENCY_RULES = [
    Rule("judge+hysteresis", 0.05, (0.01,), pool=3, trip=1),
    Rule("judge: previous rule (single window)", 0.05, (0.01,), pool=1, trip=2),
]
ERROR_RULES = [
    Rule("judge+hysteresis", 0.0025, (0.005,), pool=3, trip=1),
    Rule("judge: previous rule (single window)", 0.0025, (0.01,), pool=1, trip=2),
]


# --- stream logic shared by the detectors -------------------------------------------------------


def hysteresis_rollbacks(status: np.ndarray, cfg: HysteresisConfig, interval_s: float = 600.0, *,
                         start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Run the real hysteresis machine over verdict codes (runs x windows). After a rollback the
    run restarts in candidate mode (as if an operator rolled forward) so every window counts.
    Returns (rollbacks per run, first rollback at or after ``start`` or -1). Runs without any
    fail verdict cannot trip and are skipped."""
    names = st.STATUS_NAMES
    runs, windows = status.shape
    hy = Hysteresis(cfg)
    n_roll = np.zeros(runs, dtype=np.int64)
    first = np.full(runs, -1, dtype=np.int64)
    t0 = 1_800_000_000.0
    for r in np.flatnonzero((status == st.FAIL).any(axis=1)):
        state = initial_state(t0 - 86_400.0)
        row = status[r]
        for w in range(windows):
            state, tr = hy.step(state, names[row[w]], t0 + w * interval_s)
            if tr is not None and tr.kind == "rollback":
                n_roll[r] += 1
                if first[r] < 0 and w >= start:
                    first[r] = w
                state = initial_state(t0 + w * interval_s - 86_400.0)
    return n_roll, first


def immediate_rollbacks(failed: np.ndarray, *, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    f = failed[:, start:]
    first = np.where(f.any(axis=1), f.argmax(axis=1) + start, -1)
    return failed.sum(axis=1), first


Decider = Callable[..., tuple[np.ndarray, np.ndarray]]
Candidate = tuple[str, np.ndarray, dict[float, np.ndarray], Decider]


def evaluate(null_fail: np.ndarray, power_fail: dict[float, np.ndarray], decide: Decider, horizon: int,
             lead: int) -> tuple[float, int, int, dict[float, float], dict[float, float]]:
    n_roll, _ = decide(null_fail)
    total = int(n_roll.sum())
    windows = null_fail.shape[0] * null_fail.shape[1]
    power: dict[float, float] = {}
    delay: dict[float, float] = {}
    for size, fails in power_fail.items():
        _, first = decide(fails, start=lead)
        after = np.where(first >= 0, first - lead, -1)
        power[size] = float(((after >= 0) & (after < horizon)).mean())
        hit = after[after >= 0]
        delay[size] = float(hit.mean() + 1) if hit.size else math.nan
    return total / windows * 1e4, windows, total, power, delay


def tune(name: str, scenario: str, candidates: list[Candidate], horizon: int, ref: float,
         target_power: float) -> Result:
    """Pick the configuration with the fewest false rollbacks among those at least as powerful as
    ours at the reference size; if none is, the most powerful one (flagged in its config)."""
    evaluated = []
    for label, null_fail, power_fail, decide in candidates:
        fr, nw, nr, pw, dl = evaluate(null_fail, power_fail, decide, horizon, LEAD[scenario])
        evaluated.append((label, fr, nw, nr, pw, dl))
    ok = [e for e in evaluated if e[4][ref] >= target_power - 0.005]
    if ok:
        best = min(ok, key=lambda e: (e[1], -e[4][ref]))
        label = best[0]
    else:
        best = max(evaluated, key=lambda e: (e[4][ref], -e[1]))
        label = best[0] + " (max power < ours)"
    return Result(scenario, name, label, best[1], best[2], best[3], best[4], best[5])


def ours(scenario: str, rules: list[Rule], null: dict[Rule, np.ndarray], power: dict[Rule, dict[float, np.ndarray]],
         horizon: int, ref: float) -> list[Result]:
    out = []
    for rule in rules:
        cfg = HysteresisConfig(trip_after=rule.trip, restore_after=3, cooldown_s=3600, min_dwell_s=0)
        out.append(tune(rule.name, scenario, [(rule.label(scenario), null[rule], power[rule],
                                                lambda s, cfg=cfg, **kw: hysteresis_rollbacks(s, cfg, **kw))],
                        horizon, ref, 0.0))
    return out


def rolling_sum(a: np.ndarray, k: int) -> np.ndarray:
    """Sum over the last ``k`` windows (axis 1), fewer at the start of a stream."""
    cs = np.cumsum(a, axis=1)
    if k > 1 and a.shape[1] > k:
        cs[:, k:] -= cs[:, :-k].copy()
    return cs


def rolling_concat(a: np.ndarray, k: int) -> np.ndarray:
    """(runs, windows, points) -> (runs, windows, k * points): the points of the last k windows,
    NaN where the stream has not started yet."""
    if k == 1:
        return a
    pad = np.full((a.shape[0], k - 1) + a.shape[2:], np.nan)
    p = np.concatenate([pad, a], axis=1)
    return np.concatenate([p[:, j : j + a.shape[1]] for j in range(k)], axis=2)


def flagger_grid(label: str, null_stat: np.ndarray, power_stat: dict[float, np.ndarray], thresholds: list[float],
                 above: bool) -> list[Candidate]:
    out: list[Candidate] = []
    for t in thresholds:
        for ft in (1, 2, 3):
            fc = bl.FlaggerConfig(failure_threshold=ft)
            cmp = (lambda v, t=t: v > t) if above else (lambda v, t=t: v < t)
            out.append((label.format(t=t, ft=ft), cmp(null_stat), {s: cmp(v) for s, v in power_stat.items()},
                        lambda f, fc=fc, **kw: bl.flagger_rollbacks(f, fc, **kw)))
    return out


def null_chunks(streams: int) -> Iterator[int]:
    for s in range(0, streams, CHUNK_STREAMS):
        yield min(CHUNK_STREAMS, streams - s)


def stack(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# --- golden replays -----------------------------------------------------------------------------

GOLDEN_SIZES = [-0.01, -0.02, -0.03, -0.05]
GOLDEN_POOLS = (1, 2)


def gen_golden(rng: np.random.Generator, runs: int, windows: int, size: float, n: int = 200, lead: int = 0
               ) -> tuple[np.ndarray, np.ndarray]:
    base = np.broadcast_to(rng.beta(2.0, 2.2, (runs, 1, n)), (runs, windows, n))
    q = rng.uniform(0.05, 0.35, (runs, windows, 1))
    sigma = rng.uniform(0.04, 0.12, (runs, windows, 1))
    flip = rng.random((runs, windows, n)) < q
    cand = base + flip * (sigma * rng.standard_t(3, (runs, windows, n)) - 0.01)
    if size < 0:
        hit = (rng.random((runs, windows, n)) < 0.25) & (np.arange(windows) >= lead)[None, :, None]
        cand = cand - hit * rng.exponential(-size / 0.25, (runs, windows, n))
    cand = np.clip(cand, 0.0, 1.0)
    return cand, np.ascontiguousarray(base)


def golden_statistics(cand: np.ndarray, base: np.ndarray) -> dict[str, np.ndarray]:
    """Everything every golden detector needs from one batch of runs (runs x windows)."""
    runs, windows, n = cand.shape
    d = cand - base
    levels = sorted({q for r in GOLDEN_RULES for a in r.alphas for q in (a / 2, 1 - a / 2)})
    _, single = st.bootstrap_mean_quantiles(d.reshape(-1, n), levels, n_boot=2000, seed=7)
    pooled_d = st.average_replays([d[:, 1:], d[:, :-1]]).reshape(-1, n)
    _, pooled = st.bootstrap_mean_quantiles(pooled_d, levels, n_boot=2000, seed=7)
    out: dict[str, np.ndarray] = {}
    for rule in GOLDEN_RULES:
        a1, a2 = rule.alphas
        codes = []
        for q, a, w in ((single, a1, windows), (pooled, a2, windows - 1)):
            lo, hi = q[:, levels.index(a / 2)], q[:, levels.index(1 - a / 2)]
            code, _ = st.classify(-hi, -lo, n, effect_threshold=rule.delta, marginal_threshold=None, min_n=30,
                                  max_ci_width=None)
            codes.append(code.reshape(runs, w))
        status = codes[0].copy()
        # fail if either look fails; otherwise the pooled (more informative) look speaks
        status[:, 1:] = np.where(codes[0][:, 1:] == st.FAIL, st.FAIL, codes[1])
        out[rule.name] = status
    mean = d.mean(axis=2)
    out["flagger1"] = mean
    out["flagger2"] = rolling_sum(mean, 2) / np.minimum(np.arange(1, windows + 1), 2)
    for k in GOLDEN_POOLS:
        c2, b2 = rolling_concat(cand, k).reshape(runs * windows, -1), rolling_concat(base, k).reshape(runs * windows, -1)
        est, _, hi = bl.pairwise_shift_ci_screened(c2, b2, bl.KAYENTA_CONFIDENCE, "decrease")
        with np.errstate(invalid="ignore"):
            ratio = np.nanmean(c2, axis=1) / np.nanmean(b2, axis=1)
        out[f"kayenta_sig{k}"] = (hi < -bl.KAYENTA_TOLERANCE * np.abs(est)).reshape(runs, windows)
        out[f"kayenta_ratio{k}"] = ratio.reshape(runs, windows)
    return out


def golden(rng: np.random.Generator, sz: Sizes) -> tuple[list[Result], dict[float, float]]:
    ref, horizon = -0.03, 2
    parts, realised_null = [], []
    for m in null_chunks(sz.golden_null_streams):
        c, b = gen_golden(rng, m, sz.stream_len, 0.0)
        realised_null.append(float((c - b).mean()))
        parts.append(golden_statistics(c, b))
    null = stack(parts)
    power, realised = {}, {0.0: float(np.mean(realised_null))}
    for s in GOLDEN_SIZES:
        lead = LEAD["golden"]
        c, b = gen_golden(rng, sz.golden_power_runs, lead + H_MAX, s, lead=lead)
        realised[s] = float((c - b)[:, lead:].mean())
        power[s] = golden_statistics(c, b)
    rows = ours("golden", GOLDEN_RULES, {r: null[r.name] for r in GOLDEN_RULES},
                {r: {s: power[s][r.name] for s in GOLDEN_SIZES} for r in GOLDEN_RULES}, horizon, ref)
    target = rows[0].power[ref]
    flagger: list[Candidate] = []
    for k in GOLDEN_POOLS:
        flagger += flagger_grid(f"mean dROUGE-L of last {k} replay(s) < {{t:.4f}}, threshold {{ft}}",
                                null[f"flagger{k}"], {s: power[s][f"flagger{k}"] for s in GOLDEN_SIZES},
                                [-t for t in np.arange(0.005, 0.0301, 0.0025)], above=False)
    res_f = tune("flagger", "golden", flagger, horizon, ref, target)
    kayenta: list[Candidate] = []
    for k in GOLDEN_POOLS:
        for a in (1.0, 0.99, 0.98, 0.97, 0.95):
            def harmful(d: dict[str, np.ndarray], k: int = k, a: float = a) -> np.ndarray:
                return d[f"kayenta_sig{k}"] & (d[f"kayenta_ratio{k}"] <= a)
            kayenta.append((f"MW 98% on last {k} replay(s), allowedDecrease {a}", harmful(null),
                            {s: harmful(power[s]) for s in GOLDEN_SIZES}, immediate_rollbacks))
    res_k = tune("kayenta", "golden", kayenta, horizon, ref, target)
    return rows + [res_f, res_k], realised


# --- live windows ---------------------------------------------------------------------------------

LIVE_POOLS = (1, 3)


def _lead_factor(windows: int, size: float, lead: int) -> np.ndarray:
    return np.where(np.arange(windows) >= lead, size, 0.0)


def gen_latency(rng: np.random.Generator, runs: int, windows: int, size: float, lo_idx: int, bins: int,
                lead: int = 0) -> dict[str, np.ndarray]:
    nw = runs * windows
    r = np.clip(np.exp(rng.normal(math.log(600), 1.0, nw)), 50, 3000).astype(np.int64)
    load = np.exp(rng.normal(0.0, 0.15, nw))
    eff = np.tile(_lead_factor(windows, size, lead), runs)
    out: dict[str, np.ndarray] = {"n": r.reshape(runs, windows)}
    for side, factor in (("cand", 1.0 + eff), ("base", np.ones(nw))):
        wid = np.repeat(np.arange(nw), r)
        # log latency in float32 (speed; the data only need to be plausible, not exact)
        log_lat = (np.log(300.0 * load * factor).astype(np.float32)[wid]
                   + 0.6 * rng.standard_normal(wid.size, dtype=np.float32))
        tail = np.flatnonzero(rng.random(wid.size, dtype=np.float32) < 0.03)
        log_lat[tail] += np.log(2.0 + rng.pareto(1.8, tail.size)).astype(np.float32)
        idx = np.clip(np.ceil(log_lat / np.float32(math.log(GAMMA))).astype(np.int64) - lo_idx, 0, bins - 1)
        out[side] = np.bincount(wid * bins + idx, minlength=nw * bins).reshape(runs, windows, bins).astype(float)
        lat = np.exp(log_lat, dtype=np.float64)
        bucket = rng.integers(0, KAYENTA_BUCKETS, wid.size, dtype=np.int32)
        key = wid * KAYENTA_BUCKETS + bucket
        cnt = np.bincount(key, minlength=nw * KAYENTA_BUCKETS)
        tot = np.bincount(key, weights=lat, minlength=nw * KAYENTA_BUCKETS)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[side + "_buckets"] = (tot / cnt).reshape(runs, windows, KAYENTA_BUCKETS)
    return out


def _hist_quantile(c: np.ndarray, q: float) -> np.ndarray:
    cum = np.cumsum(c, axis=-1)
    return (cum < q * cum[..., -1:]).sum(axis=-1).astype(float)


def _kayenta_stats(d: dict[str, np.ndarray], out: dict[str, np.ndarray], allowed: list[float]) -> None:
    runs, windows = d["n"].shape
    for k in LIVE_POOLS:
        c = rolling_concat(d["cand_buckets"], k).reshape(runs * windows, -1)
        b = rolling_concat(d["base_buckets"], k).reshape(runs * windows, -1)
        classes = bl.kayenta_classify_many(c, b, direction="increase", allowed_ratios=allowed)
        for a, cls in classes.items():
            out[f"kayenta{k}_{a}"] = (cls == 1).reshape(runs, windows)


def latency_statistics(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    runs, windows, bins = d["cand"].shape
    out: dict[str, np.ndarray] = {}
    g = math.log(GAMMA)
    for rule in LATENCY_RULES:
        cx = rolling_sum(d["cand"], rule.pool).reshape(-1, bins)
        cy = rolling_sum(d["base"], rule.pool).reshape(-1, bins)
        n = np.minimum(cx.sum(axis=1), cy.sum(axis=1))
        _, lo, hi = st.shift_ci_counts_rows(cx, cy, rule.alphas[0])
        code, _ = st.classify(lo * g, hi * g, n, effect_threshold=math.log1p(rule.delta), marginal_threshold=None,
                              min_n=50, max_ci_width=None)
        out[rule.name] = code.reshape(runs, windows)
    for k in LIVE_POOLS:
        cx, cy = rolling_sum(d["cand"], k), rolling_sum(d["base"], k)
        for q in (0.5, 0.99):
            out[f"flagger{k}_p{int(q * 100)}"] = np.exp((_hist_quantile(cx, q) - _hist_quantile(cy, q)) * g)
    _kayenta_stats(d, out, [1.0, 1.05, 1.1, 1.2])
    return out


def live(scenario: str, rng: np.random.Generator, sz: Sizes, rules: list[Rule], sizes: list[float], ref: float,
         gen: Callable[..., dict[str, np.ndarray]], stats: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
         flagger_specs: list[tuple[str, str, list[float]]], allowed: list[float], kayenta_what: str) -> list[Result]:
    horizon = 3
    null = stack([stats(gen(rng, m, sz.stream_len, 0.0)) for m in null_chunks(sz.live_null_streams)])
    lead = LEAD[scenario]
    power = {s: stats(gen(rng, sz.power_runs, lead + H_MAX, s, lead=lead)) for s in sizes}
    rows = ours(scenario, rules, {r: null[r.name] for r in rules},
                {r: {s: power[s][r.name] for s in sizes} for r in rules}, horizon, ref)
    target = rows[0].power[ref]
    flagger: list[Candidate] = []
    for key, label, thresholds in flagger_specs:
        for k in LIVE_POOLS:
            flagger += flagger_grid(label.replace("{k}", str(k)), null[key.format(k=k)],
                                    {s: power[s][key.format(k=k)] for s in sizes}, thresholds, above=True)
    res_f = tune("flagger", scenario, flagger, horizon, ref, target)
    kayenta: list[Candidate] = [
        (f"MW 98% on {KAYENTA_BUCKETS} {kayenta_what} per window, last {k} window(s), allowedIncrease {a}",
         null[f"kayenta{k}_{a}"], {s: power[s][f"kayenta{k}_{a}"] for s in sizes}, immediate_rollbacks)
        for k in LIVE_POOLS for a in allowed]
    res_k = tune("kayenta", scenario, kayenta, horizon, ref, target)
    return rows + [res_f, res_k]


def latency(rng: np.random.Generator, sz: Sizes) -> list[Result]:
    lo_idx = int(math.floor(math.log(1.0) / math.log(GAMMA)))
    bins = int(math.ceil(math.log(1e6) / math.log(GAMMA))) - lo_idx + 1

    def gen(rng: np.random.Generator, runs: int, windows: int, size: float, lead: int = 0) -> dict[str, np.ndarray]:
        return gen_latency(rng, runs, windows, size, lo_idx, bins, lead)

    ratios = [1 + t for t in (0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5)]
    specs = [(f"flagger{{k}}_p{p}", f"p{p} ratio over last {{k}} window(s) > {{t:.3g}}, threshold {{ft}}", ratios)
             for p in (50, 99)]
    return live("latency", rng, sz, LATENCY_RULES, [0.05, 0.10, 0.20], 0.10, gen, latency_statistics, specs,
                [1.0, 1.05, 1.1, 1.2], "bucket means")


def gen_errors(rng: np.random.Generator, runs: int, windows: int, size: float, lead: int = 0) -> dict[str, np.ndarray]:
    shape = (runs, windows)
    r = np.clip(np.exp(rng.normal(math.log(2000), 0.8, shape)), 200, 20000).astype(np.int64)
    p = 0.01 * np.exp(rng.normal(0.0, 0.3, shape))
    out: dict[str, np.ndarray] = {"n": r}
    for side, add in (("cand", _lead_factor(windows, size, lead)[None, :]), ("base", 0.0)):
        pr = np.clip(p + add, 0, 1)
        out[side] = rng.binomial(r, pr)
        breq = rng.binomial(r[..., None], 1.0 / KAYENTA_BUCKETS, shape + (KAYENTA_BUCKETS,))
        berr = rng.binomial(breq, pr[..., None])
        with np.errstate(invalid="ignore", divide="ignore"):
            out[side + "_buckets"] = berr / breq
    return out


def error_statistics(d: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for rule in ERROR_RULES:
        n = rolling_sum(d["n"], rule.pool)
        _, lo, hi, _ = st.rate_diff_ci(rolling_sum(d["cand"], rule.pool), n, rolling_sum(d["base"], rule.pool), n,
                                       rule.alphas[0])
        out[rule.name], _ = st.classify(lo, hi, n, effect_threshold=rule.delta, marginal_threshold=None, min_n=100,
                                        max_ci_width=None)
    for k in LIVE_POOLS:
        out[f"flagger{k}"] = (rolling_sum(d["cand"], k) - rolling_sum(d["base"], k)) / rolling_sum(d["n"], k)
    _kayenta_stats(d, out, [1.0, 1.25, 1.5, 2.0])
    return out


def errors(rng: np.random.Generator, sz: Sizes) -> list[Result]:
    specs = [("flagger{k}", "error-rate diff over last {k} window(s) > {t:.3%}, threshold {ft}",
              [0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02])]
    return live("errors", rng, sz, ERROR_RULES, [0.005, 0.01, 0.02], 0.01, gen_errors, error_statistics, specs,
                [1.0, 1.25, 1.5, 2.0], "bucket rates")


# --- report -------------------------------------------------------------------------------------

HORIZON = {"golden": 2, "latency": 3, "errors": 3}
UNIT = {"golden": "dROUGE-L", "latency": "latency x", "errors": "error +pts"}


def fmt_size(scenario: str, s: float) -> str:
    if scenario == "golden":
        return f"{s:+.2f}"
    if scenario == "latency":
        return f"+{s:.0%}"
    return f"+{s * 100:.1f}"


def table(results: list[Result]) -> str:
    lines = []
    for scen in ("golden", "latency", "errors"):
        rows = [r for r in results if r.scenario == scen]
        if not rows:
            continue
        sizes = list(rows[0].power)
        h = HORIZON[scen]
        head = ("| detector | false rollbacks / 10k (count / windows) | "
                + " | ".join(f"{UNIT[scen]} {fmt_size(scen, s)}: power@{h} / delay" for s in sizes) + " | config |")
        lines += [f"\n### {scen}\n", head, "|" + " --- |" * (3 + len(sizes))]
        for r in rows:
            cells = " | ".join(f"{r.power[s]:.3f} / {r.delay[s]:.2f}" for s in sizes)
            lines.append(f"| {r.detector} | {r.false_per_10k:.2f} ({r.null_rollbacks} / {r.null_windows}) | "
                         f"{cells} | {r.config} |")
    return "\n".join(lines)


def run_scenario(name: str, seed: int, sz: Sizes) -> tuple[list[Result], dict[float, float], float]:
    """One scenario with its own generator (seeded from the seed and the scenario), so scenarios
    can run in parallel and each is reproducible alone."""
    t = time.perf_counter()
    rng = np.random.default_rng([seed, SCENARIOS.index(name)])
    realised: dict[float, float] = {}
    if name == "golden":
        res, realised = golden(rng, sz)
    else:
        res = latency(rng, sz) if name == "latency" else errors(rng, sz)
    return res, realised, time.perf_counter() - t


SCENARIOS = ["golden", "latency", "errors"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=SCENARIOS)
    ap.add_argument("--jobs", type=int, default=2, help="processes (golden runs beside latency+errors)")
    args = ap.parse_args(argv)
    sz = Sizes(40, 40, 50, 200, 400) if args.quick else Sizes(1200, 600, 50, 1000, 1500)
    names = [args.only] if args.only else SCENARIOS
    t0 = time.perf_counter()
    out: dict[str, tuple[list[Result], dict[float, float], float]] = {}
    if args.jobs > 1 and len(names) > 1:
        from concurrent.futures import ProcessPoolExecutor

        # golden is about as long as latency + errors together: two processes balance
        with ProcessPoolExecutor(max_workers=2) as pool:
            fut = pool.submit(run_scenario, "golden", args.seed, sz) if "golden" in names else None
            for n in names:
                if n != "golden":
                    out[n] = run_scenario(n, args.seed, sz)
            if fut is not None:
                out["golden"] = fut.result()
    else:
        for n in names:
            out[n] = run_scenario(n, args.seed, sz)
    results = [r for n in names for r in out[n][0]]
    if "golden" in out:
        print("golden: realised mean dROUGE-L per size (after clipping): "
              + ", ".join(f"{k:+.2f} -> {v:+.4f}" for k, v in sorted(out["golden"][1].items())), file=sys.stderr)
    print(f"seed {args.seed}; null: golden {sz.golden_null_streams}, live {sz.live_null_streams} streams x "
          f"{sz.stream_len} windows; power: golden {sz.golden_power_runs}, live {sz.power_runs} runs per size "
          f"(clean lead-in windows {LEAD}, then the regression), delay counted up to {H_MAX} windows")
    print(table(results))
    print("\ntimings: " + ", ".join(f"{n} {out[n][2]:.1f}s" for n in names)
          + f", total wall {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
