"""What a live rule judges beyond one window, and what it can see. Pure.

* ``apply_horizon``: the rule's always-valid sequential test (``judge.horizon``;
  watchdog/policy/judge/sequential.py) takes this window's FP8 - FP16 difference, whatever its
  traffic, and turns the verdict into a fail when FP8 is shown to be worse than FP16 by more
  than the absolute tolerance over the horizon; it also states the rule's minimum detectable
  effect (MDE) per window and over the horizon in ``Verdict.extra``.
* ``level_cap``: the cap on a learned null's level: the rule's ``level_cap`` (or ``effect``) and,
  with ``judge.anchor``, the long-term anchor + its tolerance (watchdog/policy/judge/anchor.py).
* ``learn_anchor``: a passing window moves the anchor (called by the engine with the null).
* ``judgeability``: per rule, whether it is judged now (per window, over the horizon, or not)
  and its MDE, for /status, the metrics and ``policy backtest``.

The engine keeps the sequential tests and the anchor in ``RuleState.horizon`` (JSON).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from watchdog.core.signals import Signal
from watchdog.policy.changes import held
from watchdog.policy.judge import sequential
from watchdog.policy.judge.anchor import anchor_cap, anchor_reset, update_anchor
from watchdog.policy.judge.stats import z_quantile
from watchdog.policy.schema import Rule
from watchdog.policy.stalls import held_by_stall

__all__ = ["MDE_POWER", "apply_horizon", "averaged_draw_sd", "judgeability", "learn_anchor", "level_cap", "level_reset", "null_learned", "settling", "window_mde"]

#: the power at which minimum detectable effects are stated
MDE_POWER = 0.8


def level_cap(rule: Rule, horizon: Mapping[str, Any] | None) -> float | None:
    """The highest level a learned null may credit (harm units), or None for the rule's own."""
    j = rule.judge
    if j is None or j.anchor is None:
        return None
    cap = anchor_cap((horizon or {}).get("anchor"), j.anchor.tolerance)
    if cap is None:
        return None
    own = j.effect if j.level_cap is None else j.level_cap
    return min(own, cap)


def level_reset(rule: Rule, horizon: Mapping[str, Any] | None) -> tuple[float, float] | None:
    """(below, level): a learned level below ``below`` (the anchor minus its tolerance) is judged
    as ``level`` (the anchor), or None."""
    j = rule.judge
    if j is None or j.anchor is None:
        return None
    return anchor_reset((horizon or {}).get("anchor"), j.anchor.tolerance)


def learn_anchor(rule: Rule, horizon: dict[str, Any], null: list[dict[str, Any]], e: float) -> None:
    """A passing window (difference ``e``, already appended to ``null``) moves the anchor."""
    j = rule.judge
    if j is None or j.anchor is None:
        return
    # the history only sets a new anchor; once set, it moves with ``e`` alone
    hist = [float(x["e"]) for x in null if "e" in x] if not horizon.get("anchor") else []
    anchor = update_anchor(horizon.get("anchor"), hist, e, learn_min=j.learn_min, halflife=j.anchor.halflife,
                           tolerance=j.anchor.tolerance)
    if anchor is not None:
        horizon["anchor"] = anchor


def window_mde(rule: Rule, judgement: Mapping[str, Any] | None, power: float = MDE_POWER) -> float | None:
    """The smallest harm (beyond the learned level, for a learned null) one window's judge would
    catch with probability ``power``: effect + the interval's half width + z_power sd, with the sd
    read off the interval (normal approximation). None when the window was not judged."""
    j = rule.judge
    if j is None or not judgement:
        return None
    lo, hi = judgement.get("ci_low"), judgement.get("ci_high")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        return None
    alpha = float((judgement.get("detail") or {}).get("alpha") or j.alpha)
    half = (hi - lo) / 2.0
    crit = z_quantile(1 - alpha / 2)
    return float(j.effect + half + z_quantile(power) * half / crit)


def _difference(rule: Rule, cand: Signal | None, base: Signal | None,
                judgement: Mapping[str, Any] | None, pool: list[dict[str, Any]] | None) -> tuple[float, float] | None:
    # pooling imports the judges; keep this light
    from watchdog.policy.pooling import joined_of, window_difference

    est = ((judgement or {}).get("detail") or {}).get("window_estimate")
    if isinstance(est, list) and len(est) == 2:
        return float(est[0]), float(est[1])
    if cand is None or base is None or cand.error or base.error:
        return None
    last = pool[-1] if pool else None
    if last is not None and "e" in last and float(last.get("end", math.nan)) == float(cand.end):
        return float(last["e"]), float(last["v"])  # this window's difference as the judge pooled it
    out = window_difference(rule, cand, base, joined_of(rule, pool or [], cand, base))
    return None if isinstance(out, str) else out


