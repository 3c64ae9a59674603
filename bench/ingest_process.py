"""Benchmark: ingest throughput of the daemon as a user runs it (``fp8-watchdog run``, a subprocess)
against a raw kafka-python consumer + ``json.loads`` and a confluent-kafka consumer + ``json.loads``.

One Tansu broker and one Redis on free ports; for each route count, one topic pre-produced with the
light or heavy mix of ``bench/ingest.py`` (same producers). Each repetition then reads the whole topic
once per mode, interleaved, each mode in a fresh process and a fresh consumer group:

* ``daemon``     ``python -m watchdog.cli.main run --config <temp YAML>`` (the ``fp8-watchdog`` console
                 script's entry point) on policies/default.yaml, checkpointing into Redis, serving HTTP.
                 Its timer covers **first event processed -> last event processed**, read from its own
                 ``/metrics`` (``llmwd_events_total`` + ``llmwd_dead_letters_total``): every ``--scrape-ms``
                 until it has processed an event, then after a third of the predicted remaining time (a
                 page is 100-160 KB at 1,000 routes: scraping it often would slow the daemon), never less
                 than 4 x ``--scrape-ms``. Rate = (events at the end - events at the first scrape that saw
                 any) / time between; the end is seen at most 4 x ``--scrape-ms`` late.
                 Start-up (spawn -> first event processed: imports, Redis, group join) and the time from the
                 last event processed to its offset committed in Kafka (the mirror of the checkpoint) are
                 quoted separately. CPU: the daemon process (all threads) over the timed span, /proc.
* ``json``       kafka-python with the daemon's consumer settings + ``json.loads`` (``ingest.consume``):
                 the **baseline**. Timer: first non-empty poll -> last record.
* ``json-drain`` the same, but each poll takes every record the consumer has fetched (``max_records`` =
                 ``REFILL_POLLS`` x ``max_poll_records``, as the daemon's ``Ingest`` refills its buffer): kafka-python
                 sends a partition's next fetch only once the last one's records are all taken, so this raw
                 consumer keeps a fetch in flight while it works; the stronger baseline, reported beside ``json``.
* ``confluent``  confluent-kafka ``Consumer`` (librdkafka) + ``json.loads``, same timer.

The result per route count and mix is the daemon's rate / the json rate per repetition, median of the
repetitions. Route limits are raised so that every route is kept (``max_routes_per_partition``).

    .venv/bin/python bench/ingest_process.py [--routes 100,1000,10000] [--mix light,heavy] [--events 200000]
        [--repeats 3] [--profile DIR] [--threads] [--code DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml
from kafka import KafkaAdminClient

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, committed, machine_note, median, process_cpu_s, produce_events, services, table  # noqa: E402
from ingest import consume, produce_heavy  # noqa: E402

from watchdog.dev.embedded import free_port  # noqa: E402

MODES = ("json", "json-drain", "confluent", "daemon")
_COUNTER = re.compile(r"^llmwd_(?:events|dead_letters)_total\{[^}]*\} ([0-9.e+]+)$", re.M)


def consume_confluent(address: str, topic: str, n: int, timeout_s: float) -> tuple[float, float]:
    """(wall, process CPU) seconds from the first non-empty consume to the n-th record + ``json.loads``."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": address, "group.id": f"bench-confluent-{uuid.uuid4().hex[:8]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    loads = json.loads
    seen = 0
    t0 = c0 = None
    deadline = time.monotonic() + timeout_s
    try:
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"confluent: read {seen} of {n} events in {timeout_s:.0f} s")
            msgs = consumer.consume(num_messages=2000, timeout=0.2)
            if not msgs:
                continue
            if t0 is None:
                t0, c0 = time.perf_counter(), time.process_time()
            for m in msgs:
                if m.error() is None:
                    loads(m.value())
                    seen += 1
        assert t0 is not None and c0 is not None
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        consumer.close()


