"""How much a tail statistic can see of a p99-only regression in one window of the fleet benchmark's
request-level shape (docs/BENCHMARKS_decisions.md, "Fleet confounders", reading the p99 rows).

Each window draws FP8 and FP16 requests exactly as ``bench/fleet_confounders.py`` does (prompt and
completion lengths, 8 FP8 replicas with their own offsets, ~5,950 FP8 and ~1,050 FP16 requests);
half the windows carry the +10 % p99-only regression on FP8. For each candidate window statistic
(FP8 minus FP16) it prints the shift the regression causes, the statistic's sd over healthy windows
and their ratio ``z1`` (signal / noise in one window), and the shift a 25-point router bias causes,
in sds. The shipped ``latency-p99`` rule judges the tail contrast at 0.95 (CVaR minus mean) pooled
over 5 windows against alpha 3e-5; with ``z1`` ~ 2, five windows give ~4.5 sd against a critical
value of ~4.45, hence a power near one half, whatever the statistic below.

    python bench/tail_efficiency.py --windows 400 --seed 2
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT_DIR = Path(__file__).resolve().parent.parent
if str(ROOT_DIR) not in sys.path:
    sys.path.insert(0, str(ROOT_DIR))

from bench.decisions import _tail  # noqa: E402
from bench.fleet_confounders import FP16_SHARE, LONG_SHARE, REPLICAS, TOTAL  # noqa: E402


def requests(rng: np.random.Generator, n: int, long_share: float, p99: float) -> tuple[np.ndarray, np.ndarray]:
    """(log latency, prompt octave) of ``n`` requests as the fleet benchmark draws them (8 replicas
    with their own offsets; FP16's 2 replicas differ only in how the offsets average)."""
    long = rng.random(n) < long_share
    p = np.maximum(np.round(np.exp(np.where(long, math.log(3000), math.log(300)) + 0.5 * rng.normal(size=n))), 1)
    c = np.clip(np.round(np.exp(math.log(150) + 0.3 * rng.normal(size=n))), 1, 4000)
    lat = (100 + 0.3 * p + 20 * c * (1 + p / 8000)) * np.exp(0.2 * rng.normal(size=n))
    rep = rng.integers(0, REPLICAS["fp8"], n)
    lat *= np.exp(rng.normal(0, 0.02, REPLICAS["fp8"])[rep])
    if p99:
        u = (np.argsort(np.argsort(lat)) + 0.5) / n
        lat *= _tail(u, p99)
    return np.log(lat), np.floor(np.log2(p)).astype(int)


def l_statistic(weight: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray, np.ndarray], float]:
    """A linear function of the order statistics with centred weights ``weight(rank)``: every
    location shift cancels, as in the shipped tail contrast."""
    def stat(y: np.ndarray, _strata: np.ndarray) -> float:
        y = np.sort(y)
        w = weight((np.arange(y.size) + 0.5) / y.size)
        return float(((w - w.mean()) * y).mean())
    return stat


def stratified_contrast(ref: dict[int, float], p: float = 0.95) -> Callable[[np.ndarray, np.ndarray], float]:
    """The 0.95 tail contrast of the mixture reweighted to fixed prompt-octave shares ``ref``."""
    def stat(y: np.ndarray, strata: np.ndarray) -> float:
        w = np.zeros(y.size)
        for k, share in ref.items():
            m = strata == k
            if m.any():
                w[m] = share / m.sum()
        o = np.argsort(y)
        y, w = y[o], w[o]
        q = y[np.searchsorted(np.cumsum(w) / w.sum(), p)]
        top = y >= q
        return float((w * y)[top].sum() / w[top].sum() - (w * y).sum() / w.sum())
    return stat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=400)
    ap.add_argument("--seed", type=int, default=2)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    n8, n16 = round(TOTAL * (1 - FP16_SHARE)), round(TOTAL * FP16_SHARE)
    _, big = requests(rng, 200_000, LONG_SHARE, 0.0)
    ks, cs = np.unique(big, return_counts=True)
    ref = dict(zip(ks.tolist(), (cs / cs.sum()).tolist(), strict=True))
    stats: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
        f"tail contrast {p}": l_statistic(lambda u, p=p: (u > p) / (1 - p)) for p in (0.90, 0.93, 0.95, 0.97)}
    stats["ramp 0.90-0.99 (the regression's own shape)"] = l_statistic(lambda u: np.clip((u - 0.9) / 0.09, 0, 1))
    stats["trimmed 0.93-0.99"] = l_statistic(lambda u: ((u > 0.93) & (u < 0.99)) * 1.0)
    stats["tail contrast 0.95, prompt-octave strata"] = stratified_contrast(ref)
    bias = 0.25
    vals: dict[str, dict[str, list[float]]] = {k: {"healthy": [], "p99": [], "bias": []} for k in stats}
    for _ in range(args.windows):
        for case, long8, long16, p99 in (("healthy", LONG_SHARE, LONG_SHARE, 0.0), ("p99", LONG_SHARE, LONG_SHARE, 0.10),
                                         ("bias", LONG_SHARE + bias * FP16_SHARE, LONG_SHARE - bias * (1 - FP16_SHARE), 0.0)):
            y16, s16 = requests(rng, n16, long16, 0.0)
            y8, s8 = requests(rng, n8, long8, p99)
            for name, f in stats.items():
                vals[name][case].append(f(y8, s8) - f(y16, s16))
    print(f"{'statistic':46s} {'p99 shift':>10s} {'sd':>8s} {'z1':>6s} {'bias (sd)':>10s}")
    for name, v in vals.items():
        h, r, b = (np.asarray(v[c]) for c in ("healthy", "p99", "bias"))
        sd = float(h.std())
        print(f"{name:46s} {r.mean() - h.mean():+10.4f} {sd:8.4f} {(r.mean() - h.mean()) / sd:6.2f} "
              f"{(b.mean() - h.mean()) / sd:+10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
