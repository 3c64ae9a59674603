"""Kafka side of the daemon: read inference-log events, dead-letter the bad ones, commit safely.

Offsets are committed only up to the first event that still sits in an open window (the caller
passes those marks in), and only after dead letters are acknowledged by the broker. After a crash
the uncommitted events are re-read and their windows rebuilt: nothing is lost, and the durable
"windows closed until" mark stops re-read events of already-closed windows from counting twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata, TopicPartition

from watchdog.config import KafkaConfig
from watchdog.events import InferenceEvent, InvalidEvent, decode_event
from watchdog.metrics import Metrics
from watchdog.otlp import RecordDecoder

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]
EventSink = Callable[[InferenceEvent, PartitionKey, int], None]


def make_consumer(cfg: KafkaConfig, **extra: Any) -> KafkaConsumer:
    return KafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers,
        group_id=cfg.group_id,
        enable_auto_commit=False,
        auto_offset_reset=cfg.auto_offset_reset,
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_poll_records=cfg.max_poll_records,
        client_id=f"llm-watchdog-{cfg.group_id}",
        **cfg.security,
        **extra,
    )


def make_producer(cfg: KafkaConfig, **extra: Any) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks="all", retries=5,
                         client_id=f"llm-watchdog-{cfg.group_id}-dlq", **cfg.security, **extra)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, on_revoked: Callable[[], None]) -> None:
        self._on_revoked = on_revoked

    def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            log.info("partitions revoked: %s", sorted(f"{tp.topic}:{tp.partition}" for tp in revoked))
            self._on_revoked()

    def on_partitions_assigned(self, assigned: Any) -> None:
        log.info("partitions assigned: %s", sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


class Ingest:
    """Poll events into ``sink``; invalid ones go to the dead-letter topic with the reason."""

    def __init__(self, consumer: KafkaConsumer, producer: KafkaProducer | None, *, topic: str,
                 dlq_topic: str, max_event_bytes: int, metrics: Metrics, sink: EventSink,
                 on_revoked: Callable[[], None] = lambda: None, decode_many: RecordDecoder | None = None) -> None:
        self.consumer = consumer
        #: a codec whose record holds many events (OTLP span batches, watchdog.otlp); None: JSON events
        self.decode_many = decode_many
        self.producer = producer
        self.topic = topic
        self.dlq_topic = dlq_topic
        self.max_event_bytes = max_event_bytes
        self.metrics = metrics
        self.sink = sink
        self.healthy = False
        self.last_error: str | None = None
        self._dlq_pending = 0
        self._last_polled: set[PartitionKey] = set()
        consumer.subscribe([topic], listener=_Rebalance(on_revoked))

    def poll(self, timeout_ms: int = 200) -> int:
        """Read one batch; returns the number of records seen (valid or not)."""
        try:
            batches = self.consumer.poll(timeout_ms=timeout_ms)
        except KafkaError as exc:
            self._fail(f"poll failed: {exc}")
            return 0
        self.healthy = True
        self.metrics.kafka_up.set(1)
        seen = 0
        ok = 0
        self._last_polled = {(tp.topic, tp.partition) for tp, records in batches.items() if records}
        for tp, records in batches.items():
            pkey = (tp.topic, tp.partition)
            for rec in records:
                seen += 1
                if self.decode_many is not None:  # every event of a record carries its offset
                    events, rejected = self.decode_many(rec.value or b"", self.max_event_bytes)
                    for bad in rejected:  # the dead letter holds just the rejected span
                        self._dead_letter(rec._replace(value=bad.value), bad)
                    for event in events:
                        self.sink(event, pkey, rec.offset)
                    ok += len(events)
                    continue
                try:
                    event = decode_event(rec.value or b"", self.max_event_bytes)
                except InvalidEvent as exc:
                    self._dead_letter(rec, exc)
                    continue
                self.sink(event, pkey, rec.offset)
                ok += 1
        if ok:
            self.metrics.events.labels("ok").inc(ok)
        return seen

    def _dead_letter(self, rec: Any, exc: InvalidEvent) -> None:
        reason = getattr(exc, "reason", "invalid")
        self.metrics.events.labels("invalid").inc()
        self.metrics.dlq.labels(reason.split(":", 1)[0]).inc()
        log.warning("dead-lettering %s:%s@%s: %s", rec.topic, rec.partition, rec.offset, exc)
        if self.producer is None:
            return
        headers = [
            ("llmwd.reason", reason.encode()),
            ("llmwd.error", str(exc)[:500].encode("utf-8", "replace")),
            ("llmwd.source.topic", rec.topic.encode()),
            ("llmwd.source.partition", str(rec.partition).encode()),
            ("llmwd.source.offset", str(rec.offset).encode()),
        ]
        # the original bytes travel unchanged as the value, so nothing is lost
        self.producer.send(self.dlq_topic, value=rec.value, key=rec.key, headers=headers)
        self._dlq_pending += 1

    def commit(self, open_marks: Mapping[PartitionKey, int]) -> bool:
        """Commit each assigned partition up to its first still-open event (else its position)."""
        try:
            if self.producer is not None and self._dlq_pending:
                self.producer.flush(timeout=10)
                self._dlq_pending = 0
            offsets = {}
            for tp in self.consumer.assignment():
                mark = open_marks.get((tp.topic, tp.partition))
                offset = mark if mark is not None else self.consumer.position(tp)
                if offset is not None:
                    offsets[tp] = OffsetAndMetadata(offset, "", -1)
            if offsets:
                self.consumer.commit(offsets)
            self.metrics.commits.labels("ok").inc()
            return True
        except (KafkaError, Exception) as exc:  # noqa: BLE001 - a failed commit is retried next time
            self.metrics.commits.labels("error").inc()
            self._fail(f"commit failed: {exc}")
            return False

    def assigned(self) -> bool:
        return bool(self.consumer.assignment())

    def behind(self) -> set[PartitionKey]:
        """Assigned partitions that may still hold unread records: behind the high watermark their
        last fetch reported (local metadata, no request), never fetched yet, or returning records in
        the last poll. The last case matters because a broker may report the high watermark at the
        start of its last batch (Tansu does), so "position >= high" can be seen with a batch left."""
        out = set(self._last_polled)
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            pos = self.consumer.position(tp) if high is not None else None
            if high is None or pos is None or pos < high:
                out.add((tp.topic, tp.partition))
        return out

    def lag(self) -> dict[int, int]:
        out = {}
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            pos = self.consumer.position(tp) if high is not None else None
            if high is not None and pos is not None:
                out[tp.partition] = max(0, high - pos)
                self.metrics.lag.labels(str(tp.partition)).set(out[tp.partition])
        return out

    def close(self) -> None:
        try:
            if self.producer is not None:
                self.producer.flush(timeout=10)
                self.producer.close(timeout=5)
        finally:
            self.consumer.close(autocommit=False)

    def _fail(self, message: str) -> None:
        self.healthy = False
        self.last_error = message
        self.metrics.kafka_up.set(0)
        log.error("kafka: %s", message)


__all__ = ["Ingest", "TopicPartition", "make_consumer", "make_producer"]
