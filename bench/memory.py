"""Benchmark: the daemon's resident memory with 1,000 active routes under sustained load.

Starts Tansu + Redis (free ports), then the daemon exactly as deployed, as its own process
(``python -m watchdog.cli.main run --config ...``, shipped ``policies/default.yaml``, 10 s windows), and
a producer thread here sending ``watchdog.dev.traffic`` events across 1,000 routes (FP8 with a 15 %
FP16 baseline slice, 30 % of requests carrying a shadow completion, 2 % of routes with a quality
regression so that agreement scoring runs and rollbacks happen). The daemon's RSS is read from
``/proc/PID/status`` (VmRSS) every few seconds: idle after start-up, then under load. Reports idle,
start, peak and end RSS, and the least-squares slope over the second half of the load (MB/min).
Also checks that the daemon never loaded torch or transformers (``/proc/PID/maps`` for their
native libraries, and ``sys.modules`` of a process that imports what ``watchdog.cli.main run`` imports).

    .venv/bin/python bench/memory.py [--minutes 5] [--rate 1000] [--routes 1000] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import yaml  # noqa: E402
from common import MODEL, ROOT, machine_note, route_names, services, table  # noqa: E402
from kafka import KafkaProducer  # noqa: E402

from watchdog.dev.embedded import free_port  # noqa: E402
from watchdog.dev.traffic import Route, TrafficGenerator  # noqa: E402

HEAVY_LIBS = ("libtorch", "libc10", "tokenizers", "safetensors")
HEAVY_MODULES = ("torch", "transformers", "evaluate", "datasets", "pynvml", "rouge_score", "nltk", "scipy")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def heavy_maps(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line}
    return sorted(p for p in paths if any(lib in os.path.basename(p) for lib in HEAVY_LIBS))


def heavy_modules_on_cli_path() -> list[str]:
    """Heavy modules imported by the daemon's own import path (CLI with its plugins + Daemon)."""
    code = ("import sys; from watchdog.cli.main import build_parser; build_parser(); "
            "import watchdog.runtime.daemon, watchdog.windows.shadow; watchdog.windows.shadow.preload_scorers(); "
            f"print(','.join(m for m in {HEAVY_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return [m for m in out.stdout.strip().split(",") if m]


def check_alive(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")


@contextlib.contextmanager
def daemon_process(workdir: Path, cfg: dict[str, Any], *, code: Path = ROOT, profile: Path | None = None,
                   gc_trace: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], Path, float]]:
    """``fp8-watchdog run`` as deployed (its own process, ``cfg`` written as its YAML file), once its
    /healthz answers: (process, log file, seconds to start). SIGTERM (then SIGKILL) on exit; the exit
    code is printed. ``code``: the tree whose daemon runs (another checkout, for a before/after);
    ``profile``: cProfile the daemon into that file (written at its graceful stop); ``gc_trace``: write
    the collector's passes to that file (bench/gc_trace.py)."""
    cfg_path = workdir / f"daemon-{cfg['instance']}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    url = f"http://127.0.0.1:{cfg['server']['port']}"
    log_path = workdir / f"daemon-{cfg['instance']}.log"
    with open(log_path, "wb") as log_file:
        env = {**os.environ, "PYTHONPATH": str(code)}
        prof = [str(Path(__file__).parent / "gc_trace.py"), str(gc_trace)] if gc_trace is not None else []
        if profile is not None:
            prof += ["-m", "cProfile", "-o", str(profile)]
        proc = subprocess.Popen([sys.executable, *prof, "-m", "watchdog.cli.main", "--log-level", "WARNING", "run",
                                 "--config", str(cfg_path)], cwd=code, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            t_spawn = time.monotonic()
            while True:
                check_alive(proc, log_path)
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code < 500:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t_spawn > 60:
                    raise RuntimeError("daemon did not answer /healthz in 60 s")
                time.sleep(0.2)
            yield proc, log_path, time.monotonic() - t_spawn
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            print(f"daemon exit code after SIGTERM: {proc.returncode}")


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float:
    n = len(samples)
    if n < 2:
        return float("nan")
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    cov = sum((t - mt) * (r - mr) for t, r in samples)
    return 60.0 * cov / var if var else float("nan")


def scrape(url: str) -> dict[str, float]:
    """Selected daemon metrics from /metrics."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith(("llmwd_events_total", "llmwd_consumer_lag", "llmwd_windows_closed_total",
                            "llmwd_flips_total", "llmwd_dead_letters_total")):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=1000.0, help="events/s in total")
    ap.add_argument("--routes", type=int, default=1000)
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--quick", action="store_true", help="30 s of load, samples every 2 s (< 60 s in all)")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.interval = 0.5, 2.0
    logging.basicConfig(level=logging.WARNING)

    with services() as svc:
        topic = f"bench.memory.{uuid.uuid4().hex[:8]}"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cfg = {
            "instance": "bench-memory",
            "policies": [str(ROOT / "policies" / "default.yaml")],
            "kafka": {"bootstrap_servers": svc.kafka_address, "topic": topic, "group_id": f"g-{topic}",
                      "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
            "redis": {"url": svc.redis_url, "prefix": "benchmem"},
            "windows": {"length_s": 10.0, "grace_s": 2.0},
            "server": {"host": "127.0.0.1", "port": port},
        }
        samples: list[tuple[float, float]] = []
        with daemon_process(svc.workdir, cfg) as (proc, log_path, startup_s):
            time.sleep(3.0)
            idle_rss = rss_mb(proc.pid)
            print(f"daemon up in {startup_s:.1f} s; idle RSS {idle_rss:.1f} MB", flush=True)

            names = route_names(args.routes)
            routes = [Route(MODEL, r, rate=args.rate / args.routes,
                            regression="quality" if i % 50 == 7 else None) for i, r in enumerate(names)]
            gen = TrafficGenerator(routes)
            producer = KafkaProducer(bootstrap_servers=svc.kafka_address, linger_ms=20)
            try:
                gen.start(producer, topic)
                t0 = time.monotonic()
                duration = args.minutes * 60.0
                while time.monotonic() - t0 < duration:
                    check_alive(proc, log_path)
                    samples.append((time.monotonic() - t0, rss_mb(proc.pid)))
                    elapsed = time.monotonic() - t0
                    print(f"  t={elapsed:6.1f} s  RSS {samples[-1][1]:6.1f} MB  sent {gen.sent:,}", flush=True)
                    time.sleep(args.interval)
                samples.append((time.monotonic() - t0, rss_mb(proc.pid)))
                gen.stop()
                sent = gen.sent
                time.sleep(min(15.0, 2 * args.interval))  # let the daemon drain what is queued
                metrics = scrape(url)
                libs = heavy_maps(proc.pid)
                status = httpx.get(f"{url}/status", timeout=5).json()
            finally:
                gen.stop()
                producer.close(timeout=5)

    modules = heavy_modules_on_cli_path()
    half = [s for s in samples if s[0] >= samples[-1][0] / 2]
    rss = [r for _, r in samples]
    rows = [
        ["idle after start-up (no traffic)", idle_rss],
        ["first sample under load", rss[0]],
        ["peak under load", max(rss)],
        ["end of load", rss[-1]],
        ["slope over 2nd half (MB/min)", slope_mb_per_min(half)],
    ]
    print()
    print(table(["daemon RSS", "MB"], rows))
    consumed = metrics.get('llmwd_events_total{result="ok"}', 0.0)
    lag = sum(v for k, v in metrics.items() if k.startswith("llmwd_consumer_lag"))
    print(f"\nload: {args.routes} routes, {args.rate:.0f} events/s, {args.minutes * 60:.0f} s, sent {sent:,}, "
          f"consumed ok {consumed:,.0f}, windows closed {metrics.get('llmwd_windows_closed_total', 0):,.0f}, "
          f"open windows at end {status.get('open_windows')}, "
          f"flags set {len(status.get('flags', {}))}, consumer lag {lag:,.0f}")
    print(f"torch/transformers native libraries mapped in the daemon: {libs or 'none'}")
    print(f"of {', '.join(HEAVY_MODULES)}, imported on the daemon's import path (CLI + Daemon + agreement "
          f"scorers): {', '.join(modules) or 'none'}")
    print(f"machine: {machine_note()}")
    ok = max(rss) <= 150.0 and abs(slope_mb_per_min(half)) < 1.0
    print(f"peak {max(rss):.1f} MB (target <= 150 MB), slope {slope_mb_per_min(half):+.2f} MB/min: "
          f"{'PASS' if ok else 'MISS'}")
    print(json.dumps({"idle": idle_rss, "peak": max(rss), "end": rss[-1], "slope": slope_mb_per_min(half)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
