"""Open windows encoded ahead of their partition's save (``WindowAggregator.encode_ahead``, called by
``Checkpointer.preencode`` a slice at a time): a save writes exactly the fields a save built in one go
would, and no loop iteration encodes more than ``PREENCODE_MAX_WINDOWS`` windows plus one slice, even
for the full snapshot of a partition with many open windows (which main encoded in one go: 0.25-0.54 s
of one iteration at 10,000 routes). Counted in encodings, not timed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.test_checkpoint_incremental import _by_key, _restored, _rig
from tests.test_checkpoint_preencode import _capture
from watchdog.core.events import decode_event
from watchdog.runtime import checkpointer as C
from watchdog.state.checkpoint import PendingSave
from watchdog.windows import aggregator as A
from watchdog.windows.aggregator import WindowAggregator


def _event(route: str, precision: str, ts: float, i: int = 0) -> Any:
    return decode_event(json.dumps({"schema": 1, "request_id": f"{route}-{precision}-{ts}-{i}", "ts": ts,
                                    "model": "m", "route": route, "precision": precision, "status": "ok",
                                    "latency_ms": 50.0 + i, "prompt_tokens": 3, "completion_tokens": 4}).encode())


@pytest.fixture
def encodings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``[n]``: windows encoded since the test last reset it (every encoding goes through ``encode_export``)."""
    count = [0]
    real = A.encode_export

    def counting(d: dict[str, Any]) -> str:
        count[0] += 1
        return real(d)

    monkeypatch.setattr(A, "encode_export", counting)
    yield count


def _fill(agg: WindowAggregator, routes: int, windows: int, offset: int = 0) -> int:
    for r in range(routes):
        for k in range(windows):
            for prec in ("fp8", "fp16"):
                assert agg.add(_event(f"r{r}", prec, 100.0 + 10 * k), ("t", 0), offset)
                offset += 1
    return offset


def test_windows_encoded_ahead_give_the_fields_and_bytes_of_a_save_built_in_one_go() -> None:
    ahead, plain = (WindowAggregator(length_s=10.0, grace_s=0.0, max_future_s=float("inf")) for _ in range(2))
    for agg in (ahead, plain):
        _fill(agg, 20, 3)
    assert ahead.unencoded == plain.unencoded == 120
    assert ahead.encode_ahead(50) == 50 and ahead.unencoded == 70
    # changed after they were encoded (encoded anew), closed after (only in ``closed``), not encoded yet
    for agg in (ahead, plain):
        assert agg.add(_event("r0", "fp8", 100.5, 1), ("t", 0), 999)
        assert agg.add(_event("r19", "fp16", 120.5, 1), ("t", 0), 999)
        assert len(agg.close_due(110.0)) == 40
    assert ahead.unencoded < plain.unencoded == 80  # the changed windows still open, less those encoded
    assert ahead.export_changes() == plain.export_changes()
    assert ahead.unencoded == 0 and ahead.encode_ahead(50) == 0
    # after a save: only what changes again, and a full snapshot holds every open window either way
    for agg in (ahead, plain):
        assert agg.add(_event("r3", "fp8", 110.5, 2), ("t", 0), 1000)
    assert ahead.unencoded == 1 and ahead.encode_ahead(50) == 1
    assert ahead.snapshot_changes(everything=True) == plain.snapshot_changes(everything=True)
    ahead.mark_all_changed()
    assert ahead.unencoded == ahead.open_windows() == 80
    assert ahead.encode_ahead(1000) == 80
    assert ahead.export_changes() == plain.export_changes(everything=True)


def _iterate(ck: C.Checkpointer, t: float, encodings: list[int], sent: list[PendingSave]) -> list[int]:
    """Call ``checkpoint`` as loop iterations whose shared deadline has passed (each does its one slice),
    until a save is built; the windows each call encoded."""
    per_call = []
    for i in range(200):
        encodings[0] = 0
        ck.step.start(0.0)  # the iteration's deadline: passed
        ck.checkpoint(t + 0.1 * i)
        per_call.append(encodings[0])
        if sent:
            break
    ck.step.until = float("inf")
    return per_call



