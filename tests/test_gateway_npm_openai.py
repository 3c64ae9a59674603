"""Issue 20: the gateway against the real npm ``openai`` client (Node), streaming as anything-llm's
"Generic OpenAI" provider does: the event of a full stream (status ``ok``, tokens, TTFT) and of a
client that aborts mid-stream (``cancelled``, the upstream connection closed, tokens relayed so far).

The package is installed by this test, pinned (``OPENAI_NPM``), with ``npm install --prefix`` into
``.cache/npm-openai-<version>/`` (about 2 s, once). Skipped only when ``node`` or ``npm`` is absent.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("aiohttp")
if shutil.which("node") is None or shutil.which("npm") is None:
    pytest.skip("node and npm are needed for the npm openai client (scripts/setup.sh installs them)",
                allow_module_level=True)

from tests import helpers  # noqa: E402
from tests.scripted_upstream import Upstream  # noqa: E402
from watchdog.gateway.config import load_gateway_config  # noqa: E402
from watchdog.gateway.openai_io import estimate_prompt_tokens  # noqa: E402
from watchdog.gateway.server import GatewayServer, build_gateway  # noqa: E402

pytestmark = [pytest.mark.services]

ROOT = Path(__file__).resolve().parent.parent
#: the npm package anything-llm's Generic OpenAI provider talks through (6.x on Node 20)
OPENAI_NPM = "6.49.0"
SCRIPT = ROOT / "tests" / "data" / "npm_openai_stream.cjs"
MODEL = "m"
#: the messages the script sends
MESSAGES = [{"role": "system", "content": "Given the following conversation, answer briefly."},
            {"role": "user", "content": "Q: capital of France? A:"}]


@pytest.fixture(scope="module")
def node_modules() -> Path:
    cache = Path(os.environ.get("LLMWD_TEST_CACHE", ROOT / ".cache"))
    prefix = cache / f"npm-openai-{OPENAI_NPM}"
    prefix.mkdir(parents=True, exist_ok=True)
    with (cache / f"npm-openai-{OPENAI_NPM}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (prefix / ".complete").exists():
            r = subprocess.run(["npm", "install", "--prefix", str(prefix), f"openai@{OPENAI_NPM}", "--no-audit",
                                "--no-fund", "--no-save", "--ignore-scripts", "--loglevel=error"],
                               capture_output=True, text=True, timeout=180)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            (prefix / ".complete").write_text("ok\n")
    pkg = json.loads((prefix / "node_modules" / "openai" / "package.json").read_text())
    assert pkg["version"] == OPENAI_NPM
    return prefix / "node_modules"


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
    cfg = load_gateway_config(None, redis_url=f"redis://{redis_service.address}/0",
                              redis_prefix=f"t{uuid.uuid4().hex[:8]}", port=0, pools=[pool],
                              events={"bootstrap_servers": kafka_service.address, "topic": topic,
                                      "flush_interval_s": 0.01})
    app = build_gateway(cfg)
    assert app.flags.wait_ready(5)
    srv = GatewayServer(app).start()
    yield srv
    srv.stop()


def run_client(node_modules: Path, srv: GatewayServer, mode: str) -> dict[str, Any]:
    env = {**os.environ, "NODE_PATH": str(node_modules)}
    r = subprocess.run(["node", str(SCRIPT), srv.base_url, MODEL, mode], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def events(kafka: str, topic: str, n: int, timeout: float) -> list[Any]:
    return helpers.read_events(kafka, topic, n, timeout=timeout)


def test_a_full_stream_from_the_npm_client_is_one_ok_event_with_tokens_and_ttft(
        node_modules: Path, gateway: GatewayServer, upstream: Upstream, kafka_service: Any, topic: str) -> None:
    got = run_client(node_modules, gateway, "full")
    assert got["chunks"] == 3 and got["text"] == " t0.0 t0.1 t0.2", got  # the upstream's 3 chunks, in order
    evs = events(kafka_service.address, topic, 2, timeout=3)  # wait for a second one: there is none
    assert len(evs) == 1, evs
    ev = evs[0]
    assert ev.status == "ok" and ev.model == MODEL and ev.route == "default" and ev.precision == "fp8"
    # no usage in the stream (the client did not ask for it): content chunks, estimated prompt tokens
    assert ev.completion_tokens == 3 and ev.completion == " t0.0 t0.1 t0.2"
    assert ev.prompt_tokens == estimate_prompt_tokens("chat", {"messages": MESSAGES}) > 0
    assert ev.extra.get("prompt_tokens_estimated") is True
    assert ev.ttft_ms is not None and 0 < ev.ttft_ms <= ev.latency_ms
    # the gateway's TTFT is the upstream's first chunk as the gateway saw it: inside what the client saw
    assert ev.ttft_ms <= got["ttft_ms"], (ev.ttft_ms, got)
    print(f"npm openai {OPENAI_NPM}: client TTFT {got['ttft_ms']:.1f} ms, total {got['total_ms']:.1f} ms; "
          f"event ttft_ms {ev.ttft_ms:.1f}, latency_ms {ev.latency_ms:.1f}")


def test_an_npm_client_that_aborts_mid_stream_is_one_cancelled_event_and_the_upstream_stops(
        node_modules: Path, gateway: GatewayServer, upstream: Upstream, kafka_service: Any, topic: str) -> None:
    upstream.mode = "slow"  # 200 chunks 50 ms apart: 10 s unless cancelled
    got = run_client(node_modules, gateway, "hangup")
    exited = time.monotonic()
    assert got["aborted"] and got["chunks"] == 3, got
    helpers.wait_until(lambda: upstream.closed_at is not None, timeout=3, what="the upstream connection closed")
    assert upstream.closed_at is not None and upstream.closed_at - exited < 3
    sent = upstream.chunks_sent
    assert 3 <= sent < 100, sent  # the upstream stopped long before its 200 chunks
    evs = events(kafka_service.address, topic, 2, timeout=3)
    assert len(evs) == 1, evs
    ev = evs[0]
    assert ev.status == "cancelled" and ev.extra["cancel_ms"] >= 0
    assert 3 <= ev.completion_tokens <= sent and ev.completion is None
    assert ev.latency_ms < 5000
    print(f"aborted after {got['chunks']} chunks: upstream sent {sent}, event completion_tokens "
          f"{ev.completion_tokens}, cancel_ms {ev.extra['cancel_ms']}")
