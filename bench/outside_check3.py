"""Outside check, third pass (issue 17, h51): fleet shapes that neither ``bench/outside_check.py`` nor
``bench/outside_check2.py`` (nor ``bench/ordinary_days.py``) draw, through the SHIPPED
``PolicyEngine.observe`` and ``policies/*.yaml`` on ``legal/...`` routes (both shipped policies judge them).

Plumbing is imported, not copied: the request model, window packaging and rollback bookkeeping are
``bench/outside_check.py``'s (``run_sim``, ``Count``, ``report_row``, ``power``, ``upper95``, ``GSim``,
``run_golden``, ``check_args``); per-replica log multipliers, replica counts and builds are
``bench/ordinary_days.py``'s ``DaySim`` (``mult``, ``nrep``, ``_base``, ``_episodes``). What this file
adds: per-window hooks (counts, shared transients, per-replica errors, replica renames) and a capture of
every rollback's verdicts (rule, reason code, message, estimate, interval) - ``TRACES``.

In every healthy live shape FP8 serves each request as fast as FP16 would or faster and with the same
error odds (stated per shape); whatever rolls back is a false rollback. 5-minute windows, ``t = 0`` is
midnight. Base fleet (``B``): 6,000 requests per route and window, FP16 share 12 %, FP8 on 8 replicas,
FP16 on 3; the outside check's request mix (25 % long prompts, 20 % long answers), AR(1) precision
offsets sd 1.5 %, replica offsets sd 1.5 %, errors 0.8 %, timeouts 0.3 % on both.

Healthy live shapes (``SHAPES``; parameters this file's own, seeded by ``--seed`` + index):

* ``h200-throttle``: FP8 on **3 H200** replicas, FP16 on **4 H100** (FP16 share 35 %); FP8 is a constant
  **15 % faster** (log 0.85, the newer GPU). **Thermal throttling** episodes (mean every 40 windows per
  route) on ONE replica of either precision, lasting **2-6 windows**, every request on it x1.08-1.25.
* ``restart-warm``: every replica of both precisions **creeps** with uptime (memory fragmentation,
  +0.03 % per window since its last restart; initial uptimes 0-1 day); each replica is restarted on its
  own about **once a day** (independent, any hour); a restarted replica's **prefix cache is cold**: x1.30,
  x1.15, x1.05 in its first three windows; **half the restarts come back under a new pod name**.
* ``oom-replica``: about every 100 windows per route one replica (either precision, FP8 with 8/11 odds)
  **crashes (OOM)**: all of its requests are errors for **2-8 minutes** starting anywhere in a window (so
  1-2 windows see a share of it), then it serves its next window cold (x1.3). About every 150 windows per
  route a **429 rate-limit burst** on one precision's pool: 1-4 % of its requests rejected (errors) for
  **1-2 windows**. (The crashed replica's requests are counted as errors; their latencies stay in the
  sketches, as the plumbing packs the first ``ok`` requests.)
* ``night-20x``: traffic **20x lower at night** (5 % of day volume 23:00-06:30, up to 100 % within 30 minutes,
  a lunch dip to 60 % at 12-13, down over 2 h from 21:00); latency x(1 + 0.2 load) on both (batching);
  at night **20 points more long prompts** on both precisions (batch jobs).
* ``skew-transient``: **FP16's gateway clock 20-90 s ahead** (per route); **shared transients** (a shared
  tokenizer / network / KV store) every ~12 windows, 30-150 s long, x1.3-2.0 on every request on both
  precisions in it; each precision's window holds the part of the transient its own clock puts there.
* ``h200-diurnal``: FP8 on H200 (8 replicas), FP16 on H100 (3), **FP16 share 15 %** (so that FP16's 360
  requests at night reach latency-typical's ``min_samples`` 300), diurnal load 0.4 at night to 1.0 by day
  (counts x load, latency x(1 + 0.15 load) on both); FP8's advantage depends on load: **20 % faster at
  night, 7 % faster at the peak** (log-linear in load). FP8 is faster than FP16 at every hour.
* ``peak-queue8``: diurnal load 0.4-1.0 as ``h200-diurnal``; at the daily peak the router gives the FP8
  pool a larger share (FP16 share 12 % -> 8 % over hours 10-15) and FP8's **queueing** adds up to
  **+8 %** (per-request service time equal); the **autoscaler** adds FP8 replicas in steps of 2 (8 -> 10
  -> 12 at hours 11 and 12.5, each new replica cold x1.3 for 1 window, removed again at 16 and 17),
  each step halving the queueing excess. FP8 is up to 8 % slower than FP16 for users at the peak: not
  FP8's precision but its pool's load, so it is counted as healthy here and REPORTED APART from the
  pooled healthy count (as ``ordinary_days``' ``load-coupled``).

Golden shapes (``GOLDEN``; one seed for all of them, so every golden shape has the same routes and item
levels as its control ``golden-fixed``; greedy serving, per-item healthy levels as ``GSim``: 80 % unchanged,
17 % N(0, 0.12), 3 % +-U(0.3, 0.7); hourly replays; FP16's A/A pass moves nothing unless stated):

* ``golden-fixed`` (the control, not a new shape): the same 200 greedy items in the same order every replay.
* ``golden-shuffled``: 200 items, the replay harness **shuffles the item order** every replay (the
  ``item_ids`` list follows the order); answers deterministic.
* ``golden-edited-nan``: 200 items; about every 12 replays **10 items are replaced** by new ones (the
  set edited, same size); in every replay **1 % of items time out** (NaN) on one precision at random.
* ``golden-batch``: 200 items; the FP8 pass runs at a **different batch size** than FP16's two passes
  (batch-dependent kernels: 4 % of items score U(-0.5, 0.5) differently against FP16, a fresh draw each
  replay - FP16 at FP8's batch size would move them just as much); FP16's A/A pass, at FP16's own batch
  size, moves nothing.

Power (``--parts power``): onset at window 100 (a learned level) unless stated: whole +10 % within 3 on
``h200-throttle``, ``restart-warm``, ``skew-transient``; on ``night-20x`` and ``h200-diurnal`` at onset 100
(08:20, just after the morning ramp: the route's first day, no level learned yet), 200 (16:40, a day
window) and 388 (08:20 of the second day, a level learned the day before); FP8 errors +2 points within 5 on
``oom-replica``.

Run: ``PYTHONPATH=. python bench/outside_check3.py [--quick] [--parts healthy,golden,power] [--shapes a,b]
[--routes R --windows W] [--seed S] [--json out.json]``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import bench.outside_check as oc
from bench.decisions import WINDOW_S
from bench.ordinary_days import KMAX, Day, DaySim, _base, _episodes
from bench.outside_check import GShape, GSim, Reg, check_args, power, report_row, run_golden, run_sim, upper95
from watchdog.core.signals import Signal
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.loader import PolicySet, load_policy_files

B = {"total": 6000, "fp16_share": 0.12, "fp8_replicas": 8, "fp16_replicas": 3}
W = WINDOW_S


@dataclass(frozen=True)
class Fleet3:
    name: str
    base: dict[str, Any] = field(default_factory=lambda: dict(B))
    fp8_speed: float = 0.0
    throttle: float = 0.0          # mean windows between throttling episodes per route
    restart: bool = False
    oom: bool = False
    night: bool = False
    skew: bool = False
    diurnal_adv: bool = False
    peak_queue: bool = False
    reported: bool = False         # reported apart from the pooled healthy count


SHAPES = [
    Fleet3("h200-throttle", base={"total": 6000, "fp16_share": 0.35, "fp8_replicas": 3, "fp16_replicas": 4},
           fp8_speed=math.log(0.85), throttle=40),
    Fleet3("restart-warm", restart=True),
    Fleet3("oom-replica", oom=True),
    Fleet3("night-20x", night=True),
    Fleet3("skew-transient", skew=True),
    Fleet3("h200-diurnal", base={"total": 6000, "fp16_share": 0.15, "fp8_replicas": 8, "fp16_replicas": 3},
           diurnal_adv=True),
    Fleet3("peak-queue8", peak_queue=True, reported=True),
]


def _hour(t: int) -> float:
    return (t * W / 3600.0) % 24


def _load20(t: int) -> float:
    """night-20x: 0.05 at night, 1.0 by day, lunch dip 0.6."""
    h = _hour(t)
    if h < 6.5 or h >= 23:
        return 0.05
    if h < 7:
        return 0.05 + 0.95 * (h - 6.5) / 0.5
    if 12 <= h < 13:
        return 0.6
    if h < 21:
        return 1.0
    return 1.0 - 0.95 * (h - 21) / 2


def _load_day(t: int) -> float:
    """0.4 at night, 1.0 by day (07-09 ramp up, 20-23 ramp down)."""
    h = _hour(t)
    if h < 7 or h >= 23:
        return 0.4
    if h < 9:
        return 0.4 + 0.6 * (h - 7) / 2
    if h < 20:
        return 1.0
    return 1.0 - 0.6 * (h - 20) / 3


def _peak(t: int) -> float:
    """peak-queue8: 0 -> 1 over hours 10-11, 1 until 14, back to 0 by 15."""
    h = _hour(t)
    if h < 10 or h >= 15:
        return 0.0
    if h < 11:
        return h - 10
    if h < 14:
        return 1.0
    return 15 - h


class Fleet3Sim(DaySim):
    def __init__(self, f: Fleet3, routes: int, windows: int, seed: int, reg: Reg | None = None) -> None:
        super().__init__(Day(f.name), routes, windows, seed, reg, base=f.base)
        self.f = f
        rng = self.rng
        n = windows + 4
        self.mult["fp8"] += f.fp8_speed
        self.gen = {p: np.zeros((routes, n, KMAX), dtype=int) for p in ("fp8", "fp16")}   # pod generation
        self.err_share: dict[tuple[int, int, str, int], float] = {}   # (r, t, prec, replica) -> share of its requests failed
        self.burst: dict[tuple[int, int, str], float] = {}              # (r, t, prec) -> 429 share
        self.trans: dict[int, list[tuple[float, float, float]]] = {}     # r -> [(start s, length s, x)]
        self.skew_s = np.zeros(routes)
        self.events: list[tuple[int, int, int, str]] = []   # (route, first window, end window, what) for the traces
        self.share = np.full((routes, n), self.base["fp16_share"])
        for r in range(routes):
            if f.throttle:
                for t in _episodes(rng, f.throttle, windows):
                    side = "fp8" if rng.random() < self.k["fp8"] / (self.k["fp8"] + self.k["fp16"]) else "fp16"
                    c = int(rng.integers(0, self.k[side]))
                    ln, x = int(rng.integers(2, 7)), float(rng.uniform(1.08, 1.25))
                    self.mult[side][r, t:t + ln, c] += math.log(x)
                    self.events.append((r, t, t + ln, f"throttle {side}-{c} x{x:.3f}"))
            if f.restart:
                self._restarts(r, n)
            if f.oom:
                for t in _episodes(rng, 100, windows):
                    side = "fp8" if rng.random() < 8 / 11 else "fp16"
                    c = int(rng.integers(0, self.k[side]))
                    a = t * W + rng.uniform(0, W)
                    e = a + rng.uniform(120, 480)
                    for w in range(t, t + 3):
                        ov = max(0.0, min(e, (w + 1) * W) - max(a, w * W)) / W
                        if ov > 0:
                            self.err_share[(r, w, side, c)] = ov
                    back = int(e // W) + 1
                    self.events.append((r, t, back + 1, f"OOM {side}-{c} {a - t * W:.0f}-{e - t * W:.0f} s into w{t}"))
                    if back < n:
                        self.mult[side][r, back, c] += math.log(1.3)
                for t in _episodes(rng, 150, windows):
                    side = "fp8" if rng.random() < 0.5 else "fp16"
                    ln = int(rng.integers(1, 3))
                    for w in range(t, t + ln):
                        self.burst[(r, w, side)] = float(rng.uniform(0.01, 0.04))
                    self.events.append((r, t, t + ln, f"429 on {side} " + ",".join(
                        f"{self.burst[(r, w, side)]:.3f}" for w in range(t, t + ln))))
            if f.night:
                ld = np.array([_load20(t) for t in range(n)])
                for p in ("fp8", "fp16"):
                    self.mult[p][r] += np.log1p(0.2 * ld)[:, None]
            if f.skew:
                self.skew_s[r] = rng.uniform(20, 90)
                self.trans[r] = [(t * W + rng.uniform(0, W), rng.uniform(30, 150), rng.uniform(1.3, 2.0))
                                 for t in _episodes(rng, 12, windows)]
                for a, d, x in self.trans[r]:
                    self.events.append((r, int(a // W), int((a + d + 90) // W) + 1,
                                        f"transient {a % W:.0f}+{d:.0f} s x{x:.2f} (FP16 clock +{self.skew_s[r]:.0f} s)"))
            if f.diurnal_adv or f.peak_queue:
                ld = np.array([_load_day(t) for t in range(n)])
                for p in ("fp8", "fp16"):
                    self.mult[p][r] += np.log1p(0.15 * ld)[:, None]
                if f.diurnal_adv:
                    lo, hi = math.log(0.80), math.log(0.93)
                    self.mult["fp8"][r] += (lo + (hi - lo) * (ld - 0.4) / 0.6)[:, None]
            if f.peak_queue:
                self._peak_queue(r, n)

    def _restarts(self, r: int, n: int) -> None:
        rng = self.rng
        warm = [math.log(1.30), math.log(1.15), math.log(1.05)]
        for p in ("fp8", "fp16"):
            for c in range(self.k[p]):
                age = int(rng.integers(0, 288))
                g = 0
                restarts = set(_episodes(rng, 288, n))
                since = 10**9
                for t in range(n):
                    if t in restarts:
                        self.events.append((r, t, t + 3, f"restart {p}-{c} (uptime {age} w)"))
                        age, since = 0, 0
                        if rng.random() < 0.5:
                            g += 1
                    self.mult[p][r, t, c] += 0.0003 * age
                    if since < 3:
                        self.mult[p][r, t, c] += warm[since]
                    self.gen[p][r, t, c] = g
                    age += 1
                    since += 1

    def _peak_queue(self, r: int, n: int) -> None:
        rng = self.rng
        pk = np.array([_peak(t) for t in range(n)])
        self.share[r] = self.base["fp16_share"] - 0.04 * pk
        steps = np.zeros(n, dtype=int)   # autoscaler: 2 replicas per step
        for t in range(n):
            h = _hour(t)
            steps[t] = (1 if 11 <= h < 17 else 0) + (1 if 12.5 <= h < 16 else 0)
        q = 0.08 * pk / (2.0 ** steps)
        self.mult["fp8"][r] += np.log1p(q)[:, None]
        self.nrep["fp8"][r] = self.k["fp8"] + 2 * steps
        for t in range(1, n):
            for c in range(self.nrep["fp8"][r, t - 1], self.nrep["fp8"][r, t]):
                self.mult["fp8"][r, t, c] += math.log(1.3)
        del rng

    # --- hooks ---------------------------------------------------------------------------------

    def _names_builds(self) -> bool:
        return False

    def _count(self, r: int, t: int, prec: str, load: float) -> int:
        f, rng = self.f, self.rng
        share = self.share[r, t] if prec == "fp16" else 1 - self.share[r, t]
        if f.night:
            load = _load20(t)
        elif f.diurnal_adv or f.peak_queue:
            load = _load_day(t)
        return max(int(rng.poisson(self.base["total"] * share * load)), 1)

    def _draw(self, r: int, t: int, prec: str, n: int, bias_c: float, bias_p: float
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        lat, p_tok, c_tok, rep, builds = super()._draw(r, t, prec, n, bias_c, bias_p)
        f, rng = self.f, self.rng
        if f.night and _load20(t) < 0.5:   # batch jobs at night: 20 points more long prompts
            on = np.flatnonzero((p_tok < 1000) & (rng.random(n) < 0.20 / 0.75))
            p_new = np.maximum(np.round(np.exp(math.log(2500) + 0.6 * rng.normal(size=on.size))), 1)
            lat[on] *= _base(p_new, c_tok[on]) / _base(p_tok[on], c_tok[on])
            p_tok[on] = p_new.astype(int)
        if f.skew:
            s = self.skew_s[r] if prec == "fp16" else 0.0
            lo, hi = t * W - s, (t + 1) * W - s       # the real times this precision's window t holds
            for a, d, x in self.trans.get(r, []):
                ov = max(0.0, min(a + d, hi) - max(a, lo)) / W
                if ov > 0:
                    lat[rng.random(n) < ov] *= x
        return lat, p_tok, c_tok, rep, builds

    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        out = super().signals(t, routes)
        rng = self.rng
        for s in out:
            r = routes.index(s.route)
            p, d = s.precision, s.detail
            extra = 0
            own: dict[str, int] = {}  # failures of one replica (a crash)
            spread = 0                 # failures spread over the precision's replicas (a 429 burst)
            if self.f.oom:
                for c in range(self.k[p]):
                    sh = self.err_share.get((r, t, p, c))
                    if sh:   # the crashed replica's share of the precision's requests
                        m = int(rng.binomial(int(round(d["events"] / self._replicas(r, t, p))), sh))
                        own[f"{p}-{c}"] = own.get(f"{p}-{c}", 0) + m
                        extra += m
                b = self.burst.get((r, t, p))
                if b:
                    spread = int(rng.binomial(d["events"], b))
                    extra += spread
            if extra:
                extra = min(extra, max(d["ok"] - 1, 0))
                d["errors"] += extra
                d["ok"] -= extra
                d["completions"] = d["ok"]
                s.values["error_rate"] = (d["errors"] + d["timeouts"]) / d["events"]
            replica_fails(d, rng, own, spread)
            if self.f.restart:
                reps = d.get("replicas", {})
                renamed = {}
                for name, v in reps.items():
                    c = int(name.rsplit("-", 1)[1])
                    g = int(self.gen[p][r, t, c])
                    renamed[f"{name}.g{g}" if g else name] = v
                d["replicas"] = renamed
        return out


# --- rollback traces --------------------------------------------------------------------------

#: every rollback's verdicts: (shape, route, window, policy, rule, reason code, message, estimate, ci)
TRACES: list[dict[str, Any]] = []
_CTX: dict[str, Any] = {"shape": "", "t": 0}


class TracingEngine(PolicyEngine):
    """The shipped engine; records each rollback's verdicts (nothing else changes)."""

    def observe(self, *a: Any, **k: Any) -> Any:   # type: ignore[override]
        acts = super().observe(*a, **k)
        for x in acts:
            if x.kind != "rollback" or x.detail.get("retry"):
                continue
            pols = [x.policy] + [y.get("policy") for y in x.detail.get("also", [])]
            for v in x.detail.get("verdicts", []) or []:
                v = v or {}
                jd = v.get("judgement") or {}
                det = jd.get("detail") or {}
                TRACES.append({"shape": _CTX["shape"], "route": x.route, "window": _CTX["t"], "policies": pols,
                               "rule": v.get("rule"), "status": v.get("status"), "reason": jd.get("reason"),
                               "message": str(jd.get("message") or v.get("reason"))[:500],
                               "estimate": jd.get("estimate"), "ci": [jd.get("ci_low"), jd.get("ci_high")],
                               "candidate": v.get("candidate"), "baseline": v.get("baseline"),
                               "full": json.dumps(det, default=str)[:3000],
                               "detail": {kk: det.get(kk) for kk in ("gap", "level", "learned", "pooled_windows",
                                                                     "own", "baseline_moved", "looks", "rotated",
                                                                     "pooled_replays", "identical_replays",
                                                                     "aa_moving", "draw", "horizon", "tolerance")
                                          if kk in det},
                               "action_reason": str(x.reason)[:400]})
        return acts


