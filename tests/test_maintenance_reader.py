"""The maintenance reader's thread (``watchdog/runtime/maintenance.py``) against a real Redis: an annotation
written by ``flags maintenance`` (which bumps ``Keys.maintenance_generation`` in its transaction) is seen
within a cycle or two, as when every key was read every second; one that ends or expires goes as fast;
one written by hand without the bump is seen within ``FULL_EVERY_S``; and while nothing changes a cycle
reads no route's key (it read every asked route's key each second: 10,000 keys a second at 10,000
routes)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from watchdog.actuation.actuator import FlagStore
from watchdog.cli.flags import add_flags_commands
from watchdog.core.keys import Keys
from watchdog.runtime import maintenance
from watchdog.runtime.maintenance import MaintenanceReader

pytestmark = pytest.mark.services

#: the old reader's bound: the next cycle (EVERY_S) plus a round trip; one more cycle of slack
SEEN_S = 2 * maintenance.EVERY_S + 0.5


class Counting:
    """A Redis client that counts the route keys MGET read and the cycles (GETs of the generation)."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client, self.keys = client, keys
        self.mget_keys = 0
        self.cycles = 0
        self.lock = threading.Lock()

    def mget(self, names: list[str]) -> Any:
        with self.lock:
            self.mget_keys += len(names)
        return self.client.mget(names)

    def get(self, name: str) -> Any:
        if name == self.keys.maintenance_generation:
            with self.lock:
                self.cycles += 1
        return self.client.get(name)

    def ping(self) -> Any:
        return self.client.ping()


def _cli(url: str, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="llm-watchdog")
    add_flags_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["flags", *argv, "--redis-url", url])
    return int(args.func(args))


def _within(what: str, ok: Callable[[], object], timeout: float) -> float:
    """Seconds until ``ok()``; AssertionError past ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if ok():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout} s")


def _cycles_pass(counting: Counting, n: int) -> None:
    start = counting.cycles
    _within(f"{n} cycles", lambda: counting.cycles >= start + n, n * maintenance.EVERY_S + 3)


@pytest.fixture
def reader(redis_client: Any) -> Any:
    errors: list[str] = []
    counting = Counting(redis_client, Keys())
    r = MaintenanceReader(counting, Keys(), lambda exc, what: errors.append(f"{what}: {exc}"))
    r.start()
    yield r, counting
    r.stop()
    assert not errors


ROUTES = [("llama", f"r{i}") for i in range(300)] + [("*", "r7")]


def test_a_cli_annotation_is_seen_within_a_cycle_and_an_unchanged_cycle_reads_no_key(reader, redis_service):
    r, counting = reader
    url = f"redis://{redis_service.address}/0"
    assert r.values(ROUTES) == {}  # first asked: read on the caller's thread, once
    assert counting.mget_keys == len(ROUTES)
    _cycles_pass(counting, 2)  # the thread's first cycle reads every asked route (a full read)
    before = counting.mget_keys
    _cycles_pass(counting, 3)
    assert counting.mget_keys == before  # nothing changed: not one route key read

    assert _cli(url, "maintenance", "llama", "r5", "--for", "30m", "--reason", "deploy v2") == 0
    took = _within("the CLI's annotation", lambda: ("llama", "r5") in r.values(ROUTES), SEEN_S)
    assert json.loads(r.values(ROUTES)[("llama", "r5")])["reason"] == "deploy v2"
    assert _cli(url, "maintenance", "*", "r7", "--for", "30m") == 0  # model '*': every model of the route
    _within("the '*' annotation", lambda: ("*", "r7") in r.values(ROUTES), SEEN_S)
    # once the bump is read: the annotated routes' keys only, one read per cycle each
    _cycles_pass(counting, 1)
    before = counting.mget_keys
    _cycles_pass(counting, 3)
    assert 0 < counting.mget_keys - before <= 2 * 4

    assert _cli(url, "maintenance", "llama", "r5", "--end") == 0
    _within("the end of the annotation", lambda: ("llama", "r5") not in r.values(ROUTES), SEEN_S)
    assert ("*", "r7") in r.values(ROUTES)
    assert took < SEEN_S


def test_an_annotation_that_expires_or_is_deleted_by_hand_goes_within_a_cycle(reader, redis_client):
    r, counting = reader
    keys = Keys()
    store = FlagStore(redis_client, keys)
    r.values(ROUTES)
    _cycles_pass(counting, 1)
    now = time.time()
    store.maintenance("llama", "r1", start=now - 60, until=now + 1.5, reason="short", changed_by="test")
    store.maintenance("llama", "r2", start=now - 60, until=now + 600, reason="long", changed_by="test")
    _within("both annotations", lambda: {("llama", "r1"), ("llama", "r2")} <= set(r.values(ROUTES)), SEEN_S)
    # the TTL ends r1 (no write, no bump): gone as soon as its key is
    _within("r1's expiry", lambda: not redis_client.exists(keys.maintenance("llama", "r1")), 3)
    _within("r1 gone", lambda: ("llama", "r1") not in r.values(ROUTES), SEEN_S)
    redis_client.delete(keys.maintenance("llama", "r2"))  # by hand, without the bump
    _within("r2 gone", lambda: ("llama", "r2") not in r.values(ROUTES), SEEN_S)


def test_an_annotation_written_without_the_bump_is_seen_within_the_full_period(
        reader, redis_client, monkeypatch):
    monkeypatch.setattr(maintenance, "FULL_EVERY_S", 4.0)
    r, counting = reader
    keys = Keys()
    r.values(ROUTES)
    _cycles_pass(counting, 2)
    redis_client.set(keys.maintenance("llama", "r9"), json.dumps({"start": 1.0, "until": 2.0}))  # by hand
    took = _within("the hand-written annotation", lambda: ("llama", "r9") in r.values(ROUTES),
                   maintenance.FULL_EVERY_S + SEEN_S)
    assert took > 0  # (how long depends on where in the period it landed)
    assert redis_client.get(keys.maintenance_generation) is None  # nobody bumped it


def test_a_route_asked_for_the_first_time_is_read_at_once(reader, redis_client):
    """A route judging has not asked about before is read on the caller's thread (its first window must
    not miss an annotation that was already there), whatever the generation and the full period."""
    r, counting = reader
    keys = Keys()
    r.values(ROUTES)
    _cycles_pass(counting, 2)
    redis_client.set(keys.maintenance("llama", "new"), json.dumps({"start": 1.0, "until": 2.0}))  # no bump
    assert ("llama", "new") in r.values([*ROUTES, ("llama", "new")])
