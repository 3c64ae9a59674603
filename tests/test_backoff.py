"""core.backoff: the one retry schedule (exponential, capped, jittered into [d/2, d), Retry-After
honoured) as a table, and ``Backoff`` on a fake monotonic clock."""

from __future__ import annotations

import random
import time

import pytest

from watchdog.core.backoff import Backoff, backoff_delay


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize(("attempt", "initial", "maximum", "retry_after", "expected"), [
    (1, 0.5, 60.0, None, 0.5),
    (2, 0.5, 60.0, None, 1.0),
    (3, 0.5, 60.0, None, 2.0),
    (8, 0.5, 60.0, None, 60.0),  # 64 capped at the maximum
    (50, 0.5, 60.0, None, 60.0),  # far past the cap: no overflow
    (0, 1.0, 10.0, None, 1.0),  # attempt 0 counts as the first
    (1, 0.5, 60.0, 5.0, 5.0),  # Retry-After longer than the schedule wins
    (4, 0.5, 60.0, 1.0, 4.0),  # shorter: the schedule wins
    (1, 0.5, 60.0, 3600.0, 60.0),  # but never past the maximum
    (1, 0.5, 60.0, 0.0, 0.5),
])
def test_backoff_delay_without_jitter(attempt: int, initial: float, maximum: float, retry_after: float | None,
                                      expected: float) -> None:
    assert backoff_delay(attempt, initial, maximum, retry_after=retry_after) == expected


@pytest.mark.parametrize(("attempt", "full"), [(1, 0.5), (2, 1.0), (5, 8.0), (7, 30.0), (20, 30.0)])
def test_jitter_stays_in_the_lower_half_open_interval(attempt: int, full: float) -> None:
    rng = random.Random(11)
    delays = [backoff_delay(attempt, 0.5, 30.0, rng) for _ in range(500)]
    assert all(full / 2 <= d < full for d in delays)
    assert len(set(delays)) > 100  # actually random
    assert min(delays) < full * 0.55 and max(delays) > full * 0.95  # spread over the whole interval


@pytest.mark.parametrize(("rng_value", "expected"), [(0.0, 2.0), (0.5, 3.0), (0.999, 3.998)])
def test_jitter_maps_the_random_draw_linearly(rng_value: float, expected: float) -> None:
    class Fixed(random.Random):
        def random(self) -> float:
            return rng_value

    assert backoff_delay(3, 1.0, 60.0, Fixed()) == pytest.approx(expected)
    assert backoff_delay(3, 1.0, 60.0, Fixed(), retry_after=10.0) == 10.0  # Retry-After after jitter


def test_backoff_counts_failures_and_waits_on_its_clock() -> None:
    clock = FakeClock()
    b = Backoff(1.0, 8.0, jitter=False, clock=clock)
    assert b.ready() and b.remaining() == 0.0 and b.failures == 0
    table = [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0)]
    for failures, delay in table:
        assert b.fail() == delay and b.failures == failures
        assert not b.ready() and b.remaining() == delay
        clock.advance(delay - 0.25)
        assert not b.ready() and b.remaining() == pytest.approx(0.25)
        clock.advance(0.25)
        assert b.ready() and b.remaining() == 0.0
    b.succeed()
    assert b.failures == 0 and b.ready()
    assert b.fail() == 1.0  # the schedule starts over


def test_backoff_honours_retry_after_and_success_clears_the_wait() -> None:
    clock = FakeClock()
    b = Backoff(0.5, 30.0, jitter=False, clock=clock)
    assert b.fail(retry_after=12.0) == 12.0 and b.remaining() == 12.0
    b.succeed()
    assert b.ready() and b.remaining() == 0.0


def test_the_default_clock_is_monotonic() -> None:
    # a retry schedule must not move when the host's wall clock steps
    assert Backoff(1.0, 2.0).clock is time.monotonic


def test_jittered_backoff_is_reproducible_with_a_seed() -> None:
    def schedule(seed: int) -> list[float]:
        b = Backoff(0.5, 60.0, seed=seed, clock=FakeClock())
        return [b.fail() for _ in range(10)]

    assert schedule(3) == schedule(3) != schedule(4)
    for n, d in enumerate(schedule(3), start=1):
        full = min(60.0, 0.5 * 2 ** (n - 1))
        assert full / 2 <= d < full


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_bad_parameters_are_refused(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="0 < initial <= maximum"):
        Backoff(initial, maximum)
