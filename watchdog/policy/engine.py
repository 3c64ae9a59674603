"""The policy state machine: signals + current flags in, actions out. Pure and deterministic.

State is kept per (policy, model, route): per-rule consecutive fail/error counts, the healthy
window count, flip history (for cooldown, min time in state, daily flip budget), open alert
incidents, and the last window end per source so a replayed window is never counted twice.
See docs/POLICIES.md for the behaviour in words.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from watchdog.core.signals import SEVERITY_RANK, Action, Signal
from watchdog.policy.causes import attribute_rule, gpu_problems, gpu_reading
from watchdog.policy.evaluate import Verdict, combine_window, evaluate_rule
from watchdog.policy.loader import PolicySet
from watchdog.policy.pooling import learn_items
from watchdog.policy.schema import MAX_POOL_WINDOWS, Policy, Rule
from watchdog.policy.state import STATE_VERSION, RuleState, ScopeState, rule_fingerprint

__all__ = ["STATE_VERSION", "PolicyEngine", "RuleState", "ScopeState", "rule_fingerprint"]

log = logging.getLogger(__name__)

ScopeKey = tuple[str, str, str]  # (policy, model, route)


def _utc_day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf -> None, so alert payloads are strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s"


def _learn(rule: Rule, rs: RuleState, v: Verdict) -> None:
    """A passing window or replay feeds the rule's learned null (bounded): the window's FP8 -
    FP16 difference (``judge.learn``) or the replay's broken-item count (``judge.broken``)."""
    j = rule.judge
    jd = v.judgement
    if j is None or jd is None:
        return
    detail = jd.get("detail") or {}
    if j.learn is not None and isinstance(detail.get("window_estimate"), list):
        est = detail["window_estimate"]
        rs.null.append({"end": v.end, "e": float(est[0]), "v": float(est[1])})
        del rs.null[:-j.learn]
        return
    if j.test == "paired" and j.learn is not None and rs.pool and rs.pool[-1].get("end") == v.end:
        learn_items(rs.null, rs.pool[-1], j.learn)
    if j.broken is not None and isinstance(detail.get("broken_test"), dict):
        bt = detail["broken_test"]
        if isinstance(bt.get("count"), int):
            counts = [x for x in rs.null if "broken" in x]
            counts.append({"end": v.end, "broken": bt["count"], "n": int(bt.get("n") or jd.get("n") or 0),
                           "pooled": bool(bt.get("pooled", False))})
            rs.null[:] = [x for x in rs.null if "broken" not in x] + counts[-_MAX_BROKEN_NULL:]


#: passing golden replays whose broken-item counts form a paired rule's null
_MAX_BROKEN_NULL = 20


