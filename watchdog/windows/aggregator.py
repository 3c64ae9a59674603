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
sampled pairs and cap ``k``: about ``k * (1 + ln(M / k))``. One window's sums, its ``Signal`` and
its checkpoint form are in ``watchdog/windows/window.py``; the agreement scores (ROUGE-L, BLEU) in
``watchdog/windows/shadow.py``.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import zlib
from collections.abc import Container
from typing import Any

import orjson

from watchdog.core.events import NOT_JUDGED, InferenceEvent
from watchdog.core.signals import Signal
from watchdog.windows.shadow import pair_scores
from watchdog.windows.window import BUFFERED, PartitionKey, Window

log = logging.getLogger(__name__)

#: (model, route, precision)
ScopeKey = tuple[str, str, str]
#: (window index, model, route, precision)
WindowKey = tuple[int, str, str, str]

#: cap on the characters of each stored completion (agreement scoring is quadratic in length)
DEFAULT_SHADOW_MAX_CHARS = 4000
_floor = math.floor
_fsum = math.fsum


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
        self._open: dict[tuple[int, str, str, str], Window] = {}
        #: windows closed since the last ``export_changes`` (their checkpoint fields are deleted)
        self._closed_keys: list[tuple[int, str, str, str]] = []
        #: ``close_due`` with a limit: (closed_end, due keys sorted newest first, those of the routes
        #: asked ``first`` sorted alike) of the windows due and not closed yet. No key can join it while
        #: closed_end holds (``add`` takes such an event as late), so the due set is sorted once per
        #: closed_end, not once per chunk (10,000 routes: 20,000 keys sorted for each of ~100 chunks of 200),
        #: and kept, empty, once all of them closed (reset by a restore and by ``set_closed_end``)
        self._due: tuple[int, list[WindowKey], list[WindowKey]] | None = None
        #: checkpoint fields of windows encoded ahead of the next save (``encode_ahead``), each exact
        #: while its window is not dirty; a dirty window is encoded anew (at the latest by the save)
        self._ahead: dict[WindowKey, str] = {}
        #: open windows changed since they were last encoded (dirty): what a save built now encodes
        self.unencoded = 0
        #: ``encode_ahead``'s pass over the open windows: their keys, and where the next slice starts
        self._ahead_keys: list[WindowKey] = []
        self._ahead_at = 0

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
            w = self._open[key] = Window(index)  # dirty
            self.unencoded += 1
        elif not w.dirty:
            w.dirty = True
            self.unencoded += 1
        status = event.status
        if status in NOT_JUDGED:
            # the client went away, erred or was throttled: nothing about the precision
            w.not_judged[status] = w.not_judged.get(status, 0) + 1
            if partition_key is not None and offset is not None:
                prev = w.offsets.get(partition_key)
                if prev is None or offset < prev:
                    w.offsets[partition_key] = offset
            self.folded += 1
            return True
        w.count += 1
        w.prompt_tokens += event.prompt_tokens
        if event.build is not None:
            w.fleet.count_build(event.build)
        if status == "ok":
            # content and speed metrics are over successful requests only
            w.ok += 1
            # the buffers are the empty tuple until their first value (watchdog/windows/window.py)
            buf = w.latency_buf
            if isinstance(buf, tuple):
                buf = w.latency_buf = []
            buf.append(event.latency_ms)
            w.ok_completion_tokens += event.completion_tokens
            ttft = event.ttft_ms
            if ttft is not None:
                tbuf = w.ttft_buf
                if isinstance(tbuf, tuple):
                    tbuf = w.ttft_buf = []
                tbuf.append(ttft)
            fleet = w.fleet
            fbuf = fleet.buf
            if isinstance(fbuf, tuple):
                fbuf = fleet.buf = []
            fbuf.append((event.latency_ms, event.prompt_tokens, event.completion_tokens, event.replica or event.gpu_uuid))
            if len(buf) >= BUFFERED:
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
            w.fleet.count_fail(event.replica or event.gpu_uuid, True)
        else:
            w.errors += 1
            w.fleet.count_fail(event.replica or event.gpu_uuid, False)
        if partition_key is not None and offset is not None:
            offsets = w.offsets
            prev = offsets.get(partition_key)
            if prev is None or offset < prev:
                offsets[partition_key] = offset
        self.folded += 1
        return True

    def _offer_pair(self, w: Window, request_id: str, completion: str, shadow: str, precision: str | None) -> None:
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
        if isinstance(heap, list) and len(heap) >= cap and -heap[0][0] <= h:
            return  # not among the window's smallest hashes
        bheap = w.bleu
        bcap = self.shadow_bleu_max_pairs
        in_bleu = bcap > 0 and (isinstance(bheap, tuple) or len(bheap) < bcap or -bheap[0][0] > h)
        chars = self.shadow_max_chars
        try:
            rouge, bleu = pair_scores(completion[:chars], shadow[:chars], in_bleu)
        except Exception as exc:  # a broken scorer install must not stop the window
            if w.shadow_error is None:
                log.warning("shadow agreement scoring failed: %s", exc)
            w.shadow_error = f"{type(exc).__name__}: {exc}"[:200]
            return
        item = (-h, rouge)
        if isinstance(heap, tuple):  # the window's first sampled pair
            heap = w.pairs = []
        if len(heap) < cap:
            heapq.heappush(heap, item)
        else:
            heapq.heapreplace(heap, item)
        if in_bleu and bleu is not None:
            if isinstance(bheap, tuple):
                bheap = w.bleu = []
            if len(bheap) < bcap:
                heapq.heappush(bheap, (-h, bleu))
            else:
                heapq.heapreplace(bheap, (-h, bleu))

    # --- closing ----------------------------------------------------------------------------

    def close_due(self, now: float, limit: int | None = None, first: Container[tuple[str, str]] = (),
                  first_only: bool = False) -> list[Signal]:
        """Close every window with end + grace <= ``now`` (wall clock); one Signal per scope and window.
        With ``limit``, the oldest ``limit`` of them (and the other precisions of the last route taken,
        so a route's windows close together); the rest stay open but count as closed (an event for
        them is late) and close at the next call. With ``limit`` and ``first`` ((model, route) pairs,
        read when a close mark's due windows are first sorted), those routes' due windows close before
        the others, each route's still oldest first; with ``first_only`` only those close."""
        if self._now is None or now > self._now:
            self._now = now
        upto = math.floor((now - self.grace_s) / self.length_s)
        if self._closed_end is None or upto > self._closed_end:
            self._closed_end = upto
        closed_end = self._closed_end
        if limit is None:
            self._due = None
            return self._close([k for k in self._open if k[0] + 1 <= closed_end])
        cache = self._due
        if cache is None or cache[0] != closed_end:
            stack = sorted((k for k in self._open if k[0] + 1 <= closed_end), reverse=True)
            ahead = [k for k in stack if (k[1], k[2]) in first] if first else []
            if ahead:
                stack = [k for k in stack if (k[1], k[2]) not in first]
            self._due = cache = (closed_end, stack, ahead)
        _, stack, ahead = cache
        opened = self._open
        due = _pop_due(ahead, limit, opened) if ahead else []
        if not first_only and (not due or len(due) < limit):
            due += _pop_due(stack, limit - len(due), opened)
        # emptied, the cache stays until closed_end moves: nothing can fall due before that, and the loop
        # calls this for every partition in every iteration (a look over every open window each time,
        # 7 % of the daemon's CPU at 10,000 routes)
        return self._close(due)

    def close_all(self) -> list[Signal]:
        """Close every open window now (graceful shutdown, end of a backtest)."""
        self._due = None
        keys = list(self._open)
        if keys:
            last_end = max(k[0] for k in keys) + 1
            if self._closed_end is None or last_end > self._closed_end:
                self._closed_end = last_end
        return self._close(keys)

    def _close(self, keys: list[tuple[int, str, str, str]]) -> list[Signal]:
        keys.sort()
        out = []
        ahead = self._ahead
        for key in keys:
            w = self._open.pop(key)
            if w.dirty:
                self.unencoded -= 1
            ahead.pop(key, None)
            self._closed_keys.append(key)
            out.append(w.to_signal(key[1], key[2], key[3], self.length_s))
        self.windows_closed += len(out)
        if out:
            log.debug("closed %d windows, %d still open", len(out), len(self._open))
        return out

    # --- checkpoints --------------------------------------------------------------------------

    def export_open(self) -> list[dict[str, Any]]:
        """Every open window as JSON-able data (a checkpoint); ``import_open`` restores it exactly."""
        return [w.export(key) for key, w in self._open.items()]

    def export_changes(self, everything: bool = False) -> tuple[dict[str, str], list[str]]:
        """Checkpoint fields of the windows changed since the last call (all with ``everything``), and
        the fields of the windows closed since; resets both."""
        changed, closed = self.snapshot_changes(everything)
        return {window_field(key): value for key, value in changed}, closed

    def snapshot_changes(self, everything: bool = False) -> tuple[list[tuple[WindowKey, str]], list[str]]:
        """Like ``export_changes``, but the field names are left to ``encode_snapshots`` (off the loop
        thread). Each changed window is exported and serialized here (``encode_export``: orjson, ~1 us
        a window): a save waiting for the writer holds strings, not a ``Window.snapshot`` copy of ~15
        containers a window that the writer exported again - those copies cost the two threads ~2x
        the CPU, and the cyclic collector traversed them (thousands per save) while they waited.
        A window encoded ahead (``encode_ahead``) and not changed since is taken as it was encoded:
        the same bytes as encoding it now."""
        changed = []
        ahead = self._ahead
        for key, w in self._open.items():
            if w.dirty:
                changed.append((key, encode_export(w.export(key))))
                w.dirty = False
            else:
                value = ahead.get(key)
                if value is not None:
                    changed.append((key, value))
                elif everything:
                    changed.append((key, encode_export(w.export(key))))
        self._ahead = {}
        self._ahead_keys = []
        self.unencoded = 0
        closed = [window_field(k) for k in self._closed_keys]
        self._closed_keys = []
        return changed, closed

    def mark_all_changed(self) -> None:
        """Every open window changed (the next save is a full snapshot: ``encode_ahead`` then takes
        them all a slice at a time, and a save built from here holds every open window)."""
        for w in self._open.values():
            w.dirty = True
        self._ahead = {}
        self.unencoded = len(self._open)

    def encode_ahead(self, n: int) -> int:
        """Encode up to ``n`` changed windows' checkpoint fields ahead of the next save (the save takes
        them as they are unless the window changes again); returns how many were encoded."""
        done = 0
        if not self.unencoded:
            return 0
        keys = self._ahead_keys
        at = self._ahead_at
        opened = self._open
        ahead = self._ahead
        fresh = False
        while True:  # the rest of this pass over the open windows, then (once) a pass over those open now
            while at < len(keys) and done < n and self.unencoded:
                key = keys[at]
                at += 1
                w = opened.get(key)
                if w is not None and w.dirty:
                    ahead[key] = encode_export(w.export(key))
                    w.dirty = False
                    self.unencoded -= 1
                    done += 1
            if done >= n or not self.unencoded or fresh:
                break
            keys, at, fresh = list(opened), 0, True
        self._ahead_keys, self._ahead_at = keys, at
        return done

    def import_open(self, data: list[dict[str, Any]]) -> None:
        self._due = None
        self._ahead = {}
        for d in data:
            w = Window.from_export(d)
            self._open[(w.index, str(d["m"]), str(d["r"]), str(d["p"]))] = w

    def set_closed_end(self, index: int | None) -> None:
        """Restore the "windows closed up to index" mark of a checkpoint."""
        if index is not None and (self._closed_end is None or index > self._closed_end):
            self._closed_end = index
            self._due = None

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

    def open_routes(self) -> set[tuple[str, str]]:
        """The (model, route) pairs with a window still open."""
        return {(k[1], k[2]) for k in self._open}

    def min_open_offsets(self) -> dict[PartitionKey, int]:
        """Per (topic, partition), the smallest offset of an event held in a still-open window."""
        out: dict[PartitionKey, int] = {}
        for w in self._open.values():
            for pk, off in w.offsets.items():
                prev = out.get(pk)
                if prev is None or off < prev:
                    out[pk] = off
        return out


