"""Drill: one producer floods the daemon with valid events of many distinct routes.

One Tansu broker and one Redis on free ports; a topic of 4 partitions holding ``--events-per-route``
events of each of ``--routes`` distinct routes (event time spread over the last minute), read by the
daemon's own main loop (``Daemon.step``, policies/default.yaml). Reported: the time to read the
flood, the longest loop iteration (a stall), the process's RSS before, after the flood and after
``route_idle_s`` more seconds of loop (idle eviction), the routes and engine scopes kept, the dead
letters by reason, the /status size, and how long the shutdown (what SIGTERM runs) took. Works on
checkouts without bounded routes too (``--code``), to compare.

    .venv/bin/python bench/route_flood.py [--routes 20000] [--events-per-route 2] [--idle 30]
    .venv/bin/python bench/route_flood.py --code /path/to/other/checkout     # before
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--routes", type=int, default=20_000)
ap.add_argument("--events-per-route", type=int, default=2)
ap.add_argument("--idle", type=float, default=30.0, help="windows.route_idle_s (where the checkout has it)")
ap.add_argument("--code", default=str(Path(__file__).resolve().parent.parent), help="checkout to import")
ap.add_argument("--timeout", type=float, default=400.0)
args = ap.parse_args()
sys.path.insert(0, args.code)  # the watchdog package measured
sys.path.append(str(Path(__file__).resolve().parent.parent))  # so that common.py does not put this one first
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, create_topic, machine_note, services, table  # noqa: E402
from kafka import KafkaProducer  # noqa: E402

from watchdog.config.settings import WindowConfig, load_config  # noqa: E402
from watchdog.core.events import encode_event, partition_key  # noqa: E402
from watchdog.runtime.daemon import Daemon  # noqa: E402

MODEL = "llama-flood"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def produce(address: str, topic: str, n_routes: int, per_route: int) -> int:
    create_topic(address, topic, partitions=4)
    producer = KafkaProducer(bootstrap_servers=address, linger_ms=20, batch_size=256 * 1024)
    now = time.time()
    n = 0
    for k in range(per_route):
        for i in range(n_routes):
            route = f"flood-{i:06d}"
            ts = now - 60 + 60 * (k * n_routes + i) / (n_routes * per_route)
            ev = {"schema": 1, "request_id": f"{i}-{k}", "ts": round(ts, 3), "model": MODEL, "route": route,
                  "precision": "fp8" if i % 5 else "fp16", "status": "ok", "latency_ms": 300.0 + i % 97,
                  "prompt_tokens": 100, "completion_tokens": 20, "completion": "an answer"}
            producer.send(topic, key=partition_key(MODEL, route), value=encode_event(ev))
            n += 1
    producer.flush(timeout=120)
    producer.close(timeout=10)
    return n


def main() -> int:
    bounded = "route_idle_s" in WindowConfig.model_fields
    with services() as svc:
        topic = f"flood-{uuid.uuid4().hex[:8]}"
        sent = produce(svc.kafka_address, topic, args.routes, args.events_per_route)
        windows: dict[str, Any] = {"length_s": 10.0, "grace_s": 2.0}
        if bounded:
            windows["route_idle_s"] = args.idle
        cfg = load_config(None, **{
            "policies": [str(ROOT / "policies" / "default.yaml")],
            "kafka": {"bootstrap_servers": svc.kafka_address, "topic": topic, "group_id": f"g-{topic}",
                      "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
            "redis": {"url": svc.redis_url}, "windows": windows, "server": {"port": 0}, "instance": "flood"})
        gc.collect()
        rss0 = rss_mb()
        daemon = Daemon(cfg)
        daemon.connect_kafka()
        daemon.freeze_startup_heap()
        m = daemon.metrics
        counted = m.events.labels("ok"), m.events.labels("invalid")

        def seen() -> float:
            return sum(c._value.get() for c in counted)

        longest = 0.0
        t0 = None  # the first event read (the group join before it is not the flood's doing)
        read_s = None
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            s = time.monotonic()
            daemon.step()
            if t0 is None:
                if seen():
                    t0 = s
                continue
            longest = max(longest, time.monotonic() - s)
            if seen() >= sent:
                read_s = time.monotonic() - t0
                break
        # let the windows close and the checkpoints land (less than route_idle_s), then measure
        until = time.monotonic() + min(12.0, args.idle / 2)
        while time.monotonic() < until:
            s = time.monotonic()
            daemon.step()
            longest = max(longest, time.monotonic() - s)
        rss1 = rss_mb()
        status = json.dumps(daemon.status(), default=str, indent=1)
        routes1 = len(daemon.ownership.route_part)
        scopes1 = len(daemon.engine.states)
        engine_keys1 = sum(1 for _ in daemon.redis.scan_iter(match=f"{cfg.redis.prefix}:engine:*", count=1000))
        # quiet: idle routes are forgotten after route_idle_s (where the checkout has it)
        until = time.monotonic() + args.idle + 10
        while time.monotonic() < until:
            daemon.step()
        gc.collect()
        rss2 = rss_mb()
        routes2 = len(daemon.ownership.route_part)
        scopes2 = len(daemon.engine.states)
        engine_keys2 = sum(1 for _ in daemon.redis.scan_iter(match=f"{cfg.redis.prefix}:engine:*", count=1000))
        dlq = {r: m.dlq.labels(r)._value.get() for r in ("route_limit", "late", "future")}
        t = time.monotonic()
        daemon.stop()
        daemon.shutdown()
        stop_s = time.monotonic() - t
    rows = [
        ["events sent / counted", f"{sent:,} / {seen():,.0f}"],
        ["read the flood (s)", f"{read_s:.1f}" if read_s is not None else f"> {args.timeout:.0f} (timed out)"],
        ["longest loop iteration (s)", f"{longest:.2f}"],
        ["RSS before / after flood / after idle (MB)", f"{rss0:.0f} / {rss1:.0f} / {rss2:.0f}"],
        ["routes kept after flood / after idle", f"{routes1:,} / {routes2:,}"],
        ["engine scopes after flood / after idle", f"{scopes1:,} / {scopes2:,}"],
        ["engine keys in Redis after flood / after idle", f"{engine_keys1:,} / {engine_keys2:,}"],
        ["dead letters route_limit / late / future", " / ".join(f"{v:,.0f}" for v in dlq.values())],
        ["/status bytes", f"{len(status):,}"],
        ["shutdown (s)", f"{stop_s:.1f}"],
    ]
    import watchdog

    print(f"\nroute flood: {args.routes:,} routes x {args.events_per_route} events, code {Path(watchdog.__file__).parent}"
          f" ({'bounded routes' if bounded else 'no route bounds'})")
    print(table(["what", "value"], rows))
    print(machine_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
