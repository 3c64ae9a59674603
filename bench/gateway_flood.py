"""Drill: a burst of concurrent requests against ``llm-watchdog gateway`` in front of a slow upstream.

One Redis and one Tansu broker on free ports; an upstream (aiohttp, in this process) that holds each
request ``--hold`` seconds and counts how many it holds at once; the gateway as its own process
(the shipped command, events on). ``--clients`` requests are sent at once, each on its own
connection. Reported: the answers by status, the upstream's peak concurrency, the gateway's RSS
before, at its peak during the burst and after, the slowest refusal, and the gateway's in-flight
metrics. Works on checkouts without ``gateway.max_in_flight`` (``--code``, ``--max-in-flight 0``
leaves the key out), to compare. ``--prompt-bytes`` of a few MB shows the body budget
(``gateway.max_body_bytes_in_flight``).

    .venv/bin/python bench/gateway_flood.py [--clients 1000] [--hold 3] [--prompt-bytes 1000] [--max-in-flight N]
    .venv/bin/python bench/gateway_flood.py --code /path/to/other/checkout --max-in-flight 0     # before

``--idle N`` opens N TCP connections that send nothing instead (a client that opens sockets and
forgets them, or a slow-header attack), waits ``--idle-wait`` seconds (the default
``gateway.header_timeout_s`` is 20) and reports how many the gateway closed, its open descriptors and
RSS, and whether a real request is served meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import orjson  # noqa: E402
import yaml  # noqa: E402
from aiohttp import web  # noqa: E402
from common import machine_note, services, table  # noqa: E402

from watchdog.dev.embedded import free_port, wait_for_port  # noqa: E402

MODEL = "flood-model"
_ANSWER = orjson.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": MODEL,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})


class HeldUpstream:
    """Answers every chat request after ``hold`` seconds; ``peak`` is the most it held at once."""

    def __init__(self, hold: float) -> None:
        self.hold, self.active, self.peak, self.port = hold, 0, 0, 0
        self.loop = asyncio.new_event_loop()

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.hold)
        finally:
            self.active -= 1
        return web.Response(body=_ANSWER, content_type="application/json")

    def start(self) -> HeldUpstream:
        app = web.Application(client_max_size=16 * 1024 * 1024)  # the gateway passes bodies up to 8 MiB
        app.router.add_post("/v1/chat/completions", self.chat)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def serve() -> int:
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
            await site.start()
            return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

        self.port = asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        return self


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, float]:
    t0 = time.perf_counter()
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
        await resp.read()
        return resp.status, time.perf_counter() - t0


async def burst(port: int, n: int, body: bytes) -> list[tuple[int, float]]:
    """``n`` requests at once, one connection each: (status, seconds) per request."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return list(await asyncio.gather(*(_one(session, url, body) for _ in range(n))))


