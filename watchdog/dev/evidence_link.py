"""The demo's pointer to the evidence page of a rollback (docs/EVIDENCE.md)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

from watchdog.runtime.evidence import list_records


def evidence_link(daemon: Any, model: str, route: str, timeout: float = 10.0) -> str | None:
    """The page URL of the newest rollback record of (model, route), once the daemon wrote it; None
    when none came within ``timeout`` seconds (or Redis said no)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list_records(daemon.redis, daemon.keys, 200)
        except Exception:  # noqa: BLE001 - a demo line, never a demo failure
            records = []
        for r in records:
            if r.get("kind") == "rollback" and (r.get("model"), r.get("route")) == (model, route):
                return f"{daemon.cfg.server.evidence_url}/{quote(str(r['id']), safe='')}"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def print_evidence_link(console: Any, daemon: Any, model: str, route: str) -> None:
    link = evidence_link(daemon, model, route)
    # the page is served by the demo's own daemon from its own Redis: both stop with the demo
    console.print(f"   evidence: {link} (open it while the demo runs)" if link
                  else "   [yellow]evidence: no record written yet[/]", soft_wrap=True)
