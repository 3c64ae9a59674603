"""A bounded-memory quantile sketch with relative accuracy (log-bucketed, in the style of DDSketch).

A value ``x > 0`` goes to bucket ``i = ceil(log_gamma(x))`` with ``gamma = (1 + a) / (1 - a)``;
every value in that bucket lies in ``(gamma**(i-1), gamma**i]``, and the bucket's representative
``2 * gamma**i / (gamma + 1)`` is within relative error ``a`` of each of them. So any quantile the
sketch returns is within ``a`` (relative) of a value whose rank is the requested one. Values below
``min_value`` share one zero bucket. Memory is a dict of at most ``max_buckets`` entries: when
that would be exceeded the lowest buckets are folded together (the high tail, which latency
policies watch, keeps its accuracy).

The bucket counts are exported (``to_dict``, ``aligned_counts``) so that two sketches with the same
accuracy can be compared by a rank test on binned data.
"""

from __future__ import annotations

import base64
import logging
import math
import sys
from array import array
from functools import reduce
from operator import add as _plus
from typing import Any

log = logging.getLogger(__name__)

_INF = math.inf
_ceil = math.ceil
_log = math.log
_LITTLE = sys.byteorder == "little"
#: ``pack``'s body of a sketch with one bucket whose count is below 256 (most windows of a thin
#: route): no gaps, one unsigned byte - "BB" + base64 of that byte
_ONE_BUCKET = ["BB" + base64.b64encode(bytes((c,))).decode("ascii") for c in range(256)]


def _typecode(values: list[int]) -> str:
    """The narrowest unsigned array type that holds every value of ``values`` (all >= 0)."""
    hi = max(values, default=0)
    return "B" if hi < 0x100 else "H" if hi < 0x10000 else "I" if hi < 0x100000000 else "Q"


def _packed(typecode: str, values: list[int]) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpacked(typecode: str, raw: bytes) -> list[int]:
    a = array(typecode)
    a.frombytes(raw)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