def _traced(fn: Any, shape: str, *a: Any, **k: Any) -> Any:
    saved = oc.PolicyEngine
    oc.PolicyEngine = TracingEngine   # type: ignore[misc]  # run_sim / run_golden build theirs by name
    _CTX["shape"] = shape
    orig_obs = oc._observe

    def obs(engine: Any, sigs: Any, now: Any, flags: Any, names: Any, c: Any, t: int) -> None:
        _CTX["t"] = t
        orig_obs(engine, sigs, now, flags, names, c, t)

    oc._observe = obs   # type: ignore[assignment]
    try:
        return fn(*a, **k)
    finally:
        oc.PolicyEngine = saved   # type: ignore[misc]
        oc._observe = orig_obs   # type: ignore[assignment]


def context(sim: Fleet3Sim, r: int, t: int, back: int = 8) -> str:
    """What the shape drew on route r in windows t - back .. t (for the traces)."""
    ev = [f"[w{a}-{b - 1}] {w}" for rr, a, b, w in sim.events if rr == r and a <= t and b > t - back]
    h = _hour(t)
    return f"{int(h):02d}:{int(60 * (h % 1)):02d}; " + ("; ".join(ev) if ev else "no drawn event in the 8 windows before")


def run_fleet3(ps: PolicySet, f: Fleet3, routes: int, windows: int, seed: int, reg: Reg | None = None) -> Any:
    sim = Fleet3Sim(f, routes, windows, seed, reg)
    n0 = len(TRACES)
    c = _traced(run_sim, f.name, ps, sim, routes, windows, "legal/k")
    for x in TRACES[n0:]:
        x["context"] = context(sim, int(x["route"].removeprefix("legal/k")), x["window"])
    return c


