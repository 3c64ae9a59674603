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


def _live_timeouts(consumer: KafkaConsumer) -> int:
    """Timeouts alive after a full collection that this consumer's polls raised (other tests' may linger;
    a daemon loop of another test may have frozen them)."""
    gc.unfreeze()
    gc.collect()
    fetcher = consumer._fetcher
    n = 0
    for o in gc.get_objects():
        if type(o) is KafkaTimeoutError:  # not isinstance: some objects warn on a __class__ lookup (torch)
            tb = o.__traceback__
            while tb is not None and tb.tb_frame.f_locals.get("self") is not fetcher:
                tb = tb.tb_next
            n += tb is not None
    return n


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
        taken = _idle_polls(consumer, drop=True)
        assert taken > 0
        assert _live_timeouts(consumer) == 0, taken
        # the same polls without it keep each timed-out wait's exception alive with its frames while the
        # fetch it waited on is in flight (a broker may answer an idle fetch early: then again)
        for _ in range(10):
            _idle_polls(consumer, drop=False)
            if any(not f.is_done for f in consumer._fetcher._fetch_futures) and _live_timeouts(consumer) > 0:
                break
        else:
            pytest.fail("no timed-out wait outlived its poll without drop_spent_wakeups")
    finally:
        consumer.close()
