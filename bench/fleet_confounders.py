"""Fleet confounders for the decision benchmark: single-replica stalls, staggered deploys, router bias
(docs/BENCHMARKS_decisions.md, "Fleet confounders"). Seeded; run through the shipped engine and policies.

Every window is simulated request by request (a few thousand per precision): each request has a
prompt and a completion length, a replica and a build, and its latency follows an LLM-serving
shape,

    latency_ms = (100 + 0.3 P + 20 C (1 + P / 8000)) x exp(0.2 z) x replica x precision effects

(P prompt tokens: "short" ~ LogNormal(ln 300, 0.5), "long" ~ LogNormal(ln 3000, 0.5), 30 % long;
C completion tokens ~ LogNormal(ln 150, 0.3); prefill 0.3 ms per prompt token, decode 20 ms per
token, slower with a long context; the log latency's sd is ~0.35 overall, as in the
benchmark's other models, of which the mix explains about two thirds of the variance). FP8 runs on 8 replicas, FP16 (15 % of 7,000 requests per window)
on 2; each replica has a fixed offset (sd 2 %) and each precision an AR(1) offset (sd 2 %, rho
0.95). The windows carry what watchdog/windows/ writes: the latency sketch, the request-mix cells,
per-replica sketches and cells, and the build counts.

Confounders (each its own model; all healthy: per request FP8 = FP16):

* ``stalls``: in 1 % of windows one replica of one precision (either, at random) stalls: 2-6 % of
  that precision's requests, all on that replica, take 5-20 x as long (a GC or allocator pause).
* ``stalls-frequent``: the same in 5 % of windows (to measure power next to stalls).
* ``deploys``: every ~100 windows (per route, at random) a new build reaches one precision (either
  first), the other 1-3 windows later; the build changes every request's latency by x0.85-1.20 (the
  same on both precisions), its first window is half old and half new build, and a new build's first
  window runs 30 % slower (cold caches). Events name the build.
* ``deploys-annotated``: the same deploys, with no build on the events; the operator declares
  maintenance for the deploy (from the first side's switch until the second side's) instead.
* ``router-bias``: for stretches of 1-6 hours (starting on average every 4 hours) the router sends
  FP8 10-25 points more long prompts than FP16 (total mix unchanged).

Regressions (power), from window ``onset`` on FP8 only: ``whole +10 %`` (every FP8 latency x1.1) and
``p99 +10 %`` (FP8 latencies x (1 + 0.1 ramp(rank; 0.9 -> 0.99)): p99 +10 %, median unchanged).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.decisions import (  # noqa: E402
    LOG_G,
    T0,
    WINDOW_S,
    Regression,
    Tally,
    _observe,
    _record_margins,
    _tail,
    upper95,
)
from watchdog.core.signals import Signal  # noqa: E402
from watchdog.policy.changes import mark_maintenance  # noqa: E402
from watchdog.policy.engine import PolicyEngine  # noqa: E402
from watchdog.policy.loader import PolicySet  # noqa: E402
from watchdog.windows.fleet import MAX_TAIL_BUCKETS, TAIL_WIDTH  # noqa: E402

TOTAL = 7000
FP16_SHARE = 0.15
REPLICAS = {"fp8": 8, "fp16": 2}
LONG_SHARE = 0.30


@dataclass(frozen=True)
class Fleet:
    name: str
    stall_rate: float = 0.0
    deploy_every: float = 0.0       # mean windows between deploys (0: none)
    annotate: bool = False          # deploys announced as maintenance instead of a build field
    bias_every: float = 0.0         # mean windows between router-bias stretches (0: none)
    target: bool = True


FLEET_MODELS = [
    Fleet("stalls", stall_rate=0.01),
    Fleet("deploys", deploy_every=100),
    Fleet("deploys-annotated", deploy_every=100, annotate=True),
    Fleet("router-bias", bias_every=48),
    Fleet("stalls-frequent", stall_rate=0.05, target=False),
]


def _ar1(rng: np.random.Generator, shape: tuple[int, int], sd: float, rho: float = 0.95) -> np.ndarray:
    out = np.zeros(shape)
    out[:, 0] = rng.normal(0, sd, shape[0])
    inno = rng.normal(0, sd * math.sqrt(1 - rho * rho), shape)
    for t in range(1, shape[1]):
        out[:, t] = rho * out[:, t - 1] + inno[:, t]
    return out


def _octave(x: np.ndarray) -> np.ndarray:
    """int.bit_length of non-negative integers."""
    return np.where(x > 0, np.floor(np.log2(np.maximum(x, 1))).astype(int) + 1, 0)


def _sketch(bins: list[list[int]]) -> dict[str, Any]:
    return {"relative_accuracy": 0.01, "min_value": 1e-3, "count": int(sum(c for _, c in bins)), "zero_count": 0,
            "bins": bins}


def _grouped(group: np.ndarray, groups: int, idx: np.ndarray, cell: np.ndarray, y: np.ndarray
             ) -> tuple[list[list[list[int]]], list[list[list[float]]]]:
    """Per group (replica): its sketch bins [[bucket, count], ...] and its mix cells
    [[prompt octave, completion octave, n, sum y, sum y^2], ...], in a few vectorised passes."""
    lo = int(idx.min())
    keys, counts = np.unique(group * 100_000 + (idx - lo), return_counts=True)
    g_of = keys // 100_000
    rows = np.column_stack((keys % 100_000 + lo, counts)).tolist()
    cut = np.searchsorted(g_of, np.arange(groups + 1))
    bins = [rows[cut[g]:cut[g + 1]] for g in range(groups)]
    ckeys, inv = np.unique(group * 4096 + cell, return_inverse=True)
    n = np.bincount(inv)
    s = np.bincount(inv, weights=y)
    q = np.bincount(inv, weights=y * y)
    c_of = ckeys // 4096
    cc = ckeys % 4096
    crow = np.column_stack((cc >> 6, cc & 63, n, s, q)).tolist()
    ccut = np.searchsorted(c_of, np.arange(groups + 1))
    return bins, [crow[ccut[g]:ccut[g + 1]] for g in range(groups)]


def _mix_tails(cell: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """The window's per-cell tail histograms as ``watchdog.windows.fleet.FleetStats.detail`` writes them
    (``latency_mix``'s ``tail_width`` and ``tails``: buckets ``ceil(y / TAIL_WIDTH)``, at most
    ``MAX_TAIL_BUCKETS`` per cell, the lowest folded into the lowest kept)."""
    b = np.ceil(y / TAIL_WIDTH).astype(np.int64)
    lo = int(b.min()) if b.size else 0
    keys, counts = np.unique(cell.astype(np.int64) * 1_000_000 + (b - lo), return_counts=True)
    c_of = keys // 1_000_000
    rows: list[list[Any]] = []
    for c in np.unique(c_of):
        sel = c_of == c
        ks, cs = (keys[sel] % 1_000_000 + lo).tolist(), counts[sel].tolist()
        if len(ks) > MAX_TAIL_BUCKETS:
            cut = len(ks) - MAX_TAIL_BUCKETS
            cs = [sum(cs[:cut + 1])] + cs[cut + 1:]
            ks = ks[cut:]
        rows.append([int(c) >> 6, int(c) & 63, [[k, n] for k, n in zip(ks, cs, strict=True)]])
    return {"tail_width": TAIL_WIDTH, "tails": rows}


class FleetSim:
    """Request-level windows of ``routes`` routes over ``windows`` windows for one confounder model."""

    def __init__(self, model: Fleet, routes: int, windows: int, seed: int, reg: Regression | None = None) -> None:
        self.m, self.R, self.W, self.reg = model, routes, windows, reg or Regression()
        rng = self.rng = np.random.default_rng(seed)
        shape = (routes, windows)
        self.prec_off = {p: _ar1(rng, shape, 0.02) for p in ("fp8", "fp16")}
        self.rep_off = {p: rng.normal(0, 0.02, (routes, k)) for p, k in REPLICAS.items()}
        # deploys: per route a schedule of (window of the first side, first side, lag, factor)
        self.build = {p: np.zeros(shape, dtype=int) for p in REPLICAS}      # build index in force
        self.half = {p: np.zeros(shape, dtype=bool) for p in REPLICAS}      # window half old / half new
        self.factor = np.ones((routes, 64))                                 # latency factor of build k
        self.maint: list[tuple[str, float, float]] = []                     # (route index, start, until)
        self.maint_spans: dict[int, list[tuple[float, float]]] = {}
        if model.deploy_every:
            for r in range(routes):
                t, k = 0, 0
                while True:
                    t += int(rng.geometric(1 / model.deploy_every))
                    if t >= windows or k >= 62:
                        break
                    k += 1
                    self.factor[r, k] = self.factor[r, k - 1] * rng.uniform(0.85, 1.20)
                    first = "fp8" if rng.random() < 0.5 else "fp16"
                    lag = int(rng.integers(1, 4))
                    for p, at in ((first, t), ("fp16" if first == "fp8" else "fp8", t + lag)):
                        if at < windows:
                            self.build[p][r, at:] = k
                            self.half[p][r, at] = True
                    self.maint_spans.setdefault(r, []).append((T0 + t * WINDOW_S, T0 + (t + lag + 1) * WINDOW_S))
                    t += lag
        # router bias: extra share of long prompts FP8 gets over FP16, per route and window
        self.bias = np.zeros(shape)
        if model.bias_every:
            for r in range(routes):
                t = 0
                while True:
                    t += int(rng.geometric(1 / model.bias_every))
                    if t >= windows:
                        break
                    length = int(rng.integers(12, 73))
                    self.bias[r, t:t + length] = rng.uniform(0.10, 0.25)
                    t += length
        self.stall = rng.random(shape) < model.stall_rate

    def _requests(self, r: int, t: int, prec: str, n: int, long_share: float, stall: tuple[int, float, float] | None,
                  bad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rng = self.rng
        long = rng.random(n) < long_share
        p_tok = np.maximum(np.round(np.exp(np.where(long, math.log(3000), math.log(300)) + 0.5 * rng.normal(size=n))), 1)
        c_tok = np.clip(np.round(np.exp(math.log(150) + 0.3 * rng.normal(size=n))), 1, 4000)
        lat = (100 + 0.3 * p_tok + 20 * c_tok * (1 + p_tok / 8000)) * np.exp(0.2 * rng.normal(size=n))
        rep = rng.integers(0, REPLICAS[prec], n)
        lat *= np.exp(self.prec_off[prec][r, t] + self.rep_off[prec][r, rep])
        k = self.build[prec][r, t]
        f = np.full(n, self.factor[r, k])
        if k > 0 and (t == 0 or self.build[prec][r, t - 1] != k):
            f *= 1.3  # a new build's first window: cold caches
        if self.half[prec][r, t]:
            old = rng.random(n) < 0.5
            f = np.where(old, self.factor[r, k - 1], f)
            builds = np.where(old, k - 1, k)
        else:
            builds = np.full(n, k)
        lat *= f
        if stall is not None:
            rid, share, mult = stall
            on = np.flatnonzero(rep == rid)
            take = on[: min(on.size, int(round(share * n)))]
            lat[take] *= mult
        if bad and self.reg.shift:
            lat *= 1 + self.reg.shift
        if bad and self.reg.p99:
            u = (np.argsort(np.argsort(lat)) + 0.5) / n
            lat *= _tail(u, self.reg.p99)
        return lat, p_tok.astype(int), c_tok.astype(int), rep, builds

    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        m, rng, reg = self.m, self.rng, self.reg
        start = T0 + t * WINDOW_S
        out: list[Signal] = []
        for r, route in enumerate(routes):
            stall_side = ("fp8" if rng.random() < 0.5 else "fp16") if self.stall[r, t] else None
            b = self.bias[r, t]
            for prec in ("fp8", "fp16"):
                share = FP16_SHARE if prec == "fp16" else 1 - FP16_SHARE
                n = max(int(rng.poisson(TOTAL * share)), 1)
                long_share = LONG_SHARE + (b * FP16_SHARE if prec == "fp8" else -b * (1 - FP16_SHARE))
                stall = None
                if stall_side == prec:
                    stall = (int(rng.integers(0, REPLICAS[prec])), float(rng.uniform(0.02, 0.06)),
                             float(rng.uniform(5, 20)))
                bad = prec == "fp8" and t >= reg.onset
                lat, p_tok, c_tok, rep, builds = self._requests(r, t, prec, n, long_share, stall, bad)
                errors = int(rng.binomial(n, 0.01))
                timeouts = int(rng.binomial(n, 0.002))
                ok = n - errors - timeouts
                lat, p_tok, c_tok, rep = lat[:ok], p_tok[:ok], c_tok[:ok], rep[:ok]
                idx = np.ceil(np.log(lat) / LOG_G).astype(int)
                y = np.log(lat)
                cell = (_octave(p_tok) << 6) | _octave(c_tok)
                k = REPLICAS[prec]
                bins, cells = _grouped(np.concatenate([rep, np.full(ok, k)]), k + 1, np.concatenate([idx, idx]),
                                       np.concatenate([cell, cell]), np.concatenate([y, y]))
                sk = _sketch(bins[k])
                q = np.exp(np.quantile(y, [0.5, 0.95, 0.99]))
                replicas = {f"{prec}-{i}": {"latency_hist": _sketch(bins[i]), "cells": cells[i]}
                            for i in range(k) if bins[i]}
                detail: dict[str, Any] = {"events": n, "ok": ok, "errors": errors, "timeouts": timeouts,
                                          "completions": ok, "empty": 0, "logprob_tokens": 0, "latency_hist": sk,
                                          "latency_mix": {"cells": cells[k], **_mix_tails(cell, y)},
                                          "replicas": replicas,
                                          "prompt_tokens": int(p_tok.sum()), "completion_tokens": int(c_tok.sum())}
                if not m.annotate and m.deploy_every:
                    ks, cs = np.unique(builds, return_counts=True)
                    detail["builds"] = {f"build-{k}": int(c) for k, c in zip(ks, cs, strict=True)}
                values = {"error_rate": (errors + timeouts) / n, "timeout_rate": timeouts / n,
                          "latency_p50_ms": float(q[0]), "latency_p95_ms": float(q[1]), "latency_p99_ms": float(q[2]),
                          "empty_rate": 0.0, "mean_completion_tokens": float(c_tok.mean())}
                out.append(Signal("live", "m", route, prec, start, start + WINDOW_S, n, values, None, None, detail))
        if m.annotate:
            spans = {("m", routes[r]): s for r, s in self.maint_spans.items()}
            mark_maintenance(out, spans)
        return out


@dataclass
class BaselineData:
    """Per route and window what the baselines read: FP8/FP16 ratio of medians and of p99s, and
    Kayenta's Mann-Whitney 98 % interval (low end, estimate) of the log ratio."""

    ratio50: np.ndarray
    ratio99: np.ndarray
    k_lo: np.ndarray
    k_est: np.ndarray


