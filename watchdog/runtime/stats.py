"""The daemon's counters, shown in /status: loops, windows closed, actions, checkpoints, recent actions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from watchdog.core.signals import Action


@dataclass
class DaemonStats:
    #: monotonic time the daemon started (uptime)
    started_at: float = field(default_factory=time.monotonic)
    #: monotonic time of the last main-loop iteration (liveness)
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
