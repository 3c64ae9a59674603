"""Pure helpers over OpenAI request/response bodies: what an event needs from them, and errors.

No I/O here: ``app`` feeds bytes in and gets plain values out, so the parsing is tested on its own.
"""

from __future__ import annotations

from typing import Any

import orjson

from watchdog.core.events import MIN_LOGPROB, loads_lenient


def _loads(raw: bytes) -> Any:
    """An upstream's JSON; ``NaN`` / ``Infinity`` too (Python servers write them by default when an
    engine's logits overflow), so a broken engine's answer is counted rather than lost. None if
    it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return loads_lenient(raw)
    except ValueError:
        return None


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


#: bytes of UTF-8 text per token in the estimate used when the upstream sends no ``usage``: about
#: 4 for English with BPE tokenizers (GPT/Llama), fewer for code and non-Latin scripts (CJK: ~1.5
#: tokens per 3-byte character, so this under-counts them ~2x). Documented in docs/INTEGRATIONS.md
BYTES_PER_TOKEN = 4


def _all_text(value: Any) -> tuple[str, int]:
    """(text, token ids) of a prompt or message content: strings, text parts, lists of token ids."""
    if isinstance(value, str):
        return value, 0
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return "", len(value)  # a prompt given as token ids
        texts, ids = [], 0
        for v in value:
            if isinstance(v, dict):
                v = v.get("text", "")
            t, n = _all_text(v)
            texts.append(t)
            ids += n
        return "\n".join(texts), ids
    return "", 0


def estimate_prompt_tokens(kind: str, body: dict[str, Any]) -> int:
    """Prompt tokens without a tokenizer, for upstreams that send no ``usage``: the UTF-8 bytes of
    every message's (or the prompt's) text over ``BYTES_PER_TOKEN``, rounded up, plus token ids as
    given; 4 tokens of chat framing per message."""
    if kind == "chat":
        msgs = [m for m in body.get("messages") or [] if isinstance(m, dict)]
        text, ids = _all_text([m.get("content") or "" for m in msgs])
        frame = 4 * len(msgs)
    else:
        text, ids = _all_text(body.get("prompt") or "")
        frame = 0
    return -(-len(text.encode("utf-8", "replace")) // BYTES_PER_TOKEN) + ids + frame


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
    return [_logprob(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _logprob(v: float) -> float:
    """A token's log-probability as the event contract takes it: NaN, -inf and values below the
    floor (an engine whose logits overflowed) are the worst token, ``MIN_LOGPROB``."""
    v = float(v)
    if v >= MIN_LOGPROB:
        return min(0.0, v)
    return MIN_LOGPROB  # below the floor, -inf or NaN (every comparison with NaN is false)


def _text(choice: dict[str, Any], kind: str, delta: bool) -> str:
    if kind == "chat":
        msg = choice.get("delta" if delta else "message")
        content = msg.get("content") if isinstance(msg, dict) else None
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class Result:
    """What one upstream answer contributes to an event."""

    __slots__ = ("choices", "completion", "completion_tokens", "logprobs", "prompt_tokens", "usage_seen")

    def __init__(self) -> None:
        self.completion = ""
        #: the text of every choice, by index (``n`` > 1); ``completion`` is choice 0's
        self.choices: list[str] = []
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
    doc = _loads(raw)
    if not isinstance(doc, dict):
        return res
    res.add_usage(doc.get("usage"))
    choices = doc.get("choices")
    if isinstance(choices, list) and choices:
        by_index: dict[int, str] = {}
        for i, choice in enumerate(choices):
            if isinstance(choice, dict):
                idx = choice.get("index")
                by_index[idx if isinstance(idx, int) and 0 <= idx < 1024 else i] = _text(choice, kind, delta=False)
        res.choices = [by_index.get(i, "") for i in range(max(by_index) + 1)] if by_index else []
        res.completion = res.choices[0] if res.choices else ""
        first = choices[0]
        if isinstance(first, dict):
            res.logprobs = _logprobs(first, kind)
    return res


class StreamParser:
    """Follows a server-sent-events stream chunk by chunk; ``result`` holds what it gathered.

    Without a ``usage`` chunk (clients ask for one with ``stream_options.include_usage``) the
    completion token count is the number of content chunks of all choices, which is what vLLM
    sends per token. ``finish`` may be called again (a stream cut short, then finished).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.result = Result()
        #: ``data: [DONE]`` was seen: the answer is whole
        self.done = False
        self._pending = b""
        #: content pieces per choice index (with ``n`` > 1 the chunks of the choices interleave)
        self._parts: dict[int, list[str]] = {}
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
        if payload == b"[DONE]":
            self.done = True
            return
        if not payload:
            return
        doc = _loads(payload)
        if not isinstance(doc, dict):
            return
        if "error" in doc:
            self.error = str(doc["error"])[:200]
        if doc.get("usage"):
            self.result.add_usage(doc["usage"])
        choices = doc.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            idx = choice.get("index")
            idx = idx if isinstance(idx, int) and 0 <= idx < 1024 else 0
            text = _text(choice, self.kind, delta=True)
            if text:
                self._parts.setdefault(idx, []).append(text)
                self._chunks += 1
            if idx == 0:
                lps = _logprobs(choice, self.kind)
                if lps:
                    self.result.logprobs = (self.result.logprobs or []) + lps

    def finish(self) -> Result:
        if self._pending:
            self.feed(b"\n\n")
        parts = self._parts
        self.result.choices = [("".join(parts.get(i, ()))) for i in range(max(parts) + 1)] if parts else []
        self.result.completion = self.result.choices[0] if self.result.choices else ""
        if not self.result.usage_seen:
            self.result.completion_tokens = self._chunks
        return self.result
