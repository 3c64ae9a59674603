"""The policy engine's state as operators read it: pure views, JSON-able, nothing changed.

``rule_verdicts`` lists the last verdict of every rule per (policy, model, route) with its
streaks and whether it trips; ``status_snapshot`` is the ``/status`` view: the loaded policies
(names, candidate and baseline, rules, promote mode, source file), the policy set's digest, and
per scope an overall status, the tripped rules and the scope state, with the pooled sketches and
learned nulls reduced to their counts so the page stays small. ``PolicyEngine.verdicts`` and
``PolicyEngine.snapshot`` (``watchdog/policy/engine.py``) return these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from watchdog.policy.loader import PolicySet
from watchdog.policy.state import ScopeState

__all__ = ["rule_verdicts", "status_snapshot"]


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
        for r in state["rules"].values():  # sketches and diffs stay out of /status: only their count
            r["pooled"] = len(r.pop("pool"))
            r["learned"] = len(r.pop("null", []))
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
