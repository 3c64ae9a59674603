"""Pooling live windows for the judge: merge the latency histograms or (errors, requests) counts
of the last k windows and judge the pool once (docs/JUDGE.md, "Pooling live windows").

``pool_histograms`` / ``pool_counts`` are the building blocks; ``judge_unpaired_pooled`` and
``judge_rate_pooled`` wrap ``watchdog.policy.judge.unpaired``'s ``judge_unpaired`` / ``judge_rate``.
Pure: plain data in, plain data out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from watchdog.policy.judge.unpaired import judge_rate, judge_unpaired
from watchdog.policy.judge.verdict import Judgement, error

__all__ = ["SketchLike", "judge_rate_pooled", "judge_unpaired_pooled", "pool_counts", "pool_histograms",
           "zero_bucket_index"]

#: a QuantileSketch.to_dict() export, or a plain {bucket_index: count}
SketchLike = Mapping[Any, Any]


def _last(windows: Iterable[Any], pool_windows: int | None) -> list[Any]:
    items = list(windows)
    if pool_windows is not None:
        if pool_windows < 1:
            raise ValueError("pool_windows must be >= 1")
        items = items[-pool_windows:]
    return [w for w in items if w is not None]


def _sketch_gamma(d: Mapping[str, Any]) -> tuple[float, float]:
    a = float(d["relative_accuracy"])
    return (1.0 + a) / (1.0 - a), float(d.get("min_value", 1e-3))


def pool_histograms(windows: Iterable[SketchLike | None], *, pool_windows: int | None = None
                    ) -> tuple[dict[int, int], float | None]:
    """Merge the latency histograms of the last ``pool_windows`` windows (oldest first; None =
    all; None entries, windows without data, are skipped) into one ``{bucket_index: count}``.

    Entries are ``QuantileSketch.to_dict()`` exports (``watchdog/windows/sketch.py``: ``bins`` and
    ``zero_count``) or plain ``{bucket_index: count}`` mappings. Returns (histogram, gamma);
    gamma comes from the sketches' ``relative_accuracy`` (None for plain mappings). The zero
    bucket goes to the index just below the lowest possible bucket of that accuracy, the same
    for every sketch, so a pooled candidate and baseline stay comparable. Sketches of different
    accuracy cannot be pooled (ValueError)."""
    out: dict[int, int] = {}
    gamma: float | None = None
    params: tuple[float, float] | None = None
    for w in _last(windows, pool_windows):
        if "bins" in w:
            p = _sketch_gamma(w)
            if params is not None and p != params:
                raise ValueError("cannot pool sketches of different relative_accuracy/min_value")
            params, gamma = p, p[0]
            for i, c in w["bins"]:
                out[int(i)] = out.get(int(i), 0) + int(c)
            zero = int(w.get("zero_count", 0))
            if zero:
                z = zero_bucket_index(*p)
                out[z] = out.get(z, 0) + zero
        else:
            for i, c in w.items():
                out[int(i)] = out.get(int(i), 0) + int(c)
    return out, gamma


def zero_bucket_index(gamma: float, min_value: float) -> int:
    """Index for a sketch's zero bucket: below every bucket a value >= ``min_value`` can use."""
    return math.ceil(math.log(min_value) / math.log(gamma)) - 1


def pool_counts(windows: Iterable[tuple[int, int] | None], *, pool_windows: int | None = None) -> tuple[int, int]:
    """Sum (errors, requests) over the last ``pool_windows`` windows (oldest first; None
    entries are skipped)."""
    errors = total = 0
    for e, n in _last(windows, pool_windows):
        errors += int(e)
        total += int(n)
    return errors, total


def judge_unpaired_pooled(
    candidate_windows: Sequence[SketchLike | None],
    baseline_windows: Sequence[SketchLike | None],
    *,
    pool_windows: int = 3,
    gamma: float | None = None,
    metric: str = "",
    **kwargs: Any,
) -> Judgement:
    """``judge_unpaired`` on the latency histograms of the last ``pool_windows`` windows of each
    side (sequences aligned by window, oldest first). Pooling assumes both precisions got a
    similar share of each window's traffic (true for a fixed split); pass only windows since the
    last flip. ``gamma`` is taken from the sketches when they carry it. Other keyword arguments
    go to ``judge_unpaired``; ``detail['pooled_windows']`` says how many windows were used."""

    try:
        cand, g1 = pool_histograms(candidate_windows, pool_windows=pool_windows)
        base, g2 = pool_histograms(baseline_windows, pool_windows=pool_windows)
    except (ValueError, KeyError, TypeError) as exc:
        return error(metric, "mann_whitney", f"cannot pool windows: {exc}", kwargs.get("effect_threshold"))
    if g1 is not None and g2 is not None and g1 != g2:
        return error(metric, "mann_whitney", "candidate and baseline sketches differ in accuracy",
                      kwargs.get("effect_threshold"))
    g = gamma if gamma is not None else (g1 if g1 is not None else g2)
    j = judge_unpaired(cand, base, gamma=g, metric=metric, **kwargs)
    j.detail["pooled_windows"] = min(len(_last(candidate_windows, pool_windows)),
                                     len(_last(baseline_windows, pool_windows)))
    return j


def judge_rate_pooled(
    candidate_windows: Sequence[tuple[int, int] | None],
    baseline_windows: Sequence[tuple[int, int] | None],
    *,
    pool_windows: int = 3,
    metric: str = "error_rate",
    **kwargs: Any,
) -> Judgement:
    """``judge_rate`` on (errors, requests) summed over the last ``pool_windows`` windows of each
    side (oldest first). Same caveats as ``judge_unpaired_pooled``."""

    try:
        ce, cn = pool_counts(candidate_windows, pool_windows=pool_windows)
        be, bn = pool_counts(baseline_windows, pool_windows=pool_windows)
    except (ValueError, TypeError) as exc:
        return error(metric, "newcombe", f"cannot pool windows: {exc}", kwargs.get("effect_threshold"))
    j = judge_rate(ce, cn, be, bn, metric=metric, **kwargs)
    j.detail["pooled_windows"] = min(len(_last(candidate_windows, pool_windows)),
                                     len(_last(baseline_windows, pool_windows)))
    return j
