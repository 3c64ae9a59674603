"""Benchmark: latency the gateway adds, and what its event path costs in throughput.

Same run, interleaved, repeated: a load generator (a minimal keep-alive HTTP/1.1 client on raw
asyncio sockets, so the client's own cost stays small) calls

* ``direct``          a fast local upstream (uvicorn, canned OpenAI answers: the gateway's own cost shows)
* ``gateway``         ``llm-watchdog gateway`` (the shipped command, its own process) in front of it,
                      events on to a local Tansu broker, flags from a local Redis
* ``gateway-noevents`` the same gateway with ``events.enabled: false``

* ``litellm``         a real ``litellm --config`` proxy (1 worker, as LiteLLM starts by default) in front
                      of the same upstream with this project's hook (``watchdog.integrations.litellm``:
                      the flag picks the FP8 or FP16 deployment, events to the same Tansu): the other
                      way to put the watchdog in front of an engine (docs/INTEGRATIONS_otlp_litellm.md)

at 1 and 64 concurrent clients, non-streamed and streamed (16 SSE chunks). Added latency is a
front's p50/p99 minus direct's; the event path's cost is 1 − throughput(gateway) /
throughput(gateway-noevents) at 64 clients. The LiteLLM cells send ``--litellm-requests`` per cell
(it is ~50x slower; 0 or no ``litellm`` executable: left out). ``--real`` adds the project's OpenAI
server over the tiny model (torch) as the upstream, for context.

    .venv/bin/python bench/gateway.py [--requests 400] [--repeats 3] [--litellm-requests 100] [--real]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson  # noqa: E402
from common import ROOT, machine_note, median, percentile, services, table  # noqa: E402

from watchdog.dev.embedded import free_port, wait_for_port  # noqa: E402

MODEL = "bench-model"
CHUNKS = 16
#: requests per client before each measured cell (connections warm, not counted)
WARM_UP = 3

# --- the fast upstream (run in its own process: python bench/gateway.py --serve-upstream PORT) ----

_ANSWER = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "The answer is 42."},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}})
_CHUNK = b"data: " + orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                                   "model": MODEL, "choices": [{"index": 0, "delta": {"content": " tok"},
                                                                "finish_reason": None}]}) + b"\n\n"


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if b'"stream":true' in body.replace(b" ", b""):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(CHUNKS):
            await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    else:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": _ANSWER})


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", backlog=4096)


# --- the load generator -------------------------------------------------------------------------


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """(status, the server closes the connection)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:] if ln)}
    if b"content-length" in headers:
        await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        await reader.read()
        return status, True
    return status, headers.get(b"connection") == b"close"


async def _worker(port: int, body: bytes, n: int, out: list[float], errors: list[int], auth: bytes = b"") -> None:
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           + (b"authorization: Bearer " + auth + b"\r\n" if auth else b"")
           + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            writer.write(req)
            status, closed = await _read_response(reader)
            out.append((time.perf_counter() - t0) * 1000)
            if status != 200:
                errors.append(status)
            if closed:  # the project's threaded server closes after a stream
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
    finally:
        writer.close()