# --- golden -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class G3:
    name: str
    shuffle: bool = False
    edit_every: float = 0.0
    nan_share: float = 0.0
    batch_share: float = 0.0


GOLDEN = [G3("golden-fixed"), G3("golden-shuffled", shuffle=True), G3("golden-edited-nan", edit_every=12, nan_share=0.01),
          G3("golden-batch", batch_share=0.04)]


class G3Sim(GSim):
    """Greedy replays of ``GSim``'s per-item levels (no sampled items), with this file's harness shapes."""

    G: G3 = GOLDEN[0]

    def __init__(self, g: GShape, routes: int, seed: int) -> None:
        super().__init__(GShape(g.name, 200, 0.0), routes, seed)
        rng = self.rng
        n = 200
        # a pool of items to edit in: level drawn as GSim's
        self.ids = [list(range(n)) for _ in range(routes)]
        self.next_id = n
        self.lev: list[dict[int, float]] = [{i: float(self.level[r, i]) for i in range(n)} for r in range(routes)]
        self.base16: list[dict[int, float]] = [{i: float(self.fp16_score[r, i]) for i in range(n)} for r in range(routes)]
        del rng

    def _new_level(self) -> float:
        rng = self.rng
        u = rng.random()
        if u < 0.8:
            return 0.0
        if u < 0.97:
            return float(np.clip(rng.normal(0, 0.12), -1, 1))
        return float((-1 if rng.random() < 0.5 else 1) * rng.uniform(0.3, 0.7))

    def signals(self, t: int) -> list[Signal]:
        g, rng = self.G, self.rng
        start = oc.T0 + t * 3600.0
        out = []
        for r, route in enumerate(self.names):
            if g.edit_every and t > 0 and rng.random() < 1 / g.edit_every:   # 10 items replaced
                ids = self.ids[r]
                for pos in rng.choice(len(ids), 10, replace=False):
                    new = self.next_id
                    self.next_id += 1
                    self.lev[r][new] = self._new_level()
                    self.base16[r][new] = float(rng.beta(5, 2))
                    ids[pos] = new
            ids = list(self.ids[r])
            if g.shuffle:
                ids = [ids[i] for i in rng.permutation(len(ids))]
            n = len(ids)
            d = np.array([self.lev[r][i] for i in ids])
            if g.batch_share:
                d = d + np.where(rng.random(n) < g.batch_share, rng.uniform(-0.5, 0.5, n), 0.0)
            d = np.clip(d, -1, 1)
            aa = np.zeros(n)
            em = np.where(d < -0.2, -1.0, np.where(d > 0.2, 1.0, 0.0))
            em_aa = np.zeros(n)
            if g.nan_share:
                nan = rng.random(n) < g.nan_share   # timed out on one precision: no score
                d = np.where(nan, np.nan, d)
                em = np.where(nan, np.nan, em)
            detail = {"golden_set": "outside3", "item_ids": ids,
                      "aa": {"rougeL": aa.tolist(), "exact_match": em_aa.tolist()}}
            out.append(Signal("golden", "m", route, "fp8", start, start + 120, n,
                              {"rougeL": 0.6 + float(np.nanmean(d)), "exact_match": 0.5 + float(np.nanmean(em))},
                              {"rougeL": d.tolist(), "exact_match": em.tolist()}, None, detail))
        return out


