"""Live latency compared like with like: net of the request mix, without a stalled replica (docs/JUDGE.md,
"Request mix and replicas"). Pure numpy.

Two per-window statistics on top of the windows' fleet detail (watchdog/windows/fleet.py):

* ``mix_log_diff``: FP8 - FP16 mean log latency *within* request-mix cells (octave of prompt tokens x
  octave of completion tokens), combined with the cells' harmonic weights ``h = n8 n16 / (n8 + n16)``
  (the fixed-effects / Mantel-Haenszel weighting: minimum variance when the effect is the same in
  every cell). A router that sends FP8 more long prompts changes which cells FP8's requests fall in,
  not the within-cell differences, so it is not a slowdown; a per-request slowdown moves every cell.
  Variance ``sum h^2 (s8^2 / n8 + s16^2 / n16) / (sum h)^2`` with each precision's pooled within-cell
  variance ``s^2``.
* ``clean_side``: per precision, the replicas whose own latency is an *upward* outlier against the
  rest of that precision's replicas (a stall: a share of one replica's requests many times slower)
  are left out of that precision's sketch and cells before any statistic is computed. A replica is
  an outlier when its mean log latency or its tail contrast (mean log latency of its slowest
  ``1 - p`` minus its mean) exceeds the rest's by more than ``min_dev`` (log units) *and* by more
  than ``z_out`` standard errors. At most ``max(1, m // 8)`` of ``m`` replicas are left out per
  precision and window, the worst first; ``_other`` (overflow) and ``_none`` (no id) never are. When
  one more replica stands out after those (two of 8 replicas stalling at once), the window is not
  comparable like with like and is not judged (``outlier_replicas``; ``pooling``). A
  regression present on the precision's replicas alike moves every replica and the rest together, so
  none is an outlier and the window is judged whole. When nothing is left out, the statistic and
  its variance are exactly the unmodified ones. Replicas that joined in this window (``fleet_side``'s
  ``joined``: cold, watchdog/policy/changes.py) are left out first, beyond that limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import chain
from typing import Any

import numpy as np

from watchdog.policy.judge.memo import cached

__all__ = ["POOLED_IDS", "FleetOptions", "clean_side", "counts_at_least", "fleet_inputs", "fleet_side", "mix_log_diff",
           "mix_shift", "mix_tail_contrast", "outlier_replicas", "replica_spread",
           "within_tail_contrast"]

#: replica ids never left out: the overflow of more than MAX_REPLICAS and requests without an id
POOLED_IDS = frozenset({"_other", "_none"})


class FleetOptions:
    """How a window's fleet detail is used: ``adjust="mix"`` and/or ``replicas="robust"``."""

    __slots__ = ("adjust", "min_dev", "p", "replicas", "z_out")

    def __init__(self, adjust: str | None = None, replicas: str | None = None, p: float = 0.95,
                 z_out: float = 5.0, min_dev: float = 0.2) -> None:
        self.adjust, self.replicas, self.p, self.z_out, self.min_dev = adjust, replicas, p, z_out, min_dev


# --- request mix -------------------------------------------------------------------------------


def _cells(rows: Any) -> dict[tuple[int, int], tuple[float, float, float]]:
    """Mix cell rows by cell (read-only: inside ``memo.window_memo`` shared by the rules)."""
    return cached("cells", (rows,), (), lambda: _cells_now(rows))


def _cells_now(rows: Any) -> dict[tuple[int, int], tuple[float, float, float]]:
    out: dict[tuple[int, int], tuple[float, float, float]] = {}
    for r in rows or []:
        n = float(r[2])
        if n > 0:
            out[(int(r[0]), int(r[1]))] = (n, float(r[3]), float(r[4]))
    return out


def _within_var(cells: Mapping[Any, tuple[float, float, float]]) -> float:
    """Pooled within-cell variance of y (NaN without a cell of two or more)."""
    ss, df = 0.0, 0.0
    for n, s, q in cells.values():
        if n >= 2:
            ss += max(q - s * s / n, 0.0)
            df += n - 1
    return ss / df if df > 0 else math.nan


