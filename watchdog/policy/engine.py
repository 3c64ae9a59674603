"""The policy state machine: signals + current flags in, actions out. Pure and deterministic.

State is kept per (policy, model, route): per-rule consecutive fail/error counts, the healthy
window count, flip history (for cooldown, min time in state, daily flip budget), open alert
incidents, and the last window end per source so a replayed window is never counted twice. The
engine keeps that bookkeeping: it groups signals by route, judges every new window once, updates
the streaks and the learned nulls, asks ``watchdog/policy/decide.py`` what each scope proposes,
arbitrates between policies that cover one route and records the flips; the read-only views for
/status are in ``watchdog/policy/status.py``. See docs/POLICIES.md for the behaviour in words.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from typing import Any

from watchdog.core.signals import Action, Signal
from watchdog.policy import retired
from watchdog.policy.causes import gpu_reading
from watchdog.policy.decide import decide, utc_day
from watchdog.policy.evaluate import MAX_AA_NULL, Verdict, combine_window, evaluate_rule, trips_on_error
from watchdog.policy.horizon import learn_anchor
from watchdog.policy.judge.memo import window_memo
from watchdog.policy.loader import PolicySet
from watchdog.policy.pooling import learn_items
from watchdog.policy.schema import MAX_POOL_WINDOWS, Policy, Rule
from watchdog.policy.state import STATE_VERSION, RuleState, ScopeState, rule_fingerprint, same_rule
from watchdog.policy.status import rule_verdicts, status_snapshot

__all__ = ["STATE_VERSION", "PolicyEngine", "RuleState", "ScopeState", "rule_fingerprint"]

log = logging.getLogger(__name__)

ScopeKey = tuple[str, str, str]  # (policy, model, route)


def _seq_memo(rule: Rule, rs: RuleState) -> list[Any] | None:
    """The rule's ``RuleState.seq_memo``, made for a rule with a horizon test on first use (none for
    the other rules: one list per rule and route adds up at 10,000 routes)."""
    memo = rs.seq_memo
    if memo is None and rule.judge is not None and rule.judge.horizon is not None:
        memo = rs.seq_memo = []
    return memo


def _histories(rule: Rule, rs: RuleState) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """The rule's pool and learned null for ``evaluate_rule``: none for a ``fail_if`` rule, which
    reads neither (``RuleState.pool``)."""
    if rule.judge is None:
        return None, None
    return rs.pool_list(), rs.null_list()


#: a sequential test whose last look reached this share of its rejection threshold (log 1/alpha) puts
#: its route first among the windows to judge. In 120 windows of 400 thin routes of bench/growth.py's
#: traffic (2 events a window) every horizon rollback came after a look at 0.47 or more, and 2 % of
#: the routes were at 0.3 or more at a time
NEAR_REJECT_SHARE = 0.3

def _learn(rule: Rule, rs: RuleState, v: Verdict) -> None:
    """A passing window or replay feeds the rule's learned null (bounded): the window's FP8 -
    FP16 difference or the replay's per-item levels (``judge.learn``)."""
    j = rule.judge
    jd = v.judgement
    if j is None or jd is None:
        return
    detail = jd.get("detail") or {}
    if j.learn is not None and isinstance(detail.get("window_estimate"), list):
        est = detail["window_estimate"]
        entry = {"end": v.end, "e": float(est[0]), "v": float(est[1])}
        if isinstance(detail.get("window_baseline"), float):
            entry["base"] = detail["window_baseline"]  # FP16's own statistic (pooling.baseline_moved)
        null = rs.null_list()
        null.append(entry)
        del null[:-j.learn]
        if v.status == "pass":  # the long-term anchor moves with passing windows only
            learn_anchor(rule, rs.horizon, null, float(est[0]))
        return
    if j.test == "paired" and j.learn is not None and rs.pool and rs.pool[-1].get("end") == v.end:
        learn_items(rs.null_list(), rs.pool[-1], j.learn)


