"""Decision benchmark: the shipped PolicyEngine over simulated fleet signals (docs/BENCHMARKS_decisions.md).

The daemon, ``policy backtest`` and this benchmark run the same decision path:
``watchdog.policy.engine.PolicyEngine.observe`` over ``watchdog.core.signals.Signal`` objects, with the
policy files given on the command line (the shipped policies/*.yaml by default). Live windows are
5 minutes of traffic per (route, precision) with the detail the daemon's windows carry (counts,
latency sketch bins, shadow pairs, logprob tokens); golden replays are per-item differences.

Noise models (seeded; each documented in docs/BENCHMARKS_decisions.md):
  iid            lognormal latency (sigma 0.35), binomial errors, no replica effects
  replica-1/10   per-precision AR(1) (rho 0.95 per window) log-latency offsets sd 1 %, error-rate factors sd 10 %
  replica-2/15   ... sd 2 % / 15 %     replica-4/30  ... sd 4 % / 30 % (reported, not a target)
  diurnal        traffic and latency follow a daily cycle with a per-route phase
  share-50       FP16 gets 50 % of the traffic (default 15 %)
  bursts         1 % of windows: one precision (either, at random) gets +2-6 points of errors
  speedup        FP8 1.6x faster than FP16 (default: latency parity)
  golden-N       N = 50, 200, 500 items: a persistent FP8-sensitive subset (each item's healthy
                 FP8 delta is drawn once from the measured drift shape) plus per-replay
                 nondeterminism (30 % of items redrawn each replay); rotated variant: each replay
                 samples N items from a pool of 5 N

Run: ``python bench/decisions.py`` (full) or ``--quick`` (CI smoke test, < 1 min); ``--jobs N`` spreads
the run over N processes (each takes every N-th unit - a noise model and route set, a power scenario - and
the parent merges their results in unit order; every unit draws from its own seed, so the numbers do not
depend on N); ``--parts`` picks parts.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.baselines import FlaggerConfig, flagger_rollbacks  # noqa: E402
from watchdog.core.signals import Signal  # noqa: E402
from watchdog.policy.engine import PolicyEngine  # noqa: E402
from watchdog.policy.loader import PolicySet, load_policy_files  # noqa: E402
from watchdog.policy.state import ScopeState  # noqa: E402

WINDOW_S = 300.0
T0 = 1_780_000_000.0
ACC = 0.01
GAMMA = (1 + ACC) / (1 - ACC)
LOG_G = math.log(GAMMA)
SIGMA = 0.35
MEDIAN_MS = 800.0
TOTAL = 7000  # requests per route and window (both precisions)
DRIFT_SHAPE = ROOT / "bench" / "data" / "fp8_drift_trained.json"


@dataclass(frozen=True)
class Live:
    name: str
    lat_sd: float = 0.0
    err_sd: float = 0.0
    rho: float = 0.95
    diurnal: bool = False
    fp16_share: float = 0.15
    bursts: float = 0.0
    speedup: float = 1.0
    target: bool = True


LIVE_MODELS = [
    Live("iid"),
    Live("replica-1/10", 0.01, 0.10),
    Live("replica-2/15", 0.02, 0.15),
    Live("diurnal+replica-2/15", 0.02, 0.15, diurnal=True),
    Live("share-50+replica-2/15", 0.02, 0.15, fp16_share=0.5),
    Live("bursts+replica-2/15", 0.02, 0.15, bursts=0.01),
    Live("speedup-1.6+replica-2/15", 0.02, 0.15, speedup=1.6),
    Live("replica-4/30", 0.04, 0.30, target=False),
]


# --- live windows --------------------------------------------------------------------------------


def _ar1(rng: np.random.Generator, shape: tuple[int, int], sd: float, rho: float) -> np.ndarray:
    """AR(1) paths (runs x windows) with stationary sd ``sd``."""
    out = np.zeros(shape)
    if sd <= 0:
        return out
    out[:, 0] = rng.normal(0, sd, shape[0])
    inno = rng.normal(0, sd * math.sqrt(1 - rho * rho), shape)
    for t in range(1, shape[1]):
        out[:, t] = rho * out[:, t - 1] + inno[:, t]
    return out


def _tail(u: np.ndarray, p99: float) -> np.ndarray:
    """Multiplier of the quantile function: 1 below p90, rising to 1 + p99 at p99 and above
    (a p99-only regression: the median does not move)."""
    return 1.0 + p99 * np.clip((u - 0.9) / 0.09, 0.0, 1.0)


def _bin_counts(rng: np.random.Generator, n: int, mu: float, p99: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(sketch bucket keys, counts) of ``n`` latencies exp(mu + SIGMA z) (times ``_tail`` of
    their rank for a p99-only regression), drawn as one multinomial over the buckets'
    probabilities: the same distribution as drawing the requests and bucketing them
    (``ceil(log(x) / LOG_G)``), at the cost of the ~200 buckets instead of the ~6,000 requests."""
    # with the regression: log latency as a monotone function of z, bucket edges mapped back through it
    g = mu + SIGMA * _Z_GRID + np.log(_tail(_U_GRID, p99)) if p99 else mu + SIGMA * _Z_GRID[[0, -1]]
    k0, k1 = math.floor(g[0] / LOG_G), math.ceil(g[-1] / LOG_G)
    edges = np.arange(k0, k1 + 1) * LOG_G
    cdf = np.interp(edges, g, _U_GRID) if p99 else _norm_cdf((edges - mu) / SIGMA)
    prob = np.diff(cdf)
    counts = rng.multinomial(n, prob / prob.sum())
    keys = np.arange(k0 + 1, k1 + 1)
    nz = counts > 0
    return keys[nz], counts[nz]