def mix_log_diff(cand_rows: Any, base_rows: Any) -> tuple[float, float, dict[str, Any]] | None:
    """(FP8 - FP16 mean log latency within request-mix cells, its variance, detail) from two
    precisions' ``latency_mix.cells`` rows ``[prompt octave, completion octave, n, sum y, sum y^2]``;
    None when no cell has requests of both. Inside ``memo.window_memo`` once per pair of rows."""
    return cached("mix_log_diff", (cand_rows, base_rows), (), lambda: _mix_log_diff(cand_rows, base_rows))


def _mix_log_diff(cand_rows: Any, base_rows: Any) -> tuple[float, float, dict[str, Any]] | None:
    a, b = _cells(cand_rows), _cells(base_rows)
    va, vb = _within_var(a), _within_var(b)
    if not (math.isfinite(va) and math.isfinite(vb)):
        return None
    num = den = var = own_b = 0.0
    used_a = used_b = 0.0
    for key, (na, sa, _) in a.items():
        cb = b.get(key)
        if cb is None:
            continue
        nb, sb = cb[0], cb[1]
        h = na * nb / (na + nb)
        num += h * (sa / na - sb / nb)
        own_b += h * (sb / nb)
        den += h
        var += h * h * (va / na + vb / nb)
        used_a += na
        used_b += nb
    if den <= 0:
        return None
    tot_a = sum(c[0] for c in a.values())
    tot_b = sum(c[0] for c in b.values())
    # "base": FP16's own mean log latency on the same cell weights (the difference is FP8's minus it)
    return num / den, var / (den * den), {"cells": len(a.keys() & b.keys()),
                                          "support": [used_a / tot_a, used_b / tot_b], "base": own_b / den}


def mix_shift(cand_rows: Any, base_rows: Any) -> tuple[float, float] | None:
    """(How much the request mix moves the FP8 - FP16 mean log latency, its sampling variance when
    both precisions draw from one mix). The shift is the unadjusted difference of mean log latency
    minus the within-cell one (``mix_log_diff``): ~0 when both precisions saw the same mix, whatever
    their speed. Its variance: the cell shares of n draws from one mix are multinomial, so the mix's
    part of a mean moves by B / n, B the between-cell variance of the cell means (both precisions'
    cells pooled); the shift by B (1/n8 + 1/n16). A wide mix (long and short answers) makes an
    ordinary window's shift wide too. None when it cannot be computed. Inside ``memo.window_memo``
    once per pair of rows (the window's gate and the pool's read it)."""
    return cached("mix_shift", (cand_rows, base_rows), (), lambda: _mix_shift(cand_rows, base_rows))


def _mix_shift(cand_rows: Any, base_rows: Any) -> tuple[float, float] | None:
    mixed = mix_log_diff(cand_rows, base_rows)
    if mixed is None:
        return None
    a, b = _cells(cand_rows), _cells(base_rows)
    na, nb = sum(c[0] for c in a.values()), sum(c[0] for c in b.values())
    raw = sum(c[1] for c in a.values()) / na - sum(c[1] for c in b.values()) / nb
    n, s, ss = 0.0, 0.0, 0.0
    for key in a.keys() | b.keys():
        cn = a.get(key, (0.0, 0.0, 0.0))[0] + b.get(key, (0.0, 0.0, 0.0))[0]
        cs = a.get(key, (0.0, 0.0, 0.0))[1] + b.get(key, (0.0, 0.0, 0.0))[1]
        n += cn
        s += cs
        ss += cs * cs / cn
    between = max(ss / n - (s / n) ** 2, 0.0)  # sum_c p_c m_c^2 - (sum_c p_c m_c)^2
    return raw - mixed[0], between * (1.0 / na + 1.0 / nb)


Tails = dict[tuple[int, int], tuple[list[float], list[float]]]


def _tails(mix: Any) -> tuple[Tails, float] | None:
    """A window's per-cell tail histograms ``{cell: (bucket indices, counts)}`` (floats, positive counts
    only) and their bucket width, or None when the window has none (read-only: inside
    ``memo.window_memo``)."""
    if not isinstance(mix, Mapping) or not mix.get("tails"):
        return None
    return cached("mix_tails", (mix,), (), lambda: _tails_now(mix))


