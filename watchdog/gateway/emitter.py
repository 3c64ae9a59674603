"""Events off the request path: a bounded buffer drained by one producer thread.

``emit`` never blocks and never raises: when the buffer is full the event is dropped and counted.
The thread hands batches to kafka-python's producer (which batches again per partition); a send
that fails, or a broker that cannot be reached, is counted and logged, never seen by a client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from watchdog.events import encode_event
from watchdog.gateway.config import EventsConfig

log = logging.getLogger(__name__)


class EventEmitter:
    def __init__(self, cfg: EventsConfig, producer_factory: Callable[[], Any] | None = None) -> None:
        self.cfg = cfg
        self._factory = producer_factory or self._kafka_producer
        self._buf: deque[dict[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._producer: Any = None
        self.accepted = 0
        self.dropped = 0
        self.sent = 0
        self.errors = 0
        self.connected = False
        self.last_error: str | None = None

    def _kafka_producer(self) -> Any:
        from kafka import KafkaProducer

        return KafkaProducer(bootstrap_servers=self.cfg.bootstrap_servers, linger_ms=self.cfg.linger_ms,
                             acks=1, retries=3, max_block_ms=1000, client_id="llm-watchdog-gateway",
                             **self.cfg.producer)

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
        self._thread = threading.Thread(target=self._run, name="llmwd-gateway-events", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Send what is buffered (up to ``timeout``), then stop."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout + 1)
            self._thread = None
        if self._producer is not None:
            try:
                self._producer.close(timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("event producer close failed: %s", exc)
            self._producer = None

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if self._producer is None and not self._connect():
                if stopping:
                    return
                self._stop.wait(1.0)
                continue
            self._drain()
            if stopping:
                try:
                    self._producer.flush(timeout=5)
                except Exception as exc:  # noqa: BLE001
                    self._count_error(exc)
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
        n = len(buf)
        for _ in range(n):
            event = buf.popleft()
            try:
                key = f"{event.get('model')}/{event.get('route')}".encode()
                future = producer.send(topic, key=key, value=encode_event(event))
                future.add_callback(self._on_sent)
                future.add_errback(self._count_error)
            except Exception as exc:  # noqa: BLE001 - buffer full in the client, broker gone
                self._count_error(exc)

    def _on_sent(self, _meta: Any) -> None:
        self.sent += 1

    def _count_error(self, exc: BaseException) -> None:
        self.errors += 1
        msg = f"{type(exc).__name__}: {exc}"
        if msg != self.last_error:
            log.warning("gateway events: %s", msg)
        self.last_error = msg

    def wait_sent(self, n: int, timeout: float = 10.0) -> bool:
        """Block until ``n`` events were acknowledged (tests, the demo)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sent >= n:
                return True
            time.sleep(0.02)
        return self.sent >= n