def _sketch(keys: np.ndarray, counts: np.ndarray) -> dict[str, Any]:
    return {"relative_accuracy": ACC, "min_value": 1e-3, "count": int(counts.sum()), "zero_count": 0,
            "bins": np.column_stack((keys, counts)).tolist()}


def _quantiles(keys: np.ndarray, counts: np.ndarray, qs: list[float]) -> list[float]:
    cum = np.cumsum(counts)
    i = np.minimum(np.searchsorted(cum, np.asarray(qs) * cum[-1]), keys.size - 1)
    return [float(x) for x in 2 * GAMMA ** keys[i] / (GAMMA + 1)]


@dataclass
class Regression:
    """What FP8 does wrong from window ``onset`` on (all zero: healthy)."""

    onset: int = 10**9
    p99: float = 0.0      # +0.10: p99-only, median unchanged
    shift: float = 0.0    # +0.10: every latency 10 % higher
    errors: float = 0.0   # absolute error-rate points added


class LiveSim:
    """Simulated live windows of ``routes`` routes over ``windows`` windows, one noise model."""

    def __init__(self, model: Live, routes: int, windows: int, seed: int, reg: Regression | None = None) -> None:
        self.m, self.R, self.W, self.reg = model, routes, windows, reg or Regression()
        rng = self.rng = np.random.default_rng(seed)
        shape = (routes, windows)
        self.lat_off = {p: _ar1(rng, shape, model.lat_sd, model.rho) for p in ("fp8", "fp16")}
        self.err_f = {p: _ar1(rng, shape, model.err_sd, model.rho) for p in ("fp8", "fp16")}
        self.phase = rng.uniform(0, 2 * math.pi, routes)

    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        m, rng, reg = self.m, self.rng, self.reg
        start = T0 + t * WINDOW_S
        out: list[Signal] = []
        day = 2 * math.pi * t * WINDOW_S / 86400.0
        for r, route in enumerate(routes):
            load = 1.0 + (0.5 * math.sin(day + self.phase[r]) if m.diurnal else 0.0)
            burst = rng.random() < m.bursts
            burst_side = "fp8" if rng.random() < 0.5 else "fp16"
            for prec in ("fp8", "fp16"):
                share = m.fp16_share if prec == "fp16" else 1 - m.fp16_share
                n = max(int(rng.poisson(TOTAL * share * load)), 1)
                bad = prec == "fp8" and t >= reg.onset
                mu = math.log(MEDIAN_MS) + self.lat_off[prec][r, t]
                mu += (0.08 * math.sin(day + self.phase[r]) if m.diurnal else 0.0)
                if prec == "fp8":
                    mu -= math.log(m.speedup)
                if bad and reg.shift:
                    mu += math.log(1 + reg.shift)
                p_err = 0.01 * math.exp(self.err_f[prec][r, t]) + (reg.errors if bad else 0.0)
                if burst and prec == burst_side:
                    p_err += rng.uniform(0.02, 0.06)
                p_err = min(p_err, 0.9)
                errors = int(rng.binomial(n, p_err))
                timeouts = int(rng.binomial(n, 0.002 * math.exp(self.err_f[prec][r, t])))
                ok = max(n - errors - timeouts, 1)
                keys, counts = _bin_counts(rng, ok, mu, reg.p99 if bad else 0.0)
                sk = _sketch(keys, counts)
                p50, p95, p99 = _quantiles(keys, counts, [0.5, 0.95, 0.99])
                lp_tokens = int(0.2 * ok * 50)
                nll_sd = 0.3 / math.sqrt(max(0.2 * ok, 1))
                ppl = math.exp(0.6 + (0.002 if prec == "fp8" else 0.0) + rng.normal(0, nll_sd))
                empty = int(rng.binomial(ok, 0.005))
                values = {"error_rate": (errors + timeouts) / n, "timeout_rate": timeouts / n,
                          "latency_p50_ms": p50, "latency_p95_ms": p95, "latency_p99_ms": p99,
                          "empty_rate": empty / ok, "perplexity": ppl, "mean_completion_tokens": 50.0}
                detail: dict[str, Any] = {"events": n, "ok": ok, "errors": errors, "timeouts": timeouts,
                                          "completions": ok, "empty": empty, "logprob_tokens": lp_tokens,
                                          "latency_hist": sk}
                if prec == "fp8":
                    pairs = int(rng.binomial(ok, 0.02))
                    # docs/DRIFT.md (3,000-step run): healthy FP8 vs FP16 ROUGE-L mean 0.906; about 25 % of answers change
                    changed = rng.random(pairs) < 0.25
                    scores = np.where(changed, rng.beta(3, 2, pairs), 1.0)
                    detail["shadow_pairs"] = pairs
                    if pairs:
                        values["shadow_rougeL"] = float(scores.mean())
                out.append(Signal("live", "m", route, prec, start, start + WINDOW_S, n, values, None, None, detail))
        return out


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    """Standard normal CDF by table lookup (numpy has no erf): the tail multiplier needs u."""
    return np.interp(z, _Z_GRID, _U_GRID)


