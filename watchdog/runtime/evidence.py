"""Evidence records of the daemon's decisions: collected on the loop, written to Redis cheaply.

``EvidenceRecorder`` sits beside ``runtime/decisions.py``:

* ``observe`` (after every ``PolicyEngine.observe``) keeps, per (policy, model, route) and rule, the
  last ``evidence.windows_before`` judged windows (the rules' last ``Verdict`` objects, by reference:
  no copy, no extra judging; ``policy/evidence.verdict_entry`` reads them when a decision needs
  them) and the latest golden replay's regressed items with their texts; the windows of a route
  with an open record also go into that record's ``after`` lists (``evidence.windows_after`` of them).
  Windows are kept for every *watched* scope (a rule failing or erroring, an alert open, a flip
  pending, serving the baseline, a record open) and for at most ``evidence.history_routes`` other,
  calm ones, the least recently judged of which lose theirs first (``on_evict``); a record whose
  windows before were cut so says (``rules[].before_missing``). A route forgotten as idle is
  forgotten here too (``forget``, called by ``runtime/routes.py``);
* ``decided`` (for each rollback, promote and alert) gives the action its evidence id
  (``action.detail['evidence']``, so every page of it links to ``<server.external_url>/evidence/<id>``)
  and builds its record (``policy/evidence.build_record``);
* ``flush`` (once per loop iteration, after the flips) writes the records built or changed since the
  last call in one pipeline: each record bounded to ``evidence.max_bytes``, with the route's entries
  of the audit stream, a TTL, and the index trimmed to ``max_records`` and ``ttl_s``. A failed write
  is retried (after ``RETRY_S``); past ``MAX_QUEUED`` the oldest waiting record is dropped and counted.
A failed write is logged and counted, not a readiness reason: evidence never decides whether the
daemon is ready (the checkpoints and the flips, which share the Redis, say when Redis is down).

Nothing here blocks the decision path on Redis: ``observe`` and ``decided`` do no I/O, ``flush``
writes only when a decision happened or an open record got a window (rare), in one round trip.
The page that shows a record is ``runtime/evidence_http.py``.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Any

import redis

from watchdog.config.settings import EvidenceConfig
from watchdog.core.keys import Keys, text
from watchdog.core.signals import Action, Signal
from watchdog.policy import PolicyEngine
from watchdog.policy.evaluate import Verdict
from watchdog.policy.evidence import (
    KINDS,
    annotate,
    bounded_json,
    build_record,
    evidence_id,
    summary_of,
    verdict_entry,
)
from watchdog.policy.schema import Policy
from watchdog.policy.state import ScopeState
from watchdog.runtime.budget import PutOff, StepDeadline

log = logging.getLogger(__name__)

#: seconds between two write attempts after a failed one
RETRY_S = 5.0
#: records waiting to be written at most (the oldest is dropped past it)
MAX_QUEUED = 256
#: records still collecting their ``after`` windows at most (the oldest is closed past it)
MAX_OPEN = 64
#: records written in one ``flush``
MAX_WRITE = 16
#: audit entries read per flush (the route's are kept, newest last, at most ``AUDIT_KEPT``)
AUDIT_SCAN = 500
AUDIT_KEPT = 20
#: seconds between two passes forgetting the windows of routes the engine forgot (e.g. revoked)
PRUNE_EVERY_S = 60.0
#: iterations in a row a flush (and a prune) waits for when the loop iteration's shared deadline has
#: passed: after a window boundary at 10,000 routes judging takes the deadline, and a flush then made
#: iterations of 0.27-0.35 s (evidence 0.07-0.09 s of them; docs/BENCHMARKS.md, "Checkpoints that fall behind")
MAX_WAITS = 4

ScopeKey = tuple[str, str, str]  # (policy, model, route)
#: rule name -> its last judged windows, oldest first
History = dict[str, list[Verdict]]


def audit_of(client: Any, keys: Keys, model: str, route: str, count: int = AUDIT_SCAN,
             kept: int = AUDIT_KEPT) -> list[dict[str, Any]]:
    """The route's entries among the last ``count`` of the audit stream, oldest first."""
    return audits_of(client, keys, {(model, route)}, count, kept)[(model, route)]


