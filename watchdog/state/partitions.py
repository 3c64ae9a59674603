"""What the daemon holds per assigned partition, and the policy-engine state per route.

Ownership model (docs/OPERATIONS.md, "State and checkpoints"): events are keyed ``model/route``, so
every event of a route lands in one partition, and the replica that owns that partition owns the
route: its windows, its policy-engine state (all policies' scope state for the route), and its flips.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from watchdog.core import exact_json
from watchdog.core.signals import Signal
from watchdog.policy import PolicyEngine
from watchdog.policy.state import ScopeState
from watchdog.state.checkpoint import SCHEMA, PendingSave, pack_engine
from watchdog.windows.aggregator import WindowAggregator

PartitionKey = tuple[str, int]
Route = tuple[str, str]


@dataclass
class Partition:
    pk: PartitionKey
    token: str
    seq: int
    agg: WindowAggregator
    routes: set[Route] = field(default_factory=set)
    #: records of windows closed since the last save, and pages to send with it
    unsaved: list[str] = field(default_factory=list)
    outbox: list[str] = field(default_factory=list)
    dirty: bool = False
    inflight: PendingSave | None = None
    last_save: float = 0.0
    #: the daemon's clock when Redis last confirmed a save of this partition (or when it was assigned):
    #: changes since then are what a SIGKILL would lose and read again (``Checkpointer.unsaved_age``)
    saved_at: float = 0.0
    #: offset the checkpoint resumed at (None: Kafka's committed offset / auto_offset_reset)
    start_offset: int | None = None
    #: routes whose engine state changed since the last save; next save sends every window and route
    dirty_routes: set[Route] = field(default_factory=set)
    full: bool = True
    #: seconds the last save took (checkpoints are spaced to keep their cost <= 10 % of the loop)
    last_cost_s: float = 0.0
    #: route -> the daemon's clock at its last event (idle routes are forgotten: runtime/routes.py)
    last_seen: dict[Route, float] = field(default_factory=dict)
    #: routes forgotten since the last save: the next save deletes their engine-state keys
    evicted: set[Route] = field(default_factory=set)


def route_of_key(key: bytes | None) -> Route | None:
    if not key:
        return None
    model, sep, route = key.decode("utf-8", "replace").partition("/")
    return (model, route) if sep else None


def engine_states_by_route(engine: PolicyEngine, routes: set[Route] | None = None) -> dict[Route, dict[str, Any]]:
    """The engine state of each route (of ``routes`` only, when given: a save serialises just those,
    looked up per policy, so its cost follows the routes asked for, not every route the engine holds)."""
    out: dict[Route, dict[str, Any]] = defaultdict(dict)
    if routes is None:
        for (policy, model, route), st in engine.states.items():
            out[(model, route)][policy] = st.to_json()
        return out
    states = engine.states
    # and the scopes a removed policy keeps while its rollback is in force (``PolicyEngine.set_policy_set``)
    names = [p.name for p in engine.policy_set.policies] + sorted(engine.retired_policies)
    for model, route in routes:
        for name in names:
            found = states.get((name, model, route))
            if found is not None:
                out[(model, route)][name] = found.to_json()
    return out


def engine_json(scopes: dict[str, Any]) -> str:
    """A route's engine-state document (``load_engine_states`` reads it back through ``json.loads``):
    orjson's text, or ``json.dumps``'s when a float in it is not finite (``core.exact_json``)."""
    return exact_json.dumps({"schema": SCHEMA, "scopes": scopes})


def engine_value(scopes: dict[str, Any], packed: bool) -> str:
    """What a route's engine-state key holds: ``engine_json``, packed when ``redis.pack_engine_state``."""
    doc = engine_json(scopes)
    return pack_engine(doc) if packed else doc


def load_engine_states(engine: PolicyEngine, saved: dict[Route, dict[str, Any]]) -> None:
    """Put saved route states into ``engine`` (rules changed since are dropped by set_policy_set)."""
    for (model, route), doc in saved.items():
        for policy, st in (doc.get("scopes") or {}).items():
            engine.states[(policy, model, route)] = ScopeState.from_json(st)
    engine.set_policy_set(engine.policy_set)


def drop_engine_states(engine: PolicyEngine, routes: set[Route]) -> None:
    for key in [k for k in engine.states if (k[1], k[2]) in routes]:
        del engine.states[key]


def window_record(sig: Signal, instance: str) -> str:
    return exact_json.dumps({"schema": 1, "source": sig.source, "model": sig.model, "route": sig.route,
                       "precision": sig.precision, "start": sig.start, "end": sig.end, "samples": sig.samples,
                       "values": sig.values, "instance": instance})


def checkpoint_blob(part: Partition, offset: int | None, max_ts: float | None, instance: str, now: float,
                    topic_id: str | None = None) -> str:
    return exact_json.dumps({"schema": SCHEMA, "offset": offset, "max_ts": max_ts, "closed_end": part.agg.closed_end,
                             "routes": sorted(part.routes), "instance": instance, "saved_at": now,
                             "topic_id": topic_id})
