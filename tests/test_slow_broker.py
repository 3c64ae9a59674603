"""A slow network in front of a real Tansu broker (issue 18 item 2): the idle-partition
confirmation's wait adapts to the round trip instead of failing for ever at a fixed 1,000 ms,
and a failure is logged at WARNING; while requests keep failing, readiness names it
(``broker-slow``, watchdog/runtime/health.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaProducer

from tests.netfault import DelayProxy
from watchdog.config.settings import KafkaConfig
from watchdog.core.metrics import Metrics
from watchdog.dev.embedded import Service, free_port, start_tansu
from watchdog.ingest.consumer import Ingest, make_consumer


@pytest.fixture
def slow_broker(tmp_path: Path) -> Iterator[tuple[Service, DelayProxy]]:
    proxy_port = free_port()
    svc = start_tansu(workdir=tmp_path / "tansu", advertised_port=proxy_port)
    proxy = DelayProxy(svc.port, proxy_port)
    yield svc, proxy
    proxy.close()
    svc.kill()  # SIGTERM waits 5 s for the proxy's open connections to drain (memory storage: nothing to keep)


def test_log_end_wait_adapts_to_a_slow_broker(slow_broker: tuple[Service, DelayProxy],
                                              caplog: pytest.LogCaptureFixture) -> None:
    svc, proxy = slow_broker
    addr = f"127.0.0.1:{proxy.port}"
    producer = KafkaProducer(bootstrap_servers=addr)
    for _ in range(5):
        producer.send("slow.topic", value=b"{}", partition=0)
    producer.flush(10)
    producer.close()
    consumer = make_consumer(KafkaConfig(bootstrap_servers=addr, topic="slow.topic", group_id="slow"))
    ingest = Ingest(consumer, None, topic="slow.topic", dlq_topic="slow.topic.dlq", max_event_bytes=1 << 20,
                    metrics=Metrics(), sink=lambda *a: None, accept=lambda pk: False, broker_timeout_ms=8000)
    pk = ("slow.topic", 0)
    try:
        # log-end requests need no group membership: no poll, so no group join (slow on a loaded box)
        end = ingest.end_offsets([pk])  # a fast network: answered within the first wait
        assert end is not None and end[pk] >= 1
        assert ingest.broker_wait.timeout_ms == 1000
        proxy.delay_s = 1.5  # every answer now arrives 1.5 s late: more than the first wait
        answers = [ingest.end_offsets([pk]) for _ in range(4)]
        assert answers[0] is None  # the 1,000 ms wait times out once ...
        assert ingest.broker_wait.failures >= 1
        # the failure is visible at WARNING (it was DEBUG-only)
        assert any(r.levelname == "WARNING" and "broker request failed" in r.getMessage() for r in caplog.records)
        assert end in answers  # ... then the wait has grown and the broker's answer is read
        assert answers[-1] == end and ingest.broker_wait.failing_since is None
        assert ingest.broker_wait.timeout_ms >= 4 * 1000  # settled at ~4 x the measured answer time
    finally:
        consumer.close()