_Z_GRID = np.linspace(-6, 6, 24001)
_U_GRID = 0.5 * (1 + np.array([math.erf(z / math.sqrt(2)) for z in _Z_GRID]))


# --- running the engine -----------------------------------------------------------------------


@dataclass
class Tally:
    windows: int = 0
    rollbacks: int = 0
    by_rule: dict[str, int] = field(default_factory=dict)
    first: list[int] = field(default_factory=list)  # window of the first rollback per route (-1: none)
    #: per "policy:rule": each judged window's distance to failing, (estimate - effect) / (estimate
    #: - ci_low): the rule fails at 1 (``margin_summary``)
    margins: dict[str, list[float]] = field(default_factory=dict)


def _record_margins(engine: PolicyEngine, tally: Tally, end: float) -> None:
    for (policy, _, _), st in engine.states.items():
        for name, rs in st.rules.items():
            v = rs.last
            j = v.judgement if v is not None and v.end == end else None
            if not j or j.get("estimate") is None or j.get("ci_low") is None:
                continue
            if not (j.get("detail") or {}).get("learned", True):
                continue  # warm-up: judged against the prior, not the learned null
            est, lo, eff = float(j["estimate"]), float(j["ci_low"]), float(j.get("effect_threshold") or 0.0)
            if est > lo:
                tally.margins.setdefault(f"{policy}:{name}", []).append((est - eff) / (est - lo))