def _tails_now(mix: Mapping[str, Any]) -> tuple[Tails, float] | None:
    width = float(mix.get("tail_width") or 0.0)
    if not width > 0:
        return None
    out: Tails = {}
    for row in mix["tails"]:
        idx: list[float] = []
        cnt: list[float] = []
        for i, c in row[2]:
            c = float(c)
            if c > 0:
                idx.append(float(i))
                cnt.append(c)
        if idx:
            out[(int(row[0]), int(row[1]))] = (idx, cnt)
    return (out, width) if out else None


# The windows' tail histograms are small (a light window: a few cells of one to a few requests, ~10
# buckets), where numpy's per-call overhead was most of the time. Below, everything but the three
# matrix-vector products per precision is plain Python on lists, written to give numpy's bits: ``_fsum``
# adds as numpy's ``add.reduce`` does on a contiguous float64 array (0.0 plus the pairwise sum), a running
# sum as ``cumsum``, ``_max``/``_min`` pick as numpy's ``maximum``/``clip`` do (signed zeros and NaN
# included), element-wise arithmetic is IEEE either way. The products stay numpy (BLAS: its order of
# summation is its own). tests/test_judge_mix_tail.py checks the bits against the numpy formulation.


def _pairwise(a: list[float], lo: int, n: int) -> float:
    """numpy's ``pairwise_sum`` of ``a[lo:lo + n]`` (8 accumulators up to 128 values, halves beyond)."""
    if n < 8:
        res = -0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    if n <= 128:
        r0, r1, r2, r3, r4, r5, r6, r7 = a[lo:lo + 8]
        i = lo + 8
        stop = lo + n - n % 8
        while i < stop:
            r0 += a[i]
            r1 += a[i + 1]
            r2 += a[i + 2]
            r3 += a[i + 3]
            r4 += a[i + 4]
            r5 += a[i + 5]
            r6 += a[i + 6]
            r7 += a[i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for j in range(i, lo + n):
            res += a[j]
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return _pairwise(a, lo, n2) + _pairwise(a, lo + n2, n - n2)


def _fsum(a: list[float]) -> float:
    """``float(np.asarray(a, dtype=float).sum())``, bit for bit."""
    return 0.0 + _pairwise(a, 0, len(a))


def _max(a: float, b: float) -> float:
    """numpy's ``maximum`` of two floats (NaN wins; of two equal values the second)."""
    return a if a > b or a != a else b


def _min(a: float, b: float) -> float:
    """numpy's minimum as ``clip`` takes it (NaN wins; of two equal values the second)."""
    return a if a < b or a != a else b


def mix_tail_contrast(cand_mix: Any, base_mix: Any, p: float) -> tuple[float, float, dict[str, Any]] | None:
    """(FP8 - FP16 tail contrast *net of the request mix*, its sampling variance, detail) from the two
    precisions' ``latency_mix`` (its ``tails``: per request-mix cell a histogram of log latency), or
    None when either has none, they share no cell, or their bucket widths differ.

    Standardisation: each precision's latency distribution is rebuilt from its own within-cell
    distributions with *common* cell weights ``w_c = h_c / sum h``, ``h = n8 n16 / (n8 + n16)`` (cells only
    one precision saw get none; no request weighs more than ``1 / sum h``), and the tail contrast
    (mean log latency above the ``p`` quantile minus the mean, ``judge.live.sketch_log_tail_contrast``) is
    taken of that mixture. A router that sends one precision more long prompts changes its cell counts,
    not the mixture; one mix drawn twice differs only within cells, so the multinomial noise of which
    requests are long - most of the plain contrast's noise on a wide mix - is gone. Variance, given the
    cell counts: ``sum_c w_c^2 s_c^2 / n_c`` per precision, ``s_c^2`` the within-cell variance of the
    contrast's influence function (cells of one request take their precision's pooled within-cell
    variance); the weights are common, so their own noise moves both precisions alike and cancels in
    the difference under the null. Inside ``memo.window_memo`` once per pair of windows and ``p``."""
    return cached("mix_tail_contrast", (cand_mix, base_mix), (p,), lambda: _mix_tail_contrast(cand_mix, base_mix, p))


def _mixture_contrast(x: list[float], mats: np.ndarray, n: list[float], w: list[float], p: float
                      ) -> tuple[float, float]:
    """(tail contrast of the mixture ``sum_c w_c mats_c / n_c`` on log midpoints ``x``, its variance)."""
    k = len(x)
    g = (np.array([wc / nc for wc, nc in zip(w, n, strict=True)]) @ mats).tolist()  # mass per bucket (sums to 1)
    need = 1.0 - p
    t = [0.0] * k  # mass of each bucket inside the top tail: clip(need - (above - g), 0, g)
    acc = 0.0
    for j in range(k - 1, -1, -1):
        gj = g[j]
        acc = gj if j == k - 1 else acc + gj  # the mass at and above bucket j (a running sum from the top)
        t[j] = _min(_max(need - (acc - gj), 0.0), gj)
    tail = _fsum([tj * xj for tj, xj in zip(t, x, strict=True)]) / need
    first = next((j for j, tj in enumerate(t) if tj > 0), 0)
    q = x[first]
    mean = _fsum([gj * xj for gj, xj in zip(g, x, strict=True)])
    infl = [((tj / gj if gj > 0 else 0.0) * (xj - q) / need + q - tail) - (xj - mean)
            for tj, gj, xj in zip(t, g, x, strict=True)]
    s1 = (mats @ np.array(infl)).tolist()
    sq = (mats @ np.array([f * f for f in infl])).tolist()
    # within-cell sums of squares of the influence function
    ss = [_max(sqc - s1c * s1c / nc, 0.0) for sqc, s1c, nc in zip(sq, s1, n, strict=True)]
    if any(nc >= 2 for nc in n):
        pooled = (_fsum([sc for sc, nc in zip(ss, n, strict=True) if nc >= 2])
                  / _fsum([nc - 1 for nc in n if nc >= 2]))
    else:
        pooled = _fsum([gj * f * f for gj, f in zip(g, infl, strict=True)])
    var = _fsum([wc * wc * (sc / _max(nc - 1, 1.0) if nc >= 2 else pooled) / nc
                 for wc, sc, nc in zip(w, ss, n, strict=True)])
    return tail - mean, var


def _mix_tail_contrast(cand_mix: Any, base_mix: Any, p: float) -> tuple[float, float, dict[str, Any]] | None:
    ta, tb = _tails(cand_mix), _tails(base_mix)
    if ta is None or tb is None or ta[1] != tb[1] or not 0.0 < p < 1.0:
        return None
    (a, width), (b, _) = ta, tb
    common = sorted(a.keys() & b.keys())
    if not common:
        return None
    keys = sorted({i for c in common for i in a[c][0]}.union(i for c in common for i in b[c][0]))
    col = {i: j for j, i in enumerate(keys)}
    x = [(i - 0.5) * width for i in keys]
    side = []
    for cells in (a, b):
        rows = []
        for c in common:
            row = [0.0] * len(keys)
            for i, v in zip(*cells[c], strict=True):
                row[col[i]] = v
            rows.append(row)
        side.append((np.array(rows), [_fsum(r) for r in rows]))
    na, nb = side[0][1], side[1][1]
    h = [x8 * x16 / (x8 + x16) for x8, x16 in zip(na, nb, strict=True)]
    hs = _fsum(h)
    w = [hc / hs for hc in h]
    (ca, va), (cb, vb) = (_mixture_contrast(x, m, n, w, p) for m, n in side)
    tot_a = sum(_fsum(v[1]) for v in a.values())
    tot_b = sum(_fsum(v[1]) for v in b.values())
    return ca - cb, va + vb, {"cells": len(common), "support": [_fsum(na) / tot_a, _fsum(nb) / tot_b],
                              "effective_n": hs}


def _count_matrix(rows: np.ndarray, idx: np.ndarray, cnt: np.ndarray, nrows: int) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct bucket indices, sorted; an ``nrows`` x buckets matrix of counts) from one (row,
    bucket index, count) triple per histogram entry: many small histograms as one matrix."""
    keys, col = np.unique(idx, return_inverse=True)
    # integer counts summed in float64: exact, in any order
    mat = np.bincount(rows * len(keys) + col, weights=cnt, minlength=nrows * len(keys)).reshape(nrows, len(keys))
    return keys, mat


def within_tail_contrast(mix: Any, p: float, least: int = 20) -> tuple[float, float] | None:
    """(One precision's latency *shape* net of the request mix, its sampling variance): the tail
    contrast (mean log latency above the ``p`` quantile minus the mean) within each request-mix cell
    of ``least`` or more requests, averaged over those cells with their own request counts as weights,
    from the window's per-cell tail histograms (``latency_mix.tails``); None without them. A mix that
    moves between cells does not move it; a share of the precision's requests many times slower (a
    pause) raises every cell's. Inside ``memo.window_memo`` once per window and ``p``."""
    return cached("within_tail_contrast", (mix,), (p, least), lambda: _within_tail_contrast(mix, p, least))


