"""The /status document, built from the daemon's parts.

/status is JSON for people and ``llm-watchdog status``: partitions and their watermarks, policies,
flags (from the daemon's one flag view, ``watchdog.runtime.decisions.FlagView``), engine verdicts,
recent actions, incidents, golden jobs and GPU health. Building it reads; it changes nothing. It runs
on the HTTP thread.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from watchdog.actuation.actuator import Actuator
from watchdog.alerting.alerter import Alerter
from watchdog.policy import PolicyEngine
from watchdog.runtime.decisions import FlagView
from watchdog.runtime.ownership import Ownership
from watchdog.runtime.policies import PolicyReloader
from watchdog.runtime.stats import DaemonStats
from watchdog.sources.golden import GoldenLeader, GoldenScheduler

#: modules whose presence /status reports (the daemon must not import them unless configured to)
HEAVY_MODULES = ("torch", "transformers", "evaluate", "pynvml")


class StatusDocument:
    def __init__(self, instance: str, stats: DaemonStats, problems: Callable[[], list[str]], ownership: Ownership,
                 policies: PolicyReloader, flags: FlagView, engine: PolicyEngine, actuator: Actuator,
                 alerter: Alerter, golden: GoldenScheduler | None, golden_leader: GoldenLeader | None,
                 gpu: Any) -> None:
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
        #: a ``probes.gpu_monitor.GpuMonitor`` or None
        self.gpu = gpu

    def build(self) -> dict[str, Any]:
        problems = self.problems()
        stats = self.stats
        return {
            "instance": self.instance,
            "uptime_s": round(time.monotonic() - stats.started_at, 1),
            "ready": not problems,
            "problems": problems,
            "partitions": self.ownership.status(),
            "policies": [p.name for p in self.policies.loader.policy_set.policies],
            "flags": {f"{m}/{r}": p for (m, r), p in self.flags.snapshot().items()},
            "verdicts": self.engine.snapshot(),
            "pending_decisions": self.actuator.pending(),
            "windows_closed": stats.windows_closed,
            "checkpoints": stats.checkpoints,
            "open_windows": sum(p.agg.open_windows() for p in self.ownership.parts.values()),
            "recent_actions": stats.last_actions[-20:],
            "incidents": self.alerter.open_incidents(),
            "alerts": self.alerter.stats(),
            "golden": self.golden.status() if self.golden is not None else [],
            "golden_lease": self.golden_leader is not None and self.golden_leader.running,
            "gpu": [h.to_dict() for h in self.gpu.latest()] if self.gpu is not None else [],
            "heavy_modules_loaded": sorted(m for m in HEAVY_MODULES if m in sys.modules),
        }
