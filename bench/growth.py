"""Benchmark: how the daemon's costs grow with the routes one replica judges (issue 19, growth table).

For each route count: a fresh Tansu + Redis (free ports), the daemon as deployed (``fp8-watchdog run``
in its own process, shipped ``policies/default.yaml``, ``--window`` s windows (10), topic of 4 partitions, route caps
raised above the count), and a producer here sending ``watchdog.dev.traffic`` events live at
``--rate`` events/s, round-robin over the routes (every route gets the same share; 2 % of the routes
carry a quality regression, so agreement scoring runs and rollbacks happen). After a warm-up of
``--warmup`` seconds (every route has state and windows have closed), ``--seconds`` are measured:

* events consumed per second (``llmwd_events_total``, every result) against events sent;
* the daemon's CPU per consumed event (user + system time from ``/proc/PID/stat``) and in % of a core;
* RSS peak and at the end (``/proc/PID/status``);
* Redis: bytes written to it per second (``INFO stats`` ``total_net_input_bytes``: checkpoints, window
  records, flips, everything the daemon sends) and ``used_memory`` at the end;
* from the daemon's /metrics, over the measured span: checkpoint saves (``llmwd_checkpoint_seconds``:
  build + encode + write; ``llmwd_checkpoint_loop_seconds``: the loop's part) p50 / p99, the loop's
  own work per iteration (``llmwd_loop_busy_seconds``: the iteration less its wait in the consumer's
  poll) p99 and the largest bucket hit, close -> flip p99 (``llmwd_close_to_flip_seconds``: from the
  loop iteration in which the watermark closed the window; a tree without it shows ``-``) and window end ->
  flip p99 (``llmwd_window_end_to_flip_seconds``, ``llmwd_reaction_seconds`` before it was renamed: from the
  window's end in event time, so with the 2 s grace and the watermark's lag), and the last checkpoint's
  bytes summed over partitions;
* the cyclic collector's passes in the span, by generation (young / middle / full): how many, the longest,
  their sum and the objects they collected, written by the daemon process itself through ``bench/gc_trace.py`` (any tree);
* events sent that no committed Kafka offset covers at the end (what a SIGKILL then would read again), and
  every 5 s whether reading was held (``llmwd_reading_held``: judging ran behind, the back-pressure), the
  oldest unsaved partition's age (``llmwd_checkpoint_age_seconds``) and the judging backlog's;
* event-time lag at the end: now minus the slowest partition's watermark (``llmwd_watermark_seconds``),
  which includes the 2 s grace and half a window.

Quantiles come from the histograms' buckets (the upper bound of the bucket that holds the quantile).

    .venv/bin/python bench/growth.py [--routes 100,1000,10000] [--rate 2000] [--seconds 60] [--warmup 25] [--window 10]
        [--code OTHER_TREE ...] [--repeats 1] [--profile DIR]

``--code`` runs the daemon of another checkout as well (a before/after in one run): each repetition
runs this tree's daemon, then each ``--code`` tree's, on fresh services; the ``tree`` column names it.
``--profile DIR`` writes a cProfile of each daemon to DIR/<tree>-<routes>-<repetition>.prof.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import redis  # noqa: E402
from common import MODEL, ROOT, committed, machine_note, process_cpu_s, route_names, services, table  # noqa: E402
from gc_trace import read as read_gc_trace  # noqa: E402
from kafka import KafkaAdminClient, KafkaProducer  # noqa: E402
from memory import check_alive, daemon_process, rss_mb  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from watchdog.dev.embedded import free_port  # noqa: E402
from watchdog.dev.traffic import Route, TrafficGenerator  # noqa: E402

HISTOGRAMS = ("llmwd_checkpoint_seconds", "llmwd_checkpoint_loop_seconds", "llmwd_loop_busy_seconds",
              "llmwd_close_to_flip_seconds", "llmwd_window_end_to_flip_seconds", "llmwd_reaction_seconds")


def snapshot(url: str) -> dict[str, Any]:
    """Counters, gauges and histogram buckets of the daemon's /metrics that this bench reads."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, Any] = {"events": 0.0, "watermarks": [], "ckpt_bytes": 0.0, "flips": 0.0, "held": float("nan"),
                           **{h: {} for h in HISTOGRAMS}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "llmwd_events_total":
                out["events"] += s.value
            elif s.name == "llmwd_watermark_seconds":
                out["watermarks"].append(s.value)
            elif s.name == "llmwd_checkpoint_bytes":
                out["ckpt_bytes"] += s.value
            elif s.name == "llmwd_flips_total":
                out["flips"] += s.value
            elif s.name == "llmwd_reading_held":  # absent in a tree without back-pressure
                out["held"] = s.value
            elif s.name == "llmwd_checkpoint_age_seconds":  # absent in a tree before it
                out["ckpt_age"] = max(out.get("ckpt_age", 0.0), s.value)
            elif s.name == "llmwd_judging_backlog_seconds":
                out["backlog_s"] = s.value
            elif s.name.endswith("_bucket") and s.name[:-7] in HISTOGRAMS:
                le = float(s.labels["le"])
                out[s.name[:-7]][le] = out[s.name[:-7]].get(le, 0.0) + s.value
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, float]:
    """(bucket bound holding quantile ``q`` of the observations between two snapshots, count)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]  # cumulative
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan"), 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= q * total:
            return b, total
    return float("inf"), total


def largest(before: dict[float, float], after: dict[float, float]) -> float:
    """Upper bound of the largest bucket that received an observation between the snapshots."""
    bounds = sorted(after)
    prev = 0.0
    top = float("nan")
    for b in bounds:
        c = after[b] - before.get(b, 0.0)
        if c > prev:
            top = b
        prev = c
    return top


def send_round_robin(gen: TrafficGenerator, producer: KafkaProducer, topic: str, rate: float,
                     stop: threading.Event) -> None:
    """``rate`` events/s, route after route (a generator's per-route timers do not scale to 50k routes)."""
    start = time.monotonic()
    i = 0
    n = len(gen.routes)
    while not stop.is_set():
        due = int((time.monotonic() - start) * rate)
        while gen.sent < due:
            key, value = gen.encoded(gen.routes[i % n])
            producer.send(topic, key=key, value=value)
            gen.sent += 1
            i += 1
        stop.wait(0.01)
    producer.flush()


def run_one(n_routes: int, args: argparse.Namespace, code: Path = ROOT, label: str = "this",
            profile: Path | None = None) -> list[Any]:
    print(f"{label} ({code}), {n_routes:,} routes: {machine_note()}", flush=True)
    with services() as svc:
        topic = f"bench.growth.{uuid.uuid4().hex[:8]}"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cfg = {
            "instance": f"bench-growth-{n_routes}",
            "policies": [str(ROOT / "policies" / "default.yaml")],
            "kafka": {"bootstrap_servers": svc.kafka_address, "topic": topic, "group_id": f"g-{topic}",
                      "session_timeout_ms": 10000, "heartbeat_interval_ms": 1000},
            "redis": {"url": svc.redis_url, "prefix": "benchgrowth"},
            "windows": {"length_s": args.window, "grace_s": 2.0, "max_routes": max(10_000, 2 * n_routes),
                        "max_routes_per_partition": max(2_000, n_routes)},
            "server": {"host": "127.0.0.1", "port": port},
        }
        r = redis.Redis.from_url(svc.redis_url)
        names = route_names(n_routes)
        gen = TrafficGenerator([Route(MODEL, name, rate=1.0, regression="quality" if i % 50 == 7 else None)
                                for i, name in enumerate(names)])
        trace = svc.workdir / "gc.trace"
        with daemon_process(svc.workdir, cfg, code=code, profile=profile, gc_trace=trace) as (proc, log_path,
                                                                                              _startup):
            producer = KafkaProducer(bootstrap_servers=svc.kafka_address, linger_ms=20)
            stop = threading.Event()
            sender = threading.Thread(target=send_round_robin, args=(gen, producer, topic, args.rate, stop),
                                      daemon=True)
            sender.start()
            try:
                time.sleep(args.warmup)
                check_alive(proc, log_path)
                m0, cpu0, sent0, wall0 = snapshot(url), process_cpu_s(proc.pid), gen.sent, time.time()
                in0, t0 = r.info("stats")["total_net_input_bytes"], time.monotonic()
                rss, held, ages, backlogs = [rss_mb(proc.pid)], [], [], []
                while time.monotonic() - t0 < args.seconds:
                    time.sleep(5.0)
                    check_alive(proc, log_path)
                    rss.append(rss_mb(proc.pid))
                    sample = snapshot(url)
                    held.append(sample["held"])
                    ages.append(sample.get("ckpt_age", float("nan")))
                    backlogs.append(sample.get("backlog_s", float("nan")))
                m1, cpu1, sent1, wall1 = snapshot(url), process_cpu_s(proc.pid), gen.sent, time.time()
                # what a SIGKILL now would read again: events sent that no committed offset covers yet
                admin = KafkaAdminClient(bootstrap_servers=svc.kafka_address)
                try:
                    uncommitted = gen.sent - committed(admin, f"g-{topic}", topic)
                finally:
                    admin.close()
                in1, t1 = r.info("stats")["total_net_input_bytes"], time.monotonic()
                lag = time.time() - min(m1["watermarks"]) if m1["watermarks"] else float("nan")
                used = r.info("memory")["used_memory"]
            finally:
                stop.set()
                sender.join(timeout=30)
                producer.close(timeout=5)
            for line in log_path.read_text(errors="replace").splitlines():
                if "slow loop iteration" in line:
                    print("  daemon:", line.strip()[-300:])
        gc_passes = read_gc_trace(trace, wall0, wall1)
        print("  RSS MB every 5 s of the span:", " ".join(f"{x:.0f}" for x in rss), flush=True)
        print("  reading held (llmwd_reading_held) every 5 s:", " ".join(f"{x:.0f}" for x in held), flush=True)
        print("  oldest unsaved partition s (llmwd_checkpoint_age_seconds) every 5 s:",
              " ".join(f"{x:.0f}" for x in ages), flush=True)
        print("  judging backlog s (llmwd_judging_backlog_seconds) every 5 s:",
              " ".join(f"{x:.0f}" for x in backlogs), flush=True)
        r.close()
    span = t1 - t0
    consumed = m1["events"] - m0["events"]
    ck = [quantile(m0[h], m1[h], q)[0] for h in ("llmwd_checkpoint_seconds", "llmwd_checkpoint_loop_seconds")
          for q in (0.5, 0.99)]
    loop99, _ = quantile(m0["llmwd_loop_busy_seconds"], m1["llmwd_loop_busy_seconds"], 0.99)
    loop_top = largest(m0["llmwd_loop_busy_seconds"], m1["llmwd_loop_busy_seconds"])
    close99, _ = quantile(m0["llmwd_close_to_flip_seconds"], m1["llmwd_close_to_flip_seconds"], 0.99)
    renamed = "llmwd_window_end_to_flip_seconds" if m1["llmwd_window_end_to_flip_seconds"] else "llmwd_reaction_seconds"
    end99, flips = quantile(m0[renamed], m1[renamed], 0.99)
    gc_cells = [f"{len(s)} / {1e3 * max(s, default=0.0):.0f} / {sum(s):.2f} / {n:,}"
                for s, n in (gc_passes[g] for g in (0, 1, 2))]
    row = [label, n_routes, (sent1 - sent0) / span, consumed / span, 1e6 * (cpu1 - cpu0) / max(consumed, 1.0),
           100 * (cpu1 - cpu0) / span, max(rss), rss[-1], (in1 - in0) / span / 1e3, used / 1e6,
           m1["ckpt_bytes"] / 1e6, f"{ck[0] * 1e3:g} / {ck[1] * 1e3:g}", f"{ck[2] * 1e3:g} / {ck[3] * 1e3:g}",
           f"{loop99 * 1e3:g} / {loop_top * 1e3:g}", *gc_cells,
           f"{close99 * 1e3:g}" if m1["llmwd_close_to_flip_seconds"] else "-", f"{end99 * 1e3:g} ({flips:.0f})", lag, uncommitted]
    print(table(HEADER, [row]), flush=True)
    return row


HEADER = ["tree", "routes", "sent ev/s", "consumed ev/s", "CPU µs/event", "CPU % of a core", "RSS peak MB",
          "RSS end MB", "Redis in kB/s", "Redis used MB", "last ckpt MB (all partitions)",
          "ckpt ms p50 / p99", "ckpt loop ms p50 / p99", "loop busy ms p99 / max bucket",
          "GC young: passes / max ms / sum s / objects collected", "GC middle", "GC full", "close->flip ms p99",
          "window end->flip ms p99 (flips)", "event-time lag s", "sent not committed at the end"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routes", default="100,1000,10000", help="comma-separated route counts")
    ap.add_argument("--rate", type=float, default=2000.0, help="events/s in total")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured span per route count")
    ap.add_argument("--warmup", type=float, default=25.0, help="seconds of traffic before measuring")
    ap.add_argument("--window", type=float, default=10.0, help="windows.length_s (policies judge each window)")
    ap.add_argument("--code", type=Path, action="append", default=[],
                    help="also run the daemon of this tree (another checkout), interleaved with this one's")
    ap.add_argument("--repeats", type=int, default=1, help="runs per tree and route count")
    ap.add_argument("--profile", type=Path, help="cProfile each daemon into DIR/<tree>-<routes>-<rep>.prof")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"machine at start: {machine_note()}", flush=True)
    trees = [("this", ROOT)] + [(f"code{i + 1}", c.resolve()) for i, c in enumerate(args.code)]
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.routes.split(","):
        for rep in range(args.repeats):
            for label, code in trees:
                prof = args.profile / f"{label}-{n}-{rep + 1}.prof" if args.profile else None
                rows.append(run_one(int(n), args, code, label, prof))
    print()
    print(table(HEADER, rows))
    print(f"windows {args.window:g} s, rate {args.rate:.0f} ev/s, warm-up {args.warmup:.0f} s, measured {args.seconds:.0f} s per count; "
          f"machine at end: {machine_note()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
