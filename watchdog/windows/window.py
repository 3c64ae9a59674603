"""One open tumbling window of one (model, route, precision): its running sums, bounded in size.

``Window`` holds what ``WindowAggregator.add`` folds in (counts, token sums, a latency
``QuantileSketch`` fed through a buffer of at most ``BUFFERED`` values, log-probability sums, the
scores of its sampled shadow pairs as bounded heaps, and the smallest Kafka offset per partition).
``to_signal`` turns a closed window into its live ``Signal``: the rates, latency quantiles,
throughput, perplexity and mean shadow agreement with the counts behind them. ``export`` and
``from_export`` give and take the exact checkpoint form of an open window (score heaps packed as
base64 of uint32 + float64, latency sketches as ``QuantileSketch.pack``; the ``to_dict`` form of
checkpoints written before it still loads).
"""

from __future__ import annotations

import base64
import heapq
import math
import struct
from functools import reduce
from itertools import repeat
from operator import add as _plus
from operator import truediv as _div
from typing import Any

from watchdog.core.signals import Signal
from watchdog.windows.fleet import FleetStats
from watchdog.windows.sketch import QuantileSketch

__all__ = ["BUFFERED", "PartitionKey", "Window"]

#: (topic, partition)
PartitionKey = tuple[str, int]

#: exp() argument cap so an absurd mean log-probability cannot overflow to inf
_MAX_NLL = 700.0
_fsum = math.fsum
#: latencies (and TTFTs) buffered per window before they go into its sketch in one batch
BUFFERED = 256


