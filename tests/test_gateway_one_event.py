"""Issue 20 §3, one true event per request: client disconnects, oversized texts, upstream 429s,
``n`` > 1, upstreams without ``usage``, embeddings. The real ``openai`` client against the gateway
(uvicorn), in front of a real HTTP upstream (aiohttp.web in a thread, scripted per test so that it
can stream slowly, answer 2 MB, throttle and notice a closed connection), real Redis flags and a
real Kafka-protocol broker."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from tests import helpers  # noqa: E402
from tests.scripted_upstream import Upstream  # noqa: E402
from watchdog.core.events import decode_event  # noqa: E402
from watchdog.core.truncation import KEEP_BYTES, MAX_VALUE_BYTES  # noqa: E402
from watchdog.gateway.config import load_gateway_config  # noqa: E402
from watchdog.gateway.openai_io import estimate_prompt_tokens  # noqa: E402
from watchdog.gateway.server import GatewayServer, build_gateway  # noqa: E402

pytestmark = [pytest.mark.services]
MODEL = "m"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: capital of France? A:"}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


@pytest.fixture
def gateway(upstream: Upstream, redis_service: Any, kafka_service: Any, topic: str) -> Iterator[GatewayServer]:
    upstream.mode, upstream.closed_at = "ok", None
    pool = {"model": MODEL, "candidate": {"url": upstream.base_url, "timeout_s": 10},
            "baseline": {"url": upstream.base_url, "timeout_s": 10}, "log_completions": True}
    cfg = load_gateway_config(None, redis_url=f"redis://{redis_service.address}/0", redis_prefix=f"t{uuid.uuid4().hex[:8]}",
                              port=0, pools=[pool],
                              events={"bootstrap_servers": kafka_service.address, "topic": topic,
                                      "flush_interval_s": 0.01})
    app = build_gateway(cfg)
    assert app.flags.wait_ready(5)
    srv = GatewayServer(app).start()
    yield srv
    srv.stop()


def client(srv: GatewayServer) -> Any:
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=10)


def raw_events(kafka: str, topic: str, n: int, timeout: float = 10.0) -> list[bytes]:
    """The raw values of ``topic`` until ``n`` arrived or ``timeout`` passed."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka, auto_offset_reset="earliest",
                             consumer_timeout_ms=500, group_id=None)
    out: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            out += [m.value for m in consumer]
    finally:
        consumer.close()
    return out


def test_a_client_that_hangs_up_mid_stream_cancels_the_upstream_and_logs_one_cancelled_event(
        gateway: GatewayServer, upstream: Upstream, kafka_service: Any, topic: str) -> None:
    upstream.mode = "slow"  # 200 chunks, one every 50 ms: 10 s unless cancelled
    stream = client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
    got = [next(iter(stream)) for _ in range(3)]
    assert all(ch.choices[0].delta.content for ch in got)
    hung_up = time.monotonic()
    stream.close()
    helpers.wait_until(lambda: upstream.closed_at is not None, timeout=3, what="the upstream connection closed")
    assert upstream.closed_at is not None
    upstream_closed_s = upstream.closed_at - hung_up
    sent = upstream.chunks_sent
    assert 3 <= sent < 100
    values = raw_events(kafka_service.address, topic, 2, timeout=3)  # wait for a second one: there is none
    assert len(values) == 1
    ev = decode_event(values[0])
    assert ev.status == "cancelled" and ev.extra["cancel_ms"] >= 0
    # the tokens produced before the hang-up: what the gateway relayed (the upstream may have
    # written one more chunk into the closing connection)
    assert 3 <= ev.completion_tokens <= sent and ev.completion is None
    assert ev.prompt_tokens == estimate_prompt_tokens("chat", {"messages": MESSAGES})
    print(f"upstream connection closed {upstream_closed_s * 1000:.0f} ms after the client hung up; "
          f"gateway cancel_ms={ev.extra['cancel_ms']}; {ev.completion_tokens} tokens of {sent} sent")


