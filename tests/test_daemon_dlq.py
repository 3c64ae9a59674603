"""Dead letters before checkpoints: a poison event passes only once the broker has its DLQ copy."""

from __future__ import annotations

import json
import time

import pytest
from kafka import KafkaConsumer, KafkaProducer

from tests.daemon_harness import (
    MODEL,
    make_config,
    recorded_windows,
    running_daemon,
    write_policy,
)
from tests.helpers import drain, wait_until
from watchdog.dev.traffic import Route, TrafficGenerator

pytestmark = pytest.mark.services


def test_a_dead_letter_that_cannot_be_written_pauses_its_partition_and_nothing_passes_it(
        kafka_service, redis_service, redis_client, topic, tmp_path):
    gen = TrafficGenerator([Route(MODEL, "a", rate=1.0)])
    producer = KafkaProducer(bootstrap_servers=kafka_service.address, max_request_size=4_000_000)
    key = b"llama-test/a"
    now = time.time()
    md = None
    for i in range(60):
        if i == 20:
            md = producer.send(topic, key=key, value=b"{not json", headers=[("trace", b"t-1")]).get(10)
        elif i == 40:
            big = json.dumps({"schema": 1, "pad": "x" * 1_200_000}).encode()
            producer.send(topic, key=key, value=big, headers=[("trace", b"t-2")]).get(10)
        else:
            producer.send(topic, *reversed(gen.encoded(gen.routes[0], now=now + i * 0.01))).get(10)
    producer.close()
    policy = write_policy(tmp_path / "p.yaml")
    bad = make_config(kafka_service.address, redis_service.port, topic, policy, None,
                      kafka={"bootstrap_servers": kafka_service.address, "topic": topic, "group_id": f"g-{topic}",
                             "session_timeout_ms": 2000, "heartbeat_interval_ms": 500})
    # a DLQ the broker refuses to take (config check now refuses this name; ACLs or quotas refuse others
    # alike): set past validation
    bad = bad.model_copy(update={"kafka": bad.kafka.model_copy(update={"dlq_topic": "bad topic!"})})
    with running_daemon(bad) as (daemon, _server):
        wait_until(lambda: any(p.startswith("dlq:") for p in daemon.problems()), 30,
                   detail=daemon.problems)
        time.sleep(2.0)
        saved = [json.loads(redis_client.hget(k, "json")) for k in redis_client.keys("llmwd:ckpt:*")]
        assert all(c["offset"] is None or c["offset"] <= md.offset for c in saved), saved
        assert recorded_windows(redis_client)[0] == {}
    good = make_config(kafka_service.address, redis_service.port, topic, policy, None)
    with running_daemon(good) as (daemon, _server):
        wait_until(lambda: sum(recorded_windows(redis_client)[0].values()) >= 58, 30)
        assert not daemon.problems(), daemon.problems()
    seen, twice = recorded_windows(redis_client)
    assert (sum(seen.values()), twice) == (58, 0)
    consumer = KafkaConsumer(good.kafka.dead_letter_topic, bootstrap_servers=kafka_service.address,
                             auto_offset_reset="earliest")
    dead = [(dict(r.headers), len(r.value)) for r in drain(consumer, 8.0)]
    consumer.close()
    assert [h["trace"] for h, _ in dead] == [b"t-1", b"t-2"]  # original headers kept
    assert [h["llmwd.reason"].split(b":")[0] for h, _ in dead] == [b"not_json", b"too_large"]
    (h, size) = dead[1]
    assert h["llmwd.truncated"] == b"1" and int(h["llmwd.original.size"]) > 1_200_000 and size == 65_536
    assert len(h["llmwd.original.sha256"]) == 64
