"""The daemon's GC-tracked containers by type and by owner, counted inside the daemon process.

``bench/gc_trace.py`` calls ``install_from_env``: with ``HEAP_CENSUS=OUT:DELAY`` in the environment (``%p`` in OUT: the pid) a
signal handler DELAY seconds after the start unfreezes the heap, counts ``gc.get_objects()`` by type, tuples by
shape, and for samples of the largest populations the object that refers to them (``Owner.attr`` for a
slot or instance attribute, ``dict[key]`` for a dict entry), times one full ``gc.collect()`` of the whole
heap and freezes it again. The report goes to OUT. The daemon stalls for the census (seconds).

    HEAP_CENSUS=/tmp/census.txt:70 .venv/bin/python bench/growth.py --routes 10000 --seconds 20 --warmup 60
    HEAP_CENSUS=/tmp/census.txt:60,180 ...   # two censuses, to /tmp/census.txt.0 and .1: what grows between

``HEAP_TRACEMALLOC=N`` as well starts ``tracemalloc`` (N frames) when the daemon starts: each census then
adds the bytes still held by allocation site (every object, not only containers: floats, strings, arrays),
the largest sites first. Tracing slows allocation; compare sites, not the run's timings.
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
import tracemalloc
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


def bytes_by_owner(objs: list[Any], out: list[str], top: int = 25) -> None:
    """Bytes of each tracked container plus the untracked objects it alone refers to (strings, floats,
    ints, bytes: what tracemalloc would charge it, without tracing), summed by the container's type and,
    for dicts and lists, by the type of the object holding them (``Owner.attr``)."""
    refs: collections.Counter[int] = collections.Counter()
    for o in objs:
        for r in gc.get_referents(o):
            if not gc.is_tracked(r):
                refs[id(r)] += 1
    size: collections.Counter[str] = collections.Counter()
    own: dict[int, str] = {}
    for o in objs:
        if type(o) in (dict, list, tuple):
            continue
        for r in gc.get_referents(o):
            if type(r) in (dict, list, tuple):
                own[id(r)] = f"{_name(o)}{_slot_of(o, r)}"
    for o in objs:
        n = sys.getsizeof(o)
        for r in gc.get_referents(o):
            if not gc.is_tracked(r) and refs[id(r)] == 1 and type(r) not in (type, type(None), bool):
                n += sys.getsizeof(r)
        size[own.get(id(o), _name(o))] += n
    out.append(f"bytes by owner (container + untracked objects only it refers to): {sum(size.values()) / 2**20:,.1f} MiB")
    for name, n in size.most_common(top):
        out.append(f"  {n / 2**20:8.2f} MiB  {name}")


def held_encodings(objs: list[Any], out: list[str]) -> None:
    """Checkpoint text held between saves: open windows encoded ahead (``WindowAggregator._ahead``),
    engine states encoded ahead (``Checkpointer._encoded``) and saves built but not yet answered."""
    ahead = engines = pending = 0
    for o in objs:
        name = type(o).__name__
        if name == "WindowAggregator":
            ahead += sum(len(v) for v in getattr(o, "_ahead", {}).values() if isinstance(v, str))
        elif name == "Checkpointer":
            for entry in getattr(o, "_encoded", {}).values():
                engines += sum(len(v) for v in entry[2].values() if isinstance(v, str))
        elif name == "PendingSave":
            pending += o.size
    out.append(f"checkpoint text held: windows encoded ahead {ahead / 2**20:.1f} MiB, engine states encoded ahead "
               f"{engines / 2**20:.1f} MiB, saves built and not answered {pending / 2**20:.1f} MiB")


def run(path: str) -> None:
    t0 = time.perf_counter()
    gc.unfreeze()
    objs = gc.get_objects()
    lines: list[str] = []
    for name in filter(None, os.environ.get("HEAP_CHAINS", "").split(",")):
        lines += referrer_chains(objs, name)
    frames = collections.Counter(f"{o.f_code.co_name} ({o.f_code.co_filename.rsplit('/', 2)[-2:]})"
                                 for o in objs if type(o).__name__ == "frame")
    errors = collections.Counter(_name(o) for o in objs if issubclass(type(o), BaseException))
    lines.append("frames by code: " + ", ".join(f"{k} {v:,}" for k, v in frames.most_common(10)))
    lines.append("exceptions by type: " + ", ".join(f"{k} {v:,}" for k, v in errors.most_common(10)))
    census(objs, lines, path)
    bytes_by_owner(objs, lines)
    held_encodings(objs, lines)
    n = len(objs)
    before = collections.Counter(_name(o) for o in objs)
    del objs
    lines.append(f"census took {time.perf_counter() - t0:.1f} s")
    rss = _rss_mb()
    for i in range(2):
        t = time.perf_counter()
        got = gc.collect()
        lines.append(f"gc.collect() of the whole unfrozen heap ({n:,} objects): {time.perf_counter() - t:.3f} s, "
                     f"{got} collected")
        if i == 0:  # what the first pass freed, by type: cyclic garbage that lived until a full pass
            freed = before - collections.Counter(_name(o) for o in gc.get_objects())
            lines.append(f"  RSS {rss:.1f} -> {_rss_mb():.1f} MB; freed by type: "
                         + ", ".join(f"{k} {v:,}" for k, v in freed.most_common(12)))
    gc.freeze()
    if tracemalloc.is_tracing():
        lines += held_by_site()
    lines += allocator_lines()
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def referrer_chains(objs: list[Any], type_name: str, samples: int = 4, depth: int = 5) -> list[str]:
    """For a few objects of the type named ``type_name``, who holds them: the chain of first referrers
    (``HEAP_CHAINS=PartitionData,Future``), to find what keeps a population alive."""
    picked = [o for o in objs if type(o).__name__ == type_name]
    out = [f"referrer chains of {type_name} ({len(picked):,}):"]
    chosen = random.Random(1).sample(picked, min(samples, len(picked)))
    skip = {id(objs), id(picked), id(chosen)}
    for o in chosen:
        chain, cur = [_name(o)], o
        for _ in range(depth):
            here = sys._getframe()
            refs = [r for r in gc.get_referrers(cur) if id(r) not in skip and r is not here]
            if not refs:
                chain.append("(none)")
                break
            cur = refs[0]
            chain.append(f"{_name(cur)}{_slot_of(cur, o) if len(chain) == 1 else ''}")
        out.append("  " + " <- ".join(chain))
    return out


def _rss_mb() -> float:
    # not bench/memory.py's rss_mb: importing that module would bring httpx and the traffic generator into the
    # daemon whose heap is being counted
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


def allocator_lines() -> list[str]:
    """RSS, glibc malloc's own count (``mallinfo2``: bytes in use and free in its heaps, bytes in its mmapped
    chunks) and what ``malloc_trim(0)`` hands back: the free memory glibc keeps inside its heaps. (CPython's
    small-object arenas are mmapped by CPython itself, outside these counts.)"""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return [f"VmRSS {_rss_mb():.1f} MB (no glibc mallinfo2 here)"]
    mi = libc.mallinfo2()
    mb = 2**20
    out = [f"malloc heaps {mi.arena / mb:.1f} MiB (in use {mi.uordblks / mb:.1f}, free {mi.fordblks / mb:.1f}), "
           f"mmapped chunks {mi.hblkhd / mb:.1f} MiB in {mi.hblks}; pymalloc blocks {sys.getallocatedblocks():,}"]
    before = _rss_mb()
    libc.malloc_trim(0)
    out.append(f"VmRSS {before:.1f} MB, after malloc_trim(0) {_rss_mb():.1f} MB")
    return out


def held_by_site(top: int = 40) -> list[str]:
    """Bytes held now by allocation site (tracemalloc), grouped by the innermost frames it keeps."""
    frames = tracemalloc.get_traceback_limit()
    stats = tracemalloc.take_snapshot().statistics("traceback" if frames > 1 else "lineno")
    total = sum(s.size for s in stats)
    out = [f"traced bytes held: {total / 2**20:,.1f} MiB in {sum(s.count for s in stats):,} blocks; largest sites:"]
    for st in stats[:top]:
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in st.traceback)
        out.append(f"  {st.size / 2**20:8.2f} MiB  {st.count:>9,}  {where}")
    return out


def _when_not_collecting(fn: Any) -> None:
    """Run ``fn`` now, or a little later when the signal came inside a collector callback: a collection
    is under way there and ``gc.collect()`` would return 0 at once."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith(("gc_trace.py", "collector.py")) and f.f_code.co_name in ("trace", "__call__"):
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            return
        f = f.f_back
    fn()


def install_from_env() -> None:
    frames = int(os.environ.get("HEAP_TRACEMALLOC") or 0)
    if frames > 0:
        tracemalloc.start(frames)
    spec = os.environ.get("HEAP_CENSUS")
    if spec:
        path, delays = spec.rsplit(":", 1)
        path = path.replace("%p", str(os.getpid()))  # one file per daemon of an A/B
        # several delays (comma-separated): one census each, the n-th to OUT.n (what grows between them)
        times = [float(d) for d in delays.split(",")]
        outs = [path] if len(times) == 1 else [f"{path}.{i}" for i in range(len(times))]
        nth = iter(outs)
        # on the main thread (a signal handler), so the daemon's loop stands still while it counts
        signal.signal(signal.SIGUSR1, lambda *_: _when_not_collecting(lambda: run(next(nth))))
        for t in times:
            threading.Timer(t, os.kill, (os.getpid(), signal.SIGUSR1)).start()
