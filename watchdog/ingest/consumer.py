"""Kafka side of the daemon: read inference-log events, dead-letter the bad ones, report what it knows.

The checkpoints in Redis (``watchdog.state.checkpoint``) are the source of truth for where each partition
resumes; Kafka's committed offsets only mirror them (asynchronously, for lag tools). A partition is
checkpointed only after every dead letter it produced is acknowledged by the broker
(``dlq_settled``); a dead letter that cannot be written pauses its partition until a retry succeeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata, TopicPartition

from watchdog.config.settings import KafkaConfig
from watchdog.core.events import InferenceEvent, InvalidEvent, decode_event, encode_event
from watchdog.core.metrics import Metrics
from watchdog.ingest.brokerwait import BrokerWait
from watchdog.ingest.deadletter import DeadLetters
from watchdog.ingest.otlp import RecordDecoder

log = logging.getLogger(__name__)

PartitionKey = tuple[str, int]
#: returns None when the event was folded, else the dead-letter reason (``future``, ``late``)
EventSink = Callable[[InferenceEvent, PartitionKey, int], str | None]
PartitionsFn = Callable[[list[PartitionKey]], None]
#: a refill of ``Ingest``'s own buffer takes up to this many polls' worth of records from the consumer:
#: enough to take every record it has fetched (Tansu answers a fetch with ~9,000 light events)
REFILL_POLLS = 10



def _reader_options(cfg: KafkaConfig, **ours: Any) -> dict[str, Any]:
    """Options every consumer of the daemon shares, then ``kafka.security`` (which may override them)."""
    return {"bootstrap_servers": cfg.bootstrap_servers, "enable_auto_commit": False,
            "metadata_max_age_ms": cfg.metadata_max_age_ms,
            # the daemon reads the topic, never makes one: a consumer that asked for the topic while an
            # operator re-created it made it first, with the broker's default partition count
            "allow_auto_create_topics": False, **ours, **cfg.security}


def make_consumer(cfg: KafkaConfig, **extra: Any) -> KafkaConsumer:
    return KafkaConsumer(**_reader_options(
        cfg, group_id=cfg.group_id, auto_offset_reset=cfg.auto_offset_reset,
        session_timeout_ms=cfg.session_timeout_ms, heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        max_poll_records=cfg.max_poll_records, client_id=f"llm-watchdog-{cfg.group_id}", **extra))


def make_offsets_consumer(cfg: KafkaConfig) -> KafkaConsumer:
    """A consumer of no group, only for log-end requests (``Ingest.end_offsets``): on the reading
    consumer's connection such a request queues behind the fetch in flight, which the broker holds
    up to ``fetch_max_wait_ms`` (500 ms) when the partitions are quiet, and the loop waited that long
    (measured on Tansu: 480 ms after a poll, 2 ms on a connection of its own)."""
    return KafkaConsumer(**_reader_options(cfg, group_id=None, client_id=f"llm-watchdog-{cfg.group_id}-offsets"))


def make_producer(cfg: KafkaConfig, **extra: Any) -> KafkaProducer:
    # not idempotent: after a broker restart that lost its producer state, kafka-python's idempotent
    # producer loops on UnknownProducerIdError and never delivers again; a duplicate dead letter is
    # harmless, a stuck one pauses its partition. max_block_ms bounds send() when metadata is missing.
    return KafkaProducer(bootstrap_servers=cfg.bootstrap_servers, acks="all", retries=5, enable_idempotence=False,
                         max_block_ms=2000, client_id=f"llm-watchdog-{cfg.group_id}-dlq", **cfg.security, **extra)


def classify_kafka_error(exc: BaseException) -> str:
    """A named not-ready reason for a poll error."""
    name = type(exc).__name__
    if name in ("UnsupportedCodecError", "CorruptRecordError", "CorruptRecordException") or "codec" in str(exc).lower():
        return "undecodable"
    return "kafka"


def drop_spent_wakeups(consumer: KafkaConsumer) -> int:
    """Take the callbacks of a poll that has returned off the fetches still in flight; the number taken.

    kafka-python 3.0's ``Fetcher.fetch_records``, when no record is buffered, hangs a ``_wake`` callback
    on every fetch in flight and waits on it with the poll's timeout. When the wait times out (every
    ``poll(0)`` that finds nothing), the ``KafkaTimeoutError`` it raises, its traceback and the frames
    of that call (whose locals hold those fetches) form a cycle that ``_wake`` keeps alive until the
    fetch completes - by then with the fetch response, the records' bytes, in it. The main loop freezes
    what survives its iteration (watchdog/runtime/collector.py), so those cycles stayed until a full
    collection: ~0.4 MB/s of dead fetch responses at 2,000 events/s (docs/BENCHMARKS.md, "Memory glibc
    kept"). A ``_wake`` of a poll that returned wakes nobody; taking it off leaves the cycle unreachable
    in the iteration that made it. Nothing here when the fetcher is not kafka-python 3.0's."""
    futures = getattr(getattr(consumer, "_fetcher", None), "_fetch_futures", None)
    if not futures:
        return 0
    taken = 0
    for fut in list(futures):
        lock = getattr(fut, "_lock", None)
        if lock is None:
            continue
        with lock:  # the IO thread completes futures under this lock
            for name in ("_callbacks", "_errbacks"):
                cbs = getattr(fut, name, None)
                if not cbs:
                    continue
                kept = [cb for cb in cbs if getattr(cb, "__qualname__", "") != "Fetcher.fetch_records.<locals>._wake"]
                if len(kept) != len(cbs):
                    taken += len(cbs) - len(kept)
                    cbs[:] = kept
    return taken


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, on_assigned: PartitionsFn, on_revoked: PartitionsFn) -> None:
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked

    def on_partitions_revoked(self, revoked: Any) -> None:
        if revoked:
            pks = sorted((tp.topic, tp.partition) for tp in revoked)
            log.info("partitions revoked: %s", [f"{t}:{p}" for t, p in pks])
            self._on_revoked(pks)

    def on_partitions_assigned(self, assigned: Any) -> None:
        pks = sorted((tp.topic, tp.partition) for tp in assigned)
        log.info("partitions assigned: %s", [f"{t}:{p}" for t, p in pks])
        if pks:
            self._on_assigned(pks)