def _within_tail_contrast(mix: Any, p: float, least: int) -> tuple[float, float] | None:
    got = _tails(mix)
    if got is None or not 0.0 < p < 1.0:
        return None
    cells, width = got
    sizes = [len(v[0]) for v in cells.values()]
    rows = np.repeat(np.arange(len(sizes)), sizes)
    idx = np.array(list(chain.from_iterable(v[0] for v in cells.values())))
    cnt = np.array(list(chain.from_iterable(v[1] for v in cells.values())))
    n = np.bincount(rows, weights=cnt, minlength=len(sizes))
    keep = n >= least
    if not keep.any():
        return None
    sel = keep[rows]
    keys, mat = _count_matrix((np.cumsum(keep) - 1)[rows[sel]], idx[sel], cnt[sel], int(keep.sum()))
    c, v = _contrast_rows((keys - 0.5) * width, mat, p)
    w = n[keep] / n[keep].sum()
    return float((w * c).sum()), float((w * w * v).sum())


# --- replicas ----------------------------------------------------------------------------------


def _matrix(replicas: Mapping[str, Any]) -> tuple[list[str], np.ndarray, np.ndarray, float, np.ndarray]:
    """(ids, log bucket midpoints x, counts per replica (m x B), log gamma, bucket indices)."""
    ids = sorted(replicas)
    hists = [replicas[i].get("latency_hist") or {} for i in ids]
    acc = float(next((h["relative_accuracy"] for h in hists if "relative_accuracy" in h), 0.01))
    lg = math.log((1.0 + acc) / (1.0 - acc))
    sizes = [len(h.get("bins") or ()) for h in hists]
    pairs = np.fromiter(chain.from_iterable(chain.from_iterable(h.get("bins") or () for h in hists)),
                        dtype=np.int64, count=2 * sum(sizes)).reshape(-1, 2)
    ok = pairs[:, 1] > 0
    keys, mat = _count_matrix(np.repeat(np.arange(len(ids)), sizes)[ok], pairs[ok, 0], pairs[ok, 1], len(ids))
    idx = keys.astype(float)
    return ids, (idx - 0.5) * lg, mat, lg, idx


