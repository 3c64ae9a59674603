"""Engine over any OpenAI-compatible server (kind ``openai``): vLLM, trtllm-serve, TGI, SGLang.

Greedy completions through ``/v1/completions`` (or ``/v1/chat/completions`` with ``api='chat'``),
with timeouts, retries with exponential backoff, and a concurrency limit (a thread pool over one
httpx client). Reference scoring uses prompt logprobs: ``echo=True, logprobs=1, max_tokens=0`` on
``/v1/completions`` (vLLM's way); a server that refuses it or returns no prompt logprobs makes
``score`` return None (perplexity unavailable, never 0).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from probes.engines import register
from probes.engines.base import Generation, ReferenceScore

log = logging.getLogger(__name__)

#: statuses worth retrying: overload, rate limit, transient server faults
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
#: statuses that mean "this server does not do prompt logprobs this way"
UNSUPPORTED_STATUSES = {400, 404, 405, 422, 501}


class RequestFailed(Exception):
    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def parse_completion(doc: dict[str, Any]) -> tuple[str, list[float] | None]:
    """(text, token logprobs or None) from a /v1/completions response."""
    choice = doc["choices"][0]
    lp = choice.get("logprobs") or {}
    values = lp.get("token_logprobs") if isinstance(lp, dict) else None
    return str(choice.get("text") or ""), ([float(v) for v in values if v is not None] if values else None)


def parse_chat(doc: dict[str, Any]) -> tuple[str, list[float] | None]:
    choice = doc["choices"][0]
    text = str((choice.get("message") or {}).get("content") or "")
    content = (choice.get("logprobs") or {}).get("content")
    return text, ([float(c["logprob"]) for c in content] if content else None)


def parse_echo_score(doc: dict[str, Any], prompt: str, full_text: str) -> tuple[float, int] | None:
    """Sum and count of reference-token logprobs from an echo response; None when absent.

    Reference tokens are those whose character offset lies in [len(prompt), len(full_text)); a token
    that straddles the boundary counts with the prompt. Tokens past the text (a server that insists on
    generating one) are ignored.
    """
    lp = (doc.get("choices") or [{}])[0].get("logprobs") or {}
    values, offsets = lp.get("token_logprobs"), lp.get("text_offset")
    if not values or not offsets or len(values) != len(offsets):
        return None
    picked = [v for v, off in zip(values, offsets, strict=True) if len(prompt) <= off < len(full_text)]
    if not picked or any(v is None for v in picked):
        return None
    return float(sum(picked)), len(picked)


@register("openai")
class OpenAIEngine:
    def __init__(self, base_url: str, model: str | None = None, *, precision: str = "unknown",
                 api: str = "completions", timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 retries: int = 2, backoff_s: float = 0.5, concurrency: int = 8, logprobs: bool = True,
                 api_key: str | None = None, name: str | None = None, extra_body: dict[str, Any] | None = None) -> None:
        if api not in ("completions", "chat"):
            raise ValueError("api must be 'completions' or 'chat'")
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.precision = precision
        self.api = api
        self.retries = max(0, int(retries))
        self.backoff_s = backoff_s
        self.want_logprobs = logprobs
        self.extra_body = dict(extra_body or {})
        key = api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
                                    headers=headers, limits=limits)
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="openai-engine")
        self.model = model or self._first_model()
        self.name = name or f"openai:{self.model}:{precision}"
        self._score_supported: bool | None = None

    def _first_model(self) -> str:
        try:
            doc = self._post_or_get("GET", "/models", None)
            return str(doc["data"][0]["id"])
        except (RequestFailed, KeyError, IndexError) as exc:
            raise ValueError(f"no model given and {self.base_url}/models did not name one: {exc}") from exc

    def _post_or_get(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """One request with retries on transport errors and retryable statuses."""
        last: RequestFailed | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = self._client.request(method, self.base_url + path, json=body)
            except httpx.TimeoutException as exc:
                last = RequestFailed(f"timeout: {type(exc).__name__}")
                continue
            except httpx.TransportError as exc:
                last = RequestFailed(f"transport: {type(exc).__name__}: {exc}")
                continue
            if resp.status_code == 200:
                try:
                    return resp.json()
                except ValueError as exc:
                    raise RequestFailed(f"bad JSON from server: {exc}", 200) from exc
            last = RequestFailed(f"HTTP {resp.status_code}: {resp.text[:200]}", resp.status_code)
            if resp.status_code not in RETRY_STATUSES:
                break
        assert last is not None
        raise last

    def _one(self, prompt: str, max_new_tokens: int) -> Generation:
        start = time.perf_counter()
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_new_tokens, "temperature": 0.0, "top_p": 1.0,
                                **self.extra_body}
        try:
            if self.api == "chat":
                body["messages"] = [{"role": "user", "content": prompt}]
                if self.want_logprobs:
                    body["logprobs"] = True
                text, lps = parse_chat(self._post_or_get("POST", "/chat/completions", body))
            else:
                body["prompt"] = prompt
                if self.want_logprobs:
                    body["logprobs"] = 1
                text, lps = parse_completion(self._post_or_get("POST", "/completions", body))
        except (RequestFailed, KeyError, IndexError, TypeError, ValueError) as exc:
            return Generation("", None, (time.perf_counter() - start) * 1000.0, error=str(exc) or type(exc).__name__)
        return Generation(text, lps, (time.perf_counter() - start) * 1000.0)

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[Generation]:
        return list(self._pool.map(lambda p: self._one(p, max_new_tokens), prompts))

    def _score_one(self, prompt: str, reference: str) -> ReferenceScore | None:
        """A score, an error score (transient failure), or None (the server cannot do this)."""
        full = prompt + reference
        n_bytes = len(reference.encode())
        body = {"model": self.model, "prompt": full, "echo": True, "logprobs": 1, "temperature": 0.0,
                **self.extra_body}
        for max_tokens in (0, 1):  # some servers reject max_tokens=0; one generated token is ignored
            try:
                doc = self._post_or_get("POST", "/completions", {**body, "max_tokens": max_tokens})
            except RequestFailed as exc:
                if exc.status in UNSUPPORTED_STATUSES:
                    continue
                return ReferenceScore(0.0, 0, n_bytes, error=str(exc))
            parsed = parse_echo_score(doc, prompt, full)
            if parsed is None:
                return None
            return ReferenceScore(parsed[0], parsed[1], n_bytes)
        return None

    def score(self, prompts: list[str], references: list[str]) -> list[ReferenceScore] | None:
        if len(prompts) != len(references):
            raise ValueError("prompts and references must have the same length")
        if self._score_supported is False or not prompts:
            return None if self._score_supported is False else []
        results = list(self._pool.map(lambda pr: self._score_one(*pr), zip(prompts, references, strict=True)))
        if any(r is None for r in results):
            log.info("engine %s: server gives no prompt logprobs; perplexity unavailable", self.name)
            self._score_supported = False
            return None
        self._score_supported = True
        return [r for r in results if r is not None]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
