"""A memo for the rules of one window: results computed once per window and shared between the rules
(and the horizon test) that read the same signals. Pure.

The rules of a policy read the same candidate and baseline signals: latency-p99 and latency-typical
both clean each precision's replicas (``judge.fleet.clean_side``), and a rule's horizon test reads
the window difference its judge already computed (``pooling.window_difference``). The engine opens
``window_memo()`` around the rules of one window; inside it ``cached`` computes each key once.
Outside it nothing is kept, so a caller that builds or mutates its inputs (tests, the backtest's
own calls) always gets a fresh result. Keys hold the objects they name (not just their ids), so an
id is never reused while the memo lives; the signals are not changed while their window is judged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = ["cached", "window_memo"]

T = TypeVar("T")

_MEMO: ContextVar[dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] | None] = ContextVar("window_memo", default=None)


@contextmanager
def window_memo() -> Iterator[None]:
    """Share results between the rules of one window until the block ends."""
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def cached(kind: str, objs: tuple[Any, ...], params: tuple[Any, ...], compute: Callable[[], T]) -> T:
    """``compute()``, once per (``kind``, identity of ``objs``, ``params``) inside ``window_memo``."""
    memo = _MEMO.get()
    if memo is None:
        return compute()
    key = (kind, *map(id, objs), *params)
    hit = memo.get(key)
    if hit is not None:
        return hit[1]
    out = compute()
    memo[key] = (objs, out)
    return out