class Window:
    """Running sums for one (scope, window); everything bounded in size."""

    __slots__ = (
        "index", "count", "ok", "errors", "timeouts", "latency", "ttft", "ok_latency_s",
        "ok_completion_tokens", "prompt_tokens", "with_completion", "empty", "lp_sum", "lp_tokens",
        "lp_events", "shadow_seen", "shadow_sampled", "shadow_precisions", "pairs", "offsets",
        "latency_buf", "ttft_buf", "shadow_error", "bleu", "dirty", "fleet", "not_judged",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.count = 0
        self.ok = 0
        self.errors = 0
        self.timeouts = 0
        #: cancelled / client_error / rate_limited events: kept apart, not in ``count``
        self.not_judged: dict[str, int] = {}
        self.latency = QuantileSketch()
        self.ttft: QuantileSketch | None = None
        self.ok_latency_s = 0.0
        self.ok_completion_tokens = 0
        self.prompt_tokens = 0
        self.with_completion = 0
        self.empty = 0
        self.lp_sum = 0.0
        self.lp_tokens = 0
        self.lp_events = 0
        self.shadow_seen = 0
        self.shadow_sampled = 0
        self.shadow_precisions: dict[str, int] = {}
        # the score heaps and the buffers below are the empty tuple until a value comes (and the buffers
        # again after ``flush``): at 10,000 routes most windows hold an event or two, and an empty list
        # per window and field is a container the cyclic collector walks (watchdog/runtime/collector.py)
        #: max-heap (by negated hash) of the sampled pairs' (-crc32(request_id), rouge_l)
        self.pairs: list[tuple[int, float]] | tuple[()] = ()
        #: changed since the last checkpoint export
        self.dirty = True
        self.shadow_error: str | None = None
        #: the same for BLEU (5x the cost of ROUGE-L) over the ``shadow_bleu_max_pairs`` smallest hashes
        self.bleu: list[tuple[int, float]] | tuple[()] = ()
        self.offsets: dict[PartitionKey, int] = {}
        # latencies and TTFTs not yet in the sketches: appending is far cheaper per event than a
        # sketch update, and ``flush`` adds them in C-level batches (at most BUFFERED each)
        self.latency_buf: list[float] | tuple[()] = ()
        self.ttft_buf: list[float] | tuple[()] = ()
        #: request mix cells, per-replica latency, build counts (watchdog/windows/fleet.py)
        self.fleet = FleetStats()

    def flush(self) -> None:
        """Move the buffered latencies into the sketches (the same state as adding them one by one)."""
        buf = self.latency_buf
        if buf:
            self.latency.add_many(buf)
            # ok_latency_s: the same left-to-right sum of latency / 1000 as per-event adding builds
            self.ok_latency_s = reduce(_plus, map(_div, buf, repeat(1000.0)), self.ok_latency_s)
            self.latency_buf = ()
        buf = self.ttft_buf
        if buf:
            if self.ttft is None:
                self.ttft = QuantileSketch()
            self.ttft.add_many(buf)
            self.ttft_buf = ()
        self.fleet.flush()

    def to_signal(self, model: str, route: str, precision: str, length_s: float) -> Signal:
        """The live ``Signal`` of this window (``length_s`` long) for (model, route, precision)."""
        self.flush()
        values: dict[str, float] = {}
        detail: dict[str, Any] = {
            "events": self.count,
            "ok": self.ok,
            "errors": self.errors,
            "timeouts": self.timeouts,
            "completion_tokens": self.ok_completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "completions": self.with_completion,
            "empty": self.empty,
            "logprob_events": self.lp_events,
            "logprob_tokens": self.lp_tokens,
            "shadow_seen": self.shadow_seen,
            "shadow_pairs": len(self.pairs),
            "latency_hist": self.latency.to_dict(),
        }
        if self.count:
            values["error_rate"] = (self.errors + self.timeouts) / self.count
            values["timeout_rate"] = self.timeouts / self.count
        if self.ok:
            p50, p95, p99 = self.latency.quantiles([0.5, 0.95, 0.99])
            assert p50 is not None and p95 is not None and p99 is not None
            values["latency_p50_ms"] = p50
            values["latency_p95_ms"] = p95
            values["latency_p99_ms"] = p99
            values["mean_completion_tokens"] = self.ok_completion_tokens / self.ok
            if self.ok_latency_s > 0:
                values["tokens_per_s"] = self.ok_completion_tokens / self.ok_latency_s
        if self.ttft is not None and self.ttft.count:
            ttft_p99 = self.ttft.quantile(0.99)
            assert ttft_p99 is not None
            values["ttft_p99_ms"] = ttft_p99
            detail["ttft_count"] = self.ttft.count
        if self.with_completion:
            values["empty_rate"] = self.empty / self.with_completion
        if self.lp_tokens:
            values["perplexity"] = math.exp(min(-self.lp_sum / self.lp_tokens, _MAX_NLL))
        if self.not_judged:
            detail["not_judged"] = dict(self.not_judged)
        if self.shadow_precisions:
            detail["shadow_precisions"] = dict(self.shadow_precisions)
        if self.shadow_error:
            detail["shadow_error"] = self.shadow_error
        detail.update(self.fleet.detail())
        if self.pairs:
            values["shadow_rougeL"] = _fsum(p[1] for p in self.pairs) / len(self.pairs)
        if self.bleu:
            values["shadow_bleu"] = _fsum(p[1] for p in self.bleu) / len(self.bleu)
            detail["shadow_bleu_pairs"] = len(self.bleu)
        start = self.index * length_s
        return Signal(
            source="live",
            model=model,
            route=route,
            precision=precision,
            start=start,
            end=(self.index + 1) * length_s,
            samples=self.count,
            values=values,
            detail=detail,
        )

    def snapshot(self) -> Window:
        """An independent copy of this window as it is now, buffers folded (a checkpoint is built on
        the loop thread as snapshots, cheap dict copies, and encoded with ``export`` off it)."""
        self.flush()
        w = Window.__new__(Window)
        (w.index, w.count, w.ok, w.errors, w.timeouts, w.ok_latency_s, w.ok_completion_tokens, w.prompt_tokens,
         w.with_completion, w.empty, w.lp_sum, w.lp_tokens, w.lp_events, w.shadow_seen, w.shadow_sampled,
         w.shadow_error, w.dirty) = (
            self.index, self.count, self.ok, self.errors, self.timeouts, self.ok_latency_s, self.ok_completion_tokens,
            self.prompt_tokens, self.with_completion, self.empty, self.lp_sum, self.lp_tokens, self.lp_events,
            self.shadow_seen, self.shadow_sampled, self.shadow_error, False)
        w.latency = self.latency.copy()
        w.ttft = self.ttft.copy() if self.ttft is not None else None
        w.not_judged = dict(self.not_judged)
        w.shadow_precisions = dict(self.shadow_precisions)
        w.pairs = self.pairs[:]
        w.bleu = self.bleu[:]
        w.offsets = dict(self.offsets)
        w.latency_buf = ()
        w.ttft_buf = ()
        w.fleet = self.fleet.copy()
        return w

    def export(self, key: tuple[int, str, str, str]) -> dict[str, Any]:
        """This window, open under ``key``, as JSON-able checkpoint data (``from_export`` restores it)."""
        self.flush()
        index, model, route, precision = key
        return {
            "i": index, "m": model, "r": route, "p": precision,
            "n": [self.count, self.ok, self.errors, self.timeouts, self.ok_completion_tokens, self.prompt_tokens,
                  self.with_completion, self.empty, self.lp_tokens, self.lp_events, self.shadow_seen,
                  self.shadow_sampled],
            "f": [self.ok_latency_s, self.lp_sum],
            "lat": self.latency.pack(), "ttft": self.ttft.pack() if self.ttft is not None else None,
            "sp": dict(self.shadow_precisions), "pairs": _pack(self.pairs), "bleu": _pack(self.bleu),
            "err": self.shadow_error,
            "off": [[t, p, o] for (t, p), o in self.offsets.items()],
            "fleet": self.fleet.export(),
            "nj": dict(self.not_judged),
        }

    @classmethod
    def from_export(cls, d: dict[str, Any]) -> Window:
        """The window ``export`` gave ``d`` for, exactly (not dirty)."""
        w = cls(int(d["i"]))
        (w.count, w.ok, w.errors, w.timeouts, w.ok_completion_tokens, w.prompt_tokens, w.with_completion,
         w.empty, w.lp_tokens, w.lp_events, w.shadow_seen, w.shadow_sampled) = (int(x) for x in d["n"])
        w.ok_latency_s, w.lp_sum = (float(x) for x in d["f"])
        w.latency = QuantileSketch.load(d["lat"])  # a dict in checkpoints written before ``pack``
        w.ttft = QuantileSketch.load(d["ttft"]) if d.get("ttft") else None
        w.shadow_precisions = {str(k): int(v) for k, v in (d.get("sp") or {}).items()}
        if d.get("pairs"):
            w.pairs = _unpack(d["pairs"])
            heapq.heapify(w.pairs)
        if d.get("bleu"):
            w.bleu = _unpack(d["bleu"])
            heapq.heapify(w.bleu)
        w.shadow_error = d.get("err")
        w.offsets = {(str(t), int(p)): int(o) for t, p, o in d.get("off") or []}
        w.fleet = FleetStats.from_export(d.get("fleet"))  # absent in checkpoints written before it
        w.not_judged = {str(k): int(v) for k, v in (d.get("nj") or {}).items()}
        w.dirty = False
        return w


def _pack(items: list[tuple[int, float]] | tuple[()]) -> str:
    """(negated crc32, score) pairs as base64 of little-endian uint32 + float64 (exact, ~1/3 of JSON)."""
    if not items:
        return ""  # what the general form gives for no pairs (most windows), without struct and base64
    return base64.b64encode(struct.pack(f"<{len(items)}I{len(items)}d", *(-h for h, _ in items),
                                        *(v for _, v in items))).decode()


def _unpack(text: str) -> list[tuple[int, float]]:
    raw = base64.b64decode(text)
    n = len(raw) // 12
    vals = struct.unpack(f"<{n}I{n}d", raw)
    return list(zip((-int(h) for h in vals[:n]), (float(v) for v in vals[n:]), strict=True))