def _never_saved(redis_client: Any) -> tuple[C.Checkpointer, Any, Any, int, list[PendingSave]]:
    """A partition with 600 open windows (50 routes x 6), never saved (its first save is a full one),
    and the list its saves are captured in; (checkpointer, partition, ingest, next offset, saves)."""
    ck, part, ingest, _own = _rig(redis_client)
    ingest.next_offset[part.pk] = off = _fill(part.agg, 50, 6)
    part.routes |= {("m", f"r{r}") for r in range(50)}
    part.dirty = True
    return ck, part, ingest, off, _capture(ck)


@pytest.mark.services
def test_a_full_save_of_many_open_windows_never_encodes_more_than_a_slice_past_the_limit(
        redis_client, encodings, monkeypatch) -> None:
    monkeypatch.setattr(C, "PREENCODE_BUDGET_S", 0.0)  # one slice per call, however fast this machine is
    ck, part, _ingest, _off, sent = _never_saved(redis_client)
    assert part.full and part.agg.unencoded == 600
    per_call = _iterate(ck, 1000.0, encodings, sent)  # never saved (due at once): it waits all the same
    assert len(per_call) > 1 and max(per_call) <= C.PREENCODE_MAX_WINDOWS + C.PREENCODE_SLICE, per_call
    ck.drain()
    (save,) = sent
    assert not save.incremental and len(save.changed) == 600
    _data, windows, _engines = _restored(redis_client)
    assert _by_key(windows) == _by_key(part.agg.export_open())


@pytest.mark.services
def test_windows_changed_after_they_were_encoded_are_saved_as_they_are_now(redis_client, encodings,
                                                                         monkeypatch) -> None:
    monkeypatch.setattr(C, "PREENCODE_BUDGET_S", 0.0)
    ck, part, ingest, off, sent = _never_saved(redis_client)
    for i in range(6):  # some windows encoded ahead, the save not due yet
        ck.step.start(0.0)
        ck.checkpoint(0.0 + 0.01 * i)
    assert not sent and part.agg.unencoded < 600
    for r in range(0, 50, 7):  # every window of these routes changes again, encoded or not
        for k in range(6):
            assert part.agg.add(_event(f"r{r}", "fp16", 100.5 + 10 * k, 9), part.pk, off)
            off += 1
    ingest.next_offset[part.pk] = off
    part.last_save = -10.0
    _iterate(ck, 100.0, encodings, sent)
    ck.drain()
    _data, windows, _engines = _restored(redis_client)
    assert _by_key(windows) == _by_key(part.agg.export_open())
    assert _data["offset"] == off


@pytest.mark.services
def test_the_full_save_after_redis_lost_the_checkpoint_is_encoded_ahead_too(redis_client, encodings,
                                                                           monkeypatch) -> None:
    monkeypatch.setattr(C, "PREENCODE_BUDGET_S", 0.0)
    ck, part, ingest, off, sent = _never_saved(redis_client)
    _iterate(ck, 1000.0, encodings, sent)
    ck.drain()
    assert part.seq == 1 and not part.full
    redis_client.delete(ck.checkpoints.keys.checkpoint("g", "t", 0))  # Redis lost it (no persistence)
    assert part.agg.add(_event("r1", "fp8", 100.7, 5), part.pk, off)
    ingest.next_offset[part.pk] = off + 1
    part.dirty = True
    part.last_cost_s = 0.0
    sent.clear()
    _iterate(ck, part.last_save + 10.0, encodings, sent)  # an incremental save of one window: RESYNC
    ck.drain()
    assert part.full and part.agg.unencoded == 600
    sent.clear()
    per_call = _iterate(ck, part.last_save + 1.5 * ck.cfg.redis.checkpoint_every_s, encodings, sent)
    assert max(per_call) <= C.PREENCODE_MAX_WINDOWS + C.PREENCODE_SLICE, per_call
    ck.drain()
    assert not sent[0].incremental and part.seq == 2
    _data, windows, _engines = _restored(redis_client)
    assert _by_key(windows) == _by_key(part.agg.export_open())
