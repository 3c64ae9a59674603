"""Event time: per-partition watermarks, idle partitions, and the time up to which windows may close.

Modelled on Flink's bounded-out-of-orderness watermarks with idle sources, on kafka-python:

* a partition's watermark is the newest event time read from it minus the allowed out-of-orderness
  (``out_of_order_s``, the window grace);
* a partition is *idle* when the broker confirmed, at time ``T``, that nothing is left to read
  (our position >= its end offset, asked with a bounded ``end_offsets`` request) and no record came
  since; an idle partition does not hold the others back, it only caps the close time at
  ``min(T, E(T)) - out_of_order_s``, where ``E(T)`` is the *events' clock* at ``T``: the newest event
  time seen (or restored from a checkpoint) plus the time elapsed since it was seen. The close time
  never runs ahead of what the events support, so a host clock that steps forward cannot close
  windows (nor persist a "closed up to" mark) ahead of the events still to come;
* windows close up to the minimum over the assigned partitions; a partition that may still hold
  records (behind, or not confirmed caught up) and has not delivered any holds everything back.

Every ``now`` and ``T`` here is the daemon's steady clock (``watchdog.runtime.clock.SteadyClock``:
wall time advanced by the monotonic clock, no steps). It is used only through broker confirmations
and the events' clock, so a frozen broker, a poll or a commit that hangs, or a loop that stalls is a
*stall* (nothing closes), never lateness.

An event is validated before it can move a watermark: stamped beyond ``now + max_future_s`` it is
rejected as ``future`` (it would otherwise push the watermark ahead and make every later event late).
"""

from __future__ import annotations

from dataclasses import dataclass

PartitionKey = tuple[str, int]


@dataclass(slots=True)
class PartitionClock:
    #: newest valid event time read (restored from the checkpoint after a restart)
    max_ts: float | None = None
    #: (steady) time the broker last confirmed this partition had nothing more to read
    caught_up_at: float | None = None
    #: (steady) time of the last record read from it
    last_record_at: float | None = None
    #: (steady) time the watermark last moved forward
    advanced_at: float | None = None
    #: our position when we last had read everything the broker reported: a record at or past it
    #: was appended after we were caught up, so its event time is live (see ``live_from``)
    live_from: int | None = None


class Watermarks:
    def __init__(self, out_of_order_s: float, max_future_s: float) -> None:
        self.out_of_order_s = out_of_order_s
        self.max_future_s = max_future_s
        self.parts: dict[PartitionKey, PartitionClock] = {}
        #: the events' clock: newest event time read by this process, and the ``now`` it was read at
        self._seen: tuple[float, float] | None = None
        #: the same over restored checkpoints (their ``max_ts`` at restore time): only ever behind
        self._restored: tuple[float, float] | None = None
        #: the same over live events only (read after their partition was caught up): the tail of an
        #: old backlog is the newest event read, but says nothing about the producers' clock
        self._live: tuple[float, float] | None = None

    # -- partitions ----------------------------------------------------------------------------
    def assign(self, pk: PartitionKey, max_ts: float | None, now: float) -> None:
        self.parts[pk] = PartitionClock(max_ts=max_ts, advanced_at=now)
        if max_ts is not None and (self._restored is None or max_ts > self._restored[0]):
            self._restored = (max_ts, now)

    def revoke(self, pk: PartitionKey) -> None:
        self.parts.pop(pk, None)

    # -- events --------------------------------------------------------------------------------
    def is_future(self, ts: float, now: float) -> bool:
        return ts > now + self.max_future_s

    def observe(self, pk: PartitionKey, ts: float, now: float, offset: int | None = None) -> None:
        """A valid event of ``pk`` at ``offset`` (already checked: not future, not late)."""
        pc = self.parts.get(pk)
        if pc is None:
            pc = self.parts[pk] = PartitionClock()
        if pc.max_ts is None or ts > pc.max_ts:
            pc.max_ts = ts
            pc.advanced_at = now
            seen = self._seen
            if seen is None or ts > seen[0] + (now - seen[1]):
                self._seen = (ts, now)
        if offset is not None and pc.live_from is not None and offset >= pc.live_from:
            live = self._live
            if live is None or ts > live[0] + (now - live[1]):
                self._live = (ts, now)

    def live_from(self, positions: dict[PartitionKey, int]) -> None:
        """``positions``: partitions read up to the log end the broker last reported, at these
        offsets. Records read from there on were appended after, so their times are live."""
        for pk, pos in positions.items():
            pc = self.parts.get(pk)
            if pc is not None:
                pc.live_from = pos

    def events_now(self, now: float, restored: bool = False, live: bool = False) -> float | None:
        """The events' clock at ``now``: the newest event time read plus the time since it was read
        (with ``restored``, checkpoints' ``max_ts`` count too, as of their restore; with ``live``,
        only events read after their partition was caught up); None before any."""
        best: float | None = None
        marks = (self._live,) if live else (self._seen, self._restored if restored else None)
        for mark in marks:
            if mark is not None:
                t = mark[0] + max(0.0, now - mark[1])
                best = t if best is None else max(best, t)
        return best

    def records_read(self, pks: set[PartitionKey], now: float) -> None:
        """``pks`` returned records in the last poll: they are not idle any more."""
        for pk in pks:
            pc = self.parts.get(pk)
            if pc is not None:
                pc.last_record_at = now
                pc.caught_up_at = None

    def confirm_caught_up(self, pk: PartitionKey, asked_at: float) -> None:
        """The broker said, in answer to a request sent at ``asked_at``, that ``pk`` is fully read."""
        pc = self.parts.get(pk)
        if pc is not None and (pc.last_record_at is None or pc.last_record_at <= asked_at):
            pc.caught_up_at = asked_at

    # -- the close time ------------------------------------------------------------------------
    def mark(self, pk: PartitionKey) -> float | None:
        pc = self.parts.get(pk)
        return None if pc is None or pc.max_ts is None else pc.max_ts - self.out_of_order_s

    def close_time(self, now: float) -> float | None:
        """Windows ending at or before this may close; None while some partition holds them back."""
        if not self.parts:
            return None
        active: list[float] = []
        caps: list[float] = []
        for pc in self.parts.values():
            if pc.caught_up_at is not None:
                caps.append(pc.caught_up_at - self.out_of_order_s)
                continue
            if pc.max_ts is None:
                return None  # may hold records and has delivered none: wait for it
            active.append(pc.max_ts - self.out_of_order_s)
        if caps:
            # an idle partition's cap never runs ahead of the events' clock (module docstring)
            events = self.events_now(now, restored=True)
            if events is None:
                if not active:
                    return None  # no event seen at all: nothing to close
            else:
                limit = events - self.out_of_order_s
                caps = [min(c, limit) for c in caps]
        t = min(active) if active else min(caps)
        if caps:
            t = min(t, min(caps))
        return min(t, now)

    def stuck(self, now: float, after_s: float) -> list[PartitionKey]:
        """Partitions that keep delivering records while their watermark has not moved for ``after_s``.

        A watermark at or ahead of ``now - after_s`` is not stuck however long since it last moved: an
        accepted event stamped up to ``max_future_s`` ahead pins ``max_ts`` until wall time catches up,
        while the events behind it still count."""
        out = []
        for pk, pc in self.parts.items():
            if pc.last_record_at is None or now - pc.last_record_at > 5.0:
                continue
            if pc.max_ts is not None and pc.max_ts >= now - after_s:
                continue
            since = pc.advanced_at
            if since is not None and now - since > after_s:
                out.append(pk)
        return out
