"""Exponential backoff with jitter, on the monotonic clock: the one retry schedule of the project.

Used by everything that retries an outside service: the actuator (Redis), the alert channels
(HTTP), the daemon's Kafka start-up. A retry schedule must not move when the host's wall clock
steps, so ``Backoff`` reads ``time.monotonic()`` unless a test passes another clock.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable


def backoff_delay(attempt: int, initial: float, maximum: float, rng: random.Random | None = None,
                  retry_after: float | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (1 for the first retry): ``initial * 2**(attempt-1)``
    capped at ``maximum``, jittered into ``[d/2, d)`` when ``rng`` is given; a server's
    ``Retry-After`` lengthens it (never beyond ``maximum``)."""
    delay = min(maximum, initial * 2.0 ** max(0, attempt - 1))
    if rng is not None:
        delay = delay / 2 + rng.random() * delay / 2
    if retry_after is not None:
        delay = max(delay, min(retry_after, maximum))
    return delay


class Backoff:
    """Consecutive failures of one service and when the next try is due."""

    def __init__(self, initial: float, maximum: float, *, jitter: bool = True, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("backoff: need 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self.failures = 0
        self.clock = clock
        self._rng = random.Random(seed) if jitter else None
        self._next_try = 0.0

    def fail(self, retry_after: float | None = None) -> float:
        """Count a failure; returns the delay until the next try."""
        self.failures += 1
        delay = backoff_delay(self.failures, self.initial, self.maximum, self._rng, retry_after)
        self._next_try = self.clock() + delay
        return delay

    def succeed(self) -> None:
        self.failures = 0
        self._next_try = 0.0

    def ready(self) -> bool:
        """True when no failure is waiting out its delay."""
        return self.clock() >= self._next_try

    def remaining(self) -> float:
        return max(0.0, self._next_try - self.clock())
