"""Tumbling event-time windows over inference events, one per (model, route, precision).

An event with timestamp ``ts`` belongs to window ``[k*L, (k+1)*L)`` with ``k = floor(ts / L)``.
Windows close on the wall clock: ``close_due(now)`` closes every window whose end + grace has
passed and turns it into a ``Signal`` (source ``live``). An event for a window that has already
closed is counted as ``late`` and dropped; an event older than ``skip_before`` (the durably
recorded "windows closed until" mark after a restart) is counted as ``replayed`` and dropped, so
re-read events are never counted twice. ``min_open_offsets`` tells the ingest how far it may
commit Kafka offsets: up to the oldest event still held in an open window.

Memory per window is bounded: latencies go into a ``QuantileSketch`` (through a buffer of at
most 256, added in one batch: cheaper per event than one sketch update each), and at most
``shadow_max_pairs`` completion/shadow pairs are scored for agreement. The sampling rule is
deterministic and order-free: a window keeps the pairs whose ``crc32(request_id)`` is smallest
(bottom-k, a uniform sample of the window), after the ``shadow_sample_rate`` hash threshold. A pair
is scored when it enters the sample (ROUGE-L; BLEU, five times dearer, only while it is among the
``shadow_bleu_max_pairs`` smallest hashes, a uniform sub-sample), so a window keeps scores, not texts: closing
it costs no scoring, and its checkpoint stays small. Expected scorings per window with ``M``
sampled pairs and cap ``k``: about ``k * (1 + ln(M / k))``.
"""

from __future__ import annotations

import base64
import functools
import heapq
import json
import logging
import math
import struct
import zlib
from functools import reduce
from itertools import repeat
from operator import add as _plus
from operator import truediv as _div
from typing import Any

from watchdog.core.events import InferenceEvent
from watchdog.core.signals import Signal
from watchdog.windows.sketch import QuantileSketch

log = logging.getLogger(__name__)

#: (model, route, precision)
ScopeKey = tuple[str, str, str]
#: (topic, partition)
PartitionKey = tuple[str, int]

#: cap on the characters of each stored completion (agreement scoring is quadratic in length)
DEFAULT_SHADOW_MAX_CHARS = 4000
#: exp() argument cap so an absurd mean log-probability cannot overflow to inf
_MAX_NLL = 700.0
_floor = math.floor
_fsum = math.fsum
#: latencies (and TTFTs) buffered per window before they go into its sketch in one batch
_BUFFERED = 256


