"""Events off the request path: a bounded buffer drained by one producer thread.

``emit`` never blocks and never raises: when the buffer is full the event is dropped and counted.
The thread creates the kafka-python producer on first use and hands it the events; a send that
fails, or a broker that cannot be reached, is counted and logged, never seen by the caller.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from watchdog.events import encode_event

log = logging.getLogger(__name__)


class EventQueue:
    def __init__(self, bootstrap_servers: str, topic: str, *, buffer_size: int = 10_000,
                 producer_factory: Callable[[], Any] | None = None, producer_options: dict[str, Any] | None = None,
                 flush_s: float = 0.05) -> None:
        self.topic = topic
        self.buffer_size = buffer_size
        self.flush_s = flush_s
        opts = {"bootstrap_servers": bootstrap_servers, "linger_ms": 20, "acks": 1, "retries": 3,
                "max_block_ms": 1000, "client_id": "llm-watchdog-litellm", **(producer_options or {})}
        self._factory = producer_factory or (lambda: _kafka_producer(opts))
        self._buf: deque[dict[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.accepted = self.dropped = self.sent = self.errors = 0
        self.last_error: str | None = None

    def emit(self, event: dict[str, Any]) -> bool:
        """Queue one event (a dict in the docs/EVENTS.md schema); False when it was dropped."""
        if len(self._buf) >= self.buffer_size:
            self.dropped += 1
            return False
        self._buf.append(event)
        self.accepted += 1
        if self._thread is None:
            self._start()
        self._wake.set()
        return True

    def _start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="llmwd-litellm-events", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        producer = None
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if producer is None and self._buf:
                try:
                    producer = self._factory()
                except Exception as exc:  # noqa: BLE001 - a broker that is down costs events, not requests
                    self._error(exc)
                    self._stop.wait(1.0)
                    if self._stop.is_set():
                        return
                    continue
            while self._buf and producer is not None:
                event = self._buf.popleft()
                try:
                    fut = producer.send(self.topic, value=encode_event(event))
                    fut.add_callback(self._sent)
                    fut.add_errback(self._error)
                except Exception as exc:  # noqa: BLE001 - an unsendable event is counted, never raised
                    self._error(exc)
            if self._stop.is_set():
                if producer is not None:
                    try:
                        producer.flush(timeout=5)
                        producer.close(timeout=2)
                    except Exception as exc:  # noqa: BLE001
                        self._error(exc)
                return

    def _sent(self, _meta: Any) -> None:
        self.sent += 1

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("event producer: %s", self.last_error)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is buffered (up to ``timeout``), then stop."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout + 1)


def _kafka_producer(opts: dict[str, Any]) -> Any:
    from kafka import KafkaProducer

    return KafkaProducer(**opts)