def audits_of(client: Any, keys: Keys, routes: Collection[tuple[str, str]], count: int = AUDIT_SCAN,
              kept: int = AUDIT_KEPT) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """``audit_of`` of each route, from one read of the stream (a flush of 16 records read and decoded
    the last 500 entries once per route: 0.08-0.15 s of the loop at 10,000 routes)."""
    found: dict[tuple[str, str], list[dict[str, Any]]] = {r: [] for r in routes}
    left = len(found)
    for entry_id, fields in client.xrevrange(keys.audit, count=count):
        rec = {text(k): text(v) for k, v in fields.items()}
        out = found.get((rec.get("model", ""), rec.get("route", "")))
        if out is None or len(out) >= kept:
            continue
        rec["id"] = text(entry_id)
        out.append(rec)
        if len(out) >= kept:
            left -= 1
            if not left:
                break
    return {r: out[::-1] for r, out in found.items()}


class EvidenceRecorder:
    def __init__(self, cfg: EvidenceConfig, keys: Keys, client: Any, engine: PolicyEngine, instance: str,
                 on_error: Callable[[Exception, str], None] | None = None,
                 gpu_latest: Callable[[], list[dict[str, Any]]] | None = None,
                 count: Callable[[str, int], None] | None = None,
                 on_evict: Callable[[int], None] | None = None) -> None:
        self.cfg = cfg
        self.keys = keys
        self.client = client
        self.engine = engine
        self.instance = instance
        self.on_error = on_error
        self.gpu_latest = gpu_latest
        #: ``count(result, n)``: written, failed, dropped (``llmwd_evidence_records_total``)
        self.count = count or (lambda _result, _n: None)
        #: ``on_evict(n)``: calm scopes that lost their windows (``llmwd_evidence_history_evictions_total``)
        self.on_evict = on_evict or (lambda _n: None)
        #: the rules' last verdicts, as the engine made them (objects kept, not copied: entries are
        #: built only for a decision's record): of watched scopes, and of calm ones least recently
        #: judged first (at most ``history_routes``)
        self._watched: dict[ScopeKey, History] = {}
        self._calm: OrderedDict[ScopeKey, History] = OrderedDict()
        self.history_evicted = 0
        self._outputs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        #: id -> record, of records still collecting ``after`` windows
        self._open: OrderedDict[str, dict[str, Any]] = OrderedDict()
        #: id -> record, to write
        self._queue: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._retry_at = -math.inf
        self._pruned_at = -math.inf
        self._trimmed_at = -math.inf
        #: the loop iteration's shared deadline (``Daemon.step`` binds it; never reached outside it)
        self.step = StepDeadline()
        self._put_off = PutOff(MAX_WAITS)
        self.written = 0
        self.dropped = 0
        self.last_error: str | None = None

    # -- on the loop, no I/O ---------------------------------------------------------------------
    def observe(self, signals: Iterable[Signal], routes: Iterable[tuple[str, str]], now: float) -> None:
        """After the engine judged ``signals``: keep each touched route's newly judged windows."""
        if not self.cfg.enabled:
            return
        for s in signals:
            outputs = s.detail.get("outputs") if s.source == "golden" else None
            if isinstance(outputs, list):
                self._outputs[(s.model, s.route)] = outputs[:50]
        policies = self.engine.policy_set.policies
        open_scopes = {(r["policy"], r["model"], r["route"]) for r in self._open.values()}
        keep = self.cfg.windows_before
        for model, route in routes:
            if "*" in (model, route):
                continue
            for policy in policies:
                key = (policy.name, model, route)
                st = self.engine.states.get(key)
                if st is None:
                    continue
                hist = self._watched.pop(key, None)
                if hist is None:
                    hist = self._calm.pop(key, None) or {}
                for name, rs in st.rules.items():
                    v = rs.last
                    if v is None:
                        continue
                    ring = hist.get(name)
                    if ring is None:
                        ring = hist[name] = []
                    elif ring and (ring[-1] is v or ring[-1].end >= v.end):
                        continue
                    ring.append(v)
                    if len(ring) > keep:
                        del ring[:-keep]
                    if key in open_scopes:
                        self._after(model, route, policy.name, name, verdict_entry(v))
                if key in open_scopes or watched(policy, st):
                    self._watched[key] = hist
                else:
                    self._calm[key] = hist
        evicted = 0
        while len(self._calm) > self.cfg.history_routes:
            self._calm.popitem(last=False)
            evicted += 1
        if evicted:
            self.history_evicted += evicted
            self.on_evict(evicted)

    def _after(self, model: str, route: str, policy: str, rule: str, entry: dict[str, Any]) -> None:
        for eid, rec in list(self._open.items()):
            if (rec["model"], rec["route"], rec["policy"]) != (model, route, policy) or entry["end"] <= rec["at"]:
                continue
            for r in rec["rules"]:
                if r["name"] == rule and len(r["after"]) < self.cfg.windows_after:
                    pol = self.engine.policy_set.get(policy)
                    r["after"].append(annotate(pol.rule(rule) if pol is not None else None, dict(entry)))
                    rec["updated_at"] = entry["end"]
                    self._queue[eid] = rec
            targets = [r for r in rec["rules"] if r["involved"]] or rec["rules"]
            if all(len(r["after"]) >= self.cfg.windows_after for r in targets):
                rec["complete"] = True
                del self._open[eid]

    def _prune(self) -> None:
        """Forget the windows and golden outputs of scopes the engine no longer keeps (a revoked
        partition's, a removed policy's); idle routes are forgotten at once by ``forget``."""
        states = self.engine.states
        for kept in (self._watched, self._calm):
            for key in [k for k in kept if k not in states]:
                del kept[key]
        routes = {(m, r) for _p, m, r in states}
        for route in [r for r in self._outputs if r not in routes]:
            del self._outputs[route]

    def forget(self, routes: set[tuple[str, str]]) -> None:
        """Drop every window and golden output kept for ``routes`` (forgotten as idle)."""
        for kept in (self._watched, self._calm):
            for key in [k for k in kept if (k[1], k[2]) in routes]:
                del kept[key]
        for route in routes & self._outputs.keys():
            del self._outputs[route]

    def history_size(self) -> tuple[int, int]:
        """Scopes whose windows are kept: (watched, calm)."""
        return len(self._watched), len(self._calm)

    def routes_kept(self) -> set[tuple[str, str]]:
        """The (model, route) pairs some of whose windows are kept."""
        return {(m, r) for kept in (self._watched, self._calm) for _p, m, r in kept}

    def decided(self, action: Action, serving: str | None) -> str | None:
        """Give ``action`` its evidence id and build its record; the id, or None (no record)."""
        if not self.cfg.enabled or action.kind not in KINDS or (action.detail or {}).get("reassert"):
            return None
        eid = evidence_id(action)
        action.detail["evidence"] = eid
        try:
            policy = self.engine.policy_set.get(action.policy)
            key = (action.policy, action.model, action.route)
            st = self.engine.states.get(key)
            hist = self._watched.get(key) or self._calm.get(key) or {}
            rules = st.rules if st is not None else {}
            windows = {name: [verdict_entry(v) for v in hist.get(name, ())] for name in rules}
            # windows the engine judged that this record cannot show (history cut, or a restart)
            missing = {name: max(0, min(rs.judged, self.cfg.windows_before) - len(windows[name]))
                       for name, rs in rules.items()}
            gpu: dict[str, Any] = {}
            if st is not None and st.gpu:
                gpu["route"] = st.gpu
            if self.gpu_latest is not None:
                gpu["devices"] = self.gpu_latest()[:16]
            record = build_record(action, eid, policy, st, windows, self._outputs.get((action.model, action.route)),
                                  gpu, self.instance, serving, missing)
        except Exception:  # noqa: BLE001 - evidence must never stop a decision
            log.exception("evidence of %s %s/%s not recorded", action.kind, action.model, action.route)
            return None
        self._queue[eid] = record
        self._queue.move_to_end(eid)
        if self.cfg.windows_after > 0 and action.kind in ("rollback", "promote", "alert") and not record.get(
                "complete"):
            self._open[eid] = record
            while len(self._open) > MAX_OPEN:
                _old, rec = self._open.popitem(last=False)
                rec["complete"] = True
        while len(self._queue) > MAX_QUEUED:
            self._queue.popitem(last=False)
            self.dropped += 1
            self.count("dropped", 1)
        return eid

    # -- writing (once per loop iteration) -------------------------------------------------------
    def pending(self) -> int:
        return len(self._queue)

    def flush(self, now: float) -> int:
        """Write up to ``MAX_WRITE`` waiting records in one pipeline; the number written. Past the
        iteration's deadline it waits (``MAX_WAITS`` iterations at most): the records keep."""
        if self._put_off.now(self.step):
            return 0
        if now - self._pruned_at >= PRUNE_EVERY_S:  # here: it runs every loop iteration, judged or not
            self._pruned_at = now
            self._prune()
        if not self._queue or now < self._retry_at:
            return 0
        batch = list(self._queue.items())[:MAX_WRITE]
        try:
            audits = audits_of(self.client, self.keys, {(rec["model"], rec["route"]) for _eid, rec in batch})
            for _eid, rec in batch:
                route = (rec["model"], rec["route"])
                if audits[route]:
                    rec["audit"] = audits[route]
            ttl = int(self.cfg.ttl_s)
            pipe = self.client.pipeline(transaction=True)
            for eid, rec in batch:
                pipe.set(self.keys.evidence(eid), bounded_json(rec, self.cfg.max_bytes), ex=ttl)
                pipe.hset(self.keys.evidence_summaries, eid, json.dumps(summary_of(rec), default=str))
                pipe.zadd(self.keys.evidence_index, {eid: float(rec.get("at") or now)})
            added = sum(int(n) for n in pipe.execute()[2::3])  # ZADD: ids new to the index
            # the index grew, or records may have outlived ttl_s: a record rewritten after each window
            # that follows its decision (``windows_after``) trimmed nothing, for 2-4 more round trips
            if added or now - self._trimmed_at >= PRUNE_EVERY_S:
                self._trim(now)
                self._trimmed_at = now
        except (redis.RedisError, OSError) as exc:
            self._retry_at = now + RETRY_S
            if self.last_error is None:  # once per outage: readiness is the checkpoints' and flips' to say
                log.warning("evidence records not written (%d waiting, retried every %.0f s): %s: %s",
                            len(self._queue), RETRY_S, type(exc).__name__, exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.count("failed", len(batch))
            if self.on_error is not None:
                self.on_error(exc, "writing evidence records")
            return 0
        for eid, rec in batch:
            if self._queue.get(eid) is rec:
                del self._queue[eid]
        self.written += len(batch)
        self.count("written", len(batch))
        self.last_error = None
        return len(batch)

    def _trim(self, now: float) -> None:
        """Keep ``max_records`` ids no older than ``ttl_s``: older ones leave the index, the summaries
        and (if their TTL has not removed them yet) Redis."""
        index = self.keys.evidence_index
        old = [text(x) for x in self.client.zrangebyscore(index, "-inf", now - self.cfg.ttl_s)]
        extra = int(self.client.zcard(index)) - len(old) - self.cfg.max_records
        if extra > 0:
            old += [text(x) for x in self.client.zrange(index, len(old), len(old) + extra - 1)]
        if not old:
            return
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(index, *old)
        pipe.hdel(self.keys.evidence_summaries, *old)
        pipe.delete(*[self.keys.evidence(i) for i in old])
        pipe.execute()

    def status(self) -> dict[str, Any]:
        return {"enabled": self.cfg.enabled, "written": self.written, "waiting": len(self._queue),
                "open": len(self._open), "dropped": self.dropped, "last_error": self.last_error,
                "history": {"watched": len(self._watched), "calm": len(self._calm),
                            "max_calm": self.cfg.history_routes, "evicted": self.history_evicted}}


def watched(policy: Policy, st: ScopeState) -> bool:
    """Whether a scope's windows are kept whatever ``history_routes`` says: a rule failing or
    erroring, an alert open, a flip pending, or the route serving the baseline (a promote's
    record shows the healthy windows that led to it)."""
    if st.open_alerts or st.pending is not None:
        return True
    if st.serving is not None and st.serving == policy.baseline != policy.candidate:
        return True
    return any(rs.fails or rs.errors for rs in st.rules.values())


def read_record(client: Any, keys: Keys, eid: str) -> dict[str, Any] | None:
    """One record (None when absent or expired); the audit trail refreshed from the stream."""
    raw = client.get(keys.evidence(eid))
    if raw is None:
        return None
    rec: dict[str, Any] = json.loads(raw)
    if rec.get("model") is not None and rec.get("route") is not None:
        try:
            fresh = audit_of(client, keys, str(rec["model"]), str(rec["route"]))
        except (redis.RedisError, OSError):
            fresh = []
        known = {a.get("id") for a in rec.get("audit") or []}
        rec["audit"] = [*(rec.get("audit") or []), *(a for a in fresh if a.get("id") not in known)][-AUDIT_KEPT:]
    return rec


def list_records(client: Any, keys: Keys, count: int = 100) -> list[dict[str, Any]]:
    """The newest ``count`` records' summaries, newest first."""
    ids = [text(x) for x in client.zrevrange(keys.evidence_index, 0, max(0, count - 1))]
    if not ids:
        return []
    out = []
    for eid, raw in zip(ids, client.hmget(keys.evidence_summaries, ids), strict=True):
        if raw is None:
            continue
        try:
            summary = json.loads(raw)
        except ValueError:
            continue
        summary["id"] = eid
        out.append(summary)
    return out
