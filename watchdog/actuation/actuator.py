"""Write routing flags to Redis: ``FlagStore`` (one atomic Lua flip) and ``Actuator`` (policy
decisions kept pending and retried with backoff while Redis is away).

A flip checks the fencing epoch and any pin, writes the route hash, indexes it, appends an audit
record and publishes a notification, all inside one script (``flip.lua``), so no reader ever sees a
flag without its audit record. Layout and record formats: ``watchdog/core/keys.py``, docs/ROUTING.md.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from watchdog.core.backoff import backoff_delay
from watchdog.core.keys import SCHEMA_VERSION, Flag, Keys, text
from watchdog.core.signals import Action

log = logging.getLogger(__name__)

#: Refusal reasons in ``FlipResult.refused``.
STALE = "stale_epoch"
PINNED = "pinned"
MISSING = "missing"
FENCED = "fenced"
#: ``FlipExtras.token`` of a route whose partition this replica lost: the flip is dropped unsent
REVOKED = "revoked"


@dataclass(frozen=True, slots=True)
class FlipExtras:
    """What a policy flip writes in the same script: the ownership fence of the partition carrying the
    route, the route's engine state, and the page (outbox record)."""

    owner_key: str
    token: str
    engine_key: str
    engine_json: str
    outbox_key: str
    outbox_json: str


@dataclass(frozen=True, slots=True)
class FlipResult:
    """Outcome of one write attempt. ``applied`` means a new epoch was written (and audited);
    ``unchanged`` means the route already served the target, so nothing was written."""

    applied: bool
    epoch: int
    refused: str | None = None
    model: str = ""
    route: str = ""
    precision: str = ""
    unchanged: bool = False
    pinned_until: float | None = None
    policy: str = ""


def _load_script() -> str:
    return resources.files("watchdog.actuation").joinpath("flip.lua").read_text(encoding="utf-8")


