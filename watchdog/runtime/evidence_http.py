"""The evidence pages on the daemon's HTTP server (``runtime/http.py``): read-only, from Redis.

``GET /evidence`` is the incident list (``?limit=N``, default 100), ``GET /evidence/<id>`` one
decision's page (HTML, its timeline as a PNG ``data:`` URI), ``GET /evidence/<id>.json`` its record,
``GET /evidence/<id>.png`` the timeline alone (full size, for a phone's zoom).
Served on the status server's bind, with the same (absence of) authentication: docs/EVIDENCE.md.
Charts are drawn with matplotlib (the ``plot`` extra) one at a time and the last few are cached.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

import redis

from watchdog.core.evidence_page import chart_of, render_list, render_record
from watchdog.core.keys import Keys
from watchdog.runtime.evidence import list_records, read_record

log = logging.getLogger(__name__)

#: charts kept drawn (by record id and last update)
CHART_CACHE = 16
HTML = "text/html; charset=utf-8"

_draw_lock = threading.Lock()
_charts: OrderedDict[tuple[Any, ...], bytes | None] = OrderedDict()


def chart_png(record: Mapping[str, Any]) -> tuple[bytes | None, str]:
    """The record's timeline as PNG bytes, or (None, why not)."""
    key = (str(record.get("id")), record.get("updated_at"), len(json.dumps(record.get("rules"), default=str)))
    with _draw_lock:
        if key in _charts:
            return _charts[key], ""
        try:
            from watchdog.core.timeline_chart import timeline_png

            png: bytes | None = timeline_png(chart_of(record))
        except ImportError:
            return None, "No chart: matplotlib (the plot extra) is not installed."
        except Exception as exc:  # noqa: BLE001 - a chart that cannot be drawn must not hide the evidence
            log.exception("evidence chart of %s failed", record.get("id"))
            return None, f"No chart: drawing it failed ({type(exc).__name__})."
        _charts[key] = png
        while len(_charts) > CHART_CACHE:
            _charts.popitem(last=False)
        return png, ""


def page_html(record: Mapping[str, Any], base: str = "/evidence", standalone: bool = False) -> str:
    """One decision's self-contained page, chart included (``standalone``: no links to the server)."""
    png, why = chart_png(record)
    return render_record(record, png, why, base, standalone)


class EvidencePages:
    """``pages(path, query)`` for ``StatusServer``: (status, body, content type), or None when the
    path is not an evidence path."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def __call__(self, path: str, query: Mapping[str, str]) -> tuple[int, bytes, str] | None:
        if path not in ("/evidence", "/evidence/") and not path.startswith("/evidence/"):
            return None
        try:
            if path in ("/evidence", "/evidence/"):
                try:
                    limit = max(1, min(1000, int(query.get("limit", "100"))))
                except ValueError:
                    limit = 100
                return 200, render_list(list_records(self.client, self.keys, limit)).encode(), HTML
            eid = unquote(path[len("/evidence/"):]).strip("/")
            suffix = next((x for x in (".json", ".png") if eid.endswith(x)), "")
            eid = eid.removesuffix(suffix) if suffix else eid
            if not eid or len(eid) > 200 or "/" in eid:
                return 404, b"no such evidence record", "text/plain; charset=utf-8"
            record = read_record(self.client, self.keys, eid)
            if record is None:
                return (404, render_list([]).replace("No decision recorded yet.",
                                                     "No such evidence record (expired or never written).").encode(),
                        HTML)
            if suffix == ".json":
                return 200, json.dumps(record, indent=1, default=str).encode(), "application/json"
            if suffix == ".png":
                png, why = chart_png(record)
                return (200, png, "image/png") if png else (404, why.encode(), "text/plain; charset=utf-8")
            return 200, page_html(record).encode(), HTML
        except (redis.RedisError, OSError) as exc:
            return 503, f"evidence unavailable: Redis: {type(exc).__name__}".encode(), "text/plain; charset=utf-8"
