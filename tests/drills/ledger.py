"""Scoring one drill: produced vs recorded per window, flips and guards from the audit stream,
pages from the alert sink, readiness samples against the intervals when something was wrong.

Everything here reads outputs only (Redis streams written by the daemon, HTTP POSTs it sent), so a
rebuilt daemon is judged by the same rules as the old one.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.drills.harness import MODEL, Guards, Sample, WindowKey

#: a problem interval: (start, end, what, replica or None for all)
Fault = tuple[float, float, str, str | None]


@dataclass
class Expect:
    """What a correct daemon does in this drill."""

    #: route -> the flips it should see, in order ("rollback", "promote")
    flips: dict[str, list[str]] = field(default_factory=dict)
    #: ops incident key -> firing pages expected (only keys listed here are judged)
    ops_pages: dict[str, int] = field(default_factory=dict)
    #: intervals in which /readyz must say "not ready"
    faults: list[Fault] = field(default_factory=list)
    #: seconds around each fault edge in which either answer is fine (time to notice / recover)
    tolerance_s: float = 5.0
    #: seconds after each daemon start in which either answer is fine (start-up and group join)
    start_tolerance_s: float = 10.0
    #: compare windows that start before this (set when the drill's traffic stops)
    cutoff: float = float("inf")
    #: the daemon must still run at the end and never die on its own
    must_survive: bool = True


@dataclass
class Result:
    drill: str
    tree: str = ""
    seconds: float = 0.0
    produced: int = 0
    recorded: int = 0
    lost: int = 0
    twice: int = 0
    windows_recorded_twice: int = 0
    produce_failed: int = 0
    broker_mismatch: int = 0
    flips_expected: int = 0
    flips_applied: int = 0
    flip_sequence: str = ""
    guard_violations: list[str] = field(default_factory=list)
    pages_expected: int = 0
    pages_received: int = 0
    pages_duplicate: int = 0
    pages_missing: int = 0
    pages_early: int = 0
    ops_pages: dict[str, int] = field(default_factory=dict)
    ready_samples: int = 0
    false_ready_s: float = 0.0
    false_unready_s: float = 0.0
    deaths: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    #: readiness transitions: (seconds since start, replica, ready, first problem)
    readiness: list[tuple[float, str, bool | None, str]] = field(default_factory=list)
    #: fault intervals, seconds since start: (start, end, what)
    faults: list[tuple[float, float, str]] = field(default_factory=list)
    #: (route, precision, window start, produced, recorded) of every window that differs
    diffs: list[tuple[str, str, float, int, int]] = field(default_factory=list)

    @property
    def readiness_accuracy(self) -> float:
        wrong = (self.false_ready_s + self.false_unready_s) / 0.5
        return 1.0 if not self.ready_samples else max(0.0, 1.0 - wrong / self.ready_samples)

    def failures(self) -> list[str]:
        out = []
        if self.error:
            out.append(f"error: {self.error}")
        if self.lost:
            out.append(f"{self.lost} events lost")
        if self.twice:
            out.append(f"{self.twice} events counted twice")
        if self.flips_applied != self.flips_expected:
            out.append(f"flips {self.flips_applied} applied vs {self.flips_expected} expected ({self.flip_sequence})")
        if self.guard_violations:
            out.append("guard violations: " + "; ".join(self.guard_violations))
        if self.pages_duplicate or self.pages_missing or self.pages_early:
            out.append(f"pages: {self.pages_duplicate} duplicate, {self.pages_missing} missing, "
                       f"{self.pages_early} before the flag changed")
        if self.false_ready_s:
            out.append(f"ready for {self.false_ready_s:.1f} s while something was wrong")
        if self.false_unready_s:
            out.append(f"not ready for {self.false_unready_s:.1f} s while all was well")
        if self.deaths:
            out.append("daemon died: " + "; ".join(self.deaths))
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["failures"] = self.failures()
        d["readiness_accuracy"] = round(self.readiness_accuracy, 3)
        d["diffs"] = self.diffs[:40]
        d["windows_differing"] = len(self.diffs)
        return d


def recorded_windows(entries: list[tuple[str, dict[str, str]]]) -> tuple[Counter[WindowKey], Counter[WindowKey]]:
    """(samples, records) per (route, precision, start) of the live windows the daemon recorded."""
    samples: Counter[WindowKey] = Counter()
    records: Counter[WindowKey] = Counter()
    for _id, fields in entries:
        try:
            w = json.loads(fields["json"])
        except (KeyError, ValueError):
            continue
        if w.get("source", "live") != "live" or w.get("model") != MODEL:
            continue
        key = (str(w["route"]), str(w["precision"]), round(float(w["start"]), 6))
        samples[key] += int(w.get("samples", 0))
        records[key] += 1
    return samples, records


def compare_counts(result: Result, produced: Counter[WindowKey], samples: Counter[WindowKey],
                   records: Counter[WindowKey], cutoff: float) -> None:
    keys = {k for k in set(produced) | set(samples) if k[2] < cutoff}
    for k in sorted(keys):
        p, r = produced.get(k, 0), samples.get(k, 0)
        if p != r:
            result.diffs.append((k[0], k[1], k[2], p, r))
        result.produced += p
        result.recorded += r
        result.lost += max(0, p - r)
        result.twice += max(0, r - p)
        result.windows_recorded_twice += max(0, records.get(k, 0) - 1)


def audit_flips(entries: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    out = []
    for entry_id, f in entries:
        if f.get("op") != "set" or f.get("model") != MODEL:
            continue
        kind = "rollback" if f.get("precision") == "fp16" else "promote"
        # the entry id is Redis's clock when the flip landed; the ``ts`` field is the writer's claim
        out.append({"id": entry_id, "at": int(entry_id.split("-")[0]) / 1000, "claimed": f.get("ts"),
                    "route": f.get("route"), "kind": kind, "previous": f.get("previous", ""),
                    "mode": f.get("mode"), "by": f.get("changed_by", "")})
    return out


def check_flips(result: Result, flips: list[dict[str, Any]], expect: Expect, guards: Guards) -> None:
    """Applied vs expected flips, and every guard checked against the audit timestamps. A write that
    re-asserts the route's last state on a hash Redis lost (previous empty) is reconciliation, not a flip."""
    policy = []
    last: dict[str, str] = {}
    for f in flips:
        if f["mode"] != "policy":
            continue
        if f["previous"] == "" and last.get(f["route"]) == f["kind"]:
            continue  # the hash was lost and the same state re-asserted
        last[f["route"]] = f["kind"]
        policy.append(f)
    result.flips_expected = sum(len(v) for v in expect.flips.values())
    result.flips_applied = len(policy)
    seq = []
    by_route: dict[str, list[dict[str, Any]]] = {}
    for f in policy:
        by_route.setdefault(f["route"], []).append(f)
    for route in sorted(set(by_route) | set(expect.flips)):
        got = [f["kind"] for f in by_route.get(route, [])]
        seq.append(f"{route}:{','.join(got) or '-'}")
        if got != expect.flips.get(route, []) and len(got) == len(expect.flips.get(route, [])):
            result.guard_violations.append(f"{route} flipped {got}, expected {expect.flips.get(route)}")
        fl = by_route.get(route, [])
        for prev, cur in zip(fl, fl[1:], strict=False):
            gap = cur["at"] - prev["at"]
            if gap < guards.cooldown_s - 0.5:
                result.guard_violations.append(f"{route} {cur['kind']} {gap:.1f} s after {prev['kind']} "
                                               f"(cooldown {guards.cooldown_s:.0f} s)")
            if cur["kind"] == "promote" and prev["kind"] == "rollback" and gap < guards.promote_after_s - 0.5:
                result.guard_violations.append(f"{route} promoted {gap:.1f} s after rollback "
                                               f"(promote.after {guards.promote_after_s:.0f} s)")
        if len(fl) > guards.max_flips_per_day:
            result.guard_violations.append(f"{route} flipped {len(fl)} times (budget {guards.max_flips_per_day}/day)")
    result.flip_sequence = " ".join(seq)


