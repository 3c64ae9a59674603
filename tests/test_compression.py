"""Producers that compress (librdkafka through confluent-kafka, aiokafka) with every Kafka codec:
every event reaches the daemon's ingest sink (kafka-python decodes them with the codec libraries
declared as core dependencies)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from watchdog.config.settings import KafkaConfig
from watchdog.core.events import InferenceEvent, encode_event
from watchdog.core.metrics import Metrics
from watchdog.ingest.consumer import Ingest, make_consumer, make_producer

pytestmark = pytest.mark.services

CODECS = ("gzip", "snappy", "lz4", "zstd")
PER_CASE = 40


def _event(case: str, i: int) -> bytes:
    return encode_event({
        "schema": 1, "request_id": f"{case}-{i}", "ts": time.time(), "model": "m", "route": "r",
        "precision": "fp8", "status": "ok", "latency_ms": 12.5, "prompt_tokens": 10, "completion_tokens": 20,
        # repetitive text so that every codec really compresses the batch
        "completion": "the quick brown fox jumps over the lazy dog " * 8,
    })


def _produce_confluent(bootstrap: str, topic: str, codec: str) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "compression.type": codec, "linger.ms": 20,
                  "acks": "all", "api.version.request": True})
    for i in range(PER_CASE):
        p.produce(topic, _event(f"confluent.{codec}", i))
    assert p.flush(15) == 0


def _produce_aiokafka(bootstrap: str, topic: str, codec: str) -> None:
    from aiokafka import AIOKafkaProducer

    async def go() -> None:
        p = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=codec, linger_ms=20, acks="all")
        await p.start()
        try:
            futs = [await p.send(topic, _event(f"aiokafka.{codec}", i)) for i in range(PER_CASE)]
            await asyncio.gather(*futs)
        finally:
            await p.stop()

    asyncio.run(go())


def test_every_codec_from_confluent_and_aiokafka_is_ingested(kafka_service) -> None:
    bootstrap = kafka_service.address
    topic = f"llm.compressed.{uuid.uuid4().hex[:8]}"
    for codec in CODECS:
        _produce_confluent(bootstrap, topic, codec)
        _produce_aiokafka(bootstrap, topic, codec)
    cfg = KafkaConfig(bootstrap_servers=bootstrap, topic=topic, group_id=f"g-{uuid.uuid4().hex[:6]}",
                      session_timeout_ms=2000, heartbeat_interval_ms=500)
    # an uncompressed event after all the compressed batches: the partition must move past them
    tail = make_producer(cfg)
    tail.send(topic, _event("plain", 0)).get(timeout=10)
    tail.close()

    got: list[InferenceEvent] = []
    metrics = Metrics()
    ingest = Ingest(make_consumer(cfg), None, topic=topic, dlq_topic=cfg.dead_letter_topic,
                    max_event_bytes=1 << 20, metrics=metrics, sink=lambda ev, pk, off: got.append(ev))
    want = 2 * len(CODECS) * PER_CASE + 1
    deadline = time.monotonic() + 30
    try:
        while len(got) < want and time.monotonic() < deadline:
            ingest.poll(200)
    finally:
        ingest.close()
    by_case: dict[str, int] = {}
    for ev in got:
        case = ev.request_id.rsplit("-", 1)[0]
        by_case[case] = by_case.get(case, 0) + 1
    expected = {f"{client}.{codec}": PER_CASE for client in ("confluent", "aiokafka") for codec in CODECS}
    expected["plain"] = 1
    assert by_case == expected
    assert metrics.registry.get_sample_value("llmwd_events_total", {"result": "invalid"}) in (None, 0.0)


@pytest.mark.parametrize(("codec", "module_attr"), [("snappy", "snappy"), ("lz4", "lz4"), ("zstd", "zstd")])
def test_batches_really_are_compressed(kafka_service, monkeypatch, codec: str, module_attr: str) -> None:
    """Negative control: with kafka-python's codec module blinded, the same producer's batch is
    undecodable, so the test above did exercise the codec (the broker keeps batches as sent)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka import codec as kcodec
    from kafka.errors import UnsupportedCodecError

    topic = f"llm.compressed.{uuid.uuid4().hex[:8]}"
    _produce_confluent(kafka_service.address, topic, codec)
    monkeypatch.setattr(kcodec, module_attr, None)
    if codec == "lz4":
        monkeypatch.setattr(kcodec, "lz4f", None)
        monkeypatch.setattr(kcodec, "lz4framed", None)
    consumer = KafkaConsumer(bootstrap_servers=kafka_service.address, enable_auto_commit=False)
    try:
        parts = None
        deadline = time.monotonic() + 10
        while not parts and time.monotonic() < deadline:
            parts = consumer.partitions_for_topic(topic)
            time.sleep(0.05)
        tps = [TopicPartition(topic, p) for p in sorted(parts or {0})]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        with pytest.raises(UnsupportedCodecError):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                consumer.poll(200)
    finally:
        consumer.close()


def test_codec_libraries_are_importable_by_kafka_python() -> None:
    from kafka import codec

    assert codec.has_gzip() and codec.has_snappy() and codec.has_lz4() and codec.has_zstd()
