"""The one rule for values too large for the broker: keep a prefix, record the size and a hash.

Used by the daemon's dead letters (``watchdog.ingest.deadletter``: a whole record value) and by the
event emitter (``watchdog.ingest.emitter``: the prompt and completion texts of an event that would
not fit). Pure.
"""

from __future__ import annotations

import hashlib

#: values larger than this are stored as a truncated copy: a producer's max_request_size is 1 MiB
#: by default and a broker's message.max.bytes may be lower, so a full copy could never be written
MAX_VALUE_BYTES = 900_000
#: how much of a truncated value is kept
KEEP_BYTES = 65_536


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def truncate_bytes(data: bytes, keep: int = KEEP_BYTES) -> bytes:
    """The first ``keep`` bytes of ``data``."""
    return data[:keep]


def truncate_text(text: str, keep: int = KEEP_BYTES) -> tuple[str, int, str] | None:
    """``text`` cut to its first ``keep`` UTF-8 bytes (never inside a character), with the original
    size in bytes and its sha256 (hex); None when it is short enough to keep whole."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= keep:
        return None
    return (truncate_bytes(raw, keep).decode("utf-8", "ignore"), len(raw), sha256_hex(raw))
