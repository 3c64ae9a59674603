"""The gateway with the real openai client, in front of two real OpenAI servers (tiny model, FP8 and
FP16 through the in-process engine), real Redis flags and a real Kafka-protocol broker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from probes.engines.torch_engine import TorchEngine  # noqa: E402
from probes.openai_server import OpenAIServer  # noqa: E402
from tests import helpers  # noqa: E402
from watchdog.actuation.actuator import FlagStore  # noqa: E402
from watchdog.core.keys import Keys  # noqa: E402
from watchdog.gateway.config import load_gateway_config  # noqa: E402
from watchdog.gateway.server import GatewayServer, build_gateway  # noqa: E402
from watchdog.state.redis_conn import client_from_url  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.torch]
MODEL = "tiny"
PROMPT = "Q: capital of France? A:"


@pytest.fixture(scope="module")
def upstreams(tiny_model_dir: Path) -> Iterator[dict[str, OpenAIServer]]:
    servers = {p: OpenAIServer(TorchEngine(tiny_model_dir, p), model_name=f"tiny-{p}").start()
               for p in ("fp8", "fp16")}
    yield servers
    for s in servers.values():
        s.stop()


def gateway_cfg(upstreams: dict[str, OpenAIServer], redis_url: str, prefix: str, kafka: str, topic: str,
                **pool: Any) -> Any:
    return load_gateway_config(None, redis_url=redis_url, redis_prefix=prefix, port=0,
                               events={"bootstrap_servers": kafka, "topic": topic, "flush_interval_s": 0.01},
                               api_keys={"key-legal": "legal"}, routes=["support"],
                               pools=[{"model": MODEL, "candidate": {"url": upstreams["fp8"].base_url, "timeout_s": 5},
                                       "baseline": {"url": upstreams["fp16"].base_url, "timeout_s": 5},
                                       "log_completions": True, **pool}])


@pytest.fixture
def gateway(upstreams: dict[str, OpenAIServer], redis_service: Any, kafka_service: Any, topic: str,
            request: pytest.FixtureRequest) -> Iterator[tuple[GatewayServer, FlagStore, str]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = f"redis://{redis_service.address}/0"
    pool = getattr(request, "param", {})
    app = build_gateway(gateway_cfg(upstreams, url, prefix, kafka_service.address, topic, **pool))
    assert app.flags.wait_ready(5)
    srv = GatewayServer(app).start()
    yield srv, FlagStore(client_from_url(url), Keys(prefix)), topic
    srv.stop()


def client(srv: GatewayServer, key: str = "none", timeout: float = 10) -> Any:
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=timeout)


def chat(c: Any, route: str | None = "support", stream: bool = False) -> tuple[Any, str]:
    """(headers, completion text) of one chat request."""
    extra = {"X-LLMWD-Route": route} if route else {}
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, stream=stream,
        extra_headers=extra)
    if stream:
        text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    else:
        text = raw.parse().choices[0].message.content
    return raw.headers, text


def read_events(kafka: str, topic: str, n: int, timeout: float = 10.0) -> list[Any]:
    return sorted(helpers.read_events(kafka, topic, n, timeout), key=lambda e: e.ts)  # partitions interleave


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_flip_reroutes_the_next_request_streamed_or_not(gateway: Any, kafka_service: Any) -> None:
    srv, store, topic = gateway
    c = client(srv)
    headers, text = chat(c)
    assert headers["x-llmwd-precision"] == "fp8" and text == " Paris."
    assert headers["x-request-id"]
    headers, streamed = chat(c, stream=True)
    assert headers["x-llmwd-precision"] == "fp8" and streamed == text
    store.flip(MODEL, "support", "fp16", expected_epoch=None, reason="test", changed_by="test")
    wait_for(lambda: srv.app.flags.precision_for(MODEL, "support") == "fp16", 2)
    for stream in (False, True):
        headers, _ = chat(c, stream=stream)
        assert headers["x-llmwd-precision"] == "fp16"
    # another route (by API key) still serves the default
    headers, _ = chat(client(srv, key="key-legal"), route=None)
    assert headers["x-llmwd-precision"] == "fp8" and headers["x-llmwd-route"] == "legal"

    events = read_events(kafka_service.address, topic, 5)
    assert [(e.route, e.precision) for e in events] == [("support", "fp8")] * 2 + [("support", "fp16")] * 2 + [
        ("legal", "fp8")]
    # which event and field (once flaky in CI, 2026-12-07: the line said only 'assert False')
    assert all(e.status == "ok" and e.latency_ms > 0 and e.completion_tokens > 0 for e in events), [
        (e.route, e.precision, e.status, e.latency_ms, e.completion_tokens) for e in events]
    assert events[0].completion == " Paris." and events[0].ttft_ms is None
    assert events[1].ttft_ms is not None and events[1].ttft_ms <= events[1].latency_ms


def test_request_id_and_traceparent_pass_through(gateway: Any, kafka_service: Any) -> None:
    srv, _, topic = gateway
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    raw = client(srv).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
        extra_headers={"X-Request-ID": "req-42", "traceparent": trace})
    assert raw.headers["x-request-id"] == "req-42"
    (event,) = read_events(kafka_service.address, topic, 1)
    assert event.extra["client_request_id"] == "req-42" and event.request_id != "req-42"  # the gateway's id
    assert event.extra["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_upstream_5xx_and_timeout_give_clean_errors_and_events(gateway: Any, kafka_service: Any,
                                                               upstreams: dict[str, OpenAIServer]) -> None:
    srv, _, topic = gateway
    c = client(srv)
    upstreams["fp8"].backend.fail_status = 500
    try:
        with pytest.raises(openai.APIStatusError) as err:
            chat(c)
        assert err.value.status_code == 502 and "HTTP 500" in str(err.value)
        with pytest.raises(openai.APIStatusError):
            chat(c, stream=True)
    finally:
        upstreams["fp8"].backend.fail_status = None
    srv.app.cfg.pools[0].candidate.timeout_s = 0.3
    upstreams["fp8"].backend.delay_s = 1.0
    try:
        with pytest.raises(openai.APIStatusError) as err:
            chat(c)
        assert err.value.status_code == 504
    finally:
        upstreams["fp8"].backend.delay_s = 0.0
    time.sleep(1.0)  # let the slow request release the model lock
    events = read_events(kafka_service.address, topic, 3)
    assert [e.status for e in events] == ["error", "error", "timeout"]
    assert events[0].extra["http_status"] == 500 and events[2].latency_ms >= 250


def test_redis_down_keeps_serving_the_last_known_flag(upstreams: dict[str, OpenAIServer], own_redis: Any,
                                                      kafka_service: Any, topic: str) -> None:
    url = f"redis://{own_redis.address}/0"
    FlagStore(client_from_url(url), Keys()).flip(MODEL, "support", "fp16", expected_epoch=None, reason="t",
                                                 changed_by="t")
    app = build_gateway(gateway_cfg(upstreams, url, "llmwd", kafka_service.address, topic))
    assert app.flags.wait_ready(5)
    srv = GatewayServer(app).start()
    try:
        assert chat(client(srv))[0]["x-llmwd-precision"] == "fp16"
        own_redis.kill()
        wait_for(lambda: not app.flags.healthy, 5)
        for stream in (False, True):
            assert chat(client(srv), stream=stream)[0]["x-llmwd-precision"] == "fp16"
    finally:
        srv.stop()


POLICY = """\
policies:
  - name: gw
    scope: {models: ["*"], routes: ["*"]}
    cooldown: 0s
    max_flips_per_day: 10
    promote: {mode: manual}
    rules:
      - name: fp8-errors
        source: live
        metric: error_rate
        fail_if: "candidate > 0.2"
        min_samples: 5
        for: 1
        severity: critical
        action: rollback
