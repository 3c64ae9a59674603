"""The gateway while its Kafka broker restarts: serving goes on, and every event either reaches Kafka once the
broker is back or is counted as lost.

Found by an outside review (2026-12-07): the emitter handed its buffer to librdkafka every 50 ms and set
librdkafka's ``message.timeout.ms`` to 30 s, so a broker away for 35 s lost every event written meanwhile (0 of
20 arrived), while ``llmwd_gateway_events_dropped`` stayed 0 and the delivery failures hid among connection
errors. Now the producer keeps trying for ``events.delivery_timeout_s`` (5 min) and what it gives up on is
counted in ``lost``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("confluent_kafka")

from tests import helpers  # noqa: E402
from tests.scripted_upstream import Upstream  # noqa: E402
from watchdog.dev.embedded import start_tansu  # noqa: E402
from watchdog.gateway.config import load_gateway_config  # noqa: E402
from watchdog.gateway.server import GatewayServer, build_gateway  # noqa: E402

pytestmark = [pytest.mark.services]
MODEL = "m"
N_DURING = 20


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


@pytest.fixture
def tansu(tmp_path: Any) -> Iterator[Any]:
    svc = start_tansu(workdir=tmp_path)
    yield svc
    svc.kill()


def outage(upstream: Upstream, redis_url: str, tansu: Any, topic: str, outage_s: float,
           **events: Any) -> tuple[int, Any]:
    """Serve N_DURING requests while the broker is away ``outage_s``; (events of them that arrived, emitter)."""
    pool = {"model": MODEL, "candidate": {"url": upstream.base_url, "timeout_s": 10},
            "baseline": {"url": upstream.base_url, "timeout_s": 10}}
    cfg = load_gateway_config(None, redis_url=redis_url, redis_prefix=f"t{uuid.uuid4().hex[:8]}", port=0,
                              pools=[pool], events={"bootstrap_servers": tansu.address, "topic": topic,
                                                    "flush_interval_s": 0.01, **events})
    app = build_gateway(cfg)
    assert app.flags.wait_ready(5)
    srv = GatewayServer(app).start()
    em = app.emitter
    assert em is not None
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=10)
        msgs = [{"role": "user", "content": "hi"}]
        c.chat.completions.create(model=MODEL, messages=msgs)
        assert em.wait_sent(1, 10)  # connected, topic made
        tansu.kill()
        ids = []
        for i in range(N_DURING):  # serving goes on during the outage
            raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=msgs,
                                                              extra_headers={"X-Request-ID": f"out-{i}"})
            assert raw.http_response.status_code == 200
            ids.append(f"out-{i}")
        time.sleep(outage_s)
        tansu.start()  # same port
        helpers.wait_until(lambda: em.sent + em.lost >= N_DURING + 1, 30, what="every event delivered or given up")
        c.chat.completions.create(model=MODEL, messages=msgs, extra_headers={"X-Request-ID": "after"})
        assert em.wait_sent(em.sent + 1, 15), "the event after the restart was not delivered"
        events = helpers.read_events(tansu.address, topic, N_DURING + 2, timeout=10)
        got = [e.extra.get("client_request_id") for e in events]
        assert "after" in got
        assert len(got) == len(set(got)), "an event was written twice"
        return sum(i in got for i in ids), em
    finally:
        srv.stop()


def test_a_35s_broker_restart_loses_no_event(upstream: Upstream, redis_service: Any, tansu: Any, topic: str) -> None:
    arrived, em = outage(upstream, f"redis://{redis_service.address}/0", tansu, topic, 35.0)
    print(f"35 s outage: {arrived} of {N_DURING} arrived; lost {em.lost}, errors {em.errors}")
    assert arrived == N_DURING and em.lost == 0 and em.dropped == 0


def test_events_the_producer_gives_up_on_are_counted_lost(upstream: Upstream, redis_service: Any, tansu: Any,
                                                          topic: str) -> None:
    arrived, em = outage(upstream, f"redis://{redis_service.address}/0", tansu, topic, 5.0, delivery_timeout_s=2.0)
    print(f"5 s outage, 2 s delivery timeout: {arrived} of {N_DURING} arrived; lost {em.lost}, errors {em.errors}")
    assert arrived + em.lost == N_DURING and em.lost > 0 and em.dropped == 0
