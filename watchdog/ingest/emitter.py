"""Events off the request path: a bounded buffer drained by one producer thread.

Used by the gateway (``watchdog.gateway``) and the LiteLLM logger (``watchdog.integrations.litellm``).
``emit`` never blocks and never raises: when the buffer is full the event is dropped and counted.
The thread hands batches to the Kafka producer (confluent-kafka when installed, else kafka-python;
both batch again per partition), each event keyed by its route (``events.partition_key``); a send
that fails, or a broker that cannot be reached, is counted and logged, never seen by a client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from watchdog.core.brokers import require_bootstrap_servers, require_topic_name
from watchdog.core.events import partition_key
from watchdog.core.truncation import MAX_VALUE_BYTES, fit_event

log = logging.getLogger(__name__)


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

    @field_validator("librdkafka")
    @classmethod
    def _librdkafka_idempotent(cls, settings: dict[str, Any]) -> dict[str, Any]:
        return require_idempotence_settings(settings, LIBRDKAFKA_IDEMPOTENCE)


class IdempotenceNames(NamedTuple):
    """One client's names for the settings the idempotent producer depends on."""

    switch: str
    acks: tuple[str, ...]
    retries: tuple[str, ...]
    in_flight: tuple[str, ...]


KAFKA_PYTHON_IDEMPOTENCE = IdempotenceNames("enable_idempotence", ("acks",), ("retries",),
                                            ("max_in_flight_requests_per_connection",))
LIBRDKAFKA_IDEMPOTENCE = IdempotenceNames("enable.idempotence", ("acks", "request.required.acks"),
                                          ("retries", "message.send.max.retries"),
                                          ("max.in.flight", "max.in.flight.requests.per.connection"))


def require_idempotence_settings(settings: dict[str, Any], names: IdempotenceNames) -> dict[str, Any]:
    """``settings``, or ValueError when they keep the producer idempotent (the emitter's default) but set what
    idempotence cannot work with: acks other than all, no retries, more than 5 requests in flight. Both
    clients refuse that when they connect, and the emitter would retry the connect for ever."""
    if _is_off(settings.get(names.switch, True)):
        return settings
    bad = [f"{k}: {settings[k]!r}" for k in names.acks if k in settings and not _is_all(settings[k])]
    bad += [f"{k}: {settings[k]!r}" for k in names.retries if k in settings and _as_int(settings[k]) == 0]
    bad += [f"{k}: {settings[k]!r}" for k in names.in_flight if k in settings and (_as_int(settings[k]) or 0) > 5]
    if bad:
        raise ValueError(f"{', '.join(bad)} does not go with the idempotent producer (on by default: a batch retried "
                         f"after a lost acknowledgement is not written twice), which needs acks: all, retries > 0 "
                         f"and at most 5 requests in flight; change it, or set {names.switch}: false and accept "
                         "duplicates")
    return settings


def _is_off(value: Any) -> bool:
    return value is False or str(value).strip().lower() in ("false", "0", "no", "off")


def _is_all(value: Any) -> bool:
    return str(value).strip().lower() in ("all", "-1")


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class _KafkaPython:
    """kafka-python behind the emitter's three calls."""

    def __init__(self, cfg: EventsConfig, on_sent: Callable[[Any], None], on_lost: Callable[[BaseException], None],
                 client_id: str, on_error: Callable[[BaseException], None]) -> None:
        # ``on_error`` (the client's own errors) has no hook in kafka-python: its failures reach ``on_lost``
        from kafka import KafkaProducer

        conf: dict[str, Any] = {"bootstrap_servers": cfg.bootstrap_servers, "linger_ms": cfg.linger_ms,
                                "acks": "all", "enable_idempotence": True, "retries": 3, "max_block_ms": 1000,
                                "batch_size": 256 * 1024, "delivery_timeout_ms": int(cfg.delivery_timeout_s * 1000),
                                "client_id": client_id}
        self._p = KafkaProducer(**(conf | cfg.producer))
        self._on_sent, self._on_lost = on_sent, on_lost

    def send(self, topic: str, value: bytes, key: bytes) -> None:
        future = self._p.send(topic, value=value, key=key)
        future.add_callback(self._on_sent)
        future.add_errback(self._on_lost)

    def poll(self) -> None:
        pass

    def flush(self, timeout: float) -> None:
        self._p.flush(timeout=timeout)

    def close(self, timeout: float) -> None:
        self._p.close(timeout=timeout)


class _Confluent:
    """confluent-kafka (librdkafka): produce() queues in C; delivery reports come on poll()."""

    def __init__(self, cfg: EventsConfig, on_sent: Callable[[Any], None], on_lost: Callable[[BaseException], None],
                 client_id: str, on_error: Callable[[BaseException], None]) -> None:
        from confluent_kafka import KafkaException, Producer

        self._on_sent, self._on_lost = on_sent, on_lost
        self._exc = KafkaException
        conf: dict[str, Any] = {"bootstrap.servers": cfg.bootstrap_servers, "linger.ms": cfg.linger_ms,
                                # acks=all: idempotence needs it
                                "enable.idempotence": True, "acks": "all", "client.id": client_id,
                                "message.timeout.ms": int(cfg.delivery_timeout_s * 1000),
                                "queue.buffering.max.messages": max(cfg.buffer_size, 1000),
                                # the Java/kafka-python partitioner: a route's events land where the
                                # daemon expects them (murmur2 of the key, docs/OPERATIONS.md)
                                "partitioner": "murmur2_random",
                                # the client's own errors (a broker down, a refused connection): no event lost
                                "error_cb": lambda err: on_error(KafkaException(err)), **cfg.librdkafka}
        self._p = Producer(conf)

    def _delivered(self, err: Any, _msg: Any) -> None:
        if err is None:
            self._on_sent(None)
        else:
            self._on_lost(self._exc(err))

    def send(self, topic: str, value: bytes, key: bytes) -> None:
        self._p.produce(topic, value=value, key=key, on_delivery=self._delivered)

    def poll(self) -> None:
        self._p.poll(0)

    def flush(self, timeout: float) -> None:
        self._p.flush(timeout)

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


class EventEmitter:
    """``name`` (``gateway``, ``litellm``) goes into the Kafka client id, the thread name and the logs."""

    def __init__(self, cfg: EventsConfig, producer_factory: Callable[[], Any] | None = None,
                 name: str = "gateway") -> None:
        self.cfg = cfg
        self.name = name
        self._factory = producer_factory or (
            lambda: _backend(cfg)(cfg, self._on_sent, self._count_lost, f"llm-watchdog-{name}", self._count_error))
        self._buf: deque[dict[str, Any]] = deque()
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

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if self._producer is None and not self._connect():
                if stopping:
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
        buf, producer, topic = self._buf, self._producer, self.cfg.topic
        for _ in range(len(buf)):
            event = buf.popleft()
            try:
                key = partition_key(str(event.get("model", "")), str(event.get("route", "")))
                value = fit_event(event, self.cfg.max_event_bytes)
                if value is None:
                    self.too_large += 1
                    continue
                if "truncated" in event:
                    self.truncated += 1
                producer.send(topic, value, key)
            except Exception as exc:  # noqa: BLE001 - client queue full, broker gone, bad value
                self._count_lost(exc)
        try:
            producer.poll()
        except Exception as exc:  # noqa: BLE001
            self._count_error(exc)

    def _on_sent(self, _meta: Any) -> None:
        self.sent += 1

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
