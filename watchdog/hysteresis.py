"""Hysteresis for an always-on precision flag: when to roll back, when to roll forward again.

Pure state machine over verdicts of the candidate (FP8). ``Hysteresis(config).step(state,
status, now)`` returns the new state and the transition it caused (or None). The state is a
JSON-able dict so the caller can keep it in Redis next to the flag.

Rules (docs/JUDGE.md has the reasoning):

* trip (candidate -> rolled_back) after ``trip_after`` consecutive ``fail`` verdicts; any other
  verdict breaks the streak;
* restore (rolled_back -> candidate) after ``restore_after`` consecutive ``pass`` verdicts of the
  candidate (marginal, inconclusive and error break the streak) AND ``cooldown_s`` since the trip;
* no transition before ``min_dwell_s`` in the current state;
* at most ``max_flips_per_day`` transitions per UTC day. A rollback is the safe direction, so by
  default the budget only blocks restores (``budget_blocks_rollback`` changes that);
* with ``auto_restore`` False a satisfied restore condition yields a ``restore_ready``
  transition (the state stays rolled back) and an operator calls ``manual_restore``.

Each transition records why it happened (``reason`` code plus the counters at that moment).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

log = logging.getLogger(__name__)

Mode = Literal["candidate", "rolled_back"]
TransitionKind = Literal["rollback", "restore", "restore_ready", "blocked"]
STATE_VERSION = 1


@dataclass(slots=True, frozen=True)
class HysteresisConfig:
    trip_after: int = 1
    restore_after: int = 3
    cooldown_s: float = 3600.0
    min_dwell_s: float = 300.0
    max_flips_per_day: int = 4
    auto_restore: bool = True
    budget_blocks_rollback: bool = False

    def __post_init__(self) -> None:
        if self.trip_after < 1 or self.restore_after < 1:
            raise ValueError("trip_after and restore_after must be >= 1")
        if self.cooldown_s < 0 or self.min_dwell_s < 0 or self.max_flips_per_day < 0:
            raise ValueError("cooldown_s, min_dwell_s and max_flips_per_day must be >= 0")


@dataclass(slots=True)
class Transition:
    """What happened at one step, and why."""

    kind: TransitionKind
    from_mode: Mode
    to_mode: Mode
    at: float
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def initial_state(now: float, mode: Mode = "candidate") -> dict[str, Any]:
    """A fresh state; ``now`` counts as the time the current mode was entered."""
    return {
        "version": STATE_VERSION, "mode": mode, "fails": 0, "passes": 0, "since": float(now),
        "tripped_at": None, "flip_day": _day(now), "flips_today": 0, "restore_ready": False,
        "last": None,
    }


def _day(now: float) -> str:
    return datetime.fromtimestamp(now, tz=UTC).date().isoformat()


class Hysteresis:
    def __init__(self, config: HysteresisConfig | None = None) -> None:
        self.config = config or HysteresisConfig()

    def step(self, state: dict[str, Any] | None, status: str, now: float) -> tuple[dict[str, Any], Transition | None]:
        """Feed one verdict status (pass|marginal|fail|inconclusive|error) of the candidate."""
        cfg = self.config
        s = dict(state) if state else initial_state(now)
        if s.get("flip_day") != _day(now):
            s["flip_day"], s["flips_today"] = _day(now), 0
        s["fails"] = s["fails"] + 1 if status == "fail" else 0
        s["passes"] = s["passes"] + 1 if status == "pass" else 0
        mode: Mode = s["mode"]
        dwell = now - s["since"]
        counters = {"fails": s["fails"], "passes": s["passes"], "dwell_s": dwell,
                    "flips_today": s["flips_today"], "status": status}
        if mode == "candidate":
            if s["fails"] < cfg.trip_after:
                return s, None
            if dwell < cfg.min_dwell_s:
                return s, self._blocked(s, now, "min_dwell", counters)
            if cfg.budget_blocks_rollback and s["flips_today"] >= cfg.max_flips_per_day:
                return s, self._blocked(s, now, "flip_budget_exhausted", counters)
            return self._flip(s, now, "rolled_back", "rollback", f"{s['fails']}_consecutive_fails", counters)
        # rolled back: wait for the candidate to prove itself again
        if s["passes"] < cfg.restore_after:
            return s, None
        since_trip = now - (s["tripped_at"] if s["tripped_at"] is not None else s["since"])
        counters["since_trip_s"] = since_trip
        if since_trip < cfg.cooldown_s:
            return s, None
        if dwell < cfg.min_dwell_s:
            return s, None
        if s["flips_today"] >= cfg.max_flips_per_day:
            return s, self._blocked(s, now, "flip_budget_exhausted", counters)
        if not cfg.auto_restore:
            if s["restore_ready"]:
                return s, None
            s["restore_ready"] = True
            t = Transition("restore_ready", mode, mode, now, "manual_restore_required", counters)
            s["last"] = t.to_dict()
            return s, t
        return self._flip(s, now, "candidate", "restore", f"{s['passes']}_consecutive_passes_after_cooldown", counters)

    def manual_restore(self, state: dict[str, Any], now: float, by: str = "operator") -> tuple[dict[str, Any], Transition | None]:
        """Roll forward on an operator's word (ignores streaks, cooldown and budget)."""
        s = dict(state)
        if s["mode"] != "rolled_back":
            return s, None
        if s.get("flip_day") != _day(now):
            s["flip_day"], s["flips_today"] = _day(now), 0
        return self._flip(s, now, "candidate", "restore", "manual_restore", {"by": by, "passes": s["passes"]})

    def _flip(self, s: dict[str, Any], now: float, to: Mode, kind: TransitionKind, reason: str,
              counters: dict[str, Any]) -> tuple[dict[str, Any], Transition]:
        t = Transition(kind, s["mode"], to, now, reason, counters)
        s.update(mode=to, since=now, fails=0, passes=0, restore_ready=False, flips_today=s["flips_today"] + 1,
                 last=t.to_dict())
        if to == "rolled_back":
            s["tripped_at"] = now
        log.info("hysteresis %s -> %s: %s", t.from_mode, to, reason)
        return s, t

    @staticmethod
    def _blocked(s: dict[str, Any], now: float, reason: str, counters: dict[str, Any]) -> Transition:
        mode: Mode = s["mode"]
        return Transition("blocked", mode, mode, now, reason, counters)