def watch_rss(pid: int, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        out.append(rss_mib(pid))
        time.sleep(0.05)


def scrape(port: int) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(("llmwd_gateway_in_flight", "llmwd_gateway_refused_total", "llmwd_gateway_body_bytes")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def idle_drill(pid: int, port: int, n: int, wait: float, body: bytes) -> None:
    """``n`` connections that send nothing; what the gateway holds and whether it still serves."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 1024)), hard))
    fds = lambda: len(list(Path(f"/proc/{pid}/fd").iterdir()))  # noqa: E731
    before_rss, before_fds = rss_mib(pid), fds()
    socks, failed = [], 0
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            failed += 1
    time.sleep(1)
    held_rss, held_fds = rss_mib(pid), fds()
    try:
        status, seconds = asyncio.run(burst(port, 1, body))[0]
        meanwhile = f"{status} in {seconds * 1000:.0f} ms"
    except (aiohttp.ClientError, OSError) as exc:
        meanwhile = f"failed: {exc}"
    t0 = time.perf_counter()
    closed = 0
    while time.perf_counter() - t0 < wait:
        time.sleep(1)
    for s in socks:
        s.setblocking(False)
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    after_rss, after_fds = rss_mib(pid), fds()
    print(table(["idle connections", "failed to connect", "gateway fds before / held / after", "RSS MiB before / held / after",
                 f"closed by the gateway within {wait:g} s", "a request meanwhile"],
                [[n, failed, f"{before_fds} / {held_fds} / {after_fds}",
                  f"{before_rss:.0f} / {held_rss:.0f} / {after_rss:.0f}", closed, meanwhile]]))
    for s in socks:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000, help="requests sent at once")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds the upstream holds each request")
    ap.add_argument("--prompt-bytes", type=int, default=1000, help="size of each request's prompt")
    ap.add_argument("--max-in-flight", type=int, default=None,
                    help="gateway.max_in_flight (default: the checkout's default; 0: key left out)")
    ap.add_argument("--code", default=str(Path(__file__).resolve().parent.parent), help="checkout to run")
    ap.add_argument("--idle", type=int, default=0, help="open this many idle connections instead of a burst")
    ap.add_argument("--idle-wait", type=float, default=25.0, help="seconds to watch the idle connections")
    args = ap.parse_args()
    print(f"machine: {machine_note()} (shared: other work may run); code: {args.code}")
    body = orjson.dumps({"model": MODEL, "max_tokens": 8,
                         "messages": [{"role": "user", "content": "x" * args.prompt_bytes}]})
    up = HeldUpstream(args.hold).start()
    with services() as svc:
        port = free_port()
        gw: dict[str, Any] = {"port": port, "redis_url": svc.redis_url,
                              "events": {"bootstrap_servers": svc.kafka_address, "topic": "bench.flood.events"},
                              "pools": [{"model": MODEL, "candidate": {"url": f"http://127.0.0.1:{up.port}/v1"},
                                         "baseline": {"url": f"http://127.0.0.1:{up.port}/v1"}}]}
        if args.max_in_flight:
            gw["max_in_flight"] = args.max_in_flight
        cfg = svc.workdir / "gateway.yaml"
        cfg.write_text(yaml.safe_dump({"gateway": gw}))
        proc = subprocess.Popen([sys.executable, "-m", "watchdog.cli.main", "--log-level", "WARNING", "gateway",
                                 "--config", str(cfg)], env={"PYTHONPATH": args.code, "PATH": "/usr/bin:/bin"}, cwd=args.code,
                                stdout=(svc.workdir / "gateway.log").open("wb"), stderr=subprocess.STDOUT)
        try:
            wait_for_port(port, 30, proc)
            up.hold, warm = 0.0, asyncio.run(burst(port, 50 if args.prompt_bytes < 1e6 else 4, body))
            assert all(s == 200 for s, _ in warm), warm
            if args.idle:
                idle_drill(proc.pid, port, args.idle, args.idle_wait, body)
                return 0
            up.hold, up.peak = args.hold, 0
            before = rss_mib(proc.pid)
            samples: list[float] = []
            stop = threading.Event()
            watcher = threading.Thread(target=watch_rss, args=(proc.pid, stop, samples))
            watcher.start()
            t0 = time.perf_counter()
            answers = asyncio.run(burst(port, args.clients, body))
            wall = time.perf_counter() - t0
            stop.set()
            watcher.join()
            time.sleep(1)
            after = rss_mib(proc.pid)
            statuses = collections.Counter(s for s, _ in answers)
            refused = [t for s, t in answers if s != 200]
            print(table(["clients", "answers by status", "upstream peak", "gateway RSS MiB before / peak / after",
                         "slowest refusal ms", "burst wall s"],
                        [[args.clients, dict(statuses), up.peak, f"{before:.0f} / {max(samples):.0f} / {after:.0f}",
                          max(refused) * 1000 if refused else "-", wall]]))
            print("gateway metrics:", scrape(port))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
