"""A daemon killed with SIGKILL resumes from its committed offsets and counts every event exactly once."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from kafka import KafkaProducer

from tests.daemon_harness import MODEL, write_policy
from tests.helpers import wait_until
from watchdog.dev.embedded import free_port
from watchdog.dev.traffic import Route, TrafficGenerator

pytestmark = pytest.mark.services
ROOT = Path(__file__).resolve().parent.parent


def _start(cfg_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "watchdog.cli.main", "run", "--config", str(cfg_path)],
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


@pytest.mark.parametrize("max_poll_records", [None, 20])
def test_killed_daemon_resumes_without_loss_or_double_counting(kafka_service, redis_service, redis_client, topic,
                                                               tmp_path, max_poll_records):
    """With ``max_poll_records`` 20, ``Ingest``'s buffer holds up to 200 records taken from the consumer and
    not handed over while each restart catches up its backlog: the counts stay exact across the kill and the
    stop with the buffer in play. (A checkpoint saves the oldest open window's offset, so it is that, not
    ``Ingest.next_offset``, that keeps buffered records from counting as read here; ``position`` with a
    buffer is checked in tests/test_ingest_buffer.py.)"""
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "policies": [str(write_policy(tmp_path / "p.yaml"))],
        "kafka": {"bootstrap_servers": kafka_service.address, "topic": topic, "group_id": f"g-{topic}",
                  "session_timeout_ms": 2000, "heartbeat_interval_ms": 500,
                  **({"max_poll_records": max_poll_records} if max_poll_records else {})},
        "redis": {"url": f"redis://127.0.0.1:{redis_service.port}/0"},
        "windows": {"length_s": 1.0, "grace_s": 1.0},
        "server": {"port": free_port()},
    }))
    log_path = tmp_path / "daemon.log"
    expected: collections.Counter[tuple[str, str, float]] = collections.Counter()
    gen = TrafficGenerator([Route(MODEL, "a", rate=80.0), Route(MODEL, "b", rate=80.0)])
    producer = KafkaProducer(bootstrap_servers=kafka_service.address, linger_ms=10)
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            for r in gen.routes:
                key, value = gen.encoded(r)
                ev = json.loads(value)
                expected[(ev["route"], ev["precision"], float(int(ev["ts"])))] += 1
                producer.send(topic, key=key, value=value)
            time.sleep(1 / 80)
        producer.flush()

    def recorded() -> tuple[collections.Counter[tuple[str, str, float]], dict[tuple[str, str, float], int]]:
        seen: collections.Counter[tuple[str, str, float]] = collections.Counter()
        records: collections.Counter[tuple[str, str, float]] = collections.Counter()
        for _id, fields in redis_client.xrange("llmwd:windows"):
            w = json.loads(fields["json"])
            key = (w["route"], w["precision"], float(w["start"]))
            records[key] += 1
            seen[key] += w["samples"]
        return seen, {k: n for k, n in records.items() if n > 1}

    daemon = _start(cfg_path, log_path)
    sender = threading.Thread(target=produce)
    sender.start()
    try:
        wait_until(lambda: redis_client.xlen("llmwd:windows") >= 6, 40,
                   detail=lambda: log_path.read_text()[-3000:])
        daemon.send_signal(signal.SIGKILL)  # a crash: no shutdown
        daemon.wait(timeout=10)
        before = redis_client.xlen("llmwd:windows")
        time.sleep(1.5)
        daemon = _start(cfg_path, log_path)
        wait_until(lambda: redis_client.xlen("llmwd:windows") >= before + 6, 60,
                   detail=lambda: log_path.read_text()[-3000:])
        t0 = time.monotonic()
        daemon.send_signal(signal.SIGTERM)  # a rolling deploy: checkpoint the half-filled windows and exit
        assert daemon.wait(timeout=10) == 0, log_path.read_text()[-3000:]
        assert time.monotonic() - t0 < 10
        before = redis_client.xlen("llmwd:windows")
        daemon = _start(cfg_path, log_path)
        wait_until(lambda: redis_client.xlen("llmwd:windows") >= before + 6, 60,
                   detail=lambda: log_path.read_text()[-3000:])
    finally:
        stop.set()
        sender.join()
        producer.close()
    # traffic stopped: the partitions go idle, the broker confirms it, and the last windows close
    total = sum(expected.values())
    wait_until(lambda: sum(recorded()[0].values()) >= total, 30,
               detail=lambda: (sum(recorded()[0].values()), total))
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=10) == 0, log_path.read_text()[-3000:]
    seen, dupes = recorded()
    assert not dupes, f"windows recorded twice: {dupes}"
    diff = {k: (seen.get(k, 0), n) for k, n in sorted(expected.items()) if seen.get(k, 0) != n}
    assert sum(seen.values()) == total, (sum(seen.values()), total, diff)
    assert seen == expected


def test_a_backlog_spread_over_partitions_is_counted_in_full(kafka_service, redis_service, redis_client, topic,
                                                            tmp_path):
    """Events published before the daemon starts, keyed by route over several partitions, are read
    unevenly across partitions; windows must close on the slowest partition's event time."""
    from tests.daemon_harness import make_config, running_daemon

    gen = TrafficGenerator([Route(MODEL, f"r{i}", rate=50.0) for i in range(8)])
    producer = KafkaProducer(bootstrap_servers=kafka_service.address, linger_ms=20)
    expected: collections.Counter[tuple[str, str, float]] = collections.Counter()
    start = time.time() - 30.0
    for step in range(30 * 50):  # 30 s of history at 50 events/s per route
        now = start + step / 50.0
        for r in gen.routes:
            key, value = gen.encoded(r, now=now)
            ev = json.loads(value)
            expected[(ev["route"], ev["precision"], float(int(ev["ts"])))] += 1
            producer.send(topic, key=key, value=value)
    producer.flush()
    producer.close()
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    with running_daemon(cfg) as (daemon, _server):
        wait_until(lambda: daemon.metrics.events.labels("ok")._value.get() >= sum(expected.values()), 60)
        wait_until(lambda: sum(p.agg.open_windows() for p in daemon.parts.values()) == 0, 20)
        late = daemon.metrics.dlq.labels("late")._value.get()
    seen: collections.Counter[tuple[str, str, float]] = collections.Counter()
    for _id, fields in redis_client.xrange("llmwd:windows"):
        w = json.loads(fields["json"])
        seen[(w["route"], w["precision"], float(w["start"]))] += w["samples"]
    assert late == 0
    assert seen == expected
