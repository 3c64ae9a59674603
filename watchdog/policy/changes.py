"""Changes on either side are not FP8's fault: deploys and maintenance (docs/JUDGE.md, "Deploys"). Pure.

A live window knows which builds served it (``Signal.detail["builds"]``, from the events' optional
``build`` field: engine version, model revision, serving image, as the producer spells it) and
whether an operator declared maintenance on its route (``detail["maintenance"]``, set by
``mark_maintenance`` from the ``maintenance`` Redis keys, watchdog/core/keys.py).

A learned live rule with ``judge: {settle: N}`` keeps, in each pool entry, the window's build
signature per precision and the number of windows since the last change (``since``). A window is
a **change** when either precision's signature differs from the previous window's, when a
precision runs more than one build (a rolling deploy in progress), or under maintenance. Then:

* the pool restarts (windows from before the change are not comparable with windows after it) and
  the change window itself is never judged evidence (it straddles the change);
* nothing is judged and nothing is learned until ``N`` windows passed without a further change
  (both precisions settled: a staggered deploy reaching FP16 1-3 windows after FP8 restarts the
  count);
* then the windows since the change are judged as usual, against the level learned *before* the
  change: a deploy that moved both precisions alike leaves the difference where it was, a
  regression that outlives the deploy (the new build is slower on FP8 only) is one.

The price is a delay of ``N`` windows after every deploy before a regression can be caught.

**Different builds (``judge.build_hold``, latency rules).** A settled window may still have FP8 and
FP16 on different named builds: a slow rollout that finished on FP8 before it started on FP16. A new
build slower on both precisions then looks like FP8's regression. The entry counts such windows
(``apart``: consecutive windows in which each precision runs one named build and the two differ) and
the latency rules judge nothing while ``0 < apart <= build_hold`` (``held``); after ``build_hold``
windows they judge anyway, so an FP8-only build (a new calibration) is judged, late. Rates are not
confounded by a build's speed and keep judging. **A build one side does not name is unknown, not the
same**: when one precision's events carry the build field and the other's do not (an older gateway
on one pool), a change of the named side's build starts the same count, since the unnamed side may
get the same deploy windows later, unseen (outside check 2, ``deploy-fp8-named``).

**Replicas that joined (``replicas: robust``).** A replica whose name was not in the previous window
of its precision (a scale-out, a rescheduled pod) serves its first window cold, like a new build.
``joined_replicas`` names them from the last pool entry (``r``: the replica names of the newest
entry only); the fleet judge leaves them out of the window's latency statistic, and when most of a
side joined at once the window is not comparable (``pooling._fleet_difference``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from watchdog.core.signals import Signal
from watchdog.policy.judge.fleet import POOLED_IDS, counts_at_least

__all__ = ["MIN_BUILD_EVENTS", "MIN_BUILD_SHARE", "MIN_JOINED_EVENTS", "build_signature", "change_entry", "held",
           "joined_replicas", "maintenance_spans", "mark_maintenance", "replica_names"]

#: a build counts in a window's signature when it served at least this share of its events ...
MIN_BUILD_SHARE = 0.01
#: ... and at least this many (a few late events of the old build are not a second build)
MIN_BUILD_EVENTS = 3
#: a replica absent from the previous window counts as joined when it served at least this many events
#: now (fewer: thin traffic, where a replica with nothing to serve in one window is no news)
MIN_JOINED_EVENTS = 20


def build_signature(sig: Signal | None) -> str:
    """The builds that served a window, sorted and joined by ``+`` ("" when none is named)."""
    if sig is None:
        return ""
    builds = sig.detail.get("builds")
    if not isinstance(builds, Mapping) or not builds:
        return ""
    total = sum(int(c) for c in builds.values())
    keep = sorted(str(b) for b, c in builds.items()
                  if int(c) >= MIN_BUILD_EVENTS and int(c) >= MIN_BUILD_SHARE * total)
    return "+".join(keep)


def _maintenance(sig: Signal | None) -> bool:
    return sig is not None and bool(sig.detail.get("maintenance"))


def change_entry(pool: Sequence[Mapping[str, Any]], cand: Signal, base: Signal, settle: int,
                 hold: int = 0) -> dict[str, Any]:
    """The change bookkeeping of this window for its pool entry: ``b`` (build signatures FP8,
    FP16), ``since`` (windows since the last change; 0 = this window is one), ``why``, and with
    ``hold`` (``judge.build_hold``) ``apart`` (windows the precisions have run different builds)."""
    sigs = [build_signature(cand), build_signature(base)]
    prev = pool[-1] if pool else None
    why = ""
    if _maintenance(cand) or _maintenance(base):
        why = "maintenance"
    elif any("+" in s for s in sigs):
        why = "mixed builds " + " / ".join(sigs)
    elif prev is not None and isinstance(prev.get("b"), list) and prev["b"] != sigs:
        why = f"build change {prev['b'][0] or '-'}/{prev['b'][1] or '-'} -> {sigs[0] or '-'}/{sigs[1] or '-'}"
    out: dict[str, Any] = {"b": sigs}
    if hold and all(sigs) and sigs[0] != sigs[1] and not any("+" in s for s in sigs):
        out["apart"] = min(int(prev.get("apart", 0)) + 1 if prev is not None else 1, hold + 1)
    elif hold and bool(sigs[0]) != bool(sigs[1]):
        # one precision names its builds, the other names none: a build the other side does not
        # name is not known to be the same build. From a change of the named side's build on, the
        # two may run different builds (the same deploy reaching the unnamed side later, unseen), so
        # the count runs as for two named builds that differ; without a change it does not start
        if why.startswith(("build change", "mixed builds")):
            out["apart"] = 1
        elif prev is not None and int(prev.get("apart", 0)) > 0:
            out["apart"] = min(int(prev["apart"]) + 1, hold + 1)
    if why:
        return {**out, "since": 0, "why": why}
    since = int(prev.get("since", settle)) + 1 if prev is not None else settle
    out["since"] = min(since, settle)
    if prev is not None and prev.get("why") and since <= settle:
        out["why"] = prev["why"]
    return out


def held(entry: Mapping[str, Any], settle: int, hold: int) -> str | None:
    """Why a window's pool entry (``change_entry``) is not judged: its settling time after a change,
    or (``hold``) the two precisions on different builds for at most ``hold`` windows; None: judge it."""
    since = int(entry.get("since", settle))
    if since < settle:
        return (f"settling after a change ({entry.get('why')}): {since} of {settle} windows without a "
                "further change")
    apart = int(entry.get("apart", 0))
    if 0 < apart <= hold:
        b = entry.get("b") or ["-", "-"]
        if not (b[0] and b[1]):
            return (f"{'FP16' if b[0] else 'FP8'} names no build since {'FP8' if b[0] else 'FP16'}'s build changed "
                    f"({b[0] or '-'} / {b[1] or '-'}): whether both run the same build is unknown, latency judged "
                    f"after {hold} windows ({apart} so far)")
        return (f"FP8 and FP16 run different builds ({b[0]} / {b[1]}): latency not comparable until both run "
                f"the same build, judged anyway after {hold} windows ({apart} so far)")
    return None


def replica_names(sig: Signal) -> list[str]:
    """The named replicas that served a window (sorted; the overflow and requests without an id left out)."""
    reps = sig.detail.get("replicas")
    if not isinstance(reps, Mapping):
        return []
    return sorted(str(r) for r in reps if r not in POOLED_IDS)


def joined_replicas(pool: Sequence[Mapping[str, Any]], cand: Signal, base: Signal
                    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Per precision (FP8, FP16) the replicas of this window that were not in the previous one (the
    pool's newest entry before this window, when it is the window just before: ``r``) and served at
    least ``MIN_JOINED_EVENTS`` events. Without a record of the window just before (a route's first
    window, a gap, an unreadable window) none counts as joined."""
    prev = next((e for e in reversed(pool) if float(e.get("end", math.inf)) < cand.end), None)
    length = cand.end - cand.start
    seen = prev.get("r") if prev is not None else None
    if prev is None or not isinstance(seen, list | tuple) or len(seen) != 2 or not length > 0 \
            or abs(float(prev["end"]) - cand.start) > length / 2:
        return (), ()
    return _joined(cand, seen[0]), _joined(base, seen[1])


