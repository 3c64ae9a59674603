"""The loop iteration's shared deadline for work that may wait for the next iteration.

Closing windows, judging them, the judgeability pass and the checkpoint saves each had a budget of
their own (0.2 s, 0.3 s, a chunk, 0.25 s): after a window boundary at 10,000 routes they added up to
iterations of 1-2.5 s (docs/BENCHMARKS.md, "Thin windows at 10,000 routes, second pass"). ``Daemon.step``
starts one ``StepDeadline`` after its poll; each of those phases still does at least one unit of work
per iteration (a chunk of windows, a chunk of routes, one save), then stops at its own budget or at the
shared deadline, whichever comes first. Outside ``step`` (tests, benches, the drain at stop) the
deadline is never reached.
"""

from __future__ import annotations

import math
import time

#: loop work per iteration (its wait for records excluded) after which deferrable phases stop. 0.1, not
#: 0.15: each phase still does one unit past it (a chunk of windows, of routes), and at 10,000 routes
#: 0.15 s plus those units made iterations of 0.25-0.29 s at every window boundary (docs/BENCHMARKS.md,
#: "Checkpoint builds after a window boundary")
STEP_WORK_S = 0.1


class StepDeadline:
    """``until``: the ``time.monotonic()`` at which this iteration's deferrable work should stop."""

    __slots__ = ("until",)

    def __init__(self) -> None:
        self.until = math.inf

    def start(self, seconds: float = STEP_WORK_S) -> None:
        self.until = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() >= self.until


class PutOff:
    """Work that may wait for a later iteration while this one's deadline has passed, but not for ever:
    at most ``max_waits`` iterations in a row (the judgeability pass, the evidence flush)."""

    __slots__ = ("max_waits", "waited")

    def __init__(self, max_waits: int) -> None:
        self.max_waits = max_waits
        #: iterations put off in a row
        self.waited = 0

    def now(self, step: StepDeadline) -> bool:
        """True: skip the work this iteration (counted); False: do it (the count starts again)."""
        if step.passed() and self.waited < self.max_waits:
            self.waited += 1
            return True
        self.waited = 0
        return False
