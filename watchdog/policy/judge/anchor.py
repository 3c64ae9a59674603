"""A long-term anchor for a learned null: a slowly updated, persisted reference of the healthy
FP8 - FP16 level that a slow creep cannot drag along (docs/JUDGE.md "No learning a regression as
normal"). Pure, stdlib only.

The learned null of a live rule follows the recent level (``recent`` windows): that is what
makes a stable replica offset or an FP8 speed-up "normal", and also what lets a regression that
creeps in more slowly than the rule can see become normal. The anchor is a second, much slower
memory of the same level:

* it is set once from the first ``learn_min`` healthy windows (the null's warm-up);
* after that every passing window moves it by ``gain * (e - anchor)`` with ``gain = 1 - 2**(-1 /
  halflife)`` (an exponential average with a half-life of ``halflife`` windows, a week of 5-minute
  windows by default), and never by more than ``tolerance / halflife`` per window: whatever the
  data do, the anchor moves at most ``tolerance`` in ``halflife`` windows;
* the level the null credits is capped at ``anchor + tolerance``;
* a learned level more than ``tolerance`` *below* the anchor is not credited either: the null
  judges against the anchor instead (``anchor_reset``). Such a level - FP8 suddenly much faster
  than it has long been - is as often the baseline getting slower (FP16 replicas creeping with
  uptime until a restart) as FP8 getting faster; held against FP8, the baseline's recovery would
  be FP8's "regression". Within the band the recent level is used as it is (a healthy level
  wanders around the anchor: holding every regression to the anchor cost a third of the power for
  +10 % at 2 % replica noise).

So a creep of the FP8 - FP16 difference faster than ``tolerance`` per ``halflife`` windows
outruns the anchor: once the learned level would sit more than ``tolerance`` above it, the level
stops following and the judge sees the rest of the creep as a shift. Only passing windows move
the anchor, and it is kept across flips and restarts (``RuleState.horizon["anchor"]``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["anchor_cap", "anchor_reset", "update_anchor"]


def update_anchor(anchor: Mapping[str, Any] | None, history: Sequence[float], e: float, *, learn_min: int,
                  halflife: int, tolerance: float) -> dict[str, Any] | None:
    """The anchor after a passing window with difference ``e``; ``history`` is the rule's
    learned null (healthy differences, oldest first, ``e`` included). None until the null holds
    ``learn_min`` windows."""
    if not math.isfinite(e):
        return dict(anchor) if anchor else None
    if not anchor:
        if len(history) < learn_min:
            return None
        first = [float(x) for x in history[:learn_min]]
        return {"level": sum(first) / len(first), "n": len(first)}
    level = float(anchor["level"])
    gain = 1.0 - 2.0 ** (-1.0 / max(halflife, 1))
    step = tolerance / max(halflife, 1)
    move = gain * (e - level)
    if step > 0:
        move = max(-step, min(step, move))
    return {"level": level + move, "n": int(anchor.get("n", 0)) + 1}


def anchor_cap(anchor: Mapping[str, Any] | None, tolerance: float) -> float | None:
    """The highest learned level the null may credit: ``anchor + tolerance`` (None: no anchor yet)."""
    if not anchor or "level" not in anchor:
        return None
    return float(anchor["level"]) + tolerance


def anchor_reset(anchor: Mapping[str, Any] | None, tolerance: float) -> tuple[float, float] | None:
    """(below, level): a learned level below ``anchor - tolerance`` is replaced by the anchor's
    ``level`` (None: no anchor yet)."""
    if not anchor or "level" not in anchor:
        return None
    return float(anchor["level"]) - tolerance, float(anchor["level"])
