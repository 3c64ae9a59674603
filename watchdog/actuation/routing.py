"""Gateway-side reader of the routing flags: ``RoutingFlags.precision_for(model, route)``.

Lookups never touch the network: they read an in-memory cache. A background thread keeps the
cache current: it subscribes to the flags channel (a change arrives within a millisecond or so),
reloads everything after each (re)connect and every ``ttl_s`` seconds as a safety net. While Redis
is unreachable the cache keeps the last known values; a route never seen gets
``default_precision``. ``redis_url`` may name a Sentinel-managed master
(``redis+sentinel://h1:26379,h2:26379/<service>/<db>``, see ``watchdog.state.redis_conn``): each
reconnect asks the sentinels again, so the reader follows a failover. It may name a Redis Cluster
(``redis+cluster://h1:6379,h2:6379``, prefix a hash tag such as ``{llmwd}``): the subscription is
on the node serving the channel's slot, and a plain PUBLISH reaches every node of a cluster, so
the reader keeps hearing changes after a failover or a slot migration (a node that goes away
breaks the subscription, and the reader reconnects and reloads). Contract: docs/ROUTING.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import redis

from watchdog.core.keys import Flag, Keys, require_cluster_prefix, text
from watchdog.state.redis_conn import client_from_url, connection_is_current

log = logging.getLogger(__name__)

#: how often the reader checks that its subscription is on the master the sentinels name
MASTER_CHECK_S = 0.5
#: flags held off the default checked for existence per change check (one EXISTS of this many keys)
MAX_HELD_CHECK = 1000


class RoutingFlags:
    """A cached, self-refreshing view of every route's precision flag: loaded once, then kept by the
    flags channel's messages; every ``ttl_s`` one round trip checks that nothing was missed (the
    routes index's size and the last audit record) and only then reloads every flag (at 10,000
    routes a full reload is ~0.5 s of CPU and 2.4 MB from Redis, the check 0.2 ms), and every
    ``full_reload_s`` regardless. ``timeout_s``: the socket
    timeout of the clients it builds from ``redis_url`` (above the link's round trip: a reader
    that times out on a slow link serves stale flags)."""

    def __init__(self, redis_url: str | None = None, keys: Keys | None = None, *,
                 client_factory: Callable[[], Any] | None = None, default_precision: str = "fp8",
                 ttl_s: float = 10.0, reconnect_s: float = 0.5, poll_s: float = 0.05,
                 timeout_s: float = 2.0, full_reload_s: float = 300.0, start: bool = True) -> None:
        if client_factory is None:
            if redis_url is None:
                raise ValueError("give redis_url or client_factory")
            url = redis_url
            client_factory = lambda: client_from_url(url, timeout_s=timeout_s)  # noqa: E731
        self._factory = client_factory
        self.keys = keys or Keys()
        if redis_url is not None:
            require_cluster_prefix(redis_url, self.keys.prefix)
        self.default_precision = default_precision
        self.ttl_s = ttl_s
        self.full_reload_s = full_reload_s
        #: (routes in the index, last audit record id) at the last full reload: every ``ttl_s`` the
        #: reader compares it (one round trip) and reloads every flag only when it moved, or after
        #: ``full_reload_s`` at the latest (an out-of-band write that left neither trace)
        self._seen: tuple[int, str | None] | None = None
        #: flags held off the default that the last change check found gone from Redis
        self.held_lost = 0
        self._held_from = 0
        self.reloads = 0
        self.reconnect_s = reconnect_s
        self.poll_s = poll_s
        self._flags: dict[tuple[str, str], Flag] = {}
        #: every flag seen with a pin, until the route's flag is seen without one (``pins``)
        self._pins: dict[tuple[str, str], Flag] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.healthy = False
        self.last_error: str | None = None
        self.last_refresh: float | None = None
        self.messages = 0
        if start:
            self.start()

    # -- lookups (no I/O) ---------------------------------------------------------------------

    def precision_for(self, model: str, route: str) -> str:
        flag = self._flags.get((model, route))
        return flag.precision if flag is not None else self.default_precision

    def flag(self, model: str, route: str) -> Flag | None:
        return self._flags.get((model, route))

    def snapshot(self) -> dict[tuple[str, str], str]:
        """``{(model, route): precision}`` for every route that has a flag."""
        return {key: flag.precision for key, flag in self._flags.items()}

    def flags(self) -> dict[tuple[str, str], Flag]:
        return dict(self._flags)

    @property
    def mapping(self) -> Mapping[tuple[str, str], Flag]:
        """The cache itself, not a copy: replaced whole at every change, never changed in place, so a
        caller may keep it and tell by identity whether anything changed since."""
        return self._flags

    @property
    def pins(self) -> Mapping[tuple[str, str], Flag]:
        """Every flag this cache has seen pinned (``pinned_until`` set, run out or not), kept until it sees
        that route's flag without a pin: a flag that vanishes (Redis restarted empty, an evicting
        ``maxmemory``) stays here, whenever it vanished. Replaced whole at every change, never changed in
        place, like ``mapping``. The daemon puts back the pins in force whose flag is gone from it
        (``Decisions.lost_pins``): sampling the cache for pins instead missed one that Redis lost within
        a second of its writing (the cache held it between two samples)."""
        return self._pins

    def _set(self, flags: dict[tuple[str, str], Flag], changed: Iterable[tuple[tuple[str, str], Flag]]) -> None:
        """Replace the cache (under ``_lock``), noting the pins of the ``changed`` flags."""
        pins = None
        for key, flag in changed:
            if flag.pinned_until is not None:
                if self._pins.get(key) != flag:
                    pins = pins if pins is not None else dict(self._pins)
                    pins[key] = flag
            elif key in self._pins:
                pins = pins if pins is not None else dict(self._pins)
                del pins[key]
        if pins is not None:
            self._pins = pins
        self._flags = flags

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="llmwd-routing-flags", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float = 2.0) -> bool:
        """Block until the first full load succeeded (True) or ``timeout`` passed (False)."""
        return self._ready.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> RoutingFlags:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- cache maintenance --------------------------------------------------------------------

    def changes_seen(self, client: Any) -> tuple[int, str | None]:
        """(routes in the index, id of the last audit record): what moves when a flag is written
        through the flip script, a route is added or removed, or Redis lost its data. In the same round
        trip, whether the flags that hold a route off the default (or pinned) are all still there
        (``held_lost``): a Redis that evicts keys (``maxmemory`` with an LRU policy) deleted exactly
        those, the coldest keys, and left the index and the audit stream as they were."""
        held = self._held_keys()
        pipe = client.pipeline(transaction=False)
        pipe.scard(self.keys.routes_index)
        pipe.xrevrange(self.keys.audit, count=1)
        if held:
            pipe.exists(*held)
        count, last, *present = pipe.execute()
        self.held_lost = len(held) - int(present[0]) if held else 0
        return int(count), (text(last[0][0]) if last else None)

    def _held_keys(self) -> list[str]:
        """The keys of cached flags whose loss changes what a route serves, at most ``MAX_HELD_CHECK``
        (a rotating slice when there are more)."""
        default, now = self.default_precision, time.time()
        held = [self.keys.route(*key) for key, flag in self._flags.items()
                if flag.precision != default or flag.pinned(now)]
        if len(held) <= MAX_HELD_CHECK:
            return held
        start = self._held_from % len(held)
        self._held_from = start + MAX_HELD_CHECK
        return (held[start:] + held[:start])[:MAX_HELD_CHECK]

    def refresh(self, client: Any) -> None:
        """Reload every flag from Redis (replaces the cache; raises on Redis errors)."""
        self._seen = self.changes_seen(client)  # before the reload: a change during it shows next time
        self.reloads += 1
        names = sorted(text(k) for k in client.smembers(self.keys.routes_index))
        loaded: dict[tuple[str, str], Flag] = {}
        if names:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.hgetall(name)
            for raw in pipe.execute():
                flag = Flag.from_hash(raw)
                if flag is not None:
                    loaded[(flag.model, flag.route)] = flag
        with self._lock:
            self._set(loaded, loaded.items())
        self.last_refresh = time.time()
        self._ready.set()

    def _apply_message(self, client: Any, data: Any) -> None:
        msg = json.loads(text(data))
        model, route = str(msg["model"]), str(msg["route"])
        epoch = int(msg["epoch"])
        key = (model, route)
        with self._lock:
            old = self._flags.get(key)
            if old is not None and old.epoch >= epoch:
                return  # a reload already brought this change or a newer one
            pinned = msg.get("pinned_until")
            if old is None:
                new = Flag(model=model, route=route, precision=str(msg["precision"]), epoch=epoch,
                           pinned_until=float(pinned) if pinned is not None else None)
            else:
                new = replace(old, precision=str(msg["precision"]), epoch=epoch,
                              pinned_until=float(pinned) if pinned is not None else None)
            self._set({**self._flags, key: new}, ((key, new),))
        # fill reason/policy/changed_by; the cache already serves the new precision
        full = Flag.from_hash(client.hgetall(self.keys.route(model, route)), model, route)
        if full is not None:
            with self._lock:
                cur = self._flags.get(key)
                if cur is None or cur.epoch <= full.epoch:
                    self._set({**self._flags, key: full}, ((key, full),))

    def _run(self) -> None:
        while not self._stop.is_set():
            client = pubsub = None
            try:
                client = self._factory()
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.keys.channel)
                self.refresh(client)  # after SUBSCRIBE, so no change falls between load and listen
                self._mark_healthy()
                next_refresh = time.monotonic() + self.ttl_s
                next_full = time.monotonic() + self.full_reload_s
                next_master_check = time.monotonic() + MASTER_CHECK_S
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=self.poll_s)
                    if message is not None and message.get("type") == "message":
                        self.messages += 1
                        try:
                            self._apply_message(client, message["data"])
                        except (ValueError, KeyError, TypeError) as exc:
                            log.warning("ignoring malformed flags message: %s", exc)
                        # the cache moved past the last full load: the next check reloads, so a loss
                        # right after this change (Redis restarted empty) cannot match the old trace
                        self._seen = None
                    if time.monotonic() >= next_refresh:
                        # pub/sub brings every change; this catches one it missed, bounded: a full
                        # reload of 10,000 routes per gateway every few seconds is not
                        if (time.monotonic() >= next_full or self.changes_seen(client) != self._seen
                                or self.held_lost):
                            self.refresh(client)
                            next_full = time.monotonic() + self.full_reload_s
                        else:
                            self.last_refresh = time.time()
                        next_refresh = time.monotonic() + self.ttl_s
                    if time.monotonic() >= next_master_check:
                        # Sentinel: a subscription on a demoted master hears nothing new
                        if not connection_is_current(client, pubsub.connection):
                            raise redis.ConnectionError("the sentinels name another master; resubscribing")
                        next_master_check = time.monotonic() + MASTER_CHECK_S
            except (redis.RedisError, OSError) as exc:
                self._mark_unhealthy(exc)
                self._stop.wait(self.reconnect_s)
            except Exception as exc:  # noqa: BLE001 - anything else must not end the reader silently
                if f"{type(exc).__name__}: {exc}" != self.last_error:  # one traceback per new error, not per retry
                    log.exception("routing flags: unexpected error; reconnecting")
                self._mark_unhealthy(exc)
                self._stop.wait(self.reconnect_s)
            finally:
                self._close_quietly(pubsub, client)

    def _mark_healthy(self) -> None:
        if not self.healthy:
            log.info("routing flags: connected, %d route flag(s) loaded", len(self._flags))
        self.healthy = True
        self.last_error = None

    def _mark_unhealthy(self, exc: BaseException) -> None:
        err = f"{type(exc).__name__}: {exc}"
        if self.healthy or err != self.last_error:
            log.warning("routing flags: redis unavailable (%s); serving %d cached flag(s)",
                        err, len(self._flags))
        self.healthy = False
        self.last_error = err

    @staticmethod
    def _close_quietly(pubsub: Any, client: Any) -> None:
        for thing in (pubsub, client):
            if thing is None:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                thing.close()
