"""Events off the request path: a bounded buffer drained by one producer thread.

Used by the gateway (``watchdog.gateway``) and the LiteLLM logger (``watchdog.integrations.litellm``).
``emit`` never blocks and never raises: when the buffer is full the event is dropped and counted.
The thread hands batches to the Kafka producer (confluent-kafka when installed, else kafka-python;
both batch again per partition), each event keyed by its route (``events.partition_key``); a send
that fails, or a broker that cannot be reached, is counted and logged, never seen by a client.

Both producers are idempotent (acks=all): a batch sent again after its acknowledgement was lost is not
written twice. A producer whose id the broker no longer knows (a broker that lost its state) is replaced,
and the events it held are sent again by the new one.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from watchdog.core.brokers import (
    KAFKA_PYTHON_IDEMPOTENCE,
    LIBRDKAFKA_IDEMPOTENCE,
    require_bootstrap_servers,
    require_idempotence_settings,
    require_topic_name,
)
from watchdog.core.events import partition_key
from watchdog.core.truncation import MAX_VALUE_BYTES, fit_event

log = logging.getLogger(__name__)


class _LibrdkafkaLog:
    """librdkafka's own log lines, at DEBUG in this module's logger. It writes them to stderr itself
    otherwise: a FAIL line ~3 times a second while the broker is away, which repeats what ``error_cb``
    already reports once per change (``_count_error``)."""

    def log(self, _level: int, msg: str, *args: Any) -> None:
        log.debug("librdkafka: " + msg, *args)


class EventsConfig(BaseModel):
    """Where and how events go (the gateway's ``events:`` section)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    bootstrap_servers: str = "127.0.0.1:9092"
    topic: str = "llm.inference.logs"
    #: events waiting for the producer; past this, new events are dropped and counted
    buffer_size: int = Field(10_000, ge=1)
    #: the producer thread sends what has gathered at most this often
    flush_interval_s: float = Field(0.05, gt=0)
    #: how long the producer keeps trying to deliver an event while the brokers are away before it gives
    #: up on it (``lost``); the producer's own queue holds at most ``buffer_size`` events meanwhile. The
    #: librdkafka default, 5 min: a broker restart or a rolling upgrade loses nothing. Before, 30 s
    delivery_timeout_s: float = Field(300.0, ge=1.0, le=3600.0)
    linger_ms: int = Field(20, ge=0)
    #: an event larger than this has its texts cut (``watchdog.core.truncation.fit_event``: the
    #: dead-letter rule, first 64 KiB kept, original size and sha256 recorded); keep it under the
    #: producer's max request size and the broker's message.max.bytes
    max_event_bytes: int = Field(MAX_VALUE_BYTES, ge=1024)
    #: producer library: ``auto`` takes confluent-kafka (librdkafka, ~10x less CPU per event) when
    #: it is installed, else kafka-python
    client: Literal["auto", "confluent", "kafka-python"] = "auto"
    #: passed to kafka-python unchanged (security_protocol, sasl_*, ssl_*, compression_type, ...); wins over
    #: the emitter's own settings
    producer: dict[str, Any] = Field(default_factory=dict)
    #: passed to confluent-kafka unchanged (librdkafka names: security.protocol, sasl.*, compression.type ...);
    #: wins over the emitter's own settings
    librdkafka: dict[str, Any] = Field(default_factory=dict)

    @field_validator("bootstrap_servers")
    @classmethod
    def _bootstrap_usable(cls, servers: str) -> str:
        return require_bootstrap_servers(servers)

    @field_validator("topic")
    @classmethod
    def _topic_legal(cls, topic: str) -> str:
        return require_topic_name(topic)

    @field_validator("producer")
    @classmethod
    def _producer_idempotent(cls, settings: dict[str, Any]) -> dict[str, Any]:
        return require_idempotence_settings(settings, KAFKA_PYTHON_IDEMPOTENCE)

    @model_validator(mode="after")
    def _timeouts_fit(self) -> EventsConfig:
        """Both clients refuse a delivery timeout that a linger (and, kafka-python, a request timeout) does not
        fit in, when the producer is built; the emitter would then retry building it for ever."""
        delivery_ms = self.delivery_timeout_s * 1000
        if self.linger_ms >= delivery_ms:
            raise ValueError(f"linger_ms {self.linger_ms} must be below delivery_timeout_s ({delivery_ms:g} ms)")
        request_ms = self.producer.get("request_timeout_ms")
        if isinstance(request_ms, (int, float)) and self.linger_ms + request_ms > delivery_ms:
            raise ValueError(f"producer request_timeout_ms {request_ms} + linger_ms {self.linger_ms} must not exceed "
                             f"delivery_timeout_s ({delivery_ms:g} ms): kafka-python refuses that")
        return self

    def request_timeout_ms(self) -> int:
        """kafka-python's request timeout: its 30 s default, or what fits in the delivery timeout after the linger."""
        return int(min(30_000, self.delivery_timeout_s * 1000 - self.linger_ms))

    @field_validator("librdkafka")
    @classmethod
    def _librdkafka_idempotent(cls, settings: dict[str, Any]) -> dict[str, Any]:
        return require_idempotence_settings(settings, LIBRDKAFKA_IDEMPOTENCE)


@dataclass(frozen=True)
class _Hooks:
    """What a backend reports to its emitter."""

    sent: Callable[[], None]
    #: an event the producer gave up on
    lost: Callable[[BaseException], None]
    #: the client's own errors (a broker down, a refused connection): no event lost
    error: Callable[[BaseException], None]
    #: an encoded event (value, key) the broker refused unwritten because it did not know the producer's id:
    #: to be sent again
    returned: Callable[[bytes, bytes], None]


#: producer epochs librdkafka may bump without a delivery before the emitter takes the producer id for lost
EPOCH_BUMPS_WITHOUT_DELIVERY = 20


class _KafkaPython:
    """kafka-python behind the emitter's calls."""

    def __init__(self, cfg: EventsConfig, hooks: _Hooks, client_id: str) -> None:
        # kafka-python has no hook for the client's own errors: its failures reach ``hooks.lost``
        from kafka import KafkaProducer
        from kafka.errors import UnknownProducerIdError

        conf: dict[str, Any] = {"bootstrap_servers": cfg.bootstrap_servers, "linger_ms": cfg.linger_ms,
                                "acks": "all", "enable_idempotence": True, "retries": 3, "max_block_ms": 1000,
                                "batch_size": 256 * 1024, "delivery_timeout_ms": int(cfg.delivery_timeout_s * 1000),
                                "request_timeout_ms": cfg.request_timeout_ms(),
                                "client_id": client_id}
        self._p = KafkaProducer(**(conf | cfg.producer))
        self._hooks = hooks
        self._unknown_id = UnknownProducerIdError

    def send(self, topic: str, value: bytes, key: bytes) -> None:
        future = self._p.send(topic, value=value, key=key)
        future.add_callback(lambda _meta: self._hooks.sent())
        future.add_errback(self._failed, value, key)

    def _failed(self, value: bytes, key: bytes, exc: BaseException) -> None:
        if isinstance(exc, self._unknown_id) or self.id_lost():
            self._hooks.returned(value, key)  # refused or aborted, never written
        else:
            self._hooks.lost(exc)

    def id_lost(self) -> bool:
        """The broker did not know the producer id and refused a new epoch for it (kafka-python then stops for
        good: every batch fails)."""
        manager = self._p._transaction_manager
        return manager is not None and bool(manager.has_fatal_error())

    def poll(self) -> None:
        pass

    def flush(self, timeout: float) -> None:
        self._p.flush(timeout=timeout)

    def hand_back(self, timeout: float) -> None:
        """Close; with the producer id lost, what it still held comes back through ``hooks.returned``."""
        self._p.close(timeout=timeout)

    def close(self, timeout: float) -> None:
        self._p.close(timeout=timeout)


class _Confluent:
    """confluent-kafka (librdkafka): produce() queues in C; delivery reports come on poll()."""

    def __init__(self, cfg: EventsConfig, hooks: _Hooks, client_id: str) -> None:
        from confluent_kafka import KafkaError, KafkaException, Producer

        self._hooks = hooks
        self._exc = KafkaException
        self._purged = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)
        self._unknown_id = KafkaError.UNKNOWN_PRODUCER_ID
        self._handing_back = self._fatal = False
        self._epoch = self._epoch_delivered = 0
        conf: dict[str, Any] = {"bootstrap.servers": cfg.bootstrap_servers, "linger.ms": cfg.linger_ms,
                                # acks=all: idempotence needs it
                                "enable.idempotence": True, "acks": "all", "client.id": client_id,
                                "message.timeout.ms": int(cfg.delivery_timeout_s * 1000),
                                "queue.buffering.max.messages": max(cfg.buffer_size, 1000),
                                # the Java/kafka-python partitioner: a route's events land where the
                                # daemon expects them (murmur2 of the key, docs/OPERATIONS.md)
                                "partitioner": "murmur2_random",
                                "error_cb": self._error,
                                # the producer epoch, to see librdkafka bump it in a loop (id_lost)
                                "statistics.interval.ms": 1000, "stats_cb": self._stats,
                                "logger": _LibrdkafkaLog(), **cfg.librdkafka}
        self._p = Producer(conf)

    def _error(self, err: Any) -> None:
        self._fatal = self._fatal or err.fatal()
        self._hooks.error(self._exc(err))

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is None:
            self._epoch_delivered = self._epoch
            self._hooks.sent()
        elif err.code() == self._unknown_id or (self._handing_back and err.code() in self._purged):
            self._hooks.returned(msg.value(), msg.key())  # refused or never sent: not written
        else:
            self._hooks.lost(self._exc(err))

    def _stats(self, raw: str) -> None:
        self._epoch = int((json.loads(raw).get("eos") or {}).get("producer_epoch", 0))

    def id_lost(self) -> bool:
        """The broker does not know the producer id, and the producer cannot go on. Either librdkafka bumps
        the epoch and sends again without end (Tansu after a restart of its memory storage answers the bump
        but still does not know the id; each event would be lost after ``delivery_timeout_s``), or it gave
        up with a fatal error (the first batch after events that timed out starts past sequence 0), after
        which the handle sends nothing. A fatal error of another cause is no better: a new producer too."""
        return self._fatal or self._epoch - self._epoch_delivered >= EPOCH_BUMPS_WITHOUT_DELIVERY

    def send(self, topic: str, value: bytes, key: bytes) -> None:
        self._p.produce(topic, value=value, key=key, on_delivery=self._delivered)

    def poll(self) -> None:
        try:
            self._p.poll(0)
        except self._exc as exc:  # confluent-kafka raises a fatal error here, not through error_cb
            self._fatal = self._fatal or exc.args[0].fatal()
            raise

    def flush(self, timeout: float) -> None:
        self._p.flush(timeout)

    def hand_back(self, timeout: float) -> None:
        """Purge everything at once; the purged events come back through ``hooks.returned``. Only for a
        producer whose id the broker does not know: its batches in flight are refused, not written."""
        self._handing_back = True
        self._p.purge(in_queue=True, in_flight=True, blocking=False)
        self.close(timeout)

    def close(self, timeout: float) -> None:
        """Flush for up to ``timeout``, then drop what is still queued and let the librdkafka handle go.

        Each undelivered message holds its delivery callback, a bound method of this object, which
        holds the producer: a cycle through C that the garbage collector cannot see. Without the
        purge the handle outlives ``close()`` (to interpreter exit) and keeps dialling a dead broker,
        logging "Connection refused" long after its owner stopped. The purged messages' delivery
        reports (served by the last flush) count as lost: they were not sent.
        """
        p = self._p
        if p is None:
            return
        self._p = None  # type: ignore[assignment]
        if p.flush(timeout) > 0:
            p.purge(in_queue=True, in_flight=True, blocking=False)
            p.flush(min(timeout, 1.0))
        del p  # the last reference: rd_kafka_destroy now, not at exit