async def _load(port: int, stream: bool, clients: int, requests: int, auth: bytes) -> tuple[list[float], float, int]:
    body = orjson.dumps({"model": MODEL, "stream": stream, "max_tokens": 16,
                         "messages": [{"role": "user", "content": "What is the answer?"}]})
    lat: list[float] = []
    errors: list[int] = []
    per = max(1, requests // clients)
    await asyncio.gather(*(_worker(port, body, WARM_UP, [], [], auth) for _ in range(clients)))  # warm connections
    t0 = time.perf_counter()
    await asyncio.gather(*(_worker(port, body, per, lat, errors, auth) for _ in range(clients)))
    return lat, len(lat) / (time.perf_counter() - t0), len(errors)


def load(port: int, stream: bool, clients: int, requests: int, auth: str = "") -> tuple[list[float], float, int]:
    return asyncio.run(_load(port, stream, clients, requests, auth.encode()))


# --- processes -----------------------------------------------------------------------------------


def start(argv: list[str], port: int, log: Path, env: dict[str, str] | None = None,
          wait_s: float = 30) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    wait_for_port(port, wait_s, proc)
    return proc


LITELLM_KEY = "sk-llmwd-bench-" + "0" * 32


def start_litellm(svc: Any, upstream: str) -> tuple[subprocess.Popen[bytes], int] | None:
    """A ``litellm --config`` proxy (1 worker) with this project's hook in front of ``upstream``;
    None when the ``litellm`` command is not installed."""
    import httpx
    import yaml

    exe = Path(sys.executable).parent / "litellm"
    if not exe.exists():
        return None
    work = svc.workdir / "litellm"
    work.mkdir(exist_ok=True)
    (work / "llmwd.yaml").write_text(yaml.safe_dump({
        "redis_url": svc.redis_url, "bootstrap_servers": svc.kafka_address, "topic": "bench.litellm.events",
        "variants": {MODEL: {"fp8": f"{MODEL}-fp8", "fp16": f"{MODEL}-fp16"}}, "default_route": "default"}))
    deployment = {"model": f"openai/{MODEL}", "api_base": upstream, "api_key": "none", "timeout": 30}
    (work / "proxy.yaml").write_text(yaml.safe_dump({
        "model_list": [{"model_name": name, "litellm_params": deployment}
                       for name in (f"{MODEL}-fp8", f"{MODEL}-fp16", MODEL)],
        "litellm_settings": {"callbacks": "watchdog.integrations.litellm.handler", "num_retries": 0},
        "general_settings": {"master_key": LITELLM_KEY}}))
    port = free_port()
    proc = start([str(exe), "--config", str(work / "proxy.yaml"), "--host", "127.0.0.1", "--port", str(port),
                  "--num_workers", "1"], port, work / "proxy.log", wait_s=180,
                 env={"LLMWD_LITELLM_CONFIG": str(work / "llmwd.yaml"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                      "NO_DOCS": "True", "DISABLE_ADMIN_UI": "True", "LITELLM_LOG": "ERROR"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the port opens before the app is ready
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"litellm proxy not ready: {(work / 'proxy.log').read_text()[-2000:]}")


def gateway_config(path: Path, port: int, upstream: str, redis_url: str, kafka: str, events: bool,
                   upstream_model: str | None = None) -> Path:
    import yaml

    up: dict[str, Any] = {"url": upstream, "timeout_s": 30}
    if upstream_model:
        up["model"] = upstream_model
    path.write_text(yaml.safe_dump({"gateway": {
        "port": port, "redis_url": redis_url,
        "events": {"enabled": events, "bootstrap_servers": kafka, "topic": "bench.gateway.events"},
        "pools": [{"model": MODEL, "candidate": up, "baseline": up}]}}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="requests per (mode, stream, clients) cell")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--litellm-requests", type=int, default=100,
                    help="requests per LiteLLM cell at 1 client (x4 at 64); 0 leaves LiteLLM out")
    ap.add_argument("--real", action="store_true", help="also: the tiny-model OpenAI server as upstream")
    ap.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    print(f"machine: {machine_note()} (shared: other work may run)")
    procs: list[subprocess.Popen[bytes]] = []
    with services() as svc:
        try:
            up_port = free_port()
            procs.append(start([sys.executable, __file__, "--serve-upstream", str(up_port)], up_port,
                               svc.workdir / "upstream.log"))
            ports = {"direct": up_port}
            for name, events in (("gateway", True), ("gateway-noevents", False)):
                ports[name] = free_port()
                cfg = gateway_config(svc.workdir / f"{name}.yaml", ports[name], f"http://127.0.0.1:{up_port}/v1",
                                     svc.redis_url, svc.kafka_address, events)
                procs.append(start([sys.executable, "-m", "watchdog.cli.main", "--log-level", "WARNING", "gateway",
                                    "--config", str(cfg)], ports[name], svc.workdir / f"{name}.log"))
            pids = {"gateway": procs[1].pid, "gateway-noevents": procs[2].pid}
            modes = ["direct", "gateway", "gateway-noevents"]
            lite = start_litellm(svc, f"http://127.0.0.1:{up_port}/v1") if args.litellm_requests > 0 else None
            if lite is not None:
                procs.append(lite[0])
                ports["litellm"], pids["litellm"] = lite[1], lite[0].pid
                modes.append("litellm")
            results: dict[tuple[str, bool, int], list[tuple[float, float, float, float]]] = {}
            lite_latencies: list[tuple[list[float], float, int]] = []
            errors: dict[str, int] = {}
            for _ in range(args.repeats):
                for stream in (False, True):
                    for clients in (1, 64):
                        for mode in modes:
                            n = args.litellm_requests if mode == "litellm" else args.requests
                            n = n if clients == 1 else n * 4
                            c0 = _cpu(pids.get(mode))
                            lat, rps, errs = load(ports[mode], stream, clients, n,
                                                  LITELLM_KEY if mode == "litellm" else "")
                            if mode == "litellm":
                                lite_latencies.append((lat, rps, errs))
                            cpu_us = (_cpu(pids.get(mode)) - c0) / max(1, len(lat)) * 1e6
                            errors[mode] = errors.get(mode, 0) + errs
                            results.setdefault((mode, stream, clients), []).append(
                                (percentile(lat, 50), percentile(lat, 99), rps, cpu_us))
            rows = []
            for stream in (False, True):
                for clients in (1, 64):
                    d = results[("direct", stream, clients)]
                    g = results[("gateway", stream, clients)]
                    q = results[("gateway-noevents", stream, clients)]
                    add50 = median([gi[0] - di[0] for gi, di in zip(g, d, strict=True)])
                    add99 = median([gi[1] - di[1] for gi, di in zip(g, d, strict=True)])
                    cost = median([1 - gi[2] / qi[2] for gi, qi in zip(g, q, strict=True)])
                    cpu_g, cpu_q = median([x[3] for x in g]), median([x[3] for x in q])
                    rows.append(["stream" if stream else "json", clients, median([x[0] for x in d]),
                                 median([x[1] for x in d]), median([x[0] for x in g]), median([x[1] for x in g]),
                                 add50, add99, median([x[2] for x in d]), median([x[2] for x in g]),
                                 median([x[2] for x in q]), f"{cost:+.1%}", cpu_g, cpu_q,
                                 f"{cpu_g / cpu_q - 1:+.1%}"])
            print(table(["mode", "clients", "direct p50 ms", "direct p99 ms", "gw p50 ms", "gw p99 ms",
                         "added p50 ms", "added p99 ms", "direct req/s", "gw req/s", "gw no-events req/s",
                         "throughput cost of events", "gw CPU us/req", "no-events CPU us/req",
                         "CPU cost of events"], rows))
            print(f"(medians over {args.repeats} interleaved repetitions; non-200 answers per mode: {errors or 0}; "
                  f"gateway events to Tansu; target added p50 <= 2 ms, p99 <= 10 ms, event cost < 10 %)")
            if "litellm" in modes:
                print(litellm_table(results))
                sent = sum(len(v[0]) for v in lite_latencies)
                warm = args.repeats * 2 * (1 + 64) * WARM_UP
                print(f"(LiteLLM 1 worker with this project's hook, events to Tansu; {args.litellm_requests} "
                      f"requests per cell at 1 client, {args.litellm_requests * 4} at 64; hook events on the "
                      f"topic: {_count(svc.kafka_address, 'bench.litellm.events')} for {sent + warm} requests "
                      f"({sent} measured + {warm} warm-up))")
            gw_metrics = _scrape(ports["gateway"])
            print("gateway event counters:", {k: v for k, v in gw_metrics.items() if "events" in k})
            emitter_cost(svc.kafka_address)
            if args.real:
                real_upstream(svc, args)
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=10)
    return 0


Cell = list[tuple[float, float, float, float]]  # per repetition: p50 ms, p99 ms, req/s, CPU us/req


def _added(x: Cell, d: Cell, i: int) -> float:
    return median([xi[i] - di[i] for xi, di in zip(x, d, strict=True)])


def _ratio(x: Cell, y: Cell, i: int) -> float:
    return median([xi[i] / yi[i] for xi, yi in zip(x, y, strict=True)])


def litellm_table(results: dict[tuple[str, bool, int], list[tuple[float, float, float, float]]]) -> str:
    """The gateway and the LiteLLM proxy against direct and against each other, same run."""
    rows = []
    for stream in (False, True):
        for clients in (1, 64):
            d, g, lt = (results[(m, stream, clients)] for m in ("direct", "gateway", "litellm"))

            rows.append(["stream" if stream else "json", clients,
                         f"{_added(g, d, 0):.2f} / {_added(g, d, 1):.2f}", f"{_added(lt, d, 0):.2f} / {_added(lt, d, 1):.2f}",
                         f"{_ratio(g, d, 0):.2f}", f"{_ratio(lt, d, 0):.2f}",
                         median([x[2] for x in d]), median([x[2] for x in g]), median([x[2] for x in lt]),
                         f"{_ratio(g, d, 2):.3f}", f"{_ratio(lt, d, 2):.4f}", f"{_ratio(g, lt, 2):.1f}",
                         median([x[3] for x in g]), median([x[3] for x in lt])])
    return table(["mode", "clients", "gw added p50 / p99 ms", "litellm added p50 / p99 ms", "gw p50 / direct",
                  "litellm p50 / direct", "direct req/s", "gw req/s", "litellm req/s", "gw / direct req/s",
                  "litellm / direct req/s", "gw / litellm req/s", "gw CPU us/req", "litellm CPU us/req"], rows)


def emitter_cost(kafka: str, n: int = 30_000) -> None:
    """CPU per event of the emitter alone (this process, all threads), for both producer libraries."""
    import importlib.util

    from watchdog.gateway.config import EventsConfig
    from watchdog.ingest.emitter import EventEmitter

    ev = {"schema": 1, "request_id": "r", "ts": time.time(), "model": MODEL, "route": "default",
          "precision": "fp8", "status": "ok", "latency_ms": 1.0, "prompt_tokens": 12, "completion_tokens": 6,
          "engine": MODEL}
    rows = []
    for client in ("confluent", "kafka-python"):
        if client == "confluent" and importlib.util.find_spec("confluent_kafka") is None:
            continue
        em = EventEmitter(EventsConfig(bootstrap_servers=kafka, topic="bench.emitter", client=client,
                                       buffer_size=n + 10)).start()
        em.emit(dict(ev))
        em.wait_sent(1, 20)
        c0 = time.process_time()
        for _ in range(n):
            em.emit(dict(ev))
        ok = em.wait_sent(n + 1, 120)
        rows.append([client, (time.process_time() - c0) / n * 1e6, em.sent - 1 if ok else f"{em.sent - 1} (timeout)",
                     em.errors])
        em.close()
    print("event emitter alone (emit + encode + produce + delivery report):")
    print(table(["producer", "CPU us/event", "acknowledged", "errors"], rows))


def _count(kafka: str, topic: str) -> int:
    """Messages on ``topic``, read from the start until 2 s pass without one."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka, auto_offset_reset="earliest",
                             consumer_timeout_ms=2000, group_id=None)
    try:
        return sum(1 for _ in consumer)
    finally:
        consumer.close()


def _cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _scrape(port: int) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith("llmwd_gateway_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def real_upstream(svc: Any, args: argparse.Namespace) -> None:
    """Context: the tiny-model OpenAI server (torch, FP16) direct vs through the gateway, 1 client."""
    import tempfile

    import torch

    from probes.engines.torch_engine import TorchEngine
    from probes.openai_server import OpenAIServer
    from probes.tiny_model import ensure_tiny_model

    torch.set_num_threads(1)  # steadier on a shared 2-core machine
    model_dir = ensure_tiny_model(Path(tempfile.gettempdir()) / "llmwd-bench-tiny")
    server = OpenAIServer(TorchEngine(model_dir, "fp16"), model_name=MODEL).start()
    port = free_port()
    cfg = gateway_config(svc.workdir / "real.yaml", port, server.base_url, svc.redis_url, svc.kafka_address, True)
    proc = start([sys.executable, "-m", "watchdog.cli.main", "--log-level", "WARNING", "gateway", "--config", str(cfg)],
                 port, svc.workdir / "real.log")
    try:
        rows = []
        for stream in (False, True):
            d, g = [], []
            for _ in range(args.repeats):
                d.append(load(server.port, stream, 1, 40)[0])
                g.append(load(port, stream, 1, 40)[0])
            dp = median([percentile(x, 50) for x in d])
            gp = median([percentile(x, 50) for x in g])
            rows.append(["stream" if stream else "json", dp, gp, gp - dp])
        print("real upstream (tiny model, torch FP16 on CPU, one request at a time):")
        print(table(["mode", "direct p50 ms", "gw p50 ms", "added p50 ms"], rows))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