def _baseline_row(sigs: list[Signal], i: int) -> tuple[float, float, float, float]:
    from watchdog.policy.evaluate import sketch_histograms
    from watchdog.policy.judge.unpaired import judge_unpaired

    c, b = sigs[2 * i], sigs[2 * i + 1]
    hc, hb, gamma = sketch_histograms(c.detail["latency_hist"], b.detail["latency_hist"])
    j = judge_unpaired(hc, hb, effect_threshold=0.0, alpha=0.02, gamma=gamma)
    return (c.values["latency_p50_ms"] / b.values["latency_p50_ms"], c.values["latency_p99_ms"] / b.values["latency_p99_ms"],
            j.ci_low or 0.0, j.estimate or 0.0)


def run_fleet(ps: PolicySet, model: Fleet, routes: int, windows: int, seed: int, prefix: str,
              reg: Regression | None = None, baselines: bool = False, onset_copy: bool = False
              ) -> tuple[Tally, BaselineData | None]:
    """One run of ``routes`` routes over ``windows`` windows through the shipped engine; every
    rollback counted (the route starts afresh, learned nulls kept). With ``baselines`` the
    baselines' inputs of every window are recorded too."""
    sim = FleetSim(model, routes, windows, seed, reg)
    names = [f"{prefix}/f{i}" for i in range(routes)]
    engine = PolicyEngine(ps)
    flags = {("m", r): "fp8" for r in names}
    tally = Tally(first=[-1] * routes)
    bd = BaselineData(*(np.zeros((routes, windows)) for _ in range(4))) if baselines else None
    for t in range(windows):
        sigs = sim.signals(t, names)
        _observe(engine, sigs, T0 + (t + 1) * WINDOW_S + 1, flags, names, tally, t)
        if reg is None:
            _record_margins(engine, tally, T0 + (t + 1) * WINDOW_S)
        tally.windows += routes
        if bd is not None:
            for i in range(routes):
                bd.ratio50[i, t], bd.ratio99[i, t], bd.k_lo[i, t], bd.k_est[i, t] = _baseline_row(sigs, i)
    return tally, bd


