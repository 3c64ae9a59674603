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


def test_an_unreachable_broker_is_named_in_log_lines_not_librdkafka_stderr(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """librdkafka wrote a FAIL line to stderr ~3 times a second while the broker was away (the gateway's
    terminal filled with them); its lines now go to the emitter's logger at DEBUG, and the emitter's own
    warning names the cause once per change."""
    pytest.importorskip("confluent_kafka")
    caplog.set_level("DEBUG", logger="watchdog.ingest.emitter")
    em = EventEmitter(EventsConfig(bootstrap_servers="127.0.0.1:9", topic="t", client="confluent",
                                   flush_interval_s=0.01)).start()
    try:
        time.sleep(2.5)
    finally:
        em.close()
    err = capfd.readouterr().err
    assert "|FAIL|" not in err, err[:300]
    assert any(r.levelname == "DEBUG" and "librdkafka" in r.getMessage() and "127.0.0.1:9" in r.getMessage()
               for r in caplog.records)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings and any("127.0.0.1:9" in w or "brokers are down" in w for w in warnings), warnings
