"""What one (policy, model, route) scope does after its new windows were judged: pure, no I/O.

``decide`` reads the scope's rule streaks and flip history and proposes actions: one alert per
incident of an ``alert`` rule, a suspicion (and a golden replay request) for a ``confirm_with``
rule, an inhibition alert when an input shift or GPU health explains the failures, a rollback
guarded by dry run, the daily flip budget, the cooldown and the minimum time in state (a blocked
flip is one alert), a promote after enough healthy windows (manual: one "ready" alert), a retry of
a flip the flags do not show yet, and a resolve when every incident has cleared. It updates the
scope's open incidents and promote readiness; the engine arbitrates between policies and records
the flips (``watchdog/policy/engine.py``). docs/POLICIES.md says it in words.
"""

from __future__ import annotations

import math
import time
from typing import Any

from watchdog.core.signals import ROUTING_KEY, SEVERITY_RANK, Action
from watchdog.policy.causes import attribute_rule, gpu_problems
from watchdog.policy.judge.verdict import Attribution
from watchdog.policy.schema import Policy, Rule
from watchdog.policy.state import ScopeState

__all__ = ["decide", "utc_day"]



def utc_day(now: float) -> str:
    """The UTC date of ``now``: the day the flip budget counts in."""
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf -> None, so alert payloads are strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s"


def decide(policy: Policy, st: ScopeState, model: str, route: str, serving: str,
           now: float, at: float) -> list[Action]:
    """The actions ``policy`` proposes for one (model, route) serving ``serving``; ``at`` is the
    latest window end (the actions' time), ``now`` the clock the guards run on."""
    return _Decision(policy, st, model, route, serving, now, at).run()


