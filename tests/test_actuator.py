"""FlagStore (the Lua flip) and Actuator (pending decisions) against real redis-servers."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import pytest

from watchdog.actuation.actuator import MISSING, PINNED, STALE, Actuator, FlagStore
from watchdog.core.keys import Flag, Keys
from watchdog.core.signals import Action
from watchdog.state.redis_conn import client_from_url

pytestmark = pytest.mark.services


@pytest.fixture
def store(redis_client: Any) -> FlagStore:
    return FlagStore(redis_client, Keys())


def rollback(model: str = "llama", route: str = "chat", **kw: Any) -> Action:
    return Action(kind="rollback", policy="quality", model=model, route=route, reason="rougeL dropped",
                  severity="critical", precision=kw.pop("precision", "fp16"), **kw)


def test_key_layout() -> None:
    k = Keys("p")
    assert k.route("m", "r") == "p:route:m:r"
    assert k.routes_index == "p:routes"
    assert k.audit == "p:audit"
    assert k.channel == "p:flags"
    assert k.state("engine") == "p:state:engine"
    assert k.heartbeat("host-1") == "p:heartbeat:host-1"
    assert k.windows == "p:windows"
    assert Keys().route("m", "r") == "llmwd:route:m:r"


def test_flip_writes_hash_audit_and_publish_together(redis_client: Any, store: FlagStore) -> None:
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys.channel)
    try:
        result = store.flip("llama", "chat", "fp16", expected_epoch=0, reason="rougeL dropped",
                            policy="quality", changed_by="test", now=1000.0)
        assert result.applied and result.epoch == 1 and result.refused is None
        raw = redis_client.hgetall("llmwd:route:llama:chat")
        assert raw["precision"] == "fp16" and raw["epoch"] == "1" and raw["policy"] == "quality"
        assert raw["reason"] == "rougeL dropped" and raw["changed_by"] == "test"
        assert float(raw["changed_at"]) == 1000.0 and "pinned_until" not in raw
        assert redis_client.sismember("llmwd:routes", "llmwd:route:llama:chat")
        (rec,) = store.audit()
        assert rec["schema"] == 1 and rec["epoch"] == 1 and rec["precision"] == "fp16"
        assert rec["previous"] == "" and rec["mode"] == "policy" and rec["op"] == "set"
        msg = None
        deadline = time.monotonic() + 2
        while msg is None and time.monotonic() < deadline:
            msg = pubsub.get_message(timeout=0.1)
        assert msg is not None
        body = json.loads(msg["data"])
        assert body["model"] == "llama" and body["route"] == "chat"
        assert body["precision"] == "fp16" and body["epoch"] == 1 and body["schema"] == 1
    finally:
        pubsub.close()


def test_stale_epoch_refused_and_nothing_written(redis_client: Any, store: FlagStore) -> None:
    assert store.flip("llama", "chat", "fp8", expected_epoch=0, reason="r", changed_by="a").applied
    stale = store.flip("llama", "chat", "fp16", expected_epoch=0, reason="r", changed_by="b")
    assert not stale.applied and stale.refused == STALE and stale.epoch == 1 and stale.precision == "fp8"
    assert store.get("llama", "chat").precision == "fp8"  # type: ignore[union-attr]
    assert redis_client.xlen(store.keys.audit) == 1
    fresh = store.flip("llama", "chat", "fp16", expected_epoch=1, reason="r", changed_by="b")
    assert fresh.applied and fresh.epoch == 2


def test_concurrent_writers_with_same_epoch_exactly_one_wins(redis_client: Any, store: FlagStore) -> None:
    results = []

    def write(i: int) -> None:
        results.append(store.flip("m", "r", f"p{i}", expected_epoch=0, reason="race", changed_by=f"w{i}"))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.applied for r in results) == 1
    assert all(r.refused == STALE for r in results if not r.applied)
    assert redis_client.xlen(store.keys.audit) == 1


def test_same_precision_is_a_noop_without_audit(redis_client: Any, store: FlagStore) -> None:
    store.flip("m", "r", "fp16", expected_epoch=None, reason="x", changed_by="a")
    again = store.flip("m", "r", "fp16", expected_epoch=None, reason="x", changed_by="a")
    assert not again.applied and again.unchanged and again.refused is None and again.epoch == 1
    assert redis_client.xlen(store.keys.audit) == 1


def test_a_retried_policy_flip_pages_once(redis_client: Any, store: FlagStore) -> None:
    """A flip applied in Redis whose reply was lost (socket timeout) is retried with the same page:
    the retry finds the route already serving the target and writes no second page. A later,
    different decision on the same route pages again."""
    from watchdog.actuation.actuator import FlipExtras

    page = json.dumps({"kind": "rollback", "route": "r", "at": 100.0})
    extras = FlipExtras("", "", "llmwd:engine:g:m:r", '{"s": 1}', "llmwd:outbox", page)
    first = store.flip("m", "r", "fp16", expected_epoch=None, reason="x", changed_by="t", extras=extras)
    again = store.flip("m", "r", "fp16", expected_epoch=None, reason="x", changed_by="t", extras=extras)
    assert first.applied and not again.applied
    assert redis_client.xlen("llmwd:outbox") == 1
    other = FlipExtras("", "", "llmwd:engine:g:m:r", '{"s": 2}', "llmwd:outbox",
                       json.dumps({"kind": "rollback", "route": "r", "at": 200.0}))
    store.flip("m", "r", "fp16", expected_epoch=None, reason="x", changed_by="t", extras=other)
    assert redis_client.xlen("llmwd:outbox") == 2
    assert store.get("m", "r") is not None and store.get("m", "r").precision == "fp16"  # type: ignore[union-attr]


def test_pin_blocks_policy_writes_until_ttl_expires(store: FlagStore) -> None:
    store.flip("m", "r", "fp8", expected_epoch=None, reason="start", changed_by="a", now=1000.0)
    pinned = store.pin("m", "r", "fp16", 30, reason="incident", changed_by="oncall", now=1000.0)
    assert pinned.applied and pinned.pinned_until == 1030.0
    blocked = store.flip("m", "r", "fp8", expected_epoch=None, reason="promote", policy="speed",
                         changed_by="daemon", now=1029.0)
    assert blocked.refused == PINNED and blocked.pinned_until == 1030.0
    assert store.get("m", "r").precision == "fp16"  # type: ignore[union-attr]
    # a manual write overrides the pin and keeps it
    manual = store.flip("m", "r", "fp8", expected_epoch=None, reason="hand", changed_by="oncall",
                        now=1010.0, manual=True)
    assert manual.applied and manual.pinned_until == 1030.0
    store.flip("m", "r", "fp16", expected_epoch=None, reason="hand", changed_by="oncall", now=1011.0,
               manual=True)
    after = store.flip("m", "r", "fp8", expected_epoch=None, reason="promote", policy="speed",
                       changed_by="daemon", now=1031.0)
    assert after.applied and after.pinned_until is None
    flag = store.get("m", "r")
    assert flag is not None and flag.pinned_until is None and flag.precision == "fp8"


def test_pin_with_real_clock_and_unpin(store: FlagStore) -> None:
    store.pin("m", "r", "fp16", 0.3, reason="brief", changed_by="oncall")
    assert store.flip("m", "r", "fp8", expected_epoch=None, reason="p", changed_by="d").refused == PINNED
    time.sleep(0.35)
    assert store.flip("m", "r", "fp8", expected_epoch=None, reason="p", changed_by="d").applied
    store.pin("m", "r", "fp16", 600, reason="long", changed_by="oncall")
    unpinned = store.unpin("m", "r", reason="done", changed_by="oncall")
    assert unpinned.applied and unpinned.pinned_until is None and unpinned.precision == "fp16"
    assert store.flip("m", "r", "fp8", expected_epoch=None, reason="p", changed_by="d").applied
    assert store.unpin("x", "y", changed_by="oncall").refused == MISSING
    with pytest.raises(ValueError):
        store.pin("m", "r", "fp16", 0, reason="zero", changed_by="oncall")


def test_manual_change_is_audited(store: FlagStore) -> None:
    store.flip("m", "r", "fp16", expected_epoch=None, reason="ticket 42", changed_by="cli:ann@box",
               manual=True)
    (rec,) = store.audit(5)
    assert rec["mode"] == "manual" and rec["changed_by"] == "cli:ann@box" and rec["reason"] == "ticket 42"
    assert rec["model"] == "m" and rec["route"] == "r" and rec["precision"] == "fp16"


def test_list_get_audit_order_and_state(redis_client: Any, store: FlagStore) -> None:
    assert store.get("none", "none") is None and store.list() == []
    for model, route in [("b", "x"), ("a", "y"), ("a", "x")]:
        store.flip(model, route, "fp16", expected_epoch=None, reason="r", changed_by="t")
    assert [(f.model, f.route) for f in store.list()] == [("a", "x"), ("a", "y"), ("b", "x")]
    assert store.snapshot() == {("a", "x"): "fp16", ("a", "y"): "fp16", ("b", "x"): "fp16"}
    assert [r["model"] + r["route"] for r in store.audit(2)] == ["ax", "ay"]  # newest first
    store.save_state("engine", '{"open": {"a/x": 3}}')
    assert json.loads(store.load_state("engine") or "") == {"open": {"a/x": 3}}
    assert store.load_state("other") is None
    with pytest.raises(ValueError):
        store.save_state("engine", "not json")
    store.heartbeat("host-1", '{"pid": 1}', ttl_s=5)
    assert 0 < redis_client.pttl("llmwd:heartbeat:host-1") <= 5000


def test_audit_stream_is_capped(redis_client: Any) -> None:
    store = FlagStore(redis_client, Keys(), audit_maxlen=10)
    for i in range(400):
        store.flip("m", "r", "fp16" if i % 2 else "fp8", expected_epoch=None, reason="x", changed_by="t")
    assert redis_client.xlen("llmwd:audit") < 400  # MAXLEN ~ trims whole macro nodes


def test_flag_parsing_works_with_bytes() -> None:
    flag = Flag.from_hash({b"precision": b"fp16", b"epoch": b"3", b"model": b"m", b"route": b"r",
                           b"pinned_until": b"12.5"})
    assert flag == Flag(model="m", route="r", precision="fp16", epoch=3, pinned_until=12.5)
    assert flag.pinned(12.0) and not flag.pinned(13.0)
    assert Flag.from_hash({}) is None


# -- Actuator ---------------------------------------------------------------------------------


def test_actuator_applies_once_and_ignores_non_flips(redis_client: Any, store: FlagStore) -> None:
    act = Actuator(store)
    assert not act.submit(Action(kind="alert", policy="p", model="m", route="r", reason="x"))
    assert not act.submit(rollback(dry_run=True))
    assert act.submit(rollback())
    assert act.pending() == 1
    (res,) = act.pump()
    assert res.applied and res.precision == "fp16" and act.pending() == 0 and act.healthy
    act.submit(rollback())
    (again,) = act.pump()
    assert again.unchanged and not again.applied
    assert redis_client.xlen(store.keys.audit) == 1
    assert act.pump() == []


def test_a_flip_told_to_wait_stays_pending_and_goes_later(redis_client: Any, store: FlagStore) -> None:
    act = Actuator(store)
    assert act.submit(rollback())
    route = next(iter(act.pending_routes()))
    assert act.pump(wait={route}) == [] and act.pending_routes() == {route}  # a save of its partition in flight
    assert store.get(*route) is None
    (res,) = act.pump(wait={("m", "another")})
    assert res.applied and act.pending() == 0


def test_actuator_retries_stale_epoch_against_fresh_state(redis_client: Any, store: FlagStore) -> None:
    store.flip("llama", "chat", "fp8", expected_epoch=0, reason="init", changed_by="t")
    store.flip("llama", "chat", "int4", expected_epoch=1, reason="someone else", changed_by="t", manual=True)
    act = Actuator(store)
    act.submit(rollback(detail={"epoch": 1}))  # decided on epoch 1, Redis is at 2 now
    (res,) = act.pump()
    assert res.applied and res.epoch == 3 and res.precision == "fp16"
    assert redis_client.xlen(store.keys.audit) == 3


def test_actuator_stale_but_target_already_served_is_done(redis_client: Any, store: FlagStore) -> None:
    store.flip("llama", "chat", "fp8", expected_epoch=0, reason="init", changed_by="t")
    store.flip("llama", "chat", "fp16", expected_epoch=1, reason="other writer", changed_by="t")
    act = Actuator(store)
    act.submit(rollback(detail={"epoch": 1}))
    (res,) = act.pump()
    assert res.unchanged and not res.applied and res.epoch == 2
    assert redis_client.xlen(store.keys.audit) == 2


def test_actuator_pin_refusal_is_final(store: FlagStore) -> None:
    store.pin("llama", "chat", "fp8", 600, reason="hold", changed_by="oncall")
    act = Actuator(store)
    act.submit(rollback())
    (res,) = act.pump()
    assert res.refused == PINNED and not res.applied and act.pending() == 0
    assert store.get("llama", "chat").precision == "fp8"  # type: ignore[union-attr]


def test_actuator_survives_redis_outage_and_applies_exactly_once(own_redis: Any) -> None:
    client = client_from_url(f"redis://{own_redis.address}/0", timeout_s=0.5)
    try:
        store = FlagStore(client, Keys())
        store.flip("llama", "chat", "fp8", expected_epoch=None, reason="init", changed_by="t")
        act = Actuator(store, backoff_initial=0.5, backoff_max=4, rng=random.Random(7))
        own_redis.kill()
        act.submit(rollback(detail={"epoch": 1}))
        t0 = 1000.0
        assert act.pump(t0) == []
        assert act.pending() == 1 and not act.healthy and act.last_error
        first_wait = act.retry_at() - t0
        assert 0.25 <= first_wait < 0.5
        assert act.pump(t0 + 0.1) == []  # still backing off: not even tried
        assert act.retry_at() - t0 == first_wait
        assert act.pump(act.retry_at()) == []
        second_wait = act.retry_at() - (t0 + first_wait)
        assert 0.5 <= second_wait < 1.0
        for _ in range(6):
            before = act.retry_at()
            assert act.pump(before) == []
            assert act.retry_at() - before < 4.0  # backoff_max
        assert act.pending() == 1

        own_redis.start()
        now = act.retry_at() - 1.0
        assert act.pump(now) == []  # backing off: Redis being back is not seen
        act.retry_now()  # another Redis operation succeeded (RedisHealth.recovered)
        (res,) = act.pump(now)
        assert res.applied and res.precision == "fp16" and res.epoch == 2
        assert act.healthy and act.last_error is None and act.pending() == 0
        assert act.pump(act.retry_at() + 100) == []
        rollbacks = [r for r in store.audit() if r["precision"] == "fp16"]
        assert len(rollbacks) == 1
        assert store.get("llama", "chat").epoch == 2  # type: ignore[union-attr]
    finally:
        client.close()


def test_actuator_backoff_is_capped(own_redis: Any) -> None:
    own_redis.kill()
    client = client_from_url(f"redis://{own_redis.address}/0", timeout_s=0.5)
    try:
        act = Actuator(FlagStore(client, Keys()), backoff_initial=0.5, backoff_max=2)
        act.submit(rollback())
        now = 0.0
        waits = []
        for _ in range(8):
            act.pump(now)
            waits.append(act.retry_at() - now)
            now = act.retry_at()
        assert all(w < 2.0 for w in waits) and max(waits) >= 1.0
        assert act.pending() == 1
    finally:
        client.close()


def test_actuator_with_failing_store_factory_stays_pending() -> None:
    calls = []

    def factory() -> FlagStore:
        calls.append(1)
        raise ConnectionRefusedError("no redis yet")

    act = Actuator(factory)
    act.submit(rollback())
    assert act.pump(0.0) == [] and act.pending() == 1 and not act.healthy
    assert "ConnectionRefusedError" in (act.last_error or "") and calls == [1]


def test_model_and_route_with_colons_name_distinct_keys(redis_client):
    from watchdog.core.keys import Keys, key_part

    keys = Keys("kp")
    assert keys.route("a:b", "c") != keys.route("a", "b:c")
    assert keys.route("llama3:8b", "chat") == "kp:route:llama3%3A8b:chat"
    assert key_part("50%:x") == "50%25%3Ax" and key_part("plain/route") == "plain/route"
    store = FlagStore(redis_client, keys)
    store.flip("a:b", "c", "fp16", expected_epoch=None, reason="t", changed_by="test")
    store.flip("a", "b:c", "fp8", expected_epoch=None, reason="t", changed_by="test")
    got = {(f.model, f.route): f.precision for f in store.list()}
    assert got == {("a:b", "c"): "fp16", ("a", "b:c"): "fp8"}


def test_redis_health_recovering_elsewhere_makes_the_failing_writer_retry_now() -> None:
    """A checkpoint that succeeds while flag writes fail keeps the daemon not ready (the writer
    has the last word) but makes the writer retry at once: readiness and the pending flips no
    longer wait out the writer's backoff after Redis comes back (drill redis-down-regression)."""
    from watchdog.core.metrics import Metrics
    from watchdog.runtime.health import Readiness, RedisHealth

    readiness = Readiness(Metrics(), lambda *a: None, lambda *a: None)
    health = RedisHealth(readiness, Metrics(), lambda: 0.0)
    calls: list[int] = []
    health.retry_writer = lambda: calls.append(1)
    health.writer(False, "ConnectionError: refused")
    assert not health.ok and readiness.problems()
    health.recovered()
    assert calls == [1] and not health.ok  # still not ready until a flag write goes through
    health.writer(True, None)
    health.recovered()
    assert health.ok and calls == [1]