def run_baseline(mode: str, address: str, topic: str, n: int, timeout_s: float) -> dict[str, float]:
    """One baseline in a fresh process (``--child``), so that neither this process's heap nor its
    imports weigh on it."""
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--address", address, "--topic", topic,
                          "--events", str(n), "--timeout", str(timeout_s)], capture_output=True, text=True,
                         cwd=ROOT, timeout=timeout_s + 60, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} baseline failed:\n{out.stderr[-3000:]}")
    wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return {"rate": n / wall, "cpu_us": 1e6 * cpu / n}


def _processed(url: str) -> tuple[float, int, str]:
    """(events read so far: folded + dead-lettered, bytes of the /metrics page, the page)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=2) as resp:  # noqa: S310 - loopback
        text = resp.read().decode()
    return sum(float(x) for x in _COUNTER.findall(text)), len(text), text


def thread_ticks(pid: int) -> dict[tuple[int, str], int]:
    """CPU clock ticks (user + system) of each thread of ``pid`` so far, keyed by (tid, name)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[(int(task.name), name)] = int(fields[11]) + int(fields[12])
    return out


def _thread_group(name: str) -> str:
    """Threads of one kind under one name (HTTP request threads, alert senders, start-up helpers)."""
    return re.sub(r"-?\d+$", "", name)


#: ``_sum`` series of /metrics whose growth over the timed span is shown with ``--threads`` (loop phases)
_SUMS = re.compile(r"^(llmwd_(?:gc_seconds|loop_busy_seconds|loop_iteration_seconds|checkpoint_loop_seconds|"
                   r"checkpoint_seconds|malloc_trim_seconds)_(?:sum|count)|"
                   r"llmwd_(?:loop_busy_seconds|checkpoint_loop_seconds)_bucket)(\{[^}]*\})? ([0-9.e+]+)$", re.M)


