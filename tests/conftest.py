"""Fixtures that start real services on free loopback ports: redis-server and the Tansu broker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdog.dev.embedded import Service, start_redis, start_tansu


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_redis(workdir=tmp_path_factory.mktemp("redis"))
    yield svc
    svc.stop()


@pytest.fixture
def redis_client(redis_service: Service) -> Iterator[object]:
    """A client on the shared Redis, flushed before and after each test."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_service.port, decode_responses=True)
    client.flushall()
    yield client
    client.flushall()
    client.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Service]:
    """A Redis for this test alone, so the test may kill and restart it (append-only file on)."""
    svc = start_redis(workdir=tmp_path / "redis")
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def kafka_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_tansu(workdir=tmp_path_factory.mktemp("tansu"))
    yield svc
    svc.stop()


@pytest.fixture
def sink() -> Iterator[tuple[object, str]]:
    """A local alert receiver (``watchdog.dev.alertsink.AlertSink``) and its URL."""
    from watchdog.dev.alertsink import AlertSink

    s = AlertSink()
    url = s.start()
    yield s, url
    s.stop()


@pytest.fixture
def topic() -> str:
    """A topic name no other test uses (Tansu creates topics on first use)."""
    return f"llm.inference.logs.{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama trained offline on ``probes.tiny_model.DEFAULT_PAIRS``, with its FP8
    calibration; built once per test session (needs the torch extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from probes.engines.torch_engine import calibrate_model
    from probes.tiny_model import DEFAULT_PAIRS, ensure_tiny_model

    path = ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-cache")
    if not (path / "fp8_calibration.json").exists():
        calibrate_model(path, [p + r for p, r in DEFAULT_PAIRS])
    return path
