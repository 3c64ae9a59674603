"""Dead letters: an event the daemon cannot count goes to ``<topic>.dlq`` with its reason.

The original record travels unchanged (value, key, headers) plus ``llmwd.*`` headers naming the
reason, the error and the source offset; an oversized one is truncated with its size and sha256.
A partition is never checkpointed past a dead letter the broker has not acknowledged: ``settled``
re-sends failed ones and pauses the partition (readiness ``dlq``) until they are written.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from kafka.structs import TopicPartition

from watchdog.core.metrics import Metrics
from watchdog.core.truncation import KEEP_BYTES, MAX_VALUE_BYTES, sha256_hex, truncate_bytes

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]

#: dead letters larger than this are stored as a truncated copy (first DLQ_KEEP_BYTES bytes, with the
#: original size and sha256 in headers): the rule of ``watchdog.core.truncation``, which the event
#: emitter applies to oversized prompts and completions too
DLQ_MAX_VALUE_BYTES = MAX_VALUE_BYTES
DLQ_KEEP_BYTES = KEEP_BYTES


@dataclass
class _Letter:
    rec: Any
    reason: str
    error: str
    future: Any = None
    attempts: int = 0


@dataclass
class _PartitionLetters:
    pending: list[_Letter] = field(default_factory=list)
    failed: str | None = None
    #: monotonic time the oldest unacknowledged dead letter was sent
    since: float | None = None


#: at most one warning per dead-letter reason this often (the rest are counted in the next one)
LOG_EVERY_S = 1.0
#: a dead letter unacknowledged this long counts as failed (its partition pauses, readiness ``dlq``)
DLQ_ACK_TIMEOUT_S = 10.0


class DeadLetters:
    """The dead letters of the partitions one consumer reads, per partition, until acknowledged."""

    def __init__(self, consumer: KafkaConsumer, producer: KafkaProducer | None, topic: str,
                 metrics: Metrics) -> None:
        self.consumer = consumer
        self.producer = producer
        self.topic = topic
        self.metrics = metrics
        self._dlq: dict[PartitionKey, _PartitionLetters] = {}
        #: partitions that dead-lettered since the daemon last looked (their checkpoint must advance)
        self.touched: set[PartitionKey] = set()
        #: reason -> (monotonic time of its last warning, dead letters not logged since)
        self._logged: dict[str, tuple[float, int]] = {}

    def add(self, pkey: PartitionKey, rec: Any, reason: str, error: str) -> None:
        """Count ``rec`` as invalid and send it, with the reason in its headers, to the dead-letter topic."""
        kind = reason.split(":", 1)[0]
        self.metrics.events.labels("invalid").inc()
        self.metrics.dlq.labels(kind).inc()
        self._log(kind, rec, error)
        if self.producer is None:
            return
        self.touched.add(pkey)
        dl = _Letter(rec, reason, error)
        st = self._dlq.setdefault(pkey, _PartitionLetters())
        if not st.pending:
            st.since = time.monotonic()
        st.pending.append(dl)
        self._send(dl)

    def _log(self, kind: str, rec: Any, error: str) -> None:
        """One warning per reason per ``LOG_EVERY_S`` at most, with the count of those not logged (a
        flood of dead letters must not become a flood of log lines; the metric counts each one)."""
        now = time.monotonic()
        last, quiet = self._logged.get(kind, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self._logged[kind] = (last, quiet + 1)
            return
        self._logged[kind] = (now, 0)
        more = f" (and {quiet} more {kind} dead letters not logged)" if quiet else ""
        log.warning("dead-lettering %s:%s@%s: %s%s", rec.topic, rec.partition, rec.offset, error[:300], more)

    def _send(self, dl: _Letter) -> None:
        rec = dl.rec
        value = rec.value or b""
        headers = [(k, v) for k, v in (rec.headers or [])]  # the original headers travel unchanged
        headers += [
            ("llmwd.reason", dl.reason.encode()),
            ("llmwd.error", dl.error[:500].encode("utf-8", "replace")),
            ("llmwd.source.topic", rec.topic.encode()),
            ("llmwd.source.partition", str(rec.partition).encode()),
            ("llmwd.source.offset", str(rec.offset).encode()),
        ]
        if len(value) > DLQ_MAX_VALUE_BYTES:
            headers += [("llmwd.truncated", b"1"), ("llmwd.original.size", str(len(value)).encode()),
                        ("llmwd.original.sha256", sha256_hex(value).encode())]
            value = truncate_bytes(value, DLQ_KEEP_BYTES)
        dl.attempts += 1
        assert self.producer is not None
        try:
            dl.future = self.producer.send(self.topic, value=value, key=rec.key, headers=headers)
        except Exception as exc:  # noqa: BLE001 - a refused send is a failed dead letter, never a crash
            dl.future = exc

    def settled(self, pkey: PartitionKey, timeout_s: float = 2.0) -> bool:
        """True when every dead letter of ``pkey`` is acknowledged; failed ones are re-sent, and the
        partition stays paused (``dlq_failures``) until they are."""
        st = self._dlq.get(pkey)
        if st is None or not st.pending:
            return True
        assert self.producer is not None
        if any(not isinstance(dl.future, BaseException) and not dl.future.is_done for dl in st.pending):
            try:
                self.producer.flush(timeout=timeout_s)
            except KafkaError as exc:
                log.warning("dead-letter flush failed: %s", exc)
        left: list[_Letter] = []
        error = None
        waited = time.monotonic() - (st.since or time.monotonic())
        for dl in st.pending:
            fut = dl.future
            if isinstance(fut, BaseException):
                error = f"{type(fut).__name__}: {fut}"
            elif not fut.is_done:
                left.append(dl)
                if waited > DLQ_ACK_TIMEOUT_S:
                    error = f"dead letters not acknowledged for {waited:.0f} s"
                continue
            elif fut.failed():
                error = f"{type(fut.exception).__name__}: {fut.exception}"
            else:
                continue
            left.append(dl)
            self._send(dl)
        st.pending = left
        if not left:
            st.since = None
        was = st.failed
        st.failed = error
        tp = TopicPartition(*pkey)
        if error and not was:
            log.error("dead letters of %s:%s cannot be written (%s): partition paused", pkey[0], pkey[1], error)
            self.consumer.pause(tp)
        elif not left and was:
            log.info("dead letters of %s:%s written again: partition resumed", pkey[0], pkey[1])
            self.consumer.resume(tp)
        return not left

    def failures(self) -> dict[PartitionKey, str]:
        return {pk: st.failed for pk, st in self._dlq.items() if st.failed}

    def forget(self, pkey: PartitionKey) -> None:
        self._dlq.pop(pkey, None)

    def drain_touched(self) -> set[PartitionKey]:
        """Partitions that dead-lettered since the last call."""
        out, self.touched = self.touched, set()
        return out
