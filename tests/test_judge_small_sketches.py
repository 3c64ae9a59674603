"""The plain-Python path of the tail statistics for sketches of a few buckets (thin windows) gives
the same bits as the numpy path (watchdog/policy/judge/live.py, ``SMALL``)."""

from __future__ import annotations

import math
import random

import pytest

from watchdog.policy.judge import live
from watchdog.policy.judge.memo import window_memo


def _sketch(rng: random.Random, bins: int) -> dict:
    centre = rng.choice([-40, 0, 250, 345, 700])
    out = [[centre + rng.randint(-60, 60), rng.choice([0, 1, 1, 2, 3, 17, 1000, 123457])] for _ in range(bins)]
    if bins and rng.random() < 0.3:
        out.append([out[0][0], rng.randint(1, 5)])  # the same bucket twice
    rng.shuffle(out)
    acc = rng.choice([0.01, 0.005, 0.02])
    return {"relative_accuracy": acc, "min_value": 1e-3, "zero_count": rng.choice([0, 0, 3]), "bins": out}


def _both(monkeypatch: pytest.MonkeyPatch, fn, sketch: dict, p: float):
    small = fn(sketch, p)
    with monkeypatch.context() as m:
        m.setattr(live, "SMALL", -1)  # every sketch takes the numpy path
        ref = fn(sketch, p)
    return small, ref


@pytest.mark.parametrize("fn", [live.sketch_log_tail_mean, live.sketch_log_tail_contrast])
def test_small_path_gives_the_numpy_bits(monkeypatch: pytest.MonkeyPatch, fn) -> None:
    rng = random.Random(11)
    small_used = 0
    for _ in range(3000):
        sketch = _sketch(rng, rng.randint(0, 7))
        p = rng.choice([0.0, 0.5, 0.9, 0.95, 0.99, 0.999])
        small, ref = _both(monkeypatch, fn, sketch, p)
        small_used += live._small_buckets_now(sketch) is not None
        if ref is None:
            assert small is None
            continue
        assert small is not None
        assert all(float(a).hex() == float(b).hex() for a, b in zip(small, ref, strict=True))
    assert small_used > 1000  # the small path ran (a sketch with 8 raw bins or more takes numpy)


def test_small_path_in_a_window_memo_and_odd_bins(monkeypatch: pytest.MonkeyPatch) -> None:
    sk = {"relative_accuracy": 0.01, "min_value": 1e-3, "zero_count": 0, "bins": [[330, 1], [345, 1]]}
    with window_memo():
        a = live.sketch_log_tail_contrast(sk, 0.95)
        b = live.sketch_log_tail_mean(sk, 0.0)
        assert live.sketch_log_tail_contrast(sk, 0.95) == a
    assert (a, b) == (_both(monkeypatch, live.sketch_log_tail_contrast, sk, 0.95)[1],
                      _both(monkeypatch, live.sketch_log_tail_mean, sk, 0.0)[1])
    # bins the plain path does not read (a flat list, non-finite keys) go to numpy
    assert live._small_buckets_now({"relative_accuracy": 0.01, "bins": [330, 1, 345, 1]}) is None
    assert live._small_buckets_now({"relative_accuracy": 0.01, "bins": [[math.inf, 1]]}) is None
    assert live.sketch_log_tail_mean({"relative_accuracy": 0.01, "bins": []}, 0.9) is None
