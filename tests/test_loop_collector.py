"""The main loop runs the cyclic collector itself (watchdog/runtime/collector.py): the young generation
and a freeze of what survived every iteration, everything when the frozen heap grew by ``FULL_GROWTH``.
Cyclic garbage is still collected, however long it lived, and memory stays flat."""

from __future__ import annotations

import gc
import sys
import weakref
from collections import deque
from collections.abc import Iterator

import pytest

from watchdog.runtime import collector
from watchdog.runtime.collector import LoopCollector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> tuple[Node, weakref.ref[Node]]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


@pytest.fixture
def loop_gc() -> Iterator[LoopCollector]:
    was = gc.isenabled()
    c = LoopCollector()
    c.enter()
    try:
        yield c
    finally:
        c.exit()
    assert gc.isenabled() == was and gc.get_freeze_count() == 0


def test_automatic_collection_is_off_while_a_loop_runs_and_back_after() -> None:
    c = LoopCollector()
    c.enter()
    c.enter()  # a second daemon of the process
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    c.exit()
    assert not gc.isenabled()  # the other loop still runs
    c.exit()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_cycle_that_dies_within_an_iteration_is_freed_by_that_iterations_pass(loop_gc: LoopCollector) -> None:
    ref = cycle()[1]
    assert ref() is not None  # automatic collection is off: nothing else frees it
    loop_gc.collect()
    assert ref() is None
    assert [g for g, _ in loop_gc.pauses.take()] == [0]  # the pass is timed for the slow-loop line and the metric


def test_what_survives_an_iterations_pass_is_frozen_so_the_next_pass_walks_only_what_is_new(
        loop_gc: LoopCollector) -> None:
    kept = [Node() for _ in range(20_000)]
    frozen = gc.get_freeze_count()
    loop_gc.collect()
    assert gc.get_freeze_count() >= frozen + len(kept)
    assert len(gc.get_objects(0)) + len(gc.get_objects(1)) + len(gc.get_objects(2)) < 1_000
    assert {g for g, _ in loop_gc.pauses.take()} == {0}


def test_a_cycle_that_died_after_it_was_frozen_is_freed_once_the_heap_grew(loop_gc: LoopCollector,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collector, "GROWTH_CHECK_S", 0.0)
    node, ref = cycle()
    loop_gc.collect()  # it lived past an iteration: frozen
    del node
    loop_gc.collect()
    assert ref() is not None  # frozen: only a full collection frees it
    grown = [[i] for i in range(int(loop_gc.base * collector.FULL_GROWTH) + 1_000)]  # a block or more each
    loop_gc.collect()
    assert ref() is None
    assert 2 in {g for g, _ in loop_gc.pauses.take()}
    assert loop_gc.base >= len(grown)  # the next full pass waits for the heap to grow from here


def test_memory_stays_bounded_when_cycles_die_after_they_were_frozen(loop_gc: LoopCollector,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collector, "GROWTH_CHECK_S", 0.0)
    start = sys.getallocatedblocks()
    alive: deque[list[Node]] = deque()
    most = fulls = 0
    for _ in range(600):
        alive.append([cycle()[0] for _ in range(2_000)])  # lives 3 iterations: frozen, then dies
        if len(alive) > 3:
            alive.popleft()
        loop_gc.collect()
        fulls += sum(g == 2 for g, _ in loop_gc.pauses.take())
        most = max(most, sys.getallocatedblocks())
    # 1.2M dead cycles (2 objects each): without the full passes the heap would hold them all
    assert fulls >= 1
    assert most < (1 + collector.FULL_GROWTH) * start + 4 * 2_000 * 10
