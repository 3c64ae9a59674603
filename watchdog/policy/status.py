"""The policy engine's state as operators read it: pure views, JSON-able, nothing changed.

``rule_verdicts`` lists the last verdict of every rule per (policy, model, route) with its
streaks and whether it trips; ``status_snapshot`` is the ``/status`` view: the loaded policies
(names, candidate and baseline, rules, promote mode, source file), the policy set's digest, and
per scope an overall status, the tripped rules and the scope state, with the pooled sketches and
learned nulls reduced to their counts so the page stays small, and per rule whether it is judged
at the route's traffic and its minimum detectable effect (``rules.<name>.judgeability``,
watchdog/policy/horizon.py); ``judgeability_rows`` flattens that for the metrics. ``PolicyEngine.verdicts`` and
``PolicyEngine.snapshot`` (``watchdog/policy/engine.py``) return these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from watchdog.policy.horizon import judgeability
from watchdog.policy.loader import PolicySet
from watchdog.policy.schema import Rule
from watchdog.policy.state import ScopeState

__all__ = ["judgeability_rows", "rule_verdicts", "state_judgeability_rows", "status_snapshot"]


def rule_verdicts(policy_set: PolicySet, states: Mapping[tuple[str, str, str], ScopeState]) -> list[dict[str, Any]]:
    """The last verdict of every rule for every (policy, model, route), JSON-able."""
    out: list[dict[str, Any]] = []
    for (pname, model, route), st in sorted(states.items()):
        policy = policy_set.get(pname)
        for name, rs in st.rules.items():
            rule = policy.rule(name) if policy else None
            out.append({
                "policy": pname, "model": model, "route": route, "rule": name,
                "status": rs.last.status if rs.last else "inconclusive",
                "tripped": bool(rule and rs.tripped(rule)), "consecutive_fails": rs.fails,
                "consecutive_errors": rs.errors, "verdict": rs.last.to_dict() if rs.last else None,
            })
    return out


def status_snapshot(policy_set: PolicySet, states: Mapping[tuple[str, str, str], ScopeState]) -> dict[str, Any]:
    """Policies and per-scope state for /status, JSON-able."""
    scopes = []
    for (pname, model, route), st in sorted(states.items()):
        policy = policy_set.get(pname)
        statuses = [rs.last.status for rs in st.rules.values() if rs.last]
        tripped = [n for n, rs in st.rules.items() if policy and (r := policy.rule(n)) and rs.tripped(r)]
        overall = ("fail" if tripped else "error" if "error" in statuses else
                   "marginal" if "marginal" in statuses else
                   "pass" if "pass" in statuses else "inconclusive")
        state = st.to_json()
        for name, r in state["rules"].items():  # sketches and diffs stay out of /status: only their count
            r["pooled"] = len(r.pop("pool"))
            r["learned"] = len(r.pop("null", []))
            horizon = r.pop("horizon", {}) or {}
            rule = policy.rule(name) if policy else None
            if rule is not None:
                r["judgeability"] = judgeability(rule, st.rules[name].last, horizon)
            if horizon.get("anchor"):
                r["anchor"] = horizon["anchor"].get("level")
        scopes.append({"policy": pname, "model": model, "route": route, "status": overall,
                       "tripped": tripped, **state})
    return {
        "policies": [{"name": p.name, "dry_run": p.dry_run, "candidate": p.candidate,
                      "baseline": p.baseline, "rules": [r.name for r in p.rules],
                      "promote": p.promote.mode, "file": policy_set.origin.get(p.name)}
                     for p in policy_set.policies],
        "digest": policy_set.digest,
        "scopes": scopes,
    }


def judgeability_rows(snapshot: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per (policy, model, route, rule) of a ``status_snapshot``: ``judged`` (1 when the
    rule is judged now, per window or over its horizon; 0 when it cannot be: too little traffic
    and no horizon test, or no data) and ``mde`` / ``horizon_mde`` (harm units at 80 % power;
    None when unknown): what the ``llmwd_rule_judged`` and ``llmwd_rule_mde`` gauges show."""
    rows = []
    for sc in snapshot.get("scopes", []):
        for name, r in (sc.get("rules") or {}).items():
            jb = r.get("judgeability")
            if not jb:
                continue
            rows.append({"policy": sc["policy"], "model": sc["model"], "route": sc["route"], "rule": name,
                         "metric": (r.get("last") or {}).get("metric"),
                         "judged": 1 if jb["judged"] in ("window", "horizon") else 0, "how": jb["judged"],
                         "mde": jb.get("mde"), "horizon_mde": jb.get("horizon_mde"), "kind": jb.get("kind"),
                         "why": jb.get("why")})
    return rows


def state_judgeability_rows(policy_set: PolicySet,
                            states: Mapping[tuple[str, str, str], ScopeState]) -> list[dict[str, Any]]:
    """``judgeability_rows(status_snapshot(policy_set, states))`` without building the snapshot (no
    state is serialised): what the daemon exports every few seconds over every route it holds."""
    rows = []
    # each policy's rules by name, looked up once per call rather than per (scope, rule)
    rules: dict[str, dict[str, Rule] | None] = {}
    for (pname, model, route), st in sorted(list(states.items()), key=lambda kv: kv[0]):
        if pname not in rules:
            policy = policy_set.get(pname)
            found: dict[str, Rule] | None = None
            if policy is not None:
                found = {}
                for r in policy.rules:
                    found.setdefault(r.name, r)  # the first of a name, as Policy.rule
            rules[pname] = found
        by_name = rules[pname]
        if by_name is None:
            continue
        for name, rs in st.rules.items():
            rule = by_name.get(name)
            if rule is None:
                continue
            jb = judgeability(rule, rs.last, rs.horizon)  # read only
            if not jb:
                continue
            rows.append({"policy": pname, "model": model, "route": route, "rule": name,
                         "metric": rs.last.metric if rs.last is not None else None,
                         "judged": 1 if jb["judged"] in ("window", "horizon") else 0, "how": jb["judged"],
                         "mde": jb.get("mde"), "horizon_mde": jb.get("horizon_mde"), "kind": jb.get("kind"),
                         "why": jb.get("why")})
    return rows
