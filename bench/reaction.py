"""Benchmark: reaction time, from the window close that shows a regression to the flag flipped in Redis.

A real ``Daemon`` runs in a thread against Tansu + Redis (free ports) with 1 s windows, 0.2 s grace
and a one-rule policy that rolls a route back on its first failing window (``for: 1``). Healthy
background traffic (~100 events/s on two routes by default, ``--background-routes``) keeps event time moving, as in production. Each
trial sends a burst of failing FP8 events on a fresh route and measures, per trial:

* **close -> flip** (the target, <= 1 s p99): from the instant ``WindowAggregator.close_due``
  returned the tripping window's ``Signal`` (``time.time()`` in the daemon thread, recorded by a
  wrapper around ``close_due``) to the instant the route's hash changed in Redis: the ``changed_at``
  field the flip's Lua script writes from the Redis server's own ``TIME`` (same host, same clock).
  This covers policy evaluation, the actuator's Lua compare-and-set and the loop between them.
* **close -> pub/sub seen**: the same start to the flip notification arriving at a subscriber on
  the ``{prefix}:flags`` channel (a thread of this process): what a gateway cache would see.
* **daemon histograms**: ``llmwd_close_to_flip_seconds`` as the daemon observes it (from the loop
  iteration in which the watermark closed the window to the flip written) and
  ``llmwd_window_end_to_flip_seconds`` (from the window's nominal *end*, i.e. it also includes the grace
  period and the wait for event time to pass it).
* **first bad event -> flip** (context): from just before the first failing event was handed to
  the producer to ``changed_at``: produce, consume, the rest of the window, grace, close, flip.

    .venv/bin/python bench/reaction.py [--trials 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402
from common import MODEL, machine_note, median, percentile, services, table  # noqa: E402
from kafka import KafkaProducer  # noqa: E402
from prometheus_client import Histogram  # noqa: E402

from watchdog.config.settings import load_config  # noqa: E402
from watchdog.core.events import partition_key  # noqa: E402
from watchdog.core.keys import Keys  # noqa: E402
from watchdog.dev.traffic import Route, TrafficGenerator  # noqa: E402
from watchdog.runtime.daemon import Daemon  # noqa: E402
from watchdog.windows.aggregator import WindowAggregator  # noqa: E402

POLICY = """\
policies:
  - name: bench-reaction
    scope: {models: ["*"], routes: ["*"]}
    cooldown: 0s
    max_flips_per_day: 1000
    promote: {mode: manual}
    rules:
      - name: errors
        source: live
        metric: error_rate
        fail_if: "candidate > 0.5"
        min_samples: 10
        for: 1
        severity: critical
        action: rollback
"""

LENGTH_S = 1.0
GRACE_S = 0.2
BURST = 20

#: route -> time.time() when close_due returned that route's failing fp8 window
_signal_at: dict[str, float] = {}
_real_close_due = WindowAggregator.close_due


def _close_due_recording(self: WindowAggregator, now: float, limit: int | None = None) -> list[Any]:
    signals = _real_close_due(self, now, limit)
    t = time.time()
    for s in signals:
        if s.route.startswith("trial-") and s.precision == "fp8" and s.values.get("error_rate", 0.0) > 0.5:
            _signal_at.setdefault(s.route, t)
    return signals


class FlagWatcher(threading.Thread):
    """Subscribes to the flags channel; notes when each route's change notification arrived."""

    def __init__(self, url: str, channel: str) -> None:
        super().__init__(name="bench-flag-watcher", daemon=True)
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(channel)
        self.seen: dict[str, float] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            msg = self.pubsub.get_message(timeout=0.05)
            if msg and msg.get("type") == "message":
                t = time.time()
                try:
                    route = json.loads(msg["data"]).get("route")
                except (ValueError, AttributeError):
                    continue
                if route:
                    self.seen.setdefault(route, t)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)
        self.pubsub.close()
        self.client.close()


