"""The golden signal stream and the replay requests of one consumer group, in Redis.

Golden replays run on one replica (the golden lease holder), but each route is judged by the
replica owning its Kafka partition. The holder writes each finished replay (the signals of every
route its job guards, one entry, so a replay's candidate and baseline signals stay together) to the
stream ``Keys.golden_signals``; every replica reads it with its own cursor (XREAD, never blocking)
and judges the signals of its routes. An on-suspicion replay asked for on any replica goes to the
list ``Keys.golden_requests``, which the holder pops. Plain JSON, schema 1; errors are the caller's
to report (they are Redis failures).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from watchdog.core.keys import Keys, text
from watchdog.core.signals import Signal, signal_from_dict, signal_to_dict

log = logging.getLogger(__name__)

#: entries the golden signal stream keeps (MAXLEN ~): one per replay; at one replay of each of ten
#: jobs every ten minutes, about 8 hours (an entry is ~7 kB per guarded route of a 54-item set)
STREAM_MAXLEN = 500
#: requests the request list keeps; older ones are dropped when it is longer
REQUESTS_MAXLEN = 200
SCHEMA = 1


@dataclass(frozen=True, slots=True)
class GoldenEntry:
    """One replay's signals as read from the stream; ``id`` is the stream entry id."""

    id: str
    job: str
    signals: list[Signal]


def _json_default(x: Any) -> Any:
    item = getattr(x, "item", None)  # numpy scalars
    if callable(item):
        return item()
    return str(x)


def entry_json(job: str, signals: list[Signal]) -> str:
    return json.dumps({"schema": SCHEMA, "job": job, "signals": [signal_to_dict(s) for s in signals]},
                      default=_json_default)


def parse_entry(entry_id: Any, fields: dict[Any, Any]) -> GoldenEntry | None:
    """The entry, or None (logged) when it is not a schema-1 record."""
    eid = text(entry_id)
    raw = {text(k): v for k, v in fields.items()}.get("json")
    try:
        data = json.loads(text(raw)) if raw is not None else None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema') if isinstance(data, dict) else None!r}")
        return GoldenEntry(eid, str(data.get("job", "")), [signal_from_dict(s) for s in data.get("signals") or []])
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("golden signal stream entry %s skipped: %s", eid, exc)
        return None


class GoldenStream:
    def __init__(self, client: Any, keys: Keys, group: str, maxlen: int = STREAM_MAXLEN) -> None:
        self.client = client
        self.key = keys.golden_signals(group)
        self.requests_key = keys.golden_requests(group)
        self.maxlen = maxlen

    # -- signals -------------------------------------------------------------------------------
    def publish(self, runs: list[tuple[str, list[Signal]]]) -> None:
        """Append one entry per (job, signals) run, in one round trip (all or none on a failure)."""
        if not runs:
            return
        pipe = self.client.pipeline(transaction=True)
        for job, signals in runs:
            pipe.xadd(self.key, {"json": entry_json(job, signals)}, maxlen=self.maxlen, approximate=True)
        pipe.execute()

    def read(self, cursor: str, count: int = 100) -> list[GoldenEntry]:
        """Entries after ``cursor`` (a stream id), oldest first, at most ``count``; never blocks."""
        reply = self.client.xread({self.key: cursor}, count=count)
        out = []
        for _key, entries in reply or []:
            for eid, fields in entries:
                entry = parse_entry(eid, fields)
                out.append(entry if entry is not None else GoldenEntry(text(eid), "", []))
        return out

    def recent(self, span_s: float, count: int) -> tuple[list[GoldenEntry], str]:
        """(the entries of the last ``span_s`` seconds of Redis's clock, at most the newest ``count``,
        oldest first; the cursor to read on from)."""
        secs, micros = self.client.time()
        since_ms = max(0, int((int(secs) + int(micros) / 1e6 - span_s) * 1000))
        low = f"{since_ms}-0"
        raw = self.client.xrevrange(self.key, "+", low, count=count)
        entries = [parse_entry(eid, fields) for eid, fields in reversed(raw or [])]
        cursor = text(raw[0][0]) if raw else f"{max(0, since_ms - 1)}-0"
        return [e for e in entries if e is not None], cursor

    def last_runs(self, jobs: set[str], page: int = 50) -> dict[str, float]:
        """Seconds since each of ``jobs`` last published a replay (by Redis's clock and the entries'
        ids), newest entries first, a page at a time until every job is found or the stream ends; a job
        not in the stream is left out."""
        secs, micros = self.client.time()
        now_ms = int(secs) * 1000 + int(micros) // 1000
        found: dict[str, float] = {}
        high = "+"
        while len(found) < len(jobs):
            raw = self.client.xrevrange(self.key, high, "-", count=page)
            for eid, fields in raw or []:
                entry = parse_entry(eid, fields)
                if entry is not None and entry.job in jobs and entry.job not in found:
                    found[entry.job] = max(0.0, (now_ms - int(text(eid).split("-")[0])) / 1000)
            if not raw or len(raw) < page:
                break
            ms, seq = text(raw[-1][0]).split("-")
            high = f"({ms}-{seq}"  # exclusive: the page after the last one read
        return found

    # -- requests ------------------------------------------------------------------------------
    def push_request(self, model: str, route: str, reason: str, at: float, by: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(self.requests_key, json.dumps({"model": model, "route": route, "reason": reason, "at": at,
                                                  "by": by}))
        pipe.ltrim(self.requests_key, -REQUESTS_MAXLEN, -1)
        pipe.execute()

    def pop_requests(self, count: int = 100) -> list[dict[str, Any]]:
        """Take (and remove) up to ``count`` requests, oldest first; malformed ones are skipped."""
        raw = self.client.lpop(self.requests_key, count) or []
        out = []
        for item in raw:
            try:
                req = json.loads(text(item))
                if (isinstance(req, dict) and isinstance(req.get("model"), str) and isinstance(req.get("route"), str)
                        and isinstance(req.get("at"), int | float) and not isinstance(req.get("at"), bool)):
                    out.append(req)
                    continue
            except ValueError:
                pass
            log.warning("golden replay request skipped: %r", item)
        return out
