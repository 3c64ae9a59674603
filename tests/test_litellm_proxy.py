"""The LiteLLM CustomLogger inside a real LiteLLM proxy process, in front of two real OpenAI servers
(tiny model, FP8 and FP16), with real Redis flags and a real broker; the `openai` client talks to
the proxy.

Runs only where a LiteLLM proxy is installed: LLMWD_LITELLM_PROXY names its ``litellm`` command, or
``LLMWD_LITELLM_PROXY_VENV=1 scripts/setup.sh`` made ``.venv-litellm-proxy`` (``litellm[proxy]``
does not install next to this project's pins; docs/INTEGRATIONS.md)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_LOCAL = Path(__file__).resolve().parents[1] / ".venv-litellm-proxy" / "bin" / "litellm"
PROXY = os.environ.get("LLMWD_LITELLM_PROXY") or (str(_LOCAL) if _LOCAL.exists() else None)
if not PROXY:
    pytest.skip("no LiteLLM proxy: set LLMWD_LITELLM_PROXY, or LLMWD_LITELLM_PROXY_VENV=1 for scripts/setup.sh",
                allow_module_level=True)
openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from probes.engines.torch_engine import TorchEngine  # noqa: E402
from probes.openai_server import OpenAIServer  # noqa: E402
from tests.test_gateway import read_events  # noqa: E402
from watchdog.actuator import FlagStore  # noqa: E402
from watchdog.embedded import free_port, wait_for_port  # noqa: E402
from watchdog.keys import Keys, client_from_url  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.torch, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
MASTER = "sk-llmwd-test-0123456789abcdef"

CALLBACKS = """\
import os
from watchdog.gateway.config import EventsConfig
from watchdog.gateway.emitter import EventEmitter
from watchdog.integrations.litellm import WatchdogLogger
from watchdog.keys import Keys
from watchdog.routing import RoutingFlags

watchdog_logger = WatchdogLogger(
    RoutingFlags(os.environ["LLMWD_REDIS_URL"], Keys(os.environ["LLMWD_PREFIX"])),
    EventEmitter(EventsConfig(bootstrap_servers=os.environ["LLMWD_KAFKA"], topic=os.environ["LLMWD_TOPIC"],
                              flush_interval_s=0.01)).start(),
    variants={"tiny": {"fp8": "tiny-fp8", "fp16": "tiny-fp16"}}, log_completions=True)
"""


@pytest.fixture(scope="module")
def upstreams(tiny_model_dir: Path) -> Iterator[dict[str, OpenAIServer]]:
    servers = {p: OpenAIServer(TorchEngine(tiny_model_dir, p), model_name=f"tiny-{p}").start()
               for p in ("fp8", "fp16")}
    yield servers
    for s in servers.values():
        s.stop()


def test_a_real_litellm_proxy_routes_by_flag_and_logs_events(upstreams: dict[str, OpenAIServer], tmp_path: Path,
                                                              redis_service: Any, kafka_service: Any,
                                                              topic: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    (tmp_path / "llmwd_callbacks.py").write_text(CALLBACKS)
    models = "\n".join(
        f"  - model_name: tiny-{p}\n    litellm_params: {{model: openai/tiny-{p}, api_base: '{s.base_url}', "
        f"api_key: none}}" for p, s in upstreams.items())
    (tmp_path / "config.yaml").write_text(f"model_list:\n{models}\nlitellm_settings:\n"
                                          "  callbacks: llmwd_callbacks.watchdog_logger\n  num_retries: 0\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LITELLM_MASTER_KEY": MASTER, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "LLMWD_REDIS_URL": f"redis://{redis_service.address}/0", "LLMWD_PREFIX": prefix,
           "LLMWD_KAFKA": kafka_service.address, "LLMWD_TOPIC": topic}
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen([PROXY, "--config", "config.yaml", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, 90, proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=MASTER, max_retries=0, timeout=30)

        bases = {s.base_url.rstrip("/"): p for p, s in upstreams.items()}

        def ask(stream: bool = False) -> tuple[str, str]:
            """(answer, precision of the deployment that served it, from the proxy's api-base header)"""
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", max_tokens=8, stream=stream, extra_headers={"X-LLMWD-Route": "support"},
                messages=[{"role": "user", "content": "Q: capital of France? A:"}])
            served = bases.get(raw.headers.get("x-litellm-model-api-base", "").rstrip("/"), "?")
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices), served
            return raw.parse().choices[0].message.content, served

        assert ask() == (" Paris.", "fp8")
        FlagStore(client_from_url(env["LLMWD_REDIS_URL"]), Keys(prefix)).flip(
            "tiny", "support", "fp16", expected_epoch=None, reason="t", changed_by="t")
        time.sleep(0.5)  # the proxy's own RoutingFlags reader picks the flip up from pub/sub
        assert ask() == (" Paris.", "fp16") and ask(stream=True) == (" Paris.", "fp16")
        events = read_events(kafka_service.address, topic, 3, timeout=20)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    got = [(e.model, e.route, e.precision, e.status) for e in events]
    assert got == [("tiny", "support", "fp8", "ok")] + [("tiny", "support", "fp16", "ok")] * 2, \
        (tmp_path / "proxy.log").read_text()[-3000:]
    assert events[0].completion == " Paris." and events[0].latency_ms > 0
