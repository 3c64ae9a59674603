"""RoutingFlags, the gateway-side reader, against real redis-servers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import wait_until
from watchdog.actuation.actuator import FlagStore
from watchdog.actuation.routing import RoutingFlags
from watchdog.core.keys import Keys
from watchdog.state.redis_conn import client_from_url

pytestmark = pytest.mark.services


def wait_for(pred: Callable[[], bool], timeout: float = 3.0) -> float:
    """Seconds until ``pred()`` held; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.002)
    return time.monotonic() - t0


def url_of(svc: Any) -> str:
    return f"redis://{svc.address}/0"


def test_reader_sees_a_flip_from_another_client_quickly(redis_service: Any, redis_client: Any) -> None:
    store = FlagStore(redis_client, Keys())
    store.flip("llama", "chat", "fp8", expected_epoch=None, reason="init", changed_by="t")
    with RoutingFlags(url_of(redis_service), ttl_s=60) as reader:
        assert reader.wait_ready(3)
        assert reader.precision_for("llama", "chat") == "fp8"
        lags = []
        for i, precision in enumerate(["fp16", "fp8", "fp16"]):
            t0 = time.monotonic()
            store.flip("llama", "chat", precision, expected_epoch=i + 1, reason="r", changed_by="t")
            wait_for(lambda p=precision: reader.precision_for("llama", "chat") == p)  # type: ignore[misc]
            lags.append(time.monotonic() - t0)
        # pub/sub delivers in well under a millisecond; allow for a loaded 2-core machine
        assert sorted(lags)[1] < 0.1, lags
        # each change came as a message: the last one may still be on its way, because a message's
        # detail read (HGETALL) can already bring the next flip, which the cache then serves first
        wait_for(lambda: reader.messages == 3)
        flag = reader.flag("llama", "chat")
        assert flag is not None and flag.epoch == 4
        wait_for(lambda: (reader.flag("llama", "chat") or flag).changed_by == "t")
        assert reader.snapshot() == {("llama", "chat"): "fp16"}


def test_unknown_route_gets_the_default(redis_service: Any, redis_client: Any) -> None:
    with RoutingFlags(url_of(redis_service), default_precision="fp16") as reader:
        assert reader.wait_ready(3)
        assert reader.precision_for("nobody", "nowhere") == "fp16"
        assert reader.flag("nobody", "nowhere") is None and reader.snapshot() == {}


def test_prefixes_are_separate(redis_service: Any, redis_client: Any) -> None:
    FlagStore(redis_client, Keys("other")).flip("m", "r", "fp16", expected_epoch=None, reason="x",
                                                changed_by="t")
    with RoutingFlags(url_of(redis_service), Keys("llmwd")) as reader:
        assert reader.wait_ready(3)
        assert reader.precision_for("m", "r") == "fp8"


def test_periodic_refresh_catches_writes_that_bypass_pubsub(redis_service: Any, redis_client: Any) -> None:
    with RoutingFlags(url_of(redis_service), ttl_s=0.2) as reader:
        assert reader.wait_ready(3)
        keys = Keys()
        redis_client.hset(keys.route("m", "r"), mapping={"model": "m", "route": "r", "precision": "fp16",
                                                        "epoch": "1"})
        redis_client.sadd(keys.routes_index, keys.route("m", "r"))
        wait_for(lambda: reader.precision_for("m", "r") == "fp16", timeout=2)
        assert reader.messages == 0


def test_reader_reloads_every_flag_only_when_something_moved(redis_service: Any, redis_client: Any) -> None:
    """With 2,000 routes the periodic check is one round trip while nothing changes; a write that
    bypassed pub/sub but left a trace (a new route in the index, an audit record), or Redis losing
    its data, triggers the full reload at the next check; and one happens after ``full_reload_s``
    regardless (an out-of-band HSET that left no trace)."""
    keys = Keys()
    pipe = redis_client.pipeline(transaction=False)
    for i in range(2000):
        pipe.hset(keys.route("m", f"r{i}"), mapping={"model": "m", "route": f"r{i}", "precision": "fp8", "epoch": "1"})
        pipe.sadd(keys.routes_index, keys.route("m", f"r{i}"))
    pipe.execute()
    with RoutingFlags(url_of(redis_service), ttl_s=0.05, full_reload_s=1.5) as reader:
        assert reader.wait_ready(3) and len(reader.snapshot()) == 2000
        time.sleep(0.5)
        assert reader.reloads == 1  # ten checks, no reload
        FlagStore(redis_client, keys).flip("m", "r7", "fp16", expected_epoch=1, reason="r", changed_by="t")
        wait_for(lambda: reader.precision_for("m", "r7") == "fp16")
        wait_for(lambda: reader.reloads == 2)  # the audit record moved: one reload (pub/sub had it already)
        redis_client.hset(keys.route("m", "r9"), "precision", "fp16")  # no trace: only the full reload
        redis_client.hset(keys.route("m", "r9"), "epoch", "5")
        wait_for(lambda: reader.precision_for("m", "r9") == "fp16", timeout=4)
        redis_client.flushall()
        wait_for(lambda: reader.snapshot() == {}, timeout=1)


