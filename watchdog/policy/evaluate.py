"""One rule against one window: candidate and baseline signals in, a ``Verdict`` out. Pure.

A rule with ``fail_if`` only is a plain threshold. A rule with ``judge`` runs a statistical test
of watchdog/policy/judge/paired.py (paired, mann_whitney, rate); with both, the judge decides and a judged fail
whose ``fail_if`` is false is only ``marginal``. A judged rule with ``pool: k`` (live) or
``replays: 2`` (golden) judges this window together with the previous ones kept in the rule's
``pool`` (a list of JSON-able entries the engine stores; see ``watchdog/policy/pooling.py``).
``combine_window`` Holm-adjusts the non-critical judged verdicts of one window of one policy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from watchdog.core.signals import Signal, VerdictStatus
from watchdog.policy.conditions import Condition
from watchdog.policy.horizon import apply_horizon, averaged_draw_sd, level_cap, level_reset
from watchdog.policy.judge.paired import judge_broken, judge_paired
from watchdog.policy.judge.unpaired import judge_rate, judge_unpaired
from watchdog.policy.judge.verdict import Judgement, combine
from watchdog.policy.pooling import (
    SAMPLED_SHARE,
    Pool,
    aa_moving,
    item_keys,
    item_levels,
    judge_pool,
    learned,
    line_up_entries,
    rate_counts,
    rate_value,
)
from watchdog.policy.schema import SAMPLE_COUNTS, Policy, Rule

#: ``Verdict.extra`` key of an error verdict whose baseline failed: it pages ops and never trips the rule
#: (``errors_trip_after``): a rollback to the engine that is failing helps nothing
BASELINE_FAILED = "baseline_failed"
#: ``Verdict.extra`` key of an error verdict of a golden set that could not be loaded (an edit left it
#: invalid): neither engine ran, so it never trips the rule either; readiness names it (``golden``)
SET_FAILED = "set_failed"


def trips_on_error(v: Verdict) -> bool:
    """Whether an error verdict counts toward the rule's ``errors_trip_after``: only the candidate's failures."""
    return not (v.extra.get(BASELINE_FAILED) or v.extra.get(SET_FAILED))


def source_failed(v: Verdict, role: str, sig: Signal) -> Verdict:
    """``v`` as the error verdict of a source that failed; a golden replay names the engine that failed."""
    side = sig.detail.get("failed_side") if sig.detail else None
    if side == "set":
        v.extra[SET_FAILED] = 1.0
        v.status, v.reason = "error", f"no replay: {sig.error}"
        return v
    if side in ("baseline", "both") or (side is None and role == "baseline"):
        v.extra[BASELINE_FAILED] = 1.0
        role = "candidate and baseline" if side == "both" else "baseline"
    v.status, v.reason = "error", f"{role} source failed: {sig.error}"
    return v


@dataclass(slots=True)
class Verdict:
    rule: str
    status: VerdictStatus
    reason: str
    source: str
    metric: str
    start: float = 0.0
    end: float = 0.0
    candidate: float | None = None
    baseline: float | None = None
    samples: int | None = None
    baseline_samples: int | None = None
    extra: dict[str, float] = field(default_factory=dict)
    #: ``restore_if`` evaluated on this window (None: the rule has none, or it could not be read)
    restore: bool | None = None
    #: the judge's result (watchdog.policy.judge.paired.Judgement.to_dict()) for judged rules
    judgement: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        # shallow on purpose: called for every rule of every route at each state save, where
        # dataclasses.asdict's recursive deep copy dominated (measured 0.67 s per save at 1,000 routes)
        # (and spelled out: a comprehension over the field names costs twice as much)
        judgement = self.judgement
        return {"rule": self.rule, "status": self.status, "reason": self.reason, "source": self.source,
                "metric": self.metric, "start": self.start, "end": self.end, "candidate": self.candidate,
                "baseline": self.baseline, "samples": self.samples, "baseline_samples": self.baseline_samples,
                "extra": dict(self.extra), "restore": self.restore,
                "judgement": None if judgement is None else dict(judgement)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


_VERDICT_FIELDS = tuple(Verdict.__dataclass_fields__)
# to_dict spells the fields out: it must list every one, in order
assert tuple(Verdict("", "pass", "", "", "").to_dict()) == _VERDICT_FIELDS


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _paired_stats(values: list[float]) -> dict[str, float]:
    """Mean and a normal-approximation 95% interval of per-item paired differences."""
    n = len(values)
    mean = sum(values) / n
    out = {"paired_mean": mean, "paired_n": float(n)}
    if n >= 2:
        var = sum((v - mean) ** 2 for v in values) / (n - 1)
        half = 1.96 * math.sqrt(var / n)
        out["paired_lo"], out["paired_hi"] = mean - half, mean + half
    return out


def _unavailable(sig: Signal | None) -> str | None:
    """Why a signal's source could not look at all (NVML missing on a CI machine), or None."""
    if sig is not None and sig.error and sig.detail.get("state") == "unavailable":
        return f"{sig.source} telemetry unavailable: {sig.detail.get('reason') or sig.error}"
    return None


