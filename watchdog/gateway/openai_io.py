"""Pure helpers over OpenAI request/response bodies: what an event needs from them, and errors.

No I/O here: ``app`` feeds bytes in and gets plain values out, so the parsing is tested on its own.
"""

from __future__ import annotations

from typing import Any

import orjson


def error_body(status: int, message: str, kind: str, code: str | None = None) -> bytes:
    """An OpenAI-style error document (clients such as ``openai`` raise a typed error from it);
    ``code`` defaults to the HTTP status."""
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code or status}})


def prompt_of(kind: str, body: dict[str, Any]) -> str | None:
    """The prompt text for the event: the last user turn of a chat, or a completion's prompt."""
    if kind == "chat":
        for msg in reversed(body.get("messages") or []):
            if isinstance(msg, dict) and msg.get("role") == "user":
                content = msg.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, list):  # content parts: keep the text ones
                    return "".join(p.get("text", "") for p in content if isinstance(p, dict))
                return None
        return None
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _logprobs(choice: dict[str, Any], kind: str) -> list[float] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if kind == "chat":
        content = lp.get("content")
        if not isinstance(content, list):
            return None
        vals = [c.get("logprob") for c in content if isinstance(c, dict)]
    else:
        vals = lp.get("token_logprobs") or []
    out = [min(0.0, float(v)) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return out


def _text(choice: dict[str, Any], kind: str, delta: bool) -> str:
    if kind == "chat":
        msg = choice.get("delta" if delta else "message")
        content = msg.get("content") if isinstance(msg, dict) else None
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class Result:
    """What one upstream answer contributes to an event."""

    __slots__ = ("completion", "completion_tokens", "logprobs", "prompt_tokens", "usage_seen")

    def __init__(self) -> None:
        self.completion = ""
        self.logprobs: list[float] | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.usage_seen = False

    def add_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(pt, int) and pt >= 0:
                self.prompt_tokens = pt
            if isinstance(ct, int) and ct >= 0:
                self.completion_tokens = ct
            self.usage_seen = True


def parse_response(kind: str, raw: bytes) -> Result:
    """Usage, first choice's text and log-probabilities of a non-streamed answer (bad JSON: empty)."""
    res = Result()
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return res
    if not isinstance(doc, dict):
        return res
    res.add_usage(doc.get("usage"))
    choices = doc.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        res.completion = _text(choices[0], kind, delta=False)
        res.logprobs = _logprobs(choices[0], kind)
    return res


class StreamParser:
    """Follows a server-sent-events stream chunk by chunk; ``result`` holds what it gathered.

    Without a ``usage`` chunk (clients ask for one with ``stream_options.include_usage``) the
    completion token count is the number of content chunks, which is what vLLM sends per token.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.result = Result()
        self._pending = b""
        self._parts: list[str] = []
        self._chunks = 0
        self.error: str | None = None

    def feed(self, data: bytes) -> None:
        buf = self._pending + data
        *events, self._pending = buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    self._line(line[5:].strip())

    def _line(self, payload: bytes) -> None:
        if not payload or payload == b"[DONE]":
            return
        try:
            doc = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return
        if not isinstance(doc, dict):
            return
        if "error" in doc:
            self.error = str(doc["error"])[:200]
        if doc.get("usage"):
            self.result.add_usage(doc["usage"])
        choices = doc.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            text = _text(choices[0], self.kind, delta=True)
            if text:
                self._parts.append(text)
                self._chunks += 1
            lps = _logprobs(choices[0], self.kind)
            if lps:
                self.result.logprobs = (self.result.logprobs or []) + lps

    def finish(self) -> Result:
        if self._pending:
            self.feed(b"\n\n")
        self.result.completion = "".join(self._parts)
        if not self.result.usage_seen:
            self.result.completion_tokens = self._chunks
        return self.result
