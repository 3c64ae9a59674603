"""Pooled judged rules: the last k live windows (``judge: {pool: k}``) or the last golden replays
(``judge: {replays: 2}``) of one rule on one route, judged together. Pure.

A rule's pool is a plain list of JSON-able entries, oldest first, kept in the engine state
(``RuleState.pool``) so that a restarted daemon continues it. It is bounded: at most ``pool``
entries of live windows, each one the window's latency sketch bins or its (errors, requests)
counts, and at most ``replays`` golden replays, each one the per-item differences. The engine
empties it after every flip: windows from before a precision change say nothing about after it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import compress
from operator import itemgetter, methodcaller
from typing import Any

from watchdog.core.signals import Signal
from watchdog.policy.changes import change_entry, held, joined_replicas, replica_names
from watchdog.policy.judge.fleet import (
    POOLED_IDS,
    FleetOptions,
    fleet_side,
    mix_log_diff,
    mix_shift,
    mix_tail_contrast,
    replica_spread,
)
from watchdog.policy.judge.live import baseline_moved, judge_learned, quantile_log_sides, rate_diff_estimate
from watchdog.policy.judge.memo import cached
from watchdog.policy.judge.paired import judge_paired_replays
from watchdog.policy.judge.pooled import judge_rate_pooled, judge_unpaired_pooled
from watchdog.policy.judge.stats import binom_sf, z_quantile
from watchdog.policy.judge.verdict import Judgement
from watchdog.policy.schema import RATE_COUNTS, REPLICA_RATES, Rule
from watchdog.policy.stalls import held_by_stall, stalled

#: a rule's pooled history, oldest first (JSON-able)
Pool = list[dict[str, Any]]

#: the part of a QuantileSketch.to_dict() export that pooling needs
_SKETCH_KEYS = ("relative_accuracy", "min_value", "zero_count", "bins")


def rate_counts(rule: Rule, sig: Signal) -> tuple[int, int] | None:
    """(numerator, denominator) of a rate metric from a live window's detail, or None; with
    ``replica_failures: leave_out``, without the replicas that failed on their own (``failing_replicas``)."""
    keys, total = RATE_COUNTS[rule.metric]
    d = sig.detail
    if total not in d or any(k not in d for k in keys):
        return None
    x, n = int(sum(int(d[k]) for k in keys)), int(d[total])
    _, dx, dn = _left_out(rule, sig)
    return x - dx, n - dn


def rate_value(rule: Rule, sig: Signal) -> float | None:
    """A rate metric's value as ``rate_counts`` counts it: the window's own value unless a replica is left
    out (None: the metric not measured, or no request left)."""
    if not _left_out(rule, sig)[0]:
        return sig.values.get(rule.metric)
    counts = rate_counts(rule, sig)
    return None if counts is None or counts[1] <= 0 else counts[0] / counts[1]


def _left_out(rule: Rule, sig: Signal) -> tuple[list[str], int, int]:
    """``failing_replicas`` of the window for a rule with ``replica_failures: leave_out`` (computed once per
    window and metric, shared by the rules and calls that read it; named in the window's detail)."""
    d = sig.detail
    fails = d.get("replica_fails")
    if rule.replica_failures != "leave_out" or rule.metric not in REPLICA_RATES or not isinstance(fails, Mapping):
        return [], 0, 0
    out = cached("failing_replicas", (sig,), (rule.metric,), lambda: failing_replicas(fails, rule.metric))
    if out[0]:
        d.setdefault("replica_failures_left_out", {})[rule.name] = out[0]
    return out


#: a replica failed on its own when, at the failure share of the rest of its precision, a share as high as
#: its own has a binomial tail below this: a crash or an out-of-memory restart (most or all of a replica's
#: requests failing for minutes) is far beyond it; a regression of the precision raises every replica's share
FAILING_P = 1e-6
#: a precision's replicas (with requests) needed to leave one out: with two, either could be the odd one
FAILING_MIN_REPLICAS = 3


def failing_replicas(fails: Mapping[str, Any], metric: str) -> tuple[list[str], int, int]:
    """(names, failures, requests) of the replicas of one precision's window that failed on their own:
    each tested against the failure share of the others (``FAILING_P``), at most a quarter of the named
    replicas (at least one); none when more are (a failure that broad is the precision's) or when fewer
    than ``FAILING_MIN_REPLICAS`` named replicas served. ``fails``: the window's ``replica_fails``,
    replica -> [ok, errors, timeouts]."""
    pos = REPLICA_RATES[metric]
    rows: dict[str, tuple[int, int]] = {}
    for k, v in fails.items():
        try:
            ok, err, to = int(v[0]), int(v[1]), int(v[2])
        except (TypeError, ValueError, IndexError, KeyError, OverflowError):
            return [], 0, 0  # not a window's own counts (a hand-written recording): counted whole
        row = (ok, err, to)
        rows[str(k)] = (sum(row[i] for i in pos), ok + err + to)
    named = [k for k, (_, n) in rows.items() if n > 0 and k not in POOLED_IDS]
    if len(named) < FAILING_MIN_REPLICAS:
        return [], 0, 0
    total_x = sum(x for x, _ in rows.values())
    total_n = sum(n for _, n in rows.values())
    out = []
    for k in named:
        x, n = rows[k]
        rest_x, rest_n = total_x - x, total_n - n
        share = (rest_x + 0.5) / (rest_n + 1.0)  # never 0: a replica failing where the rest never did
        if x > share * n and binom_sf(x, n, share) < FAILING_P:
            out.append(k)
    if not out or len(out) > max(1, len(named) // 4):
        return [], 0, 0
    return sorted(out), sum(rows[k][0] for k in out), sum(rows[k][1] for k in out)


def _sketch(h: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: h[k] for k in _SKETCH_KEYS if k in h}
    out["bins"] = [[int(i), int(c)] for i, c in h.get("bins", [])]
    return out


def _push_window(pool: Pool, entry: dict[str, Any], k: int) -> None:
    """Append a live window and keep the windows of the last ``k`` window lengths: a gap (no
    traffic, a restart) shrinks the pool instead of pooling old windows with new ones."""
    length = max(entry["end"] - entry["start"], 0.0)
    oldest = entry["end"] - (k - 0.5) * length
    pool[:] = [e for e in pool if float(e.get("end", -math.inf)) > oldest and e["end"] < entry["end"]][-(k - 1):] \
        if k > 1 else []
    pool.append(entry)


def _push_replay(pool: Pool, entry: dict[str, Any], k: int) -> None:
    """Append a golden replay; replays of another golden set (or none named) start afresh."""
    pool[:] = [e for e in pool if e.get("set") == entry["set"] and e["end"] < entry["end"]][-(k - 1):] \
        if k > 1 else []
    pool.append(entry)


def _plain_diffs(items: list[float]) -> list[float | None]:
    return [x if math.isfinite(x) else None for x in items]


def _diffs(entry: Mapping[str, Any]) -> list[float]:
    return [math.nan if x is None else float(x) for x in entry.get("diffs", [])]


def line_up(prev_ids: Any, prev: list[float], ids: Any) -> tuple[list[float], list[str] | None, bool]:
    """The previous golden replay against the latest one, by item id: (its values, their ids, rotated).

    Two replays of the same items in another order, or of a set edited between them (a few items
    replaced), are the same items: the previous values come back in the latest replay's order
    (NaN for an item it did not ask), so an item is one item of the pooled look, never two.
    ``rotated`` (the replays asked mostly different items: fewer than half of the latest's in
    common, a set sampled from a larger pool) gives instead the previous replay's items the latest
    did not ask, to be judged beside the latest's as independent items. Without ids on both, or
    with an id twice in one replay, the replays are matched by position as before."""
    if not isinstance(prev_ids, list) or not isinstance(ids, list):
        return prev, None, False
    if len(set(prev_ids)) != len(prev_ids) or len(set(ids)) != len(ids):
        return prev, list(prev_ids), prev_ids != ids
    if prev_ids == ids:
        return prev, list(prev_ids), False
    at = {i: k for k, i in enumerate(prev_ids)}
    common = sum(1 for i in ids if i in at)
    if 2 * common < len(ids):
        latest = set(ids)
        keep = [k for k, i in enumerate(prev_ids) if i not in latest]
        return [prev[k] for k in keep], [prev_ids[k] for k in keep], True
    return [prev[at[i]] if i in at else math.nan for i in ids], list(ids), False


def item_keys(ids: Any, versions: Any) -> list[str] | None:
    """What the judge learns and pairs an item by: ``id@version`` where the replay gave each item's
    version (``GoldenSet.version``: a hash of what it asked), else the id. An item edited under the
    same id is another item: the healthy level learned on the old question is not the new one's."""
    if not isinstance(ids, list):
        return None
    if isinstance(versions, list) and len(versions) == len(ids) and all(versions):
        return [f"{i}@{v}" for i, v in zip(ids, versions, strict=True)]
    return [str(i) for i in ids]


def entry_keys(entry: Mapping[str, Any]) -> list[str] | None:
    """The item keys of a pool entry (``item_keys`` of its ``ids`` and ``v``)."""
    return item_keys(entry.get("ids"), entry.get("v"))


def line_up_entries(prev: Mapping[str, Any], values: list[float], latest: Mapping[str, Any]
                    ) -> tuple[list[float], list[str] | None, list[str] | None, bool]:
    """``line_up`` of two pool entries by item key: (the previous replay's values, their ids, their
    keys, rotated). An item the latest replay asked under the same id but edited (another version)
    is neither paired with its old answers nor counted beside them as an independent item: it was
    asked once, in the latest replay."""
    prev_keys, keys = entry_keys(prev), entry_keys(latest)
    if prev_keys is None or keys is None or "v" not in prev or "v" not in latest:
        # a replay without versions (a report from before them): paired by id as before
        out, ids, rotated = line_up(prev.get("ids"), values, latest.get("ids"))
        return out, ids, ids, rotated
    out, kept, rotated = line_up(prev_keys, values, keys)
    if kept is None:
        return out, None, None, rotated
    shown = {**dict(zip(prev_keys, map(str, prev["ids"]), strict=True)),
             **dict(zip(keys, map(str, latest["ids"]), strict=True))}
    ids = [shown.get(k, k) for k in kept]
    if rotated:
        asked = {str(i) for i in latest["ids"]}
        keep = [n for n, i in enumerate(ids) if i not in asked]
        out, ids, kept = [out[n] for n in keep], [ids[n] for n in keep], [kept[n] for n in keep]
    return out, ids, kept, rotated


def learned(rule: Rule) -> bool:
    """Whether a live judged rule works on per-window differences (a quantile test, or a learned
    null): its pool then holds one (e, v) pair per window instead of sketches or counts."""
    j = rule.judge
    return j is not None and j.test != "paired" and (j.test == "quantile" or j.learn is not None)


#: no replica joined on either side
NONE_JOINED: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


#: a window's (FP8 - FP16 difference, its variance, FP16's own statistic or None), harm units
Estimate = tuple[float, float, float | None]


def window_difference(rule: Rule, cand: Signal, base: Signal,
                      joined: tuple[tuple[str, ...], tuple[str, ...]] = NONE_JOINED) -> tuple[float, float] | str:
    """One live window's FP8 - FP16 difference in harm units and its sampling variance: log
    ratio of the judged latency quantile (p50 for mann_whitney), or the rate difference. ``joined``:
    per precision the replicas new in this window (``replicas: robust`` leaves them out)."""
    out = window_estimate(rule, cand, base, joined)
    return out if isinstance(out, str) else (out[0], out[1])


def window_estimate(rule: Rule, cand: Signal, base: Signal,
                    joined: tuple[tuple[str, ...], tuple[str, ...]] = NONE_JOINED) -> Estimate | str:
    """``window_difference`` and FP16's own statistic in the same harm units (the difference is
    FP8's minus it; None for a rate or a tail contrast): what ``judge_learned`` needs to tell
    which precision moved (``baseline_moved``). Inside ``memo.window_memo`` computed once per rule
    and window (the judge's and the horizon's)."""
    return cached("window_difference", (rule, cand, base), (joined,),
                  lambda: _window_difference(rule, cand, base, joined))


def _window_difference(rule: Rule, cand: Signal, base: Signal,
                       joined: tuple[tuple[str, ...], tuple[str, ...]]) -> Estimate | str:
    j = rule.judge
    assert j is not None
    sign = 1.0 if j.harm_direction == "lower_is_better" else -1.0
    if j.test == "quantile" and (j.adjust is not None or j.replicas is not None or j.max_mix_shift is not None):
        return _fleet_difference(rule, cand, base, sign, joined)
    own: float | None = None
    if j.test in ("quantile", "mann_whitney"):
        hists = [s.detail.get("latency_hist") for s in (cand, base)]
        if not all(isinstance(h, Mapping) and "relative_accuracy" in h for h in hists):
            return "no latency_hist in the window's detail"
        try:
            sides = quantile_log_sides(hists[0], hists[1], j.q if j.test == "quantile" else 0.5,  # type: ignore[arg-type]
                                       j.tail if j.test == "quantile" else None,
                                       j.relative_to if j.test == "quantile" else None)
        except (KeyError, TypeError, ValueError) as exc:
            return f"unreadable latency_hist: {exc}"
        out = None if sides is None else (sides[0][0] - sides[1][0], sides[0][1] + sides[1][1])
        if sides is not None and _splits(rule):
            own = sides[1][0]
    else:
        counts = [rate_counts(rule, s) for s in (cand, base)]
        if counts[0] is None or counts[1] is None:
            return f"no {rule.metric} counts in the window's detail"
        out = rate_diff_estimate(counts[0][0], counts[0][1], counts[1][0], counts[1][1])
    if out is None or not all(math.isfinite(x) for x in out):
        return "no latencies in the window"
    return sign * out[0], out[1], _signed(sign, own)


def _splits(rule: Rule) -> bool:
    """Whether the rule's statistic is FP8's level minus FP16's (a latency quantile or tail mean),
    so that each precision's own move can be told apart; a tail contrast (a shape) and a rate are not
    split (an FP16 error rate that fell leaves FP8's worse than the baseline now, whoever moved)."""
    j = rule.judge
    return j is not None and j.test == "quantile" and j.relative_to != "mean"


def _signed(sign: float, own: float | None) -> float | None:
    return None if own is None or not math.isfinite(own) else sign * own


#: a precisions' request-mix difference counts only beyond this many of its own sampling sds (and
#: beyond ``max_mix_shift``): one mix drawn twice differs by chance, and that chance is already in the
#: judged statistic's sampling variance; a router that sends one precision other requests is not
MIX_Z = 3.0


def mix_line(tolerance: float, var: float) -> float:
    """How far a mix shift of sampling variance ``var`` may go before the mixes differ."""
    return max(tolerance, MIX_Z * math.sqrt(max(var, 0.0)))


def _mix_moved(rule: Rule, cand: Signal, base: Signal,
               joined: tuple[tuple[str, ...], tuple[str, ...]]) -> tuple[float, float] | None:
    """(mix shift, its variance) of a window for a rule with ``max_mix_shift`` (after the outlier
    and joined replicas are left out, as judged), or None."""
    j = rule.judge
    if j is None or j.max_mix_shift is None:
        return None
    opts = FleetOptions(j.adjust, j.replicas)
    rc, rb = fleet_side(cand.detail, opts, joined[0])[1], fleet_side(base.detail, opts, joined[1])[1]
    return mix_shift(rc, rb) if rc and rb else None


def _fleet_difference(rule: Rule, cand: Signal, base: Signal, sign: float,
                      joined: tuple[tuple[str, ...], tuple[str, ...]]) -> Estimate | str:
    """``window_difference`` with ``adjust: mix`` and/or ``replicas: robust`` (judge/fleet.py): each
    precision's window without its joined (cold) and outlier replicas, then the within-cell (mix) or
    the plain statistic."""
    j = rule.judge
    assert j is not None
    opts = FleetOptions(j.adjust, j.replicas)
    for side, sig, new in (("candidate", cand, joined[0]), ("baseline", base, joined[1])):
        if new and 2 * len(new) > len(replica_names(sig)):
            # most of the side serves its first window (a scale-out, a restart under new names): what
            # is left is too little of its serving to stand for it, and the new replicas are cold
            return (f"most {side} replicas joined in this window ({len(new)} of {len(replica_names(sig))}): "
                    "not comparable like with like in this window")
    (hc, rc, dc, xc), (hb, rb, db, xb) = fleet_side(cand.detail, opts, joined[0]), fleet_side(base.detail, opts,
                                                                                              joined[1])
    if xc or xb:
        # a share of one precision's replicas stall together (more than the 1 in 8 that may be left
        # out): what is left is not that precision's typical serving, judging it would blame FP8 (or
        # FP16) for a pause, and learning it would shift the level
        return (f"more {'candidate' if xc else 'baseline'} replicas stand out than may be left out "
                f"(left out: {len(dc if xc else db)}): not comparable like with like in this window")
    out: tuple[float, float] | None = None
    own: float | None = None
    if j.max_mix_shift is not None and rc and rb:
        moved = mix_shift(rc, rb)
        if moved is not None and abs(moved[0]) > mix_line(j.max_mix_shift, moved[1]):
            return (f"the precisions' request mixes differ (they move the mean log latency difference by "
                    f"{moved[0]:+.3f}, beyond {mix_line(j.max_mix_shift, moved[1]):.3f}): not comparable like "
                    "with like in this window")
    if j.adjust == "mix" and j.tail and j.relative_to == "mean":
        # the tail contrast net of the request mix (standardised on common cell weights); a window
        # without per-cell tails, or with a replica left out (the tails are not kept per replica), is
        # judged on the plain contrast below - never on the mean (mix_log_diff), another statistic
        tails = None if dc or db else mix_tail_contrast(cand.detail.get("latency_mix"),
                                                         base.detail.get("latency_mix"), j.tail)
        if tails is not None:
            out = tails[0], tails[1]
    elif j.adjust == "mix" and rc and rb:
        mixed = mix_log_diff(rc, rb)
        if mixed is not None:
            out, own = (mixed[0], mixed[1]), mixed[2].get("base")
    if out is None:
        if not (isinstance(hc, Mapping) and "relative_accuracy" in hc and isinstance(hb, Mapping)
                and "relative_accuracy" in hb):
            return "no latency_hist in the window's detail"
        try:
            sides = quantile_log_sides(hc, hb, j.q, j.tail, j.relative_to)
        except (KeyError, TypeError, ValueError) as exc:
            return f"unreadable latency_hist: {exc}"
        if sides is not None:
            out, own = (sides[0][0] - sides[1][0], sides[0][1] + sides[1][1]), sides[1][0]
    if out is None or not all(math.isfinite(x) for x in out):
        return "no latencies in the window"
    if dc or db:
        cand.detail.setdefault("replicas_left_out", {})[rule.name] = [dc, db]
    return sign * out[0], out[1], _signed(sign, own if _splits(rule) else None)


#: the draw of replicas counts beyond this many sds of its own estimate's sampling noise: with a few
#: hundred requests per replica the replicas' means scatter by sampling alone about as much as 1-2 %
#: offsets do, and a spread read into that noise would only widen the tolerance by chance
DRAW_Z = 2.0


def replica_draw(rule: Rule, cand: Signal, base: Signal,
                 joined: tuple[tuple[str, ...], tuple[str, ...]] = NONE_JOINED) -> tuple[float, float] | None:
    """(variance, its sampling variance) by which the draw of replicas alone moves FP8's pooled latency
    level against FP16's: ``tau^2 * sum over the precisions of sum w^2``, ``tau^2`` the replicas'
    ``replica_spread`` after the joined and outlier ones are left out, pooled over both precisions
    (one fleet's hardware; 3 FP16 replicas alone give a spread on 2 degrees of freedom). A precision
    with one replica counts ``sum w^2 = 1``; None with fewer than two replicas on both, or for a rule
    that is not a latency level with ``replicas: robust`` (a tail contrast is relative to each
    precision's own mean: replica offsets cancel)."""
    j = rule.judge
    if j is None or j.replicas != "robust" or not _splits(rule):
        return None
    opts = FleetOptions(j.adjust, j.replicas)
    sides = []
    for sig, new in ((cand, joined[0]), (base, joined[1])):
        reps = sig.detail.get("replicas")
        if not isinstance(reps, Mapping):
            return None
        dropped = tuple(fleet_side(sig.detail, opts, new)[2])
        sides.append(replica_spread(reps, dropped))
    known = [x for x in sides if x is not None]
    if not known:
        return None
    df = [x[3] - 1 for x in known]
    tau2 = sum(x[0] * d for x, d in zip(known, df, strict=True)) / sum(df)
    tau2_v = sum(x[1] * d * d for x, d in zip(known, df, strict=True)) / sum(df) ** 2
    w2 = sum(x[2] if x is not None else 1.0 for x in sides)
    return tau2 * w2, tau2_v * w2 * w2


def draw_sd(var: float, var_v: float) -> float:
    """The replicas' draw sd that counts: the estimate less ``DRAW_Z`` of its sampling sds, at least 0."""
    return math.sqrt(max(var - DRAW_Z * math.sqrt(max(var_v, 0.0)), 0.0))


def replica_allowance(rule: Rule, sd: float) -> float:
    """How far FP8's level may sit from FP16's by the draw of replicas alone (sd ``sd``), at the rule's
    horizon alpha, one-sided (the rule's alpha without a horizon)."""
    j = rule.judge
    if j is None or sd <= 0:
        return 0.0
    alpha = j.horizon.alpha if j.horizon is not None else j.alpha
    return z_quantile(1.0 - alpha) * sd


def _judge_learned(rule: Rule, cand: Signal, base: Signal, pool: Pool,
                   null: list[dict[str, Any]] | None, level_cap: float | None = None,
                   level_reset: tuple[float, float] | None = None, avg_draw: float = 0.0,
                   horizon: dict[str, Any] | None = None) -> Judgement | str:
    j = rule.judge
    assert j is not None
    joined = joined_of(rule, pool, cand, base)
    diff = window_estimate(rule, cand, base, joined)
    if isinstance(diff, str):
        return diff
    # tuples of numbers and names in pool entries (lists once restored from a checkpoint): untracked by
    # the cyclic collector, where each list is a container it walks (an entry per window, rule and route)
    entry: dict[str, Any] = {"start": cand.start, "end": cand.end, "samples": (cand.samples, base.samples),
                             "e": diff[0], "v": diff[1]}
    if diff[2] is not None:
        entry["base"] = diff[2]
    moved = _mix_moved(rule, cand, base, joined)
    if moved is not None:
        entry["mix"], entry["mix_v"] = moved
    if j.replicas == "robust":
        # the replica names of the newest entry only (the next window's joined_replicas reads them)
        if pool:
            pool[-1].pop("r", None)
        entry["r"] = (tuple(replica_names(cand)), tuple(replica_names(base)))
    run, stall_why = stalled(rule, cand, base, joined, horizon)
    if run:
        entry["stall"] = run
    if j.settle is not None:
        # deploys and maintenance (watchdog/policy/changes.py): judge only after both sides settled,
        # latency only once both run the same build (or the hold ran out)
        entry.update(change_entry(pool, cand, base, j.settle, j.hold))
        if entry["since"] == 0:
            pool.clear()
        _push_window(pool, entry, j.pool or 1)
        why = held(entry, j.settle, j.hold)
        if why:
            return why
        pool[:] = [e for e in pool if int(e.get("since", 1)) > 0]
    else:
        _push_window(pool, entry, j.pool or 1)
    if held_by_stall(entry):
        # a precision paused as a whole in this window (watchdog/policy/stalls.py): not FP8's serving
        # unless it lasts STALL_RUN windows, when the pool is judged with the stalled windows in it
        return f"{stall_why}: a stall, not comparable like with like in this window"
    if not run and any(held_by_stall(e) for e in pool):
        pool[:] = [e for e in pool if not held_by_stall(e)]  # the pauses before it; judged stalls stay
    n_cand = min(int(e["samples"][0]) for e in pool)
    n_base = min(int(e["samples"][1]) for e in pool)
    if min(n_cand, n_base) < max(rule.min_samples, j.min_n):
        return (f"too few samples in a window of the pool: {n_cand}/{n_base} "
                f"< {max(rule.min_samples, j.min_n)}")
    shifted = _pool_mix_shift(pool, j.max_mix_shift)
    if shifted:
        return shifted
    first = float(pool[0]["start"])
    # the history before the pool, and its stated sampling variances (states saved before they
    # were kept have none)
    hist, hist_v = _null_before(null or [], first) if j.learn is not None else ([], [])
    unit = " (log ratio)" if j.test != "rate" else " pts"
    gap = _gap(null or [], first, cand.end - cand.start) if hist else 0
    cap = j.level_cap if level_cap is None else level_cap
    got = replica_draw(rule, cand, base, joined)
    draw = max(draw_sd(*got) if got is not None else 0.0, avg_draw)  # this window's, or the route's average
    allow = replica_allowance(rule, draw)
    if cap is not None and allow > cap:
        # the two pools' replicas alone may put FP8's level this far from FP16's: a level within it
        # is credited (the draw of replicas is not FP8's), a shift against it is judged as ever
        cap = allow
    warm_sd = j.level_sd
    if draw > (j.prior_sd if warm_sd is None else warm_sd):
        warm_sd = draw  # before the level is learned, its prior spread is at least the replicas' draw
    out = judge_learned([(float(e["e"]), float(e["v"])) for e in pool], hist, effect_threshold=j.effect,
                        level_cap=cap, level_reset=level_reset,
                        alpha=j.alpha, prior_sd=j.prior_sd, learn_min=j.learn_min, recent=j.recent,
                        metric=rule.metric, unit=unit, null_v=hist_v, null_model=j.null_model, level_sd=warm_sd,
                        gap=gap)
    out.detail["pool_size"] = len(pool)
    if allow > 0:
        out.detail["replica_allowance"] = allow
    if diff[2] is not None:
        out.detail["window_baseline"] = diff[2]  # learned with the window (engine._learn)
    if out.status == "fail" and out.detail.get("learned"):
        _unless_baseline_moved(rule, out, pool, hist, null or [], first, gap)
    return out


def _unless_baseline_moved(rule: Rule, out: Judgement, pool: Pool, hist: list[float], null: list[dict[str, Any]],
                           first: float, gap: int) -> None:
    """A failed shift that is mostly FP16's own move (``judge_learned``'s ``baseline_moved``) is
    judged on FP8's own move instead: a pass (reason ``baseline_moved``; the window is learned, so
    the level follows FP16's new speed) unless FP8 itself moved beyond the effect."""
    j = rule.judge
    assert j is not None
    # FP16's own statistic of the same windows as ``hist`` (``_null_before``), NaN where not kept
    base = [float(x.get("base", math.nan)) for x in null if float(x.get("end", math.inf)) <= first]
    recent = max(1, min(j.recent, len(hist) // 2))
    # a level capped below the recent one (FP8 crept past its anchor, or beyond level_cap): FP8's own move
    # is judged against the cap too. A level raised to the anchor (the recent one followed FP16's creep
    # down) is not: FP8's own move since the recent windows is what says whether FP8 changed
    offset = max(0.0, sum(hist[-recent:]) / recent - float(out.detail["level"])) if hist else 0.0
    moved = baseline_moved([(float(e["e"]), float(e["v"])) for e in pool],
                           [float(e.get("base", math.nan)) for e in pool], hist, base, recent=j.recent, alpha=j.alpha,
                           prior_sd=j.prior_sd, effect=j.effect, gap=gap, level_offset=offset)
    if moved is None:
        return
    out.detail["baseline_moved"] = moved
    split = (f"FP16's own statistic moved {moved['fp16_own']:+.4g}, FP8's {moved['fp8_own']:+.4g} against the judged "
             f"level [{moved['fp8_own_low']:+.4g}, {moved['fp8_own_high']:+.4g}]")
    if moved["fails"]:
        out.message += f"; {split}: FP8 moved too"
        return
    out.status, out.reason = "pass", "baseline_moved"
    out.message = (f"{out.metric}: pass (baseline_moved); FP8 - FP16 shifted {moved['shift']:+.4g} against the "
                   f"learned level, but {split}: FP16 changed, not FP8")


def joined_of(rule: Rule, pool: Pool, cand: Signal, base: Signal) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The replicas new in this window per precision (``changes.joined_replicas``) for a rule with
    ``replicas: robust``; none for another rule."""
    j = rule.judge
    if j is None or j.replicas != "robust":
        return NONE_JOINED
    return joined_replicas(pool, cand, base)


def _pool_mix_shift(pool: Pool, tolerance: float | None) -> str | None:
    """Why the pool's windows are not comparable like with like, if their mean mix shift is beyond
    its own sampling noise: a router bias too small to show in one window would otherwise add up
    over the pool in the judged statistic."""
    ms = [(float(e["mix"]), float(e["mix_v"])) for e in pool if "mix" in e and "mix_v" in e]
    if tolerance is None or len(ms) < 2:
        return None
    mean = sum(m for m, _ in ms) / len(ms)
    line = mix_line(tolerance, sum(v for _, v in ms) / (len(ms) * len(ms)))
    if abs(mean) <= line:
        return None
    return (f"the precisions' request mixes differ over the pool (mean shift {mean:+.3f} over {len(ms)} windows, "
            f"beyond {line:.3f}): not comparable like with like")


_END, _E, _V = itemgetter("end"), itemgetter("e"), methodcaller("get", "v", math.nan)


def _gap(null: list[dict[str, Any]], first: float, window: float) -> int:
    """Whole windows between the last learned window that ended by ``first`` and ``first`` (0 when
    the pool follows the learned windows directly, as it does between deploys)."""
    if not window > 0:
        return 0
    try:
        last = max((e for e in map(float, map(_END, null)) if e <= first), default=None)
    except (KeyError, TypeError, ValueError):
        return 0
    return 0 if last is None else max(0, int(round((first - last) / window)))


def _null_before(null: list[dict[str, Any]], first: float) -> tuple[list[float], list[float]]:
    """(e, v) of the null's windows that ended by ``first``: ``[float(x["e"]) for x in null if
    float(x.get("end", inf)) <= first]`` and the same of ``v`` (NaN where missing), with C-level
    loops (a null holds up to ``learn`` windows, read every window); entries without ``end`` or
    ``e`` (or unreadable ones) take the plain loop, which raises where it raised."""
    try:
        keep = list(map(first.__ge__, map(float, map(_END, null))))
        es = list(map(float, map(_E, null)))
    except (KeyError, TypeError, ValueError):
        past = [x for x in null if float(x.get("end", math.inf)) <= first]
        return [float(x["e"]) for x in past], [float(x.get("v", math.nan)) for x in past]
    return list(compress(es, keep)), list(map(float, map(_V, compress(null, keep))))


#: share of items whose baseline answer moved (by more than ``MOVED``) in the A/A pass from which a
#: service counts as sampling (each replay a fresh draw): the mean test then runs at
#: ``judge.sampled_alpha``. Batch-dependent kernels move a few percent of greedy answers; sampling
#: at temperature > 0 moves far more
SAMPLED_SHARE = 0.10
MOVED = 0.05


def aa_moving(cand: Signal, metric: str) -> float:
    """Share of the replay's items whose two baseline answers scored more than ``MOVED`` apart (0
    without an A/A pass)."""
    aa = cand.detail.get("aa")
    values = aa.get(metric) if isinstance(aa, Mapping) else None
    if not isinstance(values, list) or not values:
        return 0.0
    vals = [float(x) for x in values if isinstance(x, (int, float)) and not math.isnan(x)]
    return sum(abs(x) > MOVED for x in vals) / max(len(vals), 1)


#: most item ids a paired rule's learned per-item level keeps
MAX_LEARNED_ITEMS = 5000


def item_levels(null: list[dict[str, Any]] | None) -> dict[str, list[float]]:
    """The learned per-item healthy differences {item id: [mean, replays]} of a paired rule."""
    for x in null or []:
        if x.get("kind") == "items" and isinstance(x.get("m"), dict):
            return x["m"]
    return {}


def learn_items(null: list[dict[str, Any]], entry: Mapping[str, Any], learn: int) -> None:
    """Fold a passing replay (pool entry with ``ids``) into the per-item healthy levels: a mean
    over the last ~``learn`` replays of each item (exponential beyond that), keyed by ``entry_keys``.
    The items replayed least recently go first beyond ``MAX_LEARNED_ITEMS`` (edited or removed ones)."""
    ids = entry_keys(entry)
    if ids is None:
        return
    levels = item_levels(null)
    if not levels:
        null.append({"kind": "items", "m": levels})
    for i, d in zip(ids, _diffs(entry), strict=False):
        if not math.isfinite(d):
            continue
        m, c = levels.pop(i, [0.0, 0])  # re-inserted last: the dict's order is the eviction order
        c = min(int(c) + 1, learn)
        levels[i] = [m + (d - m) / c, c]
    while len(levels) > MAX_LEARNED_ITEMS:
        levels.pop(next(iter(levels)))


def _against_items(rule: Rule, pool: Pool, replays: list[list[float]], null: list[dict[str, Any]] | None
                   ) -> tuple[list[list[float]], dict[str, Any] | None]:
    """Each replay's differences minus the items' learned healthy levels (items seen in at least
    2 passing replays): a persistent FP8-sensitive item is then not evidence again and again.
    The credited healthy level is capped at the rule's effect on the harmful side, so a
    regression present from the first replays is not learned away."""
    j = rule.judge
    assert j is not None
    levels = item_levels(null)
    if not levels:
        return replays, None
    hsign = 1.0 if j.harm_direction == "lower_is_better" else -1.0
    out = []
    known_all = 0
    for e, diffs in zip(pool, replays, strict=True):
        ids = entry_keys(e)
        if ids is None:
            out.append(diffs)
            continue
        m = [levels[i][0] if i in levels and levels[i][1] >= 2 else None for i in ids]
        known = [x for x in m if x is not None]
        known_all = len(known)
        shift = 0.0
        if known:
            harm_level = hsign * sum(known) / len(known)
            cap = j.effect if j.level_cap is None else j.level_cap
            if harm_level > cap:
                shift = -hsign * (harm_level - cap)
        out.append([d - (x + shift) if x is not None else d for d, x in zip(diffs, m, strict=True)])
    return out, {"items": len(levels), "known": known_all}


def judge_pool(rule: Rule, cand: Signal | None, base: Signal | None, pool: Pool,
               paired_items: list[float] | None, null: list[dict[str, Any]] | None = None,
               level_cap: float | None = None, level_reset: tuple[float, float] | None = None,
               avg_draw: float = 0.0, horizon: dict[str, Any] | None = None) -> Judgement | str:
    """Add this window (or replay) to ``pool`` and judge the pool; a string is an inconclusive
    reason (this window is unreadable, or the pool holds too few events for ``min_samples``).
    ``level_cap`` replaces the rule's cap on a learned null's level (the long-term anchor's);
    ``level_reset``: (below, level), a learned level below ``below`` is judged as ``level`` (the anchor).
    ``avg_draw``: the route's replica-draw sd averaged over its windows (``horizon.averaged_draw_sd``).
    ``horizon``: the rule's ``RuleState.horizon``, where a latency rule keeps its precisions' shapes
    (watchdog/policy/stalls.py)."""
    j = rule.judge
    assert j is not None and cand is not None
    k = j.history
    if j.test == "paired":
        if not paired_items:
            return f"no paired values for {rule.metric}"
        golden_set = cand.detail.get("golden_set") or (base.detail.get("golden_set") if base else None)
        sig = cand if cand.detail.get("item_ids") or base is None else base
        ids, versions = sig.detail.get("item_ids"), sig.detail.get("item_versions")
        entry: dict[str, Any] = {"start": cand.start, "end": cand.end, "set": golden_set, "diffs": _plain_diffs(paired_items)}
        if isinstance(ids, list) and len(ids) == len(paired_items):
            entry["ids"] = [str(i) for i in ids]
            if isinstance(versions, list) and len(versions) == len(ids) and all(versions):
                entry["v"] = [str(v) for v in versions]
        moving = aa_moving(cand, rule.metric)
        entry["moving"] = moving
        _push_replay(pool, entry, k)
        alpha = j.mean_alpha  # the broken-items test takes the rest
        # the pool is judged as fresh draws when any of its replays' A/A pass showed sampling: one
        # replay's share is noisy near the line (200 items: +-2.3 points at 12 %)
        pool_moving = max(float(e.get("moving", 0.0)) for e in pool)
        if pool_moving >= SAMPLED_SHARE:
            alpha = min(alpha, j.sampled_alpha)
        replays = [_diffs(e) for e in pool]
        level = None
        if j.learn is not None:
            replays, level = _against_items(rule, pool, replays, null)
        rotated = False
        if len(replays) >= 2:
            replays[-2], _, _, rotated = line_up_entries(pool[-2], replays[-2], pool[-1])
        out = judge_paired_replays(replays, direction=j.harm_direction, effect_threshold=j.effect,
                                   marginal_threshold=j.marginal, alpha=alpha, min_items=j.min_n,
                                   max_ci_width=j.max_ci_width, metric=rule.metric, method=j.method,
                                   prior_jump=j.prior_jump, rotated=rotated)
        out.detail["pool_size"] = len(pool)
        out.detail["aa_moving"] = moving
        out.detail["aa_moving_pool"] = pool_moving
        if level is not None:
            out.detail["item_level"] = level
        return out
    assert base is not None
    if learned(rule):
        return _judge_learned(rule, cand, base, pool, null, level_cap, level_reset, avg_draw, horizon)
    entry = {"start": cand.start, "end": cand.end, "samples": (cand.samples, base.samples)}  # as in _judge_learned
    if j.test == "mann_whitney":
        hists = [s.detail.get("latency_hist") for s in (cand, base)]
        if not all(isinstance(h, Mapping) and "relative_accuracy" in h for h in hists):
            return "no latency_hist in the window's detail"
        entry["candidate"], entry["baseline"] = _sketch(hists[0]), _sketch(hists[1])  # type: ignore[arg-type]
    else:
        counts = [rate_counts(rule, s) for s in (cand, base)]
        if counts[0] is None or counts[1] is None:
            return f"no {rule.metric} counts in the window's detail"
        entry["candidate"], entry["baseline"] = list(counts[0]), list(counts[1])
    _push_window(pool, entry, k)
    n_cand = sum(int(e["samples"][0]) for e in pool)
    n_base = sum(int(e["samples"][1]) for e in pool)
    if min(n_cand, n_base) < rule.min_samples:
        return (f"too few samples in the pool of {len(pool)} window(s): {n_cand}/{n_base} "
                f"< min_samples {rule.min_samples}")
    common: dict[str, Any] = dict(pool_windows=k, effect_threshold=j.effect, marginal_threshold=j.marginal,
                                  alpha=j.alpha, max_ci_width=j.max_ci_width, metric=rule.metric)
    if j.test == "mann_whitney":
        out = judge_unpaired_pooled([e["candidate"] for e in pool], [e["baseline"] for e in pool],
                                    direction=j.harm_direction, min_samples=j.min_n, **common)
    else:
        out = judge_rate_pooled([tuple(e["candidate"]) for e in pool], [tuple(e["baseline"]) for e in pool],
                                min_samples=j.min_n, **common)
    out.detail["pool_size"] = len(pool)
    return out
