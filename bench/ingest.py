"""Benchmark: events/s through the daemon's full ingest pipeline vs raw consume + json.loads.

One Tansu broker and one Redis on free ports; one topic pre-produced with realistic ~600-byte
events (``watchdog.dev.traffic.TrafficGenerator``) with explicit timestamps spread over many 10 s
windows and ~50 routes. Each repetition then reads the whole topic with a fresh consumer group in
every mode, interleaved, and the timer runs from the first non-empty poll to the last event:

* ``raw``       kafka-python consume only (values untouched)
* ``json``      consume + ``json.loads`` of each value  (the **baseline**)
* ``decode``    consume + ``decode_event`` (orjson + validation)
* ``pipeline``  ``watchdog.runtime.daemon.Daemon.step()`` in a loop: consume -> decode/validate -> DLQ check
                -> ``WindowAggregator`` -> close windows -> ``PolicyEngine.observe`` (policies/default.yaml)
                -> actuator -> per-partition checkpoints in Redis (open windows, window records, engine
                state, offsets; ``checkpoint.lua``) -> outbox pager -> mirrored offset commits

Mixes: ``light`` (30 % of events shadowed, short completions) and ``heavy`` (every successful event
shadowed, logprobs on all, ~40-word completions; a quarter of the shadow pairs differ, as healthy FP8
does on a trained model, docs/DRIFT.md).

All consumers use the daemon's own ``make_consumer`` settings (max_poll_records 2000). The result
is the ratio pipeline / json per repetition, reported as the median of the repetitions.

    .venv/bin/python bench/ingest.py [--events 200000] [--routes 50] [--repeats 3] [--quick] [--mix heavy]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, machine_note, median, produce_events, services, table  # noqa: E402

from watchdog.config.settings import Config, KafkaConfig, load_config  # noqa: E402
from watchdog.core.events import decode_event, partition_key  # noqa: E402
from watchdog.ingest.consumer import REFILL_POLLS, make_consumer  # noqa: E402
from watchdog.runtime.daemon import Daemon  # noqa: E402

MODES = ("raw", "json", "decode", "pipeline")


def kafka_cfg(address: str, topic: str, group: str) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=address, topic=topic, group_id=group, session_timeout_ms=6000,
                       heartbeat_interval_ms=1000)


def consume(address: str, topic: str, n: int, mode: str, timeout_s: float) -> tuple[float, float]:
    """(wall, process CPU) seconds from the first non-empty poll to the n-th record, in a raw mode."""
    consumer = make_consumer(kafka_cfg(address, topic, f"bench-{mode}-{uuid.uuid4().hex[:8]}"))
    consumer.subscribe([topic])
    # json-drain: each poll takes every record the consumer has fetched (as the daemon's Ingest refills its
    # buffer), so that its next fetch travels while the records are worked through
    drain = REFILL_POLLS * consumer.config["max_poll_records"] if mode == "json-drain" else None
    loads = json.loads
    seen = 0
    t0 = None
    deadline = time.monotonic() + timeout_s
    try:
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: read {seen} of {n} events in {timeout_s:.0f} s")
            batches = consumer.poll(timeout_ms=200, max_records=drain)
            if not batches:
                continue
            if t0 is None:
                t0 = time.perf_counter()
                c0 = time.process_time()
            for records in batches.values():
                if mode in ("json", "json-drain"):
                    for rec in records:
                        loads(rec.value)
                elif mode == "decode":
                    for rec in records:
                        decode_event(rec.value)
                seen += len(records)
        assert t0 is not None
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        consumer.close(autocommit=False)


def daemon_config(address: str, topic: str, redis_url: str) -> Config:
    group = f"bench-pipeline-{uuid.uuid4().hex[:8]}"
    return load_config(None, **{
        "policies": [str(ROOT / "policies" / "default.yaml")],
        "kafka": kafka_cfg(address, topic, group).model_dump(),
        "redis": {"url": redis_url, "prefix": f"bench{uuid.uuid4().hex[:6]}"},
        "windows": {"length_s": 10.0, "grace_s": 2.0},
        "server": {"port": 0},
        "instance": "bench",
    })


def pipeline(address: str, topic: str, redis_url: str, n: int, timeout_s: float,
             profile: str | None = None) -> tuple[float, float, dict[str, Any]]:
    """(wall, process CPU) seconds for the daemon's main loop (``Daemon.step``) to take in ``n`` events."""
    daemon = Daemon(daemon_config(address, topic, redis_url))
    daemon.connect_kafka()
    assert daemon.ingest is not None
    ingest = daemon.ingest
    real_poll = ingest.poll
    state: dict[str, Any] = {"seen": 0, "t0": None, "c0": 0.0}

    def counted_poll(timeout_ms: int = 200) -> int:
        got = real_poll(timeout_ms)
        if got and state["t0"] is None:
            state["t0"] = time.perf_counter()
            state["c0"] = time.process_time()
        state["seen"] += got
        return got

    ingest.poll = counted_poll  # type: ignore[method-assign]
    # what Daemon.run() does right before its loop, in a daemon that has it
    freeze = getattr(daemon, "freeze_startup_heap", None)
    if freeze is not None:
        freeze()
    prof = None
    deadline = time.monotonic() + timeout_s
    try:
        while state["seen"] < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline: read {state['seen']} of {n} events in {timeout_s:.0f} s")
            if prof is None and profile and state["t0"] is not None:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            daemon.step()
        elapsed = time.perf_counter() - state["t0"]
        cpu = time.process_time() - state["c0"]
        if prof is not None:
            prof.disable()
            prof.dump_stats(profile)  # type: ignore[arg-type]
        ckpt = daemon.metrics.checkpoint_seconds
        info = {"windows_closed": daemon.stats.windows_closed, "actions": daemon.stats.actions,
                "folded": sum(p.agg.folded for p in daemon.parts.values()),
                "late": daemon.metrics.dlq.labels("late")._value.get(), "checkpoints": daemon.stats.checkpoints,
                "checkpoint_ms_mean": round(1000 * ckpt._sum.get() / max(1, daemon.stats.checkpoints), 3)}
        return elapsed, cpu, info
    finally:
        daemon.stop()
        daemon.shutdown()
        if freeze is not None:
            gc.unfreeze()  # the other modes run in this process too


