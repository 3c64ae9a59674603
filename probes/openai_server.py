"""A small OpenAI-compatible HTTP server over the torch engine (tests and the demo).

Endpoints: ``GET /v1/models``, ``POST /v1/completions`` (``logprobs``, ``echo``, ``max_tokens`` 0
allowed: prompt logprobs, as vLLM gives them) and ``POST /v1/chat/completions`` (``logprobs``);
both stream server-sent events with ``stream: true`` (one chunk per token, after generation, and a
usage chunk when ``stream_options.include_usage`` is set). Decoding is always greedy; sampling
parameters are accepted and ignored. Requests are served on threads but the model runs one request
at a time (a lock). ``delay_s`` makes every request slow, so tests can exercise client timeouts
against a real socket; ``fail_status`` (settable while running) answers every POST with that HTTP
status, as a broken replica would; ``engine`` may be swapped while running.

    python -m probes.openai_server --model DIR --precision fp8 --port 8001
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any

from watchdog.core.httpserver import QuietHTTPServer

log = logging.getLogger(__name__)


class CompletionBackend:
    """Turns OpenAI request bodies into engine calls. Pure request/response logic, no sockets."""

    def __init__(self, engine: Any, model_name: str, delay_s: float = 0.0, prompt_logprobs: bool = True) -> None:
        self.engine = engine
        self.model_name = model_name
        self.delay_s = delay_s
        #: False behaves like servers without prompt logprobs: echo+logprobs is a 400
        self.prompt_logprobs = prompt_logprobs
        #: answer every completion request with this HTTP status (a failing replica); None: serve
        self.fail_status: int | None = None
        self._lock = threading.Lock()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "llm-watchdog"}]}

    def _offsets(self, ids: list[int], base: int) -> list[int]:
        # character offset where each token starts (a byte inside a multi-byte character points at it)
        return [base + len(self.engine.decode(ids[:i])) for i in range(len(ids))]

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts = body.get("prompt", "")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompt must be a string or a list of strings")
        max_tokens = int(body.get("max_tokens", 16) if body.get("max_tokens") is not None else 16)
        want_lp = body.get("logprobs") is not None
        echo = bool(body.get("echo", False))
        if echo and want_lp and not self.prompt_logprobs:
            raise ValueError("echo with logprobs is not supported by this server")
        choices = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        for idx, prompt in enumerate(prompts):
            with self._lock:
                time.sleep(self.delay_s)
                gen = self.engine.generate([prompt], max_tokens)[0] if max_tokens > 0 else None
                if gen is not None and gen.error:
                    raise RuntimeError(gen.error)
                prompt_ids, prompt_lps = self.engine.prompt_logprobs(prompt) if echo and want_lp else ([], [])
            completion = gen.text if gen else ""
            gen_ids = self.engine.encode_continuation(completion) if completion else []
            usage["prompt_tokens"] += len(self.engine.encode_prompt(prompt))
            usage["completion_tokens"] += len(gen_ids)
            logprobs = None
            if want_lp:
                tokens, lps, offsets = [], [], []
                if echo:
                    tokens += [self.engine.decode([t]) for t in prompt_ids]
                    lps += list(prompt_lps)
                    offsets += self._offsets(prompt_ids, 0)
                tokens += [self.engine.decode([t]) for t in gen_ids]
                gen_lps = gen.token_logprobs if gen and gen.token_logprobs else []
                lps += list(gen_lps[:len(gen_ids)]) + [None] * max(0, len(gen_ids) - len(gen_lps))
                offsets += self._offsets(gen_ids, len(prompt) if echo else 0)
                logprobs = {"tokens": tokens, "token_logprobs": lps, "text_offset": offsets, "top_logprobs": None}
            finish = "length" if gen is not None and len(gen_ids) >= max_tokens else "stop"
            choices.append({"index": idx, "text": (prompt if echo else "") + completion, "logprobs": logprobs,
                            "finish_reason": finish})
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages") or []
        users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if not users or not isinstance(users[-1], str):
            raise ValueError("messages must hold a user message with string content")
        prompt = users[-1]  # the tiny models have no chat template: the last user turn is the prompt
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        with self._lock:
            time.sleep(self.delay_s)
            gen = self.engine.generate([prompt], max_tokens)[0]
        if gen.error:
            raise RuntimeError(gen.error)
        gen_ids = self.engine.encode_continuation(gen.text) if gen.text else []
        logprobs = None
        if body.get("logprobs"):
            lps = gen.token_logprobs or []
            logprobs = {"content": [{"token": self.engine.decode([t]), "logprob": lp, "bytes": None,
                                     "top_logprobs": []} for t, lp in zip(gen_ids, lps, strict=False)]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                             "logprobs": logprobs,
                             "finish_reason": "length" if len(gen_ids) >= max_tokens else "stop"}],
                "usage": {"prompt_tokens": len(self.engine.encode_prompt(prompt)),
                          "completion_tokens": len(gen_ids),
                          "total_tokens": len(self.engine.encode_prompt(prompt)) + len(gen_ids)}}


def _handler_for(backend: CompletionBackend) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # headers and body go out as separate writes: with Nagle on, the second waits for the
        # client's delayed ACK (~40 ms and more per answer behind a keep-alive proxy)
        disable_nagle_algorithm = True

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, doc: dict[str, Any]) -> None:
            data = json.dumps(doc).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                pass

        def _stream(self, kind: str, doc: dict[str, Any], include_usage: bool) -> None:
            """Replay a finished answer as SSE chunks, one per token (text split by the engine)."""
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                choice = doc["choices"][0]
                base = {"id": doc["id"], "created": doc["created"], "model": doc["model"],
                        "object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
                text = choice["message"]["content"] if kind == "chat" else choice["text"]
                pieces = [backend.engine.decode([t]) for t in backend.engine.encode_continuation(text)] if text else []
                if kind == "chat":
                    self._chunk({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]})
                for piece in pieces:
                    delta = {"content": piece} if kind == "chat" else None
                    c = {"index": 0, "delta": delta, "finish_reason": None} if kind == "chat" else \
                        {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
                    self._chunk({**base, "choices": [c]})
                last = {"index": 0, "finish_reason": choice["finish_reason"]}
                last.update({"delta": {}} if kind == "chat" else {"text": "", "logprobs": None})
                self._chunk({**base, "choices": [last]})
                if include_usage:
                    self._chunk({**base, "choices": [], "usage": doc["usage"]})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _chunk(self, doc: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
            self.wfile.flush()

        def _error(self, status: int, message: str, kind: str) -> None:
            self._send(status, {"error": {"message": message, "type": kind, "code": status}})

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, backend.models())
            else:
                self._error(404, f"no route {self.path}", "not_found")

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
            except ValueError as exc:
                self._error(400, f"bad JSON: {exc}", "invalid_request_error")
                return
            route = self.path.rstrip("/")
            handlers = {"/v1/completions": backend.completions, "/v1/chat/completions": backend.chat}
            if route not in handlers:
                self._error(404, f"no route {self.path}", "not_found")
                return
            if backend.fail_status is not None:
                self._error(backend.fail_status, "this replica is failing (fail_status)", "server_error")
                return
            try:
                doc = handlers[route](body)
                if body.get("stream"):
                    opts = body.get("stream_options") or {}
                    self._stream("chat" if route.endswith("chat/completions") else "completion", doc,
                                 bool(isinstance(opts, dict) and opts.get("include_usage")))
                else:
                    self._send(200, doc)
            except (ValueError, TypeError) as exc:
                self._error(400, str(exc), "invalid_request_error")
            except Exception as exc:  # the model failed: a 500 the client can retry
                log.warning("completion failed: %s", exc)
                self._error(500, f"{type(exc).__name__}: {exc}", "server_error")

    return Handler


class OpenAIServer:
    """A threaded server on 127.0.0.1; ``start()`` runs it in a daemon thread, ``stop()`` shuts it."""

    def __init__(self, engine: Any, model_name: str = "tiny", host: str = "127.0.0.1", port: int = 0,
                 delay_s: float = 0.0, prompt_logprobs: bool = True) -> None:
        self.backend = CompletionBackend(engine, model_name, delay_s, prompt_logprobs)
        self.httpd = QuietHTTPServer((host, port), _handler_for(self.backend))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> OpenAIServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        # handler threads are daemons: wait for a generation in progress, so none is still inside
        # torch when the interpreter exits (that aborts the process)
        if self.backend._lock.acquire(timeout=30):
            self.backend._lock.release()
        if self._thread:
            self._thread.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    from probes.engines import get_engine

    ap = argparse.ArgumentParser(description="OpenAI-compatible server over the torch engine")
    ap.add_argument("--model", required=True)
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--name", default=None, help="model id reported by /v1/models")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--scale-multiplier", type=float, default=1.0, help="distort FP8 static scales (demo)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    engine = get_engine("torch", model_path=args.model, precision=args.precision,
                        scale_multiplier=args.scale_multiplier)
    server = OpenAIServer(engine, args.name or f"tiny-{args.precision}", port=args.port)
    print(f"serving {server.base_url}", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
