"""Ordinary days of a fleet (issue 17): healthy shapes no other generator draws.

The windows are ``bench/outside_check.py``'s (its request model, window packaging - latency
sketch, request-mix cells, per-replica sketches and cells, build counts - and its rollback
bookkeeping, ``Sim`` / ``_observe`` / ``Count``), driven through the shipped
``PolicyEngine.observe`` with ``policies/*.yaml`` on ``legal/...`` routes (both shipped policies
judge them). What this file adds is per (route, window, precision, replica): a log-latency
multiplier, a build and whether the replica exists, plus the count of requests, cancellations and
heavy prompts. Per request FP8 = FP16 in every shape: whatever rolls back is a false rollback.

Base fleet (this file's own parameters): 5,000 requests per route and window, FP16 share 15 %,
FP8 on 8 replicas, FP16 on 3; the outside check's request mix and noise otherwise.

Shapes (``SHAPES``; per route, seeded, episodes at geometric intervals):

* ``shadow-collapse``: about once a day FP16's share falls to 0.2-1 % (FP16 kept as a shadow) for
  3-10 hours, then back to 15 %.
* ``canary``: every ~200 windows a new build on ONE replica of each precision (same build, same
  speed x0.9-1.15 on both) for 100-300 windows; then promoted (every replica of both precisions
  within 0-2 windows, the first window cold x1.3) or dropped. Events name the build.
* ``rollout-day``: a slow rollout: FP8's replicas switch to a new build one at a time, one every
  24-40 windows; FP16's start a day (288 windows) after FP8's first; new build x0.9-1.1 on both,
  a switched replica's first window cold x1.3. The next rollout ~150 windows after the last
  replica switched. Builds named.
* ``autoscale``: FP8's replica count changes every ~100 windows among 6, 8, 10, 12 (FP16 fixed at
  3); a replica that joins is cold (x1.3) for its first 1-2 windows.
* ``heavy-cancel``: in 15 % of windows per precision 1-6 requests have 20k-32k-token prompts;
  every ~60 windows a 1-3-window burst of client cancellations on one precision (10-30 % of its
  requests: half logged ``cancelled``, kept out of the window; half logged ``ok`` with the answer
  cut at 5-60 % of its tokens - latency and completion tokens as the request model gives them).
* ``creep-fp16``: each FP16 replica gets 0.2 % slower per window since its last restart; every
  12-24 hours FP16's replicas are restarted one by one over 1-3 windows (no annotation). FP8 flat.
* ``late-replica``: one replica of one precision has its clock 1-2 windows behind for 1-6 hours
  (every ~150 windows): its events of window t+d are counted in window t; on top, the outside
  check's diurnal x10 ramp (counts and latency x(1 + 0.15 load) on both) and deploys every ~100
  windows (x0.85-1.2 on both, one precision 1-3 windows after the other, a cold first window x1.4,
  builds named), so the skewed replica shows each change d windows early.
* ``load-coupled`` (reported separately, see docs/BENCHMARKS_decisions.md): the diurnal ramp with
  FP8's replicas carrying twice FP16's load per replica, queueing x(1 + 0.3 load): FP8 1.3-23 %
  slower than FP16 through the day. Not FP8's precision, but FP8's serving path really is slower.

Run: ``PYTHONPATH=. python bench/ordinary_days.py [--quick] [--shapes a,b] [--routes R --windows W]
[--json out.json]``; the docs' table: ``--routes 10 --windows 2000`` (per shape).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.decisions import ROOT
from bench.outside_check import POLICIES, Count, Reg, Shape, Sim, _load, report_row, run_sim
from watchdog.core.signals import Signal
from watchdog.policy.loader import PolicySet, load_policy_files

KMAX = 12          # most replicas of one precision (autoscale)
BASE = {"total": 5000, "fp16_share": 0.15, "fp8_replicas": 8, "fp16_replicas": 3}


@dataclass(frozen=True)
class Day:
    name: str
    collapse: bool = False
    canary: bool = False
    rollout: bool = False
    autoscale: bool = False
    heavy_cancel: bool = False
    creep: bool = False
    late: bool = False
    load_coupled: bool = False


SHAPES = [Day("shadow-collapse", collapse=True), Day("canary", canary=True), Day("rollout-day", rollout=True),
          Day("autoscale", autoscale=True), Day("heavy-cancel", heavy_cancel=True), Day("creep-fp16", creep=True),
          Day("late-replica", late=True)]
REPORTED = [Day("load-coupled", load_coupled=True)]


def _episodes(rng: np.random.Generator, every: float, end: int) -> list[int]:
    out, t = [], 0
    while True:
        t += int(rng.geometric(1 / every))
        if t >= end:
            return out
        out.append(t)


def _base(prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
    """The outside check's request model without its noise (ms)."""
    return 60 + 0.2 * prompt + 22 * completion * (1 + prompt / 10000)