def _allowance(rule: Rule, cand: Signal | None, base: Signal | None, pool: list[dict[str, Any]] | None,
               horizon: dict[str, Any], windows: int) -> float:
    """The horizon tolerance's floor for the draw of replicas (``pooling.replica_allowance``) from the
    route's running means of the windows' replica-draw variances and their sampling variances
    (``horizon["draw"]``: [mean, mean sampling variance, windows], at most ``windows`` counted): the
    replicas are the same from window to window, so their spread is averaged over the windows the
    tests cover (the noise of the average shrinks with them) rather than read from one window."""
    from watchdog.policy.pooling import joined_of, replica_allowance, replica_draw

    got = replica_draw(rule, cand, base, joined_of(rule, pool or [], cand, base)) \
        if cand is not None and base is not None else None
    if got is not None:
        m, mv, c = horizon.get("draw") or (0.0, 0.0, 0)
        c = min(int(c) + 1, max(windows, 1))
        horizon["draw"] = [float(m) + (got[0] - float(m)) / c, float(mv) + (got[1] - float(mv)) / c, c]
    return replica_allowance(rule, averaged_draw_sd(horizon))


def averaged_draw_sd(horizon: Mapping[str, Any] | None) -> float:
    """The route's replica-draw sd averaged over the windows (``horizon["draw"]``, ``_allowance``),
    counted beyond its own sampling noise (``pooling.draw_sd``); 0 before any window measured one."""
    from watchdog.policy.pooling import draw_sd

    d = (horizon or {}).get("draw")
    if not d:
        return 0.0
    return draw_sd(float(d[0]), float(d[1]) / max(int(d[2]), 1))


def null_learned(rule: Rule, null: list[dict[str, Any]] | None, seq: Mapping[str, Any] | None = None) -> bool:
    """Whether the route's level is known: the rule's learned null holds ``learn_min`` healthy
    windows, or (a route too thin for the per-window judge, whose null never fills) the horizon
    tests have followed ``learn_min`` windows since the last flip or restart without rejecting."""
    j = rule.judge
    if j is None or j.learn is None:
        return False
    if seq is not None and int(seq.get("count", 0)) >= j.learn_min:
        return True
    return sum(1 for x in null or [] if "e" in x) >= j.learn_min


def settling(rule: Rule, cand: Signal | None, pool: list[dict[str, Any]] | None) -> bool:
    """Whether this window falls in a deploy's or a maintenance's settling time (``judge.settle``),
    or in a latency rule's hold while the two precisions run different builds (``judge.build_hold``;
    watchdog/policy/changes.py): the pool's entry for this window says so (``changes.held``). Such a
    window is not judged, and its difference - FP8 and FP16 on different builds, or a new build's
    cold first window - is not FP8's either. So is a window where a precision stalled as a whole
    (watchdog/policy/stalls.py)."""
    j = rule.judge
    if j is None or not pool or cand is None:
        return False
    last = pool[-1]
    if float(last.get("end", math.nan)) != float(cand.end):
        return False
    return held_by_stall(last) or (j.settle is not None and held(last, j.settle, j.hold) is not None)


