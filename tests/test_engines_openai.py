"""The openai engine against the real OpenAI-compatible server (probes/openai_server.py) on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from probes.engines import get_engine  # noqa: E402
from probes.engines.openai_engine import parse_echo_score  # noqa: E402
from probes.engines.torch_engine import TorchEngine  # noqa: E402
from probes.openai_server import OpenAIServer  # noqa: E402
from probes.tiny_model import DEFAULT_PAIRS  # noqa: E402

pytestmark = pytest.mark.torch

PROMPTS = [p for p, _ in DEFAULT_PAIRS]
REFS = [r for _, r in DEFAULT_PAIRS]


@pytest.fixture(scope="module")
def torch_engine(tiny_model_dir: Path) -> TorchEngine:
    return TorchEngine(tiny_model_dir, "fp16", batch_size=8)


@pytest.fixture(scope="module")
def server(torch_engine: TorchEngine) -> Iterator[OpenAIServer]:
    srv = OpenAIServer(torch_engine, model_name="tiny-fp16").start()
    yield srv
    srv.stop()


def test_models_endpoint_and_model_discovery(server: OpenAIServer) -> None:
    doc = httpx.get(server.base_url + "/models", timeout=5).json()
    assert doc["data"][0]["id"] == "tiny-fp16"
    eng = get_engine("openai", base_url=f"http://127.0.0.1:{server.port}", precision="fp16")
    assert eng.model == "tiny-fp16" and eng.name == "openai:tiny-fp16:fp16"
    eng.close()


def test_completions_match_the_local_engine(server: OpenAIServer, torch_engine: TorchEngine) -> None:
    eng = get_engine("openai", base_url=server.base_url, model="tiny-fp16", concurrency=4)
    remote = eng.generate(PROMPTS, 12)
    local = torch_engine.generate(PROMPTS, 12)
    assert [g.error for g in remote] == [None] * len(PROMPTS)
    assert [g.text for g in remote] == [g.text for g in local]
    for r, loc in zip(remote, local, strict=True):
        assert r.token_logprobs == pytest.approx(loc.token_logprobs, abs=1e-4)
    chat = get_engine("openai", base_url=server.base_url, model="tiny-fp16", api="chat")
    c = chat.generate(PROMPTS[:2], 12)
    assert [g.text for g in c] == [g.text for g in local[:2]]
    assert c[0].token_logprobs == pytest.approx(local[0].token_logprobs, abs=1e-4)
    eng.close()
    chat.close()


def test_score_through_echo_matches_teacher_forcing(server: OpenAIServer, torch_engine: TorchEngine) -> None:
    eng = get_engine("openai", base_url=server.base_url, model="tiny-fp16")
    remote = eng.score(PROMPTS, REFS)
    local = torch_engine.score(PROMPTS, REFS)
    assert remote is not None
    for r, loc in zip(remote, local, strict=True):
        assert r.error is None
        assert r.n_tokens == loc.n_tokens and r.n_bytes == loc.n_bytes
        assert r.logprob_sum == pytest.approx(loc.logprob_sum, abs=1e-3)
    eng.close()


def test_server_without_prompt_logprobs_gives_no_perplexity(torch_engine: TorchEngine) -> None:
    srv = OpenAIServer(torch_engine, model_name="plain", prompt_logprobs=False).start()
    try:
        eng = get_engine("openai", base_url=srv.base_url, model="plain")
        assert eng.score(PROMPTS[:2], REFS[:2]) is None
        assert eng.score(PROMPTS[:1], REFS[:1]) is None  # remembered, no second probe
        assert eng.generate(PROMPTS[:1], 4)[0].error is None
        eng.close()
    finally:
        srv.stop()


def test_timeouts_and_dead_servers_become_error_generations(torch_engine: TorchEngine) -> None:
    srv = OpenAIServer(torch_engine, model_name="slow", delay_s=1.5).start()
    try:
        eng = get_engine("openai", base_url=srv.base_url, model="slow", timeout_s=0.3, retries=1, backoff_s=0.05)
        gens = eng.generate(PROMPTS[:2], 4)
        assert all(g.error and "timeout" in g.error and g.text == "" for g in gens)
        assert all(300 <= g.latency_ms < 5000 for g in gens)
        eng.close()
    finally:
        srv.stop()
    dead = get_engine("openai", base_url=srv.base_url, model="slow", retries=1, backoff_s=0.01)
    g = dead.generate(["x"], 2)[0]
    assert g.error and "transport" in g.error
    scores = dead.score(["x"], ["y"])
    assert scores is not None and scores[0].error
    dead.close()


def test_bad_requests_are_400s(server: OpenAIServer) -> None:
    r = httpx.post(server.base_url + "/completions", content=b"not json", timeout=5)
    assert r.status_code == 400
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": []}, timeout=5)
    assert r.status_code == 400
    assert httpx.get(server.base_url + "/nope", timeout=5).status_code == 404


def test_echo_parser_uses_character_offsets() -> None:
    doc = {"choices": [{"logprobs": {"token_logprobs": [None, -1.0, -2.0, -0.5, -9.0],
                                     "text_offset": [0, 1, 2, 3, 4]}}]}
    assert parse_echo_score(doc, "ab", "abcd") == (-2.5, 2)  # the token at offset 4 is a generated extra
    assert parse_echo_score({"choices": [{"logprobs": None}]}, "a", "ab") is None


def test_server_binds_loopback_only() -> None:
    srv = OpenAIServer(engine=None, model_name="x")
    try:
        assert srv.httpd.server_address[0] == "127.0.0.1"
    finally:
        srv.httpd.server_close()