class QuantileSketch:
    """Relative-accuracy quantile sketch for non-negative values (latencies in ms)."""

    __slots__ = (
        "relative_accuracy", "min_value", "max_buckets", "gamma", "_inv_log_gamma",
        "buckets", "zero_count", "count", "sum", "min", "max",
    )

    def __init__(self, relative_accuracy: float = 0.01, min_value: float = 1e-3, max_buckets: int = 2048) -> None:
        if not 0.0 < relative_accuracy < 1.0:
            raise ValueError("relative_accuracy must be in (0, 1)")
        if min_value <= 0.0:
            raise ValueError("min_value must be > 0")
        if max_buckets < 2:
            raise ValueError("max_buckets must be >= 2")
        self.relative_accuracy = relative_accuracy
        self.min_value = min_value
        self.max_buckets = max_buckets
        self.gamma = (1.0 + relative_accuracy) / (1.0 - relative_accuracy)
        self._inv_log_gamma = 1.0 / math.log(self.gamma)
        #: bucket index -> count
        self.buckets: dict[int, int] = {}
        self.zero_count = 0
        self.count = 0
        self.sum = 0.0
        self.min = math.inf
        self.max = -math.inf

    # --- building ---------------------------------------------------------------------------

    def add(self, x: float, n: int = 1) -> None:
        """Add value ``x`` (>= 0) ``n`` times."""
        if not 0.0 <= x < _INF:  # also catches NaN
            raise ValueError(f"sketch values must be finite and >= 0, got {x!r}")
        if x < self.min_value:
            self.zero_count += n
        else:
            i = _ceil(_log(x) * self._inv_log_gamma)
            b = self.buckets
            c = b.get(i)
            if c is not None:
                b[i] = c + n
            else:
                b[i] = n
                if len(b) > self.max_buckets:
                    self._collapse()
        self.count += n
        self.sum += x * n
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x

    def add_many(self, xs: list[float]) -> None:
        """Add every value of ``xs`` once, in order: the same state as ``add(x)`` for each.

        The common case (all values finite and >= ``min_value``, no collapse needed) costs about half
        of one ``add`` call per value; anything else (zeros, invalid values, a collapse) goes
        through ``add`` one value at a time, which raises at the same value, after adding the ones
        before it."""
        if not xs:
            return
        lo = min(xs)
        total = reduce(_plus, xs, self.sum)  # the same left-to-right sum ``add`` builds
        b = self.buckets
        # NaN or inf make total NaN or inf; at most len(xs) new buckets cannot need a collapse
        if lo >= self.min_value and total < _INF and len(b) + len(xs) <= self.max_buckets:
            get = b.get
            inv = self._inv_log_gamma
            for x in xs:
                i = _ceil(_log(x) * inv)
                b[i] = get(i, 0) + 1
            self.count += len(xs)
            self.sum = total
            if lo < self.min:
                self.min = lo
            hi = max(xs)
            if hi > self.max:
                self.max = hi
            return
        for x in xs:
            self.add(x)

    def _collapse(self) -> None:
        """Fold the lowest buckets into one so at most ``max_buckets`` remain."""
        keys = sorted(self.buckets)
        excess = len(keys) - self.max_buckets
        if excess <= 0:
            return
        target = keys[excess]
        moved = sum(self.buckets.pop(k) for k in keys[:excess])
        self.buckets[target] += moved

    def merge(self, other: QuantileSketch) -> None:
        """Add everything ``other`` holds (same accuracy and zero threshold required)."""
        if other.gamma != self.gamma or other.min_value != self.min_value:
            raise ValueError("can only merge sketches with the same relative_accuracy and min_value")
        for i, c in other.buckets.items():
            self.buckets[i] = self.buckets.get(i, 0) + c
        if len(self.buckets) > self.max_buckets:
            self._collapse()
        self.zero_count += other.zero_count
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    # --- reading ----------------------------------------------------------------------------

    def bucket_value(self, i: int) -> float:
        """The representative value of bucket ``i`` (within the relative accuracy of its members)."""
        return 2.0 * self.gamma**i / (self.gamma + 1.0)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """The ``q``-quantile (0 <= q <= 1), or None when the sketch is empty."""
        return self.quantiles([q])[0]

    def quantiles(self, qs: list[float]) -> list[float | None]:
        """Several quantiles with one pass over the sorted buckets."""
        for q in qs:
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        if self.count == 0:
            return [None for _ in qs]
        if not self.zero_count and len(self.buckets) == 1:
            # one bucket (a near-empty window): every rank falls in it, as the loop below finds
            (key,) = self.buckets
            one = min(max(self.bucket_value(key), self.min), self.max)
            return [one for _ in qs]
        order = sorted(range(len(qs)), key=lambda k: qs[k])
        out: list[float | None] = [None] * len(qs)
        keys = sorted(self.buckets)
        cum = self.zero_count
        pos = 0
        for k in order:
            # nearest rank (numpy's "inverted_cdf"): the smallest value with at least q*n values <= it;
            # unlike interpolation it never reports a tail below an observed value on small windows
            rank = max(0, math.ceil(qs[k] * self.count - 1e-9) - 1)
            if rank < self.zero_count:
                out[k] = self.min  # the zero bucket: absolute error below min_value
                continue
            while cum <= rank:
                cum += self.buckets[keys[pos]]
                pos += 1
            value = self.bucket_value(keys[pos - 1])
            # exact extremes tighten the estimate at the ends without breaking the bound
            out[k] = min(max(value, self.min), self.max)
        return out

    def __len__(self) -> int:
        return len(self.buckets) + (1 if self.zero_count else 0)

    # --- export -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly export: ``bins`` is ``[[bucket_index, count], ...]`` sorted by index."""
        return {
            "relative_accuracy": self.relative_accuracy,
            "min_value": self.min_value,
            "count": self.count,
            "sum": self.sum,
            "min": self.min if self.count else None,
            "max": self.max if self.count else None,
            "zero_count": self.zero_count,
            "bins": list(map(list, sorted(self.buckets.items()))),  # keys are unique: sorted by index
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], max_buckets: int = 2048) -> QuantileSketch:
        sk = cls(float(data["relative_accuracy"]), float(data["min_value"]), max_buckets)
        sk.buckets = {int(i): int(c) for i, c in data.get("bins", [])}
        sk.zero_count = int(data.get("zero_count", 0))
        sk.count = int(data.get("count", sk.zero_count + sum(sk.buckets.values())))
        sk.sum = float(data.get("sum", 0.0))
        if sk.count:
            sk.min = float(data["min"]) if data.get("min") is not None else 0.0
            sk.max = float(data["max"]) if data.get("max") is not None else math.inf
        if len(sk.buckets) > max_buckets:
            sk._collapse()
        return sk

    def copy(self) -> QuantileSketch:
        """An independent copy (a checkpoint snapshot taken on the loop thread, encoded off it)."""
        sk = QuantileSketch.__new__(QuantileSketch)
        sk.relative_accuracy, sk.min_value, sk.max_buckets = self.relative_accuracy, self.min_value, self.max_buckets
        sk.gamma, sk._inv_log_gamma = self.gamma, self._inv_log_gamma
        sk.buckets = self.buckets.copy()
        sk.zero_count, sk.count, sk.sum, sk.min, sk.max = self.zero_count, self.count, self.sum, self.min, self.max
        return sk

    def pack(self) -> list[Any]:
        """A compact JSON-able export for checkpoints (``unpack`` restores it exactly), about a third
        of ``to_dict``'s bytes: ``[relative_accuracy, min_value, count, sum, min, max, zero_count,
        first bucket index, "<t><t>" + base64(index gaps + counts)]``, the gaps between consecutive
        bucket indices and the counts each as little-endian unsigned integers of the narrowest width
        that holds them (``t``: an ``array`` type code, B/H/I/Q)."""
        b = self.buckets
        if len(b) == 1:
            ((first, c),) = b.items()
            if 0 <= c < 0x100:  # the general path's bytes, without arrays (a near-empty window's sketch)
                return [self.relative_accuracy, self.min_value, self.count, self.sum, self.min if self.count else None,
                        self.max if self.count else None, self.zero_count, first, _ONE_BUCKET[c]]
        keys = sorted(b)
        counts = [b[k] for k in keys]
        gaps = [k - j for j, k in zip(keys, keys[1:], strict=False)]
        tg, tc = _typecode(gaps), _typecode(counts)
        body = base64.b64encode(_packed(tg, gaps) + _packed(tc, counts)).decode("ascii")
        return [self.relative_accuracy, self.min_value, self.count, self.sum, self.min if self.count else None,
                self.max if self.count else None, self.zero_count, keys[0] if keys else 0, tg + tc + body]

    @classmethod
    def unpack(cls, data: list[Any], max_buckets: int = 2048) -> QuantileSketch:
        acc, min_value, count, total, lo, hi, zero, first, body = data
        sk = cls(float(acc), float(min_value), max_buckets)
        tg, tc = body[0], body[1]
        raw = base64.b64decode(body[2:])
        wg, wc = array(tg).itemsize, array(tc).itemsize
        n = (len(raw) + wg) // (wg + wc) if raw else 0  # n counts and n - 1 gaps
        gaps = _unpacked(tg, raw[:wg * (n - 1)]) if n else []
        counts = _unpacked(tc, raw[wg * (n - 1):]) if n else []
        index = int(first)
        buckets = sk.buckets
        for k, c in enumerate(counts):
            if k:
                index += gaps[k - 1]
            buckets[index] = c
        sk.zero_count = int(zero)
        sk.count = int(count)
        sk.sum = float(total)
        if sk.count:
            sk.min = float(lo) if lo is not None else 0.0
            sk.max = float(hi) if hi is not None else math.inf
        if len(buckets) > max_buckets:
            sk._collapse()
        return sk

    @classmethod
    def load(cls, data: list[Any] | dict[str, Any], max_buckets: int = 2048) -> QuantileSketch:
        """A sketch from ``pack`` (a list) or ``to_dict`` (a dict: checkpoints written before ``pack``)."""
        if isinstance(data, dict):
            return cls.from_dict(data, max_buckets)
        return cls.unpack(data, max_buckets)

    def aligned_counts(self, other: QuantileSketch) -> tuple[list[float], list[int], list[int]]:
        """Bins of both sketches on one common, increasing scale: (values, counts_self, counts_other).

        The zero bucket comes first (value 0.0). This is the input a rank test on binned data
        (ties within a bin) needs.
        """
        if other.gamma != self.gamma or other.min_value != self.min_value:
            raise ValueError("can only align sketches with the same relative_accuracy and min_value")
        keys = sorted(self.buckets.keys() | other.buckets.keys())
        values = [0.0] + [self.bucket_value(i) for i in keys]
        mine = [self.zero_count] + [self.buckets.get(i, 0) for i in keys]
        theirs = [other.zero_count] + [other.buckets.get(i, 0) for i in keys]
        return values, mine, theirs
