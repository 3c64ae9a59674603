"""``llmwd_route_precision_is_candidate`` on the daemon's real /metrics: 0 for a rolled-back route, 1 for a
route on FP8, and no series for a route the daemon no longer knows (the Grafana panels read it)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_harness import MODEL, make_config, running_daemon, traffic, write_policy
from tests.helpers import wait_until
from watchdog.actuation.actuator import FlagStore
from watchdog.core.keys import Keys

pytestmark = pytest.mark.services


def _gauge(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.labels["model"], s.labels["route"]): s.value
            for family in text_string_to_metric_families(text) if family.name == "llmwd_route_precision_is_candidate"
            for s in family.samples}


def test_precision_gauge_reads_0_after_a_rollback_1_on_fp8_and_forgets_unknown_routes(
        kafka_service, redis_service, redis_client, topic, tmp_path):
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    keys = Keys()
    store = FlagStore(redis_client, keys)
    # an operator's flag on a route no traffic or policy state carries: known only through the flag
    store.flip("other-model", "batch", "fp16", expected_epoch=None, reason="manual", changed_by="test",
               manual=True)
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, ["legal/contracts", "support/chat"],
                    daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 4, 30, what="windows closing")
        wait_until(lambda: _gauge(server.url).get((MODEL, "legal/contracts")) == 1.0, 10)
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16", 30)
        wait_until(lambda: _gauge(server.url).get((MODEL, "legal/contracts")) == 0.0, 10)
        gauge = _gauge(server.url)
        assert gauge[(MODEL, "support/chat")] == 1.0  # healthy, never flipped: serves FP8 (no flag)
        assert gauge[("other-model", "batch")] == 0.0
        assert daemon.metrics.registry.get_sample_value(
            "llmwd_route_precision_is_candidate", {"model": MODEL, "route": "legal/contracts"}) == 0.0
        # the operator's flag is deleted: the route is no longer known, its series goes
        redis_client.delete(keys.route("other-model", "batch"))
        redis_client.srem(keys.routes_index, keys.route("other-model", "batch"))
        wait_until(lambda: ("other-model", "batch") not in _gauge(server.url), 15)
        assert _gauge(server.url)[(MODEL, "legal/contracts")] == 0.0


def test_maintenance_annotation_marks_the_live_signals_of_its_route(kafka_service, redis_service, redis_client,
                                                                    topic, tmp_path):
    """The operator's ``maintenance`` key (one JSON span) reaches the engine as ``detail["maintenance"]`` on
    the live signals of that route (``*`` model covers every model); other routes and golden signals stay
    unmarked; an unreadable value marks nothing."""
    import json

    from watchdog.core.signals import Signal
    from watchdog.runtime.daemon import Daemon

    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    keys = Keys()
    redis_client.set(keys.maintenance("*", "legal/contracts"), json.dumps({"start": 1000.0, "until": 2000.0}))
    redis_client.set(keys.maintenance(MODEL, "support/chat"), "not json")
    daemon = Daemon(cfg)
    try:
        sigs = [Signal(source="live", model=MODEL, route="legal/contracts", precision="fp8", start=1500.0,
                       end=1510.0, samples=100),
                Signal(source="live", model=MODEL, route="legal/contracts", precision="fp8", start=2500.0,
                       end=2510.0, samples=100),
                Signal(source="live", model=MODEL, route="support/chat", precision="fp8", start=1500.0,
                       end=1510.0, samples=100),
                Signal(source="golden", model=MODEL, route="legal/contracts", precision="fp8", start=1500.0,
                       end=1510.0, samples=100)]
        daemon.decisions.mark_maintenance(sigs, {(s.model, s.route) for s in sigs})
        assert [bool(s.detail.get("maintenance")) for s in sigs] == [True, False, False, False]
    finally:
        daemon.shutdown()