def encode_snapshots(snapshots: list[tuple[WindowKey, Window | str]]) -> dict[str, str]:
    """Checkpoint fields (hash field -> JSON) of the windows ``snapshot_changes`` serialized (or of window
    snapshots, ``Window.snapshot``); safe on any thread (they are copies)."""
    return {window_field(key): w if isinstance(w, str) else encode_window(w, key) for key, w in snapshots}


def encode_window(w: Window, key: WindowKey) -> str:
    """One open window's checkpoint field value (JSON)."""
    return encode_export(w.export(key))


def encode_export(d: dict[str, Any]) -> str:
    """A window's ``export`` data as its checkpoint field value (JSON). orjson, ~1.5x faster than
    ``json.dumps``, writes a non-finite float as null, which would not restore: the two running float
    sums are the only floats that can overflow (events carry finite numbers), so such a window goes
    through ``json.dumps`` (``Infinity``, which ``json.loads`` reads back)."""
    f = d["f"]
    if math.isfinite(f[0]) and math.isfinite(f[1]):
        return orjson.dumps(d).decode()
    return json.dumps(d, check_circular=False)


def window_field(key: tuple[int, str, str, str]) -> str:
    """The checkpoint hash field of one open window."""
    return "w" + json.dumps(list(key))


def _pop_due(stack: list[WindowKey], n: int, opened: dict[WindowKey, Window]) -> list[WindowKey]:
    """The oldest ``n`` (at least one) open keys off a stack of due keys sorted newest first, and the
    other precisions of the last route taken."""
    while stack and stack[-1] not in opened:  # closed meanwhile (close_all)
        stack.pop()
    if len(stack) <= n:
        due = [k for k in reversed(stack) if k in opened]
        stack.clear()
        return due
    due = [stack.pop() for _ in range(max(n, 1))]
    while stack and stack[-1][:3] == due[-1][:3]:
        due.append(stack.pop())
    return [k for k in due if k in opened]
