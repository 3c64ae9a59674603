"""The daemon's counters (``DaemonStats``) and the /status document built from its parts.

/status is JSON for people and ``llm-watchdog status``: partitions and their watermarks, policies,
flags (from the daemon's one flag view, ``watchdog.runtime.decisions.FlagView``), engine verdicts,
recent actions, incidents, golden jobs and GPU health. Building it reads; it changes nothing.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from watchdog.core.signals import Action

if TYPE_CHECKING:
    from watchdog.runtime.daemon import Daemon

#: modules whose presence /status reports (the daemon must not import them unless configured to)
HEAVY_MODULES = ("torch", "transformers", "evaluate", "pynvml")


@dataclass
class DaemonStats:
    started_at: float = field(default_factory=time.time)
    last_loop: float = field(default_factory=time.monotonic)
    windows_closed: int = 0
    actions: int = 0
    checkpoints: int = 0
    last_actions: list[dict[str, Any]] = field(default_factory=list)

    def record_action(self, a: Action) -> None:
        """Count ``a`` and keep it among the 50 most recent."""
        self.actions += 1
        self.last_actions = (self.last_actions + [action_dict(a)])[-50:]


def action_dict(a: Action) -> dict[str, Any]:
    return {"kind": a.kind, "policy": a.policy, "model": a.model, "route": a.route, "precision": a.precision,
            "reason": a.reason, "severity": a.severity, "dry_run": a.dry_run, "at": a.at}


def build_status(d: Daemon) -> dict[str, Any]:
    """The /status document of daemon ``d``."""
    problems = d.problems()
    return {
        "instance": d.cfg.instance,
        "uptime_s": round(time.time() - d.stats.started_at, 1),
        "ready": not problems,
        "problems": problems,
        "partitions": d.ownership.status(),
        "policies": [p.name for p in d.policies.loader.policy_set.policies],
        "flags": {f"{m}/{r}": p for (m, r), p in d.decisions.flags.snapshot().items()},
        "verdicts": d.engine.snapshot(),
        "pending_decisions": d.actuator.pending(),
        "windows_closed": d.stats.windows_closed,
        "checkpoints": d.stats.checkpoints,
        "open_windows": sum(p.agg.open_windows() for p in d.parts.values()),
        "recent_actions": d.stats.last_actions[-20:],
        "incidents": d.alerter.open_incidents(),
        "alerts": d.alerter.stats(),
        "golden": d.golden.status() if d.golden is not None else [],
        "golden_lease": d.golden_leader is not None and d.golden_leader.running,
        "gpu": [h.to_dict() for h in d.gpu.latest()] if d.gpu is not None else [],
        "heavy_modules_loaded": sorted(m for m in HEAVY_MODULES if m in sys.modules),
    }
