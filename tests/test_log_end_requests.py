"""The idle-partition check's log-end request must not wait behind the reading consumer's long poll.

On the reading consumer's own connection a ListOffsets request queues behind the Fetch in flight,
which the broker holds for ``fetch_max_wait_ms`` when the partitions are quiet: the daemon's loop
waited up to 500 ms (the default) every time it confirmed an idle partition. The daemon asks through
a consumer of no group on its own connection (``make_offsets_consumer``)."""

from __future__ import annotations

import time
from typing import Any

from kafka import KafkaProducer

from watchdog.config.settings import KafkaConfig
from watchdog.core.metrics import Metrics
from watchdog.ingest.consumer import Ingest, TopicPartition, make_consumer, make_offsets_consumer

#: the reading consumer's long-poll wait here: far longer than a log-end answer takes on a loaded box
LONG_POLL_MS = 2000


def _after_a_quiet_poll(consumer: Any, ask: Any) -> tuple[Any, float]:
    consumer.poll(timeout_ms=50)  # at the log end: the next fetch goes out and the broker holds it
    started = time.monotonic()
    ends = ask()
    return ends, time.monotonic() - started


def test_log_end_requests_do_not_queue_behind_the_long_poll(kafka_service: Any, topic: str) -> None:
    addr = kafka_service.address
    producer = KafkaProducer(bootstrap_servers=addr)
    for _ in range(3):
        producer.send(topic, value=b"{}", partition=0)
    producer.flush(10)
    producer.close()
    cfg = KafkaConfig(bootstrap_servers=addr, topic=topic, group_id=f"g-{topic}")
    pk = (topic, 0)
    consumer = make_consumer(cfg, fetch_max_wait_ms=LONG_POLL_MS)
    offsets = make_offsets_consumer(cfg)
    ingest = Ingest(consumer, None, topic=topic, dlq_topic=f"{topic}.dlq", max_event_bytes=1 << 20,
                    metrics=Metrics(), sink=lambda *a: None, broker_timeout_ms=3 * LONG_POLL_MS, offsets=offsets)
    try:
        deadline = time.monotonic() + 60
        while (consumer.position(TopicPartition(*pk)) if consumer.assignment() else 0) < 3:
            assert time.monotonic() < deadline, "the group was not joined"
            consumer.poll(timeout_ms=200)
        # on the reading connection the request waits for the held fetch (so the test can fail) ...
        ends, took = _after_a_quiet_poll(consumer, lambda: consumer.end_offsets([TopicPartition(*pk)]))
        assert took > LONG_POLL_MS / 1000 / 2, took
        end = ends[TopicPartition(*pk)]
        # ... the daemon's, on a connection of its own, does not
        for _ in range(3):
            ends, took = _after_a_quiet_poll(consumer, lambda: ingest.end_offsets([pk]))
            assert ends == {pk: end} and took < LONG_POLL_MS / 1000 / 2, took
        assert offsets.config["group_id"] is None  # it joins no group
    finally:
        consumer.close()
        offsets.close()
