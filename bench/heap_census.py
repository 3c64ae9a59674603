"""The daemon's GC-tracked containers by type and by owner, counted inside the daemon process.

``bench/gc_trace.py`` calls ``install_from_env``: with ``HEAP_CENSUS=OUT:DELAY`` in the environment (``%p`` in OUT: the pid) a
signal handler DELAY seconds after the start unfreezes the heap, counts ``gc.get_objects()`` by type, tuples by
shape, and for samples of the largest populations the object that refers to them (``Owner.attr`` for a
slot or instance attribute, ``dict[key]`` for a dict entry), times one full ``gc.collect()`` of the whole
heap and freezes it again. The report goes to OUT. The daemon stalls for the census (seconds).

    HEAP_CENSUS=/tmp/census.txt:70 .venv/bin/python bench/growth.py --routes 10000 --seconds 20 --warmup 60
    HEAP_CENSUS=/tmp/census.txt:60,180 ...   # two censuses, to /tmp/census.txt.0 and .1: what grows between
"""

from __future__ import annotations

import collections
import gc
import os
import random
import signal
import sys
import threading
import time
from typing import Any

SAMPLE = 3000


def _name(o: Any) -> str:
    t = type(o)
    mod = getattr(t, "__module__", "?")
    mod = mod.rsplit(".", 1)[-1] if isinstance(mod, str) else "?"
    return t.__qualname__ if mod == "builtins" else f"{mod}.{t.__qualname__}"


def _slot_of(owner: Any, child: Any) -> str:
    """Where ``owner`` holds ``child``: an attribute, a dict key, an index."""
    if isinstance(owner, dict):
        for k, v in owner.items():
            if v is child:  # the key when the dict is a record, its type when it is a table
                return f"[{k!r}]"[:40] if isinstance(k, str) and len(owner) <= 24 else f"[{type(k).__name__}]"
            if k is child:
                return "<key>"
        return ""
    if isinstance(owner, (list, tuple)):
        return "[i]"
    for cls in type(owner).__mro__:
        for s in cls.__dict__.get("__slots__", ()):
            if getattr(owner, s, None) is child:
                return f".{s}"
    d = getattr(owner, "__dict__", None)
    if isinstance(d, dict):
        for k, v in d.items():
            if v is child:
                return f".{k}"
    return ""


def census(objs: list[Any], out: list[str], path: str) -> None:
    names = [_name(o) for o in objs]
    by_type = collections.Counter(names)
    out.append(f"tracked containers: {len(objs):,}  allocated blocks: {sys.getallocatedblocks():,}")
    for name, n in by_type.most_common(40):
        out.append(f"  {n:>10,}  {name}")
    shapes = collections.Counter(
        (len(o), tuple(type(x).__name__ for x in o[:6])) for o in objs if type(o) is tuple)
    out.append("tuples by (len, element types):")
    for shape, n in shapes.most_common(15):
        out.append(f"  {n:>10,}  {shape}")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    # owners of samples of the largest populations
    top = [name for name, _ in by_type.most_common(12)]
    pops: dict[str, list[Any]] = {name: [] for name in top}
    for o, name in zip(objs, names, strict=True):
        if name in pops:
            pops[name].append(o)
    samples: dict[int, str] = {}
    for name, pop in pops.items():
        for o in random.sample(pop, min(SAMPLE, len(pop))):
            samples[id(o)] = name
    del pops
    owners: dict[int, list[Any]] = {}
    for o in objs:
        for r in gc.get_referents(o):
            if id(r) in samples and id(r) not in owners:
                owners[id(r)] = [o, r]
    # one more level for children of plain dicts and lists (whose owner names little)
    grand_ids = {id(o): None for o, _ in owners.values() if type(o) in (dict, list, tuple)}
    grand: dict[int, Any] = {}
    for o in objs:
        for r in gc.get_referents(o):
            if id(r) in grand_ids and id(r) not in grand:
                grand[id(r)] = o
    per: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for cid, name in samples.items():
        if cid not in owners:
            per[name]["<no owner found: frame/C/root>"] += 1
            continue
        o, r = owners[cid]
        where = f"{_name(o)}{_slot_of(o, r)}"
        g = grand.get(id(o))
        if g is not None:
            where = f"{_name(g)}{_slot_of(g, o)} -> {where}"
        per[name][where] += 1
    for name in top:
        total = by_type[name]
        n = sum(per[name].values())
        out.append(f"{name} ({total:,}): owners of {n} sampled")
        for where, k in per[name].most_common(10):
            out.append(f"  {k / n:6.1%}  ~{round(total * k / n):>9,}  {where}")


def run(path: str) -> None:
    t0 = time.perf_counter()
    gc.unfreeze()
    objs = gc.get_objects()
    lines: list[str] = []
    census(objs, lines, path)
    n = len(objs)
    del objs
    lines.append(f"census took {time.perf_counter() - t0:.1f} s")
    for _ in range(2):
        t = time.perf_counter()
        got = gc.collect()
        lines.append(f"gc.collect() of the whole unfrozen heap ({n:,} objects): {time.perf_counter() - t:.3f} s, "
                     f"{got} collected")
    gc.freeze()
    with open("/proc/self/status") as f:
        lines += [ln.strip() for ln in f if ln.startswith(("VmRSS", "VmHWM"))]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def install_from_env() -> None:
    spec = os.environ.get("HEAP_CENSUS")
    if spec:
        path, delays = spec.rsplit(":", 1)
        path = path.replace("%p", str(os.getpid()))  # one file per daemon of an A/B
        # several delays (comma-separated): one census each, the n-th to OUT.n (what grows between them)
        times = [float(d) for d in delays.split(",")]
        outs = [path] if len(times) == 1 else [f"{path}.{i}" for i in range(len(times))]
        nth = iter(outs)
        # on the main thread (a signal handler), so the daemon's loop stands still while it counts
        signal.signal(signal.SIGUSR1, lambda *_: run(next(nth)))
        for t in times:
            threading.Timer(t, os.kill, (os.getpid(), signal.SIGUSR1)).start()