def run_golden3(ps: PolicySet, g: G3, routes: int, replays: int, seed: int) -> Any:
    saved = oc.GSim
    G3Sim.G = g
    oc.GSim = G3Sim   # type: ignore[misc]  # run_golden builds its GSim by name
    try:
        return _traced(run_golden, g.name, ps, GShape(g.name, 200, 0.0), routes, replays, seed)
    finally:
        oc.GSim = saved   # type: ignore[misc]


# --- power --------------------------------------------------------------------------------------


def _ok_counts(d: dict[str, Any]) -> dict[str, int]:
    return {name: int(sum(c for _, c in v["latency_hist"].get("bins", []))) for name, v in d.get("replicas", {}).items()}


def replica_fails(d: dict[str, Any], rng: np.random.Generator, own: dict[str, int], spread: int) -> None:
    """The window's per-replica failures (``replica_fails``: replica -> [ok, errors, timeouts], as the
    daemon's windows give them): the background errors and timeouts and ``spread`` more spread over the
    replicas by their requests, ``own`` on the replica named."""
    ok = _ok_counts(d)
    if not ok:
        return
    names = sorted(ok)
    w = np.array([ok[k] for k in names], dtype=float) + 1.0
    w /= w.sum()
    base_err = d["errors"] - sum(own.values()) - spread
    err = rng.multinomial(max(base_err + spread, 0), w)
    to = rng.multinomial(d["timeouts"], w)
    d["replica_fails"] = {k: [ok[k], int(err[i]) + own.get(k, 0), int(to[i])] for i, k in enumerate(names)}


