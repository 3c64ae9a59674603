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
