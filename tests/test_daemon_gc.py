"""The main loop runs the cyclic collector itself (watchdog/runtime/collector.py): automatic collection
off and the start-up heap frozen once the loop starts, each pass timed into ``llmwd_gc_seconds``, and
both undone by ``shutdown`` (tests and embedding apps run several daemons per process)."""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.daemon_harness import make_config, running_daemon, write_policy
from tests.helpers import wait_until

pytestmark = pytest.mark.services


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_loop_runs_the_collector_and_shutdown_gives_it_back(kafka_service, redis_service, topic, tmp_path):
    assert gc.isenabled()
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    with running_daemon(cfg) as (daemon, _server):
        wait_until(lambda: not gc.isenabled(), 30, what="the loop running the collector itself")
        assert gc.get_freeze_count() > 0
        # cyclic garbage made while the loop runs (here on another thread) is still collected by its passes
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
        wait_until(lambda: ref() is None, 10, what="the loop's young pass freeing a dead cycle")
        young = daemon.metrics.gc_seconds.labels("0")
        wait_until(lambda: young._sum.get() > 0, 10, what="the young passes timed")
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