def bad_events(gen: TrafficGenerator, route: str, n: int) -> list[bytes]:
    r = Route(MODEL, route)
    out = []
    for _ in range(n):
        ev = gen.event(r)
        ev.update(precision="fp8", engine="trtllm-fp8", status="error", completion="", completion_logprobs=[])
        ev.pop("shadow", None)
        out.append(json.dumps(ev).encode())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--background-routes", type=int, default=2,
                    help="routes of healthy background traffic (each closes a window per second)")
    ap.add_argument("--background-rate", type=float, default=100.0, help="background events/s in total")
    ap.add_argument("--quick", action="store_true", help="20 trials, tighter spacing (< 60 s)")
    args = ap.parse_args()
    trials = 20 if args.quick else args.trials
    logging.basicConfig(level=logging.WARNING)
    WindowAggregator.close_due = _close_due_recording  # type: ignore[method-assign]
    rows: list[dict[str, float]] = []
    hists: dict[str, list[float]] = {}
    late = 0
    with services() as svc:
        topic = f"bench.reaction.{uuid.uuid4().hex[:8]}"
        prefix = f"bench{uuid.uuid4().hex[:6]}"
        policy = svc.workdir / "reaction.yaml"
        policy.write_text(POLICY)
        cfg = load_config(None, **{
            "policies": [str(policy)],
            "kafka": {"bootstrap_servers": svc.kafka_address, "topic": topic, "group_id": f"g-{topic}",
                      "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
            "redis": {"url": svc.redis_url, "prefix": prefix, "socket_timeout_s": 0.5},
            "windows": {"length_s": LENGTH_S, "grace_s": GRACE_S},
            "server": {"port": 0},
            "instance": "bench",
        })
        keys = Keys(prefix)
        watcher = FlagWatcher(svc.redis_url, keys.channel)
        watcher.start()
        client = redis.Redis.from_url(svc.redis_url, decode_responses=True)
        producer = KafkaProducer(bootstrap_servers=svc.kafka_address, linger_ms=5)
        n_bg = max(1, args.background_routes)
        background = TrafficGenerator([Route(MODEL, f"steady-{i:04d}", rate=args.background_rate / n_bg)
                                       for i in range(n_bg)])
        daemon = Daemon(cfg)
        thread = threading.Thread(target=daemon.run, name="bench-daemon", daemon=True)
        try:
            background.start(producer, topic)
            thread.start()
            # wait for the consumer group to form and the first windows to close
            deadline = time.monotonic() + 60
            while daemon.stats.windows_closed == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            if daemon.stats.windows_closed == 0:
                raise RuntimeError("the daemon closed no window in 60 s")
            gen = TrafficGenerator([], seed=3)
            rng = random.Random(5)
            for k in range(trials):
                route = f"trial-{k:03d}"
                # start somewhere inside a window, leaving room for the burst to land in it
                now = time.time()
                phase = rng.uniform(0.05, 0.6)
                time.sleep((phase - now % LENGTH_S) % LENGTH_S)
                first_bad = time.time()
                payload = bad_events(gen, route, BURST)  # stamped now
                for value in payload:
                    producer.send(topic, key=partition_key(MODEL, route), value=value)
                producer.flush()
                changed_at = None
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    raw = client.hget(keys.route(MODEL, route), "changed_at")
                    if raw:
                        changed_at = float(raw)
                        break
                    time.sleep(0.01)
                time.sleep(0.05)  # let the subscriber note the notification
                sig = _signal_at.get(route)
                if changed_at is None or sig is None:
                    print(f"  trial {k + 1:>2}: no flip seen (signal={sig}, changed_at={changed_at}, "
                          f"late events so far {int(daemon.metrics.dlq.labels('late')._value.get())})")
                    continue
                seen = watcher.seen.get(route)
                rows.append({"close_to_flip": changed_at - sig,
                             "close_to_pubsub": (seen - sig) if seen else float("nan"),
                             "first_bad_to_flip": changed_at - first_bad})
                print(f"  trial {k + 1:>2}: close->flip {1000 * (changed_at - sig):7.1f} ms   "
                      f"first bad event->flip {changed_at - first_bad:5.2f} s", flush=True)
                time.sleep(0.2 if args.quick else 0.5)
            hists = {"llmwd_close_to_flip_seconds (daemon's own: the watermark closed the window -> flip applied)":
                     _histogram(daemon.metrics.close_to_flip_seconds),
                     f"llmwd_window_end_to_flip_seconds (daemon's own: window end -> flip applied, so it includes the "
                     f"{GRACE_S:.1f} s grace)": _histogram(daemon.metrics.window_end_to_flip_seconds)}
            late = int(daemon.metrics.dlq.labels("late")._value.get())
        finally:
            background.stop()
            daemon.stop()
            thread.join(timeout=30)
            producer.close(timeout=5)
            watcher.stop()
            client.close()
            WindowAggregator.close_due = _real_close_due  # type: ignore[method-assign]

    if not rows:
        print("no trial produced a flip")
        return 1
    out = []
    for name, label in (("close_to_flip", "window close -> flag hash changed (Redis TIME)"),
                        ("close_to_pubsub", "window close -> pub/sub notification received"),
                        ("first_bad_to_flip", "first bad event produced -> flag hash changed")):
        xs = [r[name] for r in rows if r[name] == r[name]]
        out.append([label, len(xs), 1000 * median(xs), 1000 * percentile(xs, 99), 1000 * max(xs)])
    print()
    print(table(["measure", "trials", "p50 ms", "p99 ms", "max ms"], out))
    for what, hist in hists.items():
        print(f"\n{what}: count {int(hist[0])}, mean {1000 * hist[1] / max(hist[0], 1):.0f} ms, "
              f"p50 <= {1000 * hist[2]:.0f} ms, p99 <= {1000 * hist[3]:.0f} ms (bucket bounds)")
    p99 = percentile([r["close_to_flip"] for r in rows], 99)
    print(f"background: {args.background_routes} routes, {args.background_rate:.0f} events/s; "
          f"events dropped as late by the daemon: {late}")
    print(f"machine: {machine_note()}")
    print(f"close -> flip p99 = {1000 * p99:.1f} ms (target <= 1000 ms): {'PASS' if p99 <= 1.0 else 'MISS'}"
          f"; trials with a flip: {len(rows)}/{trials}")
    return 0


def _histogram(histogram: Histogram) -> list[float]:
    """(count, sum, p50 bucket bound, p99 bucket bound) of one of the daemon's histograms."""
    count = total = 0.0
    buckets: list[tuple[float, float]] = []
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
    buckets.sort()

    def bound(q: float) -> float:
        return next((le for le, c in buckets if c >= q * count), float("inf"))

    return [count, total, bound(0.5), bound(0.99)]


if __name__ == "__main__":
    raise SystemExit(main())