_WORDS = ["the", "model", "returns", "a", "short", "answer", "about", "contracts", "invoices", "shipping", "refunds", "policy", "customer", "account", "balance", "order", "status", "delivery", "window", "terms", "payment", "schedule", "renewal", "notice", "clause"]


def heavy_event(gen: Any, r: Any, ts: float, rng: Any) -> dict[str, Any]:
    """A ``TrafficGenerator`` event made heavy: ~40-word completion, shadow on every success, logprobs on
    both; a quarter of the shadows differ by a few words."""
    ev = gen.event(r, now=ts)
    if ev["status"] != "ok":
        return ev
    words = [rng.choice(_WORDS) for _ in range(40)]
    text = " ".join(words)
    shadow = words[:]
    if rng.random() < 0.25:
        for _ in range(3):
            shadow[rng.randrange(40)] = rng.choice(_WORDS)
    lp = [round(min(0.0, rng.gauss(-0.25, 0.2)), 4) for _ in range(42)]
    ev.update(completion=text, completion_tokens=42, completion_logprobs=lp)
    ev["shadow"] = {"precision": "fp16" if ev["precision"] == "fp8" else "fp8", "completion": " ".join(shadow),
                    "completion_logprobs": lp, "latency_ms": ev["latency_ms"]}
    return ev


def produce_heavy(address: str, topic: str, n_events: int, n_routes: int, *, events_per_s: float, end_ts: float,
                  partitions: int = 1, seed: int = 11) -> tuple[int, float]:
    import random

    import orjson
    from common import MODEL, create_topic, route_names
    from kafka import KafkaProducer

    from watchdog.dev.traffic import Route, TrafficGenerator

    create_topic(address, topic, partitions)
    gen = TrafficGenerator([Route(MODEL, r) for r in route_names(n_routes)], seed=seed)
    rng = random.Random(seed)
    producer = KafkaProducer(bootstrap_servers=address, linger_ms=20, batch_size=256 * 1024)
    start_ts = end_ts - n_events / events_per_s
    total = 0
    t0 = time.perf_counter()
    try:
        for i in range(n_events):
            r = gen.routes[rng.randrange(n_routes)]
            value = orjson.dumps(heavy_event(gen, r, round(start_ts + i / events_per_s, 3), rng))
            total += len(value)
            producer.send(topic, key=partition_key(r.model, r.route), value=value)
        producer.flush(timeout=120)
    finally:
        producer.close(timeout=10)
    return total, time.perf_counter() - t0


