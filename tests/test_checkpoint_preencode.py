"""Engine states encoded ahead of their partition's save (``Checkpointer.preencode``): a save writes
exactly the states a save built in one go would, a route judged again after it was encoded is encoded
anew, a policy reload or a new owner of the partition drops what was encoded, and a save waits (a
bounded number of spacings) while many judged routes are not encoded yet."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from tests.test_checkpoint_incremental import POLICY, _fold, _restored, _rig
from watchdog.runtime import checkpointer as C
from watchdog.state import partitions as P
from watchdog.state.checkpoint import PACKED, SCHEMA, PendingSave

pytestmark = pytest.mark.services


def _judge(ck: C.Checkpointer, part: P.Partition, now: float) -> set[P.Route]:
    """Close the due windows and judge them as ``Decisions._decide_now`` does (the engine's own
    ``observe``, then the judged routes marked dirty)."""
    signals = part.agg.close_due(now)
    ck.engine.observe(signals, now, {}, "fp8")
    touched = {(s.model, s.route) for s in signals}
    part.dirty_routes |= touched & part.routes
    part.dirty = True
    return touched


def _capture(ck: C.Checkpointer) -> list[PendingSave]:
    sent: list[PendingSave] = []
    real = ck.writer.submit

    def submit(pk: Any, token: str, save: PendingSave, built_s: float, at: float) -> None:
        sent.append(save)
        real(pk, token, save, built_s, at)

    ck.writer.submit = submit  # type: ignore[method-assign]
    return sent


def _fresh(ck: C.Checkpointer, routes: set[P.Route]) -> dict[str, str]:
    """The engine-state values a save built now, in one go, writes for ``routes``."""
    by_route = P.engine_states_by_route(ck.engine, routes)
    packed = ck.cfg.redis.pack_engine_state
    return {ck.keys.engine("g", m, r): P.engine_value(by_route[(m, r)], packed) for m, r in routes if (m, r) in by_route}


@pytest.mark.parametrize("packed", [False, True], ids=["json", "packed"])
def test_a_save_writes_what_a_save_built_in_one_go_would(redis_client, packed: bool) -> None:
    ck, part, ingest, _own = _rig(redis_client)
    ck.cfg.redis.pack_engine_state = packed
    routes = [f"r{k}" for k in range(60)]
    for r in routes:
        _fold(ck, part, ingest, r, 100.0)
    ck.checkpoint(1.0)
    ck.drain()
    sent = _capture(ck)
    for r in routes:
        _fold(ck, part, ingest, r, 110.0)
    judged = _judge(ck, part, 121.0)
    assert len(judged) == 60 and len(part.dirty_routes) == 60
    assert ck.preencode(10.0) == 60 and not part.dirty_routes
    # a third of the routes are judged again after their state was encoded: their encoding is stale
    for r in routes[:20]:
        _fold(ck, part, ingest, r, 120.0)
    for r in routes[40:]:
        _fold(ck, part, ingest, r, 130.0)
    again = _judge(ck, part, 131.0)
    assert {r for _m, r in again} == set(routes[:20])
    ck.checkpoint(1000.0)
    ck.drain()
    (save,) = sent
    assert save.engines == _fresh(ck, part.routes)
    assert all(v.startswith(PACKED) == packed for v in save.engines.values())
    _data, _windows, engines = _restored(redis_client)
    assert engines == {r: {"schema": SCHEMA, "scopes": {POLICY: ck.engine.states[(POLICY, *r)].to_json()}}
                       for r in sorted(part.routes)}


def test_a_full_save_takes_the_encoded_states_and_encodes_the_rest(redis_client) -> None:
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(10):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    ck.preencode(10.0)
    ck.engine.states[(POLICY, "m", "r0")].healthy = 99  # changed: Decisions marks it dirty
    part.dirty_routes.add(("m", "r0"))
    sent = _capture(ck)
    assert part.full
    ck.checkpoint(1.0)
    ck.drain()
    (save,) = sent
    assert not save.incremental and save.engines == _fresh(ck, part.routes)
    assert json.loads(save.engines[ck.keys.engine("g", "m", "r0")])["scopes"][POLICY]["healthy"] == 99


def test_a_policy_reload_or_a_new_owner_drops_what_was_encoded(redis_client) -> None:
    ck, part, ingest, own = _rig(redis_client)
    for k in range(5):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    ck.checkpoint(1.0)
    ck.drain()
    _fold(ck, part, ingest, "r1", 101.0)
    _fold(ck, part, ingest, "r2", 101.0)
    ck.preencode(10.0)
    assert not part.dirty_routes
    # a reload rewrites states without marking their routes dirty (set_policy_set drops changed rules)
    ck.engine.set_policy_set(dataclasses.replace(ck.engine.policy_set))
    ck.engine.states[(POLICY, "m", "r1")].healthy = 42
    sent = _capture(ck)
    ck.checkpoint(1000.0)
    ck.drain()
    (save,) = sent
    assert save.engines == _fresh(ck, {("m", "r1"), ("m", "r2")})
    # the partition revoked and assigned again: a new Partition, nothing encoded for the old one is used
    _fold(ck, part, ingest, "r3", 102.0)
    ck.preencode(10.0)
    ck.engine.states[(POLICY, "m", "r3")].healthy = 7
    again = P.Partition(part.pk, part.token, part.seq, part.agg, routes=set(part.routes), full=False)
    own.parts[part.pk] = again
    again.dirty = True
    ck.checkpoint(2000.0)
    ck.drain()
    assert len(sent) == 2 and sent[1].engines == {}


def test_a_save_waits_while_many_judged_routes_are_not_encoded(redis_client, monkeypatch) -> None:
    monkeypatch.setattr(C, "PREENCODE_MAX_LEFT", 5)
    monkeypatch.setattr(C, "PREENCODE_WAIT_SAVES", 2)
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(30):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    t = 1000.0
    ck.preencode(10.0)  # a first save waits for preencode too (test_checkpoint_windows_ahead.py)
    ck.checkpoint(t)  # nothing left to encode: saved at once
    ck.drain()
    assert part.seq == 1
    part.last_cost_s = 0.0  # the spacing is checkpoint_every_s, however slow this machine is
    sent = _capture(ck)
    for k in range(30):
        _fold(ck, part, ingest, f"r{k}", 101.0)
    calls: list[float] = []
    real = ck.preencode

    def encode_nothing(budget_s: float) -> int:
        calls.append(budget_s)
        return 0

    monkeypatch.setattr(ck, "preencode", encode_nothing)
    every = ck.cfg.redis.checkpoint_every_s
    ck.checkpoint(t + 1.5 * every)  # due, but 30 routes wait: preencode goes first
    assert sent == [] and calls == [C.PREENCODE_BUDGET_S]
    ck.checkpoint(t + 3.5 * every)  # waited (1 + 2) spacings: saved anyway, every route encoded here
    ck.drain()
    part.last_cost_s = 0.0
    assert len(sent) == 1 and sent[0].engines == _fresh(ck, part.routes)
    for k in range(30):
        _fold(ck, part, ingest, f"r{k}", 102.0)
    monkeypatch.setattr(ck, "preencode", real)
    ck.checkpoint(t + 4.0 * every)  # not due yet: this call only encodes
    assert len(sent) == 1 and len(part.dirty_routes) == 0
    ck.checkpoint(t + 4.6 * every)  # due and nothing left to encode: saved at once
    ck.drain()
    assert len(sent) == 2 and sent[1].engines == _fresh(ck, part.routes)


def test_a_full_save_has_its_engine_states_encoded_ahead(redis_client, monkeypatch) -> None:
    """A first save (or one after ``RESYNC``) writes every route's engine state: ``preencode`` takes
    them a slice per iteration, the save waits for it, then writes them all, a route without state
    left out as before."""
    monkeypatch.setattr(C, "PREENCODE_MAX_LEFT", 5)
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(30):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    _fold(ck, part, ingest, "stateless", 100.0)
    del ck.engine.states[(POLICY, "m", "stateless")]
    part.dirty_routes.clear()  # nothing judged: only the full save wants the states
    sent = _capture(ck)
    t = 1000.0
    part.last_save = t - 1.5 * ck.cfg.redis.checkpoint_every_s
    ck.checkpoint(t)
    assert sent == [] and not part.dirty_routes and part.full  # waited; preencode took all 31
    ck.checkpoint(t + 0.01)
    ck.drain()
    (save,) = sent
    assert not save.incremental and save.engines == _fresh(ck, part.routes) and len(save.engines) == 30


def test_nothing_is_encoded_ahead_while_a_save_waits_to_be_resent(redis_client) -> None:
    """Redis did not take a save (it stays in ``part.inflight`` for a resend): no build comes before
    Redis answers, so judged routes stay in ``dirty_routes`` rather than as copies in memory."""
    ck, part, ingest, _own = _rig(redis_client)
    _fold(ck, part, ingest, "a", 100.0)
    part.inflight = ck.build_save(part, 1.0, [], [])  # built, not taken by Redis (the write failed)
    _fold(ck, part, ingest, "b", 101.0)
    assert ck.preencode(10.0) == 0 and part.dirty_routes == {("m", "b")}
    part.inflight = None
    assert ck.preencode(10.0) == 1 and not part.dirty_routes


def test_the_wait_for_preencode_counts_from_when_the_routes_are_judged(redis_client, monkeypatch) -> None:
    """A save refused while its routes' closed windows wait to be judged (a close burst at 10,000 routes)
    has an old ``last_save`` once they are judged: it still waits ``PREENCODE_WAIT_SAVES`` x ``checkpoint_every_s``
    from then for ``preencode``, rather than encoding every judged route of the partition at once."""
    monkeypatch.setattr(C, "PREENCODE_MAX_LEFT", 5)
    monkeypatch.setattr(C, "PREENCODE_WAIT_SAVES", 2)
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(30):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    t = 1000.0
    ck.preencode(10.0)
    ck.checkpoint(t)
    ck.drain()
    assert part.seq == 1
    part.last_cost_s = 0.0
    sent = _capture(ck)
    for k in range(30):
        _fold(ck, part, ingest, f"r{k}", 101.0)
    monkeypatch.setattr(ck, "preencode", lambda budget_s: 0)
    every = ck.cfg.redis.checkpoint_every_s
    ck.deferred_routes = lambda: {("m", "r3")}
    ck.checkpoint(t + 10 * every)  # refused: a route of it is not judged yet
    assert sent == []
    ck.deferred_routes = set
    ck.checkpoint(t + 11 * every)  # judged now; last saved 11 spacings ago, but preencode goes first
    assert sent == []
    ck.checkpoint(t + 13.5 * every)  # 2 x checkpoint_every_s after it was last refused: saved anyway
    ck.drain()
    assert len(sent) == 1 and sent[0].engines == _fresh(ck, part.routes)


def test_past_the_iterations_deadline_only_an_overdue_save_is_built(redis_client, monkeypatch) -> None:
    """A loop iteration whose deadline judging spent builds no save unless one is overdue (then one),
    and gives preencode a slice, not PREENCODE_BUDGET_S: at 10,000 routes those made 0.25-0.3 s
    iterations after every window boundary."""
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(10):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    ck.preencode(10.0)
    t = 1000.0
    ck.checkpoint(t)
    ck.drain()
    part.last_cost_s = 0.0
    sent = _capture(ck)
    every = ck.cfg.redis.checkpoint_every_s
    calls: list[float] = []
    real = ck.preencode

    def counted(budget_s: float) -> int:
        calls.append(budget_s)
        return real(budget_s)

    monkeypatch.setattr(ck, "preencode", counted)
    ck.step.start(-1.0)  # this iteration's deadline is spent
    _fold(ck, part, ingest, "r1", 101.0)
    ck.checkpoint(t + 2 * every)  # due, not overdue: it waits for an iteration with time
    assert sent == [] and part.dirty and calls[-1] <= 0
    ck.checkpoint(t + C.SAVE_OVERDUE_SAVES * every)  # overdue: built even past the deadline
    ck.drain()
    assert len(sent) == 1
    part.last_cost_s = 0.0
    _fold(ck, part, ingest, "r2", 102.0)
    ck.step.start(10.0)  # an iteration with time: the next due save goes at once
    ck.checkpoint(t + (C.SAVE_OVERDUE_SAVES + 1.5) * every)
    ck.drain()
    assert len(sent) == 2


def test_while_records_wait_in_kafka_preencode_gets_a_slice_only_for_a_waiting_save(redis_client, monkeypatch) -> None:
    """Records waiting in Kafka (``Checkpointer.reading_behind``): what is left of the iteration's deadline goes
    to reading them. No preencode while no save waits for it (the windows being read change with the next
    poll); a slice (budget 0) while one waits, as past the deadline; the saves themselves as before."""
    monkeypatch.setattr(C, "PREENCODE_MAX_LEFT", 5)
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(10):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    ck.preencode(10.0)
    t = 1000.0
    ck.checkpoint(t)
    ck.drain()
    part.last_cost_s = 0.0
    sent = _capture(ck)
    every = ck.cfg.redis.checkpoint_every_s
    calls: list[float] = []
    real = ck.preencode

    def counted(budget_s: float) -> int:
        calls.append(budget_s)
        return real(budget_s)

    monkeypatch.setattr(ck, "preencode", counted)
    ck.step.start(10.0)  # an iteration with time left
    ck.reading_behind = True
    for k in range(3):
        _fold(ck, part, ingest, f"r{k}", 101.0)
    ck.checkpoint(t + 0.5 * every)  # not due, nothing waits: no preencode while records wait
    assert calls == [] and sent == [] and len(part.dirty_routes) == 3
    ck.reading_behind = False
    ck.checkpoint(t + 0.6 * every)  # caught up: the rest of the deadline goes to preencode, as before
    assert len(calls) == 1 and calls[0] > C.PREENCODE_BUDGET_S and not part.dirty_routes
    ck.reading_behind = True
    for k in range(40):  # more than a slice (PREENCODE_SLICE)
        _fold(ck, part, ingest, f"r{k}", 102.0)
    ck.checkpoint(t + 1.5 * every)  # due, but 40 routes wait for preencode: it gets a slice
    assert sent == [] and calls[1:] == [0.0] and len(part.dirty_routes) == 40 - C.PREENCODE_SLICE
    ck.checkpoint(t + 1.6 * every)  # 8 left, more than PREENCODE_MAX_LEFT: another slice
    assert sent == [] and calls[2:] == [0.0] and not part.dirty_routes
    ck.checkpoint(t + 1.7 * every)  # nothing left to encode: saved, the states as a save built in one go
    ck.drain()
    assert len(sent) == 1 and sent[0].engines == _fresh(ck, part.routes)


def test_a_save_waits_for_preencode_only_while_something_is_left_to_encode(redis_client, monkeypatch) -> None:
    """``save_waits_for_preencode``: the loop does not wait for records while it is True (daemon.step), so it
    must turn False once preencode has nothing left, even before the save that waited is built."""
    monkeypatch.setattr(C, "PREENCODE_MAX_LEFT", 5)
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(10):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    ck.preencode(10.0)
    t = 1000.0
    ck.checkpoint(t)
    ck.drain()
    part.last_cost_s = 0.0
    assert not ck.save_waits_for_preencode()
    for k in range(10):
        _fold(ck, part, ingest, f"r{k}", 101.0)
    assert not ck.save_waits_for_preencode()  # not due yet: nothing waits
    real = ck.preencode
    monkeypatch.setattr(ck, "preencode", lambda budget_s: 0)
    ck.checkpoint(t + 1.5 * ck.cfg.redis.checkpoint_every_s)  # due; 10 routes not encoded: it waits
    assert ck.save_waits_for_preencode()
    real(10.0)
    assert not part.dirty_routes and not ck.save_waits_for_preencode()
