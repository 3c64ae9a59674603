"""The main loop's collector settings (``LOOP_GC_THRESHOLDS``): set once the loop starts, the start-up heap
frozen, and both undone by ``shutdown`` (tests and embedding apps run several daemons per process)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.daemon_harness import make_config, running_daemon, write_policy
from tests.helpers import wait_until
from watchdog.runtime.daemon import LOOP_GC_THRESHOLDS

pytestmark = pytest.mark.services


def test_the_loop_collects_less_often_and_shutdown_puts_the_collector_back(kafka_service, redis_service, topic,
                                                                           tmp_path):
    before = gc.get_threshold()
    assert before != LOOP_GC_THRESHOLDS
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    with running_daemon(cfg):
        wait_until(lambda: gc.get_threshold() == LOOP_GC_THRESHOLDS, 30,
                   what="the loop running with its collector thresholds")
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_survivors_of_a_full_collection_are_frozen_and_handed_back_now_and_then() -> None:
    """After each full collection its survivors leave the collector's reach (the next full collections
    walk only what the loop allocated since); every ``REFREEZE_EVERY_S`` the frozen heap is handed back,
    so a cycle that became garbage after it was frozen is still collected."""
    from watchdog.runtime.daemon import _LoopGC

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    saved = gc.get_threshold()
    loop_gc = _LoopGC()
    loop_gc.enter()
    try:
        kept: Cycle | None = Cycle()
        ref = weakref.ref(kept)
        gc.collect()  # a full collection: its survivors (kept among them) are frozen
        assert loop_gc.frozen == 1 and gc.get_freeze_count() > 0
        kept = None  # now garbage, but frozen: not collected ...
        gc.collect()
        assert ref() is not None
        loop_gc._thawed -= 10 ** 6  # ... until the frozen heap is handed back
        gc.collect()
        assert loop_gc.thawed == 1 and gc.get_freeze_count() == 0
        gc.collect()  # the cycle is collected (and the survivors frozen again)
        assert ref() is None and loop_gc.frozen >= 2
    finally:
        loop_gc.exit()
    assert loop_gc.after_collection not in gc.callbacks
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == saved
