"""A rollback that outlives its policy: the policy was removed, or its scope narrowed past the route,
while the route was on the baseline because of it (docs/POLICIES.md, "Hot reload"). Pure.

Nothing is flipped for it: an edit is no evidence that FP8 is healthy again, and it is no evidence that
FP16 was wrong either. The scope is kept, retired (``ScopeState.retired``, saved like any other), with no
rule: while the route stays on the precision the rollback put it on, one message on the rollback's open
incident says so and who, if anyone, can bring the candidate back (another policy covering the route in
auto mode, else an operator with ``flags set``); when the route leaves that precision (that policy's
promote, an operator), the incident resolves and the scope is forgotten. A policy that covers the route
again takes its rollback back (``PolicyEngine.set_policy_set``).
"""

from __future__ import annotations

from typing import Any

from watchdog.core.signals import ROUTING_KEY, Action
from watchdog.policy.loader import PolicySet
from watchdog.policy.schema import Policy
from watchdog.policy.state import ScopeState

__all__ = ["follow", "retire"]


def retire(policy: Policy | None, removed: bool, st: ScopeState) -> dict[str, Any] | None:
    """The ``ScopeState.retired`` record of a scope whose policy no longer covers its route, when that
    policy's rollback is in force there (landed, or still pending); None otherwise (the scope is then
    forgotten). ``policy`` is the policy as it was (None when unknown: a state restored from Redis after
    its file was deleted while the daemon was down)."""
    to = st.rollback_to
    if to is None and policy is not None and st.last_flip is not None and st.serving == policy.baseline:
        to = policy.baseline  # a state saved before ``rollback_to`` was kept
    if to is None or (st.serving != to and not _rollback_pending(st)):
        return None
    routing = None
    if policy is not None and policy.actions.routed:  # the incident keeps it too; this is for its resolve
        routing = {"notify": list(policy.actions.notify), "page": list(policy.actions.page)}
    return {"why": "removed" if removed else "scope", "precision": to,
            "candidate": policy.candidate if policy is not None else None, "routing": routing, "told": False}


def follow(name: str, st: ScopeState, pair: tuple[str, str], serving: str, now: float, default_precision: str,
           policy_set: PolicySet) -> tuple[list[Action], bool]:
    """What a retired scope of ``name`` says at a window of its route serving ``serving`` (the caller has
    synced ``st`` with the flags): (actions, whether the scope is done and may be forgotten)."""
    r = st.retired
    assert r is not None
    model, route = pair
    precision, candidate = str(r["precision"]), str(r.get("candidate") or default_precision)
    gone = "was removed" if r.get("why") == "removed" else "no longer covers this route"
    detail: dict[str, Any] = {"retired": r.get("why")}
    if r.get("routing"):
        detail[ROUTING_KEY] = r["routing"]
    if serving == precision:
        if r.get("told"):
            return [], False
        r["told"] = True
        return [Action(kind="alert", policy=name, model=model, route=route, severity="warning", at=now,
                       reason=f"policy {name} {gone} while its rollback is in force: the route stays on {precision}; "
                              f"{_who_restores(policy_set, pair, name, candidate)}",
                       detail={**detail, "announce": "retired"})], False  # watchdog.alerting.incidents
    if _rollback_pending(st):
        return [], False  # the rollback has not landed yet (the actuator retries it)
    return [Action(kind="resolve", policy=name, model=model, route=route, severity="info", at=now,
                   reason=f"{serving} restored (policy {name}, whose rollback held the route on {precision}, {gone})",
                   detail=detail)], True


def _rollback_pending(st: ScopeState) -> bool:
    return st.pending is not None and st.pending.get("kind") == "rollback"


def _who_restores(policy_set: PolicySet, pair: tuple[str, str], name: str, candidate: str) -> str:
    covering = [p for p in policy_set.covering(*pair) if p.name != name]
    flipping = [p for p in covering if not p.dry_run]
    if flipping and all(p.promote.mode == "auto" for p in flipping):
        return (f"policy {', '.join(p.name for p in flipping)} covers it and will promote {candidate} back on its "
                "own evidence")
    why = (f"policy {', '.join(p.name for p in covering)} covers it but promotes manually or runs dry" if covering
           else "no policy covers it any more")
    return (f"nothing will promote {candidate} back by itself ({why}): when {candidate} is healthy, restore it by "
            f"hand with `fp8-watchdog flags set {pair[0]} {pair[1]} {candidate}`")
