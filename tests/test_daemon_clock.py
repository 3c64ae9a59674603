"""The daemon's time model (docs/OPERATIONS.md, "Time"): a step-free clock, the events' clock, and
close times that never run ahead of the events. The black-box clock-step drills are in
tests/drills/catalog.py (``clock-*``)."""

from __future__ import annotations

import pytest

from watchdog.ingest.eventtime import Watermarks
from watchdog.runtime.clock import SLEW_RATE, ClockCheck, SteadyClock


class Clocks:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.offset = 0.0

    def wall(self) -> float:
        return 1_790_000_000.0 + self.mono + self.offset

    def monotonic(self) -> float:
        return self.mono


def test_steady_clock_ignores_a_step_of_the_host_clock() -> None:
    c = Clocks()
    steady = SteadyClock(c.wall, c.monotonic)
    t0 = steady()
    c.mono += 10
    c.offset = 3600.0  # the host clock steps +1 h
    assert steady() - t0 == pytest.approx(10.0)
    assert steady.skew() == pytest.approx(3600.0)
    c.offset = -3600.0
    c.mono += 20
    assert steady() - t0 == pytest.approx(30.0)


@pytest.mark.parametrize("step", [30.0, -30.0])
def test_a_small_step_is_followed_by_slewing_only(step: float) -> None:
    c = Clocks()
    steady = SteadyClock(c.wall, c.monotonic)
    check = ClockCheck(steady, bound_s=300.0)
    c.offset = step
    t0 = steady()
    for _ in range(30):  # a 30 s guard, checked every second
        c.mono += 1.0
        assert check.check(None) is None  # within the bound: no clock-skew
    assert abs(steady() - t0 - 30.0) <= 30 * SLEW_RATE + 1e-9  # the guard is off by at most 15 ms
    assert 0 < steady.skew() * step / abs(step) < abs(step)  # moved toward the host clock


def test_clock_skew_is_named_while_the_host_clock_is_off_and_cleared_after() -> None:
    c = Clocks()
    steady = SteadyClock(c.wall, c.monotonic)
    check = ClockCheck(steady, bound_s=300.0)
    assert check.check(steady()) is None
    c.offset = 3600.0
    c.mono += 1
    events = steady()  # producers' clocks are right: they agree with the steady clock
    msg = check.check(events)
    assert msg and "+3600 s" in msg
    assert steady.reanchors == 0
    c.offset = 0.0
    c.mono += 1
    assert check.check(steady()) is None


def test_a_start_up_anchor_the_host_corrected_is_re_anchored_on_the_events_word() -> None:
    c = Clocks()
    c.offset = -3600.0  # started with a clock 1 h behind
    steady = SteadyClock(c.wall, c.monotonic)
    check = ClockCheck(steady, bound_s=300.0)
    c.offset = 0.0  # NTP fixed it
    c.mono += 1
    assert check.check(None)  # nothing says who is right: skew
    assert check.check(c.wall() - 2.0) is None  # the events agree with the host: re-anchored
    assert steady.reanchors == 1 and abs(steady.skew()) < 1e-6


def test_events_clock_far_from_the_host_is_skew() -> None:
    c = Clocks()
    steady = SteadyClock(c.wall, c.monotonic)
    check = ClockCheck(steady, bound_s=300.0)
    msg = check.check(steady() - 1000.0)
    assert msg and "events' clock" in msg


def test_an_idle_partition_never_closes_ahead_of_the_events_clock() -> None:
    wm = Watermarks(out_of_order_s=1.0, max_future_s=300.0)
    pk = ("t", 0)
    wm.assign(pk, None, now=100.0)
    wm.observe(pk, 100.0, now=100.0)
    wm.records_read({pk}, 100.0)
    # a confirmation stamped by a host clock 1 h ahead, read 5 s later (steady): the events' clock
    # moved 5 s, so the close time too, not 1 h
    wm.confirm_caught_up(pk, 3700.0)
    assert wm.close_time(105.0) == pytest.approx(104.0)


def test_no_event_seen_closes_nothing() -> None:
    wm = Watermarks(out_of_order_s=1.0, max_future_s=300.0)
    wm.assign(("t", 0), None, now=100.0)
    wm.confirm_caught_up(("t", 0), 100.0)
    assert wm.close_time(100.0) is None


def test_a_restored_mark_counts_as_of_its_restore() -> None:
    wm = Watermarks(out_of_order_s=1.0, max_future_s=300.0)
    wm.assign(("t", 0), 50.0, now=100.0)
    wm.confirm_caught_up(("t", 0), 110.0)
    assert wm.close_time(110.0) == pytest.approx(59.0)  # 50 + 10 s since restore - 1
    assert wm.events_now(110.0) is None  # not an events' clock for the skew check


def test_only_events_read_after_their_partition_was_caught_up_are_the_live_events_clock() -> None:
    wm = Watermarks(out_of_order_s=1.0, max_future_s=300.0)
    pk = ("t", 0)
    wm.assign(pk, None, now=1000.0)
    for off in range(5):  # a backlog: its newest event is 480 s old
        wm.observe(pk, 520.0 + off, now=1000.0, offset=off)
    assert wm.events_now(1010.0) == pytest.approx(534.0)
    assert wm.events_now(1010.0, live=True) is None
    wm.live_from({pk: 5, ("t", 9): 3})  # read to the end (a partition not assigned here is ignored)
    assert wm.events_now(1020.0, live=True) is None  # and nothing came after it
    wm.observe(pk, 1019.0, now=1020.0, offset=5)
    assert wm.events_now(1030.0, live=True) == pytest.approx(1029.0)
