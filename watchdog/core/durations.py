"""The longest duration any setting may give, one bound for policies and the daemon's config."""

from __future__ import annotations

#: longest duration a policy or a config setting may give (cooldowns, promote delays, ages, window
#: lengths): a year; larger values are typos (``1e300``) that would overflow time arithmetic
MAX_DURATION_S = 366 * 86400.0


def duration_problem(seconds: float) -> str | None:
    """Why ``seconds`` is no duration a setting may give (None when it is one): over a year."""
    if seconds > MAX_DURATION_S:
        return f"{seconds:g} s is out of range: at most {MAX_DURATION_S / 86400:.0f} days ({MAX_DURATION_S:.0f} s)"
    return None
