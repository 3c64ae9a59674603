"""The /status document, built from the daemon's parts.

/status is JSON for people and ``llm-watchdog status``: partitions and their watermarks, policies,
flags (from the daemon's one flag view, ``watchdog.runtime.decisions.FlagView``), engine verdicts,
recent actions, incidents, golden jobs and GPU health. Building it reads; it changes nothing. It runs
on the HTTP thread.

Bounded whatever the number of routes: ``flags`` and the ``verdicts`` scopes list the ``top`` (default
``TOP_ROUTES``, at most ``MAX_TOP``) most notable routes (a flag off the default, a flip pending, an
incident open, a failing or erring rule, then the most recent flip, then by name) with the totals
beside them (``routes``); ``?route=NAME`` (and ``&model=NAME``) gives those routes alone, whatever
their rank.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from watchdog.actuation.actuator import Actuator
from watchdog.alerting.alerter import Alerter
from watchdog.policy import PolicyEngine
from watchdog.runtime.decisions import FlagView
from watchdog.runtime.golden import GoldenRelay
from watchdog.runtime.http import BadQuery
from watchdog.runtime.ownership import Ownership
from watchdog.runtime.policies import PolicyReloader
from watchdog.runtime.routes import RouteKeeper
from watchdog.runtime.stats import DaemonStats
from watchdog.sources.golden import GoldenLeader, GoldenScheduler

#: modules whose presence /status reports (the daemon must not import them unless configured to)
HEAVY_MODULES = ("torch", "transformers", "evaluate", "pynvml")
#: routes /status lists by default, and at most (``?top=N``)
TOP_ROUTES = 20
MAX_TOP = 1000
#: the parameters /status takes
QUERY_KEYS = frozenset({"route", "model", "top"})
#: incidents listed at most
MAX_INCIDENTS = 100

Route = tuple[str, str]


class StatusDocument:
    def __init__(self, instance: str, stats: DaemonStats, problems: Callable[[], list[str]], ownership: Ownership,
                 policies: PolicyReloader, flags: FlagView, engine: PolicyEngine, actuator: Actuator,
                 alerter: Alerter, golden: GoldenScheduler | None, golden_leader: GoldenLeader | None,
                 gpu: Any, routes: RouteKeeper | None = None, default_precision: str = "fp8",
                 golden_relay: GoldenRelay | None = None) -> None:
        self.instance = instance
        self.stats = stats
        self.problems = problems
        self.ownership = ownership
        self.policies = policies
        self.flags = flags
        self.engine = engine
        self.actuator = actuator
        self.alerter = alerter
        self.golden = golden
        self.golden_leader = golden_leader
        self.golden_relay = golden_relay
        #: a ``probes.gpu_monitor.GpuMonitor`` or None
        self.gpu = gpu
        self.routes = routes
        self.default_precision = default_precision

    def build(self, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The document; ``query``: ``route`` (and ``model``) for one route, ``top`` for how many."""
        query = query or {}
        unknown = sorted(set(query) - QUERY_KEYS)
        if unknown:
            raise BadQuery(f"unknown /status parameter {unknown[0][:40]!r}: use route, model or top")
        problems = self.problems()
        stats = self.stats
        flags = self.flags.snapshot()
        incidents = self.alerter.open_incidents()
        if "route" in query or "model" in query:
            shown = self._matching(flags, query.get("model"), query.get("route"))
            if not shown:
                what = " ".join(f"{k} {query[k][:80]!r}" for k in ("model", "route") if k in query)
                raise BadQuery(f"no known route with {what} (flags, policy state and open windows were searched)",
                               code=404)
        else:
            top_arg = query.get("top", str(TOP_ROUTES))
            if not (top_arg.isascii() and top_arg.isdigit() and int(top_arg) <= MAX_TOP):
                raise BadQuery(f"top must be a whole number from 0 to {MAX_TOP}, got {top_arg[:40]!r}")
            shown = self._notable(flags, int(top_arg))
        wanted = set(shown)
        routes: dict[str, Any] = dict(self.routes.status()) if self.routes is not None else {}
        routes.update(flags=len(flags), with_state=len({(m, r) for _p, m, r in list(self.engine.states)}), shown=len(shown))
        return {
            "instance": self.instance,
            "uptime_s": round(time.monotonic() - stats.started_at, 1),
            "ready": not problems,
            "problems": problems,
            "partitions": self.ownership.status(),
            "policies": [p.name for p in self.policies.loader.policy_set.policies],
            "routes": routes,
            "flags": {f"{m}/{r}": p for (m, r), p in flags.items() if (m, r) in wanted},
            "verdicts": self.engine.snapshot(wanted),
            "pending_decisions": self.actuator.pending(),
            "windows_closed": stats.windows_closed,
            "checkpoints": stats.checkpoints,
            "open_windows": sum(p.agg.open_windows() for p in self.ownership.parts.values()),
            "recent_actions": stats.last_actions[-20:],
            "incidents": incidents[:MAX_INCIDENTS],
            "incidents_total": len(incidents),
            "alerts": self.alerter.stats(),
            "golden": self.golden.status() if self.golden is not None else [],
            "golden_lease": self.golden_leader is not None and self.golden_leader.running,
            "golden_stream": self.golden_relay.status() if self.golden_relay is not None else None,
            "golden_engines": self.golden.engines_status() if self.golden is not None else None,
            "gpu": [h.to_dict() for h in self.gpu.latest()] if self.gpu is not None else [],
            "heavy_modules_loaded": sorted(m for m in HEAVY_MODULES if m in sys.modules),
        }

    def _matching(self, flags: Mapping[Route, str], model: str | None, route: str | None) -> list[Route]:
        """Every known route named ``route`` (of ``model`` when given)."""
        known = set(flags) | {(m, r) for _p, m, r in list(self.engine.states)}
        for part in list(self.ownership.parts.values()):
            known |= part.routes
        return sorted(r for r in known if (route is None or r[1] == route) and (model is None or r[0] == model))

    def _notable(self, flags: Mapping[Route, str], top: int) -> list[Route]:
        """The ``top`` routes on-call most needs to see (see the module docstring)."""
        if top <= 0:
            return []
        default = self.default_precision
        rank: dict[Route, tuple[int, float]] = {r: (0 if p != default else 3, 0.0) for r, p in flags.items()}
        pending = self.actuator.pending_routes()
        for (_p, m, r), st in list(self.engine.states.items()):
            route = (m, r)
            if route in pending or st.pending is not None or st.open_alerts:
                level = 0
            elif any(rs.fails or rs.errors for rs in st.rules.values()):
                level = 1
            else:
                level = 2
            old = rank.get(route, (4, 0.0))
            rank[route] = (min(old[0], level), max(old[1], st.last_flip or 0.0))
        return sorted(rank, key=lambda r: (rank[r][0], -rank[r][1], r))[:top]
