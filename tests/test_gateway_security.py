"""Issue 20, security: who may pick a route, who may use the gateway at all, who chooses the shadow
sample, and how far client-chosen names reach into /metrics. The real ``openai`` client against the
gateway (uvicorn), in front of two real OpenAI servers (probes.openai_server over a canned engine:
no model needed), real Redis flags and, for the events, a real Kafka-protocol broker."""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from probes.engines.base import Generation  # noqa: E402
from probes.openai_server import OpenAIServer  # noqa: E402
from tests import helpers  # noqa: E402
from watchdog.actuation.actuator import FlagStore  # noqa: E402
from watchdog.core.keys import Keys  # noqa: E402
from watchdog.gateway.config import load_gateway_config  # noqa: E402
from watchdog.gateway.server import GatewayServer, build_gateway  # noqa: E402
from watchdog.state.redis_conn import client_from_url  # noqa: E402

pytestmark = [pytest.mark.services]
MODEL = "llama"


class CannedEngine:
    """Answers every prompt with the same few tokens (enough for the OpenAI server's bodies)."""

    name = "canned"

    def __init__(self, precision: str) -> None:
        self.precision = precision

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[Generation]:
        return [Generation(" Paris.", [-0.1, -0.2], 0.1) for _ in prompts]

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(range(len(prompt.split())))

    def encode_continuation(self, text: str) -> list[int]:
        return [1, 2]

    def decode(self, ids: list[int]) -> str:
        return "t" * len(ids)

    def score(self, prompts: list[str], references: list[str]) -> None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, OpenAIServer]]:
    servers = {p: OpenAIServer(CannedEngine(p), model_name=f"m-{p}").start() for p in ("fp8", "fp16")}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture
def make_gateway(upstreams: dict[str, OpenAIServer], redis_service: Any,
                 ) -> Iterator[Callable[..., tuple[GatewayServer, FlagStore]]]:
    started: list[GatewayServer] = []

    def make(path: Path | None = None, env: dict[str, str] | None = None, shadow_sample: float = 0.0,
             **section: Any) -> tuple[GatewayServer, FlagStore]:
        prefix = f"t{uuid.uuid4().hex[:8]}"
        url = f"redis://{redis_service.address}/0"
        pool = {"model": MODEL, "candidate": {"url": upstreams["fp8"].base_url, "timeout_s": 5},
                "baseline": {"url": upstreams["fp16"].base_url, "timeout_s": 5}, "log_completions": True,
                "shadow_sample": shadow_sample}
        overrides: dict[str, Any] = {"redis_url": url, "redis_prefix": prefix, "port": 0, "pools": [pool],
                                     "events": {"enabled": False}, **section}
        cfg = load_gateway_config(path, **({"env": env} if env else {}), **overrides)
        app = build_gateway(cfg)
        assert app.flags.wait_ready(5)
        srv = GatewayServer(app).start()
        started.append(srv)
        return srv, FlagStore(client_from_url(url), Keys(prefix))

    yield make
    for srv in started:
        srv.stop()


def client(srv: GatewayServer, key: str = "none") -> Any:
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=10)


def chat(c: Any, route: str | None = None, request_id: str | None = None) -> Any:
    """The response headers of one chat request."""
    extra = {"X-LLMWD-Route": route} if route else {}
    if request_id:
        extra["X-Request-ID"] = request_id
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Q: capital of France? A:"}], max_tokens=4,
        extra_headers=extra)
    assert raw.parse().choices[0].message.content == " Paris."
    return raw.headers


def flip(srv: GatewayServer, store: FlagStore, route: str, precision: str) -> None:
    store.flip(MODEL, route, precision, expected_epoch=None, reason="test", changed_by="test")
    helpers.wait_until(lambda: srv.app.flags.precision_for(MODEL, route) == precision, timeout=3,
                       what=f"{route} -> {precision}")


# --- 1. route authorisation -------------------------------------------------------------------------


def test_a_key_decides_its_route_and_its_header_cannot_escape_a_rollback(make_gateway: Any) -> None:
    srv, store = make_gateway(api_keys={"key-legal": "legal"}, routes=["chat"],
                              clients=[{"api_key": "key-eval", "route": "eval", "allow_routes": ["eval/long"]}])
    flip(srv, store, "legal", "fp16")  # legal was rolled back; chat still serves FP8
    legal = client(srv, "key-legal")
    h = chat(legal)
    assert (h["x-llmwd-route"], h["x-llmwd-precision"]) == ("legal", "fp16")
    h = chat(legal, route="legal")  # naming its own route is fine
    assert (h["x-llmwd-route"], h["x-llmwd-precision"]) == ("legal", "fp16")
    with pytest.raises(openai.PermissionDeniedError) as err:  # the old gateway served this on FP8
        chat(legal, route="chat")
    assert err.value.status_code == 403 and err.value.code == "route_not_allowed"
    assert "chat" in err.value.message
    # a key's allow-list lets its header pick those routes, and only those
    assert chat(client(srv, "key-eval"), route="eval/long")["x-llmwd-route"] == "eval/long"
    with pytest.raises(openai.PermissionDeniedError):
        chat(client(srv, "key-eval"), route="legal")
    # a client without a key may pick an open route only; it cannot feed legal's statistics
    assert chat(client(srv), route="chat")["x-llmwd-precision"] == "fp8"
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client(srv), route="legal")
    assert bad.value.code == "unknown_route"
    metrics = httpx.get(f"http://127.0.0.1:{srv.port}/metrics").text
    assert 'llmwd_gateway_refused_total{code="route_not_allowed"} 2.0' in metrics
    assert 'llmwd_gateway_refused_total{code="unknown_route"} 1.0' in metrics


