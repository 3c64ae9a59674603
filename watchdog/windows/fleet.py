"""What one window keeps about the fleet behind its requests: the request mix, the replicas, the builds.

Three bounded additions to a window's running sums (docs/EVENTS.md, "Request mix, replicas, builds"):

* **mix cells**: ok requests grouped by (octave of prompt tokens, octave of completion tokens)
  (``int.bit_length``: 0, 1, 2-3, 4-7, ... tokens), each cell ``[n, sum y, sum y^2]`` of the log
  latency ``y = ln(latency_ms)``. The judge compares FP8 with FP16 *within* cells (like with like),
  so a router that sends one precision more long prompts does not look like a slowdown. At most
  31 x 31 cells (token counts are capped at 1e9); a few dozen in practice.
* **mix tails**: per mix cell (window level only, not per replica) a coarse histogram of the log latency
  (buckets ``TAIL_WIDTH`` = 0.05 log units wide, at most ``MAX_TAIL_BUCKETS`` per cell, the lowest
  folded together beyond that), so the judge can compare the latency tail's *shape* net of the request
  mix (``judge/fleet.py`` ``mix_tail_contrast``). Bounded: cells x ``MAX_TAIL_BUCKETS``.
* **replicas**: per serving instance (``replica``, else ``gpu_uuid``) its own latency sketch and mix
  cells, so the judge can leave out one replica whose requests alone drive the window's statistic
  (a GC or allocator stall). At most ``MAX_REPLICAS`` named per window; later ones share ``_other``;
  requests without an id are ``_none`` (``_other`` once the table is full). Failed requests (errors,
  timeouts) are counted per replica too (``fails``), so a rate rule can leave out a replica that failed
  on its own (a crash, an out-of-memory restart; ``Rule.replica_failures``).
* **builds**: events per ``build`` (at most ``MAX_BUILDS`` named; later ones share ``_other``): a change
  of build between windows is a deploy (watchdog/policy/changes.py).

Latencies of 0 ms have no log and are left out of the cells (they stay in the sketches).
"""

from __future__ import annotations

import base64
import math
import struct
import sys
from array import array
from collections import Counter
from typing import Any

from watchdog.windows.sketch import QuantileSketch

__all__ = ["MAX_BUILDS", "MAX_REPLICAS", "MAX_TAIL_BUCKETS", "NO_REPLICA", "OTHER", "TAIL_WIDTH", "FleetStats",
           "cell_list", "merge_cells", "tail_list"]

#: most replicas tracked per (route, precision, window); more share the ``_other`` entry
MAX_REPLICAS = 32
#: most builds counted per window; more share ``_other``
MAX_BUILDS = 8
OTHER = "_other"
#: requests whose event names no replica
NO_REPLICA = "_none"
#: width (log units) of a mix cell's tail histogram bucket: bucket ``k`` holds ``(k - 1) w < y <= k w``
TAIL_WIDTH = 0.05
#: most buckets of one cell's tail histogram; beyond, the lowest are folded into the lowest kept one
MAX_TAIL_BUCKETS = 64
_INV_TAIL_WIDTH = 1.0 / TAIL_WIDTH
_log = math.log
_ceil = math.ceil

#: a mix cell: [n, sum of ln latency, sum of squares]
Cells = dict[int, list[float]]


def cell_list(cells: Cells) -> list[list[float]]:
    """Cells as ``[[prompt octave, completion octave, n, sum y, sum y^2], ...]``, sorted."""
    return [[k >> 6, k & 63, *v] for k, v in sorted(cells.items())]


#: a cell's tail histogram: bucket ``ceil(y / TAIL_WIDTH)`` -> count
Tails = dict[int, dict[int, int]]


def tail_list(tails: Tails) -> list[list[Any]]:
    """Tail histograms as ``[[prompt octave, completion octave, [[bucket, count], ...]], ...]``, sorted."""
    return [[k >> 6, k & 63, [[b, c] for b, c in sorted(h.items())]] for k, h in sorted(tails.items())]