class Ingest:
    """Poll events into ``sink``; invalid ones go to the dead-letter topic with the reason."""

    def __init__(self, consumer: KafkaConsumer, producer: KafkaProducer | None, *, topic: str,
                 dlq_topic: str, max_event_bytes: int, metrics: Metrics, sink: EventSink,
                 on_assigned: PartitionsFn = lambda pks: None, on_revoked: PartitionsFn = lambda pks: None,
                 accept: Callable[[PartitionKey], bool] = lambda pk: True,
                 decode_many: RecordDecoder | None = None, clock: Callable[[], float] = time.monotonic,
                 broker_timeout_ms: int = 5000, offsets: KafkaConsumer | None = None) -> None:
        self.consumer = consumer
        #: the consumer log-end requests go through (``make_offsets_consumer``); None: ``consumer``
        self.offsets = offsets
        #: the clock of ``mark_reset``/``recent_resets`` and ``broker_silence`` (the daemon's steady clock)
        self.clock = clock
        #: a codec whose record holds many events (OTLP span batches, watchdog.ingest.otlp); None: JSON events
        self.decode_many = decode_many
        self.producer = producer
        self.topic = topic
        self.dlq_topic = dlq_topic
        self.max_event_bytes = max_event_bytes
        self.metrics = metrics
        self.sink = sink
        #: False for a partition whose checkpoint is not restored yet: its records are skipped
        self.accept = accept
        self.healthy = False
        self.last_error: str | None = None
        self.error_reason: str | None = None
        #: next offset to read per partition, past every record handed to the sink or dead-lettered
        self.next_offset: dict[PartitionKey, int] = {}
        #: partitions whose offsets went backwards (broker restarted empty, log truncated)
        self._resets: dict[PartitionKey, float] = {}
        self.last_polled: set[PartitionKey] = set()
        #: records taken from the consumer and not handed to the sink yet, per partition: (records, next index)
        self._buffer: dict[TopicPartition, tuple[list[Any], int]] = {}
        #: records one ``poll`` hands to the sink at most (the consumer's ``max_poll_records``)
        self.max_records = int(getattr(consumer, "config", {}).get("max_poll_records") or 500)
        #: one key tuple per partition, handed to the sink with every event: an open window's offsets
        #: dict keyed by it stays untracked by the cyclic collector (a tuple of a str and an int is
        #: untracked from its first collection on; a dict holding only untracked keys and values is
        #: never tracked), where a fresh tuple per poll made each of them a container it walks
        self._pkeys: dict[tuple[str, int], PartitionKey] = {}
        #: seconds the last ``poll`` spent inside the consumer's poll call (waiting for and fetching records)
        self.poll_call_s = 0.0
        self._commits_in_flight = 0
        #: checkpointed offsets not yet mirrored into Kafka (a commit was in flight)
        self._mirror_wanted: dict[PartitionKey, int] = {}
        self._broker_silent_since: float | None = None
        self.broker_error = ""
        #: the adaptive wait of log-end / position requests (its failures are a readiness reason)
        self.broker_wait = BrokerWait(broker_timeout_ms, clock)
        #: checkpointed offsets to commit synchronously at close (set by the daemon's shutdown)
        self._final_offsets: dict[PartitionKey, int] = {}
        #: partitions ``pause`` stopped (their owner's reasons: not restored, fenced)
        self._paused: set[PartitionKey] = set()
        #: True while ``hold`` keeps every assigned partition paused
        self.held = False
        #: the dead-letter topic's writer: a partition never checkpoints past an unacknowledged one
        self.dead_letters = DeadLetters(consumer, producer, dlq_topic, metrics)
        consumer.subscribe([topic], listener=_Rebalance(on_assigned, on_revoked))

    # -- reading -------------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 200) -> int:
        """Hand at most ``max_records`` records to the sink; returns the number of records seen (valid or not).

        They come from a buffer of this object's own, refilled from the consumer whenever it holds less than
        one poll's worth for the partitions not paused. A refill takes every record the consumer has fetched:
        kafka-python sends a partition's next fetch only once all records of the last one are taken, so
        polling the consumer for one poll's worth at a time left no fetch in flight while the loop worked
        through the rest, and the loop then waited for that fetch (at 100 routes ~8 us of the ~30 us per
        event, docs/BENCHMARKS.md "Fetches in flight while the loop works"). Only records handed over move
        ``next_offset``; a seek or a revoke drops the partition's buffered records; a paused partition's
        records wait."""
        paused = self.consumer.paused() if self._buffer else ()
        self.poll_call_s = 0.0
        ready = self._ready(paused)
        if ready < self.max_records:
            t0 = time.monotonic()
            try:
                batches = self.consumer.poll(timeout_ms=0 if ready else timeout_ms,
                                             max_records=REFILL_POLLS * self.max_records)
            except KafkaError as exc:
                self.poll_call_s = time.monotonic() - t0
                self._fail(classify_kafka_error(exc), f"poll failed: {type(exc).__name__}: {exc}")
                batches = {}  # what the buffer holds is still handed over
            else:
                self.poll_call_s = time.monotonic() - t0
                drop_spent_wakeups(self.consumer)
                self.healthy = True
                self.error_reason = None
                self.metrics.kafka_up.set(1)
            for tp, records in batches.items():
                if records:
                    held = self._buffer.get(tp)
                    self._buffer[tp] = (held[0][held[1]:] + records, 0) if held else (records, 0)
            paused = self.consumer.paused() if self._buffer else ()  # the poll's rebalance may have paused some
        if not self._buffer:
            self.last_polled = set()
            return 0
        batches = self._take(paused)
        seen = 0
        ok = 0
        #: spans without gen_ai.* attributes the OTLP decoder passed over (HTTP, database spans)
        skipped_before = getattr(self.decode_many, "skipped", 0)
        self.last_polled = set()
        for tp, records in batches.items():
            pkey = self._pkeys.get(tp)
            if pkey is None:
                pkey = self._pkeys[tp] = (tp.topic, tp.partition)
            if not records or not self.accept(pkey):
                continue
            self.last_polled.add(pkey)
            expected = self.next_offset.get(pkey)
            if expected is not None and records[0].offset < expected:
                self._resets[pkey] = self.clock()
                log.error("partition %s:%s: offset went back from %s to %s (broker restarted empty or "
                          "log truncated)", tp.topic, tp.partition, expected, records[0].offset)
            for rec in records:
                seen += 1
                if self.decode_many is not None:  # OTLP: every event of a record carries its offset
                    events, rejected = self.decode_many(rec.value or b"", self.max_event_bytes)
                    for bad in rejected:  # the dead letter holds just the rejected span
                        self.dead_letters.add(pkey, rec._replace(value=bad.value), bad.reason, str(bad))
                    for event in events:
                        reason = self.sink(event, pkey, rec.offset)
                        if reason is None:
                            ok += 1
                        else:
                            self.dead_letters.add(pkey, rec._replace(value=encode_event(event)), reason,
                                              f"event {reason}: ts={event.ts}")
                    continue
                try:
                    event = decode_event(rec.value or b"", self.max_event_bytes)
                except InvalidEvent as exc:
                    self.dead_letters.add(pkey, rec, getattr(exc, "reason", "invalid"), str(exc))
                    continue
                reason = self.sink(event, pkey, rec.offset)
                if reason is None:
                    ok += 1
                else:
                    self.dead_letters.add(pkey, rec, reason, f"event {reason}: ts={event.ts}")
            self.next_offset[pkey] = records[-1].offset + 1
        if ok:
            self.metrics.events.labels("ok").inc(ok)
        skipped = getattr(self.decode_many, "skipped", 0) - skipped_before
        if skipped:
            self.metrics.events.labels("skipped").inc(skipped)
        return seen

    def _ready(self, paused: Any) -> int:
        """Buffered records of the partitions not paused."""
        return sum(len(recs) - i for tp, (recs, i) in self._buffer.items() if tp not in paused)

    def _take(self, paused: Any) -> dict[TopicPartition, list[Any]]:
        """Up to ``max_records`` buffered records of the partitions not paused, in order, out of the buffer."""
        out: dict[TopicPartition, list[Any]] = {}
        quota = self.max_records
        for tp, (recs, i) in list(self._buffer.items()):
            if quota <= 0:
                break
            if tp in paused:
                continue
            out[tp] = chunk = recs[i:i + quota] if i or len(recs) - i > quota else recs
            quota -= len(chunk)
            if i + len(chunk) >= len(recs):
                del self._buffer[tp]
            else:
                self._buffer[tp] = (recs, i + len(chunk))
        return out

    def _drop_buffered(self, pkey: PartitionKey) -> None:
        self._buffer.pop(TopicPartition(*pkey), None)

    def forget(self, pkey: PartitionKey) -> None:
        """A revoked partition: its dead letters and marks are someone else's now."""
        self._drop_buffered(pkey)
        self.dead_letters.forget(pkey)
        self._paused.discard(pkey)
        self._final_offsets.pop(pkey, None)
        self.next_offset.pop(pkey, None)  # (``_resets`` stay: readiness reports them for a while)
        self.metrics.forget_partition(pkey[1])

    # -- position ------------------------------------------------------------------------------
    def seek(self, pkey: PartitionKey, offset: int) -> None:
        self.consumer.seek(TopicPartition(*pkey), offset)
        self._drop_buffered(pkey)
        self.next_offset[pkey] = offset

    def pause(self, pkey: PartitionKey) -> None:
        self._paused.add(pkey)
        self.consumer.pause(TopicPartition(*pkey))

    def resume(self, pkey: PartitionKey) -> None:
        self._paused.discard(pkey)
        if not self.held:
            self.consumer.resume(TopicPartition(*pkey))

    def hold(self, on: bool) -> None:
        """Stop reading every assigned partition (``on``), or read again: the daemon holds reading while
        the judging of closed windows runs behind, so that what it cannot judge in time waits in Kafka,
        not in its memory. Polling goes on (group membership, rebalances); kafka-python keeps records
        fetched for a paused partition and hands them over once it is resumed. A partition stopped for
        its own reason (``pause``, a dead letter not written) stays stopped."""
        if on:
            assigned = self.consumer.assignment()
            if assigned:
                self.consumer.pause(*assigned)  # again each time: a partition assigned since is held too
            self.held = True
            return
        if not self.held:
            return
        self.held = False
        failed = self.dead_letters.failures()
        for tp in self.consumer.assignment():
            pkey = (tp.topic, tp.partition)
            if pkey not in self._paused and pkey not in failed:
                self.consumer.resume(tp)

    def end_offsets(self, pkeys: list[PartitionKey]) -> dict[PartitionKey, int] | None:
        """The log end of each partition, asked of the broker with the adaptive wait
        (``broker_wait``); None on failure (``broker_silence()`` then says since when the broker has
        not answered)."""
        wait = self.broker_wait
        started = time.monotonic()
        try:
            asker = self.offsets or self.consumer
            ends = asker.end_offsets([TopicPartition(*pk) for pk in pkeys], timeout_ms=wait.timeout_ms)
        except (KafkaError, Exception) as exc:  # noqa: BLE001 - a stalled broker is reported, not raised
            wait.failed("end_offsets", exc)
            if self._broker_silent_since is None:
                self._broker_silent_since = self.clock()
            self.broker_error = f"{type(exc).__name__}: {exc}"[:200]
            return None
        wait.answered(time.monotonic() - started)
        self._broker_silent_since = None
        return {(tp.topic, tp.partition): off for tp, off in ends.items()}

    def holds(self, pkey: PartitionKey) -> bool:
        """Whether records of ``pkey`` wait in the buffer (taken from the consumer, not handed over)."""
        return TopicPartition(*pkey) in self._buffer

    def position(self, pkey: PartitionKey) -> int | None:
        """The offset of the next record this object hands over: the first one it holds in its buffer, else
        the consumer's position (which is past the buffered records; after ``forget``, past the records it
        dropped: ask before)."""
        held = self._buffer.get(TopicPartition(*pkey))
        if held:
            return int(held[0][held[1]].offset)
        try:
            return int(self.consumer.position(TopicPartition(*pkey), timeout_ms=self.broker_wait.timeout_ms))
        except (KafkaError, Exception) as exc:  # noqa: BLE001
            self.broker_wait.failed("position", exc)
            return None

    def commit_mirror(self, offsets: dict[PartitionKey, int]) -> None:
        """Mirror checkpointed offsets into Kafka's group offsets (lag tools) without blocking the loop."""
        self._mirror_wanted.update(offsets)
        if not self._mirror_wanted or self._commits_in_flight:
            # one at a time: a pile of commits to a slow coordinator blocks LeaveGroup at stop; what
            # waits here goes with the next call (the loop calls with {} every step)
            return
        mine = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        payload = {TopicPartition(*pk): OffsetAndMetadata(off, "", -1)
                   for pk, off in self._mirror_wanted.items() if pk in mine}
        self._mirror_wanted.clear()
        if not payload:
            return

        def done(_offsets: Any, result: Any) -> None:
            self._commits_in_flight = max(0, self._commits_in_flight - 1)
            self.metrics.commits.labels("error" if isinstance(result, Exception) else "ok").inc()

        try:
            self._commits_in_flight += 1
            self.consumer.commit_async(payload, callback=done)
        except (KafkaError, Exception) as exc:  # noqa: BLE001 - a mirror commit is best effort
            self._commits_in_flight = max(0, self._commits_in_flight - 1)
            self.metrics.commits.labels("error").inc()
            log.debug("mirror commit failed: %s", exc)

    def topic_id(self) -> str | None:
        """The topic's id from the client's metadata (None when unknown or the broker predates ids);
        it changes when the topic was re-created, e.g. by a broker that restarted empty."""
        try:
            tid = self.consumer._client.cluster.topic_id(self.topic)  # noqa: SLF001 - no public accessor
        except Exception:  # noqa: BLE001
            return None
        return str(tid) if tid else None

    def assignment(self) -> list[PartitionKey]:
        return sorted((tp.topic, tp.partition) for tp in self.consumer.assignment())

    def assigned(self) -> bool:
        return bool(self.consumer.assignment())

    def partition_count(self) -> int | None:
        try:
            parts = self.consumer.partitions_for_topic(self.topic)
        except (KafkaError, Exception):  # noqa: BLE001
            return None
        return len(parts) if parts else None

    def read_to_end(self) -> dict[PartitionKey, int]:
        """Partitions read up to the high watermark of their last fetch, with our position. (Tansu
        reports the start of its last batch as the high watermark: a position past it counts too.)"""
        out = {}
        for tp in self.consumer.assignment():
            pk = (tp.topic, tp.partition)
            high = self.consumer.highwater(tp)
            pos = self.next_offset.get(pk)
            if high is not None and pos is not None and pos >= high and tp not in self._buffer:
                out[pk] = pos
        return out

    def reading_behind(self) -> bool:
        """True while records wait in Kafka for a partition this consumer reads now (not held, not paused,
        no dead letter failing): its position is behind the high watermark of its last fetch, so the next
        poll has records to hand over. (On Tansu, whose high watermark is the start of its last batch, the
        last batch of a partition reads as caught up.)"""
        if self.held:
            return False
        failed = self.dead_letters.failures()
        for tp in self.consumer.assignment():
            pk = (tp.topic, tp.partition)
            if pk in self._paused or pk in failed:
                continue
            if tp in self._buffer:
                return True  # records wait in the buffer
            high = self.consumer.highwater(tp)
            pos = self.next_offset.get(pk)
            if high is not None and pos is not None and pos < high:
                return True
        return False

    def lag(self) -> dict[int, int]:
        out = {}
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            pos = self.next_offset.get((tp.topic, tp.partition))
            if high is not None and pos is not None:
                out[tp.partition] = max(0, high - pos)
                self.metrics.lag.labels(str(tp.partition)).set(out[tp.partition])
        return out

    # -- what the daemon reads and marks ----------------------------------------------------
    def mark_reset(self, pkey: PartitionKey, now: float) -> None:
        """The offsets of ``pkey`` went back at ``now`` (e.g. the topic was re-created)."""
        self._resets[pkey] = now

    def recent_resets(self, now: float, within_s: float) -> list[PartitionKey]:
        """Partitions whose offsets went back less than ``within_s`` seconds before ``now``."""
        return sorted(pk for pk, t in self._resets.items() if now - t < within_s)

    def set_final_offset(self, pkey: PartitionKey, offset: int) -> None:
        """A checkpointed offset of ``pkey``: committed synchronously at ``close``."""
        self._final_offsets[pkey] = offset

    def broker_silence(self) -> float | None:
        """Time (``clock``) since which the broker has not answered an offsets request (None: it answers)."""
        return self._broker_silent_since

    def clear_broker_silence(self) -> None:
        """Records arrived: the broker answers, whatever the last offsets request said."""
        self._broker_silent_since = None

    def close(self) -> None:
        """Flush the DLQ, commit the final checkpointed offsets synchronously (so no commit is in flight
        when LeaveGroup goes out: Tansu otherwise keeps the member until its session expires and the
        next replica waits), then leave the group. The daemon runs this in a thread it bounds."""
        try:
            if self.producer is not None:
                self.producer.flush(timeout=2)
                self.producer.close(timeout=1)
        finally:
            try:
                mine = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
                offsets = {TopicPartition(*pk): OffsetAndMetadata(off, "", -1)
                           for pk, off in self._final_offsets.items() if pk in mine}
                if offsets:
                    self.consumer.commit(offsets)
            except (KafkaError, Exception) as exc:  # noqa: BLE001 - the checkpoint is the truth anyway
                log.warning("final offset commit failed: %s", exc)
            self.consumer.close(autocommit=False)
            if self.offsets is not None:
                self.offsets.close(autocommit=False)

    def _fail(self, reason: str, message: str) -> None:
        self.healthy = False
        self.last_error = message
        self.error_reason = reason
        self.metrics.kafka_up.set(0)
        log.error("kafka: %s", message)


__all__ = ["Ingest", "TopicPartition", "classify_kafka_error", "make_consumer", "make_offsets_consumer", "make_producer"]
