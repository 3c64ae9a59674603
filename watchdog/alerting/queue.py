"""One channel's waiting messages: in order per incident, several incidents at once.

:class:`DeliveryQueue` is pure bookkeeping (no thread, no socket, no clock of its own): it holds the
messages waiting for one channel and hands out the next one that may go now. A message may go when
it is due and no earlier message of the same incident is waiting or in flight, so a resolve never
overtakes its trigger, while a message waiting out a retry holds back only its own incident.
``take_group`` hands out several incidents' messages at once (storm grouping), by the same rule.

Two kinds of message share the queue. An in-memory one (``entry`` None: ops alerts, the CLI) exists
only here; when more than ``max_queue`` of them are held, the oldest waiting one is dropped. A
durable one (``entry`` set: a page from the Redis outbox) is a copy of a Redis stream entry; the
worker fetches only as many as its window allows, so none is ever dropped here, and one abandoned
at stop stays in Redis for the next start. :class:`PageSource` is what the worker fetches durable
messages from and acknowledges them to (``watchdog.actuation.pages`` implements it on Redis).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from watchdog.alerting.message import Alert


@dataclass(slots=True)
class Delivery:
    """One message on its way to one channel: the attempts so far and when the next is due."""

    alert: Alert
    attempt: int = 0
    due: float = 0.0
    #: monotonic time of the first attempt (for the give-up age of durable messages)
    first_try: float | None = None
    #: id of the message in its durable store (a Redis stream entry); None when in memory only
    entry: str | None = None
    #: called once the message is delivered (True) or given up (False); not when abandoned at stop
    done: Callable[[bool], None] | None = None
    #: monotonic time the message joined the queue (storm grouping waits from it)
    queued_at: float = 0.0
    #: storm grouping: the messages with the same ``batch`` go together and with no other (a group
    #: being retried, so it keeps its id; a part of a group the receiver refused); None: free to join
    #: any group
    batch: int | None = None

    @property
    def durable(self) -> bool:
        return self.entry is not None


class DeliveryQueue:
    """Messages waiting for one channel; ``take`` marks one in flight, ``finish``/``retry`` end it."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._items: deque[Delivery] = deque()
        self._busy: dict[str, int] = {}  # incident key -> messages of it in flight (0 or 1)
        self._in_flight: list[Delivery] = []
        self._held = {False: 0, True: 0}  # messages held (waiting or in flight), by durable

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Delivery, front: bool = False) -> list[Delivery]:
        """Queue ``item``; returns the in-memory messages dropped to keep within ``max_queue``
        (messages in flight count against it too, so the bound holds for what the process holds)."""
        if front:
            self._items.appendleft(item)
        else:
            self._items.append(item)
        self._held[item.durable] += 1
        dropped: list[Delivery] = []
        while self._held[False] > self.max_queue:
            oldest = next((d for d in self._items if not d.durable), None)
            if oldest is None:
                break
            self._items.remove(oldest)
            self._held[False] -= 1
            dropped.append(oldest)
        return dropped

    def take(self, now: float) -> Delivery | float | None:
        """The first message that may go now (marked in flight); else the seconds until one may
        (a retry falling due), or None when every waiting message waits on one in flight."""
        blocked = {k for k, n in self._busy.items() if n}
        wait: float | None = None
        for item in self._items:
            key = item.alert.key
            if key in blocked:
                continue
            if item.due <= now:
                return self._mark([item])[0]
            wait = item.due - now if wait is None else min(wait, item.due - now)
            blocked.add(key)  # later messages of this incident wait behind it
        return wait

    def take_group(self, now: float, limit: int, wait_s: float,
                   groupable: Callable[[Delivery], bool]) -> list[Delivery] | float | None:
        """Storm grouping: the messages that may go now as one group (marked in flight), the first
        of each incident only, at most ``limit``; a message that ``groupable`` refuses goes alone,
        before any group.
        A group goes once its oldest message has waited ``wait_s`` since it was queued, or once it
        holds ``limit``; until then, the seconds to wait (None as for ``take``). Messages with a
        ``batch`` go as that batch, at once, with no other message."""
        blocked = {k for k, n in self._busy.items() if n}
        wait: float | None = None
        group: list[Delivery] = []
        batches: dict[int, list[Delivery]] = {}
        alone: Delivery | None = None
        for item in self._items:
            key = item.alert.key
            if key in blocked:
                continue
            blocked.add(key)  # later messages of this incident wait behind this one
            if item.due > now:
                wait = item.due - now if wait is None else min(wait, item.due - now)
            elif not groupable(item):
                alone = alone or item
            elif item.batch is not None:
                batches.setdefault(item.batch, []).append(item)
            elif len(group) < limit:
                group.append(item)
        if alone is not None:  # never held for grouping, nor behind the full groups of a backlog
            return self._mark([alone])
        if batches:  # then a batch: its messages are the oldest, back in front after a failure
            return self._mark(next(iter(batches.values())))
        if group:
            ready_at = min(d.queued_at for d in group) + wait_s
            if len(group) >= limit or ready_at <= now:
                return self._mark(group)
            wait = ready_at - now if wait is None else min(wait, ready_at - now)
        return wait

    def _mark(self, group: list[Delivery]) -> list[Delivery]:
        """Take ``group`` out of the waiting messages and mark it in flight."""
        taken = {id(d) for d in group}
        self._items = deque(d for d in self._items if id(d) not in taken)
        for item in group:
            self._busy[item.alert.key] = 1
            self._in_flight.append(item)
        return group

    def finish(self, item: Delivery) -> None:
        """``item`` was delivered or given up: its incident's next message may go."""
        self._busy.pop(item.alert.key, None)
        if item in self._in_flight:
            self._in_flight.remove(item)
            self._held[item.durable] -= 1

    def retry(self, item: Delivery) -> list[Delivery]:
        """Put ``item`` back in front of its incident's later messages (its ``due`` set by the caller)."""
        self.finish(item)
        return self.put(item, front=True)

    def in_memory(self) -> int:
        """In-memory messages held, waiting or in flight."""
        return self._held[False]

    def durable(self) -> int:
        """Durable messages held, waiting or in flight (the worker's fetch window)."""
        return self._held[True]

    def in_flight(self) -> int:
        return len(self._in_flight)

    def drop_durable(self) -> int:
        """Forget the waiting durable messages (their store still has them); returns how many."""
        keep = [d for d in self._items if not d.durable]
        dropped = len(self._items) - len(keep)
        self._items = deque(keep)
        self._held[True] -= dropped
        return dropped

    def drain(self) -> list[Delivery]:
        """Remove and return every waiting message (at stop)."""
        out = list(self._items)
        self._items.clear()
        for d in out:
            self._held[d.durable] -= 1
        return out


class PageSource(Protocol):
    """Where a channel's durable pages wait: handed out in order, acknowledged by id. Never raises.
    ``fetch`` returns None when this process may not deliver the channel now (another replica does):
    the worker then forgets the pages it holds but has not sent."""

    def fetch(self, channel: str, n: int) -> list[tuple[str, Alert]] | None: ...

    def ack(self, channel: str, entry: str) -> None: ...

    def ack_many(self, channel: str, entries: list[str]) -> None:
        """Several pages are done at once (a grouped message): one round trip, so a crash cannot
        leave half of a delivered group to be sent again."""
        ...


def acker(source: PageSource, channel: str, entry: str) -> Callable[[bool], None]:
    """A durable page is done for its channel, delivered or given up: acknowledge it by its own id."""
    def done(_ok: bool) -> None:
        source.ack(channel, entry)
    return done
