"""A scripted OpenAI-compatible upstream for tests: aiohttp.web on its own loop in a thread.

``mode`` picks the answer: ``ok`` (``n`` choices, no ``usage``), ``slow`` (streams 200 chunks 50 ms
apart, or answers after 10 s), ``hold`` (answers after ``hold_s``), ``stall`` (streams
``stall_after`` chunks, then nothing for 30 s), ``big`` (``big`` as the completion), ``400``,
``429`` (with ``Retry-After`` and ``x-ratelimit-*``), ``500``, ``linger`` (streams 3 chunks and ``[DONE]``, then
keeps the response open ``linger_s`` before ending it). ``closed_at`` is when a connection
was closed under it; ``active`` / ``peak`` count the requests it is answering, now and at most.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import orjson
from aiohttp import web

MODEL = "m"


class Upstream:
    """An OpenAI-compatible server whose answer the test scripts (``mode``), recording when a
    streamed answer's connection was closed under it."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.linger_s = 0.5
        #: the Retry-After header of a 429
        self.retry_after = "7"
        self.big = ""
        self.requests: list[dict[str, Any]] = []
        self.closed_at: float | None = None
        self.chunks_sent = 0
        self.hold_s = 2.0
        self.stall_after = 5
        self.active = 0
        self.peak = 0
        self.loop = asyncio.new_event_loop()
        self.runner: Any = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> Upstream:
        app = web.Application(client_max_size=32 * 1024 * 1024)  # the gateway passes bodies up to 8 MiB
        app.router.add_post("/v1/chat/completions", self.chat)
        ready = threading.Event()

        async def serve() -> None:
            self.runner = web.AppRunner(app, handler_cancellation=True)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop)
        assert ready.wait(5)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)

    @staticmethod
    def _doc(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": MODEL, "choices": choices, **extra}

    async def chat(self, request: Any) -> Any:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await self._answer(request)
        finally:
            self.active -= 1

    async def _answer(self, request: Any) -> Any:
        body = await request.json()
        self.requests.append(body)
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom", "type": "server_error", "code": 500}}, status=500)
        if self.mode == "hold":
            await asyncio.sleep(self.hold_s)
        if self.mode == "400":
            return web.json_response({"error": {"message": "context too long", "type": "invalid_request_error",
                                                "code": 400}}, status=400)
        if self.mode == "429":
            return web.json_response({"error": {"message": "slow down", "type": "rate_limit", "code": 429}},
                                     status=429, headers={"Retry-After": self.retry_after,
                                                          "x-ratelimit-remaining-requests": "0",
                                                          "x-ratelimit-reset-requests": "7s"})
        n = int(body.get("n") or 1)
        if body.get("stream"):
            return await self._stream(request, n)
        if self.mode == "slow":  # a non-streamed answer that takes 10 s unless cancelled
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                self.closed_at = time.monotonic()
                raise
        if self.mode == "big":
            choices = [{"index": 0, "message": {"role": "assistant", "content": self.big}, "finish_reason": "length"}]
            return web.json_response(self._doc(choices, usage={"prompt_tokens": 9, "completion_tokens": 500_000,
                                                               "total_tokens": 500_009}))
        choices = [{"index": i, "message": {"role": "assistant", "content": f" answer {i}."},
                    "finish_reason": "stop"} for i in range(n)]
        return web.json_response(self._doc(choices), headers={"x-ratelimit-remaining-requests": "99"})

    async def _stream(self, request: Any, n: int) -> Any:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        self.chunks_sent = 0
        total = 200 if self.mode in ("slow", "stall") else 3
        try:
            for i in range(total):
                for c in range(n):  # the choices' chunks interleave, as vLLM sends them
                    delta = {"index": c, "delta": {"content": f" t{c}.{i}"}, "finish_reason": None}
                    doc = {**self._doc([delta]), "object": "chat.completion.chunk"}
                    await resp.write(b"data: " + orjson.dumps(doc) + b"\n\n")
                self.chunks_sent += 1
                if self.mode == "stall" and self.chunks_sent == self.stall_after:
                    await asyncio.sleep(30)
                if self.mode == "slow":
                    await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
            if self.mode == "linger":
                await asyncio.sleep(self.linger_s)
        except (ConnectionError, asyncio.CancelledError):
            self.closed_at = time.monotonic()
            raise
        return resp