def test_redis_killed_serves_last_known_and_recovers(own_redis: Any) -> None:
    client = client_from_url(url_of(own_redis))
    try:
        store = FlagStore(client, Keys())
        store.flip("llama", "chat", "fp16", expected_epoch=None, reason="r", changed_by="t")
        with RoutingFlags(url_of(own_redis), ttl_s=60, reconnect_s=0.1) as reader:
            assert reader.wait_ready(3) and reader.healthy
            own_redis.kill()
            wait_for(lambda: not reader.healthy, timeout=3)
            assert reader.precision_for("llama", "chat") == "fp16"  # last known, not the default
            assert reader.precision_for("other", "route") == "fp8"
            assert reader.last_error
            own_redis.start()
            # a change made right after the restart is seen, whether by reload or by message
            store.flip("llama", "chat", "fp8", expected_epoch=None, reason="r", changed_by="t")
            wait_for(lambda: reader.precision_for("llama", "chat") == "fp8", timeout=5)
            wait_for(lambda: reader.healthy, timeout=3)
    finally:
        client.close()


def test_reader_started_without_redis_serves_default(own_redis: Any) -> None:
    own_redis.kill()
    with RoutingFlags(url_of(own_redis), reconnect_s=0.1) as reader:
        assert not reader.wait_ready(0.3)
        assert reader.precision_for("m", "r") == "fp8" and not reader.healthy
        own_redis.start()
        assert reader.wait_ready(5)
        assert reader.healthy


def test_needs_a_url_or_factory() -> None:
    with pytest.raises(ValueError):
        RoutingFlags()


def test_an_unexpected_error_in_the_reader_is_reported_and_survived(redis_service: Any, redis_client: Any) -> None:
    """Anything but a Redis error used to end the reader's thread while ``healthy`` stayed True, so the
    gateway served stale flags for ever; now it is unhealthy with the error and reconnects."""
    store = FlagStore(redis_client, Keys())
    store.flip("llama", "chat", "fp8", expected_epoch=None, reason="init", changed_by="t")
    reader = RoutingFlags(url_of(redis_service), ttl_s=0.05, full_reload_s=0.05, reconnect_s=0.2, start=False)
    real_refresh, real_unhealthy = reader.refresh, reader._mark_unhealthy
    calls: list[int] = []
    errors: list[str] = []

    def refresh_once_broken(client: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug in the flag decoder")
        real_refresh(client)

    def unhealthy(exc: BaseException) -> None:
        errors.append(str(exc))
        real_unhealthy(exc)

    reader.refresh = refresh_once_broken  # type: ignore[method-assign]
    reader._mark_unhealthy = unhealthy  # type: ignore[method-assign]
    reader.start()
    with reader:
        assert reader.wait_ready(3)
        wait_for(lambda: len(calls) >= 3)
        assert errors == ["a bug in the flag decoder"]
        wait_for(lambda: reader.healthy)
        assert reader._thread is not None and reader._thread.is_alive()
        store.flip("llama", "chat", "fp16", expected_epoch=1, reason="r", changed_by="t")
        wait_for(lambda: reader.precision_for("llama", "chat") == "fp16")


@pytest.mark.parametrize("factory_error", [ValueError("Redis URL must specify a scheme"), None])
def test_an_outage_that_repeats_logs_once_not_a_traceback_per_retry(factory_error: Exception | None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    def failing() -> Any:
        raise factory_error  # type: ignore[misc]

    kwargs: dict[str, Any] = {"client_factory": failing} if factory_error else {"redis_url": "redis://127.0.0.1:1/0"}
    caplog.set_level("INFO", logger="watchdog.actuation.routing")
    reader = RoutingFlags(**kwargs, reconnect_s=0.01, timeout_s=0.2)
    try:
        wait_for(lambda: reader.last_error is not None)
        time.sleep(0.4)  # dozens of retries
        assert not reader.healthy and reader.precision_for("m", "r") == "fp8"  # the default serves meanwhile
    finally:
        reader.close()
    records = [r for r in caplog.records if r.name == "watchdog.actuation.routing"]
    assert sum(r.exc_info is not None for r in records) <= 1
    assert len(records) <= 2, [r.getMessage() for r in records]


def test_the_cache_remembers_a_pin_whose_flag_vanished_until_it_sees_the_route_unpinned(
        redis_service: Any, redis_client: Any) -> None:
    """``RoutingFlags.pins``: a pin the cache saw stays there when its flag vanishes (Redis restarted
    empty), however soon after it was written, so the daemon can put it back (``Decisions.lost_pins``);
    it goes once the route's flag is seen without a pin."""
    store = FlagStore(redis_client, Keys())
    with RoutingFlags(url_of(redis_service), ttl_s=0.1) as reader:
        assert reader.wait_ready(3)
        store.pin("m", "held", "fp16", 600, reason="INC-1", changed_by="op")
        redis_client.flushall()  # right after the write: the cache may never hold the flag for long
        wait_until(lambda: reader.flag("m", "held") is None and ("m", "held") in reader.pins, 5,
                   what="the flag gone from the cache, its pin kept")
        pin = reader.pins[("m", "held")]
        assert pin.precision == "fp16" and pin.pinned_until is not None and pin.pinned(time.time())
        store.flip("m", "held", "fp8", expected_epoch=None, reason="unpinned", changed_by="op")
        wait_until(lambda: reader.flag("m", "held") is not None and ("m", "held") not in reader.pins, 5,
                   what="the pin forgotten once the flag is seen without one")