def _fold_tail(h: dict[int, int]) -> None:
    """Fold the lowest buckets of one cell's tail histogram so at most ``MAX_TAIL_BUCKETS`` remain."""
    keys = sorted(h)
    excess = len(keys) - MAX_TAIL_BUCKETS
    if excess > 0:
        h[keys[excess]] += sum(h.pop(k) for k in keys[:excess])


def pack_tails(tails: Tails) -> str:
    """Tail histograms in a checkpoint: a type code (``t``: the narrowest unsigned ``array`` type of the
    counts, B/H/I/Q) + base64 of, little-endian, the number of cells (uint16), the cell keys (uint16,
    sorted), their bucket counts m (uint16), every cell's bucket indices in order (int16: |index| < 2^15
    for any finite log latency) and their counts (``t``). Exact; ~3 bytes per bucket on a busy window."""
    if not tails:
        return ""
    ks = sorted(tails)
    head = array("H", [len(ks), *ks, *(len(tails[k]) for k in ks)])
    bs = [b for k in ks for b in sorted(tails[k])]
    idx = array("h", bs)
    cs = [tails[k][b] for k in ks for b in sorted(tails[k])]
    hi = max(cs, default=0)
    t = "B" if hi < 0x100 else "H" if hi < 0x10000 else "I" if hi < 0x100000000 else "Q"
    counts = array(t, cs)
    if sys.byteorder != "little":
        for a in (head, idx, counts):
            a.byteswap()
    return t + base64.b64encode(head.tobytes() + idx.tobytes() + counts.tobytes()).decode("ascii")


def unpack_tails(data: Any) -> Tails:
    """``pack_tails``'s histograms (an empty dict for ``None`` or "": checkpoints written before them)."""
    if not isinstance(data, str) or not data:
        return {}
    t, raw = data[0], base64.b64decode(data[1:])
    first = array("H")
    first.frombytes(raw[:2])
    if sys.byteorder != "little":
        first.byteswap()
    n = first[0]
    head = array("H")
    head.frombytes(raw[2:2 + 4 * n])
    idx, counts = array("h"), array(t)
    if sys.byteorder != "little":
        head.byteswap()
    keys, sizes = head[:n], head[n:]
    m = sum(sizes)
    idx.frombytes(raw[2 + 4 * n:2 + 4 * n + 2 * m])
    counts.frombytes(raw[2 + 4 * n + 2 * m:])
    if sys.byteorder != "little":
        idx.byteswap()
        counts.byteswap()
    out: Tails = {}
    at = 0
    for k, size in zip(keys, sizes, strict=True):
        out[k] = dict(zip(idx[at:at + size], counts[at:at + size], strict=True))
        at += size
    return out


def cells_from_list(rows: Any) -> Cells:
    out: Cells = {}
    for row in rows or []:
        out[(int(row[0]) << 6) | int(row[1])] = [float(row[2]), float(row[3]), float(row[4])]
    return out


#: one cell as ``pack_cells`` lays it out: uint16 key, then n, sum y, sum y^2 (float64), little-endian
_ONE_CELL = struct.Struct("<H3d")


def pack_cells(cells: Cells) -> str:
    """Cells in a checkpoint: base64 of the sorted cell keys (uint16, ``prompt octave << 6 | completion
    octave``) then their ``n, sum y, sum y^2`` (float64), little-endian: exact, about half of ``cell_list``."""
    if len(cells) == 1:  # one cell (a near-empty window): one struct call, the same bytes
        ((k, v),) = cells.items()
        if 0 <= k < 0x10000 and len(v) == 3:
            return base64.b64encode(_ONE_CELL.pack(k, *v)).decode("ascii")
    ks = sorted(cells)
    keys = array("H", ks)
    vals = array("d", [x for k in ks for x in cells[k]])
    if sys.byteorder != "little":
        keys.byteswap()
        vals.byteswap()
    return base64.b64encode(keys.tobytes() + vals.tobytes()).decode("ascii")