def add_spread(d: dict[str, Any], rng: np.random.Generator, m: int) -> None:
    """``m`` more errors spread over the replicas by their requests (a regression of the whole precision)."""
    fails = d.get("replica_fails")
    if not fails or m <= 0:
        return
    names = sorted(fails)
    w = np.array([fails[k][0] for k in names], dtype=float) + 1.0
    for k, x in zip(names, rng.multinomial(m, w / w.sum()), strict=True):
        fails[k][1] += int(x)


@dataclass
class Reg3(Reg):
    errors: float = 0.0


class Fleet3RegSim(Fleet3Sim):
    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        out = super().signals(t, routes)
        reg = self.reg
        extra = getattr(reg, "errors", 0.0)
        if extra and t >= reg.onset:
            for s in out:
                if s.precision != "fp8":
                    continue
                d = s.detail
                more = min(int(self.rng.binomial(d["events"], extra)), max(d["ok"] - 1, 0))
                add_spread(d, self.rng, more)
                d["errors"] += more
                d["ok"] -= more
                d["completions"] = d["ok"]
                s.values["error_rate"] = (d["errors"] + d["timeouts"]) / d["events"]
        return out


POWER = [  # (background, name, regression, within)
    ("h200-throttle", "whole +10 %", Reg3(shift=0.10, onset=100), 3),
    ("restart-warm", "whole +10 %", Reg3(shift=0.10, onset=100), 3),
    ("skew-transient", "whole +10 %", Reg3(shift=0.10, onset=100), 3),
    ("night-20x", "whole +10 % (08:20)", Reg3(shift=0.10, onset=100), 3),
    ("night-20x", "whole +10 % (16:40)", Reg3(shift=0.10, onset=200), 3),
    ("h200-diurnal", "whole +10 % (08:20)", Reg3(shift=0.10, onset=100), 3),
    ("h200-diurnal", "whole +10 % (16:40)", Reg3(shift=0.10, onset=200), 3),
    ("night-20x", "whole +10 % (day 2 08:20)", Reg3(shift=0.10, onset=388), 3),
    ("h200-diurnal", "whole +10 % (day 2 08:20)", Reg3(shift=0.10, onset=388), 3),
    ("oom-replica", "errors +2 points", Reg3(errors=0.02, onset=100), 5),
]