def test_unknown_routes_are_refused_or_mapped_to_the_default_never_created(make_gateway: Any) -> None:
    srv, _ = make_gateway(routes=["chat"])
    with pytest.raises(openai.BadRequestError) as err:
        chat(client(srv), route="made-up-by-a-client")
    assert err.value.status_code == 400 and err.value.code == "unknown_route"
    for bad in ("x" * 201, "a\tb"):  # too long, a control character
        with pytest.raises(openai.BadRequestError) as err:
            chat(client(srv), route=bad)
        assert err.value.code == "invalid_route"
    for raw in ("chаt".encode(), b"\xff"):  # a Cyrillic 'а', not UTF-8 (the openai client sends ASCII only)
        r = httpx.post(f"{srv.base_url}/chat/completions", headers={"X-LLMWD-Route": raw},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_route", r.text
    srv, _ = make_gateway(routes=["chat"], unknown_route="default", default_route="general",
                          model_routes={"other-model": "x"})
    assert chat(client(srv), route="made-up-by-a-client")["x-llmwd-route"] == "general"
    assert chat(client(srv), route="chat")["x-llmwd-route"] == "chat"


def test_gateway_auth_refuses_unknown_keys_and_guards_metrics(make_gateway: Any, tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("gateway:\n  auth:\n    required: true\n    metrics_keys: ['${PROM_KEY}']\n"
                    "  clients:\n    - {api_key: '${LEGAL_KEY}', route: legal}\n")
    srv, _ = make_gateway(path, env={"LEGAL_KEY": "sk-legal-7f3a", "PROM_KEY": "prom-9c2e"})
    with pytest.raises(openai.AuthenticationError) as err:
        chat(client(srv, "sk-legal-7f3b"))  # one character off
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(srv, "sk-legal-7f3b").models.list()
    assert chat(client(srv, "sk-legal-7f3a"))["x-llmwd-route"] == "legal"
    base = f"http://127.0.0.1:{srv.port}"
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sk-legal-7f3a"}).status_code == 401
    ok = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer prom-9c2e"})
    assert ok.status_code == 200 and 'route="legal"' in ok.text
    assert httpx.get(f"{base}/healthz").status_code == 200  # liveness stays open


def test_metrics_on_their_own_port(make_gateway: Any) -> None:
    srv, _ = make_gateway(metrics={"port": 0})
    chat(client(srv))
    assert httpx.get(f"http://127.0.0.1:{srv.port}/metrics").status_code == 404
    text = httpx.get(f"http://127.0.0.1:{srv.metrics_server.server_port}/metrics").text
    assert 'llmwd_gateway_requests_total{precision="fp8",route="default",status="ok"} 1.0' in text


# --- 4. bounded labels ------------------------------------------------------------------------------


def test_random_route_headers_do_not_grow_metrics(make_gateway: Any) -> None:
    srv, _ = make_gateway(routes=["chat"], unknown_route="default")
    metrics = f"http://127.0.0.1:{srv.port}/metrics"
    chat(client(srv), route="chat")
    chat(client(srv))
    before = len(httpx.get(metrics).content)
    served = set()
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}") as h:
        for i in range(300):
            r = h.post("/v1/chat/completions", headers={"X-LLMWD-Route": f"r-{uuid.uuid4().hex}-{i}"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200
            served.add(r.headers["x-llmwd-route"])
    after = httpx.get(metrics).text
    assert len(after.encode()) - before < 200, f"only counter values change ({before} -> {len(after)} bytes)"
    assert served == {"default"}
    assert 'llmwd_gateway_requests_total{precision="fp8",route="default",status="ok"} 301.0' in after
    assert "r-" not in after.replace("refused", "")


# --- 2. the gateway, not the client, decides the shadow sample --------------------------------------


def _crafted_ids(below: bool, n: int) -> list[str]:
    """Request ids whose crc32 is below (or not) half of 2**32: the daemon's windows keep a shadow
    pair when crc32(request_id) < shadow_sample_rate * 2**32 (watchdog/windows/aggregator.py)."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        rid = f"req-{i}"
        if (zlib.crc32(rid.encode()) < 2**31) == below:
            out.append(rid)
        i += 1
    return out


def test_a_client_cannot_choose_its_shadow_sample(make_gateway: Any, kafka_service: Any, topic: str) -> None:
    srv, _ = make_gateway(shadow_sample=1.0, events={"bootstrap_servers": kafka_service.address, "topic": topic,
                                                     "flush_interval_s": 0.01})
    c = client(srv)
    avoid, force = _crafted_ids(False, 30), _crafted_ids(True, 30)
    for rid in avoid + force:
        assert chat(c, request_id=rid)["x-request-id"] == rid  # still passed through and returned
    events = helpers.read_events(kafka_service.address, topic, 60, timeout=20)
    assert len(events) == 60 and all(e.shadow is not None for e in events)
    by_client = {e.extra.get("client_request_id", e.request_id): e for e in events}
    assert set(by_client) == set(avoid + force)
    for group in (avoid, force):
        sampled = sum(zlib.crc32(by_client[rid].request_id.encode()) < 2**31 for rid in group)
        assert 5 <= sampled <= 25, sampled  # Binomial(30, 1/2): outside [5, 25] with p < 0.001
    assert not set(by_client) & {e.request_id for e in events}  # the event id is the gateway's
