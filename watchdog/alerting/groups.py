"""Storm grouping: the messages of several route incidents as one message (pure functions).

When many routes trip at once (a bad FP8 build deployed fleet-wide, a GPU node lost), one message
per incident floods on-call exactly when it matters, and a rate-limited receiver (Slack: one message
a second) delivers the last one minutes late. A channel with ``group_wait_s`` sends the messages
that wait for it as one grouped message instead (:mod:`watchdog.alerting.delivery` decides which,
the channels format it). What is the same for every receiver is here: which messages may be grouped,
the group's id (its idempotency key), its worst severity, its title and one line per incident, each
cut with :mod:`watchdog.alerting.limits`. Every incident of a group is listed by name; a receiver
whose limit is reached first (never with ``group_max`` at most 200) counts the rest and links the
watchdog's status page.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

from watchdog.alerting import limits
from watchdog.alerting.limits import clip, stable_key
from watchdog.alerting.message import Alert
from watchdog.core.signals import SEVERITY_RANK, Severity

#: one incident's line in a grouped message, at most this many characters
LINE_MAX = 240


def groupable(alert: Alert) -> bool:
    """Route incidents group; an ops incident (about this process: "Redis unreachable") goes alone."""
    return not alert.is_ops


def group_id(alerts: Sequence[Alert]) -> str:
    """The grouped message's id: the same for the same messages (a retry of the same group), a
    different one for another composition. ``<first page id>+<n-1>~<hash of every page id>``."""
    ids = [a.page_id or "" for a in alerts]
    digest = hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()[:16]
    return stable_key(f"{ids[0]}+{len(ids) - 1}~{digest}", limits.WEBHOOK_KEY_MAX)


def worst_severity(alerts: Sequence[Alert]) -> Severity:
    """The highest severity of the group's firing messages (of all of them when all resolve)."""
    pool = [a for a in alerts if a.status == "firing"] or list(alerts)
    return max((a.severity for a in pool), key=lambda s: SEVERITY_RANK[s])


def status(alerts: Sequence[Alert]) -> str:
    """``firing`` when any message of the group fires, else ``resolved``."""
    return "firing" if any(a.status == "firing" for a in alerts) else "resolved"


def title(alerts: Sequence[Alert]) -> str:
    """E.g. ``[CRITICAL] 200 incidents: 198 firing (198 rollback), 2 resolved, 3 models``."""
    firing = [a for a in alerts if a.status == "firing"]
    parts = []
    if firing:
        events = ", ".join(f"{n} {e}" for e, n in Counter(a.event for a in firing).most_common())
        parts.append(f"{len(firing)} firing ({events})")
    if len(firing) < len(alerts):
        parts.append(f"{len(alerts) - len(firing)} resolved")
    models = {a.model for a in alerts}
    parts.append(f"{len(models)} model{'s' if len(models) > 1 else ''}")
    state = worst_severity(alerts).upper() if firing else "RESOLVED"
    return f"[{state}] {len(alerts)} incidents: {', '.join(parts)}"


def line(alert: Alert) -> str:
    """One incident: its state and summary, cut to ``LINE_MAX`` characters."""
    state = "RESOLVED" if alert.status == "resolved" else alert.severity.upper()
    return clip(f"{state}: {alert.summary}", LINE_MAX)


def status_link(alerts: Sequence[Alert]) -> str | None:
    """The watchdog's status page, where every open incident is listed (from a message's link:
    ``<base>/status``, or ``<base>/evidence/<id>`` whose base serves ``/status`` too)."""
    for a in alerts:
        if a.url and len(a.url) <= limits.URL_MAX:
            return a.url.split("/evidence/")[0] + "/status" if "/evidence/" in a.url else a.url
    return None
