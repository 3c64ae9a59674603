"""The checkpoint form of an open window (``encode_window``): orjson's bytes parse to what
``json.dumps`` of the same export gives and restore the window exactly; a window whose running float
sums overflowed is written with ``json.dumps`` (orjson would write null, which would not restore)."""

from __future__ import annotations

import json
import math

from tests.test_windows import ev
from watchdog.windows.aggregator import WindowAggregator, encode_snapshots, encode_window, window_field
from watchdog.windows.window import Window


def _window() -> tuple[WindowAggregator, tuple[int, str, str, str], Window]:
    agg = WindowAggregator(length_s=60.0)
    for i in range(40):
        agg.add(ev(1200.0 + i, request_id=f"q{i}", latency_ms=50.0 + 3.3 * i, ttft_ms=5.0 + i / 7,
                   prompt_tokens=10 * i, completion_tokens=3 + i, completion=f"the cat sat {i}",
                   shadow=f"the cat sat {i % 3}", replica=f"pod-{i % 4}", build="b1",
                   completion_logprobs=[-0.1 * i, -0.01], status="ok" if i % 7 else "timeout"), ("t", 0), i)
    (key,) = agg._open
    return agg, key, agg._open[key]


def test_a_window_encodes_as_json_dumps_would_and_restores_exactly() -> None:
    _agg, key, w = _window()
    text = encode_window(w, key)
    assert json.loads(text) == json.loads(json.dumps(w.export(key)))
    again = Window.from_export(json.loads(text))
    assert json.dumps(again.export(key)) == json.dumps(w.export(key))
    assert encode_snapshots([(key, w.snapshot())]) == {window_field(key): text}


def test_a_window_whose_sums_overflowed_is_written_so_that_it_restores() -> None:
    _agg, key, w = _window()
    w.lp_sum = -math.inf
    text = encode_window(w, key)
    assert "-Infinity" in text and "null" not in text.split('"f":')[1][:40]
    again = Window.from_export(json.loads(text))
    assert again.lp_sum == -math.inf and again.count == w.count


def test_changes_exported_on_the_loop_encode_to_the_fields_export_changes_writes() -> None:
    """``snapshot_changes`` hands the writer thread each changed window serialized (not a copy of the
    window): encoded, the same fields and bytes as ``export_changes``, whatever the window holds (one
    event, no pairs, pairs, an overflowed sum), and later events in the open window do not reach it."""
    def filled() -> WindowAggregator:
        agg = WindowAggregator(length_s=60.0)
        for i in range(30):
            route = f"r{i % 7}"
            agg.add(ev(1200.0 + i, route=route, request_id=f"q{i}", latency_ms=40.0 + i, ttft_ms=4.0 + i / 3,
                       completion=f"a b c {i}", shadow=f"a b d {i % 2}" if i % 3 else None, replica=f"p{i % 2}",
                       build="b1" if i % 5 else None, status="ok" if i % 4 else "timeout"), ("t", 0), i)
        first = next(iter(agg._open.values()))
        first.lp_sum = -math.inf
        return agg

    a, b = filled(), filled()
    exported, closed = a.snapshot_changes(everything=True)
    want, want_closed = b.export_changes(everything=True)
    for i in range(30, 40):  # events after the save's build must not change what it writes
        a.add(ev(1200.0 + i, route=f"r{i % 7}", request_id=f"q{i}", latency_ms=400.0 + i), ("t", 0), i)
    assert encode_snapshots(exported) == want and closed == want_closed
    assert len(want) == 7