def _learn_aa(rule: Rule, rs: RuleState, v: Verdict) -> None:
    """Every judged replay with an A/A pass adds its count to the broken-items null (whatever
    the verdict: FP16 against FP16 says nothing about FP8); a passing one also adds its level-
    adjusted broken count (the change test's null). The last ``MAX_AA_NULL`` of each are kept."""
    j = rule.judge
    bt = ((v.judgement or {}).get("detail") or {}).get("broken_test")
    if j is None or j.broken is None or not isinstance(bt, dict):
        return
    aa = bt.get("aa")
    if isinstance(aa, list) and len(aa) == 2:
        _append_bounded(rs.null_list(), "aa", {"end": v.end, "aa": float(aa[0]), "n": int(aa[1])})
    change = bt.get("change")
    if v.status == "pass" and isinstance(change, dict) and isinstance(change.get("count"), int):
        _append_bounded(rs.null_list(), "broken", {"end": v.end, "broken": change["count"], "n": int(bt.get("n") or 0)})


def _append_bounded(null: list[dict[str, Any]], key: str, entry: dict[str, Any]) -> None:
    counts = [x for x in null if key in x][-(MAX_AA_NULL - 1):] + [entry]
    null[:] = [x for x in null if key not in x] + counts


#: the reasons of the rules' last verdicts, one string object per text: at 10,000 thin routes most of the
#: 110,000 verdicts kept say one of a few dozen things ("too few candidate samples: 1 < min_samples 200"),
#: each formatted anew (~94 bytes apiece, ~10 MB); bounded, since a judged window's reason quotes its values
_REASONS: dict[str, str] = {}
_MAX_REASONS = 4096


def _shared_reason(reason: str) -> str:
    shared = _REASONS.get(reason)
    if shared is None:
        if len(_REASONS) >= _MAX_REASONS:
            _REASONS.clear()
        _REASONS[reason] = shared = reason
    return shared