class FlagStore:
    """Routing flags in Redis under one ``Keys`` prefix. Redis errors propagate (``redis.RedisError``);
    ``Actuator`` is the layer that turns them into pending decisions."""

    def __init__(self, client: Any, keys: Keys | None = None, audit_maxlen: int = 10_000) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.audit_maxlen = audit_maxlen
        self._flip = client.register_script(_load_script())

    # -- writes -------------------------------------------------------------------------------

    def _run(self, op: str, mode: str, model: str, route: str, precision: str, *,
             expected_epoch: int | None, reason: str, policy: str, changed_by: str,
             now: float | None, pin_ttl_s: float = 0.0, extras: FlipExtras | None = None) -> FlipResult:
        args = [op, mode, precision, "" if expected_epoch is None else str(int(expected_epoch)),
                reason, policy, changed_by, "" if now is None else repr(float(now)), repr(float(pin_ttl_s)),
                str(self.audit_maxlen), self.keys.channel, model, route, str(SCHEMA_VERSION)]
        keys = [self.keys.route(model, route), self.keys.routes_index, self.keys.audit]
        if extras is not None:
            keys += [extras.owner_key, extras.engine_key, extras.outbox_key]
            args += [extras.token, extras.engine_json, extras.outbox_json]
        reply = self._flip(keys=keys, args=args, client=self.client)
        status, epoch, current, pin = (text(v) for v in reply)
        pinned_until = float(pin) if pin else None
        refused = {"stale": STALE, "pinned": PINNED, "missing": MISSING, "fenced": FENCED}.get(status)
        result = FlipResult(applied=status == "applied", epoch=int(epoch), refused=refused, model=model,
                            route=route, precision=current, unchanged=status == "unchanged",
                            pinned_until=pinned_until, policy=policy)
        log.info("flag %s %s/%s -> %s by %s: %s (epoch %s)", op, model, route, precision or current,
                 changed_by, status, epoch)
        return result

    def flip(self, model: str, route: str, precision: str, *, expected_epoch: int | None, reason: str,
             policy: str = "", changed_by: str, now: float | None = None, manual: bool = False,
             extras: FlipExtras | None = None) -> FlipResult:
        """Set the precision of one route. ``expected_epoch`` fences the write (None: whatever is
        current, still checked atomically). Policy writes (``manual=False``) are refused while the
        route is pinned. ``now`` defaults to the Redis server clock. ``extras`` adds the ownership
        fence, the engine state and the page (see ``FlipExtras``)."""
        return self._run("set", "manual" if manual else "policy", model, route, precision,
                         expected_epoch=expected_epoch, reason=reason, policy=policy,
                         changed_by=changed_by, now=now, extras=extras)

    def pin(self, model: str, route: str, precision: str, ttl_s: float, *, reason: str, changed_by: str,
            now: float | None = None, expected_epoch: int | None = None) -> FlipResult:
        """Manually set ``precision`` and hold it for ``ttl_s`` seconds against policy writes."""
        if ttl_s <= 0:
            raise ValueError("pin ttl must be positive")
        return self._run("pin", "manual", model, route, precision, expected_epoch=expected_epoch,
                         reason=reason, policy="", changed_by=changed_by, now=now, pin_ttl_s=ttl_s)

    def unpin(self, model: str, route: str, *, reason: str = "", changed_by: str,
              now: float | None = None, expected_epoch: int | None = None) -> FlipResult:
        """Remove a pin (the precision stays); policies may change the route again."""
        return self._run("unpin", "manual", model, route, "", expected_epoch=expected_epoch, reason=reason,
                         policy="", changed_by=changed_by, now=now)

    def maintenance(self, model: str, route: str, *, start: float, until: float | None, reason: str,
                    changed_by: str) -> dict[str, Any] | None:
        """Declare maintenance on a route from ``start`` to ``until`` (unix s; model ``*``: every
        model of the route), or end the one declared (``until`` None): the ``Keys.maintenance``
        annotation (a TTL ends it), its audit record and a bump of ``Keys.maintenance_generation`` (what
        tells the daemons to read the annotations again), in one transaction. Returns the annotation
        that was in force before, if any."""
        key = self.keys.maintenance(model, route)
        now = time.time()
        before = self.client.get(key)
        pipe = self.client.pipeline(transaction=True)
        if until is None:
            pipe.delete(key)
        else:
            doc = {"start": start, "until": until, "reason": reason, "by": changed_by}
            pipe.set(key, json.dumps(doc), px=max(1, int((until - now) * 1000)))
        pipe.xadd(self.keys.audit, {"schema": str(SCHEMA_VERSION), "ts": repr(now),
                                    "op": "maintenance" if until is not None else "maintenance-end",
                                    "mode": "manual", "model": model, "route": route, "precision": "",
                                    "previous": "", "epoch": "", "reason": reason, "policy": "",
                                    "changed_by": changed_by, "pinned_until": "",
                                    "maintenance_start": repr(start) if until is not None else "",
                                    "maintenance_until": repr(until) if until is not None else ""},
                  maxlen=self.audit_maxlen, approximate=True)
        pipe.incr(self.keys.maintenance_generation)
        pipe.execute()
        if before is None:
            return None
        try:
            old = json.loads(text(before))
        except ValueError:
            return None
        return old if isinstance(old, dict) else None

    # -- reads --------------------------------------------------------------------------------

    def get(self, model: str, route: str) -> Flag | None:
        return Flag.from_hash(self.client.hgetall(self.keys.route(model, route)), model, route)

    def list(self) -> list[Flag]:
        names = sorted(text(k) for k in self.client.smembers(self.keys.routes_index))
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        flags = [Flag.from_hash(raw) for raw in pipe.execute()]
        return sorted((f for f in flags if f is not None), key=lambda f: (f.model, f.route))

    def snapshot(self) -> dict[tuple[str, str], str]:
        """``{(model, route): precision}`` of every route with a flag (the policy engine's input)."""
        return {(f.model, f.route): f.precision for f in self.list()}

    def audit(self, count: int = 50) -> builtins.list[dict[str, Any]]:
        """The newest ``count`` audit records, newest first; each has its stream ``id``."""
        records = []
        for entry_id, fields in self.client.xrevrange(self.keys.audit, count=count):
            rec: dict[str, Any] = {"id": text(entry_id)}
            rec.update({text(k): text(v) for k, v in fields.items()})
            for name, conv in (("schema", int), ("epoch", int), ("ts", float)):
                with contextlib.suppress(KeyError, ValueError):
                    rec[name] = conv(rec[name])
            records.append(rec)
        return records

    # -- daemon state -------------------------------------------------------------------------

    def save_state(self, name: str, json_text: str) -> None:
        """Store a JSON document (validated here: never pickle) under ``Keys.state(name)``."""
        json.loads(json_text)
        self.client.set(self.keys.state(name), json_text)

    def load_state(self, name: str) -> str | None:
        raw = self.client.get(self.keys.state(name))
        return None if raw is None else text(raw)

    def heartbeat(self, instance: str, json_text: str, ttl_s: float) -> None:
        """Refresh this instance's heartbeat (a JSON blob that expires after ``ttl_s``)."""
        json.loads(json_text)
        self.client.set(self.keys.heartbeat(instance), json_text, px=max(1, int(ttl_s * 1000)))