class DaySim(Sim):
    def __init__(self, d: Day, routes: int, windows: int, seed: int, reg: Reg | None = None,
                 base: dict[str, Any] | None = None) -> None:
        self.base = dict(base or BASE)
        super().__init__(Shape(d.name, **self.base), routes, windows, seed, reg)
        self.d = d
        rng = self.rng
        n = windows + 4
        # per precision: log multiplier and build per (route, window, replica); replicas per (route, window)
        self.mult = {p: np.zeros((routes, n, KMAX)) for p in ("fp8", "fp16")}
        self.bld = {p: np.zeros((routes, n, KMAX), dtype=int) for p in ("fp8", "fp16")}
        self.nrep = {p: np.full((routes, n), self.k[p], dtype=int) for p in ("fp8", "fp16")}
        self.rep_off = {p: np.concatenate([o, rng.normal(0, 0.015, (routes, KMAX - o.shape[1]))], axis=1)
                        for p, o in self.rep_off.items()}
        self.share = np.full((routes, n), self.base["fp16_share"])
        self.skew: dict[tuple[int, int], tuple[str, int, int]] = {}   # (r, t) -> (precision, replica, d)
        self.cancel: dict[tuple[int, int, str], float] = {}
        self.cancelled: dict[tuple[int, str], int] = {}
        self._logf: dict[tuple[int, str, int], float] = {}   # the build speed each replica runs now (log)
        for r in range(routes):
            if d.collapse:
                for t in _episodes(rng, 288, windows):
                    self.share[r, t:t + int(rng.integers(36, 121))] = rng.uniform(0.002, 0.01)
            if d.canary:
                self._canaries(r, n)
            if d.rollout:
                self._rollouts(r, n)
            if d.autoscale:
                self._autoscale(r, n)
            if d.heavy_cancel:
                for t in _episodes(rng, 60, windows):
                    side = "fp8" if rng.random() < 0.5 else "fp16"
                    for w in range(t, t + int(rng.integers(1, 4))):
                        self.cancel[(r, w, side)] = float(rng.uniform(0.10, 0.30))
            if d.creep:
                self._creep(r, n)
            if d.late:
                self._deploys(r, n)
                for t in _episodes(rng, 150, windows):
                    side = "fp8" if rng.random() < 0.5 else "fp16"
                    rep, lag = int(rng.integers(0, self.k[side])), int(rng.integers(1, 3))
                    for w in range(t, min(t + int(rng.integers(12, 73)), windows)):
                        self.skew[(r, w)] = (side, rep, lag)
            if d.late or d.load_coupled:
                ramp = np.array([_load(t) for t in range(n)])
                up = 0.15 if d.late else 0.3
                self.mult["fp16"][r] += np.log1p(up * ramp)[:, None]
                self.mult["fp8"][r] += np.log1p(up * ramp * (1 if d.late else 2))[:, None]

    # --- shape construction -----------------------------------------------------------------

    def _switch(self, r: int, prec: str, reps: list[int], t: int, build: int, logf: float, cold: float) -> None:
        """From window t on, ``reps`` of ``prec`` run ``build`` (log speed ``logf`` against build 0);
        their first window is ``cold`` (log)."""
        for c in reps:
            self.bld[prec][r, t:, c] = build
            self.mult[prec][r, t:, c] += logf - self._logf.get((r, prec, c), 0.0)
            self._logf[(r, prec, c)] = logf
            self.mult[prec][r, t, c] += cold

    def _canaries(self, r: int, n: int) -> None:
        rng, build, t = self.rng, 0, 0
        while True:
            t += int(rng.geometric(1 / 200))
            if t >= n:
                return
            build += 1
            old = {p: self._logf.get((r, p, 0), 0.0) for p in self.k}
            logf = math.log(rng.uniform(0.9, 1.15))
            reps = {p: int(rng.integers(0, self.k[p])) for p in self.k}
            for p in self.k:
                self._switch(r, p, [reps[p]], t, build, logf, math.log(1.3))
            end = t + int(rng.integers(100, 301))
            if end >= n:
                return
            if rng.random() < 0.6:   # promoted everywhere, the second precision 0-2 windows later
                first = "fp8" if rng.random() < 0.5 else "fp16"
                for p, at in ((first, end), ("fp16" if first == "fp8" else "fp8", end + int(rng.integers(0, 3)))):
                    if at < n:
                        self._switch(r, p, [c for c in range(self.k[p]) if c != reps[p]], at, build, logf,
                                     math.log(1.3))
            else:                    # dropped: the canary replicas go back to the old build
                for p in self.k:
                    self._switch(r, p, [reps[p]], end, build - 1 if build > 1 else 0, old[p], 0.0)
                    self.bld[p][r, end:, reps[p]] = self.bld[p][r, end - 1, (reps[p] + 1) % self.k[p]]
            t = end + 3

    def _rollouts(self, r: int, n: int) -> None:
        rng, build, t = self.rng, 0, 0
        while True:
            t += int(rng.geometric(1 / 150))
            if t >= n:
                return
            build += 1
            logf = math.log(rng.uniform(0.9, 1.1))
            last = t
            for p, start in (("fp8", t), ("fp16", t + 288)):
                at = start
                for c in rng.permutation(self.k[p]):
                    if at >= n:
                        break
                    self._switch(r, p, [int(c)], at, build, logf, math.log(1.3))
                    last = at
                    at += int(rng.integers(24, 41))
            t = last + 1

    def _autoscale(self, r: int, n: int) -> None:
        rng, k, t = self.rng, self.k["fp8"], 0
        while True:
            t += int(rng.geometric(1 / 100))
            if t >= n:
                return
            new = int(rng.choice([6, 8, 10, 12]))
            self.nrep["fp8"][r, t:] = new
            for c in range(k, new):      # joining replicas start cold
                for w in range(t, min(t + int(rng.integers(1, 3)), n)):
                    self.mult["fp8"][r, w, c] += math.log(1.3)
            k = new

    def _creep(self, r: int, n: int) -> None:
        rng = self.rng
        age = np.zeros(KMAX)
        restart: dict[int, list[int]] = {}
        t = 0
        while t < n:
            t += int(rng.integers(144, 289))
            at = t
            for c in rng.permutation(self.k["fp16"]):
                restart.setdefault(at, []).append(int(c))
                at += int(rng.integers(0, 2))
        age += rng.integers(0, 144, KMAX)
        for w in range(n):
            for c in restart.get(w, []):
                age[c] = 0
            self.mult["fp16"][r, w] += 0.002 * age
            age += 1

    def _deploys(self, r: int, n: int) -> None:
        rng, build, t = self.rng, 0, 0
        logf = 0.0
        while True:
            t += int(rng.geometric(1 / 100))
            if t >= n:
                return
            build += 1
            logf += math.log(rng.uniform(0.85, 1.2))
            first = "fp8" if rng.random() < 0.5 else "fp16"
            lag = int(rng.integers(1, 4))
            for p, at in ((first, t), ("fp16" if first == "fp8" else "fp8", t + lag)):
                if at < n:
                    self._switch(r, p, list(range(self.k[p])), at, build, logf, math.log(1.4))
            t += lag

    # --- Sim hooks ---------------------------------------------------------------------------

    def _replicas(self, r: int, t: int, prec: str) -> int:
        return int(self.nrep[prec][r, t])

    def _names_builds(self) -> bool:
        return self.d.canary or self.d.rollout or self.d.late

    def _count(self, r: int, t: int, prec: str, load: float) -> int:
        d, rng = self.d, self.rng
        share = self.share[r, t] if prec == "fp16" else 1 - self.share[r, t]
        if d.late or d.load_coupled:
            load = _load(t)
        n = max(int(rng.poisson(self.base["total"] * share * load)), 1)
        cut = self.cancel.get((r, t, prec), 0.0)
        if cut:   # half of the cancelled requests are logged "cancelled": not in the window's count
            gone = int(rng.binomial(n, cut / 2))
            self.cancelled[(r, prec)] = gone
            n = max(n - gone, 1)
        return n

    def _draw(self, r: int, t: int, prec: str, n: int, bias_c: float, bias_p: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lat, p_tok, c_tok, rep, _ = super()._draw(r, t, prec, n, bias_c, bias_p)
        rng = self.rng
        tt = np.full(n, t)
        sk = self.skew.get((r, t))
        if sk is not None and sk[0] == prec:
            tt = np.where(rep == sk[1], t + sk[2], t)
        lat = lat * np.exp(self.mult[prec][r, tt, rep])
        builds = self.bld[prec][r, tt, rep]
        if self.d.heavy_cancel:
            if rng.random() < 0.15:
                big = rng.choice(n, min(n, int(rng.integers(1, 7))), replace=False)
                p_new = rng.integers(20000, 32001, big.size)
                lat[big] *= _base(p_new, c_tok[big]) / _base(p_tok[big], c_tok[big])
                p_tok[big] = p_new
            cut = self.cancel.get((r, t, prec), 0.0)
            if cut:   # the other half: logged "ok" with the answer cut short
                on = np.flatnonzero(rng.random(n) < cut / 2)
                c_new = np.maximum(np.round(c_tok[on] * rng.uniform(0.05, 0.6, on.size)), 1).astype(int)
                lat[on] *= _base(p_tok[on], c_new) / _base(p_tok[on], c_tok[on])
                c_tok[on] = c_new
        return lat, p_tok, c_tok, rep, builds

    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        self.cancelled.clear()
        out = super().signals(t, routes)
        for s in out:
            gone = self.cancelled.get((routes.index(s.route), s.precision), 0)
            if gone:
                s.detail["not_judged"] = {"cancelled": gone}
        return out


def run_day(ps: PolicySet, d: Day, routes: int, windows: int, seed: int, reg: Reg | None = None) -> Count:
    return run_sim(ps, DaySim(d, routes, windows, seed, reg), routes, windows, "legal/d")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="ordinary days of a fleet through the shipped decision engine")
    ap.add_argument("policies", nargs="*", default=[str(p) for p in sorted((ROOT / "policies").glob("*.yaml"))])
    ap.add_argument("--quick", action="store_true", help="2 routes x 40 windows per shape (CI)")
    ap.add_argument("--seed", type=int, default=1803)
    ap.add_argument("--shapes", default="", help="comma-separated names (default: all, load-coupled too)")
    ap.add_argument("--routes", type=int, default=0)
    ap.add_argument("--windows", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    ps = load_policy_files(args.policies)
    routes = args.routes or (2 if args.quick else 10)
    windows = args.windows or (40 if args.quick else 600)
    pick = set(args.shapes.split(",")) - {""}
    res: dict[str, Any] = {"healthy": [], "reported": [], "policies": list(POLICIES), "routes": routes,
                           "windows_per_route": windows, "seed": args.seed}
    t0 = time.perf_counter()
    for kind, shapes in (("healthy", SHAPES), ("reported", REPORTED)):
        for i, d in enumerate(shapes):
            if pick and d.name not in pick:
                continue
            seed = args.seed + i + (100 if kind == "reported" else 0)
            report_row(res, kind, d.name, run_day(ps, d, routes, windows, seed), t0)
    res["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