def sample_count(rule: Rule, sig: Signal) -> int:
    """What ``min_samples`` counts for this rule: the metric's own count when the window carries
    it (shadow pairs for shadow agreement, logprob tokens for perplexity, completions for the
    empty rate; ``schema.SAMPLE_COUNTS``), else the signal's samples (events; golden: items)."""
    key = SAMPLE_COUNTS.get(rule.metric)
    if key is not None and sig.source == "live":
        raw = sig.detail.get(key)
        if isinstance(raw, int | float) and math.isfinite(raw):
            return int(raw)
    return sig.samples


def evaluate_rule(rule: Rule, candidate: Signal | None, baseline: Signal | None,
                  pool: Pool | None = None, null: list[dict[str, Any]] | None = None,
                  horizon: dict[str, Any] | None = None, memo: list[Any] | None = None) -> Verdict:
    """The verdict of ``rule`` for one window: a plain ``fail_if`` threshold, a judge, or both.

    ``pool`` is the rule's history for a pooled judge (``judge.pool`` / ``judge.replays`` > 1):
    this window's entry is appended to it (and the list trimmed) when the window is readable, and
    the judge sees the whole pool. Without it a pooled rule judges this window alone.

    ``horizon`` is the rule's longer-horizon state (``RuleState.horizon``: sequential tests and
    long-term anchor, watchdog/policy/horizon.py); without it a ``judge.horizon`` is not run.
    ``memo``: the rule's ``RuleState.seq_memo`` (what the horizon test remembers between looks)."""
    ref = candidate or baseline
    v = Verdict(rule.name, "inconclusive", "", rule.source, rule.metric,
                start=ref.start if ref else 0.0, end=ref.end if ref else 0.0)
    for sig in (candidate, baseline):
        why = _unavailable(sig)
        if why is not None:  # never an error: a machine without NVML must not trip anything
            v.reason = why
            return v
    if rule.judge is not None:
        v = _evaluate_judged(rule, candidate, baseline, v, pool, null, level_cap(rule, horizon),
                             level_reset(rule, horizon), averaged_draw_sd(horizon), horizon)
        if v.status != "error":
            apply_horizon(rule, candidate, baseline, v, horizon, null, pool, memo)
        return v
    return _evaluate_condition(rule, candidate, baseline, v)


@dataclass(frozen=True, slots=True)
class _ConditionPlan:
    """What a ``fail_if`` rule reads, worked out once per rule object (rules are frozen)."""

    cond: Condition
    needs_base: bool
    needs_cand: bool
    paired_names: frozenset[str]
    #: fail_if or restore_if read a paired_* statistic
    any_paired: bool


#: id(rule) -> (rule, plan); holding the rule keeps its id from being reused
_PLANS: dict[int, tuple[Rule, _ConditionPlan]] = {}


