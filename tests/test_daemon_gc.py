"""The main loop's collector settings (``LOOP_GC_THRESHOLDS``): set once the loop starts, the start-up heap
frozen, and both undone by ``shutdown`` (tests and embedding apps run several daemons per process)."""

from __future__ import annotations

import gc

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