def checkpoint_cost(redis_url: str, routes: int = 1000, events_per_window: int = 200, repeats: int = 10) -> dict[str, float]:
    """Bytes and ms of one partition checkpoint holding ``routes`` routes x 2 precisions of open windows
    (heavy-mix events, ``events_per_window`` each) and their policy-engine state, saved with the
    daemon's own code (``partitions.checkpoint_blob`` + ``CheckpointStore.save``, ``checkpoint.lua``)."""
    import random

    import orjson
    import redis

    from watchdog.core.events import decode_event
    from watchdog.core.keys import Keys
    from watchdog.core.signals import Signal
    from watchdog.dev.traffic import Route, TrafficGenerator
    from watchdog.policy import PolicyEngine, PolicyLoader
    from watchdog.state import partitions as P
    from watchdog.state.checkpoint import CheckpointStore, PendingSave
    from watchdog.windows.aggregator import WindowAggregator

    client = redis.Redis.from_url(redis_url)
    keys = Keys(f"ck{uuid.uuid4().hex[:6]}")
    store = CheckpointStore(client, keys, "bench", "t", "bench")
    claim = store.claim(0)
    agg = WindowAggregator(length_s=10.0)
    gen = TrafficGenerator([Route("m", f"route-{i}") for i in range(routes)], seed=3)
    rng = random.Random(3)
    now = time.time()
    now = (now // 10) * 10 + 1  # every event inside one 10 s window
    for r in gen.routes:
        for j in range(events_per_window):
            agg.add(decode_event(orjson.dumps(heavy_event(gen, r, now + j * 0.001, rng))), ("t", 0), j)
    engine = PolicyEngine(PolicyLoader([str(ROOT / "policies" / "default.yaml")]).policy_set)
    sigs = [Signal("live", "m", r.route, p, now - 10, now, 200, {"error_rate": 0.01, "latency_p99_ms": 500.0})
            for r in gen.routes for p in ("fp8", "fp16")]
    engine.observe(sigs, now, {}, "fp8")
    part = P.Partition(("t", 0), claim.token, claim.seq, agg, routes={("m", r.route) for r in gen.routes})
    by_route = P.engine_states_by_route(engine)
    out: dict[str, Any] = {"routes": routes, "open_windows": agg.open_windows()}
    seq = claim.seq
    # steady state: every window got events since the last save (worst case), and the engine state of
    # a tenth of the routes changed (10 s windows close once per 10 s per route)
    for label, full, engine_share in (("full snapshot", True, 1.0), ("steady 1 s", False, 0.1)):
        sizes, ms = [], []
        for i in range(repeats):
            for key in list(agg._open):
                agg._open[key].dirty = True
            t0 = time.perf_counter()
            blob = P.checkpoint_blob(part, 123456, now, "bench", now)
            changed, closed = agg.export_changes(everything=full)
            chosen = sorted(part.routes)[: int(len(part.routes) * engine_share)]
            engines = {keys.engine("bench", m, r): P.engine_json(by_route[(m, r)]) for m, r in chosen
                       if (m, r) in by_route}
            seq += 1
            save = PendingSave(seq, blob, [], [], engines, changed, closed, incremental=not full or i > 0)
            assert store.save(0, claim.token, save) == "saved"
            ms.append(1000 * (time.perf_counter() - t0))
            sizes.append(save.size)
        out[label] = {"bytes": median(sizes), "ms_median": round(median(ms), 1), "ms_max": round(max(ms), 1)}
    client.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--routes", type=int, default=50)
    ap.add_argument("--windows", type=int, default=20, help="10 s windows the event timestamps span")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--partitions", type=int, default=1,
                    help="topic partitions (events keyed by route); with more than one, a backlog is read "
                         "partition by partition and the daemon's event-time closing matters")
    ap.add_argument("--modes", default=None, help=f"comma list of {','.join(MODES)} (default: all)")
    ap.add_argument("--profile", help="write a cProfile of the first pipeline run to this file")
    ap.add_argument("--quick", action="store_true", help="40k events, 3 repeats, json+pipeline only (< 60 s)")
    ap.add_argument("--mix", choices=("light", "heavy"), default="light")
    ap.add_argument("--checkpoint-cost", type=int, metavar="ROUTES",
                    help="only measure one partition checkpoint holding ROUTES routes (e.g. 1000)")
    args = ap.parse_args()
    if args.quick:
        args.events, args.windows = 40_000, 8
    modes = [m for m in (args.modes or ("json,pipeline" if args.quick else ",".join(MODES))).split(",") if m]
    logging.basicConfig(level=logging.WARNING)
    try:
        import crc32c  # noqa: F401
    except ImportError:
        print("WARNING: crc32c is not installed: kafka-python checks CRCs in pure Python (~10x slower)")

    if args.checkpoint_cost:
        with services() as svc:
            print(checkpoint_cost(svc.redis_url, args.checkpoint_cost))
        print(f"machine: {machine_note()}")
        return 0
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    info: dict[str, Any] = {}
    with services() as svc:
        topic = f"bench.ingest.{uuid.uuid4().hex[:8]}"
        span_s = args.windows * 10.0
        if args.mix == "heavy":
            nbytes, prod_s = produce_heavy(svc.kafka_address, topic, args.events, args.routes,
                                           events_per_s=args.events / span_s, end_ts=time.time() - 3.0,
                                           partitions=args.partitions)
        else:
            nbytes, prod_s = produce_events(svc.kafka_address, topic, args.events, args.routes,
                                            events_per_s=args.events / span_s, end_ts=time.time() - 3.0,
                                            partitions=args.partitions)
        print(f"mix {args.mix}: produced {args.events:,} events ({nbytes / args.events:.0f} B avg) over {args.routes} routes, "
              f"{args.windows} windows, {args.partitions} partition(s), in {prod_s:.1f} s")
        timeout = max(60.0, args.events / 2000.0)
        for rep in range(args.repeats):
            for mode in modes:
                if mode == "pipeline":
                    t, cpu, info = pipeline(svc.kafka_address, topic, svc.redis_url, args.events, timeout,
                                            args.profile if rep == 0 else None)
                else:
                    t, cpu = consume(svc.kafka_address, topic, args.events, mode, timeout)
                times[mode].append(t)
                cpus[mode].append(cpu)
                print(f"  rep {rep + 1} {mode:<9} {args.events / t:>10,.0f} ev/s  "
                      f"{1e6 * cpu / args.events:6.1f} us CPU/event", flush=True)

    base = times.get("json")
    rows = []
    for mode in modes:
        rates = [args.events / t for t in times[mode]]
        ratios = [b / t for b, t in zip(base, times[mode], strict=True)] if base else []
        cpu_us = [1e6 * c / args.events for c in cpus[mode]]
        cpu_ratio = [c / b for c, b in zip(cpus[mode], cpus["json"], strict=True)] if base else []
        rows.append([mode, median(rates), min(rates), max(rates), median(ratios) if ratios else float("nan"),
                     median(cpu_us), median(cpu_ratio) if cpu_ratio else float("nan")])
    print()
    print(table(["mode", "median ev/s", "min ev/s", "max ev/s", "rate ratio vs json", "CPU us/event",
                 "CPU vs json"], rows))
    print("(ratios: median over repetitions of the per-repetition ratio; CPU: this process, all threads)")
    print(f"\npipeline: {info}")
    print(f"machine: {machine_note()}")
    if "pipeline" in times and base:
        ratio = median([b / t for b, t in zip(base, times["pipeline"], strict=True)])
        print(f"pipeline / (consume + json.loads) = {ratio:.2f} (target >= 0.8): {'PASS' if ratio >= 0.8 else 'MISS'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
