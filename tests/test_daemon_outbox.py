"""Decision, state and page in one step: pages from the outbox, incidents in Redis, flags reconciled."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
import redis

from tests.daemon_harness import (
    MODEL,
    daemon_cfg,
    make_config,
    running_daemon,
    start_daemon_process,
    traffic,
    write_policy,
)
from tests.helpers import wait_until
from watchdog.actuation.actuator import FlagStore
from watchdog.core.keys import Keys
from watchdog.dev.alertsink import AlertSink

pytestmark = pytest.mark.services

ALERT_POLICY = """\
policies:
  - name: errors
    scope: {models: ["*"], routes: ["*"]}
    rules:
      - name: error-rate
        source: live
        metric: error_rate
        fail_if: "candidate > 0.03"
        min_samples: 20
        for: 1
        severity: critical
        action: alert
    promote: {mode: manual}
"""


def _pages(s: AlertSink, status: str, accepted: bool = True) -> list[dict]:
    """The distinct pages of ``status``: delivery is at least once with a stable ``id`` (a page on the
    wire at a SIGKILL is sent again with the same id, which receivers dedupe on), so copies of one
    id count once; a page without an id counts every time."""
    out: dict[object, dict] = {}
    for n, r in enumerate(s.received):
        if isinstance(r.body, dict) and r.body.get("status") == status and r.body.get("event") != "ops" \
                and r.accepted == accepted:
            out.setdefault(r.body.get("id") or ("no-id", n), r.body)
    return list(out.values())


def test_sigkill_with_an_open_incident_and_during_its_resolve_pages_once_and_resolves_once(
        kafka_service, redis_service, redis_client, topic, tmp_path, sink):
    s, url = sink
    policy = tmp_path / "p.yaml"
    policy.write_text(ALERT_POLICY)
    # 2 s windows of ~160 events: 12 % errors never looks healthy, 0.6 % never looks broken
    cfg = daemon_cfg(kafka_service.address, redis_service.port, topic, policy, url,
                     windows={"length_s": 2.0, "grace_s": 0.3})
    with traffic(kafka_service.address, topic, ["x"], lambda m, r: "fp8", rate=80.0) as gen:
        gen.inject(MODEL, "x", "errors")
        d = start_daemon_process(cfg, tmp_path)
        try:
            wait_until(lambda: len(_pages(s, "firing")) == 1, 40,
                       detail=lambda: (tmp_path / "daemon.log").read_text()[-2000:])
            d.send_signal(signal.SIGKILL)
            d.wait(10)
            d = start_daemon_process(cfg, tmp_path)
            # the incident is still open after the restart: errors go on, no second page
            wait_until(lambda: redis_client.xlen("llmwd:windows") >= 10, 40)
            time.sleep(3.0)
            assert len(_pages(s, "firing")) == 1
            s.status = 503  # the endpoint goes down just as the route recovers
            gen.inject(MODEL, "x", None)
            wait_until(lambda: len(_pages(s, "resolved", accepted=False)) >= 1, 40)
            d.send_signal(signal.SIGKILL)  # killed while the resolve is being retried
            d.wait(10)
            s.status = 200
            d = start_daemon_process(cfg, tmp_path)
            wait_until(lambda: len(_pages(s, "resolved")) == 1, 40,
                       detail=lambda: (tmp_path / "daemon.log").read_text()[-2000:])
            time.sleep(2.0)
        finally:
            d.send_signal(signal.SIGTERM)
            assert d.wait(10) == 0
    assert (len(_pages(s, "firing")), len(_pages(s, "resolved"))) == (1, 1)


def test_redis_down_the_rollback_page_waits_for_the_flag_and_the_ops_alert_fires_once(
        kafka_service, own_redis, topic, tmp_path, sink):
    s, url = sink
    cfg = make_config(kafka_service.address, own_redis.port, topic, write_policy(tmp_path / "p.yaml"), url)
    with running_daemon(cfg) as (daemon, _server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 2, 30)
        own_redis.kill()
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: daemon.actuator.pending() == 1, 30, what="a pending decision during the outage")
        time.sleep(4.0)
        assert [p for p in _pages(s, "firing") if "rolled back" in p.get("summary", "")] == []
        own_redis.start()
        wait_until(lambda: any("rolled back" in p.get("summary", "") for p in _pages(s, "firing")), 30)
        wait_until(lambda: any(r.body.get("key") == "ops/redis" and r.body.get("status") == "resolved"
                               for r in s.received if isinstance(r.body, dict)), 15)
    client = redis.Redis(port=own_redis.port, decode_responses=True)
    audit = [r for r in FlagStore(client, Keys()).audit(50) if r.get("route") == "legal/contracts"]
    client.close()
    page_at = min(r.at for r in s.received if isinstance(r.body, dict) and "rolled back" in r.body.get("summary", ""))
    assert len(audit) == 1 and page_at >= audit[0]["ts"]
    redis_pages = [r.body for r in s.received if isinstance(r.body, dict) and r.body.get("key") == "ops/redis"]
    assert [p["status"] for p in redis_pages] == ["firing", "resolved"]


def test_a_flag_lost_from_redis_is_reasserted_despite_the_cooldown(kafka_service, redis_service, redis_client,
                                                                   topic, tmp_path):
    policy = write_policy(tmp_path / "p.yaml")
    policy.write_text(policy.read_text().replace("cooldown: 0s", "cooldown: 1h"))
    cfg = make_config(kafka_service.address, redis_service.port, topic, policy, None)
    cfg.redis.pack_engine_state = True  # the flips and checkpoints write packed engine states (the rest: JSON)
    store = FlagStore(redis_client, Keys())
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 2, 30)
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: (f := store.get(MODEL, "legal/contracts")) is not None and f.precision == "fp16", 30)
        # no rollback still on its way (the engine may decide one more while the cache said fp8):
        # the flip that follows the loss must be the re-assertion, not a late policy write
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16"
                   and daemon.actuator.pending() == 0, 10)
        time.sleep(1.5)
        assert daemon.actuator.pending() == 0
        redis_client.flushall()  # Redis restarted without persistence
        wait_until(lambda: (f := store.get(MODEL, "legal/contracts")) is not None and f.precision == "fp16", 15)
        windows = redis_client.xlen("llmwd:windows")
        wait_until(lambda: redis_client.xlen("llmwd:windows") > windows, 10)  # checkpoints go on
        assert httpx.get(f"{server.url}/readyz").status_code == 200
    audit = store.audit(10)
    assert len(audit) == 1 and "flag was lost" in audit[0]["reason"]
    from watchdog.state.checkpoint import PACKED, SCHEMA, engine_text

    value = redis_client.get(Keys().engine(cfg.kafka.group_id, MODEL, "legal/contracts"))
    assert value.startswith(PACKED) and json.loads(engine_text(value))["schema"] == SCHEMA