def main(argv: list[str] | None = None) -> int:
    ap = check_args("outside check, third pass, through the shipped engine", 7007, "healthy,golden,power")
    ap.add_argument("--power-routes", type=int, default=0)
    args = ap.parse_args(argv)
    ps = load_policy_files(args.policies)
    q = args.quick
    routes, windows = args.routes or (2 if q else 10), args.windows or (40 if q else 300)
    parts, pick = set(args.parts.split(",")), set(args.shapes.split(",")) - {""}
    res: dict[str, Any] = {"healthy": [], "reported": [], "golden": [], "power": [], "args": vars(args)}
    t0 = time.perf_counter()
    if "healthy" in parts:
        for i, f in enumerate(SHAPES):
            if not pick or f.name in pick:
                report_row(res, "reported" if f.reported else "healthy", f.name,
                           run_fleet3(ps, f, routes, windows, args.seed + i), t0)
        rows = res["healthy"]
        if rows:
            n = sum(x["windows"] for x in rows)
            for p in oc.POLICIES:
                k = sum(x["rollbacks"][p] for x in rows)
                print(f"pooled healthy (without reported) {p}: {k} / {n}  bound/10k {1e4 * upper95(k, n):.2f}")
    if "golden" in parts:
        for g in GOLDEN:
            if not pick or g.name in pick:
                # one seed for every golden shape: the same routes' item levels, so golden-fixed is their control
                report_row(res, "golden", g.name, run_golden3(ps, g, 4 if q else 20, 20 if q else 100,
                                                              args.seed + 100), t0)
    if "power" in parts:
        by = {f.name: f for f in SHAPES}
        pr = args.power_routes or (4 if q else 20)
        for j, (bg, name, reg, within) in enumerate(POWER):
            if pick and bg not in pick:
                continue
            c = _traced(run_sim, f"power:{bg}:{name}", ps,
                        Fleet3RegSim(by[bg], pr, reg.onset + within + 1, args.seed + 200 + j, reg),
                        pr, reg.onset + within + 1, "legal/p")
            p, n = power(c, reg.onset, within)
            early = sum(1 for x in c.first if 0 <= x < reg.onset)
            res["power"].append({"scenario": name, "background": bg, "within": within, "power": p, "routes": n,
                                 "early": early, "by_rule": c.by_rule})
            print(f"power    {name:22s} on {bg:16s} within {within:2d}: {p:.3f} ({n} routes, {early} rolled back "
                  f"before onset)  {c.by_rule}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    res["traces"] = TRACES
    print("\n--- verdicts of every rollback (healthy and golden) ---")
    for x in TRACES:
        if x["shape"].startswith("power:"):
            continue
        print(f"{x['shape']:18s} {x['route']:10s} w{x['window']:<4d} {','.join(str(p) for p in x['policies'])} "
              f"{x['rule']} {x['status']}/{x['reason']} est={x['estimate']} ci={x['ci']} "
              f"cand={x['candidate']} base={x['baseline']}\n      msg: {x['message']}"
              f"\n      detail: {json.dumps(x['detail'], default=str)[:400]}"
              + (f"\n      drawn: {x['context']}" if x.get("context") else ""))
    return oc.finish(res, t0, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
