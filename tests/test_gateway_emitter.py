"""The gateway's event emitter with both producer libraries, against the real broker and a dead one."""

from __future__ import annotations

import time
from typing import Any

import pytest

from watchdog.embedded import free_port
from watchdog.event_emitter import EventEmitter
from watchdog.events import decode_event
from watchdog.gateway.config import EventsConfig

pytestmark = pytest.mark.services
CLIENTS = ["kafka-python", pytest.param("confluent", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("confluent_kafka") is None, reason="confluent-kafka not installed"))]


def event(i: int) -> dict[str, Any]:
    return {"schema": 1, "request_id": f"r{i}", "ts": time.time(), "model": "m", "route": "r", "precision": "fp8",
            "status": "ok", "latency_ms": 1.5, "prompt_tokens": 3, "completion_tokens": 2}


@pytest.mark.parametrize("client", CLIENTS)
def test_events_reach_the_broker(client: str, kafka_service: Any, topic: str) -> None:
    from kafka import KafkaConsumer

    em = EventEmitter(EventsConfig(bootstrap_servers=kafka_service.address, topic=topic, client=client,
                                   flush_interval_s=0.01)).start()
    try:
        assert all(em.emit(event(i)) for i in range(20))
        assert em.wait_sent(20, 15), (em.sent, em.errors, em.last_error)
    finally:
        em.close()
    consumer = KafkaConsumer(topic, bootstrap_servers=kafka_service.address, auto_offset_reset="earliest",
                             consumer_timeout_ms=2000)
    got = sorted(decode_event(m.value).request_id for m in consumer)
    consumer.close()
    assert got == sorted(f"r{i}" for i in range(20)) and em.errors == 0


@pytest.mark.parametrize("client", CLIENTS)
def test_a_dead_broker_never_blocks_and_a_full_buffer_drops(client: str) -> None:
    em = EventEmitter(EventsConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", topic="t", client=client,
                                   buffer_size=50, librdkafka={"message.timeout.ms": 500},
                                   producer={"request_timeout_ms": 500})).start()
    try:
        t0 = time.perf_counter()
        accepted = [em.emit(event(i)) for i in range(5000)]
        assert time.perf_counter() - t0 < 1.0  # emit is a deque append, whatever the broker does
        assert em.dropped > 0 and em.dropped + em.accepted == 5000 and accepted.count(True) == em.accepted
        if client == "confluent":  # kafka-python's constructor itself waits for the broker (backoff)
            deadline = time.monotonic() + 10
            while em.errors == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert em.errors > 0
        assert em.sent == 0
    finally:
        em.close(timeout=1)
