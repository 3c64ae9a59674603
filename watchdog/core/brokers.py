"""Kafka addresses and topic names as a client takes them, checked when a config is loaded (the
daemon's ``kafka:`` and the gateway's ``events:``), not when the first connect or send fails."""

from __future__ import annotations

import re


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
