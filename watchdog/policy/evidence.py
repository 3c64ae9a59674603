"""The evidence record of one decision (rollback, promote, alert): pure, no I/O.

What the policy engine saw when it decided, as one JSON-able dict (schema ``EVIDENCE_SCHEMA``,
docs/EVIDENCE.md): the rules that made the decision with their statistic, interval and threshold,
the judged windows of each rule before (and, filled in later, after) the decision with the
candidate (FP8) and baseline (FP16) values side by side, the learned null's level, the golden
items that regressed with the outputs side by side where the golden signal carried them, the
route's GPU reading, and what would undo the decision and when. ``watchdog/runtime/evidence.py``
collects the inputs on the daemon's loop and writes the record; ``bounded_json`` keeps it within
``evidence.max_bytes``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

from watchdog.core.signals import Action
from watchdog.policy.backtest_stats import condition_threshold
from watchdog.policy.evaluate import Verdict
from watchdog.policy.schema import Policy, Rule
from watchdog.policy.state import RuleState, ScopeState

__all__ = ["EVIDENCE_SCHEMA", "KINDS", "annotate", "bounded_json", "build_record", "evidence_id", "summary_of",
           "verdict_entry"]

EVIDENCE_SCHEMA = 1
#: decisions that get an evidence record (a resolve has none: it closes an incident)
KINDS = ("rollback", "promote", "alert")
#: characters of one golden text kept in a record (the page shows them side by side)
TEXT_CHARS = 600
#: golden items kept in a record, worst first
MAX_ITEMS = 12


def evidence_id(action: Action) -> str:
    """A stable id: ``<UTC time>-<kind>-<hash of model, route, policy, kind and time>``; the same
    decision re-made from a replayed window gets the same id (its record is overwritten)."""
    at = action.at or time.time()
    digest = hashlib.sha1(f"{action.kind}\0{action.model}\0{action.route}\0{action.policy}\0{at:.3f}".encode(),
                          usedforsecurity=False).hexdigest()[:10]
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(at))}-{action.kind}-{digest}"


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def verdict_entry(v: Verdict) -> dict[str, Any]:
    """One judged window of one rule, compact: times, status, both sides' values and samples, the
    judge's estimate with its interval and threshold (None for a plain ``fail_if`` rule)."""
    j = v.judgement or {}
    detail = j.get("detail") or {}
    bt = detail.get("broken_test") if isinstance(detail.get("broken_test"), dict) else None
    out: dict[str, Any] = {
        "start": v.start, "end": v.end, "status": v.status, "candidate": _num(v.candidate),
        "baseline": _num(v.baseline), "samples": v.samples, "baseline_samples": v.baseline_samples,
        "estimate": _num(j.get("estimate")), "ci_low": _num(j.get("ci_low")), "ci_high": _num(j.get("ci_high")),
        "threshold": _num(j.get("effect_threshold")), "p_value": _num(j.get("p_value")),
        "reason": v.reason[:400],
    }
    extra = {k: x for k, x in v.extra.items() if _num(x) is not None}
    if extra:
        out["extra"] = extra
    if bt is not None:
        out["broken"] = bt.get("count")
        out["broken_n"] = bt.get("n")
    elif isinstance(detail.get("broken_count"), int):
        out["broken"] = detail["broken_count"]
    return out


_SIMPLE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|<|>)\s*(-?[0-9.]+(?:[eE][-+]?[0-9]+)?)\s*$")


