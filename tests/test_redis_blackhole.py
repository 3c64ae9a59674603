"""Redis that stops answering (packets held, connections not refused) behind a user-space proxy
(issue 18 item 2): the daemon names it in readiness and pages within 5 s, although every Redis
call of a loop pass waits for its socket timeout; it recovers when Redis answers again."""

from __future__ import annotations

import json
import time

import httpx

from tests.daemon_harness import make_config, running_daemon, traffic, write_policy
from tests.helpers import wait_until
from tests.netfault import DelayProxy
from watchdog.dev.embedded import free_port


def test_redis_blackhole_is_paged_within_five_seconds(kafka_service, own_redis, topic, tmp_path, sink) -> None:
    s, url = sink
    proxy = DelayProxy(own_redis.port, free_port())
    cfg = make_config(kafka_service.address, proxy.port, topic, write_policy(tmp_path / "p.yaml"), url)
    try:
        with running_daemon(cfg) as (daemon, server), \
                traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for):
            wait_until(lambda: daemon.stats.windows_closed >= 2, 30)
            proxy.blackhole()
            started = time.monotonic()
            wait_until(lambda: any("Redis unreachable" in json.dumps(r.body) for r in s.received), 15,
                       what="the Redis page")
            paged_after = time.monotonic() - started
            print(f"redis blackhole paged after {paged_after:.2f} s")
            ready = httpx.get(f"{server.url}/readyz")
            assert ready.status_code == 503 and "redis" in ready.text
            assert paged_after <= 5.0, f"paged {paged_after:.1f} s after Redis stopped answering"
            proxy.restore()
            wait_until(lambda: httpx.get(f"{server.url}/readyz").status_code == 200, 40,
                       what="ready again after Redis answers", detail=lambda: httpx.get(f"{server.url}/readyz").text)
    finally:
        proxy.close()
