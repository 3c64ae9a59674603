"""Bounded start-up: build Kafka clients in a thread we can abandon, and name the likely cause.

kafka-python's ``KafkaConsumer.__init__`` bootstraps synchronously and can wait forever (a plaintext
broker with SASL configured never answers the handshake it waits for). We construct it in a daemon
thread and wait at most ``timeout_s`` (waking for a stop request every 0.1 s); past that the attempt
is abandoned (the thread is left to die with the process) and ``diagnose`` says why in one line.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class StartupTimeout(Exception):
    pass


class Stopped(Exception):
    pass


def bounded(build: Callable[[], T], timeout_s: float, stop: threading.Event, name: str) -> T:
    """Run ``build`` in a daemon thread; its result, its exception, StartupTimeout or Stopped."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name=f"startup-{name}", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    while t.is_alive():
        if stop.is_set():
            raise Stopped(name)
        if time.monotonic() >= deadline:
            raise StartupTimeout(name)
        t.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]


def diagnose(bootstrap: str, security: dict[str, Any], timeout_s: float = 2.0) -> str:
    """One line naming the first broker's likely problem: DNS, refused, timeout, or a protocol mismatch."""
    first = bootstrap.split(",")[0].strip()
    host, sep, port_s = first.rpartition(":")
    if not sep:  # a bare host: kafka-python's default port
        host, port_s = first, "9092"
    host = host.strip("[]") or first
    try:
        port = int(port_s)
    except ValueError:
        return f"broker {first}: bad address (want host:port)"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"broker {first}: DNS lookup failed ({exc.strerror or exc})"
    family, kind, proto, _canon, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.settimeout(timeout_s)
            s.connect(addr)
    except ConnectionRefusedError:
        return f"broker {first}: connection refused (nothing listens on {host}:{port})"
    except TimeoutError:
        return f"broker {first}: TCP connect timed out (firewall or wrong address)"
    except OSError as exc:
        return f"broker {first}: cannot connect ({exc.strerror or exc})"
    proto_name = str(security.get("security_protocol", "PLAINTEXT")).upper()
    if proto_name != "PLAINTEXT":
        return (f"broker {first}: TCP connects but the {proto_name} handshake does not complete: likely a "
                f"TLS/SASL mismatch (is the listener plaintext?) or wrong credentials")
    return f"broker {first}: TCP connects but the Kafka bootstrap does not complete (is it a Kafka listener?)"


def redis_cause(exc: BaseException) -> tuple[str, str]:
    """(reason, one line) for a Redis error: redis-auth, redis-tls or redis."""
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    if "auth" in low or "password" in low or "noperm" in low or "wrongpass" in low:
        # without a password redis-py's first command is HELLO, whose refusal does not say "password"
        return "redis-auth", (f"Redis authentication failed ({text[:200]}): give the password in redis.url "
                              f"(redis://:PASSWORD@HOST:PORT/DB or redis://USER:PASSWORD@...)")
    if "ssl" in low or "certificate" in low or "tls" in low:
        return "redis-tls", f"Redis TLS failed ({text[:200]})"
    return "redis", f"Redis unreachable ({text[:200]})"