class _Decision:
    """One call of ``decide``: the scope, and the actions proposed so far."""

    def __init__(self, policy: Policy, st: ScopeState, model: str, route: str, serving: str,
                 now: float, at: float) -> None:
        self.policy = policy
        self.st = st
        self.model = model
        self.route = route
        self.serving = serving
        self.now = now
        self.at = at
        self.out: list[Action] = []

    def act(self, kind: str, reason: str, severity: str, **kw: Any) -> Action:
        routing = self.policy.actions
        # a real rollback is announced as critical (watchdog.alerting.incidents.describe): it pages
        announced = "critical" if kind == "rollback" and not kw.get("dry_run") else severity
        detail = {"channels": routing.channels(announced), **kw.pop("detail", {})}
        if routing.routed:  # the alerter sends this incident's messages to these channels only
            detail[ROUTING_KEY] = {"notify": list(routing.notify), "page": list(routing.page)}
        a = Action(kind=kind, policy=self.policy.name, model=self.model, route=self.route,  # type: ignore[arg-type]
                   reason=reason, severity=severity, at=self.at, detail=detail, **kw)  # type: ignore[arg-type]
        self.out.append(a)
        return a

    def run(self) -> list[Action]:
        policy, st = self.policy, self.st
        had_open = bool(st.open_alerts)
        tripped = [r for r in policy.rules if st.rules[r.name].tripped(r)]
        on_candidate = self.serving == policy.candidate

        # alert rules: one alert per incident, cleared when the rule no longer trips
        for rule in tripped:
            if rule.action == "alert" and f"rule:{rule.name}" not in st.open_alerts:
                st.open_alerts.add(f"rule:{rule.name}")
                self.act("alert", _why(rule, st), rule.severity, detail={"rule": rule.name, "source": rule.source,
                         "verdict": _last(st, rule)})

        notes: dict[str, str] = {}
        candidates = self._confirmed(tripped, on_candidate, notes)
        tripped_rb, inhibited = self._inhibit(candidates, on_candidate)
        removed = self._clear_incidents(tripped, inhibited)
        rolled_back = self._rollback(tripped_rb, inhibited, notes)
        promoted = self._promote(tripped)
        if had_open and not st.open_alerts and not (rolled_back or promoted):
            why = (f"rule {', '.join(removed)} removed from the policy by an edit (not judged recovered)" if removed
                   else "recovered: no rule trips any more")
            self.act("resolve", why, "info")
        return self.out

    def _clear_incidents(self, tripped: list[Rule], inhibited: list[tuple[Rule, Attribution]]) -> list[str]:
        """Close the rule, suspicion and inhibition incidents whose cause no longer holds; the names of
        the rules among them that the policy no longer has (removed by an edit: not a recovery)."""
        st = self.st
        still = ({f"rule:{r.name}" for r in tripped if r.action == "alert"}
                 | {f"suspect:{r.name}" for r in tripped if r.action == "rollback" and r.confirm_with}
                 | {f"inhibited:{a.cause}" for _, a in inhibited})
        removed: list[str] = []
        for key in sorted(st.open_alerts):
            kind, _, name = key.partition(":")
            if kind in ("rule", "suspect", "inhibited") and key not in still:
                st.open_alerts.discard(key)
                if kind in ("rule", "suspect") and self.policy.rule(name) is None:
                    removed.append(name)
        return removed

    def _rollback(self, tripped_rb: list[Rule], inhibited: list[tuple[Rule, Attribution]],
                  notes: dict[str, str]) -> bool:
        """Roll back (or say why not) for the rules blamed on the candidate; True when a rollback
        was proposed."""
        policy, st, now = self.policy, self.st, self.now
        flipped = False
        if tripped_rb and self.serving == policy.candidate:
            severity = max((r.severity for r in tripped_rb), key=SEVERITY_RANK.__getitem__)
            why = "; ".join(_why(r, st) + (f" ({notes[r.name]})" if r.name in notes else "")
                            for r in tripped_rb)
            detail: dict[str, Any] = {"rule": tripped_rb[0].name, "source": tripped_rb[0].source,
                                      "rules": [r.name for r in tripped_rb], "cause": "candidate",
                                      "verdicts": [_last(st, r) for r in tripped_rb]}
            if inhibited:
                detail["inhibited"] = {r.name: a.cause for r, a in inhibited}
            if policy.dry_run:
                if "dry_run_rollback" not in st.open_alerts:
                    st.open_alerts.add("dry_run_rollback")
                    self.act("alert", f"dry run: would roll back to {policy.baseline}: {why}", severity,
                             dry_run=True, precision=policy.baseline, detail=detail)
            elif _retry(policy, st, policy.baseline, now):
                # asked before, flags do not show it yet: ask again, it is the same flip
                self.act("rollback", why, severity, precision=policy.baseline, detail={**detail, "retry": True})
                flipped = True
            elif (blocked := _blocked(policy, st, now)) is not None:
                if "rollback_blocked" not in st.open_alerts:
                    st.open_alerts.add("rollback_blocked")
                    self.act("alert", f"rollback to {policy.baseline} blocked ({blocked}): {why}", severity,
                             detail={**detail, "blocked": blocked})
            else:
                self.act("rollback", why, severity, precision=policy.baseline, detail=detail)
                flipped = True
        if not tripped_rb:
            st.open_alerts -= {"dry_run_rollback", "rollback_blocked"}
            if st.pending and st.pending["kind"] == "rollback":
                st.pending = None
        return flipped

    def _promote(self, tripped: list[Rule]) -> bool:
        """Promote the candidate after enough healthy windows (manual mode: say it is ready);
        True when a promote was proposed."""
        policy, st, now = self.policy, self.st, self.now
        flipped = False
        st.promote_ready = self.serving == policy.baseline and not tripped and st.healthy >= policy.promote.healthy_windows
        if not st.promote_ready:
            st.open_alerts.discard("promote_blocked")
            st.promote_ready_alerted = False
        elif policy.promote.mode == "manual" or policy.dry_run:
            # a dry-run policy speaks of its own rollback only (switched to dry run while it was in force)
            if not st.promote_ready_alerted and (not policy.dry_run or st.rollback_to == self.serving):
                st.promote_ready_alerted = True
                how = ("promote manually when ready" if not policy.dry_run else
                       f"dry run: not promoting it; restore it by hand (`fp8-watchdog flags set {self.model} "
                       f"{self.route} {policy.candidate}`) or turn dry_run off")
                # announced on the rollback's open incident too (watchdog.alerting.incidents)
                self.act("alert", f"{policy.candidate} healthy for {st.healthy} windows; {how}", "info",
                         detail={"promote_ready": True, "announce": "promote-ready"})
        else:
            # since the route came to the baseline: our rollback, or one seen in the flags (another
            # policy's, an operator's), so a policy that takes over waits its promote.after too
            arrived = max((t for t in (st.last_flip, st.serving_since) if t is not None), default=None)
            since = math.inf if arrived is None else now - arrived
            why = f"{st.healthy} consecutive healthy windows"
            if _retry(policy, st, policy.candidate, now):
                self.act("promote", why, "info", precision=policy.candidate, detail={"retry": True})
                flipped = True
            elif since >= policy.promote.after:
                if (blocked := _blocked(policy, st, now)) is not None:
                    if "promote_blocked" not in st.open_alerts:
                        st.open_alerts.add("promote_blocked")
                        self.act("alert", f"promote to {policy.candidate} blocked ({blocked})", "info",
                                 detail={"blocked": blocked})
                else:
                    self.act("promote", why, "info", precision=policy.candidate)
                    flipped = True
        return flipped

    def _confirmed(self, tripped: list[Rule], on_candidate: bool, notes: dict[str, str]) -> list[Rule]:
        """Tripped rollback rules that may roll back now. A ``confirm_with`` rule is only a
        suspicion: one alert asking for a golden replay (``detail.request_replay``); it rolls back
        when a rule of the confirming source trips too, or when it keeps failing
        ``confirm_timeout`` more windows."""
        st = self.st
        out: list[Rule] = []
        for rule in tripped:
            if rule.action != "rollback":
                continue
            if rule.confirm_with is None:
                out.append(rule)
                continue
            rs = st.rules[rule.name]
            confirm = [r.name for r in tripped if r.source == rule.confirm_with]
            by_fails = rs.fails >= rule.for_
            streak = rs.fails if by_fails else rs.errors
            limit = (rule.for_ if by_fails else rule.errors_trip_after or 0) + rule.confirm_timeout
            if confirm:
                notes[rule.name] = f"confirmed by {rule.confirm_with} rule(s) {', '.join(confirm)}"
                out.append(rule)
            elif streak >= limit:
                notes[rule.name] = (f"not confirmed by {rule.confirm_with}, still failing after "
                                    f"{rule.confirm_timeout} more window(s)")
                out.append(rule)
            elif on_candidate and f"suspect:{rule.name}" not in st.open_alerts:
                st.open_alerts.add(f"suspect:{rule.name}")
                self.act("alert", f"suspected: {_why(rule, st)}; {rule.confirm_with} replay requested to confirm "
                         f"before rolling back", rule.severity,
                         detail={"request_replay": True, "rule": rule.name, "source": rule.source,
                                 "confirm_with": rule.confirm_with, "confirm_timeout": rule.confirm_timeout,
                                 "verdict": _last(st, rule)})
        return out

    def _inhibit(self, rules: list[Rule], on_candidate: bool) -> tuple[list[Rule], list[tuple[Rule, Attribution]]]:
        """Split rollback rules into those blamed on the candidate and those an input shift or GPU
        health explains. Only when none is blamed on the candidate: one alert with the cause."""
        policy, st = self.policy, self.st
        if not rules:
            return [], []
        problems = gpu_problems(policy, st, self.now)
        blame: list[Rule] = []
        inhibited: list[tuple[Rule, Attribution]] = []
        for rule in rules:
            if rule.source == "gpu":  # a GPU rule is about the GPU itself
                blame.append(rule)
                continue
            a = attribute_rule(policy, rule, st.rules[rule.name], problems)
            if a.inhibit_rollback:
                inhibited.append((rule, a))
            else:
                blame.append(rule)
        if blame or not inhibited or not on_candidate:
            return blame, inhibited
        rule, a = inhibited[0]
        key = f"inhibited:{a.cause}"
        if key not in st.open_alerts:
            st.open_alerts.add(key)
            severity = max((r.severity for r, _ in inhibited), key=SEVERITY_RANK.__getitem__)
            why = "; ".join(_why(r, st) for r, _ in inhibited)
            self.act("alert", f"not rolling back to {policy.baseline}: {a.message}: {why}", severity,
                     detail={"cause": a.cause, "rule": rule.name, "source": rule.source,
                             "rules": [r.name for r, _ in inhibited], "attribution": _finite(a.to_dict()),
                             "verdicts": [_last(st, r) for r, _ in inhibited]})
        return blame, inhibited