def margin_summary(margins: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per rule: how far its healthy judged windows stayed from failing (margin 1 = fail), and
    an EXTRAPOLATED per-window failure rate: a normal fitted to the healthy margins, its tail
    beyond 1 (a model of the tail, not a count; t-based rules have heavier tails)."""
    out = {}
    for key, xs in sorted(margins.items()):
        x = np.asarray(xs)
        if x.size < 30:
            continue
        m, sd = float(x.mean()), float(x.std(ddof=1))
        z = (1 - m) / sd if sd > 0 else math.inf
        out[key] = {"windows": int(x.size), "max": float(x.max()), "mean": m, "sd": sd,
                    "share_above_half": float(np.mean(x > 0.5)),
                    "extrapolated_per_10k": 1e4 * 0.5 * math.erfc(z / math.sqrt(2))}
    return out


def _reset_route(engine: PolicyEngine, route: str) -> None:
    """After a rollback: the route starts afresh (as if FP8 was promoted again), learned nulls kept."""
    for key in [k for k in engine.states if k[2] == route]:
        old = engine.states[key]
        st = ScopeState()
        for name, rs in old.rules.items():
            rs.fails = rs.errors = 0
            rs.pool = ()
            rs.last = None
            st.rules[name] = rs
        st.last_end = dict(old.last_end)
        engine.states[key] = st


def _observe(engine: PolicyEngine, sigs: list[Signal], now: float, flags: dict[tuple[str, str], str],
             names: list[str], tally: Tally, t: int) -> None:
    """One round of the engine; every rollback counted, its route started afresh."""
    for a in engine.observe(sigs, now, flags):
        if a.kind != "rollback" or a.detail.get("retry"):
            continue
        r = names.index(a.route)
        tally.rollbacks += 1
        for rule in a.detail.get("rules", []):
            key = f"{a.policy}:{rule}"
            tally.by_rule[key] = tally.by_rule.get(key, 0) + 1
        if tally.first[r] < 0:
            tally.first[r] = t
        _reset_route(engine, a.route)


def run_live(ps: PolicySet, model: Live, routes: int, windows: int, seed: int, route_prefix: str,
             reg: Regression | None = None) -> Tally:
    return run_live_branches(ps, model, routes, windows, seed, route_prefix, [reg] if reg else [None])[0]


def run_live_branches(ps: PolicySet, model: Live, routes: int, windows: int, seed: int, route_prefix: str,
                      regs: list[Regression | None]) -> list[Tally]:
    """One healthy run up to the regressions' common onset, then one continuation per regression
    from a copy of the engine and the simulator at that point (the healthy prefix, most of a
    power run, is simulated and judged once)."""
    onset = min((r.onset for r in regs if r is not None), default=windows)
    sim = LiveSim(model, routes, windows, seed, None)
    names = [f"{route_prefix}/r{i}" for i in range(routes)]
    engine = PolicyEngine(ps)
    flags = {("m", r): "fp8" for r in names}
    prefix = Tally(first=[-1] * routes)
    for t in range(min(onset, windows)):
        _observe(engine, sim.signals(t, names), T0 + (t + 1) * WINDOW_S + 1, flags, names, prefix, t)
        if not any(regs):
            _record_margins(engine, prefix, T0 + (t + 1) * WINDOW_S)
        prefix.windows += routes
    out = []
    for reg in regs:
        tally = copy.deepcopy(prefix)
        e2, s2 = (copy.deepcopy(engine), copy.deepcopy(sim)) if len(regs) > 1 else (engine, sim)
        s2.reg = reg or Regression()
        for t in range(min(onset, windows), windows):
            _observe(e2, s2.signals(t, names), T0 + (t + 1) * WINDOW_S + 1, flags, names, tally, t)
            tally.windows += routes
        out.append(tally)
    return out


# --- golden replays -----------------------------------------------------------------------------


def drift_shape(variant: str | None) -> np.ndarray | None:
    """Healthy FP8 - FP16 per-item ROUGE-L deltas measured on a trained model (gpu12's
    bench/data/fp8_drift_trained.json, model "main", the named variant), or None for the
    docs/DRIFT.md 3,000-step shape (86.7 % unchanged, 1.2 % below -0.2, 2.3 % above +0.2)."""
    if variant is None:
        return None
    d = json.loads(DRIFT_SHAPE.read_text())
    items = d["models"]["main"]["variants"][variant]["items"]
    vals = np.array([float(x["delta_rougeL"]) for x in items if x.get("delta_rougeL") is not None])
    return vals[np.isfinite(vals)]


def healthy_deltas(rng: np.random.Generator, size: tuple[int, ...], measured: np.ndarray | None) -> np.ndarray:
    if measured is not None:
        return rng.choice(measured, size=size)
    nz = rng.random(size) < 0.133
    u = rng.random(size)
    big = rng.uniform(0.2, 0.8, size)
    small = rng.normal(0, 0.07, size)
    return np.where(nz, np.where(u < 0.09, -big, np.where(u < 0.26, big, small)), 0.0)


@dataclass(frozen=True)
class Golden:
    name: str
    items: int
    rotate: bool = False
    nondeterminism: float = 0.3
    #: healthy deltas resampled from this measured variant (bench/data/fp8_drift_trained.json)
    measured: str | None = None
    #: sampled serving (temperature > 0): each engine's answer to an item is a fresh sample with
    #: this probability per replay, moving its score by U(-0.5, 0.5) (0.11: ~12 % of items move by
    #: more than 0.2 between two replays of the same engine)
    sampled: float = 0.0


GOLDEN_MODELS = [Golden("golden-50", 50), Golden("golden-200", 200), Golden("golden-500", 500),
                 Golden("golden-200-rotated", 200, rotate=True),
                 Golden("golden-200-sampled", 200, nondeterminism=0.0, sampled=0.11)]
#: the measured drift of a trained model (gpu12, H200): healthy FP8 per-tensor and per-row
TRAINED_MODELS = [Golden("trained-per-tensor-200", 200, measured="fp8 per-tensor"),
                  Golden("trained-per-row-200", 200, measured="fp8 per-row")]


class GoldenSim:
    """Golden replays of ``routes`` routes (hourly), one golden model; ``damage`` (None,
    "diffuse": 30 % of items -0.1, "concentrated": a persistent 6 % of items -0.5) from replay
    ``onset`` on.

    Every replay also carries an A/A pass (the daemon's ``repeat_baseline``): the baseline's
    second answer minus its first. Without sampling a baseline answer changes only where the
    comparison is nondeterministic (``nondeterminism`` of the items redraw, a symmetric healthy-
    shape jump); with ``sampled`` every engine draws its own sample per replay."""

    def __init__(self, g: Golden, routes: int, seed: int, route_prefix: str) -> None:
        self.g, self.damage, self.onset = g, None, 10**9
        rng = self.rng = np.random.default_rng(seed)
        # the A/A pass and the sampling draw from their own stream: the FP8 - FP16 differences stay
        # those of the benchmark's earlier runs
        self.aa_rng = np.random.default_rng(seed + 7777)
        self.measured = drift_shape(g.measured)
        self.pool_n = g.items * (5 if g.rotate else 1)
        self.persistent = healthy_deltas(rng, (routes, self.pool_n), self.measured)
        # exactly 6 % of the items (of the pool, for rotated sets) break: the target's shape
        self.broken_items = np.zeros((routes, self.pool_n), dtype=bool)
        for r in range(routes):
            self.broken_items[r, rng.choice(self.pool_n, round(0.06 * self.pool_n), replace=False)] = True
        self.names = [f"{route_prefix}/g{i}" for i in range(routes)]

    def _sample(self, n: int) -> np.ndarray:
        rng = self.aa_rng
        return np.where(rng.random(n) < self.g.sampled, rng.uniform(-0.5, 0.5, n), 0.0)

    def signals(self, t: int) -> list[Signal]:
        g, rng = self.g, self.rng
        start = T0 + t * 3600.0
        sigs = []
        for r, route in enumerate(self.names):
            idx = np.sort(rng.choice(self.pool_n, g.items, replace=False)) if g.rotate else np.arange(g.items)
            d = self.persistent[r, idx].copy()
            redraw = rng.random(g.items) < g.nondeterminism
            d[redraw] = healthy_deltas(rng, (int(redraw.sum()),), self.measured)
            arng = self.aa_rng
            flip = arng.random(g.items) < g.nondeterminism
            sign = np.where(arng.random(g.items) < 0.5, -1.0, 1.0)
            aa = np.where(flip, sign * healthy_deltas(arng, (g.items,), self.measured), 0.0)
            if g.sampled:
                e_b, e_c, e_r = self._sample(g.items), self._sample(g.items), self._sample(g.items)
                d += e_c - e_b
                aa = e_r - e_b
            if self.damage and t >= self.onset:
                if self.damage == "diffuse":
                    d -= np.where(rng.random(g.items) < 0.3, 0.1, 0.0)
                else:
                    d -= np.where(self.broken_items[r, idx], 0.5, 0.0)
            d, aa = np.clip(d, -1, 1), np.clip(aa, -1, 1)
            em = np.where(d < -0.2, -1.0, np.where(d > 0.2, 1.0, 0.0))
            em_aa = np.where(aa < -0.2, -1.0, np.where(aa > 0.2, 1.0, 0.0))
            detail = {"golden_set": "bench", "item_ids": [int(i) for i in idx],
                      "aa": {"rougeL": aa.tolist(), "exact_match": em_aa.tolist()}}
            sigs.append(Signal("golden", "m", route, "fp8", start, start + 120, g.items,
                               {"rougeL": 0.5 + float(d.mean()), "exact_match": 0.5 + float(em.mean())},
                               {"rougeL": d.tolist(), "exact_match": em.tolist()}, None, detail))
        return sigs


def run_golden(ps: PolicySet, g: Golden, routes: int, replays: int, seed: int, route_prefix: str,
               damages: tuple[str | None, ...] = (None,), onset: int = 10**9) -> list[Tally]:
    """``replays`` replays of each route; with damages, one healthy run up to ``onset`` and one
    continuation per damage from a copy of the engine and the simulator at that point."""
    sim = GoldenSim(g, routes, seed, route_prefix)
    names = sim.names
    engine = PolicyEngine(ps)
    flags = {("m", r): "fp8" for r in names}
    prefix = Tally(first=[-1] * routes)
    stop = min(onset, replays)
    for t in range(stop):
        _observe(engine, sim.signals(t), T0 + t * 3600.0 + 121, flags, names, prefix, t)
        prefix.windows += routes
    out = []
    for damage in damages:
        tally = copy.deepcopy(prefix)
        e2, s2 = (copy.deepcopy(engine), copy.deepcopy(sim)) if len(damages) > 1 else (engine, sim)
        s2.damage, s2.onset = damage, onset
        for t in range(stop, replays):
            _observe(e2, s2.signals(t), T0 + t * 3600.0 + 121, flags, names, tally, t)
            tally.windows += routes
        out.append(tally)
    return out


def power(t: Tally, onset: int, within: int) -> float:
    hits = [f for f in t.first if onset <= f < onset + within]
    early = [f for f in t.first if 0 <= f < onset]
    return len(hits) / max(len(t.first) - len(early), 1)


def upper95(k: int, n: int) -> float:
    """One-sided 95 % upper bound of a rate from k events in n trials (exact for k = 0)."""
    if n == 0:
        return math.nan
    if k == 0:
        return 3.0 / n
    return (k + 1.645 * math.sqrt(k) + 1.0) / n


# --- baselines on the same windows --------------------------------------------------------------


def baseline_windows(model: Live, routes: int, windows: int, seed: int, reg: Regression | None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same simulated windows as ``run_live`` (same seed) reduced to what the baselines read:
    per window the FP8/FP16 ratio of the medians, and Kayenta's Mann-Whitney 98 % interval of
    the Hodges-Lehmann log ratio (low end, estimate) from the windows' sketches."""
    from watchdog.policy.evaluate import sketch_histograms
    from watchdog.policy.judge.unpaired import judge_unpaired

    sim = LiveSim(model, routes, windows, seed, None)
    names = [f"b/r{i}" for i in range(routes)]
    ratio, k_lo, k_est = (np.zeros((routes, windows)) for _ in range(3))
    for t in range(windows):
        if reg is not None and t == reg.onset:
            sim.reg = reg  # as run_live_branches: the same windows as our power run
        sigs = sim.signals(t, names)
        for i in range(routes):
            c, b = sigs[2 * i], sigs[2 * i + 1]
            ratio[i, t] = c.values["latency_p50_ms"] / b.values["latency_p50_ms"]
            hc, hb, gamma = sketch_histograms(c.detail["latency_hist"], b.detail["latency_hist"])
            j = judge_unpaired(hc, hb, effect_threshold=0.0, alpha=0.02, gamma=gamma)
            k_lo[i, t], k_est[i, t] = j.ci_low or 0.0, j.estimate or 0.0
    return ratio, k_lo, k_est


def baseline_rollbacks(kind: str, x: float, data: tuple[np.ndarray, np.ndarray, np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(rollbacks per route, first rollback window per route) of a baseline at setting ``x``:
    Flagger: check fails when the median ratio > 1 + x, rollback at 2 failed checks of an
    analysis of 10; Kayenta: a window fails (and rolls back at once: one metric, score 0 < 75)
    when the 98 % interval excludes 0 and the ratio estimate exceeds the allowance x."""
    ratio, k_lo, k_est = data
    failed = ratio > 1 + x if kind == "flagger" else (k_lo > 0) & (k_est > x)
    cfg = FlaggerConfig(failure_threshold=2 if kind == "flagger" else 1, iterations=10)
    return flagger_rollbacks(failed, cfg)


def compare_baselines(res: dict[str, Any], args: argparse.Namespace, n_pow: int, onset: int, model: Live) -> None:
    """Flagger- and Kayenta-style deciders on the same windows as ours (whole-distribution +10 %
    within 3 windows): the setting on a fine grid whose power matches ours, and its false
    rollbacks on the healthy windows of the same noise model."""
    grid = np.round(np.arange(0.0, 0.2001, 0.0025), 4)
    ours = next((r["power"] for r in res["power"] if r["scenario"] == f"whole distribution +10% ({model.name})"
                 and r["routes"] == "chat"), None)
    if ours is None:
        return
    reg = Regression(onset=onset, shift=0.10)
    bad = baseline_windows(model, n_pow, onset + 3, args.seed + 400, reg)
    # the chat routes' healthy windows (their seed offset in main)
    healthy = baseline_windows(model, args.routes, args.windows, args.seed + LIVE_MODELS.index(model) + 1000, None)
    for kind in ("flagger", "kayenta"):
        best = None
        for x in grid[::-1]:  # loosest setting first: the first with enough power is the matched one
            _, first = baseline_rollbacks(kind, float(x), bad)
            early = first[(first >= 0) & (first < onset)].size
            pw = float(np.mean((first >= onset) & (first < onset + 3))) if early == 0 else \
                float(np.sum((first >= onset) & (first < onset + 3)) / max(first.size - early, 1))
            if pw >= ours:
                rb, _ = baseline_rollbacks(kind, float(x), healthy)
                best = {"setting": float(x), "power": pw, "false_per_10k": 1e4 * float(rb.sum()) / healthy[0].size}
                break
        row = {"baseline": kind, "noise": model.name, "our_power": ours,
               **(best or {"setting": None, "power": None, "false_per_10k": None})}
        res["baselines"].append(row)
        print(f"baseline {kind:8s} {model.name:14s} matched to our power {ours:.3f}: setting {row['setting']}, "
              f"power {row['power']}, false rollbacks {row['false_per_10k']} per 10k")


# --- report -------------------------------------------------------------------------------------


class Units:
    """The units of a run (``take`` in the order they come) that this process runs: all of them, or
    with ``--shard K/N`` every N-th from K. The rows a unit adds to ``res`` get its index (``unit``),
    for the merge, when the next unit is taken or at ``close``."""

    def __init__(self, shard: str | None, res: dict[str, Any]) -> None:
        k, n = (int(x) for x in shard.split("/")) if shard else (0, 1)
        if not 0 <= k < n:
            raise SystemExit(f"--shard {shard}: want K/N with 0 <= K < N")
        self.k, self.n, self.index, self.res = k, n, -1, res

    def take(self) -> bool:
        self.close()
        self.index += 1
        return self.index % self.n == self.k

    def close(self) -> None:
        for key in LISTS:
            for row in self.res.get(key, []):
                row.setdefault("unit", self.index)


LISTS = ("live", "golden", "power", "baselines", "fleet", "fleet_healthy", "fleet_power")


def run_jobs(argv: list[str], jobs: int, out: str | None) -> int:
    """Run this benchmark as ``jobs`` shard processes and merge their JSON in unit order."""
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"shard{k}.json") for k in range(jobs)]
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--shard", f"{k}/{jobs}",
                                   "--json", paths[k]]) for k in range(jobs)]
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"a shard failed: exit codes {codes}", file=sys.stderr)
            return 1
        parts = [json.loads(Path(x).read_text()) for x in paths]
    res = {k: v for k, v in parts[0].items() if k not in LISTS}
    for key in LISTS:
        rows = [r for part in parts for r in part.get(key, [])]
        if rows or key in parts[0]:
            res[key] = sorted(rows, key=lambda r: r.get("unit", -1))
    res["jobs"] = jobs
    res["seconds"] = time.perf_counter() - t_start
    print(f"total {res['seconds']:.1f} s over {jobs} processes")
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policies", nargs="*", default=[str(p) for p in sorted((ROOT / "policies").glob("*.yaml"))])
    ap.add_argument("--quick", action="store_true", help="small runs for CI (< 1 min)")
    ap.add_argument("--routes", type=int, default=16, help="healthy live routes per noise model and route set")
    ap.add_argument("--windows", type=int, default=200, help="healthy windows per route and noise model")
    ap.add_argument("--replays", type=int, default=80, help="healthy replays per route and golden model")
    ap.add_argument("--golden-routes", type=int, default=30, help="healthy golden routes per golden model")
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--power-routes", type=int, default=80, help="regressed routes per live power scenario")
    ap.add_argument("--golden-power-routes", type=int, default=30, help="regressed routes per golden power scenario")
    ap.add_argument("--strict-power-routes", type=int, default=200,
                    help="regressed routes of the legal (strict policy) fixed golden-200 scenario")
    ap.add_argument("--default-power-routes", type=int, default=100,
                    help="regressed routes of the chat (default policy) fixed golden-200 scenario")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--parts", default="live,golden,power,trained", help="which parts to run (comma-separated): "
                    "live, golden, power (power includes the baselines), trained (golden models with the drift "
                    "measured on a trained model), confounders (stalls, deploys, router bias: "
                    "bench/fleet_confounders.py), traffic (cold start, restart, creep, low and lopsided traffic: "
                    "bench/fleet_traffic.py); the last two are not in the default set (they take the full run past "
                    "10 minutes) and run tiny in --quick; to spread a full run over processes")
    ap.add_argument("--fleet-power-routes", type=int, default=40, help="regressed routes per traffic power scenario")
    ap.add_argument("--jobs", type=int, default=1, help="processes to spread the units over (results do not depend on it)")
    ap.add_argument("--shard", help=argparse.SUPPRESS)  # K/N: the units this process runs (set by --jobs)
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.jobs > 1 and not args.shard:
        rest = list(sys.argv[1:] if argv is None else argv)
        rest = [a for i, a in enumerate(rest) if not (a.startswith("--jobs") or a.startswith("--json")
                                                      or (i and rest[i - 1] in ("--jobs", "--json")))]
        return run_jobs(rest, args.jobs, args.json)
    if args.quick:
        args.routes, args.windows, args.replays, args.golden_routes = 4, 30, 12, 4
    t_start = time.perf_counter()
    ps = load_policy_files(args.policies)
    res: dict[str, Any] = {"policies": [p.name for p in ps.policies], "quick": args.quick, "live": [], "golden": [],
                           "power": [], "baselines": []}
    units = Units(args.shard, res)
    # a route per policy: "legal/*" is covered by both shipped policies, "chat/*" only by the default
    prefixes = {"legal": "legal", "chat": "chat"}
    # healthy runs: the two route sets draw their own traffic, so the default policy (on both)
    # is measured on twice the windows of the strict one instead of the same windows twice
    set_seed = {"legal": 0, "chat": 1000}
    parts = set(args.parts.split(","))
    models = LIVE_MODELS[:3] + LIVE_MODELS[-1:] if args.quick else LIVE_MODELS
    if "live" not in parts:
        models = []
    print(f"{'noise model':28s} {'routes':>6s} {'windows':>8s} {'rollbacks':>9s} {'per 10k':>8s} {'95% up':>8s}  by rule")
    for i, model in enumerate(models):
        for label, prefix in prefixes.items():
            if not units.take():
                continue
            tl = run_live(ps, model, args.routes, args.windows, args.seed + i + set_seed[label], prefix)
            row = {"model": model.name, "routes": label, "windows": tl.windows, "rollbacks": tl.rollbacks,
                   "per_10k": 1e4 * tl.rollbacks / tl.windows, "upper95_per_10k": 1e4 * upper95(tl.rollbacks, tl.windows),
                   "by_rule": tl.by_rule, "target": model.target, "margins": margin_summary(tl.margins)}
            res["live"].append(row)
            print(f"{model.name:28s} {label:>6s} {tl.windows:8d} {tl.rollbacks:9d} {row['per_10k']:8.2f} "
                  f"{row['upper95_per_10k']:8.2f}  {tl.by_rule}")
            for rule, mg in row["margins"].items():
                print(f"    margin {rule:34s} max {mg['max']:+.2f}  mean {mg['mean']:+.2f} sd {mg['sd']:.2f}  "
                      f"extrapolated {mg['extrapolated_per_10k']:.2g} per 10k")
    golden = GOLDEN_MODELS[1:2] + GOLDEN_MODELS[3:] if args.quick else GOLDEN_MODELS
    if "golden" not in parts:
        golden = []
    if "trained" in parts and DRIFT_SHAPE.exists() and not args.quick:
        golden = golden + TRAINED_MODELS
    for i, g in enumerate(golden):
        for label, prefix in prefixes.items():
            if not units.take():
                continue
            tg = run_golden(ps, g, args.golden_routes, args.replays, args.seed + 100 + i + set_seed[label], prefix)[0]
            row = {"model": g.name, "routes": label, "replays": tg.windows, "rollbacks": tg.rollbacks,
                   "per_10k": 1e4 * tg.rollbacks / tg.windows, "upper95_per_10k": 1e4 * upper95(tg.rollbacks, tg.windows),
                   "by_rule": tg.by_rule}
            res["golden"].append(row)
            print(f"{g.name:28s} {label:>6s} {tg.windows:8d} {tg.rollbacks:9d} {row['per_10k']:8.2f} "
                  f"{row['upper95_per_10k']:8.2f}  {tg.by_rule}")
    print(f"  ({time.perf_counter() - t_start:.0f} s)")
    # power: regressions from window/replay `onset` on, on fresh routes with a healthy history
    n_pow = 8 if args.quick else args.power_routes
    onset = 30 if args.quick else 110  # replays / windows of healthy history before the regression
    golden_power = ((GOLDEN_MODELS[1], GOLDEN_MODELS[3]) if "power" in parts else ()) + \
        (tuple(TRAINED_MODELS[:1]) if "trained" in parts and DRIFT_SHAPE.exists() and not args.quick else ())
    # golden: 40 healthy replays before the drop (the per-item levels are a mean of at most 24)
    g_onset = 30 if args.quick else 40
    for label, prefix in (list(prefixes.items())[-1:] if args.quick else prefixes.items()):
        for g in golden_power:
            if not units.take():
                continue
            # the targets on a fixed set (strict 0.99, default 0.95) need enough routes to resolve them
            n_gpow = 8 if args.quick else args.golden_power_routes if g != GOLDEN_MODELS[1] \
                else args.strict_power_routes if label == "legal" else args.default_power_routes
            tgs = run_golden(ps, g, n_gpow, g_onset + 2, args.seed + 300, prefix, damages=("diffuse", "concentrated"),
                             onset=g_onset)
            for damage, tg in zip(("diffuse", "concentrated"), tgs, strict=True):
                p = power(tg, g_onset, 2)
                res["power"].append({"scenario": f"golden -0.03 {damage} ({g.name})", "routes": label,
                                     "within": "2 replays", "power": p, "n": n_gpow, "by_rule": tg.by_rule})
                print(f"power {label:6s} {g.name:20s} -0.03 {damage:12s} within 2 replays: {p:.3f} "
                      f"({n_gpow} routes) {tg.by_rule}")
        for g in (golden_power[:2] + (GOLDEN_MODELS[2], GOLDEN_MODELS[4])) if "power" in parts else ():
            if not units.take():
                continue
            # damage present from the first replay: nothing healthy to learn from first
            n_first = 8 if args.quick else args.golden_power_routes
            tg = run_golden(ps, g, n_first, 2, args.seed + 350, prefix, damages=("concentrated",), onset=0)[0]
            p = power(tg, 0, 2)
            res["power"].append({"scenario": f"golden -0.03 concentrated from the first replay ({g.name})",
                                 "routes": label, "within": "2 replays", "power": p, "n": n_first, "by_rule": tg.by_rule})
            print(f"power {label:6s} {g.name:20s} -0.03 concentrated from replay 0 within 2 replays: {p:.3f} "
                  f"({n_first} routes) {tg.by_rule}")
        # the latency rules are the default policy's (the strict one has none that rolls back): their
        # power is measured on the chat routes only, with more of them
        if "power" not in parts or (label == "legal" and not args.quick):
            continue
        regs = {"p99-only +10%": (Regression(onset=onset, p99=0.10), 5),
                "whole distribution +10%": (Regression(onset=onset, shift=0.10), 3)}
        for model in (LIVE_MODELS[0], LIVE_MODELS[2]):
            if not units.take():
                continue
            tls = run_live_branches(ps, model, n_pow, onset + 5, args.seed + 400, prefix, [r for r, _ in regs.values()])
            for (name, (_, within)), tl in zip(regs.items(), tls, strict=True):
                p = power(tl, onset, within)
                res["power"].append({"scenario": f"{name} ({model.name})", "routes": label, "n": n_pow,
                                     "within": f"{within} windows", "power": p, "by_rule": tl.by_rule})
                print(f"power {label:6s} {model.name:20s} {name:24s} within {within} windows: {p:.3f} "
                      f"({n_pow} routes) {tl.by_rule}")
            if label == "chat":  # the baselines are matched to our power on the chat routes
                compare_baselines(res, args, n_pow, onset, model)
        print(f"  ({time.perf_counter() - t_start:.0f} s)")
    if ("confounders" in parts or args.quick) and units.take():
        # single-replica stalls, staggered deploys, router bias (bench/fleet_confounders.py; its own
        # command runs the power and the baselines): opt-in in a full run, tiny in --quick
        from bench.fleet_confounders import FLEET_MODELS, healthy_rows

        quick = FLEET_MODELS[:2] if args.quick else None
        res["fleet"] = healthy_rows(ps, 1 if args.quick else args.routes, 30 if args.quick else args.windows, args.seed,
                                    quick)
    if ("traffic" in parts or args.quick) and units.take():
        from bench.fleet_traffic import run_all

        run_all(ps, res, quick=args.quick, seed=args.seed, routes=args.routes, windows=args.windows,
                power_routes=args.fleet_power_routes)
        print(f"  ({time.perf_counter() - t_start:.0f} s)")
    units.close()
    res["seconds"] = time.perf_counter() - t_start
    print(f"total {res['seconds']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
