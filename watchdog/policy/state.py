"""Per (policy, model, route) engine state: rule streaks, flip history, open incidents, the last
GPU reading. JSON-able through ``to_json`` / ``from_json`` (older saved states load: new fields
have defaults)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from watchdog.policy.evaluate import Verdict
from watchdog.policy.schema import Rule

STATE_VERSION = 1


#: id(rule) -> (rule, its fingerprints); holding the rule keeps its id from being reused. Rules are
#: frozen, and a new route's state takes one fingerprint per rule: serialising the rule each time
#: cost ~0.1 ms per rule, a third of judging a flood of new routes
_FINGERPRINTS: dict[int, tuple[Rule, tuple[str, str]]] = {}


def rule_fingerprint(rule: Rule) -> str:
    """What the rule's saved state is keyed by: every key that changes how it judges. Its ``description``
    is not one: an ML lead who rewords it (hot-reloaded) keeps the rule's learned nulls, histories and
    horizon tests."""
    return _fingerprints(rule)[0]


def same_rule(rule: Rule, saved: str) -> bool:
    """Whether state saved under fingerprint ``saved`` belongs to ``rule``: its fingerprint, or the form
    releases before 2026-12-06 saved (the description included), so an upgrade keeps what was learned."""
    return saved in _fingerprints(rule)


def _fingerprints(rule: Rule) -> tuple[str, str]:
    """(today's fingerprint, the earlier form)."""
    hit = _FINGERPRINTS.get(id(rule))
    if hit is not None and hit[0] is rule:
        return hit[1]
    # keys left at their defaults are not part of it: a release that adds a key with a default keeps
    # every rule's saved state (learned nulls, horizon tests, anchors) instead of relearning it
    fps = tuple(hashlib.sha256(rule.model_dump_json(by_alias=True, exclude_defaults=True, exclude=exclude)
                               .encode()).hexdigest()[:16] for exclude in ({"description"}, None))
    if len(_FINGERPRINTS) >= 4096:  # policy reloads make new rule objects: keep the cache bounded
        _FINGERPRINTS.clear()
    _FINGERPRINTS[id(rule)] = (rule, (fps[0], fps[1]))
    return fps[0], fps[1]


@dataclass(slots=True)
class RuleState:
    fingerprint: str
    fails: int = 0
    errors: int = 0
    last: Verdict | None = None
    #: candidate and baseline values of the last passing window: the "before" of cause attribution
    #: ... and "recent": [[end, candidate, baseline], ...] of the last passing windows (a pooled
    #: rule compares with the last one before its pool; watchdog/policy/causes.py)
    ref: dict[str, Any] | None = None
    #: pooled judge history (watchdog/policy/pooling.py): the last ``pool`` windows' sketches or
    #: counts, or the last ``replays`` golden replays' per-item differences; emptied by a flip.
    #: ``pool`` and ``null`` are the empty tuple until a judged rule needs the list (``pool_list``,
    #: ``null_list``): a ``fail_if`` rule never does, and an empty list per rule and route is a
    #: container the cyclic collector walks (at 10,000 routes, 120,000 of them for nothing)
    pool: list[dict[str, Any]] | tuple[()] = ()
    #: learned null (judge.learn): the last healthy windows' differences and their stated sampling
    #: variances {"end", "e", "v"} ("v" absent in states saved before it was kept), or for a
    #: paired rule with ``broken`` the passing replays' broken counts {"end", "broken", "n"};
    #: bounded, kept across flips (it describes healthy FP8 vs FP16, not the serving state)
    null: list[dict[str, Any]] | tuple[()] = ()
    #: what a rule learns over a longer horizon: {"seq": the staggered sequential tests
    #: (watchdog/policy/judge/sequential.py; emptied by a flip), "anchor": the long-term anchor of
    #: the learned null (watchdog/policy/judge/anchor.py; kept across flips)}; absent keys = none yet
    horizon: dict[str, Any] = field(default_factory=dict)
    #: windows judged by this process (a restored state with a verdict counts one); not saved: the
    #: evidence recorder compares it with the windows it kept to say when a record's history is cut
    judged: int = 0
    #: what the horizon test remembers between two looks (``sequential.evaluate``'s MDEs with their
    #: inputs); not saved: a cache of numbers the state gives again
    seq_memo: list[Any] | None = field(default=None, repr=False, compare=False)

    def pool_list(self) -> list[dict[str, Any]]:
        if not isinstance(self.pool, list):
            self.pool = []
        return self.pool

    def null_list(self) -> list[dict[str, Any]]:
        if not isinstance(self.null, list):
            self.null = []
        return self.null

    def tripped(self, rule: Rule) -> bool:
        if self.fails >= rule.for_:
            return True
        return rule.errors_trip_after is not None and self.errors >= rule.errors_trip_after

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "fails": self.fails, "errors": self.errors,
                "last": self.last.to_dict() if self.last else None, "ref": self.ref, "pool": list(self.pool),
                "null": list(self.null), "horizon": dict(self.horizon)}

    @classmethod
    def from_json(cls, r: dict[str, Any]) -> RuleState:
        last = Verdict.from_dict(r["last"]) if r.get("last") else None
        pool = r.get("pool") or []  # absent in states saved before pooled rules
        if not isinstance(pool, list) or not all(isinstance(e, dict) for e in pool):
            pool = []
        null = r.get("null") or []  # absent in states saved before learned nulls
        if not isinstance(null, list) or not all(isinstance(e, dict) for e in null):
            null = []
        horizon = r.get("horizon") or {}  # absent in states saved before horizon tests and anchors
        if not isinstance(horizon, dict):
            horizon = {}
        return cls(r["fingerprint"], int(r["fails"]), int(r["errors"]), last, r.get("ref"), list(pool) if pool else (),
                   list(null) if null else (), dict(horizon), 1 if last is not None else 0)


