"""Small helpers shared by several test modules."""

from __future__ import annotations

import os
import time
from typing import Any, NoReturn

import pytest


def missing(ci_message: str, local_message: str) -> NoReturn:
    """A tool the suite needs is absent: a failure in CI (setup installs it), a skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(ci_message)
    pytest.skip(local_message)


def read_events(kafka: str, topic: str, n: int, timeout: float = 10.0) -> list[Any]:
    """The decoded events of ``topic`` from the start, until ``n`` arrived or ``timeout`` passed."""
    from kafka import KafkaConsumer

    from watchdog.core.events import decode_event

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka, auto_offset_reset="earliest",
                             consumer_timeout_ms=500, group_id=None)
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            out += [decode_event(m.value) for m in consumer]
    finally:
        consumer.close()
    return out
