"""A poll that finds no record leaves no live cycle holding the fetch in flight
(``watchdog.ingest.consumer.drop_spent_wakeups``): with the main loop freezing what survives an
iteration, such cycles kept dead fetch responses until a full collection."""

from __future__ import annotations

import gc
import time

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaTimeoutError

from watchdog.ingest.consumer import drop_spent_wakeups

pytestmark = pytest.mark.services


def _live_timeouts() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, KafkaTimeoutError))


def _idle_polls(consumer: KafkaConsumer, drop: bool) -> int:
    taken = 0
    for _ in range(20):
        consumer.poll(timeout_ms=0)
        if drop:
            taken += drop_spent_wakeups(consumer)
    return taken


def test_idle_polls_leave_no_timeout_cycle_alive(kafka_service, topic):
    producer = KafkaProducer(bootstrap_servers=kafka_service.address)
    producer.send(topic, b"x").get(timeout=10)
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=kafka_service.address, enable_auto_commit=False,
                             fetch_max_wait_ms=2000)  # fetches stay in flight on an idle partition
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        deadline = time.monotonic() + 10
        while not consumer.poll(timeout_ms=100) and time.monotonic() < deadline:
            pass
        # drained: every poll now waits on a fetch the broker holds, and times out at once
        assert _idle_polls(consumer, drop=True) > 0
        assert _live_timeouts() == 0
        # the same polls without it keep each timed-out wait's exception alive with its frames
        _idle_polls(consumer, drop=False)
        assert _live_timeouts() > 0
    finally:
        consumer.close()