class PolicyEngine:
    """Evaluate policies over signals and decide rollbacks, promotes and alerts.

    Call ``observe`` once per closed window (or golden/GPU report) with every signal of that
    window: candidate and baseline signals of one window must arrive in the same call.
    """

    def __init__(self, policy_set: PolicySet | None = None) -> None:
        self.policy_set = policy_set or PolicySet()
        self.states: dict[ScopeKey, ScopeState] = {}

    # -- policies -------------------------------------------------------------------------
    def set_policy_set(self, policy_set: PolicySet) -> None:
        """Swap policies (hot reload). State of unchanged rules is kept; flip history of a
        policy that still exists under the same name is kept; removed policies are forgotten."""
        self.policy_set = policy_set
        for key in list(self.states):
            policy = policy_set.get(key[0])
            if policy is None:
                del self.states[key]
                continue
            st = self.states[key]
            for name in list(st.rules):
                rule = policy.rule(name)
                if rule is None or rule_fingerprint(rule) != st.rules[name].fingerprint:
                    del st.rules[name]

    def _state(self, policy: Policy, model: str, route: str) -> ScopeState:
        st = self.states.get((policy.name, model, route))
        if st is None:
            st = self.states[(policy.name, model, route)] = ScopeState()
        for rule in policy.rules:
            if rule.name not in st.rules:
                st.rules[rule.name] = RuleState(rule_fingerprint(rule))
        return st

    # -- main call ------------------------------------------------------------------------
    def observe(
        self,
        signals: list[Signal],
        now: float,
        flags: Mapping[tuple[str, str], str],
        default_precision: str = "fp8",
    ) -> list[Action]:
        by_pair = self._group(signals, flags)
        proposed: list[Action] = []
        for policy in self.policy_set.policies:
            for (model, route), sigs in by_pair.items():
                if not policy.scope.covers(model, route):
                    continue
                st = self._state(policy, model, route)
                serving = flags.get((model, route), default_precision)
                self._sync_serving(st, serving, now)
                at = self._process_windows(policy, st, sigs)
                if at is None:
                    continue
                proposed += self._decide(policy, st, model, route, serving, now, at)
        return self._arbitrate(proposed, now, flags, default_precision)

    def _group(self, signals: list[Signal], flags: Mapping[tuple[str, str], str]) -> dict[tuple[str, str], list[Signal]]:
        """Signals by (model, route); a ``*`` model or route (e.g. GPU health) applies to every
        known pair that matches (known = in flags, in these signals, or seen before)."""
        known = set(flags) | {(s.model, s.route) for s in signals if "*" not in (s.model, s.route)}
        known |= {(m, r) for (_, m, r) in self.states}
        out: dict[tuple[str, str], list[Signal]] = {}
        for s in signals:
            if s.model == "*" or s.route == "*":
                for m, r in sorted(known):
                    if s.model in ("*", m) and s.route in ("*", r):
                        out.setdefault((m, r), []).append(s)
            else:
                out.setdefault((s.model, s.route), []).append(s)
        return out

    @staticmethod
    def _sync_serving(st: ScopeState, serving: str, now: float) -> None:
        if st.pending and st.pending["precision"] == serving:
            st.pending = None  # our flip is now visible in the flags
        elif serving != st.serving and st.serving is not None:
            st.serving_since = now  # changed by someone else
            st.pending = None
            st.reset_pools()
        st.serving = serving

    def _process_windows(self, policy: Policy, st: ScopeState, sigs: list[Signal]) -> float | None:
        """Evaluate every new window in time order. Returns the latest window end, or None."""
        sources = {r.source for r in policy.rules}
        windows: dict[tuple[str, float, float], list[Signal]] = {}
        for s in sorted((s for s in sigs if s.source == "gpu"), key=lambda s: s.end):
            reading = gpu_reading(policy, s)
            if reading is not None and (st.gpu is None or s.end >= float(st.gpu["at"])):
                st.gpu = reading
        for s in sigs:
            if s.source in sources and s.end > st.last_end.get(s.source, -math.inf):
                windows.setdefault((s.source, s.start, s.end), []).append(s)
        latest: float | None = None
        for source, start, end in sorted(windows, key=lambda k: (k[2], k[0], k[1])):
            group = windows[(source, start, end)]
            cand = next((s for s in group if s.precision == policy.candidate), None)
            if cand is None:
                cand = next((s for s in group if s.precision is None), None)
            base = next((s for s in group if s.precision == policy.baseline), None)
            judged = [(rule, evaluate_rule(rule, cand, base, st.rules[rule.name].pool, st.rules[rule.name].null))
                      for rule in policy.rules if rule.source == source]
            combine_window(policy, judged)
            window = [self._apply(rule, st, v) for rule, v in judged]
            self._count_healthy(policy, st, source, window)
            st.last_end[source] = max(st.last_end.get(source, -math.inf), end)
            latest = end if latest is None else max(latest, end)
        return latest

    @staticmethod
    def _apply(rule: Rule, st: ScopeState, v: Verdict) -> Verdict:
        rs = st.rules[rule.name]
        if v.status == "pass":
            rs.fails = rs.errors = 0
            _learn(rule, rs, v)
            if v.candidate is not None and v.baseline is not None:
                old = (rs.ref or {}).get("recent")
                recent = [e for e in old if isinstance(e, list) and len(e) == 3] if isinstance(old, list) else []
                recent = (recent + [[v.end, v.candidate, v.baseline]])[-(MAX_POOL_WINDOWS + 1):]
                rs.ref = {"candidate": v.candidate, "baseline": v.baseline, "recent": recent}
        elif v.status == "marginal":  # measured, not clearly bad: breaks the streaks, not healthy
            rs.fails = rs.errors = 0
        if v.status in ("inconclusive", "marginal") and v.judgement is not None \
                and v.judgement.get("reason") == "learning_null":
            _learn(rule, rs, v)  # the null learns while it warms up (no fail: nothing to roll back)
        elif v.status == "fail":
            rs.fails += 1
            rs.errors = 0
        elif v.status == "error":
            rs.errors += 1
        rs.last = v
        return v

    @staticmethod
    def _count_healthy(policy: Policy, st: ScopeState, source: str, window: list[Verdict]) -> None:
        """Restore hysteresis: a fail or error of any source resets the count; in a window of
        ``promote.healthy_sources`` (default: all) a marginal verdict or a false ``restore_if``
        resets it too, and a clean window counts up."""
        counted = policy.promote.healthy_sources is None or source in policy.promote.healthy_sources
        bad = any(v.status in ("fail", "error") for v in window)
        if bad or (counted and any(v.status == "marginal" or v.restore is False for v in window)):
            st.healthy = 0
        elif counted and any(v.status == "pass" for v in window) and all(
            st.rules[r.name].fails == 0 and st.rules[r.name].errors == 0 for r in policy.rules
        ):
            st.healthy += 1

    # -- decisions ------------------------------------------------------------------------
    def _blocked(self, policy: Policy, st: ScopeState, now: float) -> str | None:
        """Why a flip may not happen now, or None."""
        if st.flip_day != _utc_day(now):
            st.flip_day, st.flips_today = _utc_day(now), 0
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

    def _decide(self, policy: Policy, st: ScopeState, model: str, route: str, serving: str,
                now: float, at: float) -> list[Action]:
        out: list[Action] = []
        had_open = bool(st.open_alerts)

        def act(kind: str, reason: str, severity: str, **kw: Any) -> Action:
            detail = {"channels": policy.actions.channels(severity), **kw.pop("detail", {})}
            a = Action(kind=kind, policy=policy.name, model=model, route=route, reason=reason,  # type: ignore[arg-type]
                       severity=severity, at=at, detail=detail, **kw)  # type: ignore[arg-type]
            out.append(a)
            return a

        tripped = [r for r in policy.rules if st.rules[r.name].tripped(r)]
        on_candidate = serving == policy.candidate

        # alert rules: one alert per incident, cleared when the rule no longer trips
        for rule in tripped:
            if rule.action == "alert" and f"rule:{rule.name}" not in st.open_alerts:
                st.open_alerts.add(f"rule:{rule.name}")
                act("alert", self._why(rule, st), rule.severity, detail={"rule": rule.name, "source": rule.source,
                    "verdict": self._last(st, rule)})

        notes: dict[str, str] = {}
        candidates = self._confirmed(policy, st, tripped, on_candidate, notes, act)
        tripped_rb, inhibited = self._inhibit(policy, st, candidates, now, on_candidate, act)

        still = ({f"rule:{r.name}" for r in tripped if r.action == "alert"}
                 | {f"suspect:{r.name}" for r in tripped if r.action == "rollback" and r.confirm_with}
                 | {f"inhibited:{a.cause}" for _, a in inhibited})
        for key in list(st.open_alerts):
            if key.split(":", 1)[0] in ("rule", "suspect", "inhibited") and key not in still:
                st.open_alerts.discard(key)

        flipped = False
        if tripped_rb and serving == policy.candidate:
            severity = max((r.severity for r in tripped_rb), key=SEVERITY_RANK.__getitem__)
            why = "; ".join(self._why(r, st) + (f" ({notes[r.name]})" if r.name in notes else "")
                            for r in tripped_rb)
            detail: dict[str, Any] = {"rule": tripped_rb[0].name, "source": tripped_rb[0].source,
                                      "rules": [r.name for r in tripped_rb], "cause": "candidate",
                                      "verdicts": [self._last(st, r) for r in tripped_rb]}
            if inhibited:
                detail["inhibited"] = {r.name: a.cause for r, a in inhibited}
            if policy.dry_run:
                if "dry_run_rollback" not in st.open_alerts:
                    st.open_alerts.add("dry_run_rollback")
                    act("alert", f"dry run: would roll back to {policy.baseline}: {why}", severity,
                        dry_run=True, precision=policy.baseline, detail=detail)
            elif self._retry(policy, st, policy.baseline, now):
                # asked before, flags do not show it yet: ask again, it is the same flip
                act("rollback", why, severity, precision=policy.baseline, detail={**detail, "retry": True})
                flipped = True
            elif (blocked := self._blocked(policy, st, now)) is not None:
                if "rollback_blocked" not in st.open_alerts:
                    st.open_alerts.add("rollback_blocked")
                    act("alert", f"rollback to {policy.baseline} blocked ({blocked}): {why}", severity,
                        detail={**detail, "blocked": blocked})
            else:
                act("rollback", why, severity, precision=policy.baseline, detail=detail)
                flipped = True
        if not tripped_rb:
            st.open_alerts -= {"dry_run_rollback", "rollback_blocked"}
            if st.pending and st.pending["kind"] == "rollback":
                st.pending = None

        st.promote_ready = serving == policy.baseline and not tripped and st.healthy >= policy.promote.healthy_windows
        if not st.promote_ready:
            st.open_alerts.discard("promote_blocked")
            st.promote_ready_alerted = False
        elif policy.promote.mode == "manual":
            if not st.promote_ready_alerted:
                st.promote_ready_alerted = True
                act("alert", f"{policy.candidate} healthy for {st.healthy} windows; promote manually "
                    "when ready", "info", detail={"promote_ready": True})
        elif not policy.dry_run:
            since = math.inf if st.last_flip is None else now - st.last_flip
            why = f"{st.healthy} consecutive healthy windows"
            if self._retry(policy, st, policy.candidate, now):
                act("promote", why, "info", precision=policy.candidate, detail={"retry": True})
                flipped = True
            elif since >= policy.promote.after:
                if (blocked := self._blocked(policy, st, now)) is not None:
                    if "promote_blocked" not in st.open_alerts:
                        st.open_alerts.add("promote_blocked")
                        act("alert", f"promote to {policy.candidate} blocked ({blocked})", "info",
                            detail={"blocked": blocked})
                else:
                    act("promote", why, "info", precision=policy.candidate)
                    flipped = True

        if had_open and not st.open_alerts and not flipped:
            act("resolve", "recovered: no rule trips any more", "info")
        return out

    def _confirmed(self, policy: Policy, st: ScopeState, tripped: list[Rule], on_candidate: bool,
                   notes: dict[str, str], act: Any) -> list[Rule]:
        """Tripped rollback rules that may roll back now. A ``confirm_with`` rule is only a
        suspicion: one alert asking for a golden replay (``detail.request_replay``); it rolls back
        when a rule of the confirming source trips too, or when it keeps failing
        ``confirm_timeout`` more windows."""
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
                act("alert", f"suspected: {self._why(rule, st)}; {rule.confirm_with} replay requested to confirm "
                    f"before rolling back", rule.severity,
                    detail={"request_replay": True, "rule": rule.name, "source": rule.source,
                            "confirm_with": rule.confirm_with, "confirm_timeout": rule.confirm_timeout,
                            "verdict": self._last(st, rule)})
        return out

    def _inhibit(self, policy: Policy, st: ScopeState, rules: list[Rule], now: float, on_candidate: bool,
                 act: Any) -> tuple[list[Rule], list[tuple[Rule, Any]]]:
        """Split rollback rules into those blamed on the candidate and those an input shift or GPU
        health explains. Only when none is blamed on the candidate: one alert with the cause."""
        if not rules:
            return [], []
        problems = gpu_problems(policy, st, now)
        blame: list[Rule] = []
        inhibited: list[tuple[Rule, Any]] = []
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
            why = "; ".join(self._why(r, st) for r, _ in inhibited)
            act("alert", f"not rolling back to {policy.baseline}: {a.message}: {why}", severity,
                detail={"cause": a.cause, "rule": rule.name, "source": rule.source,
                        "rules": [r.name for r, _ in inhibited], "attribution": _finite(a.to_dict()),
                        "verdicts": [self._last(st, r) for r, _ in inhibited]})
        return blame, inhibited

    @staticmethod
    def _retry(policy: Policy, st: ScopeState, precision: str, now: float) -> bool:
        """Ask again for a flip the flags do not show yet, for up to one cooldown (at least 60 s);
        after that a new flip is needed, which spends budget, so a refused flip cannot loop."""
        return bool(st.pending and st.pending["precision"] == precision
                    and now - float(st.pending["at"]) <= max(policy.cooldown, 60.0))

    @staticmethod
    def _last(st: ScopeState, rule: Rule) -> dict[str, Any] | None:
        last = st.rules[rule.name].last
        return last.to_dict() if last else None

    @staticmethod
    def _why(rule: Rule, st: ScopeState) -> str:
        rs = st.rules[rule.name]
        reason = rs.last.reason if rs.last else ""
        if rs.fails >= rule.for_:
            return f"{rule.name} failed {rs.fails} window(s) in a row: {reason}"
        return f"{rule.name}: source failed {rs.errors} time(s) in a row: {reason}"

    def _arbitrate(self, proposed: list[Action], now: float, flags: Mapping[tuple[str, str], str],
                   default_precision: str) -> list[Action]:
        """Several policies may cover one route: one rollback wins, and a promote happens only
        when every other (non dry-run) policy covering the route is ready and in auto mode."""
        out: list[Action] = []
        rolled: dict[tuple[str, str], Action] = {}
        for a in proposed:
            pair = (a.model, a.route)
            if a.kind == "rollback":
                if pair in rolled:
                    rolled[pair].detail.setdefault("also", []).append({"policy": a.policy, "reason": a.reason})
                    continue
                rolled[pair] = a
            out.append(a)
        final: list[Action] = []
        for a in out:
            pair = (a.model, a.route)
            if pair in rolled and a is not rolled[pair] and (a.kind == "promote" or "blocked" in a.detail):
                continue
            if a.kind == "promote" and not self._all_ready(a, pair):
                continue
            final.append(a)
        for a in final:
            if a.kind in ("rollback", "promote") and not a.detail.get("retry"):
                self._record_flip(a, now)
        return final

    def _all_ready(self, promote: Action, pair: tuple[str, str]) -> bool:
        for policy in self.policy_set.policies:
            if policy.name == promote.policy or policy.dry_run or not policy.scope.covers(*pair):
                continue
            st = self.states.get((policy.name, *pair))
            if policy.promote.mode != "auto" or st is None or not st.promote_ready:
                log.info("promote of %s/%s by %s held back by policy %s", pair[0], pair[1],
                         promote.policy, policy.name)
                return False
        return True

    def _record_flip(self, a: Action, now: float) -> None:
        st = self.states[(a.policy, a.model, a.route)]
        if st.flip_day != _utc_day(now):
            st.flip_day, st.flips_today = _utc_day(now), 0
        st.flips_today += 1
        st.last_flip = now
        st.reset_pools()
        st.serving_since = now
        st.pending = {"kind": a.kind, "precision": a.precision, "at": now}
        st.healthy = 0
        st.promote_ready = False
        st.promote_ready_alerted = False
        st.open_alerts -= {"rollback_blocked", "promote_blocked", "dry_run_rollback"}
        a.detail["flips_today"] = st.flips_today

    # -- status and persistence -----------------------------------------------------------
    def verdicts(self) -> list[dict[str, Any]]:
        """The last verdict of every rule for every (policy, model, route), JSON-able."""
        out: list[dict[str, Any]] = []
        for (pname, model, route), st in sorted(self.states.items()):
            policy = self.policy_set.get(pname)
            for name, rs in st.rules.items():
                rule = policy.rule(name) if policy else None
                out.append({
                    "policy": pname, "model": model, "route": route, "rule": name,
                    "status": rs.last.status if rs.last else "inconclusive",
                    "tripped": bool(rule and rs.tripped(rule)), "consecutive_fails": rs.fails,
                    "consecutive_errors": rs.errors, "verdict": rs.last.to_dict() if rs.last else None,
                })
        return out

    def snapshot(self) -> dict[str, Any]:
        """Policies and per-scope state for /status, JSON-able."""
        scopes = []
        for (pname, model, route), st in sorted(self.states.items()):
            policy = self.policy_set.get(pname)
            statuses = [rs.last.status for rs in st.rules.values() if rs.last]
            tripped = [n for n, rs in st.rules.items() if policy and (r := policy.rule(n)) and rs.tripped(r)]
            overall = ("fail" if tripped else "error" if "error" in statuses else
                       "marginal" if "marginal" in statuses else
                       "pass" if "pass" in statuses else "inconclusive")
            state = st.to_json()
            for r in state["rules"].values():  # sketches and diffs stay out of /status: only their count
                r["pooled"] = len(r.pop("pool"))
                r["learned"] = len(r.pop("null", []))
            scopes.append({"policy": pname, "model": model, "route": route, "status": overall,
                           "tripped": tripped, **state})
        return {
            "policies": [{"name": p.name, "dry_run": p.dry_run, "candidate": p.candidate,
                          "baseline": p.baseline, "rules": [r.name for r in p.rules],
                          "promote": p.promote.mode, "file": self.policy_set.origin.get(p.name)}
                         for p in self.policy_set.policies],
            "digest": self.policy_set.digest,
            "scopes": scopes,
        }

    def export_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION,
                "scopes": [{"policy": p, "model": m, "route": r, "state": st.to_json()}
                           for (p, m, r), st in sorted(self.states.items())]}

    def import_state(self, data: Mapping[str, Any]) -> None:
        """Restore ``export_state`` output; unknown policies and changed rules are dropped."""
        if not data:
            return
        if data.get("version") != STATE_VERSION:
            log.warning("ignoring policy engine state of version %r", data.get("version"))
            return
        self.states = {}
        for item in data.get("scopes", []):
            try:
                st = ScopeState.from_json(item["state"])
                key = (str(item["policy"]), str(item["model"]), str(item["route"]))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("skipping bad policy state entry: %s", exc)
                continue
            self.states[key] = st
        self.set_policy_set(self.policy_set)
