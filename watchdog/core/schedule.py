"""Golden replay schedules: a crontab line read in a named time zone, checked when the config loads.

APScheduler reads a cron trigger in the host's local zone unless told otherwise, so the same config
would fire at different instants on differently configured hosts; the job's ``timezone`` (UTC by
default) makes the instant part of the config. APScheduler 3 also numbers weekdays from Monday = 0
where crontab has Sunday = 0 (and 7), so the weekday field is translated here, not passed through.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

#: crontab's weekday numbers: Sunday is 0 and 7
DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def zone_info(name: str) -> dt.tzinfo:
    """The IANA zone ``name``; ValueError naming it when this host's zone database lacks it."""
    if name.upper() == "UTC":
        return dt.UTC  # needs no zone database (slim images ship none)
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}: give an IANA name such as UTC or Europe/Berlin") from None


def _day(token: str) -> int:
    low = token.lower()
    if low in DAYS:
        return DAYS.index(low)
    if low.isdigit() and int(low) <= 7:
        return int(low) % 7
    raise ValueError(f"weekday {token!r} is not 0-7 or sun-sat")


def weekdays(field: str) -> str:
    """A crontab weekday field (``1-5``, ``sun,sat``, ``*/2``, ``0-6/3``) as APScheduler day names."""
    days: set[int] = set()
    for item in field.split(","):
        span, slash, step_text = item.partition("/")
        if slash and (not step_text.isdigit() or int(step_text) == 0):
            raise ValueError(f"weekday step {step_text!r} is not a positive number")
        step = int(step_text) if slash else 1
        if span == "*":
            first, last = 0, 6
        else:
            a, dash, b = span.partition("-")
            first = _day(a)
            last = (7 if b == "7" else _day(b)) if dash else (6 if slash else first)
            if last < first:
                raise ValueError(f"weekday range {span!r} runs backwards")
        days.update(d % 7 for d in range(first, last + 1, step))
    return "*" if len(days) == 7 else ",".join(DAYS[d] for d in sorted(days))


def cron_trigger(spec: str, zone: str, jitter_s: float) -> Any:
    """APScheduler's trigger for a five-field crontab line; ValueError with its reason when it does not parse."""
    from apscheduler.triggers.cron import CronTrigger

    fields = spec.split()
    if len(fields) != 5:
        raise ValueError(f"cron {spec!r}: {len(fields)} fields, expected 5 (minute hour day month weekday)")
    minute, hour, day, month, weekday = fields
    try:
        return CronTrigger(minute=minute, hour=hour, day=day, month=month, day_of_week=weekdays(weekday),
                           timezone=zone_info(zone), jitter=jitter_s or None)
    except ValueError as exc:
        raise ValueError(f"cron {spec!r}: {exc}") from None
