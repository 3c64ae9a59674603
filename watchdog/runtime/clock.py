"""The daemon's clocks: a step-free wall clock, and the host clock checked against the events' clock.

Durations (cadences, backoffs, leases, debounces, the policy engine's guards) must not shrink or grow
when the host's wall clock steps (a VM resumed, a bad NTP server). ``SteadyClock`` is wall time
anchored once on ``time.time()`` and advanced by ``time.monotonic()``: it reads like a wall clock
(audit records, engine state written to checkpoints stay comparable with other processes), and a
step of the host clock does not move it.

It follows the host clock in two ways only, both bounded:

* ``slew``: while the host clock and the steady clock differ by less than ``bound_s``, the anchor
  moves toward the host clock by at most ``SLEW_RATE`` of the elapsed time (500 ppm, as NTP slews):
  a 30 s guard is off by at most 15 ms, and small NTP steps do not accumulate over months;
* ``reanchor``: when they differ by more than ``bound_s`` and the events' clock (the newest event time
  seen plus the monotonic time since) agrees with the host clock, the anchor was wrong (the host
  started with a bad clock and was corrected): the steady clock jumps to the host clock, once.

``ClockCheck`` names the disagreement (readiness reason ``clock-skew``): the host clock differs from
the steady clock, or from a fresh events' clock, by more than ``bound_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: the most the steady clock's anchor moves toward the host clock, per second of elapsed time
SLEW_RATE = 0.0005


class SteadyClock:
    """``anchor_wall + (monotonic() - anchor_mono)``; callable, returns seconds since the epoch."""

    def __init__(self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        self.wall = wall
        self.mono = mono
        self.anchor_mono = mono()
        self.anchor_wall = wall()
        self._last_slew = self.anchor_mono
        #: times the anchor jumped to the host clock (``reanchor``)
        self.reanchors = 0

    def __call__(self) -> float:
        return self.anchor_wall + (self.mono() - self.anchor_mono)

    def at(self, mono: float) -> float:
        """The steady time of monotonic time ``mono``."""
        return self.anchor_wall + (mono - self.anchor_mono)

    def skew(self) -> float:
        """Host clock minus steady clock, seconds."""
        return self.wall() - self()

    def slew(self, bound_s: float) -> None:
        """Move toward the host clock by at most ``SLEW_RATE`` of the time since the last call, while
        they differ by less than ``bound_s`` (beyond it the host clock is not trusted: see module doc)."""
        mono = self.mono()
        elapsed = max(0.0, mono - self._last_slew)
        self._last_slew = mono
        off = self.wall() - self.at(mono)
        if abs(off) >= bound_s:
            return
        step = SLEW_RATE * elapsed
        self.anchor_wall += max(-step, min(step, off))

    def reanchor(self) -> float:
        """Jump to the host clock; returns the jump in seconds."""
        mono = self.mono()
        jump = self.wall() - self.at(mono)
        self.anchor_wall += jump
        self._last_slew = mono
        self.reanchors += 1
        return jump


class ClockCheck:
    """Compares the host clock with the steady clock and the events' clock; re-anchors when safe."""

    def __init__(self, steady: SteadyClock, bound_s: float) -> None:
        self.steady = steady
        self.bound_s = bound_s

    def check(self, events_now: float | None) -> str | None:
        """``events_now``: the events' clock now (None when no fresh events). A message when the host
        clock disagrees beyond the bound (after re-anchoring if the events say the host is right)."""
        wall = self.steady.wall()
        steady = self.steady()
        bound = self.bound_s
        if abs(wall - steady) > bound and events_now is not None and abs(wall - events_now) <= bound / 2:
            jump = self.steady.reanchor()
            log.warning("the events' clock agrees with the host clock, not with the clock anchored at "
                        "start-up: steady clock re-anchored by %+.1f s", jump)
            steady = self.steady()
        self.steady.slew(bound)
        if abs(wall - steady) > bound:
            ev = f", events' clock {events_now - wall:+.0f} s from it" if events_now is not None else ""
            return (f"host clock {wall - steady:+.0f} s from the monotonic clock since start-up{ev}: "
                    f"durations and event time run on the steady clock; bound {bound:.0f} s")
        if events_now is not None and abs(wall - events_now) > bound:
            return (f"host clock {wall - events_now:+.0f} s from the events' clock (newest event time + "
                    f"time since): producers' or this host's clock is off; bound {bound:.0f} s")
        return None