def unpack_cells(data: Any) -> Cells:
    """Cells from ``pack_cells`` (a string) or ``cell_list`` (checkpoints written before it)."""
    if not isinstance(data, str):
        return cells_from_list(data)
    raw = base64.b64decode(data)
    n = len(raw) // 26  # 2 bytes of key and 3 x 8 of values per cell
    keys, vals = array("H"), array("d")
    keys.frombytes(raw[:2 * n])
    vals.frombytes(raw[2 * n:])
    if sys.byteorder != "little":
        keys.byteswap()
        vals.byteswap()
    return {k: [vals[3 * i], vals[3 * i + 1], vals[3 * i + 2]] for i, k in enumerate(keys)}


def merge_cells(into: Cells, other: Cells) -> None:
    for k, v in other.items():
        c = into.get(k)
        if c is None:
            into[k] = list(v)
        else:
            c[0] += v[0]
            c[1] += v[1]
            c[2] += v[2]


class _Replica:
    __slots__ = ("cells", "sketch")

    def __init__(self) -> None:
        self.sketch = QuantileSketch()
        self.cells: Cells = {}


class FleetStats:
    """Mix cells, per-replica sketches and cells, and build counts of one window (bounded)."""

    __slots__ = ("buf", "builds", "cells", "fails", "replicas", "tails")

    def __init__(self) -> None:
        self.cells: Cells = {}
        self.tails: Tails = {}
        self.replicas: dict[str, _Replica] = {}
        self.builds: dict[str, int] = {}
        #: ok requests not folded yet: (latency_ms, prompt_tokens, completion_tokens, replica id)
        self.buf: list[tuple[float, int, int, str | None]] | tuple[()] = ()  # as Window.latency_buf
        #: failed requests per replica: [errors, timeouts]; the empty tuple until the first (most windows)
        self.fails: dict[str, list[int]] | tuple[()] = ()

    def count_fail(self, rid: str | None, timeout: bool) -> None:
        """A failed request (an error, or a timeout) on replica ``rid``."""
        fails = self.fails
        if isinstance(fails, tuple):
            fails = self.fails = {}
        key = rid if rid is not None else NO_REPLICA
        if key not in fails and len(fails) >= MAX_REPLICAS:
            key = OTHER  # the table is full: as ``flush`` does with the replicas' sketches
        fails.setdefault(key, [0, 0])[1 if timeout else 0] += 1

    def count_build(self, build: str) -> None:
        b = self.builds
        if build not in b and len(b) >= MAX_BUILDS:
            build = OTHER
        b[build] = b.get(build, 0) + 1

    def flush(self) -> None:
        """Fold the buffered requests into the cells and the replicas."""
        buf = self.buf
        if not buf:
            return
        self.buf = ()
        cells = self.cells
        tails = self.tails
        reps = self.replicas
        by_rep: dict[str, list[float]] = {}
        marks: list[int] = []
        ceil_, inv_w = _ceil, _INV_TAIL_WIDTH
        for lat, pt, ct, rid in buf:
            key = rid if rid is not None else NO_REPLICA
            r = reps.get(key)
            if r is None:
                if len(reps) >= MAX_REPLICAS:
                    key = OTHER
                    r = reps.get(key)
                if r is None:
                    r = reps[key] = _Replica()
            lats = by_rep.get(key)
            if lats is None:
                lats = by_rep[key] = []
            lats.append(lat)
            if lat > 0.0:
                # folded into the window's and the replica's cells inline: no call per request
                y = _log(lat)
                yy = y * y
                cell = (pt.bit_length() << 6) | ct.bit_length()
                for into in (cells, r.cells):
                    c = into.get(cell)
                    if c is None:
                        into[cell] = [1.0, y, yy]
                    else:
                        c[0] += 1.0
                        c[1] += y
                        c[2] += yy
                # the cell's tail bucket, counted below in one C pass (|bucket| < 2^15 for any finite y)
                marks.append((cell << 16) + ceil_(y * inv_w) + 0x8000)
        for key, lats in by_rep.items():
            reps[key].sketch.add_many(lats)
        touched = set()
        for mark, k in Counter(marks).items():
            cell = mark >> 16
            h = tails.get(cell)
            if h is None:
                h = tails[cell] = {}
            b = (mark & 0xFFFF) - 0x8000
            h[b] = h.get(b, 0) + k
            touched.add(cell)
        for cell in touched:
            if len(tails[cell]) > MAX_TAIL_BUCKETS:
                _fold_tail(tails[cell])

    def copy(self) -> FleetStats:
        """An independent copy, buffer folded first (a checkpoint snapshot)."""
        self.flush()
        f = FleetStats.__new__(FleetStats)
        f.buf = ()
        f.cells = {k: v[:] for k, v in self.cells.items()}
        f.tails = {k: dict(h) for k, h in self.tails.items()}
        reps = f.replicas = {}
        for k, r in self.replicas.items():
            rep = reps[k] = _Replica.__new__(_Replica)  # not __init__: its empty sketch would be replaced
            rep.sketch = r.sketch.copy()
            rep.cells = {c: v[:] for c, v in r.cells.items()}
        f.builds = dict(self.builds)
        f.fails = {k: v[:] for k, v in self.fails.items()} if self.fails else ()
        return f

    def has_replicas(self) -> bool:
        return any(k != NO_REPLICA for k in self.replicas)

    def detail(self) -> dict[str, Any]:
        """The window's ``Signal.detail`` additions: ``latency_mix``, ``replicas``, ``builds``."""
        self.flush()
        out: dict[str, Any] = {}
        if self.cells:
            out["latency_mix"] = {"cells": cell_list(self.cells)}
            if self.tails:
                out["latency_mix"].update(tail_width=TAIL_WIDTH, tails=tail_list(self.tails))
        if self.has_replicas():
            out["replicas"] = {k: {"latency_hist": r.sketch.to_dict(), "cells": cell_list(r.cells)}
                               for k, r in sorted(self.replicas.items())}
        if self.builds:
            out["builds"] = dict(self.builds)
        if self.fails and any(k != NO_REPLICA for k in self.fails):
            # per replica [ok, errors, timeouts], every replica of the window (one that only failed too)
            reps, fails = self.replicas, self.fails
            out["replica_fails"] = {k: [reps[k].sketch.count if k in reps else 0, *fails.get(k, (0, 0))]
                                    for k in sorted(reps.keys() | fails.keys())}
        return out

    def export(self) -> dict[str, Any]:
        self.flush()
        return {"cells": pack_cells(self.cells), "tails": pack_tails(self.tails),
                "rep": {k: {"lat": r.sketch.pack(), "cells": pack_cells(r.cells)} for k, r in self.replicas.items()},
                "bld": dict(self.builds), **({"fail": {k: v[:] for k, v in self.fails.items()}} if self.fails else {})}

    @classmethod
    def from_export(cls, d: dict[str, Any] | None) -> FleetStats:
        f = cls()
        if not d:
            return f
        f.cells = unpack_cells(d.get("cells"))  # a list before ``pack_cells``
        f.tails = unpack_tails(d.get("tails"))  # absent before the tail histograms
        for k, r in (d.get("rep") or {}).items():
            rep = _Replica()
            rep.sketch = QuantileSketch.load(r["lat"])  # a dict before ``pack``
            rep.cells = unpack_cells(r.get("cells"))
            f.replicas[str(k)] = rep
        f.builds = {str(k): int(v) for k, v in (d.get("bld") or {}).items()}
        fails = d.get("fail")  # absent before failures were counted per replica, and in most windows
        if fails:
            f.fails = {str(k): [int(v[0]), int(v[1])] for k, v in fails.items()}
        return f