def _backend(cfg: EventsConfig) -> type[_KafkaPython] | type[_Confluent]:
    if cfg.client == "kafka-python":
        return _KafkaPython
    if cfg.client == "confluent":
        return _Confluent
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return _KafkaPython
    return _Confluent


class ProducerIdLost(Exception):
    """The broker refuses the producer's batches because it does not know the producer's id."""


class EventEmitter:
    """``name`` (``gateway``, ``litellm``) goes into the Kafka client id, the thread name and the logs."""

    def __init__(self, cfg: EventsConfig, producer_factory: Callable[[], Any] | None = None,
                 name: str = "gateway") -> None:
        self.cfg = cfg
        self.name = name
        hooks = _Hooks(self._on_sent, self._count_lost, self._count_error, self._returned)
        self._factory = producer_factory or (lambda: _backend(cfg)(cfg, hooks, f"llm-watchdog-{name}"))
        self._buf: deque[dict[str, Any]] = deque()
        #: encoded events (value, key) a producer handed back unwritten, sent before the buffer
        self._resend: deque[tuple[bytes, bytes]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._producer: Any = None
        #: how long the thread's last flush may take (close()'s timeout)
        self._close_timeout = 5.0
        self.accepted = 0
        self.dropped = 0
        self.sent = 0
        #: events handed to the producer that it gave up on: not delivered within ``delivery_timeout_s``,
        #: refused by its full queue, purged at close
        self.lost = 0
        #: the producer's errors, events or not (a broker down, a refused connection): not a loss count
        self.errors = 0
        #: events sent with texts cut to fit ``max_event_bytes``; events that did not fit even then
        self.truncated = 0
        self.too_large = 0
        #: producers replaced because the broker did not know their id any more
        self.renewed = 0
        self.connected = False
        self.last_error: str | None = None

    # -- request path --------------------------------------------------------------------------

    def emit(self, event: dict[str, Any]) -> bool:
        """Queue one event (a dict in the docs/EVENTS.md schema); False when it was dropped."""
        if len(self._buf) >= self.cfg.buffer_size:
            self.dropped += 1
            return False
        self._buf.append(event)
        self.accepted += 1
        return True

    @property
    def queued(self) -> int:
        return len(self._buf)

    # -- producer thread -----------------------------------------------------------------------

    def start(self) -> EventEmitter:
        self._thread = threading.Thread(target=self._run, name=f"llmwd-{self.name}-events", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Send what is buffered (up to ``timeout``), then stop; what is not sent by then is dropped.

        The producer thread closes the producer itself on its way out, so that one it connects after
        this call gave up waiting (kafka-python's constructor blocks while the broker is down) is closed
        too, rather than left to dial a dead broker until the interpreter exits."""
        self._close_timeout = timeout
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=timeout + 1)
            if thread.is_alive():
                log.warning("%s events: the producer thread is still connecting; it closes the producer "
                            "when it gets one", self.name)
            return
        self._close_producer()  # never started: nobody else will

    def _close_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.close(timeout=self._close_timeout)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("event producer close failed: %s", exc)
        self.lost += len(self._resend)  # handed back by a producer, and no producer left to send them
        self._resend.clear()

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if self._producer is None and not self._connect():
                if stopping:
                    self._close_producer()
                    return
                self._stop.wait(1.0)
                continue
            self._drain()
            if stopping:  # the backend's close() flushes for up to close()'s timeout first
                self._close_producer()
                return
            self._stop.wait(self.cfg.flush_interval_s)

    def _connect(self) -> bool:
        try:
            self._producer = self._factory()
        except Exception as exc:  # noqa: BLE001 - NoBrokersAvailable, bad settings: retried
            self._count_error(exc)
            self.connected = False
            return False
        self.connected = True
        return True

    def _drain(self) -> None:
        if self._producer.id_lost() and not self._renew():
            return
        producer, topic = self._producer, self.cfg.topic
        for _ in range(len(self._resend)):
            self._send(producer, topic, *self._resend.popleft())
        for _ in range(len(self._buf)):
            encoded = self._encode(self._buf.popleft())
            if encoded is not None:
                self._send(producer, topic, *encoded)
        try:
            producer.poll()
        except Exception as exc:  # noqa: BLE001
            self._count_error(exc)

    def _encode(self, event: dict[str, Any]) -> tuple[bytes, bytes] | None:
        """(value, key), or None when the event cannot be sent (counted)."""
        try:
            key = partition_key(str(event.get("model", "")), str(event.get("route", "")))
            value = fit_event(event, self.cfg.max_event_bytes)
        except Exception as exc:  # noqa: BLE001 - a value that cannot be encoded
            self._count_lost(exc)
            return None
        if value is None:
            self.too_large += 1
            return None
        if "truncated" in event:
            self.truncated += 1
        return value, key

    def _send(self, producer: Any, topic: str, value: bytes, key: bytes) -> None:
        try:
            producer.send(topic, value, key)
        except Exception as exc:  # noqa: BLE001 - client queue full, broker gone
            self._count_lost(exc)

    def _renew(self) -> bool:
        """Replace a producer whose id the broker does not know (a broker that lost its state: Tansu's
        memory storage after a restart) with a new one, which gets a new id; the events it held are sent
        again. False when the new one could not connect (the loop tries again)."""
        producer, self._producer = self._producer, None
        self._count_error(ProducerIdLost("the broker does not know the producer id; starting a new producer"))
        try:
            producer.hand_back(timeout=1.0)
        except Exception as exc:  # noqa: BLE001 - replacing it anyway
            log.warning("event producer close failed: %s", exc)
        self.renewed += 1
        return self._connect()

    def _on_sent(self) -> None:
        self.sent += 1

    def _returned(self, value: bytes, key: bytes) -> None:
        self._resend.append((value, key))

    def _count_lost(self, exc: BaseException) -> None:
        self.lost += 1
        self._count_error(exc)

    def _count_error(self, exc: BaseException) -> None:
        self.errors += 1
        msg = f"{type(exc).__name__}: {exc}"
        if msg != self.last_error:
            log.warning("%s events: %s", self.name, msg)
        self.last_error = msg

    def wait_sent(self, n: int, timeout: float = 10.0) -> bool:
        """Block until ``n`` events were acknowledged (tests, the demo)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sent >= n:
                return True
            time.sleep(0.02)
        return self.sent >= n
