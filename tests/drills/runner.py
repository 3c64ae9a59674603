"""One drill run: the stack, traffic, readiness sampling, fault marks, and the final count."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.drills.harness import Guards, ReadinessSampler, Stack, Traffic, read_topic
from tests.drills.ledger import (
    Expect,
    Result,
    audit_flips,
    check_flips,
    check_pages,
    check_readiness,
    compare_counts,
    recorded_windows,
)
from tests.helpers import WaitTimeout, wait_until

log = logging.getLogger(__name__)

ROUTES = ["r0", "r1", "r2", "r3"]
#: a consumer recording nothing for this long while events arrive is stalled: something is wrong
STALL_S = 12.0
#: the daemons' Kafka session in ms where set (tests/test_drills.py: 2000); else Stack's 6000
SESSION_ENV = "LLMWD_DRILL_SESSION_MS"


class Drill:
    """``with Drill(name, root, workdir, full) as d: ...; return d.finish()``

    Starts Tansu, Redis, the alert sink and the replicas; ``traffic`` runs at ``rate`` events/s
    over ``ROUTES``. ``fault(what)`` marks an interval in which readiness must be false. ``finish``
    keeps traffic running ``settle_s`` past the cutoff (so event-time windows can close), waits for
    the count to settle, stops everything and scores the run.
    """

    def __init__(self, name: str, root: Path, workdir: Path, full: bool, *, rate: float = 120.0,
                 routes: list[str] | None = None, guards: Guards | None = None,
                 producer_kw: dict[str, Any] | None = None, **stack_kw: Any) -> None:
        self.name = name
        self.full = full
        self.t0 = time.time()
        self.expect = Expect()
        self.guards = guards or Guards()
        self.result = Result(drill=name, tree=str(root))
        self.routes = routes or list(ROUTES)
        self.rate = rate
        self.producer_kw = producer_kw or {}
        session_ms = os.environ.get(SESSION_ENV)
        if session_ms and not stack_kw.get("broker_proxy") and stack_kw.get("storage", "memory") == "memory":
            # tests/test_drills.py sets 2000: each group join takes 1 s, not 3 s; a slowed broker link
            # (1 s per answer) and S3 storage keep the 6 s of bench/drills.py (docs/RELIABILITY.md)
            stack_kw.setdefault("session_timeout_ms", int(session_ms))
        self.stack = Stack(root=root, workdir=workdir / name, **stack_kw)
        self.traffic: Traffic | None = None
        self.sampler: ReadinessSampler | None = None
        self.extra_traffic: list[Traffic] = []
        #: valid events sent on purpose outside the ledger (future-stamped ones), for broker_check
        self.uncounted = 0

    def __enter__(self) -> Drill:
        self.stack.start_services()
        self.sampler = ReadinessSampler(self.stack.daemons).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.traffic is not None:
            self.traffic.stop()
        for t in self.extra_traffic:
            t.stop()
        if self.sampler is not None:
            self.sampler.stop()
        self.stack.close()

    # -- helpers for drill bodies ---------------------------------------------------------------
    @property
    def daemon(self) -> Any:
        return self.stack.daemons[0]

    def start(self, wait_windows: int = 4, timeout: float = 45.0) -> None:
        """Start every replica and the traffic; wait until windows are being recorded."""
        for d in self.stack.daemons:
            d.start()
        self.traffic = self.stack.traffic(self.routes, self.rate, **self.producer_kw).start()
        try:
            wait_until(lambda: self.windows_recorded() >= wait_windows, timeout, 0.2)
        except WaitTimeout:
            self.result.notes.append(f"no windows recorded {timeout:.0f} s after start")

    def windows_recorded(self) -> int:
        try:
            return int(self.stack.client().xlen("llmwd:windows"))
        except Exception:  # noqa: BLE001 - Redis down in this drill
            return 0

    def flips(self) -> list[dict[str, Any]]:
        return audit_flips(self.stack.stream("audit"))

    def wait_flip(self, route: str, kind: str, timeout: float) -> float | None:
        """Wait for an applied flip; return its audit time."""
        found: list[float] = []

        def seen() -> bool:
            with contextlib.suppress(Exception):
                hits = [f["at"] for f in self.flips() if f["route"] == route and f["kind"] == kind]
                if hits:
                    found.append(hits[-1])
                    return True
            return False

        with contextlib.suppress(WaitTimeout):
            wait_until(seen, timeout, 0.5)
        return found[-1] if found else None

    @contextlib.contextmanager
    def fault(self, what: str, replica: str | None = None) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.expect.faults.append((start, time.time(), what, replica))

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def note(self, text: str) -> None:
        self.result.notes.append(text)

    # -- the end ------------------------------------------------------------------------------
    def finish(self, settle_s: float | None = None, wait_s: float | None = None) -> Result:
        settle_s = settle_s if settle_s is not None else (6.0 if self.full else 4.0)
        wait_s = wait_s if wait_s is not None else (30.0 if self.full else 15.0)
        assert self.traffic is not None
        cutoff = self.traffic.window_of(time.time())
        self.expect.cutoff = cutoff
        time.sleep(settle_s)
        # count settled: every window before the cutoff is recorded (or the wait ran out)
        def settled() -> bool:
            produced = self.produced()
            samples, _ = recorded_windows(self.stack.stream("windows"))
            want = sum(n for k, n in produced.items() if k[2] < cutoff)
            return sum(n for k, n in samples.items() if k[2] < cutoff) >= want
        with contextlib.suppress(WaitTimeout):  # the counts below say what is missing
            wait_until(settled, wait_s, 0.5)
        self.traffic.stop()
        for t in self.extra_traffic:
            t.stop()
        assert self.sampler is not None
        self.sampler.stop()
        try:
            self.broker_check()
        except Exception as exc:  # noqa: BLE001 - the broker may be what the drill broke
            self.note(f"broker read-back failed: {type(exc).__name__}")
        return self.score()

    def produced(self) -> Any:
        assert self.traffic is not None
        total = self.traffic.snapshot()
        for t in self.extra_traffic:
            total.update(t.snapshot())
        return total

    def score(self) -> Result:
        r = self.result
        assert self.traffic is not None and self.sampler is not None
        r.seconds = round(time.time() - self.t0, 1)
        r.produce_failed = self.traffic.failed + sum(t.failed for t in self.extra_traffic)
        windows = self.stack.stream("windows")
        samples, records = recorded_windows(windows)
        compare_counts(r, self.produced(), samples, records, self.expect.cutoff)
        flips = self.flips()
        check_flips(r, flips, self.expect, self.guards)
        assert self.stack.sink is not None
        check_pages(r, list(self.stack.sink.received), flips, self.expect)
        self.expect.faults.extend(self._stalls(windows))
        downtime = {d.name: d.down for d in self.stack.daemons}
        check_readiness(r, self.sampler.samples, self.expect, downtime, self.sampler.every_s)  # type: ignore[arg-type]
        for d in self.stack.daemons:
            d.note_exit()
            for at, rc in d.deaths:
                r.deaths.append(f"{d.name} exited rc {rc} at +{at - self.t0:.1f} s")
            if self.expect.must_survive and not d.running() and not d.deaths:
                r.deaths.append(f"{d.name} not running at the end")
        return r

    def _stalls(self, windows: list[tuple[str, dict[str, str]]]) -> list[tuple[float, float, str, str | None]]:
        """Gaps of more than STALL_S between recorded windows while every replica was up and traffic
        flowed: a stalled consumer that readiness must report."""
        times = [int(i.split("-")[0]) / 1000 for i, _ in windows if int(i.split("-")[0]) / 1000 >= self.t0]
        out = []
        start = min((d.down[0][1] or self.t0) for d in self.stack.daemons) if self.stack.daemons else self.t0
        end = time.time()
        points = [start + 5.0, *times, end]
        for a, b in zip(points, points[1:], strict=False):
            if b - a > STALL_S:
                out.append((a + STALL_S, b, "stalled: no windows recorded", None))
        if end - points[-2] > STALL_S:
            self.note(f"consumer stalled at the end: no window recorded for the last {end - points[-2]:.0f} s "
                      "(its unrecorded events count as lost)")
        return out

    def broker_check(self) -> None:
        """Compare the acked count with what the broker holds (by request id) and note a mismatch."""
        assert self.stack.tansu is not None
        idle = 5.0 if self.stack.storage == "s3" else 2.0  # S3-backed fetches are slow to start
        ids = read_topic(self.stack.tansu.address, self.stack.topic, self.stack.partitions, idle_s=idle, limit_s=60)
        acked = sum(self.produced().values()) + self.uncounted
        held = sum(n for k, n in ids.items() if k != "<invalid>")
        self.result.broker_mismatch = held - acked
        if held != acked:
            self.note(f"broker holds {held} events, {acked} acked")