def _condition_plan(rule: Rule) -> _ConditionPlan:
    hit = _PLANS.get(id(rule))
    if hit is not None and hit[0] is rule:
        return hit[1]
    cond = rule.condition
    assert cond is not None  # validated: a rule has fail_if, judge or both
    restore = rule.restore_condition
    names = cond.names | (restore.names if restore is not None else set())
    needs_base = "baseline" in cond.names
    plan = _ConditionPlan(cond, needs_base, "candidate" in cond.names or not needs_base,
                          frozenset(n for n in cond.names if n.startswith("paired_")),
                          any(n.startswith("paired_") for n in names))
    if len(_PLANS) >= 4096:  # policy reloads leave old rules behind
        _PLANS.clear()
    _PLANS[id(rule)] = (rule, plan)
    return plan


def _evaluate_condition(rule: Rule, candidate: Signal | None, baseline: Signal | None, v: Verdict) -> Verdict:
    plan = _condition_plan(rule)
    cond = plan.cond
    needs_base = plan.needs_base
    needs_cand = plan.needs_cand
    paired_names = plan.paired_names

    for role, sig, needed in (("candidate", candidate, needs_cand), ("baseline", baseline, needs_base)):
        if not needed:  # not read by fail_if: kept for restore_if and cause attribution if there
            raw = None if sig is None or sig.error else sig.values.get(rule.metric)
            if raw is not None and not math.isnan(float(raw)):
                setattr(v, role, float(raw))
            continue
        if sig is None:
            v.reason = f"no {role} signal in this window"
            return v
        if sig.error:
            return source_failed(v, role, sig)
        count = sample_count(rule, sig)
        if role == "candidate":
            v.samples = count
        else:
            v.baseline_samples = count
        if count < rule.min_samples:
            v.reason = f"too few {role} samples: {count} < min_samples {rule.min_samples}"
            return v
        raw = sig.values.get(rule.metric) if rule.replica_failures == "count" else rate_value(rule, sig)
        if raw is None:
            v.reason = f"{rule.metric} not measured for {role}"
            return v
        x = float(raw)
        if math.isnan(x):
            v.reason = f"{rule.metric} is NaN for {role}"
            return v
        setattr(v, role, x)

    env = _env(v)
    items = _paired_items(rule, candidate, baseline) if plan.any_paired else None
    if not paired_names and items:
        env.update(_paired_stats(items))
    if paired_names:
        if not items:
            v.reason = f"no paired values for {rule.metric}"
            return v
        stats = _paired_stats(items)
        missing = paired_names - stats.keys()
        if missing:
            v.reason = f"too few paired items for {', '.join(sorted(missing))}: {len(items)}"
            return v
        v.extra = {k: stats[k] for k in sorted(paired_names)}
        env.update(stats)

    shown = ", ".join(f"{k}={_fmt(x)}" for k, x in env.items() if k in cond.names or k in v.extra)
    if cond.evaluate(env):
        v.status, v.reason = "fail", f"{rule.metric}: {cond.text} ({shown})"
    else:
        v.status, v.reason = "pass", f"{rule.metric}: not ({cond.text}) ({shown})"
    _restore(rule, v, env)
    return v


def _env(v: Verdict) -> dict[str, float]:
    env: dict[str, float] = {}
    if v.candidate is not None:
        env["candidate"] = v.candidate
    if v.baseline is not None:
        env["baseline"] = v.baseline
    return env


def _restore(rule: Rule, v: Verdict, env: Mapping[str, float]) -> None:
    cond = rule.restore_condition
    if cond is not None and cond.names <= env.keys():
        v.restore = cond.evaluate(env)


def _paired_items(rule: Rule, candidate: Signal | None, baseline: Signal | None) -> list[float] | None:
    for sig in (candidate, baseline):
        if sig is not None and sig.paired and sig.paired.get(rule.metric):
            return [float(x) for x in sig.paired[rule.metric]]
    return None


# --- judged rules ------------------------------------------------------------------------------


_SCALARS = frozenset({float, int, str, bool, type(None)})