def _blocked(policy: Policy, st: ScopeState, now: float) -> str | None:
    """Why a flip may not happen now, or None."""
    if st.flip_day != utc_day(now):
        st.flip_day, st.flips_today = utc_day(now), 0
    if st.flips_today >= policy.max_flips_per_day:
        return (f"flip budget spent: {st.flips_today} flips today "
                f"(max_flips_per_day: {policy.max_flips_per_day})")
    if st.last_flip is not None and now - st.last_flip < policy.cooldown:
        return f"cooldown: last flip {_ago(now - st.last_flip)} ago, cooldown {_ago(policy.cooldown)}"
    least = policy.min_time_in_state.of(st.serving, policy.candidate)
    if st.serving_since is not None and now - st.serving_since < least:
        return (f"min_time_in_state: serving {st.serving} for {_ago(now - st.serving_since)}, "
                f"minimum {_ago(least)}")
    return None


def _retry(policy: Policy, st: ScopeState, precision: str, now: float) -> bool:
    """Ask again for a flip the flags do not show yet, for up to one cooldown (at least 60 s);
    after that a new flip is needed, which spends budget, so a refused flip cannot loop."""
    return bool(st.pending and st.pending["precision"] == precision
                and now - float(st.pending["at"]) <= max(policy.cooldown, 60.0))


def _last(st: ScopeState, rule: Rule) -> dict[str, Any] | None:
    last = st.rules[rule.name].last
    return last.to_dict() if last else None


def _why(rule: Rule, st: ScopeState) -> str:
    rs = st.rules[rule.name]
    reason = rs.last.reason if rs.last else ""
    if rs.fails >= rule.for_:
        return f"{rule.name} failed {rs.fails} window(s) in a row: {reason}"
    return f"{rule.name}: source failed {rs.errors} time(s) in a row: {reason}"
