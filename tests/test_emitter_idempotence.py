"""A lost produce acknowledgement does not write an event twice.

The broker writes a batch, its answer never reaches the producer (the connection breaks after the write:
``tests.netfault.AckCutProxy``), and the producer sends the batch again. With ``acks=1`` and no idempotence, as
the emitter sent until 2026-12-08, the retry was a second copy: 20 events gave 40 records and the daemon,
which does not deduplicate ``request_id``, counted each twice. The idempotent producer numbers its batches and
the broker drops the copy; Tansu 0.6.0 does, for both clients (measured here).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import drain
from tests.netfault import AckCutProxy
from watchdog.dev.embedded import Service, free_port, start_tansu
from watchdog.gateway.config import EventsConfig
from watchdog.ingest.emitter import EventEmitter

pytestmark = pytest.mark.services
CLIENTS = ["kafka-python", pytest.param("confluent", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("confluent_kafka") is None, reason="confluent-kafka not installed"))]
FIRST, THEN = 20, 5


@pytest.fixture
def cut_broker(tmp_path: Path) -> Iterator[tuple[Service, AckCutProxy]]:
    """Tansu behind a proxy that loses its first two produce acknowledgements."""
    proxy_port = free_port()
    svc = start_tansu(workdir=tmp_path / "tansu", advertised_port=proxy_port)
    proxy = AckCutProxy(svc.port, proxy_port, cuts=2)
    yield svc, proxy
    proxy.close()
    svc.kill()


def event(i: int) -> dict[str, Any]:
    return {"schema": 1, "request_id": f"r{i}", "ts": time.time(), "model": "m", "route": "r", "precision": "fp8",
            "status": "ok", "latency_ms": 1.5}


def send_through_cuts(cut_broker: tuple[Service, AckCutProxy], topic: str, **cfg: Any) -> list[str]:
    """Emit FIRST events (one batch: queued before the producer starts), then THEN more once those are
    acknowledged; the request ids of every record on the topic, read from the broker directly."""
    from kafka import KafkaConsumer

    svc, proxy = cut_broker
    em = EventEmitter(EventsConfig(bootstrap_servers=f"127.0.0.1:{proxy.port}", topic=topic, flush_interval_s=0.01,
                                   **cfg))
    try:
        assert all(em.emit(event(i)) for i in range(FIRST))
        em.start()
        assert em.wait_sent(FIRST, 15), (em.sent, em.lost, em.last_error)
        assert all(em.emit(event(i)) for i in range(FIRST, FIRST + THEN))  # the producer goes on after the cuts
        assert em.wait_sent(FIRST + THEN, 15), (em.sent, em.lost, em.last_error)
    finally:
        em.close()
    assert proxy.cut == 2 and em.lost == 0, (proxy.cut, em.lost)
    consumer = KafkaConsumer(topic, bootstrap_servers=svc.address, auto_offset_reset="earliest")
    try:
        return [r.value.decode() for r in drain(consumer, 5.0)]
    finally:
        consumer.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_a_lost_acknowledgement_writes_no_event_twice(client: str, cut_broker: tuple[Service, AckCutProxy],
                                                      topic: str) -> None:
    records = send_through_cuts(cut_broker, topic, client=client)
    print(f"{client}: {FIRST + THEN} events, {len(records)} records, {len(set(records))} distinct")
    assert len(set(records)) == FIRST + THEN
    assert len(records) == FIRST + THEN, f"{len(records) - FIRST - THEN} extra copies written"


@pytest.mark.parametrize("client", CLIENTS)
def test_a_broker_that_forgot_the_producer_id_gets_a_new_producer(client: str, tmp_path: Path, topic: str) -> None:
    """Tansu on memory storage forgets producer ids when it restarts. The idempotent producers then never
    delivered again: librdkafka bumped the epoch ten times a second without end (each event lost after
    ``delivery_timeout_s``), kafka-python failed for good on the bump (every event lost). The emitter now
    replaces such a producer and sends again what it held: every event written once."""
    from kafka import KafkaConsumer

    svc = start_tansu(workdir=tmp_path / "tansu")
    em = EventEmitter(EventsConfig(bootstrap_servers=svc.address, topic=topic, client=client,
                                   flush_interval_s=0.01)).start()
    try:
        assert all(em.emit(event(i)) for i in range(5))
        assert em.wait_sent(5, 15), (em.sent, em.last_error)
        svc.kill()  # the first 5 go with it
        assert all(em.emit(event(i)) for i in range(5, 15))
        time.sleep(1.0)
        svc.start()
        assert em.wait_sent(15, 20), (em.sent, em.lost, em.renewed, em.last_error)
        assert all(em.emit(event(i)) for i in range(15, 20))
        assert em.wait_sent(20, 15), (em.sent, em.lost, em.renewed, em.last_error)
        em.close()
        consumer = KafkaConsumer(topic, bootstrap_servers=svc.address, auto_offset_reset="earliest")
        records = [r.value.decode() for r in drain(consumer, 5.0)]
        consumer.close()
    finally:
        em.close()
        svc.kill()
    print(f"{client}: producers renewed {em.renewed}, lost {em.lost}, {len(records)} records after the restart")
    assert em.renewed >= 1 and em.lost == 0
    assert len(records) == len(set(records)) == 15


@pytest.mark.parametrize(("client", "opt_out"), [
    ("kafka-python", {"producer": {"enable_idempotence": False, "acks": 1}}),
    pytest.param("confluent", {"librdkafka": {"enable.idempotence": False, "acks": 1}}, marks=CLIENTS[1].marks),
])
def test_an_operator_who_turns_idempotence_off_gets_the_duplicates_back(
        client: str, opt_out: dict[str, Any], cut_broker: tuple[Service, AckCutProxy], topic: str) -> None:
    """The ``producer:`` / ``librdkafka:`` settings win over the emitter's own: off means off."""
    records = send_through_cuts(cut_broker, topic, client=client, **opt_out)
    print(f"{client}, idempotence off: {FIRST + THEN} events, {len(records)} records")
    assert len(set(records)) == FIRST + THEN and len(records) > FIRST + THEN


@pytest.mark.parametrize(("settings", "says"), [
    ({"librdkafka": {"acks": 1}}, "librdkafka\n  Value error, acks: 1 does not go with the idempotent producer"),
    ({"librdkafka": {"request.required.acks": "1"}}, "request.required.acks: '1' does not go"),
    ({"librdkafka": {"max.in.flight": 10}}, "max.in.flight: 10 does not go"),
    ({"producer": {"acks": 0, "retries": 0}}, "acks: 0, retries: 0 does not go"),
    ({"producer": {"acks": 1, "enable_idempotence": True}}, "or set enable_idempotence: false"),
])
def test_settings_that_idempotence_cannot_work_with_are_a_config_error(settings: dict[str, Any], says: str) -> None:
    """Both clients refuse them at connect, and the emitter would retry that connect for ever."""
    with pytest.raises(ValueError, match="does not go with the idempotent producer") as err:
        EventsConfig(**settings)
    assert says in str(err.value), str(err.value)


@pytest.mark.parametrize("settings", [
    {"librdkafka": {"acks": "all"}}, {"librdkafka": {"acks": -1, "max.in.flight": 5}},
    {"librdkafka": {"enable.idempotence": False, "acks": 1}}, {"producer": {"enable_idempotence": "false", "acks": 0}},
    {"producer": {"acks": "all", "retries": 10}},
])
def test_settings_that_go_with_idempotence_or_turn_it_off_load(settings: dict[str, Any]) -> None:
    EventsConfig(**settings)
