"""A delivery timeout under kafka-python's 30-s request timeout still delivers (kafka-python refuses such a
producer when it is built, and the emitter retried building it for ever: every event queued, none sent);
timeouts that cannot fit are a config error."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from watchdog.dev.embedded import Service
from watchdog.gateway.config import EventsConfig
from watchdog.ingest.emitter import EventEmitter


@pytest.mark.services
def test_kafka_python_delivers_with_a_short_delivery_timeout(kafka_service: Service, topic: str) -> None:
    cfg = EventsConfig(bootstrap_servers=f"127.0.0.1:{kafka_service.port}", topic=topic, client="kafka-python",
                       delivery_timeout_s=5, flush_interval_s=0.01)
    assert cfg.request_timeout_ms() == 4_980
    em = EventEmitter(cfg).start()
    try:
        for i in range(10):
            em.emit({"schema": 1, "request_id": f"r{i}", "ts": time.time(), "model": "m", "route": "r",
                     "precision": "fp8", "status": "ok", "latency_ms": 1.0})
        assert em.wait_sent(10, 15), (em.sent, em.lost, em.last_error)
    finally:
        em.close()


@pytest.mark.parametrize(("settings", "why"), [
    ({"delivery_timeout_s": 1, "linger_ms": 1000}, "linger_ms 1000 must be below delivery_timeout_s"),
    ({"delivery_timeout_s": 10, "producer": {"request_timeout_ms": 20_000}}, "request_timeout_ms 20000"),
])
def test_timeouts_that_cannot_fit_are_refused(settings: dict, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        EventsConfig(**settings)