def apply_horizon(rule: Rule, cand: Signal | None, base: Signal | None, v: Any,
                  horizon: dict[str, Any] | None, null: list[dict[str, Any]] | None = None,
                  pool: list[dict[str, Any]] | None = None, memo: list[Any] | None = None) -> None:
    """Feed this window to the rule's sequential tests and fold their result into the verdict
    ``v`` (an ``evaluate.Verdict``): a rejection is a fail (reason ``horizon_regression``); the
    per-window and horizon MDEs go to ``v.extra``. The tolerance is ``horizon.tolerance`` until
    the rule's learned null (``null``) knows the route's level, ``learned_tolerance`` after.
    A window in a deploy's settling time (``settling``; ``pool`` is the rule's pool with this
    window's entry) is not fed: the tests see the same windows the per-window judge does. ``memo``:
    the rule's ``RuleState.seq_memo`` (``sequential.evaluate``)."""
    j = rule.judge
    if j is None:
        return
    mde = window_mde(rule, v.judgement) if v.status in ("pass", "fail", "marginal") else None
    if mde is not None:
        v.extra["mde"] = mde
    held_now = settling(rule, cand, pool)
    if held_now:
        v.extra["settling"] = 1.0  # judgeability: not judged, not even over the horizon (why: the reason)
    if j.horizon is None or horizon is None:
        return
    h = j.horizon
    seq = horizon.setdefault("seq", sequential.new_state())
    learned = null_learned(rule, null, seq)
    tol, gamma = j.horizon_tolerance_at(learned), j.horizon_mixture_sd
    diff = None if held_now else _difference(rule, cand, base, v.judgement, pool)
    allow = _allowance(rule, cand, base, pool, horizon, h.windows)
    if allow > tol:
        # the replicas' draw alone may put FP8's pool this far from FP16's: within it the tolerance
        # cannot tell FP8 from where its replicas landed (docs/JUDGE.md "The draw of replicas")
        tol = allow
    if diff is not None:
        sequential.update(seq, diff[0], diff[1], end=v.end, between_sd=j.horizon_between_sd,
                          restart=h.restart, windows=h.windows, cap=(tol, h.max_step_sd) if h.max_step_sd else None)
    ev = sequential.evaluate(seq, alpha=h.alpha, gamma=gamma, tolerance=tol, windows=h.windows, power=MDE_POWER,
                             memo=memo)
    v.extra.update({"horizon_windows": float(ev["windows"]), "horizon_log_lr": float(ev["log_lr"]),
                    "horizon_mde": float(ev["mde_now"]), "horizon_mde_full": float(ev["mde_horizon"])})
    summary = {k: ev[k] for k in ("reject", "log_lr", "threshold", "windows", "estimate", "se", "tests",
                                  "mde_now", "mde_horizon")}
    summary["tolerance"] = tol
    if allow > 0:
        summary["replica_allowance"] = allow
    summary["level_learned"] = learned
    if v.judgement is not None:
        v.judgement.setdefault("detail", {})["horizon"] = summary
    if not ev["reject"] or v.status == "fail":
        return
    msg = (f"{rule.metric}: fail over the horizon (horizon_regression); FP8 - FP16 {ev['estimate']:+.4g} "
           f"(se {ev['se']:.2g}) beyond the tolerance {tol:.4g} over {ev['windows']} window(s), always-valid "
           f"mixture SPRT log LR {ev['log_lr']:.1f} >= {ev['threshold']:.1f}")
    if v.reason:
        msg += f"; this window: {v.reason}"
    v.status, v.reason = "fail", msg
    jd = dict(v.judgement or {"metric": rule.metric, "n": ev["windows"], "effect_threshold": tol,
                              "method": "msprt", "detail": {"horizon": summary}})
    jd.update(status="fail", reason="horizon_regression", message=msg, estimate=ev["estimate"],
              p_value=min(1.0, math.exp(-ev["log_lr"])))
    v.judgement = jd


def judgeability(rule: Rule, last: Any, horizon: Mapping[str, Any] | None) -> dict[str, Any]:
    """Whether ``rule`` is judged at the traffic of its last window, and what it can see there:
    ``judged`` = ``window`` (the last window got a verdict from the judge), ``horizon`` (too
    little traffic for one window, judged over the horizon by the sequential test), ``learning``
    (a learned null warming up), or ``no`` (with ``why``: also a window in a deploy's settling time
    or a build hold, which feeds the horizon nothing either); ``mde`` (harm units, at 80 % power) per
    window and ``horizon_mde`` now / after the full horizon at this traffic; for a window judged
    against a learned null, ``level`` (the FP8 - FP16 level its ``mde`` is beyond) and, when the draw
    of replicas raised the level the rule may credit, ``replica_allowance``. Plain ``fail_if``
    rules are ``window`` whenever their last verdict is pass or fail."""
    out: dict[str, Any] = {"judged": "no", "why": None, "mde": None, "horizon_mde": None,
                           "horizon_mde_full": None, "horizon_windows": None,
                           "kind": "threshold" if rule.judge is None else "judge"}
    if last is None:
        out["why"] = "no window yet"
        return out
    extra = last.extra or {}
    jd = last.judgement or {}
    if last.status in ("pass", "fail", "marginal") and jd.get("reason") != "horizon_regression":
        out["judged"] = "window"
    elif jd.get("reason") == "learning_null":
        out["judged"] = "learning"
    j = rule.judge
    if j is not None and j.horizon is not None and not extra.get("settling"):
        h = (horizon or {}).get("seq") or {}
        if h.get("tests"):
            for key in ("horizon_mde", "horizon_mde_full"):
                x = extra.get(key)
                out[key] = float(x) if x is not None and math.isfinite(x) else None
            out["horizon_windows"] = int(extra.get("horizon_windows", 0))
            if out["judged"] != "window":
                out["judged"] = "horizon"
    if "mde" in extra:
        out["mde"] = float(extra["mde"])
    detail = jd.get("detail") or {}
    if out["judged"] == "window" and isinstance(detail.get("level"), (int, float)):
        # the per-window MDE is beyond this level (FP8 - FP16 the rule credits: learned, capped at the
        # rule's level_cap, raised to what the draw of replicas alone allows)
        out["level"] = float(detail["level"])
        if isinstance(detail.get("replica_allowance"), (int, float)):
            out["replica_allowance"] = float(detail["replica_allowance"])
    if out["judged"] == "no":
        out["why"] = last.reason or last.status
    return out
