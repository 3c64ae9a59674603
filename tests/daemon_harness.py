"""Helpers for end-to-end tests: a daemon with real Kafka (Tansu), real Redis and a real alert sink."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kafka import KafkaProducer

from watchdog.config.settings import Config, load_config
from watchdog.dev.embedded import free_port
from watchdog.dev.traffic import Route, TrafficGenerator
from watchdog.runtime.daemon import Daemon
from watchdog.runtime.http import StatusServer

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
    return load_config(None, **daemon_cfg(kafka_address, redis_port, topic, policy, sink_url, **overrides))


@contextmanager
def running_daemon(cfg: Config, **daemon_kwargs: Any) -> Iterator[tuple[Daemon, StatusServer]]:
    daemon = Daemon(cfg, **daemon_kwargs)
    server = StatusServer(cfg.server.host, cfg.server.port, daemon.metrics.registry, daemon.status,
                          daemon.problems, daemon.alive, pages=daemon.evidence_pages).start()
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


class CountingProducer:
    """Sends events of ``routes`` at ``rate`` per route from a thread; counts each one when the broker
    acknowledges it, by (route, precision, window start) for windows of ``length_s``."""

    def __init__(self, kafka_address: str, topic: str, routes: list[str], rate: float = 60.0,
                 length_s: float = 1.0) -> None:
        import collections

        self.topic = topic
        self.length_s = length_s
        self.gen = TrafficGenerator([Route(MODEL, r, rate=rate) for r in routes])
        self.rate = rate
        self.producer = KafkaProducer(bootstrap_servers=kafka_address, linger_ms=10)
        self.acked: collections.Counter[tuple[str, str, float]] = collections.Counter()
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _key(self, value: bytes) -> tuple[str, str, float]:
        import json
        import math

        ev = json.loads(value)
        return ev["route"], ev["precision"], math.floor(ev["ts"] / self.length_s) * self.length_s

    def send(self, key: bytes, value: bytes, counted: bool = True) -> Any:
        fut = self.producer.send(self.topic, key=key, value=value)
        if counted:
            k = self._key(value)

            def ok(_md: Any) -> None:
                with self._lock:
                    self.acked[k] += 1

            def bad(_exc: Any) -> None:
                with self._lock:
                    self.failed += 1

            fut.add_callback(ok)
            fut.add_errback(bad)
        return fut

    def _run(self) -> None:
        while not self._stop.is_set():
            for r in self.gen.routes:
                self.send(*self.gen.encoded(r))
            self._stop.wait(1 / self.rate)

    def start(self) -> CountingProducer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.producer.flush(timeout=30)
        self.producer.close(timeout=5)

    def total(self) -> int:
        with self._lock:
            return sum(self.acked.values())


def recorded_windows(redis_client: Any, prefix: str = "llmwd") -> tuple[dict[tuple[str, str, float], int], int]:
    """(samples per (route, precision, window start) in the windows stream, windows recorded twice)."""
    import collections
    import json

    seen: collections.Counter[tuple[str, str, float]] = collections.Counter()
    records: collections.Counter[tuple[str, str, float]] = collections.Counter()
    for _id, fields in redis_client.xrange(f"{prefix}:windows"):
        w = json.loads(fields["json"])
        key = (w["route"], w["precision"], float(w["start"]))
        records[key] += 1
        seen[key] += w["samples"]
    return dict(seen), sum(n - 1 for n in records.values() if n > 1)


def start_daemon_process(cfg: dict[str, Any], tmp_path: Path, name: str = "daemon") -> Any:
    """``python -m watchdog.cli.main run`` on ``cfg`` (written as YAML), output appended to ``tmp_path/name.log``."""
    import os
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parent.parent
    cfg_path = tmp_path / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.Popen([sys.executable, "-m", "watchdog.cli.main", "run", "--config", str(cfg_path)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)


def daemon_cfg(kafka_address: str, redis_port: int, topic: str, policy: Path, sink_url: str | None,
               **overrides: Any) -> dict[str, Any]:
    """The test config as a plain dict (for a daemon subprocess); ``make_config`` validates it."""
    channels = [{"kind": "webhook", "url": f"{sink_url}/webhook"}] if sink_url else []
    # session 2 s: Tansu answers a group join after about half the session timeout (6 s took 3 s per
    # daemon start and per rebalance, 2 s takes 1 s); heartbeats every 0.5 s keep 4 per session
    data: dict[str, Any] = {
        "policies": [str(policy)],
        "kafka": {"bootstrap_servers": kafka_address, "topic": topic, "group_id": f"g-{topic}",
                  "session_timeout_ms": 2000, "heartbeat_interval_ms": 500},
        "redis": {"url": f"redis://127.0.0.1:{redis_port}/0", "socket_timeout_s": 0.5},
        "windows": {"length_s": 1.0, "grace_s": 0.3},
        "alerts": {"channels": channels},
        "server": {"port": free_port()},
        "policy_poll_s": 0.2,
    }
    data.update(overrides)
    return data
