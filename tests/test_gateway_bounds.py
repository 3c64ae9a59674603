"""What a client or a burst can make the gateway hold: the in-flight bound (``gateway.max_in_flight``)
and the event of a stream that stalls. The real ``openai`` client and raw aiohttp clients against the
gateway (uvicorn), in front of a real scripted HTTP upstream (tests/scripted_upstream.py), real Redis
flags and a real Kafka-protocol broker.

Found by an attack on the gateway (2026-12-08): with no bound, 200 concurrent requests to a slow
upstream were 200 requests at the upstream at once; and a stream that stalled past
``timeout_s`` after 5 chunks had its event say 0 completion tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

from tests import helpers  # noqa: E402
from tests.scripted_upstream import Upstream  # noqa: E402
from watchdog.gateway.config import load_gateway_config  # noqa: E402
from watchdog.gateway.server import GatewayServer, build_gateway  # noqa: E402

pytestmark = [pytest.mark.services]
MODEL = "m"
MESSAGES = [{"role": "user", "content": "Q: capital of France? A:"}]
BODY = {"model": MODEL, "messages": MESSAGES}


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


@pytest.fixture
def gateway(upstream: Upstream, redis_service: Any, kafka_service: Any, topic: str,
            request: pytest.FixtureRequest) -> Iterator[GatewayServer]:
    upstream.mode, upstream.closed_at, upstream.peak = "ok", None, 0
    settings: dict[str, Any] = getattr(request, "param", {})
    up = {"url": upstream.base_url, "timeout_s": settings.pop("timeout_s", 10)}
    cfg = load_gateway_config(None, redis_url=f"redis://{redis_service.address}/0",
                              redis_prefix=f"t{uuid.uuid4().hex[:8]}", port=0,
                              pools=[{"model": MODEL, "candidate": up, "baseline": up}],
                              events={"bootstrap_servers": kafka_service.address, "topic": topic,
                                      "flush_interval_s": 0.01}, **settings)
    app = build_gateway(cfg)
    assert app.flags.wait_ready(5)
    srv = GatewayServer(app).start()
    yield srv
    srv.stop()


def client(srv: GatewayServer, **kw: Any) -> Any:
    return openai.OpenAI(base_url=srv.base_url, api_key="none", **{"max_retries": 0, "timeout": 10, **kw})


async def _post(session: Any, url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes, float]:
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        content = await resp.read()
        return resp.status, dict(resp.headers), content, time.perf_counter() - t0


def flood(srv: GatewayServer, n: int, body: dict[str, Any] = BODY) -> list[tuple[int, dict[str, str], bytes, float]]:
    """``n`` concurrent requests, each on its own connection: (status, headers, body, seconds) each."""
    async def run() -> list[tuple[int, dict[str, str], bytes, float]]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=20)) as session:
            url = f"{srv.base_url}/chat/completions"
            return list(await asyncio.gather(*(_post(session, url, body) for _ in range(n))))
    return asyncio.run(run())


@pytest.mark.parametrize("gateway", [{"timeout_s": 0.5}], indirect=True)
def test_a_stream_that_stalls_past_the_timeout_counts_the_tokens_it_relayed(
        gateway: GatewayServer, upstream: Upstream, kafka_service: Any, topic: str) -> None:
    upstream.mode, upstream.stall_after = "stall", 5
    got = []
    with pytest.raises(openai.APIError) as err:
        for chunk in client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
            got.append(chunk.choices[0].delta.content)
    assert len(got) == 5 and "mid-stream" in str(err.value)
    (ev,) = helpers.read_events(kafka_service.address, topic, 1)
    assert ev.status == "timeout" and ev.completion_tokens == 5
    assert ev.ttft_ms is not None and ev.latency_ms >= 500
