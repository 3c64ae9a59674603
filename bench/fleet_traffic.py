"""Fleet situations the decision benchmark did not generate before (issue 17 items 5-6), through
the shipped engine and policies (docs/BENCHMARKS_decisions.md "Cold starts, creep, thin and
lopsided traffic").

Every generator is ``bench/decisions.py``'s ``LiveSim`` (the same windows, sketches and counts)
with one thing changed, seeded:

  cold-start        a fresh engine (new route, or a restart that lost its state) while FP8 is
                    already 10 % slower than FP16 (whole distribution) from the first window
  restart           60 healthy windows with state, FP8 becomes 10 % slower at window 60 and the
                    daemon restarts without state at the same window
  creep             FP8 1.6x faster than FP16, after 150 healthy windows FP8's latency creeps up
                    by 0.06 % per window (+19 % per day of 5-minute windows) for 300 windows
  low-N             N requests per precision per window (FP16 share 50 %; N = 20, 50, 100)
  lopsided          FP16 share 5 % of 7,000 requests (~350 FP16 requests per window)

on the background the audit used (``replica-1/10``: per-precision AR(1) replica effects, sd 1 %
latency / 10 % error rate), and ``replica-2/15`` where named. Regressions: ``shift`` (whole
distribution), ``errors`` (absolute points added to FP8's error rate), ``creep`` (log latency
per window after onset).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Any

import bench.decisions as d
from watchdog.core.signals import Signal
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.loader import PolicySet

__all__ = ["FLEET_MODELS", "Fleet", "FleetSim", "run_fleet", "run_all"]


@dataclass(frozen=True)
class Fleet:
    """A fleet situation: a ``decisions.Live`` noise model plus traffic per window."""

    name: str
    live: d.Live
    #: requests per route and window, both precisions together
    total: int = d.TOTAL


REPLICA_1 = d.LIVE_MODELS[1]
REPLICA_2 = d.LIVE_MODELS[2]
SPEEDUP_1 = replace(d.LIVE_MODELS[6], name="speedup-1.6+replica-1/10", lat_sd=0.01, err_sd=0.10)

FLEET_MODELS = [
    Fleet("low-20+replica-1/10", replace(REPLICA_1, fp16_share=0.5), total=40),
    Fleet("low-50+replica-1/10", replace(REPLICA_1, fp16_share=0.5), total=100),
    Fleet("low-100+replica-1/10", replace(REPLICA_1, fp16_share=0.5), total=200),
    Fleet("lopsided-5%+replica-1/10", replace(REPLICA_1, fp16_share=0.05)),
    Fleet("lopsided-5%+replica-2/15", replace(REPLICA_2, fp16_share=0.05)),
]


@dataclass
class FleetRegression(d.Regression):
    #: log latency added per window after ``onset`` (slow creep)
    creep: float = 0.0


class FleetSim(d.LiveSim):
    """``LiveSim`` with a per-model traffic total and a creeping regression."""

    def __init__(self, fleet: Fleet, routes: int, windows: int, seed: int, reg: d.Regression | None = None) -> None:
        super().__init__(fleet.live, routes, windows, seed, reg)
        self.total = fleet.total

    def signals(self, t: int, routes: list[str]) -> list[Signal]:
        reg = self.reg
        saved_total, saved_reg = d.TOTAL, reg
        if isinstance(reg, FleetRegression) and reg.creep and t >= reg.onset:
            # a creep is a whole-distribution shift that grows every window
            self.reg = replace(reg, shift=math.exp(reg.creep * (t - reg.onset + 1)) - 1.0)
        d.TOTAL = self.total
        try:
            return super().signals(t, routes)
        finally:
            d.TOTAL, self.reg = saved_total, saved_reg


def run_fleet(ps: PolicySet, fleet: Fleet, routes: int, windows: int, seed: int, prefix: str,
              regs: list[d.Regression | None], fresh_at: int | None = None) -> list[d.Tally]:
    """As ``decisions.run_live_branches``: one healthy run up to the regressions' common onset,
    then one continuation per regression from a copy of the engine and simulator. With
    ``fresh_at`` the engine loses its state at that window (a restart without state; a new
    route when 0)."""
    onset = min((r.onset for r in regs if r is not None), default=windows)
    sim = FleetSim(fleet, routes, windows, seed, None)
    names = [f"{prefix}/r{i}" for i in range(routes)]
    engine = PolicyEngine(ps)
    flags = {("m", r): "fp8" for r in names}
    prefix_t = d.Tally(first=[-1] * routes)
    for t in range(min(onset, windows)):
        if t == fresh_at:
            engine = PolicyEngine(ps)
        d._observe(engine, sim.signals(t, names), d.T0 + (t + 1) * d.WINDOW_S + 1, flags, names, prefix_t, t)
        prefix_t.windows += routes
    out = []
    for reg in regs:
        tally = copy.deepcopy(prefix_t)
        e2, s2 = (copy.deepcopy(engine), copy.deepcopy(sim)) if len(regs) > 1 else (engine, sim)
        s2.reg = reg or d.Regression()
        for t in range(min(onset, windows), windows):
            if t == fresh_at:
                e2 = PolicyEngine(ps)
            d._observe(e2, s2.signals(t, names), d.T0 + (t + 1) * d.WINDOW_S + 1, flags, names, tally, t)
            tally.windows += routes
        out.append(tally)
    return out


def _healthy_row(res: dict[str, Any], name: str, label: str, tl: d.Tally) -> None:
    row = {"model": name, "routes": label, "windows": tl.windows, "rollbacks": tl.rollbacks,
           "per_10k": 1e4 * tl.rollbacks / max(tl.windows, 1),
           "upper95_per_10k": 1e4 * d.upper95(tl.rollbacks, tl.windows), "by_rule": tl.by_rule}
    res["fleet_healthy"].append(row)
    print(f"{name:28s} {label:>6s} {tl.windows:8d} {tl.rollbacks:9d} {row['per_10k']:8.2f} "
          f"{row['upper95_per_10k']:8.2f}  {tl.by_rule}")


def _power_row(res: dict[str, Any], scenario: str, label: str, tl: d.Tally, onset: int, within: int,
               n: int) -> None:
    p = d.power(tl, onset, within)
    res["fleet_power"].append({"scenario": scenario, "routes": label, "n": n, "within": f"{within} windows",
                               "power": p, "by_rule": tl.by_rule})
    print(f"power {label:6s} {scenario:52s} within {within:3d} windows: {p:.3f} ({n} routes) {tl.by_rule}")


def run_all(ps: PolicySet, res: dict[str, Any], *, quick: bool, seed: int, routes: int, windows: int,
            power_routes: int) -> None:
    """Healthy false rollbacks on the fleet models and the cold-start / restart / creep /
    low-traffic / lopsided power scenarios; rows go to ``res["fleet_healthy"]`` and
    ``res["fleet_power"]``."""
    res.setdefault("fleet_healthy", [])
    res.setdefault("fleet_power", [])
    prefixes = {"legal": 0, "chat": 1000}
    models = FLEET_MODELS[1:2] + FLEET_MODELS[3:4] if quick else FLEET_MODELS
    for i, fl in enumerate(models):
        for label, off in prefixes.items():
            tl = run_fleet(ps, fl, routes, windows, seed + 500 + i + off, label, [None])[0]
            _healthy_row(res, fl.name, label, tl)
    n = 6 if quick else power_routes
    label = "chat"
    # cold start: a fresh engine, FP8 10 % slower from the first window
    for fl in ([Fleet("replica-1/10", REPLICA_1)] if quick else
               [Fleet("iid", d.LIVE_MODELS[0]), Fleet("replica-1/10", REPLICA_1), Fleet("replica-2/15", REPLICA_2)]):
        tl = run_fleet(ps, fl, n, 12 if quick else 30, seed + 600, label, [d.Regression(onset=0, shift=0.10)])[0]
        _power_row(res, f"cold start, FP8 +10% whole ({fl.name})", label, tl, 0, 10, n)
    # restart without state while FP8 is already 10 % slower
    if not quick:
        fl = Fleet("replica-1/10", REPLICA_1)
        tl = run_fleet(ps, fl, n, 90, seed + 610, label, [d.Regression(onset=60, shift=0.10)], fresh_at=60)[0]
        _power_row(res, "restart without state, FP8 +10% whole (replica-1/10)", label, tl, 60, 10, n)
    # low traffic: 50 requests per precision per window, after a healthy history
    onset = 20 if quick else 110
    fl = FLEET_MODELS[1]
    tls = run_fleet(ps, fl, n, onset + 30, seed + 620, label,
                    [d.Regression(onset=onset, shift=0.30), d.Regression(onset=onset, errors=0.05)])
    _power_row(res, f"+30% whole ({fl.name})", label, tls[0], onset, 30, n)
    _power_row(res, f"errors 1% -> 6% ({fl.name})", label, tls[1], onset, 30, n)
    # lopsided traffic: FP16 share 5 %
    fl = FLEET_MODELS[3]
    tl = run_fleet(ps, fl, n, onset + 10, seed + 630, label, [d.Regression(onset=onset, shift=0.10)])[0]
    _power_row(res, f"+10% whole ({fl.name})", label, tl, onset, 10, n)
    # creep on a 1.6x-speed-up route: only the anchor can see it (FP8 stays faster than FP16)
    if not quick:
        fl = Fleet("speedup-1.6+replica-1/10", SPEEDUP_1)
        c_onset, span = 150, 300
        tl = run_fleet(ps, fl, n, c_onset + span, seed + 640, label,
                       [FleetRegression(onset=c_onset, creep=0.0006)])[0]
        _power_row(res, "creep +0.06%/window on a 1.6x speed-up (speedup-1.6+replica-1/10)", label, tl,
                   c_onset, span, n)
        hits = sorted(f - c_onset for f in tl.first if f >= c_onset)
        if hits:
            res["fleet_power"][-1]["median_windows"] = hits[len(hits) // 2]
            print(f"    creep caught after a median of {hits[len(hits) // 2]} windows "
                  f"(FP8 {100 * (math.exp(0.0006 * hits[len(hits) // 2]) - 1):.0f} % slower than its start)")