def _sums(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in _SUMS.findall(text):
        key = name + (labels or "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def run_daemon(svc: Any, topic: str, n: int, timeout_s: float, scrape_s: float,
               profile: Path | None = None, code: Path = ROOT, threads: bool = False) -> dict[str, Any]:
    """``watchdog.cli.main run`` of the tree ``code`` on a temp config until it has processed all ``n``
    events (see the module docstring for what the timer covers), then SIGTERM."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    group = f"bench-daemon-{uuid.uuid4().hex[:8]}"
    cfg_path = svc.workdir / f"{group}.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "instance": "bench-ingest",
        "policies": [str(ROOT / "policies" / "default.yaml")],
        "kafka": {"bootstrap_servers": svc.kafka_address, "topic": topic, "group_id": group,
                  "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        "redis": {"url": svc.redis_url, "prefix": f"b{uuid.uuid4().hex[:6]}"},
        "windows": {"length_s": 10.0, "grace_s": 2.0, "max_routes_per_partition": 50_000, "max_routes": 50_000},
        "server": {"host": "127.0.0.1", "port": port},
    }))
    log_path = svc.workdir / f"{group}.log"
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    cmd += [str(ROOT / "bench" / "named_threads.py"), "watchdog.cli.main"] if threads else ["-m", "watchdog.cli.main"]
    cmd += ["--log-level", "WARNING", "run", "--config", str(cfg_path)]
    with open(log_path, "wb") as log_file:
        t_spawn = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=code, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(code)})
    try:
        deadline = time.monotonic() + timeout_s + 60
        t_http = first = None
        scrapes = 0
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon: no end in {timeout_s + 60:.0f} s:\n{log_path.read_text()[-3000:]}")
            try:
                got, page, text = _processed(url)
            except OSError:
                time.sleep(scrape_s)
                continue
            scrapes += 1
            now = time.perf_counter()
            if t_http is None:
                t_http = now
            if got and first is None:
                first = (now, got, process_cpu_s(proc.pid))
                if threads:
                    first_threads, first_sums = thread_ticks(proc.pid), _sums(text)
            if got >= n:
                last = (now, got, process_cpu_s(proc.pid))
                if threads:
                    last_threads, last_sums = thread_ticks(proc.pid), _sums(text)
                break
            wait = scrape_s
            if first is not None and got > first[1]:
                # a scrape costs the daemon a /metrics page (100 KB at 1,000 routes): between the first
                # and the last, wait a third of the predicted remaining time
                wait = max(4 * scrape_s, min(2.0, (n - got) * (now - first[0]) / (got - first[1]) / 3))
            time.sleep(wait)
        assert first is not None
        # the last event's offset in Kafka's group offsets (mirrored after its partition's checkpoint)
        committed_s = float("inf")  # not committed within 20 s
        admin = KafkaAdminClient(bootstrap_servers=svc.kafka_address)
        try:
            until = time.monotonic() + 20
            while time.monotonic() < until:
                if committed(admin, group, topic) >= n:
                    committed_s = time.perf_counter() - last[0]
                    break
                time.sleep(0.1)
        finally:
            admin.close()
        span = last[0] - first[0]
        counted = last[1] - first[1]
        extra: dict[str, Any] = {}
        if threads:
            tick = os.sysconf("SC_CLK_TCK")
            by: dict[str, float] = {}
            for key, ticks in last_threads.items():
                grown = ticks - first_threads.get(key, 0)
                by[_thread_group(key[1])] = by.get(_thread_group(key[1]), 0.0) + grown / tick
            # threads that ended inside the span (an HTTP request's): in the process's CPU, in no task left
            by["(ended in the span)"] = max(0.0, last[2] - first[2] - sum(by.values()))
            extra["threads"] = {k: 1e6 * v / counted for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v}
            grown = {k: v - first_sums.get(k, 0.0) for k, v in last_sums.items()}
            # and from the first event to now (the last offset committed, or 20 s after the last event): the
            # judging and saves a catch-up leaves for after its last event
            try:
                until_commit = _sums(_processed(url)[2])
            except OSError:
                until_commit = {}
            # a histogram's observations over 0.25 s (count - the 0.25 bucket), for the loop's two
            for h in ("loop_busy_seconds", "checkpoint_loop_seconds"):
                for label, sums in (("", grown), (" to the commit", {k: v - first_sums.get(k, 0.0)
                                                                     for k, v in until_commit.items()})):
                    if f"llmwd_{h}_count" in sums:
                        grown[f"llmwd_{h} > 0.25 s{label}"] = (sums[f"llmwd_{h}_count"]
                                                               - sums.get(f'llmwd_{h}_bucket{{le="0.25"}}', 0.0))
            extra["sums"] = {k: v for k, v in grown.items() if v and "_bucket" not in k}
        with open(f"/proc/{proc.pid}/status") as f:  # the daemon's peak resident memory so far (VmHWM)
            peak_mb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
        return {**extra, "rate": counted / span, "cpu_us": 1e6 * (last[2] - first[2]) / counted, "peak_mb": peak_mb,
                "startup_s": first[0] - t_spawn, "http_s": t_http - t_spawn, "commit_s": committed_s,
                "first_events": first[1], "metrics_kb": page / 1024, "scrapes": scrapes}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def produce(svc: Any, topic: str, mix: str, events: int, routes: int, windows: int) -> tuple[int, float]:
    args = (svc.kafka_address, topic, events, routes)
    kw = {"events_per_s": events / (windows * 10.0), "end_ts": time.time() - 3.0}
    return (produce_heavy if mix == "heavy" else produce_events)(*args, **kw)  # type: ignore[operator]


def child(args: argparse.Namespace) -> int:
    if args.child == "confluent":
        wall, cpu = consume_confluent(args.address, args.topic, args.events, args.timeout)
    else:
        wall, cpu = consume(args.address, args.topic, args.events, args.child, args.timeout)
    print(json.dumps([wall, cpu]))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", default="100,1000,10000")
    ap.add_argument("--mix", default="light,heavy")
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--windows", type=int, default=10, help="10 s windows the event timestamps span")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--scrape-ms", type=float, default=100.0,
                    help="how often the daemon's /metrics is read until its first event (4x that after)")
    ap.add_argument("--code", type=Path, help="also run the daemon of this tree (mode daemon-code), e.g. an "
                    "export of main, interleaved with this one: a before/after in one run")
    ap.add_argument("--profile", type=Path, help="cProfile the daemon's first repetition into DIR/<mix>-<routes>.prof")
    ap.add_argument("--threads", action="store_true", help="name the daemon's OS threads (bench/named_threads.py) "
                    "and show its CPU per event by thread over the timed span, and the loop phases' /metrics sums")
    ap.add_argument("--child", choices=("json", "json-drain", "confluent"), help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    modes = [m for m in args.modes.split(",") if m]
    if args.code:
        modes.append("daemon-code")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"start: {machine_note()}", flush=True)
    with services() as svc:
        for mix in args.mix.split(","):
            for routes in (int(r) for r in args.routes.split(",")):
                topic = f"bench.proc.{mix}.{routes}.{uuid.uuid4().hex[:6]}"
                nbytes, prod_s = produce(svc, topic, mix, args.events, routes, args.windows)
                print(f"mix {mix}, {routes:,} routes: produced {args.events:,} events "
                      f"({nbytes / args.events:.0f} B avg, {args.windows} windows) in {prod_s:.1f} s", flush=True)
                timeout = max(120.0, args.events / 1000.0)
                res: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
                for rep in range(args.repeats):
                    for mode in modes:
                        if mode == "daemon":
                            prof = args.profile / f"{mix}-{routes}.prof" if args.profile and rep == 0 else None
                            r = run_daemon(svc, topic, args.events, timeout, args.scrape_ms / 1000.0, prof,
                                           threads=args.threads)
                        elif mode == "daemon-code":
                            r = run_daemon(svc, topic, args.events, timeout, args.scrape_ms / 1000.0, code=args.code,
                                           threads=args.threads)
                        else:
                            r = run_baseline(mode, svc.kafka_address, topic, args.events, timeout)
                        res[mode].append(r)
                        extra = (f"  start-up {r['startup_s']:.1f} s (HTTP up {r['http_s']:.1f} s), "
                                 f"peak RSS {r['peak_mb']:.0f} MB, "
                                 f"commit +{r['commit_s']:.2f} s, "
                                 f"{r['scrapes']} scrapes of {r['metrics_kb']:.0f} KB"
                                 if mode.startswith("daemon") else "")
                        print(f"  rep {rep + 1} {mode:<9} {r['rate']:>9,.0f} ev/s {r['cpu_us']:6.1f} us CPU/event"
                              f"{extra}  [{machine_note()}]", flush=True)
                        if "threads" in r:
                            print("    CPU us/event by thread: " + ", ".join(
                                f"{k} {v:.1f}" for k, v in r["threads"].items()), flush=True)
                            print("    /metrics sums over the span: " + ", ".join(
                                f"{k} {v:.3f}" for k, v in sorted(r["sums"].items())), flush=True)
                base = res.get("json")
                for mode in modes:
                    rates = [r["rate"] for r in res[mode]]
                    ratios = [r["rate"] / b["rate"] for r, b in zip(res[mode], base, strict=True)] if base else []
                    d = res[mode]
                    rows.append([mix, routes, mode, median(rates), min(rates), max(rates),
                                 median(ratios) if ratios else float("nan"),
                                 (f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""),
                                 median([r["cpu_us"] for r in d]),
                                 median([r["startup_s"] for r in d]) if "startup_s" in d[0] else float("nan"),
                                 median([r["commit_s"] for r in d]) if "commit_s" in d[0] else float("nan")])
                svc_redis_flush(svc)
    print()
    print(table(["mix", "routes", "mode", "median ev/s", "min", "max", "÷ json (median)", "÷ json range",
                 "CPU us/event", "start-up s", "last event -> committed s"], rows))
    print(f"end: {machine_note()}")
    return 0


def svc_redis_flush(svc: Any) -> None:
    """Drop what the daemons wrote (checkpoints, windows stream) before the next topic."""
    import redis

    client = redis.Redis.from_url(svc.redis_url)
    try:
        client.flushdb()
    finally:
        client.close()


if __name__ == "__main__":
    raise SystemExit(main())
