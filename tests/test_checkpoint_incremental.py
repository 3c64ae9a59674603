"""Checkpoints that cost what changed (issue 19 item 1): incremental saves restore exactly what a full
save would, the loop builds snapshots that the writer thread encodes, a zombie's save is refused, a
flip waits for a save in flight, and a checkpoint written before the packed window form still loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from watchdog.config.settings import load_config
from watchdog.core.events import decode_event
from watchdog.core.keys import Keys
from watchdog.core.metrics import Metrics
from watchdog.ingest.eventtime import Watermarks
from watchdog.policy import PolicyEngine
from watchdog.policy.loader import load_policy_files
from watchdog.policy.state import ScopeState
from watchdog.runtime.checkpointer import Checkpointer
from watchdog.runtime.stats import DaemonStats
from watchdog.state import partitions as P
from watchdog.state.checkpoint import FENCED, SAVED, SCHEMA, CheckpointStore
from watchdog.windows.aggregator import WindowAggregator
from watchdog.windows.fleet import cell_list, unpack_cells
from watchdog.windows.sketch import QuantileSketch

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parent.parent
POLICY = "fp8-default"
TOPIC = "t"


class _Letters:
    def settled(self, pk: Any, timeout_s: float = 0.0) -> bool:
        return True


class _Ingest:
    def __init__(self) -> None:
        self.next_offset: dict[P.PartitionKey, int] = {}
        self.dead_letters = _Letters()
        self.mirrored: list[dict[P.PartitionKey, int]] = []

    def position(self, pk: P.PartitionKey) -> int:
        return self.next_offset.get(pk, 0)

    def commit_mirror(self, offsets: dict[P.PartitionKey, int]) -> None:
        self.mirrored.append(dict(offsets))

    def set_final_offset(self, pk: P.PartitionKey, offset: int) -> None:
        pass


class _Actuator:
    def pending_routes(self) -> set[P.Route]:
        return set()


class _Health:
    ok = True

    def failed(self, exc: BaseException, what: str) -> None:
        raise AssertionError(f"{what}: {exc}")

    def recovered(self) -> None:
        pass


class _Ownership:
    def __init__(self) -> None:
        self.parts: dict[P.PartitionKey, P.Partition] = {}
        self.topic_id = None
        self.fenced: list[P.PartitionKey] = []

    def fence(self, pk: P.PartitionKey) -> None:
        self.fenced.append(pk)
        self.parts.pop(pk, None)


def _rig(client: Any, instance: str = "a") -> tuple[Checkpointer, P.Partition, _Ingest, _Ownership]:
    cfg = load_config(None, **{"policies": [str(ROOT / "policies" / "default.yaml")],
                               "kafka": {"topic": TOPIC, "group_id": "g"}, "server": {"port": 0}, "instance": instance})
    keys = Keys(cfg.redis.prefix)
    store = CheckpointStore(client, keys, "g", TOPIC, instance)
    engine = PolicyEngine(load_policy_files([str(ROOT / "policies" / "default.yaml")]))
    own = _Ownership()
    ingest = _Ingest()
    pk = (TOPIC, 0)
    claim = store.claim(0)
    part = P.Partition(pk, claim.token, claim.seq, WindowAggregator(length_s=10.0, grace_s=0.0), full=True)
    own.parts[pk] = part
    ingest.next_offset[pk] = 0
    ck = Checkpointer(cfg, keys, client, store, engine, Watermarks(2.0, 300.0), own, _Actuator(),  # type: ignore[arg-type]
                      _Health(), Metrics(), DaemonStats())  # type: ignore[arg-type]
    ck.attach(ingest)  # type: ignore[arg-type]
    return ck, part, ingest, own


def _fold(ck: Checkpointer, part: P.Partition, ingest: _Ingest, route: str, ts: float, n: int = 5) -> None:
    for i in range(n):
        off = ingest.next_offset[part.pk]
        ev = decode_event(json.dumps({"schema": 1, "request_id": f"{route}-{ts}-{i}", "ts": ts + i * 0.01, "model": "m",
                                      "route": route, "precision": "fp8", "status": "ok", "latency_ms": 100.0 + 7 * i,
                                      "ttft_ms": 20.0 + i, "prompt_tokens": 10 + i, "completion_tokens": 5,
                                      "replica": f"pod-{i % 2}"}).encode())
        assert part.agg.add(ev, part.pk, off)
        ingest.next_offset[part.pk] = off + 1
    part.routes.add(("m", route))
    part.dirty = True
    ck.engine.states[(POLICY, "m", route)] = ScopeState(healthy=n)
    part.dirty_routes.add(("m", route))


def _restored(client: Any) -> tuple[dict[str, Any], list[dict[str, Any]], dict[P.Route, dict[str, Any]]]:
    """What a replica claiming partition 0 now reads: meta, open windows, engine states."""
    store = CheckpointStore(client, Keys(), "g", TOPIC, "reader")
    claim = store.claim(0)
    assert claim.data is not None
    routes = sorted((str(m), str(r)) for m, r in claim.data["routes"])
    return claim.data, claim.data["windows"], store.load_engines(routes)


def _by_key(windows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(w["i"], w["m"], w["r"], w["p"]): w for w in orjson.loads(orjson.dumps(windows))}


def test_incremental_saves_write_what_changed_and_restore_what_a_full_save_would(redis_client) -> None:
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(20):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    ck.checkpoint(1.0)  # the loop's save: built here, written by the writer thread
    ck.drain()
    assert part.inflight is None and part.seq == 1
    first = int(ck.metrics.checkpoint_bytes.labels("0")._value.get())
    # two routes take events, one route's engine state changes, the windows of 100 s close later
    _fold(ck, part, ingest, "r3", 101.0)
    _fold(ck, part, ingest, "r7", 102.0)
    sent: list[Any] = []
    real = ck.writer.submit
    ck.writer.submit = lambda pk, token, save, built_s, at: (sent.append(save), real(pk, token, save, built_s, at))  # type: ignore[method-assign]
    ck.checkpoint(1000.0)
    ck.drain()
    (save,) = sent
    assert sorted(save.changed) == sorted(['w[10, "m", "r3", "fp8"]', 'w[10, "m", "r7", "fp8"]'])
    assert sorted(save.engines) == sorted([ck.keys.engine("g", "m", "r3"), ck.keys.engine("g", "m", "r7")])
    assert save.incremental and save.size < first / 5
    # a new window opens for r1, the old ones close: their fields are deleted, the new one added
    _fold(ck, part, ingest, "r1", 125.0)
    part.agg.close_due(122.0)
    ck.checkpoint(2000.0)
    ck.drain()
    assert len(sent) == 2 and len(sent[1].closed) == 20 and list(sent[1].changed) == ['w[12, "m", "r1", "fp8"]']
    data, windows, engines = _restored(redis_client)
    assert data["offset"] == ingest.next_offset[part.pk] and data["closed_end"] == part.agg.closed_end
    assert _by_key(windows) == _by_key(part.agg.export_open())
    assert engines == {r: {"schema": SCHEMA, "scopes": {POLICY: ck.engine.states[(POLICY, *r)].to_json()}}
                       for r in sorted(part.routes)}
    assert ingest.mirrored[-1] == {part.pk: ingest.next_offset[part.pk]}  # mirrored after Redis had it
    # llmwd_checkpoint_seconds covers build + encode + write, llmwd_checkpoint_loop_seconds the loop's part
    reg = ck.metrics.registry
    total, loop = (reg.get_sample_value(f"llmwd_checkpoint{m}_seconds_sum") for m in ("", "_loop"))
    assert reg.get_sample_value("llmwd_checkpoint_seconds_count") == 3
    assert reg.get_sample_value("llmwd_checkpoint_loop_seconds_count") == 3
    assert total is not None and loop is not None and total > loop > 0


def test_a_save_writes_the_snapshot_taken_with_its_offset(redis_client) -> None:
    """Events folded after the loop built a save (while the writer encodes it) are not in it."""
    ck, part, ingest, _own = _rig(redis_client)
    _fold(ck, part, ingest, "r", 100.0, n=5)
    save = ck.build_save(part, 1.0, [], [])
    offset = ingest.next_offset[part.pk]
    _fold(ck, part, ingest, "r", 101.0, n=7)  # the loop carries on before the write
    assert ck.checkpoints.save(0, part.token, save) == SAVED
    data, windows, _ = _restored(redis_client)
    assert data["offset"] == offset
    (w,) = windows
    assert w["n"][0] == 5 and QuantileSketch.load(w["lat"]).count == 5


def test_a_zombie_replicas_writer_thread_save_is_refused(redis_client) -> None:
    ck, part, ingest, own = _rig(redis_client)
    _fold(ck, part, ingest, "r", 100.0)
    ck.checkpoint(1.0)
    ck.drain()
    CheckpointStore(redis_client, Keys(), "g", TOPIC, "b").claim(0)  # another replica takes the partition
    _fold(ck, part, ingest, "r", 101.0)
    ck.checkpoint(1000.0)
    ck.drain()
    assert own.fenced == [part.pk]
    assert ck.metrics.checkpoints.labels(FENCED)._value.get() == 1
    assert int(redis_client.hget(Keys().checkpoint("g", TOPIC, 0), "seq")) == 1


def test_a_flip_waits_for_the_save_in_flight_of_its_partition(redis_client) -> None:
    ck, part, ingest, _own = _rig(redis_client)
    _fold(ck, part, ingest, "r", 100.0)
    ck.writer.start()
    gate = __import__("threading").Event()
    real = ck.checkpoints.save

    def slow(*a: Any, **kw: Any) -> str:
        gate.wait(5)
        return real(*a, **kw)

    ck.checkpoints.save = slow  # type: ignore[method-assign]
    ck.checkpoint(1.0)
    assert ck.writer.busy(part.pk)
    assert ck.saving({("m", "other"), ("m", "r")}) == {("m", "r")}  # not its routes: no wait; never blocks
    assert ck.writer.busy(part.pk)
    gate.set()
    ck.drain()
    assert ck.saving({("m", "r")}) == set()
    assert not ck.writer.busy(part.pk) and part.inflight is None and part.seq == 1


def test_a_checkpoint_written_before_the_packed_window_form_restores(redis_client) -> None:
    """Migration: windows saved with ``QuantileSketch.to_dict`` and ``cell_list`` (the form before
    issue 19) load into the same windows; nothing is dropped, no log needed."""
    ck, part, ingest, _own = _rig(redis_client)
    for k in range(3):
        _fold(ck, part, ingest, f"r{k}", 100.0)
    ck.offload = False
    save = ck.build_save(part, 1.0, [], [])
    save.encode()
    for field_name, raw in list(save.changed.items()):
        d = json.loads(raw)
        d["lat"] = QuantileSketch.unpack(d["lat"]).to_dict()
        d["ttft"] = QuantileSketch.unpack(d["ttft"]).to_dict()
        fl = d["fleet"]
        fl["cells"] = cell_list(unpack_cells(fl["cells"]))
        fl["rep"] = {k: {"lat": QuantileSketch.unpack(r["lat"]).to_dict(), "cells": cell_list(unpack_cells(r["cells"]))}
                     for k, r in fl["rep"].items()}
        save.changed[field_name] = json.dumps(d)
    save.blob = json.dumps({**json.loads(save.blob), "schema": 1})
    assert ck.checkpoints.save(0, part.token, save) == SAVED
    _data, windows, _ = _restored(redis_client)
    again = WindowAggregator(length_s=10.0, grace_s=0.0)
    again.import_open(windows)
    want = {(s.route, s.start): s.detail for s in part.agg.close_all()}
    got = {(s.route, s.start): s.detail for s in again.close_all()}
    assert got == want and len(got) == 3


def test_a_checkpoint_of_an_unknown_schema_is_ignored_with_one_line(redis_client, caplog) -> None:
    """A checkpoint this release cannot read (a later release's) is not half-read: the partition
    starts from the committed offset, and one warning says so."""
    ck, part, ingest, _own = _rig(redis_client)
    _fold(ck, part, ingest, "r", 100.0)
    save = ck.build_save(part, 1.0, [], [])
    save.blob = json.dumps({**json.loads(save.blob), "schema": 99})
    assert ck.checkpoints.save(0, part.token, save) == SAVED
    caplog.set_level("WARNING", logger="watchdog.state.checkpoint")
    claim = CheckpointStore(redis_client, Keys(), "g", TOPIC, "b").claim(0)
    assert claim.data is None and claim.seq == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "watchdog.state.checkpoint"]
    assert "ignoring checkpoint of schema 99" in line and "\n" not in line


def test_a_full_snapshot_replaces_the_hash(redis_client) -> None:
    """Window fields of a checkpoint that was ignored (unknown schema) must not come back at the next
    restore: a full save carries every open window and replaces the hash."""
    ck, part, ingest, _own = _rig(redis_client)
    key = Keys().checkpoint("g", TOPIC, 0)
    redis_client.hset(key, 'w[1, "m", "stale", "fp8"]', '{"i": 1}')
    _fold(ck, part, ingest, "r", 100.0)
    assert part.full
    ck.checkpoint(1.0)
    ck.drain()
    assert part.seq == 1
    _data, windows, _ = _restored(redis_client)
    assert [w["r"] for w in windows] == ["r"]


def test_redis_losing_the_checkpoint_makes_the_next_save_a_full_one(redis_client) -> None:
    """``RESYNC`` from the writer thread: the records of the refused save go with the next save, a
    full snapshot built like any other (its checks run again), with the same sequence number."""
    ck, part, ingest, _own = _rig(redis_client)
    _fold(ck, part, ingest, "a", 100.0)
    ck.checkpoint(1.0)
    ck.drain()
    redis_client.delete(Keys().checkpoint("g", TOPIC, 0))  # Redis restarted without persistence
    _fold(ck, part, ingest, "b", 101.0)
    part.unsaved.append('{"record": 1}')
    ck.checkpoint(1000.0)
    ck.drain()
    assert part.inflight is None and part.full and part.unsaved == ['{"record": 1}'] and part.seq == 1
    ck.checkpoint(2000.0)
    ck.drain()
    assert part.seq == 2 and not part.full
    data, windows, _ = _restored(redis_client)
    assert data["offset"] == ingest.next_offset[part.pk]
    assert _by_key(windows) == _by_key(part.agg.export_open())
    assert redis_client.xlen(Keys().windows) == 1
