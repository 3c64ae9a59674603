"""Issue 20 §3: what the LiteLLM logger records for a client 4xx, a throttled call with retries and a
stream the client drops. LiteLLM's own Router (in-process, the proxy's routing core) in front of a
real HTTP upstream (tests/scripted_upstream.py), with the logger registered as its callback."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch of the cost map
litellm = pytest.importorskip("litellm")

from tests import helpers  # noqa: E402
from tests.scripted_upstream import Upstream  # noqa: E402
from watchdog.core.events import decode_event, encode_event  # noqa: E402
from watchdog.integrations.litellm import LiteLLMSettings, WatchdogLogger, failure_status  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
#: litellm's Router builds pydantic schemas that warn about ReadOnly TypedDict items
pytestmark = pytest.mark.filterwarnings("ignore:Item.*ReadOnly:UserWarning")


class Flags:
    def precision_for(self, model: str, route: str) -> str:
        return "fp8"


class Sink:
    """The logger's event buffer, kept in a list (the emitter itself is tested with a broker)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, event: dict[str, Any]) -> bool:
        self.events.append(decode_event(encode_event(event)) and event)  # valid per docs/EVENTS.md
        return True

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream().start()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def logger() -> Iterator[tuple[WatchdogLogger, Sink]]:
    """One logger for the module: LiteLLM keeps the first instance of a callback class it saw."""
    sink = Sink()
    lg = WatchdogLogger(LiteLLMSettings(variants={"tiny": {"fp8": "tiny-fp8", "fp16": "tiny-fp16"}}),
                        flags=Flags(), events=sink)
    saved = litellm.callbacks
    litellm.callbacks = [lg]
    yield lg, sink
    litellm.callbacks = saved


@pytest.fixture
def setup(upstream: Upstream, logger: tuple[WatchdogLogger, Sink]) -> tuple[WatchdogLogger, Sink, Any]:
    upstream.mode, upstream.closed_at, upstream.retry_after = "ok", None, "7"
    lg, sink = logger
    sink.events.clear()
    router = litellm.Router(model_list=[{"model_name": "tiny-fp8", "litellm_params": {
        "model": "openai/m", "api_base": upstream.base_url, "api_key": "none"}}], num_retries=2, retry_after=0)
    return lg, sink, router


def call(router: Any, **kw: Any) -> Any:
    """One call, then a moment on the same loop for LiteLLM's logging tasks to run."""
    async def go() -> Any:
        try:
            return await router.acompletion(model="tiny-fp8", messages=MESSAGES, **kw)
        finally:
            await asyncio.sleep(0.5)
    return asyncio.run(go())


def wait_events(sink: Sink, n: int) -> list[dict[str, Any]]:
    helpers.wait_until(lambda: len(sink.events) >= n, timeout=5, what=f"{n} events",
                       detail=lambda: [e["status"] for e in sink.events])
    return sink.events


def test_a_client_4xx_is_client_error_not_an_fp8_error(setup: Any, upstream: Upstream) -> None:
    lg, sink, router = setup
    upstream.mode = "400"
    with pytest.raises(litellm.BadRequestError):
        call(router)
    (ev,) = wait_events(sink, 1)  # a 400 is not retried
    assert (ev["status"], ev["precision"], ev["model"]) == ("client_error", "fp8", "tiny")


def test_a_throttled_call_is_rate_limited_once_per_attempt(setup: Any, upstream: Upstream) -> None:
    lg, sink, router = setup
    upstream.mode, upstream.retry_after = "429", "0"  # the Router waits out a Retry-After between attempts
    before = len(upstream.requests)
    with pytest.raises(litellm.RateLimitError):
        call(router)
    events = wait_events(sink, 3)
    # LiteLLM calls the failure hook once per attempt (1 + num_retries): one event each, with
    # that attempt's own latency (docs/INTEGRATIONS_otlp_litellm.md)
    assert len(upstream.requests) - before == 3
    assert [e["status"] for e in events] == ["rate_limited"] * 3
    assert len({e["request_id"] for e in events}) == 3


def test_a_dropped_stream_is_one_cancelled_event_and_the_upstream_is_let_go(setup: Any,
                                                                            upstream: Upstream) -> None:
    lg, sink, router = setup
    upstream.mode = "slow"

    async def drop_after_three() -> int:
        data: dict[str, Any] = {"model": "tiny-fp8", "messages": MESSAGES}
        stream = await router.acompletion(stream=True, **data)
        relay = lg.async_post_call_streaming_iterator_hook(None, stream, data)  # as the proxy does
        n = 0
        async for _chunk in relay:
            n += 1
            if n == 3:
                break
        await relay.aclose()  # the proxy closes the generator when its client hangs up
        return n

    assert asyncio.run(drop_after_three()) == 3
    helpers.wait_until(lambda: upstream.closed_at is not None, timeout=3, what="the upstream connection closed")
    asyncio.run(asyncio.sleep(0.5))  # no success or failure event follows
    (ev,) = sink.events
    assert ev["status"] == "cancelled" and ev["completion_tokens"] == 3


def test_failure_status_by_http_status() -> None:
    def err(cls: Any, **kw: Any) -> Any:
        return cls(message="m", llm_provider="openai", model="m", **kw)

    assert failure_status(err(litellm.BadRequestError)) == "client_error"
    assert failure_status(err(litellm.AuthenticationError)) == "client_error"
    assert failure_status(err(litellm.RateLimitError)) == "rate_limited"
    assert failure_status(err(litellm.InternalServerError)) == "error"
    assert failure_status(asyncio.CancelledError()) == "cancelled"
