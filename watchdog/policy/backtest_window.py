"""Which window length a backtest should use when the operator gives none.

A policy has no window length of its own (the daemon's ``windows.length_s`` is deployment config),
but its live rules say how much traffic a window needs: ``min_samples`` (and a judge's
``min_items``) per precision, ``for`` windows in a row, ``pool`` windows together. One pass over
the recording in event-time order (``backtest.event_time_order``) through ``WindowAggregator`` at a
short base length, each base window closed as the events pass it, counts, per (rule, route,
precision), what ``min_samples`` counts (``evaluate.sample_count``); a longer window's count is
the sum of its base windows (windows are aligned to multiples of their length). For each length
of a ladder the rule is *reachable* when the median full window of some route it covers reaches
the minimum for both precisions and the recording holds at least ``for + pool`` full windows
(``for`` failing windows after one to compare with). The choice is the smallest length that makes
the most rules reachable; none reachable at any length gives a one-line reason instead.
Pure over plain data; no I/O beyond the iterable of lines it is given.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from watchdog.core.events import InvalidEvent, decode_event
from watchdog.core.signals import Signal
from watchdog.policy.backtest import event_time_order
from watchdog.policy.evaluate import sample_count
from watchdog.policy.loader import PolicySet
from watchdog.policy.schema import Policy, Rule
from watchdog.windows.aggregator import WindowAggregator

#: window lengths a backtest may pick, seconds (each a multiple of the base length)
LADDER_S: tuple[float, ...] = (10, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
BASE_S = 10.0
#: a window counts when the recording covers at least this share of it
FULL = 0.9


class WindowChoiceError(ValueError):
    """No window length lets any live rule reach its ``min_samples``; the message is one line."""


@dataclass(slots=True)
class WindowChoice:
    window_s: float
    #: ``policy:rule`` reachable at the chosen length
    reachable: list[str] = field(default_factory=list)
    #: ``policy:rule`` -> why not (one short phrase)
    unreachable: dict[str, str] = field(default_factory=dict)
    #: ``policy:rule`` -> how close it came (0..1: the smaller of traffic / need and windows / need)
    closeness: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        n, total = len(self.reachable), len(self.reachable) + len(self.unreachable)
        return (f"window {fmt_duration(self.window_s)} picked from the recording: the smallest length at which "
                f"{n} of {total} live rules reach min_samples in a typical window (--window overrides)")


def fmt_duration(s: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{int(s // size)}{unit}"
    return f"{s:g}s"


def _need(rule: Rule) -> int:
    return max(rule.min_samples, rule.judge.min_n) if rule.judge is not None else rule.min_samples


def choose_window(policy_set: PolicySet, lines: Iterable[bytes]) -> WindowChoice:
    """The window length for a backtest of ``lines`` under ``policy_set`` (see the module doc).
    Raises ``WindowChoiceError`` when no length makes any live rule reachable."""
    rules = [(p, r) for p in policy_set.policies for r in p.rules if r.source == "live"]
    agg = WindowAggregator(length_s=BASE_S, grace_s=0.0, max_future_s=math.inf)
    # (policy, rule, model, route, role) -> {base index: count}
    counts: dict[tuple[str, str, str, str, str], dict[int, int]] = defaultdict(dict)
    first: float | None = None
    last: float | None = None
    for line in event_time_order(lines):
        try:
            ev = decode_event(line)
        except InvalidEvent:
            continue
        # in time order, each base window is counted and dropped once the events pass it: the open
        # windows stay a few per route, not every 10 s of the recording (a week of 100 routes held
        # ~3 MB per route and hour open)
        _count(agg.close_due(ev.ts), rules, counts)
        if agg.add(ev):
            first = ev.ts if first is None else min(first, ev.ts)
            last = ev.ts if last is None else max(last, ev.ts)
    if first is None or last is None:
        raise WindowChoiceError("cannot pick a window: the recording holds no valid event; pass --window")
    _count(agg.close_all(), rules, counts)
    if not rules:
        return WindowChoice(LADDER_S[0])
    choices = [_at(length, rules, counts, first, last) for length in LADDER_S]
    best = choices[0]
    for choice in choices[1:]:
        if len(choice.reachable) > len(best.reachable):
            best = choice
    if not best.reachable:  # the nearest miss: the rule and length that came closest
        near = max(((c.closeness.get(n, 0.0), -i, n) for i, c in enumerate(choices) for n in c.unreachable))
        name = near[2]
        why = choices[-near[1]].unreachable[name]
        span = fmt_duration(round(last - first))
        raise WindowChoiceError(f"cannot pick a window: in this {span} recording no live rule reaches its "
                                f"min_samples at any window length (e.g. {name}: {why}); pass --window")
    return best


def _count(signals: list[Signal], rules: list[tuple[Policy, Rule]],
           counts: dict[tuple[str, str, str, str, str], dict[int, int]]) -> None:
    for sig in signals:
        if sig.source != "live":
            continue
        k = int(math.floor(sig.start / BASE_S + 1e-9))
        for p, r in rules:
            if not p.scope.covers(sig.model, sig.route):
                continue
            role = "candidate" if sig.precision == p.candidate else "baseline" if sig.precision == p.baseline else None
            if role is None:
                continue
            counts[(p.name, r.name, sig.model, sig.route, role)][k] = sample_count(r, sig)


def _at(length: float, rules: list[tuple[Policy, Rule]], counts: dict[tuple[str, str, str, str, str], dict[int, int]],
        first: float, last: float) -> WindowChoice:
    per = round(length / BASE_S)
    # windows [k*L, (k+1)*L) the recording covers (at least FULL of each): k in [k0, k1)
    k0 = math.floor(first / length)
    if (k0 + 1) * length - first < length * FULL:
        k0 += 1
    k1 = math.floor(last / length) + 1
    if last - (k1 - 1) * length < length * FULL:
        k1 -= 1
    full = max(0, k1 - k0)
    out = WindowChoice(length)
    for p, r in rules:
        name = f"{p.name}:{r.name}"
        need = _need(r)
        hist = (r.judge.history if r.judge is not None else 1)
        keys = [k for k in counts if (k[0], k[1], k[4]) == (p.name, r.name, "candidate")]
        if not keys:
            out.unreachable[name] = "covers none of the recording's routes (or none has both precisions)"
            out.closeness[name] = 0.0
            continue
        windows_needed = r.for_ + hist - 1  # `for` failing windows, each judging `hist` windows
        if full < windows_needed:
            out.unreachable[name] = (f"needs {windows_needed} windows in a row, the recording holds {full} "
                                     f"of {fmt_duration(length)}")
            out.closeness[name] = full / windows_needed
            continue
        best_typical = 0
        for pn, rn, model, route, _ in keys:
            other = counts.get((pn, rn, model, route, "baseline"), {})
            typical = min(_median_window(counts[(pn, rn, model, route, "candidate")], per, k0, k1),
                          _median_window(other, per, k0, k1))
            best_typical = max(best_typical, typical)
        if best_typical >= need:
            out.reachable.append(name)
        else:
            out.unreachable[name] = (f"needs {need} per precision, a typical {fmt_duration(length)} "
                                     f"window has {best_typical}")
            out.closeness[name] = best_typical / need
    return out


def _median_window(by_base: dict[int, int], per: int, k0: int, k1: int) -> int:
    sums = [sum(by_base.get(k * per + i, 0) for i in range(per)) for k in range(k0, k1)]
    if not sums:
        return 0
    sums.sort()
    return sums[(len(sums) - 1) // 2]
