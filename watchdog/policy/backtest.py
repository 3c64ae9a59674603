"""Policy backtesting: replay recorded history through the same pure core the daemon runs.

Recorded inference events (JSON lines, optionally gzip) are decoded with ``decode_event`` (bad
lines are counted, never fatal), put in event-time order (``event_time_order``: a recording of a
topic of several partitions holds each partition's stretch in turn), folded into tumbling windows by ``WindowAggregator`` on *event*
time (a window closes when event time passes its end + grace; ``close_all`` at the end), golden
drift reports are fed at their finish time, and every closed window goes to ``PolicyEngine.observe``
with simulated flags: every route starts at the policies' candidate, and rollback/promote actions
are applied to the simulated flags as the actuator would. The result lists every would-be flip and
alert with its time, reason and numbers, plus a timeline for plotting
(``watchdog/policy/backtest_report.py``). Nothing here touches Kafka, Redis or the network.
"""

from __future__ import annotations

import contextlib
import gzip
import heapq
import json
import logging
import math
import os
import struct
import tempfile
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from watchdog.core.events import InvalidEvent, decode_event
from watchdog.core.signals import Action, Signal
from watchdog.policy.backtest_stats import verdict_row
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.loader import PolicySet
from watchdog.policy.status import judgeability_rows
from watchdog.windows.aggregator import WindowAggregator

log = logging.getLogger(__name__)

#: (time, signals of one golden report)
GoldenFeed = list[tuple[float, list[Signal]]]


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class BacktestAction:
    """One would-be action, flattened for tables and JSON."""

    at: float
    kind: str
    policy: str
    model: str
    route: str
    severity: str
    reason: str
    precision: str | None = None
    dry_run: bool = False
    rule: str | None = None
    source: str | None = None
    cause: str | None = None
    flip: bool = False
    numbers: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"time": iso(self.at), "at": self.at, "kind": self.kind, "policy": self.policy, "model": self.model,
                "route": self.route, "severity": self.severity, "precision": self.precision,
                "dry_run": self.dry_run, "rule": self.rule, "source": self.source, "cause": self.cause,
                "flip": self.flip, "reason": self.reason, "numbers": self.numbers}


@dataclass(slots=True)
class BacktestResult:
    policies: list[str]
    window_s: float
    lines: int = 0
    events: int = 0
    bad_lines: int = 0
    bad_reasons: Counter[str] = field(default_factory=Counter)
    late: int = 0
    windows: int = 0
    golden_reports: int = 0
    golden_bad: list[str] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    actions: list[BacktestAction] = field(default_factory=list)
    #: one point per closed window or golden report side:
    #: {"t", "source", "model", "route", "precision", "samples", "values"}
    timeline: list[dict[str, Any]] = field(default_factory=list)
    #: (model, route) -> [(time, precision served from then on)], starting at the candidate
    serving: dict[tuple[str, str], list[tuple[float, str]]] = field(default_factory=dict)
    flags: dict[tuple[str, str], str] = field(default_factory=dict)
    #: per (policy, model, route, rule) at the end of the replay: whether the rule was judged at
    #: that traffic (per window, over its horizon, or not) and its minimum detectable effect
    #: (``watchdog.policy.status.judgeability_rows``)
    judged: list[dict[str, Any]] = field(default_factory=list)
    #: one row per rule per judged window or report (``backtest_stats.verdict_row``): status, whether
    #: it was judged or why not ("n < min"), the statistic, its interval, threshold and margin
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    #: how the window length was chosen (``backtest_window.WindowChoice.summary``), if it was
    window_note: str | None = None
    #: one line per policy whose scope covers none of the recording's routes (it judged nothing:
    #: "0 flips" says nothing about it)
    uncovered: list[str] = field(default_factory=list)

    @property
    def flips(self) -> int:
        return sum(a.flip for a in self.actions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policies": self.policies, "window_s": self.window_s,
            "start": None if self.start is None else iso(self.start),
            "end": None if self.end is None else iso(self.end),
            "lines": self.lines, "events": self.events, "bad_lines": self.bad_lines,
            "bad_reasons": dict(self.bad_reasons), "late_events": self.late, "windows": self.windows,
            "golden_reports": self.golden_reports, "golden_bad": self.golden_bad, "flips": self.flips,
            "alerts": sum(a.kind == "alert" for a in self.actions),
            "actions": [a.to_dict() for a in self.actions],
            "final_flags": {f"{m}/{r}": p for (m, r), p in sorted(self.flags.items())},
            "judged": self.judged, "window_note": self.window_note, "uncovered": self.uncovered,
            "verdicts": self.verdicts,
        }


# --- inputs ----------------------------------------------------------------------------------------


