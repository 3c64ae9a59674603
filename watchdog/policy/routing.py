"""The channel names a policy routes its alerts to (``actions.notify`` / ``actions.page``), checked
against the daemon's alert channels.

Channel names are the daemon config's (``alerts: channels:``, a channel's ``name`` or its kind), so
a policy file alone cannot know them: the loader takes them as ``channels`` (the daemon and
``config check`` pass theirs; ``policy validate`` has none and checks no names).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any

from watchdog.config.yamlpos import Pos, PosDoc

ROUTING_FIELDS = ("notify", "page")


def unknown_channels(pol: dict[str, Any], ppath: tuple[str | int, ...], channels: Collection[str],
                     doc: PosDoc) -> list[tuple[Pos, str]]:
    """One ``(position, message)`` per name in the policy's ``actions`` that no channel has."""
    actions = pol.get("actions")
    if not isinstance(actions, dict):
        return []
    known = sorted(channels)
    out: list[tuple[Pos, str]] = []
    for field in ROUTING_FIELDS:
        names = actions.get(field)
        for i, name in enumerate(names if isinstance(names, list) else []):
            if not isinstance(name, str) or name in channels:
                continue
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            out.append((doc.pos((*ppath, "actions", field, i)),
                        f"actions.{field}: unknown alert channel '{name}'{hint}; the daemon's alert channels: "
                        f"{', '.join(known)}" + ("" if close else
                                                 f" (a channel's name is its `name:`, else its kind: add "
                                                 f"`name: {name}` to the channel that should get these, or "
                                                 f"change actions.{field})")))
    return out
