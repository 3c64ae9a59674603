"""WatchdogLogger without a proxy: route resolution, hooks that never raise, a bounded event buffer.
Real Redis flags (RoutingFlags) and, for the buffer, a broker address where nothing listens."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("litellm")

from watchdog.actuation.actuator import FlagStore  # noqa: E402
from watchdog.actuation.routing import RoutingFlags  # noqa: E402
from watchdog.core.events import decode_event, encode_event  # noqa: E402
from watchdog.core.keys import Keys  # noqa: E402
from watchdog.dev.embedded import free_port  # noqa: E402
from watchdog.ingest.emitter import EventEmitter, EventsConfig  # noqa: E402
from watchdog.integrations.litellm import LiteLLMSettings, WatchdogLogger, failure_status  # noqa: E402

pytestmark = pytest.mark.services


@pytest.fixture
def logger(redis_service: Any, redis_client: Any):
    prefix = f"llmwd{uuid.uuid4().hex[:6]}"
    settings = LiteLLMSettings(redis_url=f"redis://127.0.0.1:{redis_service.port}/0", redis_prefix=prefix,
                               bootstrap_servers=f"127.0.0.1:{free_port()}", topic="t", buffer_size=3,
                               variants={"tiny": {"fp8": "tiny-fp8", "fp16": "tiny-fp16"}},
                               key_routes={"team-legal": "legal"}, model_routes={"tiny": "by-model"},
                               routes=["legal", "odd", "chat"], key_allow_routes={"team-legal": ["legal/eval"]})
    flags = RoutingFlags(settings.redis_url, Keys(prefix), default_precision="fp8")
    assert flags.wait_ready(3)
    events = EventEmitter(EventsConfig(bootstrap_servers=settings.bootstrap_servers, topic=settings.topic,
                                       buffer_size=3), name="litellm").start()
    lg = WatchdogLogger(settings, flags=flags, events=events)
    yield lg, FlagStore(redis_client, Keys(prefix))
    events.close(timeout=0.1)
    flags.close()


def _call(lg: WatchdogLogger, data: dict[str, Any], key: Any = None) -> dict[str, Any]:
    return asyncio.run(lg.async_pre_call_hook(key or SimpleNamespace(), None, data, "completion"))


def _wait_flag(lg: WatchdogLogger, route: str, precision: str) -> None:
    deadline = time.monotonic() + 3
    while lg.flags.precision_for("tiny", route) != precision and time.monotonic() < deadline:
        time.sleep(0.02)


def test_route_sources_and_the_flag_pick_the_deployment(logger):
    lg, store = logger
    store.flip("tiny", "legal", "fp16", expected_epoch=None, reason="r", changed_by="t")
    _wait_flag(lg, "legal", "fp16")
    hdr = {"proxy_server_request": {"headers": {"X-LLMWD-Route": "legal"}}}
    assert _call(lg, {"model": "tiny", "litellm_call_id": "a", **hdr})["model"] == "tiny-fp16"
    assert _call(lg, {"model": "tiny"}, SimpleNamespace(key_alias=None, team_alias="team-legal"))["model"] == "tiny-fp16"
    data = _call(lg, {"model": "tiny", "metadata": {}})  # no header, no key: model_routes -> by-model (no flag)
    assert data["model"] == "tiny-fp8" and data["metadata"]["llmwd"]["route"] == "by-model"
    # a flag naming a precision without a deployment falls back to the baseline
    store.flip("tiny", "odd", "int4", expected_epoch=None, reason="r", changed_by="t")
    _wait_flag(lg, "odd", "int4")
    odd = {"proxy_server_request": {"headers": {"x-llmwd-route": "odd"}}}
    assert _call(lg, {"model": "tiny", **odd})["model"] == "tiny-fp16"
    assert _call(lg, {"model": "other"})["model"] == "other"  # not a routed model


def test_a_key_decides_its_route_and_a_header_cannot_escape_it(logger):
    """Issue 20 §1: a key mapped to ``legal`` (rolled back to FP16) naming ``chat`` in the header was
    served FP8 on ``chat``; the key decides, and the header picks only what the key allows."""
    lg, store = logger
    store.flip("tiny", "legal", "fp16", expected_epoch=None, reason="r", changed_by="t")
    _wait_flag(lg, "legal", "fp16")
    legal = SimpleNamespace(key_alias="team-legal", team_alias=None)

    def routed(route: str, key: Any = None) -> tuple[str, str]:
        data = _call(lg, {"model": "tiny", "metadata": {},
                          "proxy_server_request": {"headers": {"X-LLMWD-Route": route}}}, key)
        return data["model"], data["metadata"]["llmwd"]["route"]

    assert routed("chat", legal) == ("tiny-fp16", "legal")
    assert routed("legal/eval", legal) == ("tiny-fp8", "legal/eval")  # on the key's allow-list
    assert routed("made-up") == ("tiny-fp8", "by-model")  # no key: only `routes` may be named
    assert routed("chat") == ("tiny-fp8", "chat")
    assert routed("x" * 300) == ("tiny-fp8", "by-model")  # not a valid route name
    assert lg.ignored_route_headers == 3


def test_hooks_never_raise_and_map_the_outcome(logger):
    lg, _ = logger
    for bad in ({}, {"model": None}, {"model": "tiny", "proxy_server_request": "nonsense"}):
        assert _call(lg, dict(bad)) is not None
    assert lg.hook_errors == 1  # the nonsense request_server_request: counted, request left alone
    _call(lg, {"model": "tiny", "litellm_call_id": "c1"})
    t0 = datetime.now()
    asyncio.run(lg.async_log_failure_event({"litellm_call_id": "c1", "exception": TimeoutError("read timed out")},
                                           None, t0, t0 + timedelta(seconds=2)))
    asyncio.run(lg.async_log_success_event({"model": "unknown"}, None, t0, t0))  # not ours: no event
    asyncio.run(lg.async_log_success_event(None, None, "x", object()))  # garbage: counted, not raised
    ev = lg.event({"model": "tiny-fp16"}, t0, t0 + timedelta(milliseconds=250), "ok",
                  SimpleNamespace(usage=SimpleNamespace(prompt_tokens=7, completion_tokens=3)))
    assert ev is not None
    got = decode_event(encode_event(ev))  # the events validator accepts what the hook writes
    assert (got.model, got.precision, got.route, got.engine, got.latency_ms, got.completion_tokens) == \
        ("tiny", "fp16", "default", "litellm:tiny-fp16", pytest.approx(250.0), 3)
    assert lg.hook_errors == 2  # the garbage success call: counted, not raised
    assert lg.events.accepted == 1


def test_failure_status():
    import litellm

    assert failure_status(litellm.Timeout("request timed out", model="m", llm_provider="openai")) == "timeout"
    assert failure_status(TimeoutError()) == "timeout"
    assert failure_status(litellm.APIConnectionError("refused", llm_provider="openai", model="m")) == "error"
    assert failure_status(None) == "error"


def test_event_buffer_is_bounded_and_a_dead_broker_costs_events_not_requests(logger):
    lg, _ = logger
    q: EventEmitter = lg.events
    t0 = time.monotonic()
    results = [q.emit({"schema": 1, "request_id": str(i)}) for i in range(50)]
    assert time.monotonic() - t0 < 0.5  # emit never waits for the broker
    assert q.accepted + q.dropped == 50 and sum(results) == q.accepted
    assert q.dropped > 0 and q.sent == 0
