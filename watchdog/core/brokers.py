"""Kafka addresses, topic names and producer settings as a client takes them, checked when a config is
loaded (the daemon's ``kafka:`` and the gateway's ``events:``), not when the first connect or send fails."""

from __future__ import annotations

import re
from typing import Any, NamedTuple


def require_bootstrap_servers(servers: str) -> str:
    """``servers`` (``host[:port],...``), or ValueError naming the entry no Kafka client can use: it
    passed config check, then the daemon retried its start-up for ever on ``int('abc')``. A bare host
    is kafka-python's (port 9092)."""
    entries = [e.strip() for e in servers.split(",")]
    if not any(entries):
        raise ValueError("no broker given (want host:port, comma-separated)")
    for entry in entries:
        if not entry:
            raise ValueError(f"{servers!r} has an empty entry (want host:port, comma-separated)")
        host, sep, port = entry.rpartition(":")
        if not sep or (host.count(":") and not host.endswith("]")):  # a bare host, or a bare IPv6 address
            continue
        if not host:
            raise ValueError(f"{entry!r} has no host (want host:port)")
        if not port.isdigit():
            raise ValueError(f"{entry!r}: port {port!r} is not a number (want host:port)")
        if not 1 <= int(port) <= 65535:
            raise ValueError(f"{entry!r}: port {int(port)} is out of range (1-65535)")
    return servers


_TOPIC = re.compile(r"[A-Za-z0-9._-]+")


def require_topic_name(topic: str) -> str:
    """``topic``, or ValueError for a name Kafka refuses: it passed config check, then kafka-python's
    ValueError ended the daemon in a traceback when it subscribed."""
    if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
        raise ValueError(f"{topic!r} is not a Kafka topic name (ASCII letters, digits, '.', '_' and '-'; "
                         "not '.' or '..')")
    if len(topic) > 249:
        raise ValueError(f"topic name of {len(topic)} characters: Kafka takes at most 249 characters")
    return topic


class IdempotenceNames(NamedTuple):
    """One client's names for the settings the idempotent producer depends on."""

    switch: str
    acks: tuple[str, ...]
    retries: tuple[str, ...]
    in_flight: tuple[str, ...]


KAFKA_PYTHON_IDEMPOTENCE = IdempotenceNames("enable_idempotence", ("acks",), ("retries",),
                                            ("max_in_flight_requests_per_connection",))
LIBRDKAFKA_IDEMPOTENCE = IdempotenceNames("enable.idempotence", ("acks", "request.required.acks"),
                                          ("retries", "message.send.max.retries"),
                                          ("max.in.flight", "max.in.flight.requests.per.connection"))


def require_idempotence_settings(settings: dict[str, Any], names: IdempotenceNames) -> dict[str, Any]:
    """``settings``, or ValueError when they keep the producer idempotent (the emitter's default) but set what
    idempotence cannot work with: acks other than all, no retries, more than 5 requests in flight. Both
    clients refuse that when they connect, and the emitter would retry the connect for ever."""
    if _is_off(settings.get(names.switch, True)):
        return settings
    bad = [f"{k}: {settings[k]!r}" for k in names.acks if k in settings and not _is_all(settings[k])]
    bad += [f"{k}: {settings[k]!r}" for k in names.retries if k in settings and _as_int(settings[k]) == 0]
    bad += [f"{k}: {settings[k]!r}" for k in names.in_flight if k in settings and (_as_int(settings[k]) or 0) > 5]
    if bad:
        raise ValueError(f"{', '.join(bad)} does not go with the idempotent producer (on by default: a batch retried "
                         f"after a lost acknowledgement is not written twice), which needs acks: all, retries > 0 "
                         f"and at most 5 requests in flight; change it, or set {names.switch}: false and accept "
                         "duplicates")
    return settings


def _is_off(value: Any) -> bool:
    return value is False or str(value).strip().lower() in ("false", "0", "no", "off")


def _is_all(value: Any) -> bool:
    return str(value).strip().lower() in ("all", "-1")


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
