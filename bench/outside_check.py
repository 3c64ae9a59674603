"""Outside check of the decision engine (issue 17): shapes the project's own generators do not draw.

Every window goes through the shipped ``PolicyEngine.observe`` with ``policies/*.yaml`` loaded as
the daemon loads them, on ``legal/...`` routes (covered by both shipped policies: a rollback is
counted for its policy and for every policy in its ``also`` list). The plumbing - the window's
latency sketch, request-mix cells, per-replica sketches and cells, build counts, maintenance marks,
the rollback bookkeeping - is ``bench/fleet_confounders.py`` / ``bench/decisions.py``'s; the noise
is not (all parameters below are this file's own, seeded).

Request model (per route, window, precision; 5-minute windows as the benchmark's):

    latency_ms = (60 + 0.2 P + 22 C (1 + P / 10000)) x exp(0.25 z) x precision x replica x build x load

P prompt tokens: 25 % "long" ~ LogNormal(ln 2500, 0.6), else LogNormal(ln 250, 0.6); C completion
tokens: 20 % "long answers" ~ LogNormal(ln 700, 0.5), else LogNormal(ln 150, 0.5). FP8 on 8
replicas, FP16 on 3; per-precision AR(1) offset sd 1.5 % (rho 0.9), per-replica offsets sd 1.5 %.
6,000 requests per window, FP16 share 12 %, errors 0.8 %, timeouts 0.3 %. Per request FP8 = FP16.

Healthy shapes (``SHAPES``):

* ``stall-fp16-2win``: stall episodes (mean every 60 windows) on ONE FP16 replica lasting 2-3
  windows: 3-8 % of FP16's requests (all on that replica) x20.
* ``stall-2of8``: episodes on TWO of the 8 FP8 replicas at once, 2-3 windows, each 1.5-3 % of
  FP8's requests x20.
* ``deploy-slow``: a new build every ~80 windows, the second precision 4-6 windows after the
  first; x0.85-1.20 on both precisions alike; a new build's first window x1.4 (cold); events name
  the build; one FP8 replica's clock is 30 s behind (10 % of its events of window t are those of
  t + 1: it shows each change one window early on a tenth of its requests).
* ``maint-one-side``: one precision only is restarted / patched (every ~80 windows; same speed
  after), no build field, the operator annotates maintenance for the 2 windows it takes; during
  them a rolling restart leaves 1-3 of that side's replicas cold (x1.3-1.6).
* ``bias-completion``: stretches of 1-6 hours (every ~4 hours) in which the router sends FP8
  10-25 points more LONG ANSWERS (completion-length mix), and in half of them the prompt-length
  bias the other way (FP16 more long prompts).
* ``ramp-2%``: diurnal traffic ramping x10 within an hour (600 -> 6,000 requests per window over
  12 windows, night 8 h, day 13 h), latency x(1 + 0.15 load) on both; FP16 share 2 %.
* ``new-route-20``: brand-new routes at 20 requests per precision and window; a staggered deploy
  (build named, 1-5 windows apart) lands in each route's windows 3-10, while the route is cold.

Golden (hourly replays, ``GOLDEN_SHAPES``): per-item healthy FP8 - FP16 levels (80 % unchanged,
17 % N(0, 0.12), 3 % +-U(0.3, 0.7)); sampled serving: a share of "open" items whose answer is a
fresh sample in each replay with probability 0.8, moving the item's score by U(-0.5, 0.5): ~20 % /
~25 % of items move by more than 0.2 between two replays of the same engine (measured and printed).
``golden-50-s20``, ``golden-200-s25``. The A/A pass is FP16's second answer minus its first.

Regressions (power): ``whole`` (every FP8 latency x1.1), ``p99`` (FP8's slowest 10 % ramped to
+10 % at p99), ``shift30`` (+30 %), golden ``concentrated`` (6 % of items -0.5: -0.03, from the first
replay), ``broken`` (FP8 answers garbage: every item's FP8 score 0, exact match 0).

Run: ``PYTHONPATH=. python bench/outside_check.py [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.decisions import LOG_G, ROOT, T0, WINDOW_S, _reset_route, _tail
from bench.fleet_confounders import _grouped, _mix_tails, _octave, _sketch
from watchdog.core.signals import Signal
from watchdog.policy.changes import mark_maintenance
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.loader import PolicySet, load_policy_files

POLICIES = ("fp8-default", "fp8-strict-legal-medical")


@dataclass(frozen=True)
class Shape:
    name: str
    total: int = 6000
    fp16_share: float = 0.12
    fp8_replicas: int = 8
    fp16_replicas: int = 3
    stall_every: float = 0.0
    stall_side: str = "fp16"
    stall_replicas: int = 1
    stall_share: tuple[float, float] = (0.03, 0.08)
    deploy_every: float = 0.0
    deploy_lag: tuple[int, int] = (4, 6)
    one_side: bool = False         # maintenance of one precision only (no build field, annotated)
    clock_skew: bool = False
    bias_every: float = 0.0
    ramp: bool = False
    per_precision: int = 0         # fixed requests per precision (low traffic)
    cold_deploy: bool = False


SHAPES = [
    Shape("stall-fp16-2win", stall_every=60, stall_side="fp16"),
    Shape("stall-2of8", stall_every=60, stall_side="fp8", stall_replicas=2, stall_share=(0.015, 0.03)),
    Shape("deploy-slow", deploy_every=80, clock_skew=True),
    Shape("maint-one-side", deploy_every=80, one_side=True),
    Shape("bias-completion", bias_every=48),
    Shape("ramp-2%", ramp=True, fp16_share=0.02),
    Shape("new-route-20", per_precision=20, cold_deploy=True, deploy_lag=(1, 5)),
]


def _ar1(rng: np.random.Generator, shape: tuple[int, int], sd: float, rho: float = 0.9) -> np.ndarray:
    out = np.zeros(shape)
    out[:, 0] = rng.normal(0, sd, shape[0])
    inno = rng.normal(0, sd * math.sqrt(1 - rho * rho), shape)
    for t in range(1, shape[1]):
        out[:, t] = rho * out[:, t - 1] + inno[:, t]
    return out


def _load(t: int) -> float:
    """Diurnal load of ``ramp``: night 0.1 for 8 h, up x10 within an hour, day 1.0, down over 3 h."""
    h = (t * WINDOW_S / 3600.0) % 24
    if h < 8:
        return 0.1
    if h < 9:
        return 0.1 + 0.9 * (h - 8)
    if h < 21:
        return 1.0
    return 1.0 - 0.9 * (h - 21) / 3


@dataclass
class Reg:
    onset: int = 10**9
    shift: float = 0.0
    p99: float = 0.0


class Sim:
    def __init__(self, s: Shape, routes: int, windows: int, seed: int, reg: Reg | None = None) -> None:
        self.s, self.R, self.W, self.reg = s, routes, windows, reg or Reg()
        rng = self.rng = np.random.default_rng(seed)
        shape = (routes, windows + 1)
        self.k = {"fp8": s.fp8_replicas, "fp16": s.fp16_replicas}
        self.prec_off = {p: _ar1(rng, shape, 0.015) for p in ("fp8", "fp16")}
        self.rep_off = {p: rng.normal(0, 0.015, (routes, k)) for p, k in self.k.items()}
        # builds: index in force per precision and window, cold flag, factor per build
        self.build = {p: np.zeros(shape, dtype=int) for p in self.k}
        self.cold = {p: np.zeros(shape, dtype=bool) for p in self.k}
        self.factor = np.ones((routes, 128))
        self.maint: dict[int, list[tuple[float, float]]] = {}
        self.restart: dict[tuple[int, int, str], list[tuple[int, float]]] = {}  # (r, t, prec) -> cold replicas
        for r in range(routes):
            if s.cold_deploy:
                at0 = int(rng.integers(3, 11))
                self._deploy(r, at0, int(rng.integers(s.deploy_lag[0], s.deploy_lag[1] + 1)), 1, windows + 1)
            elif s.deploy_every:
                t, k = 0, 0
                while True:
                    t += int(rng.geometric(1 / s.deploy_every))
                    if t >= windows or k >= 120:
                        break
                    if s.one_side:
                        side = "fp8" if rng.random() < 0.5 else "fp16"
                        for w in (t, t + 1):
                            cold = rng.choice(self.k[side], int(rng.integers(1, 4)), replace=False)
                            self.restart[(r, w, side)] = [(int(c), float(rng.uniform(1.3, 1.6))) for c in cold]
                        self.maint.setdefault(r, []).append((T0 + t * WINDOW_S, T0 + (t + 2) * WINDOW_S))
                        t += 2
                        continue
                    k += 1
                    lag = int(rng.integers(s.deploy_lag[0], s.deploy_lag[1] + 1))
                    self._deploy(r, t, lag, k, windows + 1)
                    t += lag
        # stall episodes: (route, window) -> (side, [(replica, share)])
        self.stalls: dict[tuple[int, int], tuple[str, list[tuple[int, float]]]] = {}
        if s.stall_every:
            for r in range(routes):
                t = 0
                while True:
                    t += int(rng.geometric(1 / s.stall_every))
                    if t >= windows:
                        break
                    side = s.stall_side
                    reps = rng.choice(self.k[side], s.stall_replicas, replace=False)
                    length = int(rng.integers(2, 4))
                    shares = rng.uniform(*s.stall_share, s.stall_replicas)
                    for w in range(t, min(t + length, windows)):
                        self.stalls[(r, w)] = (side, [(int(a), float(b)) for a, b in zip(reps, shares, strict=True)])
                    t += length
        # router bias: (extra long-answer share to FP8, extra long-prompt share to FP16)
        self.bias_c = np.zeros(shape)
        self.bias_p = np.zeros(shape)
        if s.bias_every:
            for r in range(routes):
                t = 0
                while True:
                    t += int(rng.geometric(1 / s.bias_every))
                    if t >= windows:
                        break
                    length = int(rng.integers(12, 73))
                    self.bias_c[r, t:t + length] = rng.uniform(0.10, 0.25)
                    if rng.random() < 0.5:
                        self.bias_p[r, t:t + length] = rng.uniform(0.10, 0.25)
                    t += length

    def _deploy(self, r: int, t: int, lag: int, k: int, end: int) -> None:
        rng = self.rng
        self.factor[r, k] = self.factor[r, k - 1] * rng.uniform(0.85, 1.20)
        first = "fp8" if rng.random() < 0.5 else "fp16"
        for p, at in ((first, t), ("fp16" if first == "fp8" else "fp8", t + lag)):
            if at < end:
                self.build[p][r, at:] = k
                self.cold[p][r, at] = True

    def _draw(self, r: int, t: int, prec: str, n: int, bias_c: float, bias_p: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        s, rng = self.s, self.rng
        long_p = rng.random(n) < 0.25 + bias_p
        long_c = rng.random(n) < 0.20 + bias_c
        p_tok = np.maximum(np.round(np.exp(np.where(long_p, math.log(2500), math.log(250)) + 0.6 * rng.normal(size=n))), 1)
        c_tok = np.clip(np.round(np.exp(np.where(long_c, math.log(700), math.log(150)) + 0.5 * rng.normal(size=n))),
                        1, 8000)
        lat = (60 + 0.2 * p_tok + 22 * c_tok * (1 + p_tok / 10000)) * np.exp(0.25 * rng.normal(size=n))
        rep = rng.integers(0, self._replicas(r, t, prec), n)
        # the clock-skewed replica (FP8 replica 0) carries 10 % of window t + 1's events
        tt = np.full(n, t)
        if s.clock_skew and prec == "fp8":
            tt = np.where((rep == 0) & (rng.random(n) < 0.1), min(t + 1, self.W), t)
        lat *= np.exp(self.prec_off[prec][r, tt] + self.rep_off[prec][r, rep])
        b = self.build[prec][r, tt]
        f = self.factor[r, b] * np.where(self.cold[prec][r, tt], 1.4, 1.0)
        lat *= f
        if s.ramp:
            lat *= 1 + 0.15 * _load(t)
        for c, mult in self.restart.get((r, t, prec), []):
            lat[rep == c] *= mult
        st = self.stalls.get((r, t))
        if st is not None and st[0] == prec:
            for c, share in st[1]:
                on = np.flatnonzero(rep == c)
                lat[on[: min(on.size, int(round(share * n)))]] *= 20.0
        return lat, p_tok.astype(int), c_tok.astype(int), rep, b

    # hooks that bench/ordinary_days.py overrides
    def _count(self, r: int, t: int, prec: str, load: float) -> int:
        """Requests of one precision in the window (before errors)."""
        s, rng = self.s, self.rng
        if s.per_precision:
            return max(int(rng.poisson(s.per_precision)), 1)
        share = s.fp16_share if prec == "fp16" else 1 - s.fp16_share
        return max(int(rng.poisson(s.total * share * load)), 1)

    def _replicas(self, r: int, t: int, prec: str) -> int:
        return self.k[prec]

    def _names_builds(self) -> bool:
        return bool((self.s.deploy_every or self.s.cold_deploy) and not self.s.one_side)

    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        s, rng, reg = self.s, self.rng, self.reg
        start = T0 + t * WINDOW_S
        out: list[Signal] = []
        load = _load(t) if s.ramp else 1.0
        for r, route in enumerate(routes):
            for prec in ("fp8", "fp16"):
                n = self._count(r, t, prec, load)
                # bias: FP8 gets extra long answers, FP16 extra long prompts (the total mix unchanged)
                f8 = 1 - s.fp16_share
                bc = self.bias_c[r, t] * ((1 - f8) if prec == "fp8" else -f8)
                bp = self.bias_p[r, t] * (f8 if prec == "fp16" else -(1 - f8))
                lat, p_tok, c_tok, rep, builds = self._draw(r, t, prec, n, bc, bp)
                if prec == "fp8" and t >= reg.onset:
                    if reg.shift:
                        lat *= 1 + reg.shift
                    if reg.p99:
                        u = (np.argsort(np.argsort(lat)) + 0.5) / n
                        lat *= _tail(u, reg.p99)
                errors = int(rng.binomial(n, 0.008))
                timeouts = int(rng.binomial(n, 0.003))
                ok = max(n - errors - timeouts, 1)
                lat, p_tok, c_tok, rep = lat[:ok], p_tok[:ok], c_tok[:ok], rep[:ok]
                idx = np.ceil(np.log(lat) / LOG_G).astype(int)
                y = np.log(lat)
                cell = (_octave(p_tok) << 6) | _octave(c_tok)
                k = self._replicas(r, t, prec)
                bins, cells = _grouped(np.concatenate([rep, np.full(ok, k)]), k + 1, np.concatenate([idx, idx]),
                                       np.concatenate([cell, cell]), np.concatenate([y, y]))
                q = np.exp(np.quantile(y, [0.5, 0.95, 0.99]))
                replicas = {f"{prec}-{i}": {"latency_hist": _sketch(bins[i]), "cells": cells[i]}
                            for i in range(k) if bins[i]}
                detail: dict[str, Any] = {"events": n, "ok": ok, "errors": errors, "timeouts": timeouts,
                                          "completions": ok, "empty": 0, "logprob_tokens": 0,
                                          "latency_hist": _sketch(bins[k]),
                                          "latency_mix": {"cells": cells[k], **_mix_tails(cell, y)},
                                          "replicas": replicas, "prompt_tokens": int(p_tok.sum()),
                                          "completion_tokens": int(c_tok.sum())}
                if self._names_builds():
                    ks, cs = np.unique(builds[: n], return_counts=True)
                    detail["builds"] = {f"v{kk}": int(c) for kk, c in zip(ks, cs, strict=True)}
                values = {"error_rate": (errors + timeouts) / n, "timeout_rate": timeouts / n,
                          "latency_p50_ms": float(q[0]), "latency_p95_ms": float(q[1]),
                          "latency_p99_ms": float(q[2]), "empty_rate": 0.0,
                          "mean_completion_tokens": float(c_tok.mean())}
                out.append(Signal("live", "m", route, prec, start, start + WINDOW_S, n, values, None, None, detail))
        if self.maint:
            mark_maintenance(out, {("m", routes[r]): sp for r, sp in self.maint.items()})
        return out


# --- counting -----------------------------------------------------------------------------------


@dataclass
class Count:
    windows: int = 0
    rollbacks: dict[str, int] = field(default_factory=lambda: {p: 0 for p in POLICIES})
    by_rule: dict[str, int] = field(default_factory=dict)
    first: list[int] = field(default_factory=list)
    #: every rollback: (route, window, policy, rules, reason)
    events: list[tuple[str, int, str, list[str], str]] = field(default_factory=list)


def _observe(engine: PolicyEngine, sigs: list[Signal], now: float, flags: dict[tuple[str, str], str],
             names: list[str], c: Count, t: int) -> None:
    """One round of the engine (as bench.decisions._observe), counting per policy (the winner and
    every policy in ``also``)."""
    for a in engine.observe(sigs, now, flags):
        if a.kind != "rollback" or a.detail.get("retry"):
            continue
        pols = {a.policy} | {x.get("policy") for x in a.detail.get("also", [])}
        for p in pols:
            if p in c.rollbacks:
                c.rollbacks[p] += 1
        for rule in a.detail.get("rules", []):
            key = f"{a.policy}:{rule}"
            c.by_rule[key] = c.by_rule.get(key, 0) + 1
        for x in a.detail.get("also", []):
            key = f"{x.get('policy')}:also"
            c.by_rule[key] = c.by_rule.get(key, 0) + 1
        c.events.append((a.route, t, a.policy, list(a.detail.get("rules", [])), str(a.reason)[:300]))
        r = names.index(a.route)
        if c.first[r] < 0:
            c.first[r] = t
        _reset_route(engine, a.route)


def upper95(k: int, n: int) -> float:
    """Exact one-sided 95 % Poisson upper bound of a rate from k events in n windows."""
    if n == 0:
        return math.nan
    lo, hi = 0.0, k + 10 * math.sqrt(k + 1) + 10
    for _ in range(80):
        mid = (lo + hi) / 2
        cdf = sum(math.exp(-mid + i * math.log(mid) - math.lgamma(i + 1)) for i in range(k + 1)) if mid > 0 else 1.0
        lo, hi = (mid, hi) if cdf > 0.05 else (lo, mid)
    return hi / n


def report_row(res: dict[str, Any], kind: str, name: str, c: Count, t0: float) -> dict[str, Any]:
    """``c``'s row (rollbacks, rates and their 95 % bounds per 10,000 windows) appended to ``res[kind]``,
    and printed with the first events."""
    d = {"shape": name, "windows": c.windows, "rollbacks": c.rollbacks, "by_rule": c.by_rule, "events": c.events,
         "per_10k": {p: 1e4 * k / c.windows for p, k in c.rollbacks.items()},
         "upper95_per_10k": {p: 1e4 * upper95(k, c.windows) for p, k in c.rollbacks.items()}}
    res[kind].append(d)
    print(f"{kind:8s} {name:18s} {c.windows:6d} windows  rollbacks {c.rollbacks}  "
          f"bound/10k {{{', '.join(f'{v:.1f}' for v in d['upper95_per_10k'].values())}}}  {c.by_rule}  "
          f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    for e in c.events[:5]:
        print(f"         {e}")
    return d


def run_live(ps: PolicySet, s: Shape, routes: int, windows: int, seed: int, reg: Reg | None = None) -> Count:
    return run_sim(ps, Sim(s, routes, windows, seed, reg), routes, windows, "legal/o")


def run_sim(ps: PolicySet, sim: Sim, routes: int, windows: int, prefix: str) -> Count:
    """``sim``'s windows of ``routes`` routes (``prefix`` + index) through the shipped engine."""
    names = [f"{prefix}{i}" for i in range(routes)]
    engine = PolicyEngine(ps)
    flags = {("m", r): "fp8" for r in names}
    c = Count(first=[-1] * routes)
    for t in range(windows):
        _observe(engine, sim.signals(t, names), T0 + (t + 1) * WINDOW_S + 1, flags, names, c, t)
        c.windows += routes
    return c