"""


@pytest.mark.parametrize("gateway", [{"shadow_sample": 1.0}], indirect=True)
def test_shadows_then_the_daemon_rolls_back_a_failing_fp8_upstream(gateway: Any, kafka_service: Any,
                                                                   redis_service: Any, tmp_path: Path,
                                                                   upstreams: dict[str, OpenAIServer]) -> None:
    from tests.daemon_harness import make_config, running_daemon

    srv, store, topic = gateway
    c = client(srv)
    chat(c)
    (event,) = read_events(kafka_service.address, topic, 1)
    assert event.precision == "fp8" and event.shadow is not None
    assert event.shadow.precision == "fp16" and event.shadow.completion == event.completion == " Paris."

    policy = tmp_path / "gw.yaml"
    policy.write_text(POLICY)
    cfg = make_config(kafka_service.address, redis_service.port, topic, policy, None,
                      redis={"url": f"redis://{redis_service.address}/0", "prefix": store.keys.prefix})
    served: list[str] = []
    with running_daemon(cfg) as (daemon, _):
        upstreams["fp8"].backend.fail_status = 503
        try:
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                try:
                    served.append(chat(c)[0]["x-llmwd-precision"])
                except openai.APIStatusError as exc:
                    assert exc.status_code == 502
                    served.append("failed")
                if served[-1] == "fp16":
                    break
                time.sleep(0.05)
        finally:
            upstreams["fp8"].backend.fail_status = None
        assert served[-1] == "fp16", served[-10:]
        flag = store.get(MODEL, "support")
        assert flag is not None and flag.precision == "fp16" and flag.policy == "gw"
        assert daemon.stats.windows_closed > 0


@pytest.mark.parametrize("gateway", [{"model": "*", "served_model": MODEL}], indirect=True)
def test_a_wildcard_pool_with_served_model_obeys_one_flag_whatever_model_the_client_names(
        gateway: Any, kafka_service: Any) -> None:
    # before served_model, a client that renamed its model reached a route with no flag: a rollback of
    # (tiny, support) still served "tiny-x" FP8, and each new name was one more route for the daemon
    srv, store, topic = gateway
    store.flip(MODEL, "support", "fp16", expected_epoch=None, reason="test", changed_by="test")
    wait_for(lambda: srv.app.flags.precision_for(MODEL, "support") == "fp16", 2)
    c = client(srv)
    for name in ("tiny-x", MODEL):
        raw = c.chat.completions.with_raw_response.create(
            model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
            extra_headers={"X-LLMWD-Route": "support"})
        assert raw.headers["x-llmwd-precision"] == "fp16", name
    events = read_events(kafka_service.address, topic, 2)
    assert [(e.model, e.route, e.precision) for e in events] == [(MODEL, "support", "fp16")] * 2
