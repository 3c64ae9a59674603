"""Helpers for end-to-end tests: a daemon with real Kafka (Tansu), real Redis and a real alert sink."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kafka import KafkaProducer

from watchdog.config import Config, load_config
from watchdog.daemon import Daemon
from watchdog.embedded import free_port
from watchdog.server import StatusServer
from watchdog.traffic import Route, TrafficGenerator

MODEL = "llama-test"

POLICY = """\
policies:
  - name: e2e
    description: test policy with short windows
    scope: {{models: ["*"], routes: ["*"]}}
    dry_run: {dry_run}
    cooldown: 0s
    max_flips_per_day: 10
    rules:
      - name: shadow-agreement
        source: live
        metric: shadow_rougeL
        fail_if: "candidate < 0.85"
        min_samples: 5
        for: 2
        severity: critical
        action: rollback
      - name: error-rate
        source: live
        metric: error_rate
        fail_if: "candidate - baseline > 0.08"
        min_samples: 20
        for: 2
        severity: critical
        action: rollback
    promote: {{mode: manual}}
"""


def write_policy(path: Path, dry_run: bool = False) -> Path:
    path.write_text(POLICY.format(dry_run=str(dry_run).lower()))
    return path


def make_config(kafka_address: str, redis_port: int, topic: str, policy: Path, sink_url: str | None,
                **overrides: Any) -> Config:
    channels = [{"kind": "webhook", "url": f"{sink_url}/webhook"}] if sink_url else []
    data: dict[str, Any] = {
        "policies": [str(policy)],
        "kafka": {"bootstrap_servers": kafka_address, "topic": topic, "group_id": f"g-{topic}",
                  "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        "redis": {"url": f"redis://127.0.0.1:{redis_port}/0", "socket_timeout_s": 0.5},
        "windows": {"length_s": 1.0, "grace_s": 0.3},
        "alerts": {"channels": channels},
        "server": {"port": free_port()},
        "policy_poll_s": 0.2,
    }
    data.update(overrides)
    return load_config(None, **data)


@contextmanager
def running_daemon(cfg: Config, **daemon_kwargs: Any) -> Iterator[tuple[Daemon, StatusServer]]:
    daemon = Daemon(cfg, **daemon_kwargs)
    server = StatusServer(cfg.server.host, cfg.server.port, daemon.metrics.registry, daemon.status,
                          daemon.problems, daemon.alive).start()
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        yield daemon, server
    finally:
        daemon.stop()
        thread.join(timeout=30)
        server.stop()
        assert not thread.is_alive(), "daemon did not stop"


@contextmanager
def traffic(kafka_address: str, topic: str, routes: list[str], precision_of: Callable[[str, str], str],
            rate: float = 60.0) -> Iterator[TrafficGenerator]:
    producer = KafkaProducer(bootstrap_servers=kafka_address, linger_ms=10)
    gen = TrafficGenerator([Route(MODEL, r, rate=rate) for r in routes], precision_of=precision_of)
    gen.start(producer, topic)
    try:
        yield gen
    finally:
        gen.stop()
        producer.close(timeout=5)


def wait_until(cond: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())
