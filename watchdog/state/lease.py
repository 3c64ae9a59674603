"""A Redis lease for singleton work (the golden scheduler): one holder at a time, renewed while alive.

``tick`` acquires the lease when it is free (``SET NX PX``) and renews it while we hold it (a Lua
compare-and-extend, so we never extend someone else's). A holder that stops renewing (killed,
frozen) loses it after ``ttl_s``; a frozen holder that wakes finds ``held()`` False at its next tick.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
#: delete the lease only if we still hold it, in one step (a GET then DEL could delete the lease
#: another replica took between the two)
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease:
    def __init__(self, client: Any, key: str, holder: str, ttl_s: float = 10.0) -> None:
        self.client = client
        self.key = key
        self.holder = holder
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._held = False
        self._valid_until = 0.0
        self._last = -1e18

    def tick(self, now: float, every_s: float | None = None) -> bool:
        """Acquire or renew (at most every ``ttl/3``); returns whether we hold the lease."""
        every = every_s if every_s is not None else self.ttl_ms / 3000
        if now - self._last < every:
            return self.held(now)
        self._last = now
        try:
            # renew first even when we think we do not hold it: a restarted holder (same instance
            # name) takes its lease back at once instead of waiting out its own TTL
            if self._renew(keys=[self.key], args=[self.holder, self.ttl_ms], client=self.client):
                ok = True
            else:
                ok = bool(self.client.set(self.key, self.holder, nx=True, px=self.ttl_ms))
        except (redis.RedisError, OSError) as exc:
            log.warning("lease %s: %s", self.key, exc)
            ok = False
        if ok != self._held:
            log.info("lease %s %s by %s", self.key, "taken" if ok else "lost", self.holder)
        self._held = ok
        if ok:
            self._valid_until = now + self.ttl_ms / 1000
        return self.held(now)

    def held(self, now: float) -> bool:
        # a holder frozen past the TTL must not act on a lease it may have lost
        return self._held and now < self._valid_until

    def release(self) -> None:
        if not self._held:
            return
        with contextlib.suppress(redis.RedisError, OSError):
            self._release(keys=[self.key], args=[self.holder], client=self.client)
        self._held = False