def summary_row(model: Fleet, label: str, tl: Tally) -> dict[str, Any]:
    return {"model": model.name, "routes": label, "windows": tl.windows, "rollbacks": tl.rollbacks,
            "per_10k": 1e4 * tl.rollbacks / tl.windows, "upper95_per_10k": 1e4 * upper95(tl.rollbacks, tl.windows),
            "by_rule": tl.by_rule, "target": model.target}


def run_fleet_branches(ps: PolicySet, model: Fleet, routes: int, windows: int, seed: int, prefix: str,
                       regs: list[Regression], baselines: bool = False) -> list[tuple[Tally, BaselineData | None]]:
    """One healthy run up to the regressions' common onset, then one continuation per regression
    from a copy of the engine and the simulator (as ``bench.decisions.run_live_branches``)."""
    import copy

    onset = min(r.onset for r in regs)
    sim = FleetSim(model, routes, windows, seed, None)
    names = [f"{prefix}/f{i}" for i in range(routes)]
    engine = PolicyEngine(ps)
    flags = {("m", r): "fp8" for r in names}
    prefix_tally = Tally(first=[-1] * routes)
    bd = BaselineData(*(np.zeros((routes, windows)) for _ in range(4))) if baselines else None

    def step(e: PolicyEngine, s: FleetSim, tl: Tally, b: BaselineData | None, t: int) -> None:
        sigs = s.signals(t, names)
        _observe(e, sigs, T0 + (t + 1) * WINDOW_S + 1, flags, names, tl, t)
        tl.windows += routes
        if b is not None:
            for i in range(routes):
                b.ratio50[i, t], b.ratio99[i, t], b.k_lo[i, t], b.k_est[i, t] = _baseline_row(sigs, i)

    for t in range(onset):
        step(engine, sim, prefix_tally, bd, t)
    out = []
    for reg in regs:
        tl, e2, s2, b2 = copy.deepcopy(prefix_tally), copy.deepcopy(engine), copy.deepcopy(sim), copy.deepcopy(bd)
        s2.reg = reg
        for t in range(onset, windows):
            step(e2, s2, tl, b2, t)
        out.append((tl, b2))
    return out


