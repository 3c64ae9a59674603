"""The LiteLLM integration against a real LiteLLM proxy process (``litellm --config``) in front of two
real OpenAI-compatible servers (probes/openai_server.py over the tiny torch engine, FP8 and FP16),
with real Redis flags and the Tansu broker."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litellm")
pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("websockets") is None:
    pytest.skip("the LiteLLM proxy's dependencies are not installed (pip install -e '.[litellm]')",
                allow_module_level=True)

import httpx  # noqa: E402
import openai  # noqa: E402

from probes.engines.torch_engine import TorchEngine  # noqa: E402
from probes.openai_server import OpenAIServer  # noqa: E402
from tests.helpers import read_events  # noqa: E402
from watchdog.actuation.actuator import FlagStore  # noqa: E402
from watchdog.core.keys import Keys  # noqa: E402
from watchdog.dev.embedded import free_port  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.torch, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
MASTER_KEY = "sk-llmwd-test-" + "0" * 32
LITELLM = Path(sys.executable).parent / "litellm"


class Upstream:
    """An OpenAI-compatible server that counts the chat requests it answered."""

    def __init__(self, engine: TorchEngine, name: str) -> None:
        self.server = OpenAIServer(engine, model_name=name).start()
        self.calls = 0
        chat = self.server.backend.chat

        def counted(body: dict[str, Any]) -> dict[str, Any]:
            self.calls += 1
            return chat(body)

        self.server.backend.chat = counted  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def upstreams(tiny_model_dir: Path) -> Iterator[dict[str, Upstream]]:
    ups = {p: Upstream(TorchEngine(tiny_model_dir, p, batch_size=1), f"tiny-{p}") for p in ("fp8", "fp16")}
    yield ups
    for u in ups.values():
        u.server.stop()


@pytest.fixture(scope="module")
def proxy(upstreams: dict[str, Upstream], redis_service: Any, kafka_service: Any,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not LITELLM.exists():
        pytest.skip(f"no litellm executable next to {sys.executable}")
    work = tmp_path_factory.mktemp("litellm")
    prefix = f"llmwd{uuid.uuid4().hex[:6]}"
    topic = f"llm.inference.logs.litellm.{uuid.uuid4().hex[:8]}"
    dead = free_port()  # nothing listens here: the "bf16" deployment always fails
    (work / "llmwd.yaml").write_text(f"""\
redis_url: redis://127.0.0.1:{redis_service.port}/0
redis_prefix: {prefix}
bootstrap_servers: {kafka_service.address}
topic: {topic}
variants:
  tiny: {{fp8: tiny-fp8, fp16: tiny-fp16, bf16: tiny-bf16}}
key_routes: {{}}
routes: [legal, support, broken]
default_route: default
""")
    models = "".join(f"""\
  - model_name: tiny-{p}
    litellm_params: {{model: openai/tiny-{p}, api_base: "{url}", api_key: none, timeout: 10}}
""" for p, url in (("fp8", upstreams["fp8"].server.base_url), ("fp16", upstreams["fp16"].server.base_url),
                   ("bf16", f"http://127.0.0.1:{dead}/v1")))
    (work / "proxy.yaml").write_text(f"""\
model_list:
{models}  - model_name: tiny
    litellm_params: {{model: openai/tiny-fp16, api_base: "{upstreams['fp16'].server.base_url}", api_key: none}}
litellm_settings:
  callbacks: watchdog.integrations.litellm.handler
  num_retries: 0
router_settings:
  num_retries: 0
general_settings:
  master_key: {MASTER_KEY}
""")
    port = free_port()
    env = {**os.environ, "LLMWD_LITELLM_CONFIG": str(work / "llmwd.yaml"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "PYTHONPATH": str(ROOT), "NO_DOCS": "True", "DISABLE_ADMIN_UI": "True"}
    logf = (work / "proxy.log").open("w")
    proc = subprocess.Popen([str(LITELLM), "--config", str(work / "proxy.yaml"), "--host", "127.0.0.1",
                             "--port", str(port), "--num_workers", "1"], cwd=work, env=env, stdout=logf,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"litellm proxy exited {proc.returncode}:\n{(work / 'proxy.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health/liveliness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"litellm proxy not up in 120 s:\n{(work / 'proxy.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield {"url": url, "prefix": prefix, "topic": topic, "log": work / "proxy.log"}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        logf.close()


def test_flag_picks_the_deployment_and_every_answer_becomes_an_event(proxy, upstreams, redis_client, kafka_service):
    store = FlagStore(redis_client, Keys(proxy["prefix"]))
    client = openai.OpenAI(base_url=proxy["url"] + "/v1", api_key=MASTER_KEY, max_retries=0, timeout=30)
    route = "legal"
    store.flip("tiny", route, "fp8", expected_epoch=None, reason="rollout", changed_by="test")
    time.sleep(0.3)  # the proxy's flag reader gets the change over pub/sub

    def ask(route: str) -> Any:
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=4, extra_headers={"X-LLMWD-Route": route})

    before = {p: u.calls for p, u in upstreams.items()}
    r1 = ask(route)
    assert upstreams["fp8"].calls == before["fp8"] + 1 and upstreams["fp16"].calls == before["fp16"]
    assert r1.choices[0].message.content is not None

    # the watchdog flips the route back to FP16: the next request goes to the baseline deployment
    store.flip("tiny", route, "fp16", expected_epoch=1, reason="regression", changed_by="test")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ask(route)
        if upstreams["fp16"].calls > before["fp16"]:
            break
        time.sleep(0.2)
    fp8_calls = upstreams["fp8"].calls
    assert upstreams["fp16"].calls == before["fp16"] + 1, "flip not obeyed within 5 s"
    ask(route)
    assert upstreams["fp8"].calls == fp8_calls and upstreams["fp16"].calls == before["fp16"] + 2

    # a route without a flag gets the default precision (fp8)
    ask("support")
    assert upstreams["fp8"].calls == fp8_calls + 1

    # a flag naming a deployment that is down: the client sees an error, the watchdog an error event
    store.flip("tiny", "broken", "bf16", expected_epoch=None, reason="test", changed_by="test")
    time.sleep(0.3)
    with pytest.raises(openai.APIError):
        ask("broken")

    d8, d16 = upstreams["fp8"].calls - before["fp8"], upstreams["fp16"].calls - before["fp16"]
    sent = d8 + d16 + 1
    events = read_events(kafka_service.address, proxy["topic"], sent, timeout=20.0)
    assert len(events) == sent, (events, proxy["log"].read_text()[-2000:])
    by_route = {}
    for ev in events:
        by_route.setdefault((ev.route, ev.precision, ev.status), []).append(ev)
        assert ev.model == "tiny" and ev.latency_ms > 0
    served = [e for e in events if e.status == "ok"]
    assert all(e.completion_tokens > 0 and e.prompt_tokens > 0 for e in served)
    assert {e.engine for e in served} == {"litellm:tiny-fp8", "litellm:tiny-fp16"}
    # every answer is logged with the precision that served it
    assert len(by_route[(route, "fp8", "ok")]) == d8 - 1
    assert len(by_route[(route, "fp16", "ok")]) == d16 == 2
    assert len(by_route[("support", "fp8", "ok")]) == 1
    assert len(by_route[("broken", "bf16", "error")]) == 1
    assert len({e.request_id for e in events}) == len(events)