def annotate(rule: Rule | None, entry: dict[str, Any]) -> dict[str, Any]:
    """Add to a window ``entry`` what a chart of it needs: ``line``, the value of the plotted
    statistic where ``fail_if`` turns (the candidate's, given the window's baseline; or the
    threshold of a one-statistic condition such as ``paired_mean < -0.25``), and ``stat``, the name
    of that statistic (``candidate`` or e.g. ``paired_mean``)."""
    if rule is None or rule.judge is not None or not rule.fail_if:
        return entry
    try:
        line = condition_threshold(rule, entry.get("candidate"), entry.get("baseline"))
    except (ValueError, ArithmeticError):
        line = None
    if line is not None:
        entry["stat"], entry["line"] = "candidate", line
        return entry
    m = _SIMPLE.match(rule.fail_if)
    if m and m.group(1) not in ("candidate", "baseline", "value"):
        entry["stat"], entry["line"] = m.group(1), float(m.group(3))
    return entry


def _null_level(rs: RuleState) -> dict[str, Any] | None:
    """The learned null's level: what healthy FP8 - FP16 differences look like (``judge.learn``),
    or the broken-items null of A/A replays."""
    es = [float(x["e"]) for x in rs.null if isinstance(x.get("e"), int | float)]
    out: dict[str, Any] = {}
    if es:
        out.update({"windows": len(es), "mean": statistics.fmean(es),
                    "sd": statistics.stdev(es) if len(es) > 1 else None, "recent": es[-24:]})
    aa = [x for x in rs.null if "aa" in x]
    if aa:
        out["aa_broken"] = sum(float(x["aa"]) for x in aa)
        out["aa_items"] = sum(int(x.get("n", 0)) for x in aa)
    broken = [x for x in rs.null if "broken" in x]
    if broken:
        out["healthy_broken"] = sum(float(x["broken"]) for x in broken)
        out["healthy_items"] = sum(int(x.get("n", 0)) for x in broken)
    anchor = rs.horizon.get("anchor") if isinstance(rs.horizon, dict) else None
    if isinstance(anchor, dict):
        out["anchor"] = {k: v for k, v in anchor.items() if isinstance(v, int | float | str)}
    return out or None


def _rule_names(action: Action) -> list[str]:
    d = action.detail or {}
    names = d.get("rules")
    if isinstance(names, list) and names:
        return [str(n) for n in names]
    return [str(d["rule"])] if d.get("rule") else []


def _judgement_of(action: Action, rule: str, st: ScopeState | None) -> dict[str, Any] | None:
    """The verdict (``Verdict.to_dict``) the action carries for ``rule``, else the rule's last."""
    d = action.detail or {}
    for v in [*(d.get("verdicts") or []), d.get("verdict")]:
        if isinstance(v, dict) and v.get("rule") == rule:
            return v
    rs = st.rules.get(rule) if st is not None else None
    return rs.last.to_dict() if rs is not None and rs.last is not None else None


def _broken_items(verdict: Mapping[str, Any] | None, outputs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The golden items that regressed, worst first: the judge's ranking (``broken`` of a
    broken-items test) joined with the outputs the golden signal carried; without a ranking, the
    replay's own (its regressions on the primary metric, worst first)."""
    j = (verdict or {}).get("judgement") or {}
    detail = j.get("detail") or {}
    ranked = detail.get("broken")
    if not isinstance(ranked, list):
        bt = detail.get("broken_test")
        ranked = bt.get("items") if isinstance(bt, dict) else None
    by_id = {str(o.get("id")): o for o in outputs or [] if isinstance(o, dict)}
    items: list[dict[str, Any]] = []
    if isinstance(ranked, list) and ranked:
        for r in ranked[:MAX_ITEMS]:
            if not isinstance(r, dict):
                continue
            item_id = str(r.get("item"))
            item: dict[str, Any] = {"id": item_id, "harm": _num(r.get("harm"))}
            item.update({k: v for k, v in by_id.get(item_id, {}).items() if k not in item or item[k] is None})
            items.append(item)
        return items
    return [dict(o) for o in (outputs or [])[:MAX_ITEMS] if isinstance(o, dict)]


