"""Benchmark: what the idempotent producer (acks=all) costs the event emitter against acks=1 without it.

For each producer library, interleaved and repeated: a fresh ``EventEmitter`` to a local Tansu, one event
sent to connect (and, when idempotent, to get its producer id), then ``--events`` events emitted at once over
``--routes`` routes (keys), timed until the last is acknowledged. Reports events per second (first emit to
last acknowledgement, wall clock) and this process's CPU per event (all threads), medians over ``--repeats``,
and the load average. The broker runs on the same cores, so its work is inside the wall time.

    .venv/bin/python bench/emitter_acks.py [--events 20000] [--repeats 5] [--routes 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_note, median, table  # noqa: E402

from watchdog.dev.embedded import start_tansu  # noqa: E402
from watchdog.gateway.config import EventsConfig  # noqa: E402
from watchdog.ingest.emitter import EventEmitter  # noqa: E402

#: the emitter's settings before 2026-12-08, given as overrides
ACKS1 = {"confluent": {"librdkafka": {"enable.idempotence": False, "acks": 1}},
         "kafka-python": {"producer": {"enable_idempotence": False, "acks": 1}}}
MODES = ("acks=1", "idempotent")


def event(i: int, routes: int) -> dict[str, Any]:
    return {"schema": 1, "request_id": f"r{i}", "ts": time.time(), "model": "bench-model",
            "route": f"tenant-{i % routes}", "precision": "fp8", "status": "ok", "latency_ms": 1.0,
            "prompt_tokens": 12, "completion_tokens": 6, "engine": "bench-model"}


def one_run(kafka: str, topic: str, client: str, mode: str, n: int, routes: int) -> tuple[float, float, int]:
    """(events/s, CPU us/event, errors) for ``n`` events."""
    overrides = ACKS1[client] if mode == "acks=1" else {}
    em = EventEmitter(EventsConfig(bootstrap_servers=kafka, topic=topic, client=client, buffer_size=n + 10,
                                   **overrides)).start()
    try:
        em.emit(event(-1, routes))
        if not em.wait_sent(1, 30):
            raise SystemExit(f"{client} {mode}: not connected ({em.last_error})")
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            em.emit(event(i, routes))
        if not em.wait_sent(n + 1, 120):
            raise SystemExit(f"{client} {mode}: {em.sent - 1} of {n} acknowledged ({em.last_error})")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return n / wall, cpu / n * 1e6, em.errors
    finally:
        em.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--routes", type=int, default=8)
    args = ap.parse_args()
    clients = [c for c in ("confluent", "kafka-python")
               if c != "confluent" or importlib.util.find_spec("confluent_kafka") is not None]
    runs: dict[tuple[str, str], list[tuple[float, float, int]]] = {(c, m): [] for c in clients for m in MODES}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="llmwd-bench-") as workdir:
        kafka = start_tansu(workdir=Path(workdir))
        try:
            for rep in range(args.repeats):
                for client in clients:
                    modes = MODES if rep % 2 == 0 else MODES[::-1]  # neither mode always runs first
                    for mode in modes:
                        runs[(client, mode)].append(one_run(kafka.address, f"bench.acks.{client}.{MODES.index(mode)}.{rep}",
                                                            client, mode, args.events, args.routes))
                loads.append(os.getloadavg()[0])
        finally:
            kafka.kill()
    rows = []
    for client in clients:
        base = median([r[0] for r in runs[(client, "acks=1")]])
        for mode in MODES:
            rs = runs[(client, mode)]
            rate = median([r[0] for r in rs])
            rows.append([client, mode, f"{rate:,.0f}", f"{min(r[0] for r in rs):,.0f}-{max(r[0] for r in rs):,.0f}",
                         f"{rate / base:.2f}", f"{median([r[1] for r in rs]):.1f}", sum(r[2] for r in rs)])
    print(table(["producer", "settings", "events/s (median)", "range", "vs acks=1", "CPU us/event", "errors"], rows))
    print(f"({args.events} events a run over {args.routes} routes, {args.repeats} interleaved repeats; "
          f"1-min load average {min(loads):.2f}-{max(loads):.2f}; {machine_note()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