@dataclass(slots=True)
class ScopeState:
    rules: dict[str, RuleState] = field(default_factory=dict)
    last_end: dict[str, float] = field(default_factory=dict)
    healthy: int = 0
    serving: str | None = None
    serving_since: float | None = None
    #: when the route last changed precision as far as this scope knows (our flip, another policy's or an
    #: operator's); None when it was on its precision when first seen. Windows begun before it do not
    #: count as healthy (``PolicyEngine._count_healthy``)
    changed_at: float | None = None
    last_flip: float | None = None
    flip_day: str = ""
    flips_today: int = 0
    #: a flip we asked for that the flags do not show yet: {"kind", "precision", "at"}
    pending: dict[str, Any] | None = None
    open_alerts: set[str] = field(default_factory=set)
    promote_ready_alerted: bool = False
    promote_ready: bool = False
    #: the latest usable GPU reading of the route: {"at": end, "problems": ["xid_critical=1", ...]}
    gpu: dict[str, Any] | None = None
    #: the precision our last rollback put the route on, while no promote or change by someone else
    #: followed it (whether this policy's rollback is what holds the route on its baseline)
    rollback_to: str | None = None
    #: set when the policy was removed, or its scope no longer covers the route, while its rollback was in
    #: force: {"why": "removed" | "scope", "precision", "candidate", "routing", "told"}. Such a scope
    #: judges nothing; it keeps the rollback's incident until the route leaves that precision
    #: (``PolicyEngine.set_policy_set``)
    retired: dict[str, Any] | None = None

    def reset_pools(self) -> None:
        """Start every pooled rule afresh: evidence from before a flip is not about after it."""
        for rs in self.rules.values():
            if isinstance(rs.pool, list):
                rs.pool.clear()
            rs.horizon.pop("seq", None)  # the horizon tests too; the long-term anchor stays

    def to_json(self) -> dict[str, Any]:
        return {
            "rules": {n: r.to_json() for n, r in self.rules.items()},
            "last_end": dict(self.last_end),
            "healthy": self.healthy,
            "serving": self.serving,
            "serving_since": self.serving_since,
            "last_flip": self.last_flip,
            "flip_day": self.flip_day,
            "flips_today": self.flips_today,
            "pending": self.pending,
            "open_alerts": sorted(self.open_alerts),
            "promote_ready_alerted": self.promote_ready_alerted,
            "gpu": self.gpu,
            # only when set: most scopes never roll back (bytes per route in every checkpoint)
            **({"rollback_to": self.rollback_to} if self.rollback_to is not None else {}),
            **({"changed_at": self.changed_at} if self.changed_at is not None else {}),
            **({"retired": self.retired} if self.retired is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScopeState:
        st = cls()
        st.rules = {name: RuleState.from_json(r) for name, r in d.get("rules", {}).items()}
        st.last_end = {k: float(v) for k, v in d.get("last_end", {}).items()}
        st.healthy = int(d.get("healthy", 0))
        st.serving = d.get("serving")
        st.serving_since = d.get("serving_since")
        changed_at = d.get("changed_at")
        st.changed_at = float(changed_at) if isinstance(changed_at, int | float) else None
        st.last_flip = d.get("last_flip")
        st.flip_day = d.get("flip_day", "")
        st.flips_today = int(d.get("flips_today", 0))
        st.pending = d.get("pending")
        st.open_alerts = set(d.get("open_alerts", []))
        st.promote_ready_alerted = bool(d.get("promote_ready_alerted", False))
        st.gpu = d.get("gpu")
        st.rollback_to = d.get("rollback_to")
        retired = d.get("retired")
        st.retired = dict(retired) if isinstance(retired, dict) and retired.get("precision") else None
        return st
