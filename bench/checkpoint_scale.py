"""Checkpoint cost at scale: full against incremental saves at 100 / 1,000 / 10,000 routes.

One Redis on a free port; no broker. The daemon's own checkpoint path (``runtime.checkpointer.Checkpointer``,
``state.checkpoint.CheckpointStore`` and its Lua script, ``windows.WindowAggregator``, the policy engine
with policies/default.yaml) over ``--parts`` partitions claimed as the daemon claims them; only the
Kafka consumer and the actuator are stand-ins. Per route: fp8 and fp16 windows of ``--events`` ok events
each (latency, TTFT, tokens, 4 replicas, a build), ``--judged`` windows closed and judged first (so the
engine state is what a running daemon keeps), then one open window.

Measured, in one run, per size:

* **full on the loop**: every partition saved as a full snapshot, built, encoded and written on the
  calling thread (what every save cost before incremental state; what a forced save still does):
  payload bytes, loop time (the ``save`` calls) and wall time until Redis holds it;
* **full, writer thread**: the same snapshot as the loop saves it now (a first save, a ``RESYNC``):
  built on the loop, encoded and written by the writer thread;
* **steady**: ``--rounds`` saves while ``--active`` (1 %) of the routes take events and are judged
  between two saves: bytes, loop time per partition save (p50/p99), wall time until Redis has them;
* the Redis memory of the checkpoints (``MEMORY USAGE`` of the hashes and engine keys);
* **after a close**: every route's open window closed (what a window boundary does to a replica), then
  loop iterations as the daemon's: judge for up to ``DECIDE_BUDGET_S`` (0.3 s) in chunks of 100
  routes (``PolicyEngine.observe``, the judged routes marked dirty, as ``Decisions`` does), then
  ``Checkpointer.checkpoint``, then ~10 ms of poll, until every route is judged and every partition
  saved: the loop time of each checkpoint call (p99 / largest / sum), the calls and the wall time.

    .venv/bin/python bench/checkpoint_scale.py [--sizes 100,1000,10000] [--rounds 20]
    .venv/bin/python bench/checkpoint_scale.py --code /path/to/other/checkout      # the old code
    .venv/bin/python bench/checkpoint_scale.py --cluster   # a 3-master Redis Cluster, prefix {llmwd}

With ``--cluster`` the same saves go to a Redis Cluster of 3 masters (no replicas) under the hash-tag
prefix ``{llmwd}``; the keys and memory each master holds are printed after the table (one master
holds the deployment: docs/ROUTING.md, "Redis Cluster").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--sizes", default="100,1000,10000")
ap.add_argument("--parts", type=int, default=4)
ap.add_argument("--events", type=int, default=40, help="events per window and precision")
ap.add_argument("--judged", type=int, default=2, help="windows closed and judged per route before the saves")
ap.add_argument("--active", type=float, default=0.01, help="share of routes active between steady saves")
ap.add_argument("--rounds", type=int, default=20)
ap.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster, prefix {llmwd}")
ap.add_argument("--code", default=str(Path(__file__).resolve().parent.parent), help="checkout to import")
args = ap.parse_args()
sys.path.insert(0, args.code)  # the watchdog package measured
sys.path.append(str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, machine_note, table  # noqa: E402

from watchdog.config.settings import load_config  # noqa: E402
from watchdog.core.events import InferenceEvent, decode_event  # noqa: E402
from watchdog.core.keys import Keys  # noqa: E402
from watchdog.core.metrics import Metrics  # noqa: E402
from watchdog.dev.embedded import start_redis, start_redis_cluster  # noqa: E402
from watchdog.ingest.eventtime import Watermarks  # noqa: E402
from watchdog.policy import PolicyEngine  # noqa: E402
from watchdog.policy.loader import load_policy_files  # noqa: E402
from watchdog.runtime.checkpointer import Checkpointer  # noqa: E402
from watchdog.runtime.stats import DaemonStats  # noqa: E402
from watchdog.state import partitions as P  # noqa: E402
from watchdog.state.checkpoint import CheckpointStore  # noqa: E402

MODEL = "llama-scale"
TOPIC = "scale"
GROUP = "g-scale"
L = 10.0


class _Letters:
    def settled(self, pk: Any, timeout_s: float = 0.0) -> bool:
        return True


class _Ingest:
    """What the checkpointer asks of the Kafka side: offsets (kept per partition), no broker."""

    def __init__(self) -> None:
        self.next_offset: dict[P.PartitionKey, int] = {}
        self.dead_letters = _Letters()

    def position(self, pk: P.PartitionKey) -> int:
        return self.next_offset.get(pk, 0)

    def commit_mirror(self, offsets: dict[P.PartitionKey, int]) -> None:
        pass

    def set_final_offset(self, pk: P.PartitionKey, offset: int) -> None:
        pass


class _Actuator:
    def pending_routes(self) -> set[P.Route]:
        return set()


class _Health:
    ok = True

    def failed(self, exc: BaseException, what: str) -> None:
        raise RuntimeError(f"{what}: {exc}") from exc

    def recovered(self) -> None:
        pass


class _Ownership:
    def __init__(self, parts: dict[P.PartitionKey, P.Partition]) -> None:
        self.parts = parts
        self.topic_id = None

    def fence(self, pk: P.PartitionKey) -> None:
        raise RuntimeError(f"fenced on {pk}")


def event(route: str, precision: str, ts: float, i: int, rng: random.Random) -> InferenceEvent:
    return decode_event(json.dumps({
        "schema": 1, "request_id": f"{route}-{precision}-{ts:.3f}-{i}", "ts": ts, "model": MODEL, "route": route,
        "precision": precision, "status": "ok", "latency_ms": rng.lognormvariate(6.0, 0.4),
        "ttft_ms": rng.lognormvariate(4.5, 0.3), "prompt_tokens": rng.randint(50, 2000),
        "completion_tokens": rng.randint(10, 400), "replica": f"replica-{i % 4}", "build": "b1"}).encode())


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * len(xs) + 0.5)) - 1))]


def server_cpu(client: Any, key: str) -> float:
    """CPU seconds the Redis server holding ``key`` used so far (on a cluster: the master of its slot)."""
    server = client.get_redis_connection(client.get_node_from_key(key)) if args.cluster else client
    cpu = server.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def run_size(n_routes: int, url: str, prefix: str) -> dict[str, Any]:
    from watchdog.state.redis_conn import client_from_url

    rng = random.Random(n_routes)
    client = client_from_url(url, timeout_s=60, decode_responses=False)
    client.flushall()
    cfg = load_config(None, **{"policies": [str(ROOT / "policies" / "default.yaml")],
                               "kafka": {"topic": TOPIC, "group_id": GROUP}, "redis": {"url": url, "prefix": prefix},
                               "server": {"port": 0}, "instance": "scale"})
    keys = Keys(cfg.redis.prefix)
    store = CheckpointStore(client, keys, GROUP, TOPIC, "scale", cfg.redis.windows_maxlen)
    engine = PolicyEngine(load_policy_files([str(ROOT / "policies" / "default.yaml")]))
    wm = Watermarks(out_of_order_s=2.0, max_future_s=300.0)
    parts: dict[P.PartitionKey, P.Partition] = {}
    ingest = _Ingest()
    for p in range(args.parts):
        pk = (TOPIC, p)
        claim = store.claim(p)
        agg = P.WindowAggregator(length_s=L, grace_s=2.0, max_future_s=float("inf"))
        parts[pk] = P.Partition(pk, claim.token, claim.seq, agg, full=True)
        wm.assign(pk, None, 0.0)
        ingest.next_offset[pk] = 0
    ck = Checkpointer(cfg, keys, client, store, engine, wm, _Ownership(parts), _Actuator(),  # type: ignore[arg-type]
                      _Health(), Metrics(), DaemonStats())  # type: ignore[arg-type]
    ck.attach(ingest)  # type: ignore[arg-type]
    routes = [f"r-{i:06d}" for i in range(n_routes)]
    part_of = {r: (TOPIC, i % args.parts) for i, r in enumerate(routes)}
    t_base = 1_800_000_000.0

    def fold(rs: list[str], index: int, n: int) -> None:
        for r in rs:
            pk = part_of[r]
            part = parts[pk]
            for prec in ("fp8", "fp16"):
                for i in range(n):
                    ts = t_base + index * L + rng.uniform(0.0, L - 0.01)
                    off = ingest.next_offset[pk]
                    part.agg.add(event(r, prec, ts, i, rng), pk, off)
                    ingest.next_offset[pk] = off + 1
            part.routes.add((MODEL, r))
            part.dirty = True

    def close_and_judge(index: int) -> None:
        now = t_base + (index + 1) * L + 2.0
        flags = {(MODEL, r): "fp8" for r in routes}
        for part in parts.values():
            sigs = part.agg.close_due(now)
            if sigs:
                engine.observe(sigs, now, flags, "fp8")
                part.dirty_routes |= {(s.model, s.route) for s in sigs}
                part.dirty = True

    t0 = time.perf_counter()
    for index in range(args.judged):
        fold(routes, index, args.events)
        close_and_judge(index)
    current = args.judged
    fold(routes, current, args.events)
    fill_s = time.perf_counter() - t0

    offload = hasattr(ck, "writer")  # this checkout encodes and writes saves off the loop thread

    def save_all(force_full: bool, off: bool) -> tuple[int, list[float], float]:
        """Save every partition; (payload bytes, loop seconds per partition, wall seconds until Redis has all)."""
        if offload:
            ck.offload = off
        loop = []
        w0 = time.perf_counter()
        now = time.time()
        for part in parts.values():
            if force_full:
                part.full = True
            part.dirty = True
            s = time.perf_counter()
            done = ck.save(part, now, force=not off, mirror=False)
            loop.append(time.perf_counter() - s)
            assert done or off, "save refused"
        if off:
            ck.drain()
        wall = time.perf_counter() - w0
        for part in parts.values():
            assert part.inflight is None, "a save did not land"
        size = sum(int(ck.metrics.checkpoint_bytes.labels(str(pk[1]))._value.get()) for pk in parts)
        return size, loop, wall

    # the full save as it was before incremental state and the writer thread: built, encoded and
    # written on the loop thread (with --code of an older checkout: that code's save)
    full_bytes, full_loop, full_wall = save_all(True, False)
    out: dict[str, Any] = {}
    if offload:  # the same full snapshot (a first save, a RESYNC) with the writer thread
        _b, off_loop, off_wall = save_all(True, True)
        out.update(full_off_loop=off_loop, full_off_wall=off_wall)
    steady_bytes, steady_loop, steady_wall = [], [], []
    cpu0 = server_cpu(client, keys.audit)
    n_active = max(1, int(n_routes * args.active))
    for k in range(args.rounds):
        active = routes[(k * n_active) % n_routes:][:n_active]
        fold(active, current, max(1, args.events // 4))
        for r in active:  # judged since the last save: their engine state changed
            parts[part_of[r]].dirty_routes.add((MODEL, r))
        b, loop, wall = save_all(False, offload)
        steady_bytes.append(b)
        steady_loop.extend(loop)
        steady_wall.append(wall)
    steady_cpu = (server_cpu(client, keys.audit) - cpu0) / args.rounds
    # a window boundary: every route's window closes and is judged, then the loop's own calls
    if offload:
        ck.offload = True
    closing_at = t_base + (current + 1) * L + 2.0
    flags = {(MODEL, r): "fp8" for r in routes}
    to_judge = [(part, part.agg.close_due(closing_at)) for part in parts.values()]
    pending = [(part, [s for s in sigs if s.route == r]) for part, sigs in to_judge
               for r in sorted({s.route for s in sigs})]
    calls: list[float] = []
    c0 = time.perf_counter()
    while (pending or any(p.dirty or p.inflight is not None for p in parts.values())
           or (offload and ck.writer.any_busy())):
        until = time.perf_counter() + 0.3  # decisions.DECIDE_BUDGET_S
        while pending and time.perf_counter() < until:
            chunk, pending = pending[:100], pending[100:]  # decisions.DECIDE_CHUNK_ROUTES
            engine.observe([s for _p, sigs in chunk for s in sigs], closing_at, flags, "fp8")
            for part, sigs in chunk:
                part.dirty_routes.add((MODEL, sigs[0].route))
                part.dirty = True
        s = time.perf_counter()
        ck.checkpoint(time.time())
        calls.append(time.perf_counter() - s)
        if time.perf_counter() - c0 > 300:
            raise RuntimeError("the saves after a close did not finish in 300 s")
        time.sleep(0.01)  # the consumer's poll
    out.update(close_calls=calls, close_wall=time.perf_counter() - c0)
    mem = sum(client.memory_usage(k) or 0 for k in client.scan_iter(match=f"{cfg.redis.prefix}:ckpt:*"))
    mem += sum(client.memory_usage(k) or 0 for k in client.scan_iter(match=f"{cfg.redis.prefix}:engine:*",
                                                                        count=1000))
    per_node = {}
    if args.cluster:  # where the deployment's bytes live
        for node in client.get_primaries():
            r = client.get_redis_connection(node)
            per_node[node.port] = (r.dbsize(), r.info("memory")["used_memory"])
    client.close()
    return {**out, "routes": n_routes, "fill_s": fill_s, "full_bytes": full_bytes, "full_loop": full_loop,
            "full_wall": full_wall, "steady_bytes": statistics.median(steady_bytes), "steady_loop": steady_loop,
            "steady_wall": statistics.median(steady_wall), "redis_bytes": mem, "per_node": per_node,
            "steady_cpu": steady_cpu}


def main() -> int:
    import watchdog

    if args.cluster:
        nodes = start_redis_cluster(masters=3, replicas=0)
        url, prefix = "redis+cluster://" + ",".join(n.address for n in nodes), "{llmwd}"
    else:
        nodes = [start_redis(appendonly=False)]
        url, prefix = f"redis://127.0.0.1:{nodes[0].port}/0", "llmwd"
    try:
        results = [run_size(int(n), url, prefix) for n in args.sizes.split(",")]
    finally:
        for node in nodes:
            node.stop()
    rows = []
    for r in results:
        ms = lambda xs: f"{sum(xs) * 1e3:,.0f} / {max(xs) * 1e3:,.0f}"  # noqa: E731
        rows.append([
            f"{r['routes']:,}",
            f"{r['full_bytes'] / 1e6:.2f} MB",
            f"{ms(r['full_loop'])} / {r['full_wall'] * 1e3:,.0f}",
            f"{ms(r['full_off_loop'])} / {r['full_off_wall'] * 1e3:,.0f}" if "full_off_loop" in r else "-",
            f"{r['steady_bytes'] / 1e3:,.1f} kB",
            f"{100 * r['steady_bytes'] / r['full_bytes']:.2f} %",
            f"{pct(r['steady_loop'], 0.5) * 1e3:.1f} / {pct(r['steady_loop'], 0.99) * 1e3:.1f}",
            f"{r['steady_wall'] * 1e3:,.1f}",
            f"{r['redis_bytes'] / 1e6:.1f} MB",
            f"{r['steady_cpu'] * 1e3:.1f}",
            f"{pct(r['close_calls'], 0.99) * 1e3:,.0f} / {max(r['close_calls']) * 1e3:,.0f} / "
            f"{sum(r['close_calls']) * 1e3:,.0f}",
            f"{len(r['close_calls'])} / {r['close_wall'] * 1e3:,.0f}",
        ])
    print(f"\ncheckpoint scale: {args.parts} partitions, {args.events} events per window and precision, "
          f"{args.judged} windows judged, {args.active:.0%} active, {args.rounds} steady rounds; "
          f"code {Path(watchdog.__file__).parent}")
    print(table(["routes", "full bytes", "full on the loop: loop ms all / max part / wall ms",
                 "full, writer thread: loop ms all / max part / wall ms", "steady bytes", "steady / full",
                 "steady loop ms per part save p50 / p99", "steady wall ms", "Redis memory",
                 "Redis CPU ms per steady round",
                 "after a close: loop ms per checkpoint call p99 / max / sum", "calls / wall ms until all saved"],
                rows))
    for r in results:
        if r["per_node"]:
            print(f"{r['routes']:,} routes, per master (keys, used_memory): "
                  + ", ".join(f"{port}: {keys:,} keys, {mem / 1e6:.1f} MB" for port, (keys, mem)
                              in sorted(r["per_node"].items())))
    print(f"redis: {url}, prefix {prefix}")
    print(machine_note())
    return 0


if __name__ == "__main__":
    sys.exit(main())
