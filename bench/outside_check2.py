"""Outside check, second pass (issue 17, h50): fleet shapes neither the project's generators nor the
first outside check draw, through the SHIPPED ``PolicyEngine.observe`` and ``policies/*.yaml``.

Plumbing is reused, not copied: the request model, the window packaging (latency sketch, mix cells,
per-replica sketches, build counts) and the rollback bookkeeping are ``bench/outside_check.py``'s
(``Sim``, ``run_sim``, ``Count``, ``report_row``, ``power``, ``GSim``, ``run_golden``); the per-replica
log multipliers and builds are ``bench/ordinary_days.py``'s ``DaySim`` (``mult``, ``bld``, ``_switch``).
Routes are ``legal/...`` (both shipped policies judge them). Per request FP8 = FP16 in every healthy
shape unless stated: whatever rolls back is a false rollback.

Parameters are this file's own (seeded by ``--seed``; 5-minute windows):

* ``gc-2v12``: FP8 on 12 replicas, FP16 on **2**; 6,000 requests per window, FP16 share 12 %. In 3 %
  of windows one replica (any, either precision) has a GC pause: 5-15 % of that replica's requests
  x5; in another 3 % of windows a **shared host** pauses FP8 replica 0 and FP16 replica 0 together
  (5-15 % of each one's requests x5).
* ``gc-1v1``: **one replica per precision**, 1,500 requests each per window, the same pauses.
* ``deploy-lag5-8``: a new build every ~80 windows (x0.85-1.20 on both), the second precision
  **5-8 windows** after the first, cold first window x1.3; in half the deploys a **rollback then
  redeploy** (3-10 windows after the second side landed, both go back to the old build 0-3 windows
  apart, and the same new build comes again 10-30 windows later, staggered 5-8 windows again). The
  build field is on **60 % of the events** only (the rest carry none).
* ``deploy-fp8-named``: the same deploys, but only FP8's producer sends the build field (FP16's
  gateway is older): FP16's builds are invisible.
* ``bias-flip20``: the router sends one precision 15 points more long prompts, **flipping direction
  every 20 windows**; at the daily peak (hours 12-14) both precisions get 15 points more long
  answers together; in 3 % of windows a **burst of 20-150 very long prompts** (16k-32k tokens)
  arrives on the route (each to FP16 with its 12 % share). 6,000 requests, FP16 12 %.
* ``cold-noisy15``: brand-new routes (the engine sees each route from its first window) with
  **15 % replica noise** (per-replica offsets sd 0.15), FP8 on 8 and FP16 on 3 replicas, healthy
  FP8 **3 % faster** than FP16, 5,000 requests, FP16 15 %.
* ``thin-10-30``: **10-30 requests per precision** per window (uniform), otherwise the base fleet.
* ``share3``: FP16 share **3 %** (180 FP16 requests of 6,000), replica noise 5 %.

Golden ``golden-fp8-sampled``: FP8 serves sampled answers (each open item re-sampled, as the first
check's sampled serving, on 40 % of items), FP16 greedy: the A/A pass (two FP16 answers) shows no
movement. Per-item levels and the rest as ``bench/outside_check.py``'s ``GSim``.

Power (``--parts power``; onset at window 100, a learned level, except the cold start): whole +10 % within 3 windows (``gc-2v12``, ``bias-flip20``,
``deploy-fp8-named``, ``share3``), p99 +10 % within 5 (``gc-2v12``), FP8 errors +2 points within 5
(``share3``) and within 30 (``thin-10-30``, +3 points), +30 % within 30 (``thin-10-30``), cold start
+10 % from window 0 within 10 (``cold-noisy15``, and ``clean``: the base fleet at 1.5 % replica noise),
whole +10 % within 3 after the level is learned (``cold-noisy15``); whole +10 % within 3 and p99 +10 % within 5 on
``gc-1v1`` (what the stall check costs where it acts).

Run: ``PYTHONPATH=. nice -n 15 python bench/outside_check2.py [--quick] [--parts healthy,golden,power]
[--shapes a,b] [--routes R --windows W] [--pause X,LO,HI] [--json out.json]``. ``--pause`` changes every
shape's pauses: latency x``X`` on a share ``LO``-``HI`` of the paused replica's requests.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench.decisions import WINDOW_S
from bench.ordinary_days import KMAX, Day, DaySim, _base, _episodes
from bench.outside_check import GShape, GSim, Reg, check_args, finish, power, report_row, run_golden, run_sim
from watchdog.core.signals import Signal
from watchdog.policy.loader import PolicySet, load_policy_files

NO_BUILD = -1


@dataclass(frozen=True)
class Fleet:
    name: str
    base: dict[str, Any] = field(default_factory=lambda: {"total": 6000, "fp16_share": 0.12,
                                                          "fp8_replicas": 8, "fp16_replicas": 3})
    rep_sd: float = 0.0             # per-replica offset sd (0: the outside check's 1.5 %)
    fp8_speed: float = 0.0          # healthy FP8 log speed against FP16
    gc: float = 0.0                 # share of windows with a single-replica pause
    host: float = 0.0               # share of windows with a shared-host pause (FP8 0 + FP16 0)
    deploy: float = 0.0             # mean windows between deploys
    named: str = "all"              # "all", "partial" (60 % of events), "fp8" (FP8's events only)
    bias_flip: int = 0              # windows between flips of the long-prompt bias
    thin: tuple[int, int] | None = None
    pause_x: float = 5.0            # a paused request's latency multiplier
    pause_share: tuple[float, float] = (0.05, 0.15)   # share of the replica's requests a pause hits


F = {"total": 5000, "fp16_share": 0.15, "fp8_replicas": 8, "fp16_replicas": 3}
SHAPES = [
    Fleet("gc-2v12", base={"total": 6000, "fp16_share": 0.12, "fp8_replicas": 12, "fp16_replicas": 2},
          gc=0.03, host=0.03),
    Fleet("gc-1v1", base={"total": 3000, "fp16_share": 0.5, "fp8_replicas": 1, "fp16_replicas": 1},
          gc=0.03, host=0.03),
    Fleet("deploy-lag5-8", base=F, deploy=80, named="partial"),
    Fleet("deploy-fp8-named", base=F, deploy=80, named="fp8"),
    Fleet("bias-flip20", bias_flip=20),
    Fleet("cold-noisy15", base=F, rep_sd=0.15, fp8_speed=math.log(0.97)),
    Fleet("thin-10-30", base=F, thin=(10, 30)),
    Fleet("share3", base={"total": 6000, "fp16_share": 0.03, "fp8_replicas": 8, "fp16_replicas": 3}, rep_sd=0.05),
]


@dataclass
class Reg2(Reg):
    errors: float = 0.0             # FP8's extra error rate from the onset


class FleetSim(DaySim):
    def __init__(self, f: Fleet, routes: int, windows: int, seed: int, reg: Reg | None = None) -> None:
        super().__init__(Day(f.name), routes, windows, seed, reg, base=f.base)
        self.f = f
        rng = self.rng
        n = windows + 4
        if f.rep_sd:
            self.rep_off = {p: rng.normal(0, f.rep_sd, (routes, KMAX)) for p in ("fp8", "fp16")}
        self.mult["fp8"] += f.fp8_speed
        # pauses: (r, t) -> [(precision, replica, share)]
        self.pause: dict[tuple[int, int], list[tuple[str, int, float]]] = {}
        k8, k16 = self.k["fp8"], self.k["fp16"]
        for r in range(routes):
            for t in range(windows):
                ev = []
                if rng.random() < f.gc:
                    c = int(rng.integers(0, k8 + k16))
                    ev.append(("fp8", c, float(rng.uniform(*f.pause_share))) if c < k8
                              else ("fp16", c - k8, float(rng.uniform(*f.pause_share))))
                if rng.random() < f.host:
                    ev += [("fp8", 0, float(rng.uniform(*f.pause_share))),
                           ("fp16", 0, float(rng.uniform(*f.pause_share)))]
                if ev:
                    self.pause[(r, t)] = ev
            if f.deploy:
                self._deploys2(r, n)
            if f.bias_flip:
                phase = int(rng.integers(0, 2 * f.bias_flip))
                sign = np.where(((np.arange(windows + 1) + phase) // f.bias_flip) % 2 == 0, 1.0, -1.0)
                self.bias_p[r] = 0.15 * sign
        self.burst = {(r, t): int(rng.integers(20, 151)) for r in range(routes) for t in range(windows)
                      if f.bias_flip and rng.random() < 0.03}

    def _deploys2(self, r: int, n: int) -> None:
        rng, cold = self.rng, math.log(1.3)
        build, logf, busy = 0, 0.0, -1
        for t in _episodes(rng, self.f.deploy, n):
            if t <= busy:
                continue
            old, old_f = build, logf
            build += 1
            logf = old_f + math.log(rng.uniform(0.85, 1.20))
            busy = self._stagger(r, t, build, logf, cold, n)
            if rng.random() < 0.5:   # rolled back, then the same build again
                busy = self._stagger(r, busy + int(rng.integers(3, 11)), old, old_f, 0.0, n, lag=(0, 3))
                busy = self._stagger(r, busy + int(rng.integers(10, 31)), build, logf, cold, n)

    def _stagger(self, r: int, t: int, build: int, logf: float, cold: float, n: int,
                 lag: tuple[int, int] = (5, 8)) -> int:
        first = "fp8" if self.rng.random() < 0.5 else "fp16"
        second = "fp16" if first == "fp8" else "fp8"
        at2 = t + int(self.rng.integers(lag[0], lag[1] + 1))
        for p, at in ((first, t), (second, at2)):
            if at < n:
                self._switch(r, p, list(range(self.k[p])), at, build, logf, cold)
        return at2

    def _names_builds(self) -> bool:
        return bool(self.f.deploy)

    def _count(self, r: int, t: int, prec: str, load: float) -> int:
        if self.f.thin:
            return int(self.rng.integers(self.f.thin[0], self.f.thin[1] + 1))
        return super()._count(r, t, prec, load)

    def _draw(self, r: int, t: int, prec: str, n: int, bias_c: float, bias_p: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lat, p_tok, c_tok, rep, builds = super()._draw(r, t, prec, n, bias_c, bias_p)
        rng, f = self.rng, self.f
        for side, c, share in self.pause.get((r, t), []):
            if side == prec:
                on = np.flatnonzero(rep == c)
                lat[on[: int(round(share * on.size))]] *= f.pause_x
        if f.bias_flip:
            h = (t * WINDOW_S / 3600.0) % 24
            if 12 <= h < 14:   # the daily peak: more long answers on both precisions
                on = np.flatnonzero(rng.random(n) < 0.15)
                c_new = np.clip(np.round(np.exp(math.log(700) + 0.5 * rng.normal(size=on.size))), 1, 8000)
                lat[on] *= _base(p_tok[on], c_new) / _base(p_tok[on], c_tok[on])
                c_tok[on] = c_new.astype(int)
            k = self.burst.get((r, t), 0)
            if k:
                share = self.base["fp16_share"]
                m = min(n, int(rng.binomial(k, share if prec == "fp16" else 1 - share)))
                big = rng.choice(n, m, replace=False)
                p_new = rng.integers(16000, 32001, m)
                lat[big] *= _base(p_new, c_tok[big]) / _base(p_tok[big], c_tok[big])
                p_tok[big] = p_new
        if f.named == "partial":
            builds = np.where(rng.random(n) < 0.6, builds, NO_BUILD)
        elif f.named == "fp8" and prec == "fp16":
            builds = np.full(n, NO_BUILD)
        return lat, p_tok, c_tok, rep, builds

    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        out = super().signals(t, routes)
        reg = self.reg
        for s in out:
            b = s.detail.get("builds")
            if isinstance(b, dict):
                b.pop(f"v{NO_BUILD}", None)
                if not b:
                    del s.detail["builds"]
            extra = getattr(reg, "errors", 0.0)
            if extra and s.precision == "fp8" and t >= reg.onset:
                d = s.detail
                more = min(int(self.rng.binomial(d["events"], extra)), max(d["ok"] - 1, 0))
                d["errors"] += more
                d["ok"] -= more
                d["completions"] = d["ok"]
                s.values["error_rate"] = (d["errors"] + d["timeouts"]) / d["events"]
        return out


def run_fleet(ps: PolicySet, f: Fleet, routes: int, windows: int, seed: int, reg: Reg | None = None) -> Any:
    return run_sim(ps, FleetSim(f, routes, windows, seed, reg), routes, windows, "legal/h")


class FP8SampledGSim(GSim):
    """FP8 sampled, FP16 greedy: of ``GSim.signals``' three draws per route (FP16, FP8, FP16 again),
    only the second (FP8's) is a fresh sample; the A/A pass shows no movement."""

    def __init__(self, g: GShape, routes: int, seed: int) -> None:
        super().__init__(g, routes, seed)
        self._calls = 0

    def _sample(self, r: int) -> np.ndarray:
        self._calls += 1
        out = super()._sample(r)
        return out if self._calls % 3 == 2 else np.zeros_like(out)


GOLDEN = GShape("golden-fp8-sampled", 200, 0.40)


def run_golden_fp8_sampled(ps: PolicySet, routes: int, replays: int, seed: int, damage: str = "",
                           onset: int = 10**9) -> Any:
    import bench.outside_check as oc

    saved = oc.GSim
    oc.GSim = FP8SampledGSim   # type: ignore[misc]  # run_golden builds its GSim by name
    try:
        return run_golden(ps, GOLDEN, routes, replays, seed, damage, onset)
    finally:
        oc.GSim = saved   # type: ignore[misc]


POWER = [  # (background, name, regression, within)
    ("gc-2v12", "whole +10 %", Reg2(shift=0.10, onset=100), 3),
    ("gc-2v12", "p99 +10 %", Reg2(p99=0.10, onset=100), 5),
    ("bias-flip20", "whole +10 %", Reg2(shift=0.10, onset=100), 3),
    ("deploy-fp8-named", "whole +10 %", Reg2(shift=0.10, onset=100), 3),
    ("share3", "whole +10 %", Reg2(shift=0.10, onset=100), 3),
    ("share3", "errors +2 points", Reg2(errors=0.02, onset=100), 5),
    ("thin-10-30", "+30 %", Reg2(shift=0.30, onset=100), 30),
    ("thin-10-30", "errors +3 points", Reg2(errors=0.03, onset=100), 30),
    ("cold-noisy15", "+10 % from window 0", Reg2(shift=0.10, onset=0), 10),
    ("cold-noisy15", "whole +10 %", Reg2(shift=0.10, onset=100), 3),
    ("clean", "+10 % from window 0", Reg2(shift=0.10, onset=0), 10),
    ("gc-1v1", "whole +10 %", Reg2(shift=0.10, onset=100), 3),
    ("gc-1v1", "p99 +10 %", Reg2(p99=0.10, onset=100), 5),
]
#: power-only background: the base fleet without any of the shapes' confounders (1.5 % replica noise)
CLEAN = Fleet("clean", base=F)


def main(argv: list[str] | None = None) -> int:
    ap = check_args("outside check, second pass, through the shipped engine", 5005, "healthy,golden,power")
    ap.add_argument("--power-routes", type=int, default=0)
    ap.add_argument("--pause", default="", metavar="X,LO,HI",
                    help="pauses multiply latency by X on a share LO-HI of the replica's requests (default 5,0.05,0.15)")
    args = ap.parse_args(argv)
    shapes = SHAPES
    if args.pause:
        x, lo, hi = (float(v) for v in args.pause.split(","))
        shapes = [replace(f, pause_x=x, pause_share=(lo, hi)) for f in SHAPES]
    ps = load_policy_files(args.policies)
    q = args.quick
    routes, windows = args.routes or (2 if q else 10), args.windows or (40 if q else 300)
    parts, pick = set(args.parts.split(",")), set(args.shapes.split(",")) - {""}
    res: dict[str, Any] = {"healthy": [], "golden": [], "power": [], "args": vars(args)}
    t0 = time.perf_counter()
    if "healthy" in parts:
        for i, f in enumerate(shapes):
            if not pick or f.name in pick:
                report_row(res, "healthy", f.name, run_fleet(ps, f, routes, windows, args.seed + i), t0)
    if "golden" in parts and (not pick or GOLDEN.name in pick):
        sim = FP8SampledGSim(GOLDEN, 1, args.seed)
        moved = float(np.mean([np.mean(np.abs(GSim._sample(sim, 0)) > 0.2) for _ in range(300)]))
        print(f"{GOLDEN.name}: {moved:.3f} of items move by > 0.2 between FP8 and FP16 from sampling alone "
              "(between two FP16 replays: 0)")
        c = run_golden_fp8_sampled(ps, 4 if q else 20, 20 if q else 100, args.seed + 100)
        report_row(res, "golden", GOLDEN.name, c, t0)
    if "power" in parts:
        by = {f.name: f for f in [*shapes, CLEAN]}
        pr = args.power_routes or (4 if q else 20)
        for j, (bg, name, reg, within) in enumerate(POWER):
            if pick and bg not in pick:
                continue
            c = run_fleet(ps, by[bg], pr, reg.onset + within + 1, args.seed + 200 + j, reg)
            p, n = power(c, reg.onset, within)
            res["power"].append({"scenario": name, "background": bg, "within": within, "power": p, "routes": n,
                                 "by_rule": c.by_rule})
            print(f"power    {name:22s} on {bg:16s} within {within:2d}: {p:.3f} ({n} routes)  {c.by_rule}  "
                  f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    return finish(res, t0, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