def power(c: Count, onset: int, within: int) -> tuple[float, int]:
    early = sum(1 for f in c.first if 0 <= f < onset)
    hits = sum(1 for f in c.first if onset <= f < onset + within)
    n = len(c.first) - early
    return hits / max(n, 1), n


# --- golden -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GShape:
    name: str
    items: int
    open_share: float      # items whose answers are fresh samples (sampled serving)


GOLDEN_SHAPES = [GShape("golden-50-s20", 50, 0.33), GShape("golden-200-s25", 200, 0.42)]


class GSim:
    def __init__(self, g: GShape, routes: int, seed: int) -> None:
        self.g, self.damage = g, ""
        rng = self.rng = np.random.default_rng(seed)
        n = g.items
        u = rng.random((routes, n))
        big = np.where(rng.random((routes, n)) < 0.5, -1, 1) * rng.uniform(0.3, 0.7, (routes, n))
        self.level = np.where(u < 0.80, 0.0, np.where(u < 0.97, np.clip(rng.normal(0, 0.12, (routes, n)), -1, 1), big))
        self.open = rng.random((routes, n)) < g.open_share
        self.fp16_score = rng.beta(5, 2, (routes, n))
        self.broken = np.zeros((routes, n), dtype=bool)
        for r in range(routes):
            self.broken[r, rng.choice(n, round(0.06 * n), replace=False)] = True
        self.names = [f"legal/g{i}" for i in range(routes)]

    def _sample(self, r: int) -> np.ndarray:
        n = self.g.items
        rng = self.rng
        return np.where(self.open[r] & (rng.random(n) < 0.8), rng.uniform(-0.5, 0.5, n), 0.0)

    def moving_share(self, draws: int = 200) -> float:
        return float(np.mean([np.mean(np.abs(self._sample(0) - self._sample(0)) > 0.2) for _ in range(draws)]))

    def signals(self, t: int) -> list[Signal]:
        g = self.g
        start = T0 + t * 3600.0
        out = []
        for r, route in enumerate(self.names):
            e_b, e_c, e_r = self._sample(r), self._sample(r), self._sample(r)
            d = self.level[r] + e_c - e_b
            aa = e_r - e_b
            if self.damage == "concentrated":
                d = d - np.where(self.broken[r], 0.5, 0.0)
            elif self.damage == "broken":
                d = -np.clip(self.fp16_score[r] + e_b, 0, 1)   # FP8 garbage: ROUGE-L 0 on every item
            d, aa = np.clip(d, -1, 1), np.clip(aa, -1, 1)
            em = np.where(d < -0.2, -1.0, np.where(d > 0.2, 1.0, 0.0))
            if self.damage == "broken":
                em = -np.ones(g.items)
            em_aa = np.where(aa < -0.2, -1.0, np.where(aa > 0.2, 1.0, 0.0))
            detail = {"golden_set": "outside", "item_ids": list(range(g.items)),
                      "aa": {"rougeL": aa.tolist(), "exact_match": em_aa.tolist()}}
            out.append(Signal("golden", "m", route, "fp8", start, start + 120, g.items,
                              {"rougeL": 0.6 + float(d.mean()), "exact_match": 0.5 + float(em.mean())},
                              {"rougeL": d.tolist(), "exact_match": em.tolist()}, None, detail))
        return out


