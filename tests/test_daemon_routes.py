"""Bounded routes on real services: a flood of new routes is dead-lettered as ``route_limit`` (counted,
offsets pass it), a real route still rolls back, idle routes are forgotten (memory and Redis), and
/status stays small however many routes there are (docs/OPERATIONS.md, "Bounded routes")."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from kafka import KafkaConsumer, KafkaProducer

from tests.daemon_harness import MODEL, make_config, running_daemon, traffic, write_policy
from tests.helpers import drain, wait_until
from watchdog.actuation.actuator import FlagStore
from watchdog.core.events import encode_event, partition_key
from watchdog.core.keys import Keys

pytestmark = pytest.mark.services


def _event(route: str, i: int, ts: float | None = None) -> dict[str, object]:
    return {"schema": 1, "request_id": f"{route}-{i}", "ts": ts or time.time(), "model": MODEL, "route": route,
            "precision": "fp8", "status": "ok", "latency_ms": 100.0 + i, "completion": "ok"}


def _value(metric: object) -> float:
    return metric._value.get()  # type: ignore[attr-defined]


def test_a_route_flood_is_dead_lettered_route_limit_and_a_real_route_still_rolls_back(
        kafka_service, redis_service, redis_client, topic, tmp_path):
    cap = 20
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3, "max_routes_per_partition": cap})
    real = ["legal/contracts", "support/chat"]
    flood = [f"flood-{i}" for i in range(500)]
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, real, daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 6, 30, what="windows of the real routes")
        producer = KafkaProducer(bootstrap_servers=kafka_service.address, linger_ms=5)
        for rnd in range(2):  # every flood route twice: a route admitted once is admitted again
            for i, route in enumerate(flood):
                producer.send(topic, key=partition_key(MODEL, route), value=encode_event(_event(route, rnd * 1000 + i)))
        producer.flush()
        producer.close()
        limited = daemon.metrics.dlq.labels("route_limit")
        wait_until(lambda: _value(limited) > 0, 20, what="route_limit dead letters")
        wait_until(lambda: any(p.startswith("route-limit:") for p in daemon.problems()), 10,
                   detail=daemon.problems)
        assert httpx.get(f"{server.url}/readyz").status_code == 503
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16", 40,
                   what="the real route's rollback")
        gen.stop()
        sent = gen.sent + 2 * len(flood)
        ok, invalid = daemon.metrics.events.labels("ok"), daemon.metrics.events.labels("invalid")
        wait_until(lambda: _value(ok) + _value(invalid) >= sent, 30, what="every event counted")
        nparts = len(daemon.parts)
        admitted = {r for part in daemon.parts.values() for m, r in part.routes if r.startswith("flood-")}
        per_part = [len(part.routes) for part in daemon.parts.values()]
        active = _value(daemon.metrics.routes_active)
        time.sleep(4)  # the readiness condition has held past fire_after_s: one page
        pages = _value(daemon.metrics.ops_alerts.labels("route-limit"))
        status = httpx.get(f"{server.url}/status").json()
        assert _value(ok) + _value(invalid) == sent
        offsets_wanted = sent
        wait_until(lambda: sum((json.loads(redis_client.hget(k, "json")).get("offset") or 0)
                               for k in redis_client.keys("llmwd:ckpt:*")) == offsets_wanted, 20,
                   what="checkpoints past every record, dead letters included")

    refused = [r for r in flood if r not in admitted]
    assert all(n <= cap for n in per_part), per_part
    if nparts == 1:  # Tansu's auto-created topics have one partition
        assert len(admitted) == cap - len(real)
    assert _value(limited) == 2 * len(refused)  # both events of every refused route, none of an admitted one
    assert _value(daemon.metrics.route_limit_events.labels("partition")) == 2 * len(refused)
    assert _value(invalid) == 2 * len(refused)  # nothing else was dead-lettered
    assert active == len(admitted) + len(real)
    assert pages == 1
    assert status["routes"]["refused_events"]["partition"] == 2 * len(refused)
    store = FlagStore(redis_client, Keys())
    flag = store.get(MODEL, "legal/contracts")
    assert flag is not None and flag.precision == "fp16"
    assert store.get(MODEL, "support/chat") is None
    consumer = KafkaConsumer(cfg.kafka.dead_letter_topic, bootstrap_servers=kafka_service.address,
                             auto_offset_reset="earliest")
    dead = [dict(r.headers)["llmwd.reason"] for r in drain(consumer, 8.0)]
    consumer.close()
    assert dead == [b"route_limit"] * (2 * len(refused))


def test_idle_routes_are_forgotten_and_status_stays_small(kafka_service, redis_service, redis_client, topic,
                                                          tmp_path):
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3, "route_idle_s": 6.0})
    store = FlagStore(redis_client, Keys())
    store.flip(MODEL, "kept-fp16", "fp16", expected_epoch=None, reason="test", changed_by="test", manual=True)
    routes = [f"tenant-{i}" for i in range(300)] + ["kept-fp16"]
    with running_daemon(cfg) as (daemon, server):
        producer = KafkaProducer(bootstrap_servers=kafka_service.address, linger_ms=5)
        for i in range(3):
            for route in routes:
                producer.send(topic, key=partition_key(MODEL, route), value=encode_event(_event(route, i)))
        producer.flush()
        producer.close()
        engine = daemon.engine

        def routes_with_state() -> set[tuple[str, str]]:
            return {(m, r) for _p, m, r in list(engine.states)}

        wait_until(lambda: len(routes_with_state()) == len(routes), 30, what="engine state of every route")
        wait_until(lambda: redis_client.keys("llmwd:engine:*"), 10, what="engine state in Redis")
        # /status with 301 routes: the top 20 by default, every count beside them
        full = httpx.get(f"{server.url}/status?top=1000").content
        small = httpx.get(f"{server.url}/status").content
        doc = json.loads(small)
        assert len(small) < 64_000 < 500_000 < len(full), (len(small), len(full))  # ~2 KB per route shown
        assert doc["routes"]["with_state"] == len(routes) and doc["routes"]["shown"] == 20
        assert doc["flags"] == {f"{MODEL}/kept-fp16": "fp16"}  # the flag off the default ranks first
        one = httpx.get(f"{server.url}/status", params={"route": "tenant-7"}).json()
        assert {(s["model"], s["route"]) for s in one["verdicts"]["scopes"]} == {(MODEL, "tenant-7")}
        assert one["routes"]["shown"] == 1
        # a bad query is an error that says so, not the default document or an empty one
        for query, code, says in (({"top": "abc"}, 400, "top must be a whole number"), ({"top": "-1"}, 400, "top"),
                                  ({"tpo": "5"}, 400, "unknown /status parameter 'tpo'"),
                                  ({"route": "tenant-7x"}, 404, "no known route with route 'tenant-7x'")):
            bad = httpx.get(f"{server.url}/status", params=query)
            assert bad.status_code == code and says in bad.json()["error"], (query, bad.text)
        # nothing comes any more: after route_idle_s every route but the one flagged fp16 is forgotten
        wait_until(lambda: routes_with_state() == {(MODEL, "kept-fp16")}, 30, what="idle routes forgotten",
                   detail=lambda: len(routes_with_state()))
        wait_until(lambda: sum(len(p.routes) for p in daemon.parts.values()) == 1, 5)
        assert not any(p.agg.open_windows() for p in daemon.parts.values())
        wait_until(lambda: redis_client.keys("llmwd:engine:*") == [f"llmwd:engine:g-{topic}:{MODEL}:kept-fp16"],
                   10, what="forgotten routes' engine keys deleted", detail=lambda: len(redis_client.keys("llmwd:engine:*")))
        wait_until(lambda: [json.loads(redis_client.hget(k, "json"))["routes"] for k in redis_client.keys("llmwd:ckpt:*")
                            if json.loads(redis_client.hget(k, "json"))["routes"]] == [[[MODEL, "kept-fp16"]]],
                   10, what="the checkpoint no longer lists them")
        assert daemon.routes.evicted == 300
        # the gauge is exported once per EXPORT_EVERY_S, so it may trail the sweep that forgot them
        wait_until(lambda: daemon.metrics.routes_active._value.get() == 1, 5, what="llmwd_routes_active",
                   detail=lambda: daemon.metrics.routes_active._value.get())
        # a forgotten route that comes back is a new route, judged afresh
        producer = KafkaProducer(bootstrap_servers=kafka_service.address)
        producer.send(topic, key=partition_key(MODEL, "tenant-1"), value=encode_event(_event("tenant-1", 9)))
        producer.flush()
        producer.close()
        wait_until(lambda: (MODEL, "tenant-1") in daemon.ownership.route_part, 10)