@dataclass
class _Decision:
    model: str
    route: str
    precision: str
    reason: str
    policy: str
    expected_epoch: int | None
    submitted_at: float
    action: Action | None = None
    #: a pin to put back (``submit_pin``): held until then (unix s)
    pin_until: float | None = None


class Actuator:
    """Carries rollback/promote actions into Redis without ever raising on a Redis outage.

    ``submit`` queues a decision (the newest per route wins); ``pump`` tries the queue. On a Redis
    error the decision stays pending, ``healthy`` turns False, and the next try waits an
    exponential backoff with jitter. A stale-epoch refusal is re-read and retried against the fresh
    epoch unless the route already serves the target; a pin refusal is final.

    An action may carry ``detail["epoch"]``, the flag epoch the policy engine decided on; it then
    fences the first attempt. ``pump(now)`` uses ``now`` for backoff only; flips use Redis time.
    """

    def __init__(self, store: FlagStore | Callable[[], FlagStore], backoff_initial: float = 0.5,
                 backoff_max: float = 30.0, changed_by: str = "watchdog", max_stale_retries: int = 3,
                 rng: random.Random | None = None,
                 extras: Callable[[Action], FlipExtras | None] | None = None) -> None:
        if isinstance(store, FlagStore):
            self._store: FlagStore | None = store
            self._factory: Callable[[], FlagStore] | None = None
        else:
            self._store = None
            self._factory = store
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.changed_by = changed_by
        self.max_stale_retries = max_stale_retries
        self._rng = rng or random.Random()
        #: computes, at each attempt, what the flip writes with it (fence, engine state, page)
        self.extras = extras
        self._pending: dict[tuple[str, str], _Decision] = {}
        self._failures = 0
        self._next_try = 0.0
        self.healthy = True
        self.last_error: str | None = None

    def submit(self, action: Action, now: float | None = None) -> bool:
        """Queue a non-dry-run rollback/promote; returns False for anything else (ignored)."""
        if action.kind not in ("rollback", "promote") or action.dry_run or not action.precision:
            return False
        epoch = action.detail.get("epoch") if action.detail else None
        self._pending[(action.model, action.route)] = _Decision(
            model=action.model, route=action.route, precision=action.precision, reason=action.reason,
            policy=action.policy, expected_epoch=epoch if isinstance(epoch, int) else None,
            submitted_at=time.time() if now is None else now, action=action)
        return True

    def submit_pin(self, model: str, route: str, precision: str, until: float, reason: str,
                   now: float | None = None) -> None:
        """Queue putting back an operator's pin that Redis lost: ``precision`` held until ``until``."""
        self._pending[(model, route)] = _Decision(model=model, route=route, precision=precision, reason=reason,
                                                  policy="", expected_epoch=None,
                                                  submitted_at=time.time() if now is None else now, pin_until=until)

    def pending(self) -> int:
        return len(self._pending)

    def pending_routes(self) -> set[tuple[str, str]]:
        """The (model, route) of every decision still waiting to be written."""
        return set(self._pending)

    def retry_at(self) -> float:
        """When ``pump`` will next try after a Redis error (0 when it is not backing off)."""
        return self._next_try

    def retry_now(self) -> None:
        """Another Redis operation just succeeded: the next ``pump`` tries at once instead of waiting out
        its backoff (a failure after this backs off from where it was)."""
        self._next_try = 0.0

    def pump(self, now: float | None = None, wait: AbstractSet[tuple[str, str]] = frozenset()) -> list[FlipResult]:
        """Try the pending decisions (but those of the routes in ``wait``, which stay pending); returns the
        finished ones (applied, unchanged or refused)."""
        now = time.time() if now is None else now
        if not self._pending or now < self._next_try:
            return []
        done: list[FlipResult] = []
        for key, decision in list(self._pending.items()):
            if key in wait:
                continue
            try:
                result = self._attempt(decision)
            except (redis.RedisError, OSError) as exc:
                self._fail(exc, now)
                break
            if result is not None:
                done.append(result)
                self._pending.pop(key, None)
        else:
            self._recover()
        return done

    def _attempt(self, d: _Decision) -> FlipResult | None:
        """One decision against Redis; None when it must stay pending (stale retries exhausted)."""
        store = self._get_store()
        if d.pin_until is not None:
            ttl = d.pin_until - time.time()
            if ttl <= 0:  # the pin ran out while it waited: nothing to put back
                return FlipResult(applied=False, epoch=0, model=d.model, route=d.route, precision=d.precision,
                                  unchanged=True)
            return store.pin(d.model, d.route, d.precision, ttl, reason=d.reason, changed_by=self.changed_by)
        for _ in range(self.max_stale_retries + 1):
            extras = self.extras(d.action) if self.extras is not None and d.action is not None else None
            if extras is not None and extras.token == REVOKED:
                log.warning("%s/%s: %s of policy %s dropped: the route's partition moved to another replica",
                            d.model, d.route, d.precision, d.policy)
                return FlipResult(applied=False, epoch=0, refused=FENCED, model=d.model, route=d.route,
                                  precision=d.precision, policy=d.policy)
            result = store.flip(d.model, d.route, d.precision, expected_epoch=d.expected_epoch,
                                reason=d.reason, policy=d.policy, changed_by=self.changed_by, extras=extras)
            if result.refused != STALE:
                if result.refused == FENCED:
                    log.warning("%s/%s: %s of policy %s refused: this replica no longer owns the route's "
                                "partition", d.model, d.route, d.precision, d.policy)
                if result.refused == PINNED:
                    log.warning("%s/%s pinned until %s: %s of policy %s not applied", d.model, d.route,
                                result.pinned_until, d.precision, d.policy)
                return result
            current = store.get(d.model, d.route)
            if current is not None and current.precision == d.precision:
                return FlipResult(applied=False, epoch=current.epoch, model=d.model, route=d.route,
                                  precision=current.precision, unchanged=True, policy=d.policy)
            d.expected_epoch = current.epoch if current is not None else 0
        log.warning("%s/%s: epoch kept moving, %s stays pending", d.model, d.route, d.precision)
        return None

    def _get_store(self) -> FlagStore:
        if self._store is None:
            assert self._factory is not None
            self._store = self._factory()
        return self._store

    def _fail(self, exc: Exception, now: float) -> None:
        self._failures += 1
        delay = backoff_delay(self._failures, self.backoff_initial, self.backoff_max, self._rng)  # in [d/2, d)
        self._next_try = now + delay
        self.healthy = False
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("redis unavailable (%s); %d decision(s) pending, retry in %.2f s",
                    self.last_error, len(self._pending), delay)

    def _recover(self) -> None:
        if not self.healthy:
            log.info("redis reachable again; pending decisions: %d", len(self._pending))
        self._failures = 0
        self._next_try = 0.0
        self.healthy = True
        self.last_error = None