def read_lines(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """The non-empty lines of a JSON-lines file; gzip is recognised by its magic bytes."""
    with open(path, "rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as fh:
        try:
            for raw in fh:
                line = raw.strip()
                if line:
                    yield line
        except (EOFError, zlib.error) as exc:  # a cut-short or damaged gzip file: callers catch OSError
            raise OSError(f"{os.fspath(path)}: damaged gzip file: {exc}") from exc


#: lines ``event_time_order`` sorts in memory at a time; a longer recording is sorted in runs of this
#: many, spilled to temporary files and merged, so memory stays bounded whatever its length
SORT_RUN_LINES = 200_000
_RUN_HEADER = struct.Struct("<dQI")  # event time, position in the input, line length


def _sort_key(line: bytes) -> float:
    try:
        return decode_event(line).ts
    except InvalidEvent:
        return -math.inf  # a bad line is counted wherever it goes: first


def event_time_order(lines: Iterable[bytes], run_lines: int = SORT_RUN_LINES) -> Iterator[bytes]:
    """``lines`` in event-time order; lines of equal time, and bad lines (first), keep their order.

    A recording made from the daemon's topic (docs/POLICIES.md "Backtest") holds each partition's
    stretch of events in turn, not one time order: the daemon closes windows on the slowest
    partition's watermark, while a fold over the file in its own order would close a window as soon
    as one partition's events passed it and drop the other partitions' events for it as late (half of
    a 4-partition recording). Runs of ``run_lines`` lines are sorted in memory; beyond one run they go
    to temporary files and are merged."""
    runs: list[IO[bytes]] = []
    run: list[tuple[float, int, bytes]] = []
    with contextlib.ExitStack() as files:
        for i, line in enumerate(lines):
            run.append((_sort_key(line), i, line))
            if len(run) >= run_lines:
                run.sort()
                fh = files.enter_context(tempfile.TemporaryFile())
                for ts, n, ln in run:
                    fh.write(_RUN_HEADER.pack(ts, n, len(ln)))
                    fh.write(ln)
                fh.seek(0)
                runs.append(fh)
                run = []
        run.sort()
        for _ts, _n, ln in heapq.merge(run, *(_read_run(fh) for fh in runs)) if runs else run:
            yield ln


def _read_run(fh: IO[bytes]) -> Iterator[tuple[float, int, bytes]]:
    size = _RUN_HEADER.size
    while header := fh.read(size):
        ts, n, length = _RUN_HEADER.unpack(header)
        yield ts, n, fh.read(length)


def _report_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    # latest.json is a copy of the newest report-*.json (DriftReport.save): skip it
    return sorted(p for p in path.rglob("*.json") if p.name != "latest.json")


def load_golden_reports(path: str | os.PathLike[str], scope: tuple[str, str] | None = None) -> tuple[GoldenFeed, list[str]]:
    """Golden drift reports (``probes.drift.DriftReport`` JSON, schema 1) from a file or a
    directory tree, as (finish time, signals), oldest first, plus ``file: problem`` strings.

    The (model, route) a report guards comes from optional top-level ``model`` and ``routes``
    (list) or ``route`` keys in the file, else from ``scope``, else ``*``/``*`` (every route the
    events show, as the engine expands wildcard signals)."""
    from probes.drift import DriftReport  # lazy: probes pull in numpy and scoring helpers

    feed: GoldenFeed = []
    bad: list[str] = []
    for f in _report_files(Path(path)):
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            report = DriftReport.from_dict(data)
            model = str(data.get("model") or (scope[0] if scope else "*"))
            routes = data.get("routes") or ([data["route"]] if data.get("route") else None)
            routes = [str(r) for r in routes] if routes else [scope[1] if scope else "*"]
            signals = [s for r in routes for s in report.to_signals(model, r)]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad.append(f"{f}: {type(exc).__name__}: {exc}")
            continue
        feed.append((float(report.finished_at), signals))
    feed.sort(key=lambda x: x[0])
    return feed, bad


# --- simulation ------------------------------------------------------------------------------------


def _numbers(a: Action) -> dict[str, float]:
    d = a.detail or {}
    verdict = d.get("verdict") or next(iter(d.get("verdicts") or []), None)
    if not isinstance(verdict, dict):
        return {}
    out = {k: verdict[k] for k in ("candidate", "baseline", "samples", "baseline_samples")
           if isinstance(verdict.get(k), int | float)}
    out.update({k: v for k, v in (verdict.get("extra") or {}).items() if isinstance(v, int | float)})
    return {k: float(v) for k, v in out.items() if math.isfinite(float(v))}


class _Replay:
    def __init__(self, policy_set: PolicySet, window_s: float) -> None:
        self.engine = PolicyEngine(policy_set)
        self.default = policy_set.policies[0].candidate if policy_set.policies else "fp8"
        self.policy_set = policy_set
        self.result = BacktestResult(policies=list(policy_set.names), window_s=window_s)
        #: (policy, model, route, rule) -> end of the last verdict recorded
        self._seen: dict[tuple[str, str, str, str], float] = {}

    def feed(self, signals: list[Signal], now: float) -> None:
        if not signals:
            return
        r = self.result
        for s in signals:
            if s.source == "live":
                r.windows += 1
            if s.source in ("live", "golden"):
                r.timeline.append({"t": s.end, "source": s.source, "model": s.model, "route": s.route,
                                   "precision": s.precision, "samples": s.samples, "values": dict(s.values)})
                r.serving.setdefault((s.model, s.route), [(s.start, r.flags.get((s.model, s.route), self.default))])
        serving = dict(r.flags)
        actions = self.engine.observe(signals, now, r.flags, self.default)
        pairs = None if any("*" in (s.model, s.route) for s in signals) else {(s.model, s.route) for s in signals}
        self._record_verdicts(serving, pairs)
        for a in actions:
            flip = a.kind in ("rollback", "promote") and not a.dry_run and not a.detail.get("retry")
            if a.kind in ("rollback", "promote") and not a.dry_run and a.precision:
                r.flags[(a.model, a.route)] = a.precision
                r.serving.setdefault((a.model, a.route), [(a.at, self.default)]).append((a.at, a.precision))
            d = a.detail or {}
            r.actions.append(BacktestAction(
                at=a.at or now, kind=a.kind, policy=a.policy, model=a.model, route=a.route, severity=a.severity,
                reason=a.reason, precision=a.precision, dry_run=a.dry_run, rule=d.get("rule"),
                source=d.get("source"), cause=d.get("cause"), flip=flip, numbers=_numbers(a)))


    def _record_verdicts(self, serving: dict[tuple[str, str], str], pairs: set[tuple[str, str]] | None) -> None:
        """Append the verdicts the last ``observe`` made (of the scopes of ``pairs``; None: all)."""
        for (pname, model, route), st in self.engine.states.items():
            if pairs is not None and (model, route) not in pairs:
                continue
            policy = self.policy_set.get(pname)
            if policy is None:
                continue
            for name, rs in st.rules.items():
                v, rule = rs.last, policy.rule(name)
                key = (pname, model, route, name)
                if v is None or rule is None or v.end <= self._seen.get(key, -math.inf):
                    continue
                self._seen[key] = v.end
                self.result.verdicts.append(verdict_row(
                    policy, rule, v, model, route, serving.get((model, route), self.default)))


def uncovered_policies(policy_set: PolicySet, routes: set[tuple[str, str]]) -> list[str]:
    """A line per policy whose scope covers none of ``routes`` (none when there are no routes)."""
    if not routes:
        return []
    seen = ", ".join(f"{m}/{r}" for m, r in sorted(routes)[:5]) + (", ..." if len(routes) > 5 else "")
    out = []
    for p in policy_set.policies:
        if not any(p.scope.covers(m, r) for m, r in routes):
            out.append(f"policy {p.name} judged nothing: its scope (models {p.scope.models}, routes "
                       f"{p.scope.routes}) covers none of the {len(routes)} routes in the recording ({seen})")
    return out


def run_backtest(policy_set: PolicySet, lines: Iterable[bytes], golden: GoldenFeed | None = None, *,
                 window_s: float = 10.0, grace_s: float | None = None) -> BacktestResult:
    """Replay event lines (and golden reports) through windows and the policy engine."""
    grace = min(2.0, window_s / 2) if grace_s is None else grace_s
    agg = WindowAggregator(length_s=window_s, grace_s=grace, max_future_s=math.inf)
    rp = _Replay(policy_set, window_s)
    r = rp.result
    feed = list(golden or [])
    gi = 0
    for line in event_time_order(lines):
        r.lines += 1
        try:
            ev = decode_event(line)
        except InvalidEvent as exc:
            r.bad_lines += 1
            r.bad_reasons[exc.reason] += 1
            continue
        ts = ev.ts
        while gi < len(feed) and feed[gi][0] <= ts:
            t, sigs = feed[gi]
            rp.feed(agg.close_due(t), t)
            rp.feed(sigs, t)
            gi += 1
        rp.feed(agg.close_due(ts), ts)
        if agg.add(ev):
            r.events += 1
            r.start = ts if r.start is None else min(r.start, ts)
            r.end = ts if r.end is None else max(r.end, ts)
    last = r.end if r.end is not None else 0.0
    closing = agg.close_all()
    rp.feed(closing, max([last, *(s.end for s in closing)]))
    for t, sigs in feed[gi:]:
        rp.feed(sigs, t)
    r.late = agg.late
    r.golden_reports = len(feed)
    r.judged = judgeability_rows(rp.engine.snapshot())
    r.uncovered = uncovered_policies(policy_set, {(p["model"], p["route"]) for p in r.timeline})
    log.info("backtest: %d lines, %d events, %d bad, %d windows, %d golden reports, %d flips",
             r.lines, r.events, r.bad_lines, r.windows, r.golden_reports, r.flips)
    return r