def baseline_rollbacks(kind: str, x: float, bd: BaselineData) -> tuple[np.ndarray, np.ndarray]:
    """(rollbacks per route, first rollback window) of a baseline at setting ``x``: Flagger-style
    (``flagger50``: median ratio, ``flagger99``: p99 ratio > 1 + x; rollback at 2 failed checks of an
    analysis of 10) or Kayenta-style (Mann-Whitney 98 % interval excludes 0 and the Hodges-Lehmann
    ratio exceeds the allowance x; rolls back at once)."""
    from bench.baselines import FlaggerConfig, flagger_rollbacks

    if kind == "kayenta":
        failed = (bd.k_lo > 0) & (bd.k_est > x)
    else:
        failed = (bd.ratio50 if kind == "flagger50" else bd.ratio99) > 1 + x
    cfg = FlaggerConfig(failure_threshold=1 if kind == "kayenta" else 2, iterations=10)
    return flagger_rollbacks(failed, cfg)


def matched_baseline(kind: str, ours: float, bad: BaselineData, healthy: BaselineData, onset: int, within: int
                     ) -> dict[str, Any]:
    """The loosest setting (0 to 50 % in steps of 0.25 %) whose power reaches ``ours`` on ``bad``,
    and its false rollbacks per 10k healthy windows on ``healthy``."""
    for x in np.round(np.arange(0.5, -1e-9, -0.0025), 4):
        _, first = baseline_rollbacks(kind, float(x), bad)
        early = int(np.sum((first >= 0) & (first < onset)))
        pw = float(np.sum((first >= onset) & (first < onset + within)) / max(first.size - early, 1))
        if pw >= ours:
            rb, _ = baseline_rollbacks(kind, float(x), healthy)
            return {"setting": float(x), "power": pw, "false_per_10k": 1e4 * float(rb.sum()) / healthy.ratio50.size}
    return {"setting": None, "power": None, "false_per_10k": None}


