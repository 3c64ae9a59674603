"""Shared helpers for the spine benchmarks: local services, a pre-produced topic, tables, statistics.

Every benchmark starts its own Tansu broker and Redis on free loopback ports
(``watchdog.dev.embedded``) and stops them when it ends, whatever happens.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from watchdog.dev.embedded import Service, start_redis, start_tansu  # noqa: E402
from watchdog.dev.traffic import Route, TrafficGenerator  # noqa: E402

MODEL = "llama-3-8b-instruct"


@dataclass
class Services:
    kafka: Service
    redis: Service
    workdir: Path

    @property
    def kafka_address(self) -> str:
        return self.kafka.address

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}/0"


@contextlib.contextmanager
def services() -> Iterator[Services]:
    """Tansu + Redis on free ports in a temporary directory, removed afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="llmwd-bench-"))
    kafka = redis = None
    try:
        kafka = start_tansu(workdir=workdir / "tansu")
        redis = start_redis(workdir=workdir / "redis", appendonly=False)
        yield Services(kafka, redis, workdir)
    finally:
        for svc in (redis, kafka):
            if svc is not None:
                svc.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def route_names(n: int) -> list[str]:
    return [f"tenant-{i:04d}" for i in range(n)]


def create_topic(address: str, topic: str, partitions: int = 1) -> None:
    """Create ``topic`` explicitly (Tansu would auto-create it with 4 partitions)."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=address)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()


def produce_events(address: str, topic: str, n_events: int, n_routes: int, *, events_per_s: float,
                   end_ts: float, seed: int = 11, shadow_share: float = 0.3,
                   partitions: int = 1) -> tuple[int, float]:
    """Produce ``n_events`` realistic events spread evenly over ``n_routes`` routes with explicit
    timestamps ending at ``end_ts`` (event time advancing ``events_per_s``), into a new topic of
    ``partitions`` partitions. Returns (bytes, seconds)."""
    from kafka import KafkaProducer

    create_topic(address, topic, partitions)

    gen = TrafficGenerator([Route(MODEL, r, shadow_share=shadow_share) for r in route_names(n_routes)], seed=seed)
    producer = KafkaProducer(bootstrap_servers=address, linger_ms=20, batch_size=256 * 1024)
    start_ts = end_ts - n_events / events_per_s
    total = 0
    t0 = time.perf_counter()
    try:
        for i in range(n_events):
            r = gen.routes[gen.rng.randrange(n_routes)]
            key, value = gen.encoded(r, now=round(start_ts + i / events_per_s, 3))
            total += len(value)
            producer.send(topic, key=key, value=value)
        producer.flush(timeout=120)
    finally:
        producer.close(timeout=10)
    return total, time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = max(0, math.ceil(q / 100.0 * len(s)) - 1)
    return s[k]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable on a terminal)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def machine_note() -> str:
    load = os.getloadavg()
    return (f"cpus={os.cpu_count()} load_avg={load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} "
            f"python={sys.version.split()[0]}")


def committed(admin: Any, group: str, topic: str) -> int:
    """Records of ``topic`` the consumer group's committed offsets cover (summed over partitions)."""
    offsets = admin.list_group_offsets(group).get(group, {})
    return sum(o.offset for tp, o in offsets.items() if tp.topic == topic and o.offset >= 0)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads), from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