def check_pages(result: Result, received: list[Any], flips: list[dict[str, Any]], expect: Expect) -> None:
    """One page per expected route flip (a rollback fires an incident, a promote resolves it), none
    before the flag changed; firing ops incidents counted by key."""
    pages: Counter[tuple[str, str]] = Counter()
    ops: Counter[str] = Counter()
    for r in received:
        body = r.body
        if not r.accepted:
            continue
        if not isinstance(body, dict) or "schema" not in body:
            continue
        event = str(body.get("event", ""))
        key = str(body.get("key", ""))
        if key.startswith("ops") or event.startswith("ops"):
            if body.get("status") == "firing":
                ops[key] += 1
            continue
        if body.get("dry_run"):
            continue
        if event in ("rollback", "promote"):
            pages[(str(body.get("route")), event)] += 1
            applied = [f for f in flips if f["route"] == body.get("route") and f["kind"] == event]
            if applied and r.at + 0.25 < min(f["at"] for f in applied):
                result.pages_early += 1
            if not applied:
                result.pages_early += 1  # paged a flip that was never applied
    want: Counter[tuple[str, str]] = Counter()
    for route, kinds in expect.flips.items():
        for k in kinds:
            want[(route, k)] += 1
    result.pages_expected = sum(want.values())
    result.pages_received = sum(pages.values())
    for k in set(want) | set(pages):
        result.pages_duplicate += max(0, pages.get(k, 0) - want.get(k, 0))
        result.pages_missing += max(0, want.get(k, 0) - pages.get(k, 0))
    result.ops_pages = dict(ops)
    for key, n in expect.ops_pages.items():
        got = sum(v for k, v in ops.items() if re.search(key, k))
        if got != n:
            result.guard_violations.append(f"ops page {key!r}: {got} sent, {n} expected")


def check_readiness(result: Result, samples: list[Sample], expect: Expect, downtime: dict[str, list[list[float]]],
                    every_s: float) -> None:
    tol = expect.tolerance_s
    edges = [t for f in expect.faults for t in (f[0], f[1])]
    t0 = samples[0].at if samples else 0.0
    last: dict[str, bool | None] = {}
    for s in samples:
        if s.replica not in last or last[s.replica] != s.ready:
            last[s.replica] = s.ready
            result.readiness.append((round(s.at - t0, 1), s.replica, s.ready, (s.problems or [""])[0][:120]))
    result.faults = [(round(a - t0, 1), round(b - t0, 1), w) for a, b, w, _r in expect.faults]
    for s in samples:
        if any(abs(s.at - t) < tol for t in edges):
            continue
        # a replica that was down (killed, stopped, restarting) may answer anything until tol after start
        if any(a - 0.5 <= s.at <= (b if b is not None else float("inf")) + expect.start_tolerance_s
               for a, b in downtime.get(s.replica, [])):
            continue
        wrong_now = any(a <= s.at <= b and (who is None or who == s.replica) for a, b, _w, who in expect.faults)
        result.ready_samples += 1
        if wrong_now and s.ready:
            result.false_ready_s += every_s
        elif not wrong_now and not s.ready:
            result.false_unready_s += every_s