def test_a_client_that_closes_after_done_is_an_ok_event_while_the_upstream_lingers(
        gateway: GatewayServer, upstream: Upstream, kafka_service: Any, topic: str) -> None:
    # the openai client closes its connection once it has read [DONE]; the upstream ends its response
    # 0.5 s later. Before, the gateway saw the close while it waited for that end and logged the whole
    # answer as cancelled (a flaky gateway test under load, where the same race is milliseconds wide)
    upstream.mode = "linger"
    chunks = list(client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == " t0.0 t0.1 t0.2"
    # and an upstream that lingers past the gateway's read timeout after [DONE]: still a whole answer
    upstream.linger_s = 1.0
    for pool in (gateway.app.cfg.pools[0].candidate, gateway.app.cfg.pools[0].baseline):
        pool.timeout_s = 0.3
    try:
        stream = client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        assert len(list(stream)) == 3
        time.sleep(1.0)
    finally:
        upstream.linger_s = 0.5
    events = [decode_event(v) for v in raw_events(kafka_service.address, topic, 2)]
    assert [(ev.status, ev.completion_tokens, "cancel_ms" in ev.extra) for ev in events] == [("ok", 3, False)] * 2, \
        events


def test_a_client_that_gives_up_on_a_plain_request_cancels_it_too(gateway: GatewayServer, upstream: Upstream,
                                                                   kafka_service: Any, topic: str) -> None:
    upstream.mode = "slow"
    c = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        c.chat.completions.create(model=MODEL, messages=MESSAGES)
    helpers.wait_until(lambda: upstream.closed_at is not None, timeout=3, what="the upstream request cancelled")
    assert upstream.closed_at is not None and upstream.closed_at - t0 < 2
    values = raw_events(kafka_service.address, topic, 2, timeout=3)
    assert len(values) == 1
    ev = decode_event(values[0])
    assert ev.status == "cancelled" and ev.completion_tokens == 0 and 400 <= ev.latency_ms < 2000


def test_a_2mb_completion_is_cut_to_fit_with_its_size_and_hash(gateway: GatewayServer, upstream: Upstream,
                                                               kafka_service: Any, topic: str) -> None:
    upstream.mode = "big"
    upstream.big = "é" + "x" * (2 * 1024 * 1024)
    answer = client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES)
    assert answer.choices[0].message.content == upstream.big  # the client gets all of it
    (value,) = raw_events(kafka_service.address, topic, 1)
    assert len(value) <= MAX_VALUE_BYTES
    print(f"2 MB completion: event of {len(value)} bytes")
    ev = decode_event(value)
    original = upstream.big.encode()
    assert ev.status == "ok" and ev.completion_tokens == 500_000
    assert ev.completion is not None and original.startswith(ev.completion.encode())
    assert len(ev.completion.encode()) <= KEEP_BYTES
    assert ev.extra["truncated"] == {"completion": {"bytes": len(original),
                                                    "sha256": hashlib.sha256(original).hexdigest()}}
    assert gateway.app.emitter is not None and gateway.app.emitter.truncated == 1


def test_an_upstream_429_reaches_the_client_with_retry_after_and_is_rate_limited(
        gateway: GatewayServer, upstream: Upstream, kafka_service: Any, topic: str) -> None:
    upstream.mode = "429"
    with pytest.raises(openai.RateLimitError) as err:
        client(gateway).chat.completions.create(model=MODEL, messages=MESSAGES)
    headers = err.value.response.headers
    assert err.value.status_code == 429 and headers["retry-after"] == "7"
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"] == "7s"
    upstream.mode = "ok"  # rate-limit headers of a successful answer pass through too
    raw = client(gateway).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)
    assert raw.headers["x-ratelimit-remaining-requests"] == "99"
    events = sorted((decode_event(v) for v in raw_events(kafka_service.address, topic, 2)), key=lambda e: e.ts)
    assert [e.status for e in events] == ["rate_limited", "ok"]
    assert events[0].extra["http_status"] == 429 and events[0].completion_tokens == 0


def test_n2_gives_one_event_with_every_choice_streamed_or_not(gateway: GatewayServer, upstream: Upstream,
                                                              kafka_service: Any, topic: str) -> None:
    c = client(gateway)
    answer = c.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    assert [ch.message.content for ch in answer.choices] == [" answer 0.", " answer 1."]
    texts = {0: "", 1: ""}
    for chunk in c.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: " t0.0 t0.1 t0.2", 1: " t1.0 t1.1 t1.2"}
    assert [r.get("n") for r in upstream.requests[-2:]] == [2, 2]
    events = sorted((decode_event(v) for v in raw_events(kafka_service.address, topic, 3, timeout=4)),
                    key=lambda e: e.ts)
    assert len(events) == 2  # one per request, not one per choice
    plain, streamed = events
    assert (plain.completion, plain.extra["other_completions"], plain.extra["choices"]) == (
        " answer 0.", [" answer 1."], 2)
    assert (streamed.completion, streamed.extra["other_completions"]) == (texts[0], [texts[1]])
    assert streamed.completion_tokens == 6  # content chunks of both choices (no usage chunk)
    # the upstream sent no usage: the prompt is estimated (bytes / 4 + 4 per message), and says so
    for ev in events:
        assert ev.prompt_tokens == estimate_prompt_tokens("chat", {"messages": MESSAGES}) > 0
        assert ev.extra["prompt_tokens_estimated"] is True


def test_embeddings_are_refused_with_a_clear_error_and_no_event(gateway: GatewayServer, upstream: Upstream,
                                                                kafka_service: Any, topic: str) -> None:
    before = len(upstream.requests)
    with pytest.raises(openai.NotFoundError) as err:
        client(gateway).embeddings.create(model=MODEL, input="hello")
    assert err.value.code == "embeddings_not_proxied" and "does not proxy embeddings" in err.value.message
    assert len(upstream.requests) == before
    assert raw_events(kafka_service.address, topic, 1, timeout=1.5) == []