def _plain(x: Any) -> Any:
    """numpy scalars and containers (and dataclasses, as ``asdict`` would) -> plain Python, so
    verdicts stay JSON-able. Containers are copied."""
    t = type(x)
    if t in _SCALARS:  # the common case, and none of them has ``item``
        return x
    # scalars are kept inline below (no call each): a judgement has dozens of them per window
    if isinstance(x, dict):
        return {k if type(k) is str else str(k): v if type(v) in _SCALARS else _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [v if type(v) in _SCALARS else _plain(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain(dataclasses.asdict(x))
    if hasattr(x, "item") and callable(x.item):
        return x.item()
    return x


def _judgement_dict(j: Judgement) -> dict[str, Any]:
    """``_plain(j.to_dict())`` without ``asdict``'s deep copy (``_plain`` copies the containers)."""
    return _plain({name: getattr(j, name) for name in _JUDGEMENT_FIELDS})


_JUDGEMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Judgement))


def sketch_histograms(cand: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[dict[int, int], dict[int, int], float]:
    """Two ``QuantileSketch.to_dict()`` exports -> (candidate histogram, baseline histogram, gamma)
    in the form ``judge_unpaired`` takes; the zero buckets go to one index below all others."""
    acc = float(cand["relative_accuracy"])
    if acc != float(base["relative_accuracy"]) or float(cand["min_value"]) != float(base["min_value"]):
        raise ValueError("latency sketches have different accuracy")
    hc = {int(i): int(c) for i, c in cand.get("bins", [])}
    hb = {int(i): int(c) for i, c in base.get("bins", [])}
    zc, zb = int(cand.get("zero_count", 0)), int(base.get("zero_count", 0))
    if zc or zb:
        zero = min([*hc, *hb], default=0) - 1
        if zc:
            hc[zero] = zc
        if zb:
            hb[zero] = zb
    return hc, hb, (1.0 + acc) / (1.0 - acc)


def _item_ids(cand: Signal | None, base: Signal | None) -> list[Any] | None:
    for sig in (cand, base):
        ids = sig.detail.get("item_ids") if sig is not None else None
        if isinstance(ids, list):
            return ids
    return None


def _item_keys(cand: Signal | None, base: Signal | None) -> list[str] | None:
    """The replay's ``pooling.item_keys`` (id and version): what per-item levels are looked up by."""
    for sig in (cand, base):
        if sig is not None and isinstance(sig.detail.get("item_ids"), list):
            return item_keys(sig.detail["item_ids"], sig.detail.get("item_versions"))
    return None


def aa_count(rule: Rule, cand: Signal | None) -> tuple[float, int] | None:
    """This replay's A/A count for ``rule``'s broken-items test: (half the items whose baseline
    repeat moved by more than ``drop`` either way - the harmful side's share by symmetry, items)
    from the candidate signal's ``detail['aa']``, or None when the replay had no A/A pass."""
    j = rule.judge
    aa = cand.detail.get("aa") if cand is not None else None
    values = aa.get(rule.metric) if isinstance(aa, Mapping) else None
    if j is None or j.broken is None or not isinstance(values, list) or not values:
        return None
    vals = [float(x) for x in values if isinstance(x, (int, float)) and not math.isnan(x)]
    return sum(abs(x) > j.broken.drop for x in vals) / 2.0, len(vals)


#: A/A replays whose counts form a broken-items null (engine state)
MAX_AA_NULL = 20


def broken_null(rule: Rule, cand: Signal | None, null: list[dict[str, Any]] | None
                ) -> tuple[float, float, float]:
    """The broken-items null of ``rule`` for this replay: (A/A broken, A/A items, tolerance).
    Measured when any A/A pass is known (this replay's and the last ``MAX_AA_NULL`` stored):
    the baseline's own share plus the policy's ``null_share`` (FP8's tolerated sensitivity).
    Otherwise the stated share alone, as if measured on ``null_items`` items. Never learned from
    FP8-vs-FP16 replays: damage present from the first replay is not taken for the normal."""
    j = rule.judge
    assert j is not None and j.broken is not None
    b = j.broken
    counts = [(float(x["aa"]), int(x.get("n", 0))) for x in (null or []) if "aa" in x][-MAX_AA_NULL:]
    now = aa_count(rule, cand)
    if now is not None:
        counts.append(now)
    k0, n0 = sum(k for k, _ in counts), sum(n for _, n in counts)
    if n0 > 0:
        return k0, float(n0), b.null_share
    return b.null_share * b.null_items, float(b.null_items), 0.0


def _with_broken(rule: Rule, mean_j: Judgement | str, items: list[float] | None, cand: Signal | None,
                 base: Signal | None, null: list[dict[str, Any]] | None,
                 prev_ids: list[Any] | None = None, prev_keys: list[str] | None = None) -> Judgement | str:
    """A paired rule with ``judge.broken``: the mean-drift judgement and the broken-items tests of
    the latest replay (of the latest two when they asked different items), which split the
    rule's alpha (Bonferroni: ``broken.alpha``, default half, and the rest); the failing one
    (mean first) is the verdict, and the broken-items ranking is always in its detail.

    Two broken-items tests share ``broken.alpha``. The *absolute* one reads the raw FP8 - FP16
    differences against ``broken_null`` (A/A share + tolerance): no learned per-item level and
    no learned share can hide items broken from the start. The *change* one (rules that
    ``learn``, once per-item levels are known) reads the differences net of each item's healthy
    level against the level-adjusted counts of passing replays, seeded with the absolute null:
    sharper for damage that starts on a route with a healthy history."""
    j = rule.judge
    assert j is not None and j.broken is not None
    if isinstance(mean_j, str) or not items:
        return mean_j
    b = j.broken
    ids = (prev_ids or []) + (_item_ids(cand, base) or []) if prev_ids else _item_ids(cand, base)
    keys = (prev_keys or []) + (_item_keys(cand, base) or []) if prev_keys else _item_keys(cand, base)
    k0, n0, tolerance = broken_null(rule, cand, null)
    adjusted = _level_adjusted(rule, items, keys, null)
    alpha = j.broken_alpha / (2 if adjusted is not None else 1)
    common: dict[str, Any] = dict(direction=j.harm_direction, drop=b.drop, effect_threshold=b.effect, alpha=alpha,
                                  min_items=j.min_n, item_ids=ids, metric=rule.metric)
    bj = judge_broken(items, null_broken=k0, null_items=n0, tolerance=tolerance, **common)
    now = aa_count(rule, cand)
    summary = {"status": bj.status, "count": bj.detail.get("broken_count"), "null": [k0, n0],
               "tolerance": tolerance, "n": len(items), "alpha": alpha, **({"aa": list(now)} if now is not None else {}),
               "estimate": bj.estimate, "ci_low": bj.ci_low, "ci_high": bj.ci_high, "items": bj.detail.get("broken")}
    if adjusted is not None:
        seed = k0 / n0 + tolerance  # the absolute null's share: A/A + tolerance, or the stated share
        learned_counts = [x for x in (null or []) if "broken" in x]
        kc = seed * b.null_items + sum(float(x.get("broken", 0)) for x in learned_counts)
        nc = b.null_items + sum(float(x.get("n", 0)) for x in learned_counts)
        cj = judge_broken(adjusted, null_broken=kc, null_items=nc, **common)
        summary["change"] = {"status": cj.status, "count": cj.detail.get("broken_count"), "null": [kc, nc],
                             "p_value": cj.p_value}
        if bj.status != "fail" and cj.status == "fail":
            bj = cj
    if mean_j.status != "fail" and bj.status == "fail":
        bj.detail["mean_drift"] = {"status": mean_j.status, "message": mean_j.message}
        bj.detail["broken_test"] = summary
        return bj
    mean_j.detail["broken_test"] = summary
    return mean_j


def _level_adjusted(rule: Rule, items: list[float], ids: list[Any] | None, null: list[dict[str, Any]] | None
                    ) -> list[float] | None:
    """``items`` net of each item's learned healthy level (items seen in at least 2 passing
    replays; ``ids``: their ``pooling.item_keys``), or None when the rule does not learn or no item
    has a level yet."""
    j = rule.judge
    assert j is not None
    levels = item_levels(null) if j.learn is not None else {}
    if not levels or ids is None or len(ids) != len(items):
        return None
    known = [levels.get(str(i)) for i in ids]
    if not any(x is not None and x[1] >= 2 for x in known):
        return None
    return [d - x[0] if x is not None and x[1] >= 2 else d for d, x in zip(items, known, strict=True)]


def _run_judge(rule: Rule, cand: Signal | None, base: Signal | None, pool: Pool | None,
               null: list[dict[str, Any]] | None = None, cap: float | None = None,
               reset: tuple[float, float] | None = None, draw: float = 0.0,
               horizon: dict[str, Any] | None = None) -> Judgement | str:
    """The judge's verdict, or why it could not run (an inconclusive reason); ``cap``: a lower
    cap on a learned null's level (the long-term anchor's); ``reset``: (below, level), a learned
    level below ``below`` is judged as ``level`` (the anchor); ``draw``: the route's replica-draw sd
    averaged over its windows (``horizon.averaged_draw_sd``); ``horizon``: the rule's longer-horizon
    state (a latency rule's precisions' shapes, watchdog/policy/stalls.py)."""
    j = rule.judge
    assert j is not None
    if j.test != "paired" and learned(rule):
        return judge_pool(rule, cand, base, pool if pool is not None else [], None, null, level_cap=cap,
                          level_reset=reset, avg_draw=draw, horizon=horizon)
    if pool is not None and j.history > 1:
        items = _paired_items(rule, cand, base)
        if j.test == "paired" and j.broken is not None:
            out = judge_pool(rule, cand, base, pool, items, null)
            if not isinstance(out, str) and out.detail.get("looks", {}).get("rotated2") and len(pool) >= 2:
                prev, prev_ids, prev_keys, _ = line_up_entries(
                    pool[-2], [math.nan if x is None else float(x) for x in pool[-2]["diffs"]], pool[-1])
                return _with_broken(rule, out, prev + (items or []), cand, base, null, prev_ids, prev_keys)
            return _with_broken(rule, out, items, cand, base, null)
        return judge_pool(rule, cand, base, pool, items, null)
    if j.test == "paired":
        items = _paired_items(rule, cand, base)
        if not items:
            return f"no paired values for {rule.metric}"
        alpha = j.mean_alpha if cand is None or aa_moving(cand, rule.metric) < SAMPLED_SHARE \
            else min(j.mean_alpha, j.sampled_alpha)
        out = judge_paired(items, direction=j.harm_direction, effect_threshold=j.effect,
                           marginal_threshold=j.marginal, alpha=alpha, min_items=j.min_n, method=j.method,
                           max_ci_width=j.max_ci_width, metric=rule.metric, prior_jump=j.prior_jump)
        return _with_broken(rule, out, items, cand, base, null) if j.broken is not None else out
    assert cand is not None and base is not None
    if j.test == "mann_whitney":
        hists = [s.detail.get("latency_hist") for s in (cand, base)]
        if not all(isinstance(h, Mapping) for h in hists):
            return "no latency_hist in the window's detail"
        try:
            hc, hb, gamma = sketch_histograms(hists[0], hists[1])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as exc:
            return f"unreadable latency_hist: {exc}"
        if not hc or not hb:
            return "no latencies in the window"
        return judge_unpaired(hc, hb, direction=j.harm_direction, effect_threshold=j.effect,
                              marginal_threshold=j.marginal, alpha=j.alpha, min_samples=j.min_n,
                              max_ci_width=j.max_ci_width, gamma=gamma, metric=rule.metric)
    counts = [rate_counts(rule, s) for s in (cand, base)]
    if counts[0] is None or counts[1] is None:
        return f"no {rule.metric} counts in the window's detail"
    return judge_rate(counts[0][0], counts[0][1], counts[1][0], counts[1][1], effect_threshold=j.effect,
                      marginal_threshold=j.marginal, alpha=j.alpha, min_samples=j.min_n,
                      max_ci_width=j.max_ci_width, metric=rule.metric)


def _evaluate_judged(rule: Rule, candidate: Signal | None, baseline: Signal | None, v: Verdict,
                     pool: Pool | None, null: list[dict[str, Any]] | None = None, cap: float | None = None,
                     reset: tuple[float, float] | None = None, draw: float = 0.0,
                     horizon: dict[str, Any] | None = None) -> Verdict:
    j = rule.judge
    assert j is not None
    # a pooled live rule applies min_samples to the pool's events (judge_pool), not to one window
    pooled_live = j.test != "paired" and ((pool is not None and j.history > 1) or learned(rule))
    cond = rule.condition
    needs_base = j.test != "paired" or (cond is not None and "baseline" in cond.names)
    for role, sig, needed in (("candidate", candidate, True), ("baseline", baseline, needs_base)):
        if sig is None:
            if needed:
                v.reason = f"no {role} signal in this window"
                return v
            continue
        if sig.error:
            if needed:
                return source_failed(v, role, sig)
            continue
        count = sample_count(rule, sig)
        if role == "candidate":
            v.samples = count
        else:
            v.baseline_samples = count
        if needed and not pooled_live and count < rule.min_samples:
            v.reason = f"too few {role} samples: {count} < min_samples {rule.min_samples}"
            return v
        raw = rate_value(rule, sig)  # the window's value, or the rate as the judge counted it (restore_if reads it)
        if raw is not None and not math.isnan(float(raw)):
            setattr(v, role, float(raw))
    result = _run_judge(rule, candidate, baseline, pool, null, cap, reset, draw, horizon)
    if isinstance(result, str):
        v.reason = f"{rule.metric}: {result}"
        return v
    if j.straddle == "pass" and result.status == "marginal" and result.reason == "straddles_threshold":
        result.status, result.reason = "pass", "not_beyond_threshold"
        result.message = result.message.replace("marginal (straddles_threshold)", "pass (not shown beyond the threshold)")
    v.judgement = _judgement_dict(result)
    v.status, v.reason = result.status, result.message
    v.extra = {k: float(x) for k, x in (("estimate", result.estimate), ("ci_low", result.ci_low),
                                        ("ci_high", result.ci_high), ("p_value", result.p_value))
               if x is not None and math.isfinite(x)}
    if isinstance(result.detail.get("pool_size"), int):
        v.extra["pooled"] = float(result.detail["pool_size"])
    env = _env(v)
    if cond is not None and v.status == "fail":
        if not cond.names <= env.keys():
            v.status = "inconclusive"
            v.reason += f"; fail_if ({cond.text}) cannot be read: {rule.metric} not measured"
        elif not cond.evaluate(env):
            v.status = "marginal"
            v.reason += f"; significant, but fail_if ({cond.text}) is false"
    _restore(rule, v, env)
    return v


def combine_window(policy: Policy, verdicts: list[tuple[Rule, Verdict]]) -> Judgement | None:
    """Holm-adjust the non-critical judged verdicts of one window (in place): a fail that is not
    significant after the adjustment, or that fails with fewer than ``combine.k`` others, becomes
    marginal. Critical rules and plain thresholds are left alone. Returns combine's result."""
    judged = [(r, v) for r, v in verdicts if r.judge is not None and not r.critical and v.judgement is not None]
    if not judged or (policy.combine.method == "none" and policy.combine.k == 1):
        return None
    items = [Judgement(metric=r.name, status=v.status, reason="", message=v.reason,
                       p_value=(v.judgement or {}).get("p_value")) for r, v in judged]
    out = combine(items, method=policy.combine.method, alpha=policy.combine.alpha, k=policy.combine.k,
                  metric=policy.name)
    statuses, adjusted = out.detail["statuses"], out.detail["adjusted_p"]
    failed = out.detail["failed"]
    for r, v in judged:
        p_adj = adjusted.get(r.name)
        if p_adj is not None and math.isfinite(p_adj):
            v.extra["adjusted_p"] = float(p_adj)
        if v.status != "fail":
            continue
        if statuses.get(r.name) == "marginal":
            v.status = "marginal"
            v.reason += f"; not significant after Holm over {len(judged)} judged rules (adjusted p={p_adj:.3g})"
        elif len(failed) < policy.combine.k:
            v.status = "marginal"
            v.reason += f"; {len(failed)} judged rule(s) fail, combine.k is {policy.combine.k}"
    return out