def _joined(sig: Signal, seen: Sequence[str]) -> tuple[str, ...]:
    reps = sig.detail.get("replicas")
    if not isinstance(reps, Mapping):
        return ()
    known = set(seen)
    return tuple(r for r in replica_names(sig) if r not in known and counts_at_least(reps[r], MIN_JOINED_EVENTS))


def mark_maintenance(signals: Sequence[Signal], spans: Mapping[tuple[str, str], Sequence[tuple[float, float]]]) -> int:
    """Mark every live signal whose window overlaps an operator maintenance span of its
    (model, route) (``("*", route)`` covers every model) with ``detail["maintenance"] = True``;
    returns how many were marked. The runtime reads the spans from the ``maintenance`` keys and
    calls this before ``PolicyEngine.observe``."""
    marked = 0
    for s in signals:
        if s.source != "live":
            continue
        for key in ((s.model, s.route), ("*", s.route)):
            if any(start < s.end and s.start < until for start, until in spans.get(key, ())):
                s.detail["maintenance"] = True
                marked += 1
                break
    return marked


def maintenance_spans(records: Mapping[tuple[str, str], Any]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """The spans of the ``maintenance`` keys' JSON values (watchdog/core/keys.py), by (model, route);
    unreadable values are skipped. The runtime reads the keys (SCAN ``{prefix}:maintenance:*`` or the
    routes it owns) and passes ``mark_maintenance(signals, maintenance_spans(values))``."""
    import json

    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for key, raw in records.items():
        try:
            d = json.loads(raw) if isinstance(raw, str | bytes) else raw
            start, until = float(d["start"]), float(d["until"])
        except (TypeError, ValueError, KeyError):
            continue
        if until > start:
            out.setdefault(key, []).append((start, until))
    return out