def run_golden(ps: PolicySet, g: GShape, routes: int, replays: int, seed: int, damage: str = "",
               onset: int = 10**9) -> Count:
    sim = GSim(g, routes, seed)
    engine = PolicyEngine(ps)
    flags = {("m", r): "fp8" for r in sim.names}
    c = Count(first=[-1] * routes)
    for t in range(replays):
        sim.damage = damage if t >= onset else ""
        _observe(engine, sim.signals(t), T0 + t * 3600.0 + 121, flags, sim.names, c, t)
        c.windows += routes
    return c


# --- a catastrophically broken FP8 engine (live) ------------------------------------------------


def broken_live(ps: PolicySet, windows: int = 12) -> dict[str, Any]:
    """FP8 serves NaN logits / empty answers: perplexity NaN or inf, every completion empty, shadow
    agreement 0, answers fast (nothing decoded); "overflow" is the window's capped perplexity exp(700)
    (watchdog/windows/window.py). Which window rolls back, and does anything raise."""
    out: dict[str, Any] = {}
    for variant, route in (("nan", "legal/broken"), ("overflow", "legal/broken"), ("nan", "chat/broken"),
                           ("overflow", "chat/broken")):
        sim = Sim(Shape("clean"), 1, windows + 30, 77)
        names = [route]
        engine = PolicyEngine(ps)
        flags = {("m", names[0]): "fp8"}
        c = Count(first=[-1])
        err = ""
        for t in range(windows + 30):
            sigs = sim.signals(t, names)
            if t >= 30:
                for s in sigs:
                    n = s.samples
                    if s.precision == "fp8":
                        s.values.update(perplexity=math.nan if variant == "nan" else math.exp(700.0), empty_rate=1.0,
                                        shadow_rougeL=0.0, mean_completion_tokens=0.0)
                        s.detail.update(empty=s.detail["ok"], logprob_tokens=20 * n, shadow_pairs=max(n // 50, 1))
                    else:
                        s.values.update(perplexity=1.8)
                        s.detail.update(logprob_tokens=20 * n)
            else:
                for s in sigs:
                    s.values.update(perplexity=1.8, shadow_rougeL=0.9 if s.precision == "fp8" else None)
                    if s.values.get("shadow_rougeL") is None:
                        s.values.pop("shadow_rougeL")
                    s.detail.update(logprob_tokens=20 * s.samples, shadow_pairs=max(s.samples // 50, 1))
            try:
                _observe(engine, sigs, T0 + (t + 1) * WINDOW_S + 1, flags, names, c, t)
            except Exception as e:  # noqa: BLE001 - what the check is about
                err = f"{type(e).__name__}: {e}"
                break
        out[f"{variant} {route}"] = {"first_rollback_window_after_break": (c.first[0] - 30) if c.first[0] >= 0 else None,
                        "rules": c.by_rule, "exception": err}
    return out


# --- main ---------------------------------------------------------------------------------------


def check_args(description: str, seed: int, parts: str) -> argparse.ArgumentParser:
    """The options an outside check takes: the policy files (default: the shipped ones), --quick,
    --seed, --parts, --shapes, --routes, --windows and --json."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("policies", nargs="*", default=[str(p) for p in sorted((ROOT / "policies").glob("*.yaml"))])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--parts", default=parts)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--routes", type=int, default=0)
    ap.add_argument("--windows", type=int, default=0)
    ap.add_argument("--json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = check_args("outside check of the shipped decision engine", 1717, "healthy,golden,power,broken").parse_args(argv)
    ps = load_policy_files(args.policies)
    q = args.quick
    routes = args.routes or (4 if q else 8)
    windows = args.windows or (60 if q else 250)   # full: 8 x 250 per shape (--routes 10 for the docs' table)
    parts = set(args.parts.split(","))
    pick = set(args.shapes.split(",")) - {""}
    res: dict[str, Any] = {"healthy": [], "golden": [], "power": [], "broken": {}, "args": vars(args)}
    t0 = time.perf_counter()

    def row(kind: str, name: str, c: Count) -> dict[str, Any]:
        return report_row(res, kind, name, c, t0)

    if "healthy" in parts:
        for i, s in enumerate(SHAPES):
            if pick and s.name not in pick:
                continue
            row("healthy", s.name, run_live(ps, s, routes, windows, args.seed + i))
    if "golden" in parts:
        for i, g in enumerate(GOLDEN_SHAPES):
            if pick and g.name not in pick:
                continue
            sim = GSim(g, 1, args.seed)
            print(f"{g.name}: {sim.moving_share():.3f} of items move by > 0.2 between two replays of one engine")
            row("golden", g.name, run_golden(ps, g, 20 if not q else 4, 100 if not q else 30,
                                             args.seed + 100 + i))
    if "power" in parts:
        pr = 6 if q else 30
        scen = [("bias-completion", "whole +10 %", Reg(shift=0.10), 3, 0.9, 80),
                ("stall-1of8-fp8", "p99 +10 %", Reg(p99=0.10), 5, 0.9, 80),
                ("cold-start", "whole +10 % from window 0", Reg(shift=0.10, onset=0), 10, 0.9, 0),
                ("low-50", "+30 % from window 0", Reg(shift=0.30, onset=0), 30, 0.9, 0),
                ("low-50", "+30 % after 100 windows", Reg(shift=0.30), 30, 0.9, 100),
                ("clean", "p99 +10 %", Reg(p99=0.10), 5, 0.9, 80)]
        extra = {"stall-1of8-fp8": Shape("stall-1of8-fp8", stall_every=20, stall_side="fp8",
                                         stall_share=(0.02, 0.05)),
                 "cold-start": Shape("cold-start"), "clean": Shape("clean"), "low-50": Shape("low-50", per_precision=50)}
        by = {s.name: s for s in SHAPES} | extra
        for j, (bg, name, reg, within, target, onset) in enumerate(scen):
            if pick and bg not in pick:
                continue
            if onset:
                reg = replace(reg, onset=onset)
            c = run_live(ps, by[bg], pr, reg.onset + within + 1, args.seed + 200 + j, reg)
            p, n = power(c, reg.onset, within)
            res["power"].append({"scenario": name, "background": bg, "within": within, "power": p, "routes": n,
                                 "target": target, "by_rule": c.by_rule})
            print(f"power    {name:26s} on {bg:16s} within {within:2d}: {p:.3f} ({n} routes; target {target})  "
                  f"{c.by_rule}  [{time.perf_counter() - t0:.0f} s]", flush=True)
        gr = 10 if q else 30
        for j, g in enumerate(GOLDEN_SHAPES):
            if pick and g.name not in pick:
                continue
            c = run_golden(ps, g, gr, 2, args.seed + 300 + j, damage="concentrated", onset=0)
            p, n = power(c, 0, 2)
            res["power"].append({"scenario": "golden -0.03 concentrated from the first replay", "background": g.name,
                                 "within": 2, "power": p, "routes": n, "target": 0.95, "by_rule": c.by_rule})
            print(f"power    golden concentrated        on {g.name:16s} within  2: {p:.3f} ({n} routes; target 0.95)"
                  f"  {c.by_rule}  [{time.perf_counter() - t0:.0f} s]", flush=True)
            c = run_golden(ps, g, 5, 2, args.seed + 320 + j, damage="broken", onset=0)
            p, n = power(c, 0, 1)
            res["power"].append({"scenario": "golden: FP8 garbage on every item", "background": g.name,
                                 "within": 1, "power": p, "routes": n, "target": 1.0, "by_rule": c.by_rule})
            print(f"power    golden garbage             on {g.name:16s} within  1: {p:.3f} ({n} routes; target 1.0)"
                  f"  {c.by_rule}", flush=True)
    if "broken" in parts:
        res["broken"] = broken_live(ps)
        print(f"broken live FP8 engine: {res['broken']}")
    return finish(res, t0, args.json)


def finish(res: dict[str, Any], t0: float, out: str | None) -> int:
    """The run's seconds printed and kept, the results written to ``out`` (JSON) when given: 0."""
    res["seconds"] = time.perf_counter() - t0
    print(f"({res['seconds']:.0f} s)")
    if out:
        Path(out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
