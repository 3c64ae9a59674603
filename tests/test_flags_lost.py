"""Flags that hold a route off FP8 and vanish from Redis without a trace the readers' cheap check sees.

Found by an outside review (2026-12-07): a Redis shared as a cache (``maxmemory`` with ``allkeys-lru``)
evicted a rolled-back route's flag, the coldest key, and left the routes index and the audit stream (read
by every reader's check) as they were: no reader noticed for up to its 300 s full reload, and a gateway
that connected meanwhile served FP8. And an operator's pin was lost for good when Redis restarted empty:
the daemon re-asserted only its own flips."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis

from tests.daemon_harness import MODEL, make_config, running_daemon, traffic, write_policy
from tests.helpers import wait_until
from watchdog.actuation.actuator import FlagStore
from watchdog.actuation.routing import RoutingFlags
from watchdog.core.keys import Keys

pytestmark = pytest.mark.services


def test_a_flag_evicted_alone_is_reasserted_within_seconds(kafka_service, own_redis, topic, tmp_path):
    route = "legal/contracts"
    cfg = make_config(kafka_service.address, own_redis.port, topic, write_policy(tmp_path / "p.yaml"), None)
    client = redis.Redis(port=own_redis.port, decode_responses=True)
    keys = Keys()
    store = FlagStore(client, keys)
    with running_daemon(cfg) as (daemon, _server), \
            traffic(kafka_service.address, topic, [route], daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 2, 30)
        gen.inject(MODEL, route, "quality")
        wait_until(lambda: (f := store.get(MODEL, route)) is not None and f.precision == "fp16", 30)
        wait_until(lambda: daemon.flags.precision_for(MODEL, route) == "fp16" and daemon.actuator.pending() == 0, 10)
        gateway = RoutingFlags(f"redis://127.0.0.1:{own_redis.port}/0", keys, ttl_s=2.0)
        try:
            assert gateway.wait_ready(5)
            gen.inject(MODEL, route, None)  # the route stays rolled back; nothing new is written
            wait_until(lambda: daemon.flags._seen is not None and gateway._seen is not None, 15)  # noqa: SLF001
            # what an evicting Redis did to the route in the outside review's runs (maxmemory + allkeys-lru, a
            # co-tenant filling it): the flag hash, the coldest key, deleted alone; the routes index and the audit
            # stream, which every reader's check reads, left as they were. Deleted here directly: which keys the
            # approximate LRU takes varies from run to run
            route_key = keys.route(MODEL, route)
            assert client.delete(route_key) == 1
            assert client.sismember(keys.routes_index, route_key)
            evicted = time.monotonic()
            wait_until(lambda: (f := store.get(MODEL, route)) is not None and f.precision == "fp16", 15,
                       what="the rollback re-asserted")
            restored_s = time.monotonic() - evicted
            wait_until(lambda: gateway.precision_for(MODEL, route) == "fp16", 10)
        finally:
            gateway.close()
    client.close()
    print(f"flag evicted; re-asserted {restored_s:.1f} s later")


def test_an_operators_pin_lost_with_redis_is_put_back(kafka_service, own_redis, topic, tmp_path):
    route = "support/chat"
    cfg = make_config(kafka_service.address, own_redis.port, topic, write_policy(tmp_path / "p.yaml"), None)
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    client = redis.Redis(port=own_redis.port, decode_responses=True)
    keys = Keys()
    store = FlagStore(client, keys)
    gateway = RoutingFlags(url, keys)
    try:
        with running_daemon(cfg) as (daemon, _server), \
                traffic(kafka_service.address, topic, [route], daemon.flags.precision_for):
            wait_until(lambda: daemon.stats.windows_closed >= 2, 30)
            pin = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "flags", "pin", MODEL, route, "fp16",
                                  "--ttl", "30m", "--reason", "INC-123", "--redis-url", url, "--no-announce"],
                                 capture_output=True, text=True, timeout=60)
            assert pin.returncode == 0, pin.stderr
            before = store.get(MODEL, route)
            assert before is not None and before.pinned_until is not None
            wait_until(lambda: daemon.flags.flag(MODEL, route) is not None
                       and daemon.flags.flag(MODEL, route).pinned(time.time()), 10)
            client.flushall()  # Redis restarted without persistence
            lost = time.monotonic()
            wait_until(lambda: (f := store.get(MODEL, route)) is not None and f.pinned(time.time()), 15,
                       what="the pin put back")
            restored_s = time.monotonic() - lost
            after = store.get(MODEL, route)
            assert after is not None and after.precision == "fp16"
            assert abs(after.pinned_until - before.pinned_until) < 2.0  # held until the operator said
            assert "INC-123" in after.reason and after.changed_by.startswith("watchdog@")
            wait_until(lambda: gateway.precision_for(MODEL, route) == "fp16", 15)
    finally:
        gateway.close()
        client.close()
    print(f"pin put back {restored_s:.1f} s after Redis lost it")
