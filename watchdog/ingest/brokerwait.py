"""How long the loop waits for the broker's answer to a log-end or position request.

A fixed wait fails for ever on a slow network (an outside drill: at a 1 s round trip a 1,000 ms
wait never confirmed an idle partition, so nothing was decided for the whole fault, silently).
The wait starts at ``START_MS``, doubles after a timeout up to the configured ceiling, and after
an answer settles at four times the answer's own duration (never below ``START_MS``). Failures
are logged at WARNING (the first, then at most once a minute) and remembered for readiness.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: the first wait, and the floor of the adapted one
START_MS = 1000
#: seconds between two WARNING lines about failing requests
LOG_EVERY_S = 60.0


class BrokerWait:
    def __init__(self, ceiling_ms: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ceiling_ms = max(int(ceiling_ms), 1)
        self.clock = clock
        self.timeout_ms = min(START_MS, self.ceiling_ms)
        #: seconds the last answered request took
        self.last_s: float | None = None
        #: since when (``clock``) every request failed; None while they are answered
        self.failing_since: float | None = None
        self.last_error = ""
        self.failures = 0
        self._logged = -1e18

    def answered(self, took_s: float) -> None:
        self.last_s = took_s
        self.timeout_ms = min(self.ceiling_ms, max(START_MS, int(4000 * took_s)))
        if self.failing_since is not None:
            log.warning("broker answers again (%.2f s); waiting up to %d ms", took_s, self.timeout_ms)
        self.failing_since = None

    def failed(self, what: str, exc: BaseException) -> None:
        now = self.clock()
        self.failures += 1
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"[:200]
        if self.failing_since is None:
            self.failing_since = now
        if now - self._logged >= LOG_EVERY_S:
            self._logged = now
            log.warning("broker request failed after waiting %d ms (%s); next wait %d ms", self.timeout_ms,
                        self.last_error, min(self.ceiling_ms, 2 * self.timeout_ms))
        self.timeout_ms = min(self.ceiling_ms, 2 * self.timeout_ms)
