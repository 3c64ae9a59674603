"""``Ingest``'s own buffer of records (watchdog/ingest/consumer.py ``poll``): a refill takes everything the
consumer has fetched, so that its next fetch travels while the loop works, yet each ``poll`` hands over
at most ``max_poll_records``, every record once and in order; what is buffered is never counted as read
(``position``, the offset a checkpoint falls back to), a seek drops it and a paused partition keeps it."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewTopic
from kafka.structs import TopicPartition

from watchdog.config.settings import KafkaConfig
from watchdog.core.events import InferenceEvent, encode_event
from watchdog.core.metrics import Metrics
from watchdog.ingest.consumer import Ingest, make_consumer

pytestmark = pytest.mark.services

N = 3000
PER_POLL = 200


def _produce(address: str, topic: str) -> None:
    admin = KafkaAdminClient(bootstrap_servers=address)  # one partition (Tansu would make 4)
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        admin.close()
    producer = KafkaProducer(bootstrap_servers=address, linger_ms=20, batch_size=256 * 1024)
    for i in range(N):
        producer.send(topic, encode_event({
            "schema": 1, "request_id": f"q{i}", "ts": time.time(), "model": "m", "route": "r",
            "precision": "fp8", "status": "ok", "latency_ms": 10.0 + i, "prompt_tokens": 5, "completion_tokens": 7}))
    producer.flush(30)
    producer.close()


def _ingest(address: str, topic: str, got: list[tuple[int, InferenceEvent]]) -> Ingest:
    cfg = KafkaConfig(bootstrap_servers=address, topic=topic, group_id=f"g-{uuid.uuid4().hex[:6]}",
                      session_timeout_ms=2000, heartbeat_interval_ms=500, max_poll_records=PER_POLL,
                      auto_offset_reset="earliest")
    return Ingest(make_consumer(cfg), None, topic=topic, dlq_topic=cfg.dead_letter_topic, max_event_bytes=1 << 20,
                  metrics=Metrics(), sink=lambda ev, pk, off: got.append((off, ev)))


def _poll_until(ingest: Ingest, got: list[Any], want: int, sizes: list[int] | None = None) -> None:
    deadline = time.monotonic() + 30
    while len(got) < want and time.monotonic() < deadline:
        n = ingest.poll(100)
        if sizes is not None and n:
            sizes.append(n)
    assert len(got) >= want, f"{len(got)} of {want} records within 30 s"


def test_each_poll_hands_at_most_one_polls_worth_of_what_a_refill_took_every_record_once_in_order(
        kafka_service: Any, topic: str) -> None:
    _produce(kafka_service.address, topic)
    got: list[tuple[int, InferenceEvent]] = []
    ingest = _ingest(kafka_service.address, topic, got)
    pk = (topic, 0)
    sizes: list[int] = []
    buffered_beyond_one_poll = False
    try:
        _poll_until(ingest, got, 1, sizes)
        deadline = time.monotonic() + 30
        while len(got) < N and time.monotonic() < deadline:
            held = ingest._buffer.get(TopicPartition(*pk))
            if held and len(held[0]) - held[1] > PER_POLL:
                buffered_beyond_one_poll = True
                # what waits in the buffer is not read: the position is its first record, the consumer's is past it
                assert ingest.position(pk) == held[0][held[1]].offset == ingest.next_offset[pk]
                assert ingest.consumer.position(TopicPartition(*pk)) > ingest.position(pk)
                assert ingest.reading_behind() and ingest.holds(pk)
            n = ingest.poll(100)
            if n:
                sizes.append(n)
    finally:
        ingest.close()
    assert [off for off, _ in got] == list(range(N))  # every record once, in order
    assert [ev.request_id for _, ev in got] == [f"q{i}" for i in range(N)]
    assert max(sizes) <= PER_POLL
    assert buffered_beyond_one_poll, "no refill took more than one poll's worth of records"
    assert ingest.next_offset[pk] == N and not ingest.holds(pk)


def test_a_seek_drops_the_buffered_records_and_a_paused_partition_keeps_them(kafka_service: Any, topic: str) -> None:
    _produce(kafka_service.address, topic)
    got: list[tuple[int, InferenceEvent]] = []
    ingest = _ingest(kafka_service.address, topic, got)
    pk = (topic, 0)
    try:
        _poll_until(ingest, got, 1)
        ingest.pause(pk)
        before = len(got)
        for _ in range(5):
            ingest.poll(20)
        assert len(got) == before  # paused: nothing handed over, buffered or not
        ingest.resume(pk)
        _poll_until(ingest, got, before + 1)
        assert [off for off, _ in got] == list(range(len(got)))  # no gap across the pause
        ingest.seek(pk, 100)
        assert TopicPartition(*pk) not in ingest._buffer
        mark = len(got)
        _poll_until(ingest, got, mark + 1)
        assert got[mark][0] == 100  # read again from the seek, nothing buffered before it handed over
        _poll_until(ingest, got, mark + N - 100)
        assert [off for off, _ in got[mark:]] == list(range(100, N))
    finally:
        ingest.close()
