"""Crash-only (issue 18 item 6): an unexpected exception in the main loop leaves without a
checkpoint or a drain - the state it would save may be what broke - and the next start restores
the last good checkpoint; a long-lived thread that dies is a readiness reason."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.daemon_harness import make_config, running_daemon, traffic, write_policy
from tests.helpers import wait_until
from watchdog.runtime.daemon import Daemon


def test_an_unexpected_exception_exits_without_a_checkpoint_and_the_next_start_restores(
        kafka_service, redis_service, redis_client, topic, tmp_path) -> None:
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    daemon = Daemon(cfg)
    thread_error: list[BaseException] = []

    def run() -> None:
        try:
            daemon.run()
        except RuntimeError as exc:
            thread_error.append(exc)

    with traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for):
        t = threading.Thread(target=run, daemon=True)
        t.start()
        wait_until(lambda: daemon.stats.windows_closed >= 2 and daemon.stats.checkpoints > 0, 40)
        saved_before = daemon.stats.checkpoints
        saves: list[int] = []
        crashed: list[bool] = []
        real_save = daemon.checkpointer.save

        def counting_save(*a, **kw):  # type: ignore[no-untyped-def]
            if crashed:  # saves of the loop before the crash are fine
                saves.append(1)
            return real_save(*a, **kw)

        def broken_close(now: float) -> list:  # type: ignore[type-arg]
            crashed.append(True)
            raise RuntimeError("a bug in window closing")

        daemon.checkpointer.save = counting_save  # type: ignore[method-assign]
        daemon.closer.close_windows = broken_close  # type: ignore[method-assign]
        t.join(timeout=30)
        assert not t.is_alive()
        assert [str(e) for e in thread_error] == ["a bug in window closing"]
        assert saves == []  # no checkpoint of the state that broke, no drain
        # the next start restores the last good checkpoint and carries on
        assert saved_before > 0
        with running_daemon(cfg) as (again, _server):
            # the partitions come back with the windows the last good checkpoint had closed
            wait_until(lambda: again.parts and all((p.agg.closed_end or 0) > 0 for p in again.parts.values()), 40,
                       what="partitions restored from the last good checkpoint")
            wait_until(lambda: again.stats.windows_closed >= 2, 40, what="windows closing again")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_thread_is_a_readiness_reason(kafka_service, redis_service, redis_client, topic, tmp_path) -> None:
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for):
        wait_until(lambda: httpx.get(f"{server.url}/readyz").status_code == 200, 40)
        ticker = next(t for t in daemon.health.threads if t.name == "readiness")
        real_tick = daemon.readiness.tick

        def tick_once_broken(now: float) -> None:
            if threading.current_thread() is ticker:
                raise RuntimeError("ticker bug")
            real_tick(now)

        daemon.readiness.tick = tick_once_broken  # type: ignore[method-assign]
        ticker.join(timeout=5)
        assert not ticker.is_alive()
        daemon.readiness.tick = real_tick  # type: ignore[method-assign]
        body = wait_until(lambda: (r := httpx.get(f"{server.url}/readyz")).status_code == 503 and r.text, 20)
        assert "thread-died" in body and "readiness" in body