def counts_at_least(replica: Mapping[str, Any], least: int) -> bool:
    """Whether a replica has ``least`` requests as ``_matrix`` counts them (its sketch's positive bins)."""
    n = 0
    for _, c in (replica.get("latency_hist") or {}).get("bins", []):
        c = int(c)
        if c > 0:
            n += c
            if n >= least:
                return True
    return False


def _mean_rows(x: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of counts: mean of x and the variance of that mean."""
    n = c.sum(axis=1)
    safe = np.maximum(n, 1.0)
    m = (c * x).sum(axis=1) / safe
    var = (c * (x - m[:, None]) ** 2).sum(axis=1) / np.maximum(n - 1, 1.0)
    return m, var / safe


def _contrast_rows(x: np.ndarray, c: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row of counts: the tail contrast (mean of x above the p quantile minus the mean) and its
    influence-function variance, as ``judge.live.sketch_log_tail_contrast`` for one sketch."""
    n = c.sum(axis=1)
    safe = np.maximum(n, 1.0)
    need = (safe * (1.0 - p))[:, None]
    above = np.cumsum(c[:, ::-1], axis=1)[:, ::-1]
    w = np.clip(need - (above - c), 0.0, c)
    ws = np.maximum(w.sum(axis=1), 1e-12)
    tail = (w * x).sum(axis=1) / ws
    first = np.argmax(w > 0, axis=1)
    q = x[first]
    mean = (c * x).sum(axis=1) / safe
    frac = np.divide(w, c, out=np.zeros_like(w), where=c > 0)
    infl = frac * (x - q[:, None]) / (1.0 - p) + (q - tail)[:, None] - (x - mean[:, None])
    return tail - mean, (c * infl * infl).sum(axis=1) / (safe * safe)


def clean_side(replicas: Mapping[str, Any] | None, opts: FleetOptions) -> list[str]:
    """The replica ids of one precision's window to leave out (upward outliers; see the module)."""
    return outlier_replicas(replicas, opts)[0]


def outlier_replicas(replicas: Mapping[str, Any] | None, opts: FleetOptions) -> tuple[list[str], bool]:
    """(``clean_side``'s replicas to leave out, whether a further replica is an outlier after the
    ``max(1, m // 8)`` that may be left out): then the window is not comparable like with like."""
    if not replicas or len(replicas) < 2:
        return [], False
    if not any(i not in POOLED_IDS and counts_at_least(r, 20) for i, r in replicas.items()):
        return [], False  # nobody may be left out (thin windows): the loop below would find the same
    ids, x, mat, _, _ = _matrix(replicas)
    n = mat.sum(axis=1)
    keep = np.ones(len(ids), dtype=bool)
    dropped: list[str] = []
    limit = max(1, len(ids) // 8)
    excess = False
    eligible = np.array([i not in POOLED_IDS for i in ids]) & (n >= 20)
    own: tuple[np.ndarray, ...] | None = None
    k = len(ids)
    while keep.sum() > 1:
        total = (mat * keep[:, None]).sum(axis=0)
        rest = total[None, :] - mat
        rest_ok = rest.sum(axis=1) >= 20
        if own is None:
            # the replicas and the rests as rows of one matrix: the statistics are per row, so
            # each row's numbers are those of separate calls (test_judge_fleet checks the bits)
            both = np.concatenate((mat, rest))
            mb, vmb = _mean_rows(x, both)
            cb, vcb = _contrast_rows(x, both, opts.p)
            own = mb[:k], vmb[:k], cb[:k], vcb[:k]
            m_o, vm_o, c_o, vc_o = mb[k:], vmb[k:], cb[k:], vcb[k:]
        else:  # a replica's own statistics do not change when another is left out
            m_o, vm_o = _mean_rows(x, rest)
            c_o, vc_o = _contrast_rows(x, rest, opts.p)
        m_r, vm_r, c_r, vc_r = own
        d_loc, d_tail = m_r - m_o, c_r - c_o
        z_loc = d_loc / np.sqrt(np.maximum(vm_r + vm_o, 1e-18))
        z_tail = d_tail / np.sqrt(np.maximum(vc_r + vc_o, 1e-18))
        out_loc = (d_loc > opts.min_dev) & (z_loc > opts.z_out)
        out_tail = (d_tail > opts.min_dev) & (z_tail > opts.z_out)
        score = np.where(out_loc | out_tail, np.maximum(z_loc, z_tail), -np.inf)
        score[~(keep & eligible & rest_ok)] = -np.inf
        worst = int(np.argmax(score))
        if not math.isfinite(score[worst]):
            break
        if len(dropped) >= limit:
            excess = True  # one more outlier than may be left out
            break
        keep[worst] = False
        dropped.append(ids[worst])
    return dropped, excess


def replica_spread(replicas: Mapping[str, Any] | None, leave_out: tuple[str, ...] = ()
                   ) -> tuple[float, float, float, int] | None:
    """(tau^2, its sampling variance, sum of squared traffic shares, replicas) of one precision's named
    replicas with at least 20 requests, ``leave_out`` excepted. tau^2 is the variance of the replicas'
    mean log latencies beyond what each one's own sampling explains (method of moments; not cut at 0,
    so that averages over windows stay unbiased), ``tau^2 * sum w^2`` the variance the draw of these
    replicas adds to the precision's pooled mean. The sampling variance of tau^2 is the chi-square
    one of the replica means' own noise, ``2 mean(v)^2 / (k - 1)``. None with fewer than two such
    replicas. Inside ``memo.window_memo`` computed once per window."""
    if not isinstance(replicas, Mapping):
        return None
    return cached("replica_spread", (replicas,), (leave_out,), lambda: _replica_spread(replicas, leave_out))


def _replica_spread(replicas: Mapping[str, Any], leave_out: tuple[str, ...]) -> tuple[float, float, float, int] | None:
    reps = {k: v for k, v in replicas.items()
            if k not in POOLED_IDS and k not in leave_out and isinstance(v, Mapping) and counts_at_least(v, 20)}
    if len(reps) < 2:
        return None
    _, x, mat, _, _ = _matrix(reps)
    m, vm = _mean_rows(x, mat)
    n = mat.sum(axis=1)
    w = n / max(float(n.sum()), 1.0)
    k = len(reps)
    noise = float(np.mean(vm))
    return float(np.var(m, ddof=1)) - noise, 2.0 * noise * noise / (k - 1), float((w * w).sum()), k


def _without(hist: Mapping[str, Any], replicas: Mapping[str, Any], dropped: list[str]) -> dict[str, Any]:
    """A sketch export minus the dropped replicas' bins."""
    bins = {int(k): int(c) for k, c in hist.get("bins", [])}
    zero = int(hist.get("zero_count", 0))
    for rid in dropped:
        h = replicas[rid].get("latency_hist") or {}
        for k, c in h.get("bins", []):
            bins[int(k)] = bins.get(int(k), 0) - int(c)
        zero -= int(h.get("zero_count", 0))
    return {"relative_accuracy": hist["relative_accuracy"], "min_value": hist.get("min_value", 1e-3),
            "zero_count": max(zero, 0), "count": sum(max(c, 0) for c in bins.values()) + max(zero, 0),
            "bins": [[k, c] for k, c in sorted(bins.items()) if c > 0]}


def _cells_without(rows: Any, replicas: Mapping[str, Any], dropped: list[str]) -> list[list[float]]:
    cells = {(int(r[0]), int(r[1])): [float(r[2]), float(r[3]), float(r[4])] for r in rows or []}
    for rid in dropped:
        for r in replicas[rid].get("cells") or []:
            c = cells.get((int(r[0]), int(r[1])))
            if c is not None:
                c[0] -= float(r[2])
                c[1] -= float(r[3])
                c[2] -= float(r[4])
    return [[k[0], k[1], *v] for k, v in sorted(cells.items()) if v[0] > 0.5]


def fleet_inputs(detail: Mapping[str, Any], opts: FleetOptions) -> tuple[Mapping[str, Any] | None, Any, list[str]]:
    """One precision's window, cleaned: (latency sketch, mix cell rows, replicas left out). Inside
    ``memo.window_memo`` computed once per window for all rules with the same replica options."""
    return fleet_side(detail, opts)[:3]


def fleet_side(detail: Mapping[str, Any], opts: FleetOptions, joined: tuple[str, ...] = ()
               ) -> tuple[Mapping[str, Any] | None, Any, list[str], bool]:
    """``fleet_inputs`` and whether more replicas stood out than may be left out (``outlier_replicas``).
    ``joined``: replicas new in this window (cold: watchdog/policy/changes.py ``joined_replicas``), left
    out first; the outliers are then sought among the rest."""
    hist = detail.get("latency_hist")
    rows = (detail.get("latency_mix") or {}).get("cells")
    reps = detail.get("replicas")
    if opts.replicas != "robust" or not isinstance(reps, Mapping):
        return hist if isinstance(hist, Mapping) else None, rows, [], False
    h2, r2, dropped, excess = cached("fleet_inputs", (hist, rows, reps), (opts.p, opts.z_out, opts.min_dev, joined),
                                     lambda: _cleaned(hist, rows, reps, opts, joined))
    return h2, r2, list(dropped), excess


def _cleaned(hist: Any, rows: Any, reps: Mapping[str, Any], opts: FleetOptions, joined: tuple[str, ...] = ()
             ) -> tuple[Mapping[str, Any] | None, Any, list[str], bool]:
    new = [r for r in joined if r in reps]
    rest = {k: v for k, v in reps.items() if k not in new} if new else reps
    dropped, excess = outlier_replicas(rest, opts)
    dropped = new + dropped
    if not dropped:
        return hist if isinstance(hist, Mapping) else None, rows, [], excess
    hist2 = _without(hist, reps, dropped) if isinstance(hist, Mapping) else None
    rows2 = _cells_without(rows, reps, dropped) if rows is not None else None
    return hist2, rows2, dropped, excess
