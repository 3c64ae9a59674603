"""Small helpers shared by several test modules."""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """``wait_until`` ran out of time; the message names what was awaited."""


def wait_until(cond: Callable[[], T], timeout: float, interval: float = 0.1, *, what: str | None = None,
               detail: Callable[[], object] | None = None,
               ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``cond`` every ``interval`` s until it returns something truthy, and return that.

    After ``timeout`` s (``cond`` is tried once more at the deadline) it raises ``WaitTimeout``
    naming what was awaited (``what``, else the source of ``cond``) and, if given, ``detail()``
    (a log tail, the daemon's problems). Exceptions of the ``ignore`` types count as "not yet". A
    caller that carries on after a timeout (the drills note it and go on) catches ``WaitTimeout``.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except ignore:
            got = None
        if got:
            return got
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    message = f"timed out after {timeout:g} s waiting for {what or _describe(cond)}"
    if detail is not None:
        message += f"\n{detail()}"
    raise WaitTimeout(message)


def _describe(cond: Callable[..., object]) -> str:
    name = getattr(cond, "__qualname__", repr(cond))
    if not name.endswith("<lambda>"):
        return name
    try:
        source = " ".join(inspect.getsource(cond).split())
    except (OSError, TypeError):
        return name
    return source if len(source) <= 300 else source[:300] + "..."


def missing(ci_message: str, local_message: str) -> NoReturn:
    """A tool the suite needs is absent: a failure in CI (setup installs it), a skip elsewhere."""
    import pytest  # here, not at the top: the drills (run outside pytest) import this module too

    if os.environ.get("CI"):
        pytest.fail(ci_message)
    pytest.skip(local_message)


def read_events(kafka: str, topic: str, n: int, timeout: float = 10.0) -> list[Any]:
    """The decoded events of ``topic`` from the start, until ``n`` arrived or ``timeout`` passed."""
    from kafka import KafkaConsumer

    from watchdog.core.events import decode_event

    consumer = KafkaConsumer(topic, bootstrap_servers=kafka, auto_offset_reset="earliest",
                             consumer_timeout_ms=500, group_id=None)
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < n and time.monotonic() < deadline:
            out += [decode_event(m.value) for m in consumer]
    finally:
        consumer.close()
    return out


def drain(consumer: Any, first_s: float, idle_s: float = 1.0) -> list[Any]:
    """Every record ``consumer`` gets, in the order it gets them: waits up to ``first_s`` for the
    first, then stops once ``idle_s`` passed without a new one. For topics whose records are all
    written before the read (a consumer's ``consumer_timeout_ms`` idles its full length after the
    last record: 8 s per read in some tests)."""
    out: list[Any] = []
    deadline = time.monotonic() + first_s
    last: float | None = None
    while True:
        batch = consumer.poll(timeout_ms=200)
        now = time.monotonic()
        for records in batch.values():
            out += records
            last = now if records else last
        if last is None and now >= deadline:
            return out
        if last is not None and now - last >= idle_s:
            return out


def write_golden_set(set_dir: Any, pairs: Any, *, name: str = "tiny", languages: str = "en, zh",
                     max_new_tokens: int = 16) -> Any:
    """A golden set of (prompt, reference) ``pairs`` in ``set_dir`` (a ``Path``): exact match and ROUGE-L."""
    set_dir.mkdir(parents=True, exist_ok=True)
    (set_dir / "manifest.yaml").write_text(
        f"schema: 1\nname: {name}\ndomain: qa\ndescription: {name}\nlanguages: [{languages}]\nroutes: ['*']\n"
        f"template: '{{prompt}}'\ngeneration: {{max_new_tokens: {max_new_tokens}}}\nmetrics: [exact_match, rougeL]\n")
    (set_dir / "items.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "prompt": p, "reference": r}, ensure_ascii=False) + "\n"
        for i, (p, r) in enumerate(pairs)))
    return set_dir
