"""Minimal reproduction: a consumer that leaves while its group is still joining, then a new member.

Starts Tansu, creates a topic, lets consumer A start joining the group and closes it (as SIGTERM
during start-up does) before it gets an assignment, then starts consumer B in the same group and
reports how long B waits for partitions (capped at ``--wait``). The daemon reports this state as the
not-ready reason ``unassigned`` after ``kafka.unassigned_grace_s``.

    .venv/bin/python bench/tansu_wedge.py [--leave-after 1.0] [--wait 60]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafka import KafkaConsumer, KafkaProducer  # noqa: E402

from watchdog.dev.embedded import start_tansu  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leave-after", type=float, default=1.0, help="seconds A spends joining before it closes")
    ap.add_argument("--wait", type=float, default=60.0)
    args = ap.parse_args()
    svc = start_tansu()
    try:
        topic, group = f"wedge.{uuid.uuid4().hex[:6]}", f"g-{uuid.uuid4().hex[:6]}"
        p = KafkaProducer(bootstrap_servers=svc.address)
        p.send(topic, b"x").get(10)
        p.close()
        opts = {"bootstrap_servers": svc.address, "group_id": group, "session_timeout_ms": 6000,
                "heartbeat_interval_ms": 1000, "enable_auto_commit": False}
        a = KafkaConsumer(topic, **opts)
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.leave_after:
            a.poll(timeout_ms=100)
        print(f"A assigned before leaving: {sorted(tp.partition for tp in a.assignment())}")
        a.close(autocommit=False)
        b = KafkaConsumer(topic, **opts)
        t0 = time.monotonic()
        while not b.assignment() and time.monotonic() - t0 < args.wait:
            b.poll(timeout_ms=200)
        waited = time.monotonic() - t0
        got = sorted(tp.partition for tp in b.assignment())
        print(f"B assigned {got} after {waited:.1f} s" if got else f"B: NO assignment after {waited:.0f} s (wedged)")
        b.close(autocommit=False)
    finally:
        svc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
