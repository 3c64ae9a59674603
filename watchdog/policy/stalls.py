"""A precision that stalls as a whole for a window (docs/JUDGE.md "A stall with no other replica").

``replicas: robust`` leaves out a replica that stalls against the precision's other replicas
(judge/fleet.py ``outlier_replicas``). A precision served by one replica, or all of whose replicas
pause together, has nothing to leave it out against: a garbage-collector pause that makes 5-15 % of
its requests five times slower moves its mean log latency by 0.08-0.24 in that window. On a fleet of
one replica per precision (bench/outside_check2.py ``gc-1v1``) that rolled back 71 times in 42,000
healthy windows, on the latency rules' cold start as much as on a learned level.

Such a window has a signature that a speed regression does not: the precision's latency *shape*
jumps against its own recent windows. The shape is the within-cell tail contrast (the mean log
latency of the slowest 5 % of each request-mix cell minus the cell's mean, averaged over the cells;
``fleet.within_tail_contrast``), or the whole window's tail contrast when the window has no per-cell
tails. A precision is stalled in a window when its shape exceeds its reference by more than
``STALL_DEV`` and by more than ``STALL_Z`` standard errors. A uniform slowdown (FP8 10 % slower) moves
every request and leaves the shape alone. A tail regression of +10 % at p99 moves it by less than 0.1.

A stalled window is not judged and not fed to the horizon tests, as a deploy's settling window is
not. If the shape stays up for ``STALL_RUN`` windows in a row, or a precision stalls in more windows
than pauses do (``OFTEN_MAX``), it is the precision's serving, not a pause: the pool is judged with
those windows in it. The reference is each precision's running mean
over its last ``REF_WINDOWS`` windows that were not stalled; before a precision has one, the other
precision's shape in the same window; a window far below the reference (the reference learned a
pause in its first window) starts it again. It is kept in the rule's
``RuleState.horizon["stall"]`` as ``reference, windows, run, how often`` for FP8, then for FP16.
A precision with a replica left out in the window (its stall already handled; the per-cell tails
are not kept per replica) is not read in that window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from watchdog.core.signals import Signal
from watchdog.policy.judge.fleet import FleetOptions, fleet_side, within_tail_contrast
from watchdog.policy.judge.live import sketch_log_tail_contrast
from watchdog.policy.schema import Rule

__all__ = ["STALL_RUN", "held_by_stall", "stalled"]

#: tail contrast (log units) above the precision's reference that a pause gives and a regression of
#: the typical latency or of p99 by 10 % does not (a pause of 5 % of the requests x5 gives ~1)
STALL_DEV = 0.2
STALL_Z = 5.0
#: stalled windows in a row after which the shape is the precision's serving and is judged: pauses on FP8 in
#: 4.5 % of the windows (bench/outside_check2.py gc-1v1) come 3 in a row about once in 10,000 windows
STALL_RUN = 4
REF_WINDOWS = 8
#: a precision's stalled windows, counted with weights that halve over ~33 windows (a count over about
#: the last 48): beyond OFTEN_MAX its stalls come too often to be pauses (FP8's own: frequent GC, a
#: kernel that hangs on some requests) and are judged. Stalls at random in 4.5 % of windows count 2.2 on
#: average and never passed 8 in 200,000 simulated windows; in 10 %, 2 % of windows pass it; in 25 %,
#: every window from the ~30th on
OFTEN_MAX = 8.0
_OFTEN_DECAY = 1.0 - 1.0 / 48
#: numbers kept per precision: reference, its windows, run of stalled windows, how often
_PER_SIDE = 4
#: the shape's tail quantile
SHAPE_P = 0.95
#: requests a precision needs in the window for its shape to be read (a pause shows at STALL_Z only with
#: a few hundred; thin routes are judged over the horizon, where one window weighs little)
MIN_REQUESTS = 100


def _shape(sig: Signal, opts: FleetOptions, joined: tuple[str, ...]) -> tuple[float, float] | None:
    if sig.samples < MIN_REQUESTS:
        return None
    hist, _, dropped, excess = fleet_side(sig.detail, opts, joined)
    if dropped or excess:
        return None
    got = within_tail_contrast(sig.detail.get("latency_mix"), SHAPE_P)
    if got is None and isinstance(hist, Mapping) and "relative_accuracy" in hist:
        got = sketch_log_tail_contrast(hist, SHAPE_P)
    if got is None or not all(math.isfinite(x) for x in got):
        return None
    return got


def stalled(rule: Rule, cand: Signal, base: Signal, joined: tuple[tuple[str, ...], tuple[str, ...]],
            horizon: dict[str, Any] | None) -> tuple[int, str]:
    """Read this window's shapes into ``horizon["stall"]`` and say whether a precision stalled:
    (its run of stalled windows with this one - ``STALL_RUN`` when they come too often to be pauses -,
    0 when none stalled; the reason in words)."""
    j = rule.judge
    if horizon is None or j is None or j.replicas != "robust":
        return 0, ""
    opts = FleetOptions(j.adjust, j.replicas)
    st = [float(x) for x in horizon.get("stall") or ()]
    if len(st) != 2 * _PER_SIDE:
        st = [0.0] * (2 * _PER_SIDE)
    shapes = (_shape(cand, opts, joined[0]), _shape(base, opts, joined[1]))
    if shapes == (None, None) and "stall" not in horizon:
        return 0, ""  # a thin route keeps no state for it
    run, why = 0, []
    for i, name in enumerate(("FP8", "FP16")):
        k = _PER_SIDE * i
        got, other = shapes[i], shapes[1 - i]
        mean, n, r, often = st[k: k + _PER_SIDE]
        if got is None:
            st[k + 2] = 0.0
            continue
        if n > 0:
            ref, ref_v, against = mean, got[1] / n, f"its last {int(n)} window(s)"
        elif other is not None:  # no window of its own yet: the other precision in this window
            ref, ref_v, against = other[0], other[1], f"{'FP16' if i == 0 else 'FP8'}'s in this window"
        else:
            ref, ref_v, against = math.nan, 0.0, ""
        dev = got[0] - ref
        line = STALL_Z * math.sqrt(got[1] + ref_v)
        up = dev > STALL_DEV and dev > line
        st[k + 3] = often = often * _OFTEN_DECAY + up
        if up:
            st[k + 2] = r = r + 1
            run = max(run, STALL_RUN if often > OFTEN_MAX else int(r))
            why.append(f"{name}'s latency tail rose {dev:+.2f} (log) against {against}")
            if r < STALL_RUN:
                continue  # the reference does not learn a pause
        else:
            st[k + 2] = 0.0
            if n > 0 and -dev > STALL_DEV and -dev > line:
                n = 0.0  # the reference's first windows were a pause: start it again from this one
        n = min(n + 1.0, float(REF_WINDOWS))
        st[k] = got[0] if n == 1 else mean + (got[0] - mean) / n
        st[k + 1] = n
    horizon["stall"] = tuple(st)  # numbers only: a tuple the cyclic collector need not walk
    return run, "; ".join(why)


def held_by_stall(entry: dict[str, Any]) -> bool:
    """Whether a pool entry is a stalled window not yet judged (``stalled``'s run below ``STALL_RUN``)."""
    return 0 < int(entry.get("stall", 0)) < STALL_RUN