class PolicyEngine:
    """Evaluate policies over signals and decide rollbacks, promotes and alerts.

    Call ``observe`` once per closed window (or golden/GPU report) with every signal of that
    window: candidate and baseline signals of one window must arrive in the same call.
    """

    def __init__(self, policy_set: PolicySet | None = None) -> None:
        self.policy_set = policy_set or PolicySet()
        self.states: dict[ScopeKey, ScopeState] = {}
        #: (model, route) -> names of the policies with a retired scope there (``set_policy_set``)
        self._retired: dict[tuple[str, str], set[str]] = {}

    # -- policies -------------------------------------------------------------------------
    def set_policy_set(self, policy_set: PolicySet) -> None:
        """Swap policies (hot reload). State of unchanged rules is kept; flip history of a
        policy that still exists under the same name is kept; removed policies are forgotten,
        and so is a policy's state of a route its scope no longer covers, except where its rollback
        is in force: that scope is kept, retired (``ScopeState.retired``), until the route leaves the
        precision the rollback put it on. A rule added or changed, or ``promote.healthy_sources`` changed,
        restarts the scope's healthy count: the windows counted so far were not judged or counted so."""
        old, self.policy_set = self.policy_set, policy_set
        self._retired = {}
        for key in list(self.states):
            name, model, route = key
            st = self.states[key]
            policy = policy_set.get(name)
            if policy is None or not policy.scope.covers(model, route):
                if st.retired is None:
                    st.retired = retired.retire(old.get(name) or policy, policy is None, st)
                if st.retired is None:
                    del self.states[key]
                    continue
                st.rules.clear()  # no rule of it judges this route any more
                self._retired.setdefault((model, route), set()).add(name)
                continue
            st.retired = None  # the policy covers the route (again): its rollback is its own again
            for rname in list(st.rules):
                rule = policy.rule(rname)
                if rule is None or not same_rule(rule, st.rules[rname].fingerprint):
                    del st.rules[rname]
                else:
                    st.rules[rname].fingerprint = rule_fingerprint(rule)  # saved in today's form from now on
            prev = old.get(name)
            if any(r.name not in st.rules for r in policy.rules) or (
                    prev is not None and prev.promote.healthy_sources != policy.promote.healthy_sources):
                st.healthy = 0

    @property
    def retired_policies(self) -> set[str]:
        """Names of the policies that hold a retired scope (their state is saved like any other)."""
        return {name for names in self._retired.values() for name in names}

    def judging_rank(self, model: str, route: str) -> int:
        """Where a closed window of (model, route) waits among the windows to judge (the daemon's
        ``Backlog``): 0 when the route's state says a rollback may be near - it does not serve the
        policy's baseline, and a rule's fail or error streak is under way or a sequential test's last
        look reached ``NEAR_REJECT_SHARE`` of its rejection threshold - 1 for another route a policy
        holds state for, 2 for a new route. The
        order changes no decision (a route's state is its own); it decides whose flip waits behind
        10,000 routes' judging."""
        return self._nearness(model, route, False)[0]

    def nearness(self, model: str, route: str) -> float | None:
        """For a route of ``judging_rank`` 0, how near a rollback its state says it is (the daemon closes
        and judges such routes' windows nearest first): 1 + the longest streak's share of its trip for a
        rule's fail or error streak under way, else the highest share of a sequential test's rejection
        threshold its last look reached; None for a route of another rank. Only an order."""
        rank, near = self._nearness(model, route, True)
        return near if rank == 0 else None

    def _nearness(self, model: str, route: str, most: bool) -> tuple[int, float]:
        """(``judging_rank``, the nearness of a rank 0 route): the first reason for rank 0 found, or with
        ``most`` the nearest over every rule."""
        states = self.states
        rank, nearest = 2, -math.inf
        for p in self.policy_set.policies:
            st = states.get((p.name, model, route))
            if st is None:
                continue
            rank = min(rank, 1)
            if st.serving == p.baseline:
                continue  # rolled back already: what is left to come is a promote, hours away
            for rule in p.rules:
                rs = st.rules.get(rule.name)
                if rs is None:
                    continue
                if rs.fails or rs.errors:
                    if not most:
                        return 0, nearest
                    trips = rule.errors_trip_after
                    streak = rs.fails / rule.for_ if rs.fails else rs.errors / trips if trips else 0.0
                    rank, nearest = 0, max(nearest, 1.0 + streak)
                    continue
                last = rs.last
                horizon = rule.judge.horizon if rule.judge is not None else None
                if horizon is not None and last is not None:
                    log_lr, reject = last.extra.get("horizon_log_lr", -math.inf), math.log(1.0 / horizon.alpha)
                    if log_lr >= NEAR_REJECT_SHARE * reject:
                        if not most:
                            return 0, nearest
                        rank, nearest = 0, max(nearest, log_lr / reject)
        return rank, nearest

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
        """Judge ``signals`` and return the actions. Live windows of several ends (the daemon catching up
        a backlog) are decided one end at a time, as one window per pass and the backtest decide: a rule
        that trips at one end flips there, even when it passes again at the next. A route flipped at one
        end is judged at the later ends but decided again only at the next call, once the flags show
        the flip. Other sources (golden, GPU) go with the latest end."""
        ends = sorted({s.end for s in signals if s.source == "live"})
        if len(ends) <= 1:
            return self._observe(signals, now, flags, default_precision, frozenset())
        by_end: dict[float, list[Signal]] = {end: [] for end in ends}
        for s in signals:
            by_end[s.end if s.source == "live" else ends[-1]].append(s)
        out: list[Action] = []
        flipped: set[tuple[str, str]] = set()
        for end in ends:
            acts = self._observe(by_end[end], now, flags, default_precision, frozenset(flipped))
            flipped |= {(a.model, a.route) for a in acts if a.kind in ("rollback", "promote") and not a.dry_run}
            out += acts
        return out

    def _observe(self, signals: list[Signal], now: float, flags: Mapping[tuple[str, str], str],
                 default_precision: str, flipped: frozenset[tuple[str, str]]) -> list[Action]:
        by_pair = self._group(signals, flags)
        proposed: list[Action] = []
        for policy in self.policy_set.policies:
            for (model, route), sigs in by_pair.items():
                if not policy.scope.covers(model, route):
                    continue
                st = self._state(policy, model, route)
                serving = flags.get((model, route), default_precision)
                was = st.serving
                if was is None and serving == policy.baseline and st.serving_since is None:
                    st.serving_since = now  # first seen on the baseline: promote.after counts from here
                changed = self._sync_serving(st, serving, now)
                if changed:
                    st.changed_at = self._flipped_at(model, route, serving, now)
                if changed and serving == policy.candidate and was == policy.baseline \
                        and (st.last_flip is not None or st.promote_ready_alerted):
                    # an operator put the candidate back after our rollback (``flags set``): the
                    # rollback's incident (or the "promote manually" one) ends here, not never
                    proposed.append(Action(kind="resolve", policy=policy.name, model=model, route=route,
                                           reason=f"{serving} restored outside the watchdog (flags)",
                                           severity="info", at=now))
                at = self._process_windows(policy, st, sigs)
                if at is None or (model, route) in flipped:
                    continue
                proposed += decide(policy, st, model, route, serving, now, at)
        if self._retired:
            for pair in by_pair:
                if pair in self._retired:
                    proposed += self._follow_retired(pair, flags.get(pair, default_precision), now, default_precision)
        return self._arbitrate(proposed, now, flags, default_precision)

    def _flipped_at(self, model: str, route: str, precision: str, now: float) -> float:
        """When a policy of this engine flipped the route to ``precision`` (the change a scope has just
        seen may be that flip, made up to a window ago, or a rollback it was arbitrated into); else
        ``now``: someone else changed it, at the latest now."""
        names = set(self.policy_set.names) | self._retired.get((model, route), set())
        at = [o.last_flip for o in (self.states.get((n, model, route)) for n in names)
              if o is not None and o.last_flip is not None and o.last_flip == o.changed_at and o.last_flip <= now
              and (o.pending["precision"] if o.pending else o.serving) == precision]
        return max(at, default=now)

    def _follow_retired(self, pair: tuple[str, str], serving: str, now: float, default_precision: str) -> list[Action]:
        """The retired scopes of one route (``watchdog/policy/retired.py``): never a flip; one notice while
        the route stays on the precision their rollback put it on, a resolve when it leaves it."""
        out: list[Action] = []
        names = self._retired[pair]
        for name in sorted(names):
            st = self.states.get((name, *pair))
            if st is None or st.retired is None:
                names.discard(name)
                continue
            self._sync_serving(st, serving, now)
            acts, done = retired.follow(name, st, pair, serving, now, default_precision, self.policy_set)
            out += acts
            if done:
                del self.states[(name, *pair)]
                names.discard(name)
        if not names:
            del self._retired[pair]
        return out

    def _group(self, signals: list[Signal], flags: Mapping[tuple[str, str], str]) -> dict[tuple[str, str], list[Signal]]:
        """Signals by (model, route); a ``*`` model or route (e.g. GPU health) applies to every
        known pair that matches (known = in flags, in these signals, or seen before)."""
        known: set[tuple[str, str]] | None = None  # built only for a "*" signal: it is every route's
        out: dict[tuple[str, str], list[Signal]] = {}
        for s in signals:
            if s.model == "*" or s.route == "*":
                if known is None:
                    known = set(flags) | {(x.model, x.route) for x in signals if "*" not in (x.model, x.route)}
                    known |= {(m, r) for (_, m, r) in self.states}
                for m, r in sorted(known):
                    if s.model in ("*", m) and s.route in ("*", r):
                        out.setdefault((m, r), []).append(s)
            else:
                out.setdefault((s.model, s.route), []).append(s)
        return out

    @staticmethod
    def _sync_serving(st: ScopeState, serving: str, now: float) -> bool:
        """Follow the flags; True when someone else changed the precision served."""
        changed = False
        if st.pending and st.pending["precision"] == serving:
            st.pending = None  # our flip is now visible in the flags
        elif serving != st.serving and st.serving is not None:
            st.serving_since = st.changed_at = now  # changed by someone else (at the latest now)
            st.pending = None
            st.rollback_to = None  # whatever our rollback did, the route is where someone else put it
            st.healthy = 0  # healthy windows count on the precision served now (as after our own flip)
            st.reset_pools()
            changed = True
        st.serving = serving
        return changed

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
            rules = st.rules
            with window_memo():  # the rules of this window share what they read alike
                judged = [(rule, evaluate_rule(rule, cand, base, *_histories(rule, rs), rs.horizon, _seq_memo(rule, rs)))
                          for rule in policy.rules if rule.source == source for rs in (rules[rule.name],)]
            combine_window(policy, judged)
            window = [self._apply(rule, st, v) for rule, v in judged]
            self._count_healthy(policy, st, source, start, window)
            st.last_end[source] = max(st.last_end.get(source, -math.inf), end)
            latest = end if latest is None else max(latest, end)
        return latest

    @staticmethod
    def _apply(rule: Rule, st: ScopeState, v: Verdict) -> Verdict:
        rs = st.rules[rule.name]
        _learn_aa(rule, rs, v)
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
        elif v.status == "error" and trips_on_error(v):
            rs.errors += 1
        v.reason = _shared_reason(v.reason)
        rs.last = v
        rs.judged += 1
        return v

    @staticmethod
    def _count_healthy(policy: Policy, st: ScopeState, source: str, start: float, window: list[Verdict]) -> None:
        """Restore hysteresis: a fail or error of any source resets the count; in a window of
        ``promote.healthy_sources`` (default: all) a marginal verdict or a false ``restore_if``
        resets it too, and a clean window counts up if it began after the route's last change of
        precision: one judged after a flip but begun before it (the allowed lateness, a backlog) holds
        traffic served before the flip, no evidence for the precision served now."""
        counted = policy.promote.healthy_sources is None or source in policy.promote.healthy_sources
        bad = any(v.status in ("fail", "error") for v in window)
        if bad or (counted and any(v.status == "marginal" or v.restore is False for v in window)):
            st.healthy = 0
        elif counted and (st.changed_at is None or start >= st.changed_at) \
                and any(v.status == "pass" for v in window) and all(
            st.rules[r.name].fails == 0 and st.rules[r.name].errors == 0 for r in policy.rules
        ):
            st.healthy += 1

    # -- arbitration between policies ------------------------------------------------------
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
        promotes: dict[tuple[str, str], list[Action]] = {}
        for a in out:
            pair = (a.model, a.route)
            if pair in rolled and a is not rolled[pair] and (a.kind == "promote" or "blocked" in a.detail):
                continue
            if a.kind == "promote":
                if not self._all_ready(a, pair):
                    continue
                promotes.setdefault(pair, []).append(a)
            final.append(a)
        for pair, acts in promotes.items():
            if len(acts) > 1:  # one promote per route, by the policy whose rollback it undoes if one is
                keep = next((a for a in acts if self.states[(a.policy, *pair)].rollback_to is not None), acts[0])
                dropped = {id(a) for a in acts if a is not keep}
                keep.detail.setdefault("also", []).extend({"policy": a.policy, "reason": a.reason}
                                                          for a in acts if id(a) in dropped)
                final = [a for a in final if id(a) not in dropped]
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
        if st.flip_day != utc_day(now):
            st.flip_day, st.flips_today = utc_day(now), 0
        st.flips_today += 1
        st.last_flip = now
        st.reset_pools()
        st.serving_since = st.changed_at = now
        st.pending = {"kind": a.kind, "precision": a.precision, "at": now}
        st.healthy = 0
        st.promote_ready = False
        st.promote_ready_alerted = False
        st.open_alerts -= {"rollback_blocked", "promote_blocked", "dry_run_rollback"}
        st.rollback_to = a.precision if a.kind == "rollback" else None
        a.detail["flips_today"] = st.flips_today

    # -- status and persistence -----------------------------------------------------------
    def verdicts(self) -> list[dict[str, Any]]:
        """The last verdict of every rule for every (policy, model, route), JSON-able."""
        return rule_verdicts(self.policy_set, self.states)

    def snapshot(self, routes: Collection[tuple[str, str]] | None = None) -> dict[str, Any]:
        """Policies and per-scope state for /status, JSON-able (only the scopes of ``routes`` if given)."""
        if routes is None:
            return status_snapshot(self.policy_set, self.states)
        wanted = set(routes)
        return status_snapshot(self.policy_set, {k: st for k, st in list(self.states.items())
                                                 if (k[1], k[2]) in wanted})

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

    # -- queries for the runtime
    def route_policies(self) -> dict[tuple[str, str], Policy | None]:
        """Every (model, route) some policy holds state for, with the first such policy (in state order)."""
        get = self.policy_set.get
        out: dict[tuple[str, str], Policy | None] = {}
        for (p, m, r) in self.states:
            if (m, r) not in out:
                out[(m, r)] = get(p)
        return out

    def scopes_of(self, route: tuple[str, str]) -> dict[str, ScopeState]:
        """The state of each policy for one (model, route), by policy name."""
        return {p: st for (p, m, r), st in self.states.items() if (m, r) == route}

    def policy_of(self, route: tuple[str, str]) -> Policy | None:
        """The first policy (in state order) holding state for (model, route); None if none does."""
        name = next((p for (p, m, r) in self.states if (m, r) == route), None)
        return self.policy_set.get(name) if name is not None else None

    def flipped_routes(self, default_precision: str) -> dict[tuple[str, str], str]:
        """Routes a policy flip moved off ``default_precision``, with the precision they serve now."""
        out: dict[tuple[str, str], str] = {}
        for (_p, m, r), st in self.states.items():
            if st.last_flip is not None and st.serving not in (None, default_precision):
                out[(m, r)] = str(st.serving)
        return out