def healthy_rows(ps: PolicySet, routes: int, windows: int, seed: int, models: list[Fleet] | None = None
                 ) -> list[dict[str, Any]]:
    """False rollbacks of every target confounder model on both route sets (``bench/decisions.py
    --parts confounders``; ``--quick`` runs it tiny, as a smoke test)."""
    rows = []
    for i, m in enumerate(models or [m for m in FLEET_MODELS if m.target]):
        for j, label in enumerate(("legal", "chat")):
            tl, _ = run_fleet(ps, m, routes, windows, seed + 500 + 1000 * j + i, label)
            rows.append(summary_row(m, label, tl))
            print(f"fleet {m.name:18s} {label:6s} {tl.windows:7d} windows {tl.rollbacks:3d} rollbacks  {tl.by_rule}")
    return rows


#: power scenarios: (name, background model, regression, within windows)
POWER = [
    ("whole +10%", "clean", Regression(shift=0.10), 3),
    ("whole +10%", "router-bias", Regression(shift=0.10), 3),
    ("p99 +10%", "clean", Regression(p99=0.10), 5),
    ("p99 +10%", "stalls", Regression(p99=0.10), 5),
    ("p99 +10%", "stalls-frequent", Regression(p99=0.10), 5),
]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import time
    from dataclasses import replace
    from pathlib import Path

    from bench.decisions import ROOT, power
    from watchdog.policy.loader import load_policy_files

    ap = argparse.ArgumentParser(description="fleet confounders through the shipped engine")
    ap.add_argument("policies", nargs="*", default=[str(p) for p in sorted((ROOT / "policies").glob("*.yaml"))])
    ap.add_argument("--routes", type=int, default=16)
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--power-routes", type=int, default=40)
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--models", default=",".join(m.name for m in FLEET_MODELS))
    ap.add_argument("--route-sets", default="legal,chat")
    ap.add_argument("--parts", default="healthy,power")
    ap.add_argument("--baselines", action="store_true", help="record the baselines' inputs and match them")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ps = load_policy_files(args.policies)
    res: dict[str, Any] = {"healthy": [], "power": [], "baselines": [], "args": vars(args)}
    t0 = time.perf_counter()
    models = {m.name: m for m in FLEET_MODELS}
    models["clean"] = Fleet("clean")
    healthy_bd: dict[str, BaselineData] = {}
    parts = set(args.parts.split(","))
    for i, name in enumerate(args.models.split(",")):
        if "healthy" not in parts:
            break
        m = models[name]
        for j, label in enumerate(args.route_sets.split(",")):
            tl, bd = run_fleet(ps, m, args.routes, args.windows, args.seed + 1000 * j + i, label,
                               baselines=args.baselines and label == "chat")
            if bd is not None:
                healthy_bd[name] = bd
            row = summary_row(m, label, tl)
            res["healthy"].append(row)
            print(f"{name:18s} {label:6s} {tl.windows:7d} windows {tl.rollbacks:3d} rollbacks "
                  f"({row['per_10k']:.2f} per 10k, 95% <= {row['upper95_per_10k']:.2f})  {tl.by_rule}  "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    onset = 110
    if "power" in parts:
        by_bg: dict[str, list[tuple[str, Regression, int]]] = {}
        for name, bg, reg, within in POWER:
            if bg in args.models.split(",") or bg == "clean":
                by_bg.setdefault(bg, []).append((name, replace(reg, onset=onset), within))
        for bg, scen in by_bg.items():
            outs = run_fleet_branches(ps, models[bg], args.power_routes, onset + 5, args.seed + 400, "chat",
                                      [r for _, r, _ in scen], baselines=args.baselines)
            for (name, _, within), (tl, bd) in zip(scen, outs, strict=True):
                p = power(tl, onset, within)
                res["power"].append({"scenario": name, "background": bg, "within": within, "power": p,
                                     "routes": args.power_routes, "by_rule": tl.by_rule})
                print(f"power {name:12s} on {bg:16s} within {within} windows: {p:.3f} ({args.power_routes} routes) "
                      f"{tl.by_rule}  [{time.perf_counter() - t0:.0f} s]", flush=True)
                if bd is not None and bg in healthy_bd:
                    kinds = ("flagger50", "kayenta") if name.startswith("whole") else ("flagger99", "kayenta")
                    for kind in kinds:
                        row = {"baseline": kind, "scenario": name, "background": bg, "our_power": p,
                               **matched_baseline(kind, p, bd, healthy_bd[bg], onset, within)}
                        res["baselines"].append(row)
                        print(f"   baseline {kind:9s} matched: {row}", flush=True)
    res["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
