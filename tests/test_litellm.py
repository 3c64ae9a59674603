"""The LiteLLM CustomLogger through LiteLLM's own Router and logging machinery, in front of two real
OpenAI servers (tiny model, FP8 and FP16), with real Redis flags and a real broker.

Not the LiteLLM proxy process: ``litellm[proxy]`` cannot be installed next to this project's pins
(docs/INTEGRATIONS.md says why), so the proxy's call of ``async_pre_call_hook`` is made here with
the same arguments (a real ``UserAPIKeyAuth`` and ``DualCache``)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list
litellm = pytest.importorskip("litellm")
pytest.importorskip("torch")

from litellm.caching.dual_cache import DualCache  # noqa: E402
from litellm.proxy._types import UserAPIKeyAuth  # noqa: E402

from probes.engines.torch_engine import TorchEngine  # noqa: E402
from probes.openai_server import OpenAIServer  # noqa: E402
from tests.test_gateway import read_events  # noqa: E402
from watchdog.actuator import FlagStore  # noqa: E402
from watchdog.gateway.config import EventsConfig  # noqa: E402
from watchdog.gateway.emitter import EventEmitter  # noqa: E402
from watchdog.integrations.litellm import WatchdogLogger  # noqa: E402
from watchdog.keys import Keys, client_from_url  # noqa: E402
from watchdog.routing import RoutingFlags  # noqa: E402

# litellm trips pydantic and other warnings of its own; this project's code is checked by the other tests
pytestmark = [pytest.mark.services, pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning")]


@pytest.fixture(scope="module")
def upstreams(tiny_model_dir: Path) -> Iterator[dict[str, OpenAIServer]]:
    servers = {p: OpenAIServer(TorchEngine(tiny_model_dir, p), model_name=f"tiny-{p}").start()
               for p in ("fp8", "fp16")}
    yield servers
    for s in servers.values():
        s.stop()


def test_the_logger_routes_by_flag_and_logs_events(upstreams: dict[str, OpenAIServer], redis_service: Any,
                                                   kafka_service: Any, topic: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = f"redis://{redis_service.address}/0"
    flags = RoutingFlags(url, Keys(prefix))
    assert flags.wait_ready(5)
    emitter = EventEmitter(EventsConfig(bootstrap_servers=kafka_service.address, topic=topic,
                                        flush_interval_s=0.01)).start()
    logger = WatchdogLogger(flags, emitter, {"tiny": {"fp8": "tiny-fp8", "fp16": "tiny-fp16"}},
                            key_routes={"legal-team": "legal"}, log_completions=True)
    router = litellm.Router(model_list=[
        {"model_name": f"tiny-{p}", "litellm_params": {"model": f"openai/tiny-{p}", "api_base": s.base_url,
                                                        "api_key": "none"}} for p, s in upstreams.items()],
        num_retries=0)
    old_callbacks = litellm.callbacks
    litellm.callbacks = [logger]

    async def call(route: str | None = "support", key_alias: str | None = None) -> Any:
        data: dict[str, Any] = {"model": "tiny", "max_tokens": 8,
                                "messages": [{"role": "user", "content": "Q: capital of France? A:"}],
                                "proxy_server_request": {"headers": {"X-LLMWD-Route": route} if route else {}}}
        data = await logger.async_pre_call_hook(UserAPIKeyAuth(api_key="sk-x", key_alias=key_alias), DualCache(),
                                                data, "acompletion")
        data.pop("proxy_server_request")  # the proxy keeps it for itself
        return await router.acompletion(**data)

    async def scenario() -> list[str]:
        models = [(await call()).model]
        FlagStore(client_from_url(url), Keys(prefix)).flip("tiny", "support", "fp16", expected_epoch=None,
                                                           reason="t", changed_by="t")
        deadline = time.monotonic() + 3
        while flags.precision_for("tiny", "support") != "fp16" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        models.append((await call()).model)
        upstreams["fp8"].backend.fail_status = 500
        try:
            with pytest.raises(Exception, match="500|Internal|failing"):
                await call(route=None, key_alias="legal-team")
        finally:
            upstreams["fp8"].backend.fail_status = None
        deadline = time.monotonic() + 5
        while emitter.accepted < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # LiteLLM runs its logging callbacks in the background
        return models

    try:
        models = asyncio.run(scenario())
    finally:
        litellm.callbacks = old_callbacks
        emitter.close()
        flags.close()
    assert [m.removeprefix("openai/") for m in models] == ["tiny-fp8", "tiny-fp16"]
    events = read_events(kafka_service.address, topic, 3)
    assert [(e.model, e.route, e.precision, e.status) for e in events] == [
        ("tiny", "support", "fp8", "ok"), ("tiny", "support", "fp16", "ok"), ("tiny", "legal", "fp8", "error")]
    assert events[0].completion == " Paris." and events[0].completion_tokens > 0 and events[0].latency_ms > 0