class _Window:
    """Running sums for one (scope, window); everything bounded in size."""

    __slots__ = (
        "index", "count", "ok", "errors", "timeouts", "latency", "ttft", "ok_latency_s",
        "ok_completion_tokens", "prompt_tokens", "with_completion", "empty", "lp_sum", "lp_tokens",
        "lp_events", "shadow_seen", "shadow_sampled", "shadow_precisions", "pairs", "offsets",
        "latency_buf", "ttft_buf", "shadow_error", "bleu", "dirty",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.count = 0
        self.ok = 0
        self.errors = 0
        self.timeouts = 0
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
        #: max-heap (by negated hash) of the sampled pairs' (-crc32(request_id), rouge_l)
        self.pairs: list[tuple[int, float]] = []
        #: changed since the last checkpoint export
        self.dirty = True
        self.shadow_error: str | None = None
        #: the same for BLEU (5x the cost of ROUGE-L) over the ``shadow_bleu_max_pairs`` smallest hashes
        self.bleu: list[tuple[int, float]] = []
        self.offsets: dict[PartitionKey, int] = {}
        # latencies and TTFTs not yet in the sketches: appending is far cheaper per event than a
        # sketch update, and ``flush`` adds them in C-level batches (at most _BUFFERED each)
        self.latency_buf: list[float] = []
        self.ttft_buf: list[float] = []

    def flush(self) -> None:
        """Move the buffered latencies into the sketches (the same state as adding them one by one)."""
        buf = self.latency_buf
        if buf:
            self.latency.add_many(buf)
            # ok_latency_s: the same left-to-right sum of latency / 1000 as per-event adding builds
            self.ok_latency_s = reduce(_plus, map(_div, buf, repeat(1000.0)), self.ok_latency_s)
            self.latency_buf = []
        buf = self.ttft_buf
        if buf:
            if self.ttft is None:
                self.ttft = QuantileSketch()
            self.ttft.add_many(buf)
            self.ttft_buf = []


class WindowAggregator:
    """Folds inference events into tumbling windows and closes them into live ``Signal`` objects."""

    def __init__(
        self,
        length_s: float = 10.0,
        grace_s: float = 2.0,
        shadow_sample_rate: float = 1.0,
        shadow_max_pairs: int = 200,
        shadow_max_chars: int = DEFAULT_SHADOW_MAX_CHARS,
        shadow_bleu_max_pairs: int = 50,
        seed: int = 0,
        max_future_s: float = 300.0,
    ) -> None:
        if length_s <= 0:
            raise ValueError("length_s must be > 0")
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        if not 0.0 <= shadow_sample_rate <= 1.0:
            raise ValueError("shadow_sample_rate must be in [0, 1]")
        if shadow_max_pairs < 0:
            raise ValueError("shadow_max_pairs must be >= 0")
        self.length_s = float(length_s)
        self.grace_s = float(grace_s)
        self.shadow_sample_rate = shadow_sample_rate
        self.shadow_max_pairs = shadow_max_pairs
        self.shadow_max_chars = shadow_max_chars
        self.shadow_bleu_max_pairs = min(shadow_bleu_max_pairs, shadow_max_pairs)
        #: events stamped further than this past the last close_due clock are dropped as ``future``:
        #: a skewed producer clock would otherwise hold a window (and the Kafka commit) open for long
        self.max_future_s = max_future_s
        self._sample_below = int(shadow_sample_rate * 2**32)
        #: events with ts < skip_before are dropped as already counted (set after a restart)
        self.skip_before: float | None = None
        self.late = 0
        self.replayed = 0
        self.folded = 0
        self.future = 0
        self._now: float | None = None
        self.windows_closed = 0
        # windows with end index <= this are closed; integer indices avoid float drift at boundaries
        self._closed_end: int | None = None
        self._open: dict[tuple[int, str, str, str], _Window] = {}
        #: windows closed since the last ``export_changes`` (their checkpoint fields are deleted)
        self._closed_keys: list[tuple[int, str, str, str]] = []

    # --- folding ----------------------------------------------------------------------------

    @property
    def closed_until(self) -> float | None:
        """Every window ending at or before this time is closed (None before the first close)."""
        return None if self._closed_end is None else self._closed_end * self.length_s

    def add(self, event: InferenceEvent, partition_key: PartitionKey | None = None, offset: int | None = None) -> bool:
        """Fold ``event`` in; False when it was dropped (replayed, late or future)."""
        # The hot path of the daemon: one call per event, so attributes are read once into locals
        # and the fold is inline rather than a method call.
        ts = event.ts
        skip = self.skip_before
        if skip is not None and ts < skip:
            self.replayed += 1
            return False
        index = _floor(ts / self.length_s)
        closed = self._closed_end
        if closed is not None and index + 1 <= closed:
            self.late += 1
            return False
        now = self._now
        if now is not None and ts > now + self.max_future_s:
            self.future += 1
            return False
        key = (index, event.model, event.route, event.precision)
        w = self._open.get(key)
        if w is None:
            w = self._open[key] = _Window(index)
        w.count += 1
        w.dirty = True
        w.prompt_tokens += event.prompt_tokens
        status = event.status
        if status == "ok":
            # content and speed metrics are over successful requests only
            w.ok += 1
            buf = w.latency_buf
            buf.append(event.latency_ms)
            w.ok_completion_tokens += event.completion_tokens
            ttft = event.ttft_ms
            if ttft is not None:
                w.ttft_buf.append(ttft)
            if len(buf) >= _BUFFERED:
                w.flush()
            completion = event.completion
            if completion is not None:
                w.with_completion += 1
                if not completion or completion.isspace():
                    w.empty += 1
            lps = event.completion_logprobs
            if lps:
                w.lp_sum += _fsum(lps)
                w.lp_tokens += len(lps)
                w.lp_events += 1
            shadow = event.shadow
            if shadow is not None and completion is not None and shadow.completion is not None:
                self._offer_pair(w, event.request_id, completion, shadow.completion, shadow.precision)
        elif status == "timeout":
            w.timeouts += 1
        else:
            w.errors += 1
        if partition_key is not None and offset is not None:
            offsets = w.offsets
            prev = offsets.get(partition_key)
            if prev is None or offset < prev:
                offsets[partition_key] = offset
        self.folded += 1
        return True

    def _offer_pair(self, w: _Window, request_id: str, completion: str, shadow: str, precision: str | None) -> None:
        w.shadow_seen += 1
        if precision:
            w.shadow_precisions[precision] = w.shadow_precisions.get(precision, 0) + 1
        cap = self.shadow_max_pairs
        if cap == 0:
            return
        h = zlib.crc32(request_id.encode())
        if h >= self._sample_below:
            return
        w.shadow_sampled += 1
        heap = w.pairs
        if len(heap) >= cap and -heap[0][0] <= h:
            return  # not among the window's smallest hashes
        bheap = w.bleu
        bcap = self.shadow_bleu_max_pairs
        in_bleu = bcap > 0 and (len(bheap) < bcap or -bheap[0][0] > h)
        chars = self.shadow_max_chars
        try:
            rouge, bleu = _pair_scores(completion[:chars], shadow[:chars], in_bleu)
        except Exception as exc:  # a broken scorer install must not stop the window
            if w.shadow_error is None:
                log.warning("shadow agreement scoring failed: %s", exc)
            w.shadow_error = f"{type(exc).__name__}: {exc}"[:200]
            return
        item = (-h, rouge)
        if len(heap) < cap:
            heapq.heappush(heap, item)
        else:
            heapq.heapreplace(heap, item)
        if in_bleu and bleu is not None:
            if len(bheap) < bcap:
                heapq.heappush(bheap, (-h, bleu))
            else:
                heapq.heapreplace(bheap, (-h, bleu))

    # --- closing ----------------------------------------------------------------------------

    def close_due(self, now: float) -> list[Signal]:
        """Close every window with end + grace <= ``now`` (wall clock); one Signal per scope and window."""
        if self._now is None or now > self._now:
            self._now = now
        upto = math.floor((now - self.grace_s) / self.length_s)
        if self._closed_end is None or upto > self._closed_end:
            self._closed_end = upto
        due = [k for k in self._open if k[0] + 1 <= self._closed_end]
        return self._close(due)

    def close_all(self) -> list[Signal]:
        """Close every open window now (graceful shutdown, end of a backtest)."""
        keys = list(self._open)
        if keys:
            last_end = max(k[0] for k in keys) + 1
            if self._closed_end is None or last_end > self._closed_end:
                self._closed_end = last_end
        return self._close(keys)

    def _close(self, keys: list[tuple[int, str, str, str]]) -> list[Signal]:
        keys.sort()
        out = []
        for key in keys:
            w = self._open.pop(key)
            self._closed_keys.append(key)
            out.append(self._signal(key[1], key[2], key[3], w))
        self.windows_closed += len(out)
        if out:
            log.debug("closed %d windows, %d still open", len(out), len(self._open))
        return out

    def _signal(self, model: str, route: str, precision: str, w: _Window) -> Signal:
        w.flush()
        values: dict[str, float] = {}
        detail: dict[str, Any] = {
            "events": w.count,
            "ok": w.ok,
            "errors": w.errors,
            "timeouts": w.timeouts,
            "completion_tokens": w.ok_completion_tokens,
            "prompt_tokens": w.prompt_tokens,
            "completions": w.with_completion,
            "empty": w.empty,
            "logprob_events": w.lp_events,
            "logprob_tokens": w.lp_tokens,
            "shadow_seen": w.shadow_seen,
            "shadow_pairs": len(w.pairs),
            "latency_hist": w.latency.to_dict(),
        }
        if w.count:
            values["error_rate"] = (w.errors + w.timeouts) / w.count
            values["timeout_rate"] = w.timeouts / w.count
        if w.ok:
            p50, p95, p99 = w.latency.quantiles([0.5, 0.95, 0.99])
            assert p50 is not None and p95 is not None and p99 is not None
            values["latency_p50_ms"] = p50
            values["latency_p95_ms"] = p95
            values["latency_p99_ms"] = p99
            values["mean_completion_tokens"] = w.ok_completion_tokens / w.ok
            if w.ok_latency_s > 0:
                values["tokens_per_s"] = w.ok_completion_tokens / w.ok_latency_s
        if w.ttft is not None and w.ttft.count:
            ttft_p99 = w.ttft.quantile(0.99)
            assert ttft_p99 is not None
            values["ttft_p99_ms"] = ttft_p99
            detail["ttft_count"] = w.ttft.count
        if w.with_completion:
            values["empty_rate"] = w.empty / w.with_completion
        if w.lp_tokens:
            values["perplexity"] = math.exp(min(-w.lp_sum / w.lp_tokens, _MAX_NLL))
        if w.shadow_precisions:
            detail["shadow_precisions"] = dict(w.shadow_precisions)
        if w.shadow_error:
            detail["shadow_error"] = w.shadow_error
        if w.pairs:
            values["shadow_rougeL"] = _fsum(p[1] for p in w.pairs) / len(w.pairs)
        if w.bleu:
            values["shadow_bleu"] = _fsum(p[1] for p in w.bleu) / len(w.bleu)
            detail["shadow_bleu_pairs"] = len(w.bleu)
        start = w.index * self.length_s
        return Signal(
            source="live",
            model=model,
            route=route,
            precision=precision,
            start=start,
            end=(w.index + 1) * self.length_s,
            samples=w.count,
            values=values,
            detail=detail,
        )

    # --- checkpoints --------------------------------------------------------------------------

    @staticmethod
    def _export(key: tuple[int, str, str, str], w: _Window) -> dict[str, Any]:
        w.flush()
        index, model, route, precision = key
        return {
            "i": index, "m": model, "r": route, "p": precision,
            "n": [w.count, w.ok, w.errors, w.timeouts, w.ok_completion_tokens, w.prompt_tokens,
                  w.with_completion, w.empty, w.lp_tokens, w.lp_events, w.shadow_seen, w.shadow_sampled],
            "f": [w.ok_latency_s, w.lp_sum],
            "lat": w.latency.to_dict(), "ttft": w.ttft.to_dict() if w.ttft is not None else None,
            "sp": w.shadow_precisions, "pairs": _pack(w.pairs), "bleu": _pack(w.bleu), "err": w.shadow_error,
            "off": [[t, p, o] for (t, p), o in w.offsets.items()],
        }

    def export_open(self) -> list[dict[str, Any]]:
        """Every open window as JSON-able data (a checkpoint); ``import_open`` restores it exactly."""
        return [self._export(key, w) for key, w in self._open.items()]

    def export_changes(self, everything: bool = False) -> tuple[dict[str, str], list[str]]:
        """Checkpoint fields of the windows changed since the last call (all with ``everything``), and
        the fields of the windows closed since; resets both."""
        changed = {}
        for key, w in self._open.items():
            if w.dirty or everything:
                changed[window_field(key)] = json.dumps(self._export(key, w), check_circular=False)
                w.dirty = False
        closed = [window_field(k) for k in self._closed_keys]
        self._closed_keys = []
        return changed, closed

    def import_open(self, data: list[dict[str, Any]]) -> None:
        for d in data:
            w = _Window(int(d["i"]))
            (w.count, w.ok, w.errors, w.timeouts, w.ok_completion_tokens, w.prompt_tokens, w.with_completion,
             w.empty, w.lp_tokens, w.lp_events, w.shadow_seen, w.shadow_sampled) = (int(x) for x in d["n"])
            w.ok_latency_s, w.lp_sum = (float(x) for x in d["f"])
            w.latency = QuantileSketch.from_dict(d["lat"])
            w.ttft = QuantileSketch.from_dict(d["ttft"]) if d.get("ttft") else None
            w.shadow_precisions = {str(k): int(v) for k, v in (d.get("sp") or {}).items()}
            w.pairs = _unpack(d.get("pairs") or "")
            heapq.heapify(w.pairs)
            w.bleu = _unpack(d.get("bleu") or "")
            heapq.heapify(w.bleu)
            w.shadow_error = d.get("err")
            w.offsets = {(str(t), int(p)): int(o) for t, p, o in d.get("off") or []}
            w.dirty = False
            self._open[(w.index, str(d["m"]), str(d["r"]), str(d["p"]))] = w

    def set_closed_end(self, index: int | None) -> None:
        """Restore the "windows closed up to index" mark of a checkpoint."""
        if index is not None and (self._closed_end is None or index > self._closed_end):
            self._closed_end = index

    @property
    def closed_end(self) -> int | None:
        return self._closed_end

    def is_closed(self, ts: float) -> bool:
        """True when the window ``ts`` falls in has already closed (an event for it is late)."""
        closed = self._closed_end
        return closed is not None and _floor(ts / self.length_s) + 1 <= closed

    # --- state for the ingest -----------------------------------------------------------------

    def open_windows(self) -> int:
        return len(self._open)

    def min_open_offsets(self) -> dict[PartitionKey, int]:
        """Per (topic, partition), the smallest offset of an event held in a still-open window."""
        out: dict[PartitionKey, int] = {}
        for w in self._open.values():
            for pk, off in w.offsets.items():
                prev = out.get(pk)
                if prev is None or off < prev:
                    out[pk] = off
        return out


def window_field(key: tuple[int, str, str, str]) -> str:
    """The checkpoint hash field of one open window."""
    return "w" + json.dumps(list(key))


def _pack(items: list[tuple[int, float]]) -> str:
    """(negated crc32, score) pairs as base64 of little-endian uint32 + float64 (exact, ~1/3 of JSON)."""
    return base64.b64encode(struct.pack(f"<{len(items)}I{len(items)}d", *(-h for h, _ in items),
                                        *(v for _, v in items))).decode()


def _unpack(text: str) -> list[tuple[int, float]]:
    raw = base64.b64decode(text)
    n = len(raw) // 12
    vals = struct.unpack(f"<{n}I{n}d", raw)
    return list(zip((-int(h) for h in vals[:n]), (float(v) for v in vals[n:]), strict=True))


# --- shadow agreement scoring -----------------------------------------------------------------
# Tokenised with watchdog/core/text.py's CjkTokenizer (each CJK character one token, otherwise exactly
# rouge-score's default tokenizer without stemming), so Chinese pairs score like golden replays do;
# BLEU uses sacrebleu's ``zh`` tokenizer on CJK pairs, ``13a`` otherwise, as probes/metrics.py does.
# ROUGE-L is computed here with a bit-parallel LCS: the same numbers as rouge-score's ``rougeL``
# F-measure (tests compare them), without importing rouge-score, whose nltk import pulls in scipy
# (~80 MB of RSS and ~2 s) into the daemon.


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists (bit-parallel, Hyyrö 2004)."""
    masks: dict[str, int] = {}
    bit = 1
    for tok in a:
        masks[tok] = masks.get(tok, 0) | bit
        bit <<= 1
    full = bit - 1
    v = full
    for tok in b:
        m = masks.get(tok)
        if m:
            u = v & m
            v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def rouge_l(target: list[str], prediction: list[str]) -> float:
    """ROUGE-L F-measure of token lists, computed as rouge-score's ``_score_lcs`` does."""
    if not target or not prediction:
        return 0.0
    lcs = lcs_length(target, prediction)
    precision = lcs / len(prediction)
    recall = lcs / len(target)
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


class _AgreementScorer:
    """ROUGE-L F-measure and sentence BLEU of a completion against its shadow (the reference)."""

    def __init__(self) -> None:
        from sacrebleu.metrics import BLEU

        from watchdog.core.text import CjkTokenizer, has_cjk

        self._tokenize = CjkTokenizer().tokenize
        self._has_cjk = has_cjk
        # sacrebleu.sentence_bleu's defaults (13a, smooth exp, effective order), and its zh variant
        self._bleu = BLEU(tokenize="13a", effective_order=True)
        self._bleu_zh = BLEU(tokenize="zh", effective_order=True)

    def pair(self, completion: str, shadow: str, with_bleu: bool = True) -> tuple[float, float | None]:
        score = rouge_l(self._tokenize(shadow), self._tokenize(completion))
        if not with_bleu:
            return float(score), None
        cjk = self._has_cjk(completion) or self._has_cjk(shadow)
        bleu = (self._bleu_zh if cjk else self._bleu).sentence_score(completion, [shadow]).score
        return float(score), min(max(float(bleu), 0.0), 100.0)


@functools.lru_cache(maxsize=1)
def _agreement_scorer() -> _AgreementScorer:
    return _AgreementScorer()


def preload_scorers() -> None:
    """Import the agreement scorers now (sacrebleu, ~0.3 s) rather than at the first window close."""
    _agreement_scorer()


def _pair_scores(completion: str, shadow: str, with_bleu: bool = True) -> tuple[float, float | None]:
    """(ROUGE-L F-measure in [0, 1], sentence BLEU in [0, 100] or None without ``with_bleu``)."""
    a, b = completion.strip(), shadow.strip()
    if a == b:  # identical (including both empty): full agreement, and no scorer cost
        return 1.0, 100.0
    if not a or not b:
        return 0.0, 0.0
    return _agreement_scorer().pair(a, b, with_bleu)


def shadow_agreement(pairs: list[tuple[str, str]]) -> tuple[float, float]:
    """Mean ROUGE-L F-measure and mean sentence BLEU of (completion, shadow completion) pairs.

    The shadow completion is the reference. Pairs must be non-empty. CJK pairs are tokenised per
    character (see ``watchdog.core.text``).
    """
    if not pairs:
        raise ValueError("no pairs to score")
    rouge_sum = 0.0
    bleu_sum = 0.0
    for completion, shadow in pairs:
        r, b = _pair_scores(completion, shadow)
        rouge_sum += r
        bleu_sum += b or 0.0
    return rouge_sum / len(pairs), bleu_sum / len(pairs)