def _promote_back(policy: Policy, st: ScopeState | None, action: Action) -> dict[str, Any]:
    """What would undo this decision, and the earliest time it could."""
    p = policy.promote
    restore = {r.name: r.restore_if for r in policy.rules if r.restore_if}
    if action.kind == "rollback":
        last = (st.last_flip if st is not None and st.last_flip is not None else action.at) or action.at
        least = policy.min_time_in_state.baseline
        earliest = last + max(p.after if p.mode == "auto" else 0.0, policy.cooldown, least)
        if p.mode == "auto":
            text = (f"promote back to {policy.candidate} automatically after {p.healthy_windows} consecutive healthy "
                    f"windows" + (f" of {', '.join(p.healthy_sources)}" if p.healthy_sources else "")
                    + f" and not before {_utc(earliest)} (promote.after {p.after:g} s, cooldown {policy.cooldown:g} s,"
                    f" min_time_in_state {least:g} s)")
        else:
            text = (f"promote manually (promote.mode: manual): after {p.healthy_windows} consecutive healthy windows "
                    f"the watchdog says the route is ready; `fp8-watchdog flags set MODEL ROUTE {policy.candidate}`")
        if restore:
            text += "; a window counts as healthy only when " + "; ".join(f"{k}: {v}" for k, v in restore.items())
        return {"text": text, "mode": p.mode, "healthy_windows": p.healthy_windows,
                "healthy_now": st.healthy if st is not None else None, "earliest": earliest, "restore_if": restore}
    if action.kind == "promote":
        rules = [f"{r.name} ({r.fail_if or r.metric})" for r in policy.rules if r.action == "rollback"]
        return {"text": f"rolled back to {policy.baseline} again when a rollback rule trips: {', '.join(rules)}; "
                        f"not before cooldown {policy.cooldown:g} s", "mode": p.mode, "earliest": None,
                "restore_if": restore}
    return {"text": "an alert changes no flag: nothing to undo; it resolves when no rule trips any more",
            "mode": p.mode, "earliest": None, "restore_if": restore}


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def build_record(action: Action, eid: str, policy: Policy | None, st: ScopeState | None,
                 windows: Mapping[str, Iterable[dict[str, Any]]], outputs: list[dict[str, Any]] | None,
                 gpu: Mapping[str, Any] | None, instance: str, serving: str | None,
                 missing: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The evidence record of ``action`` (its ``after`` windows empty: they come later).

    ``windows``: rule name -> the rule's judged windows up to now (``verdict_entry``), oldest
    first; ``missing``: rule name -> how many of the windows before it should show were not kept
    (the recorder cut that route's history, or the daemon restarted); ``outputs``: the latest golden replay's regressed items with their texts; ``gpu``: the
    route's latest GPU reading; ``serving``: the precision the flags showed before the action."""
    names = _rule_names(action)
    rules: list[dict[str, Any]] = []
    for rule in policy.rules if policy is not None else []:
        rs = st.rules.get(rule.name) if st is not None else None
        involved = rule.name in names
        v = _judgement_of(action, rule.name, st) if involved else (
            rs.last.to_dict() if rs is not None and rs.last is not None else None)
        j = (v or {}).get("judgement") or {}
        entry: dict[str, Any] = {
            "name": rule.name, "involved": involved, "source": rule.source, "metric": rule.metric,
            "description": rule.description, "fail_if": rule.fail_if, "restore_if": rule.restore_if,
            "for": rule.for_, "min_samples": rule.min_samples, "action": rule.action, "severity": rule.severity,
            "judge": None if rule.judge is None else {"test": rule.judge.test,
                                                       "direction": rule.judge.harm_direction,
                                                       "effect": rule.judge.effect},
            "status": (v or {}).get("status"), "reason": str((v or {}).get("reason") or "")[:600],
            "statistic": {"method": j.get("method"), "estimate": _num(j.get("estimate")),
                          "ci_low": _num(j.get("ci_low")), "ci_high": _num(j.get("ci_high")),
                          "threshold": _num(j.get("effect_threshold")), "p_value": _num(j.get("p_value")),
                          "n": j.get("n"), "message": str(j.get("message") or "")[:600]} if j else None,
            "candidate": _num((v or {}).get("candidate")), "baseline": _num((v or {}).get("baseline")),
            "fails": rs.fails if rs is not None else None,
            "null": _null_level(rs) if rs is not None else None,
            "before": [annotate(rule, dict(w)) for w in windows.get(rule.name, ())], "after": [],
            "before_missing": int((missing or {}).get(rule.name, 0)),
        }
        if involved and rule.source == "golden":
            entry["broken_items"] = _broken_items(v, outputs)
        rules.append(entry)
    rules.sort(key=lambda r: not r["involved"])
    detail = {k: v for k, v in (action.detail or {}).items() if k not in ("verdicts", "verdict", "routing")}
    return {
        "schema": EVIDENCE_SCHEMA, "id": eid, "kind": action.kind, "model": action.model, "route": action.route,
        "policy": action.policy, "reason": action.reason, "severity": action.severity,
        "precision": action.precision, "dry_run": action.dry_run, "at": action.at, "instance": instance,
        "serving_before": serving,
        "candidate": policy.candidate if policy is not None else None,
        "baseline": policy.baseline if policy is not None else None,
        "rules": rules, "gpu": dict(gpu) if gpu else None,
        "undo": _promote_back(policy, st, action) if policy is not None else None,
        "detail": json.loads(json.dumps(detail, default=str)),
        "audit": [], "updated_at": action.at, "complete": False,
        "history_cut": any(r["before_missing"] for r in rules),
    }


def summary_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """The incident list's line of a record."""
    involved = [r["name"] for r in record.get("rules", []) if r.get("involved")]
    return {k: record.get(k) for k in ("id", "kind", "model", "route", "policy", "severity", "precision",
                                       "dry_run", "at")} | {"rules": involved, "reason": str(record.get("reason"))[:300]}


def _cut_texts(record: dict[str, Any], chars: int) -> None:
    for rule in record.get("rules", []):
        for item in rule.get("broken_items") or []:
            for k in ("reference", "candidate", "baseline", "prompt"):
                if isinstance(item.get(k), str) and len(item[k]) > chars:
                    item[k] = item[k][:chars] + "…"


def _finite(x: Any) -> Any:
    """``x`` with NaN/inf floats as None (strict JSON), recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def bounded_json(record: dict[str, Any], max_bytes: int) -> bytes:
    """``record`` as JSON of at most ``max_bytes``: texts are cut, then windows, items and the audit
    trail thinned (``record['truncated']`` says so) until it fits. NaN/inf become null."""
    def dump() -> bytes:
        return json.dumps(_finite(record), default=str, allow_nan=False, separators=(",", ":")).encode()

    raw = dump()
    steps = 0
    while len(raw) > max_bytes and steps < 12:
        steps += 1
        record["truncated"] = True
        if steps <= 3:
            _cut_texts(record, TEXT_CHARS // (2 ** steps))
        else:
            keep = max(1, 24 >> (steps - 3))
            for rule in record.get("rules", []):
                for k in ("before", "after", "broken_items"):
                    if isinstance(rule.get(k), list):
                        rule[k] = rule[k][-keep:] if k != "broken_items" else rule[k][:keep]
                if isinstance(rule.get("null"), dict):
                    rule["null"].pop("recent", None)
                if not rule.get("involved"):
                    rule["reason"] = rule["reason"][:80]
            record["audit"] = record.get("audit", [])[-keep:]
            record["detail"] = {}
        raw = dump()
    if len(raw) > max_bytes:  # still too big (e.g. a huge policy): keep what identifies it
        slim = {k: record.get(k) for k in ("schema", "id", "kind", "model", "route", "policy", "reason", "at")}
        slim["reason"] = str(slim["reason"])[:2000]
        slim["truncated"] = True
        raw = json.dumps(_finite(slim), default=str).encode()
    return raw
