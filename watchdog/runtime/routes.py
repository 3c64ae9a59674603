"""Bounded routes: how many (model, route) pairs this replica keeps state for, and forgetting idle ones.

Model and route names come from producers, so the state kept per route (open windows, the policy
engine's scopes, checkpoint entries, metric series, /status rows) is bounded three ways
(docs/OPERATIONS.md, "Bounded routes"):

* **names**: ``decode_event`` refuses a name longer than 200 characters or holding a space,
  control or invisible character (``watchdog.core.events.name_problem``);
* **caps**: ``Ownership.fold`` dead-letters an event of a *new* route beyond
  ``windows.max_routes_per_partition`` or ``windows.max_routes`` with reason ``route_limit``
  (counted, its offset passes like any dead letter's); routes already known are judged as before.
  ``RouteKeeper.update`` exports ``llmwd_routes_active`` and ``llmwd_route_limit_events_total`` and
  holds the readiness reason ``route-limit`` (one warning page) while refusals go on;
* **idle eviction**: a route without an event for ``windows.route_idle_s`` is forgotten (its engine
  scopes and evidence windows, its place in the partition and, with the partition's next checkpoint, its engine-state key
  and its entry in the checkpoint), unless it has an open window, its flag is off the default
  precision, a flip of it is pending or in flight, or one of its scopes has an open incident.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from watchdog.config.settings import Config
from watchdog.core.metrics import Metrics
from watchdog.policy import PolicyEngine
from watchdog.runtime.health import Readiness
from watchdog.runtime.ownership import Ownership
from watchdog.state import partitions as P

log = logging.getLogger(__name__)

#: the readiness reason ``route-limit`` holds this long after the last refused event
ROUTE_LIMIT_HOLD_S = 60.0
#: at most this often the gauges are exported and the refusals looked at
EXPORT_EVERY_S = 1.0


class RouteKeeper:
    def __init__(self, cfg: Config, ownership: Ownership, engine: PolicyEngine, readiness: Readiness,
                 metrics: Metrics, flags: Callable[[], Mapping[P.Route, str]],
                 pending: Callable[[], set[P.Route]],
                 incidents: Callable[[], list[dict[str, Any]]] = list,
                 forget: Callable[[set[P.Route]], None] | None = None) -> None:
        self.cfg = cfg
        self.ownership = ownership
        self.engine = engine
        self.readiness = readiness
        self.metrics = metrics
        #: the flags as the daemon sees them (``FlagView.snapshot``) and the routes with a flip pending
        self.flags = flags
        self.pending = pending
        #: the alerter's open incidents (``Alerter.open_incidents``: dicts with ``model`` and ``route``)
        self.incidents = incidents
        #: what else keeps per-route state drops the forgotten routes' (``EvidenceRecorder.forget``)
        self.forget = forget or (lambda _routes: None)
        self.idle_s = cfg.windows.route_idle_s
        #: seconds between two sweeps for idle routes
        self.sweep_every_s = min(30.0, max(0.2, self.idle_s / 10))
        self._last_sweep = 0.0
        self._last_export = 0.0
        self._counted = {"partition": 0, "replica": 0}
        self._limited_at: float | None = None
        #: routes forgotten as idle since start
        self.evicted = 0

    def update(self, now: float) -> None:
        """Export the counts, hold or clear ``route-limit``, and forget idle routes when due."""
        if now - self._last_sweep >= self.sweep_every_s:
            self._last_sweep = now
            self.sweep(now)
        if now - self._last_export < EXPORT_EVERY_S:
            return
        self._last_export = now
        own = self.ownership
        self.metrics.routes_active.set(len(own.route_part))
        fresh = 0
        for cap, n in own.route_limited.items():
            new = n - self._counted[cap]
            if new:
                self.metrics.route_limit_events.labels(cap).inc(new)
                self._counted[cap] = n
                fresh += new
        if fresh:
            self._limited_at = now
            full = sorted(pk[1] for pk, part in own.parts.items() if len(part.routes) >= own.max_part_routes)
            self.readiness.set("route-limit", (
                f"events of new routes refused (route_limit): {len(own.route_part)} routes active (at most "
                f"{own.max_routes} per replica, {own.max_part_routes} per partition; full partitions {full[:20]})"),
                now)
        elif self._limited_at is not None and now - self._limited_at >= ROUTE_LIMIT_HOLD_S:
            self._limited_at = None
            self.readiness.clear("route-limit", now)

    def sweep(self, now: float) -> int:
        """Forget every route idle for ``route_idle_s`` that may be forgotten; how many were."""
        idle_before = now - self.idle_s
        candidates: dict[P.Route, P.Partition] = {}
        for part in self.ownership.parts.values():
            for route, seen in part.last_seen.items():
                if seen <= idle_before:
                    candidates[route] = part
        if not candidates:
            return 0
        keep = self._kept(candidates)
        own = self.ownership
        by_part: dict[P.PartitionKey, set[P.Route]] = {}
        for route, part in candidates.items():
            if route in keep:
                continue
            by_part.setdefault(part.pk, set()).add(route)
        n = 0
        for pk, routes in by_part.items():
            part = own.parts[pk]
            open_routes = part.agg.open_routes()
            gone = routes - open_routes
            if not gone:
                continue
            for route in gone:
                part.routes.discard(route)
                del part.last_seen[route]
                if own.route_part.get(route) == pk:
                    del own.route_part[route]
            part.dirty_routes -= gone
            part.evicted |= gone
            part.dirty = True
            P.drop_engine_states(self.engine, gone)
            self.forget(gone)
            n += len(gone)
        if n:
            self.evicted += n
            log.info("forgot %d routes idle for %.0f s (%d routes active)", n, self.idle_s, len(own.route_part))
        return n

    def _kept(self, candidates: Mapping[P.Route, P.Partition]) -> set[P.Route]:
        """Candidates that must stay: a flag off the default, a flip pending, an incident open."""
        default = self.cfg.default_precision
        flags = self.flags()
        keep = {r for r in candidates if flags.get(r, default) != default}
        keep |= self.pending() & candidates.keys()
        keep |= {(str(i.get("model")), str(i.get("route"))) for i in self.incidents()} & candidates.keys()
        for (_p, m, r), st in self.engine.states.items():
            route = (m, r)
            if route in candidates and (st.pending is not None or st.open_alerts
                                        or st.serving not in (None, default)):
                keep.add(route)
        return keep

    def status(self) -> dict[str, object]:
        own = self.ownership
        return {"active": len(own.route_part), "max_routes": own.max_routes,
                "max_routes_per_partition": own.max_part_routes, "refused_events": dict(own.route_limited),
                "idle_s": self.idle_s, "evicted": self.evicted}
