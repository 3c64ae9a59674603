"""End to end on real services: Tansu (Kafka protocol), redis-server, an HTTP alert sink."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import redis
from kafka import KafkaConsumer, KafkaProducer

from tests.daemon_harness import MODEL, make_config, running_daemon, traffic, write_policy
from tests.helpers import wait_until
from watchdog.actuation.actuator import FlagStore
from watchdog.core.keys import Keys
from watchdog.dev.alertsink import AlertSink
from watchdog.state.checkpoint import CheckpointStore

pytestmark = pytest.mark.services


def _alerts_for(sink: AlertSink, route: str) -> list[dict]:
    return [r.body for r in sink.received if r.path.endswith("webhook") and route in json.dumps(r.body)]


def _healthy_fp8_windows(redis_client) -> int:
    """Windows of support/chat on FP8 in the windows stream."""
    windows = [json.loads(v["json"]) for _id, v in redis_client.xrange("llmwd:windows")]
    return sum(1 for w in windows if w["route"] == "support/chat" and w["precision"] == "fp8")


def test_regression_rolls_back_once_and_healthy_route_never_flips(kafka_service, redis_service, redis_client,
                                                                  topic, tmp_path, sink):
    s, url = sink
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), url)
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, ["legal/contracts", "support/chat"],
                    daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 8, 30, what="windows to close")
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16", 30)
        # keep running: more failing windows must not page again nor write again
        closed = daemon.stats.windows_closed
        wait_until(lambda: daemon.stats.windows_closed >= closed + 16, 30)
        # and the healthy route judged in at least 10 windows (with a 1 s group join there is less
        # of a start-up backlog to close in a burst, so the count above alone may leave it at 9)
        wait_until(lambda: _healthy_fp8_windows(redis_client) >= 10, 30)
        status = httpx.get(f"{server.url}/status").json()

    store = FlagStore(redis_client, Keys())
    flag = store.get(MODEL, "legal/contracts")
    assert flag is not None and flag.precision == "fp16" and flag.policy == "e2e"
    audit = [r for r in store.audit(100) if r.get("route") == "legal/contracts"]
    assert len(audit) == 1, audit
    firing = [b for b in _alerts_for(s, "legal/contracts") if b.get("status") == "firing"]
    assert len(firing) == 1, firing
    # the healthy route served FP8 for the whole run and was judged many times
    assert store.get(MODEL, "support/chat") is None
    n = _healthy_fp8_windows(redis_client)
    assert n >= 10
    assert "legal/contracts" in json.dumps(status["flags"])


def test_poison_events_go_to_dead_letters_and_daemon_stays_up(kafka_service, redis_service, redis_client, topic,
                                                              tmp_path):
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None,
                      windows={"length_s": 1.0, "grace_s": 0.3, "max_event_bytes": 4096})
    good = {"request_id": "r1", "ts": time.time(), "model": MODEL, "route": "a", "precision": "fp8",
            "status": "ok", "latency_ms": 12.5}
    poison = [b"not json at all", b"\xff\xfe\xfa", b"[1, 2, 3]", json.dumps({**good, "route": None}).encode(),
              json.dumps({**good, "latency_ms": "fast"}).encode(), json.dumps({**good, "pad": "x" * 5000}).encode()]
    producer = KafkaProducer(bootstrap_servers=kafka_service.address)
    with running_daemon(cfg) as (daemon, server):
        for i, bad in enumerate(poison):
            producer.send(topic, value=json.dumps({**good, "request_id": f"ok{i}", "ts": time.time()}).encode())
            producer.send(topic, key=b"k%d" % i, value=bad)
        producer.flush()
        wait_until(lambda: daemon.metrics.events.labels("invalid")._value.get() >= len(poison), 30)
        wait_until(lambda: daemon.metrics.events.labels("ok")._value.get() >= len(poison), 10)
        assert httpx.get(f"{server.url}/healthz").status_code == 200
    producer.close()
    consumer = KafkaConsumer(f"{topic}.dlq", bootstrap_servers=kafka_service.address, group_id=f"dlq-{topic}",
                             auto_offset_reset="earliest", consumer_timeout_ms=15000, session_timeout_ms=2000,
                             heartbeat_interval_ms=500)
    dead = []
    for rec in consumer:
        dead.append(rec)
        if len(dead) == len(poison):
            break
    consumer.close()
    assert sorted(r.value for r in dead) == sorted(poison)
    reasons = {dict(r.headers)["llmwd.reason"].decode() for r in dead}
    assert {"not_json", "bad_utf8", "not_object", "too_large"} <= {r.split(":")[0] for r in reasons}
    assert all(dict(r.headers)["llmwd.source.topic"].decode() == topic for r in dead)


def test_invalid_policy_edit_is_rejected_and_old_policy_keeps_acting(kafka_service, redis_service, redis_client,
                                                                     topic, tmp_path, sink):
    s, url = sink
    policy = write_policy(tmp_path / "p.yaml")
    cfg = make_config(kafka_service.address, redis_service.port, topic, policy, url)
    with running_daemon(cfg) as (daemon, _server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for) as gen:
        policy.write_text(policy.read_text().replace('fail_if: "candidate < 0.85"', 'fail_if: "candidate <<< 0.85"'))
        wait_until(lambda: any("rejected" in json.dumps(r.body) for r in s.received), 15)
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16", 30)
    rejected = [r.body for r in s.received if "rejected" in json.dumps(r.body)]
    assert "p.yaml:" in json.dumps(rejected[0])  # the alert names file:line:col
    assert re.search(r"p\.yaml:\d+:\d+", rejected[0]["summary"])  # in the line on-call reads (Slack text)


def test_dry_run_alerts_would_roll_back_but_never_flips(kafka_service, redis_service, redis_client, topic,
                                                        tmp_path, sink):
    s, url = sink
    cfg = make_config(kafka_service.address, redis_service.port, topic,
                      write_policy(tmp_path / "p.yaml", dry_run=True), url)
    with running_daemon(cfg) as (daemon, _server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for) as gen:
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: any("would roll back" in json.dumps(b).lower()
                               for b in _alerts_for(s, "legal/contracts")), 30)
        time.sleep(2)
    assert redis_client.exists(f"llmwd:route:{MODEL}:legal/contracts") == 0
    assert redis_client.xlen("llmwd:audit") == 0


def test_pin_wins_over_policy_until_it_expires(kafka_service, redis_service, redis_client, topic, tmp_path, sink):
    s, url = sink
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), url)
    store = FlagStore(redis_client, Keys())
    pin_s = 20.0  # the refusal must come while pinned: the join and two windows on a loaded 2-core machine
    store.pin(MODEL, "legal/contracts", "fp8", pin_s, reason="incident drill", changed_by="test")
    pinned_at = time.time()
    with running_daemon(cfg) as (daemon, _server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for) as gen:
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: any("refused" in json.dumps(r.body) for r in s.received), pin_s)
        flag = store.get(MODEL, "legal/contracts")
        assert flag is not None and flag.precision == "fp8" and time.time() < pinned_at + pin_s
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16", 30)
    assert time.time() >= pinned_at + pin_s
    flips = [r for r in store.audit(50) if r.get("route") == "legal/contracts"]
    assert [r["precision"] for r in reversed(flips)][-1] == "fp16"


def test_redis_outage_keeps_decision_pending_then_applies_it_once(kafka_service, own_redis, topic, tmp_path, sink):
    s, url = sink
    cfg = make_config(kafka_service.address, own_redis.port, topic, write_policy(tmp_path / "p.yaml"), url)
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 2, 30)
        own_redis.kill()
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: daemon.actuator.pending() == 1, 30, what="a pending decision during the outage")
        ready = httpx.get(f"{server.url}/readyz")
        assert ready.status_code == 503 and "redis" in ready.text
        wait_until(lambda: any("Redis unreachable" in json.dumps(r.body) for r in s.received), 10)
        own_redis.start()
        wait_until(lambda: daemon.actuator.pending() == 0, 40)
        wait_until(lambda: httpx.get(f"{server.url}/readyz").status_code == 200, 20)
    client = redis.Redis(port=own_redis.port, decode_responses=True)
    store = FlagStore(client, Keys())
    assert store.get(MODEL, "legal/contracts").precision == "fp16"
    assert len([r for r in store.audit(50) if r.get("route") == "legal/contracts"]) == 1
    client.close()


def test_a_flip_waits_for_its_partitions_save_in_flight_without_blocking_the_loop(kafka_service, redis_service,
                                                                                  redis_client, topic, tmp_path,
                                                                                  monkeypatch):
    real_save, real_flip = CheckpointStore.save, FlagStore.flip
    route = (MODEL, "legal/contracts")
    armed, release = threading.Event(), threading.Event()
    flips_during_a_save: list[str] = []
    daemons: list = []

    def held_save(self, partition, token, save):  # type: ignore[no-untyped-def]
        # once armed, the route's partition's next save stays in flight until the test lets it land
        if armed.is_set() and daemons[0].ownership.route_part.get(route, (None, None))[1] == partition:
            release.wait(30)
        return real_save(self, partition, token, save)

    def flip(self, model, route_name, precision, **kw):  # type: ignore[no-untyped-def]
        ck = daemons[0].checkpointer
        if any(ck.writer.busy(p.pk) for p in ck.ownership.parts.values() if (model, route_name) in p.routes):
            flips_during_a_save.append(route_name)
        return real_flip(self, model, route_name, precision, **kw)

    monkeypatch.setattr(CheckpointStore, "save", held_save)
    monkeypatch.setattr(FlagStore, "flip", flip)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    try:
        with running_daemon(cfg) as (daemon, _server), \
                traffic(kafka_service.address, topic, [route[1]], daemon.flags.precision_for) as gen:
            daemons.append(daemon)
            wait_until(lambda: daemon.stats.windows_closed >= 6, 30, what="windows to close")
            armed.set()
            gen.inject(MODEL, route[1], "quality")
            wait_until(lambda: daemon.actuator.pending() >= 1, 40, what="the rollback to be decided")
            # decided while its partition's save is held in flight: the flip waits, the loop goes on
            assert daemon.checkpointer.writer.busy(daemon.ownership.route_part[route])
            loop_before = daemon.stats.last_loop
            time.sleep(1.0)
            assert daemon.stats.last_loop > loop_before + 0.5, "the loop stopped to wait for the save"
            assert daemon.flags.precision_for(*route) == "fp8" and daemon.actuator.pending() >= 1
            armed.clear()
            release.set()
            wait_until(lambda: daemon.flags.precision_for(*route) == "fp16", 30)
    finally:
        release.set()
    assert flips_during_a_save == []  # the save in flight landed first: it cannot overwrite the flip's state
