"""The one rule for values too large for the broker: keep a prefix, record the size and a hash.

Used by the daemon's dead letters (``watchdog.ingest.deadletter``: a whole record value) and by the
event emitter (``watchdog.ingest.emitter``: the prompt and completion texts of an event that would
not fit). Pure.
"""

from __future__ import annotations

import hashlib
from typing import Any

from watchdog.core.events import encode_event

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


#: event text fields cut first, the largest first; ``shadow.completion`` is nested
_TEXT_FIELDS = ("completion", "prompt", "shadow.completion")
#: dropped (their count recorded) when cutting the texts was not enough
_LIST_FIELDS = ("completion_logprobs", "other_completions", "shadow.completion_logprobs")


def _holder(event: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    head, _, leaf = dotted.rpartition(".")
    if not head:
        return event, leaf
    inner = event.get(head)
    return (inner if isinstance(inner, dict) else None), leaf


def fit_event(event: dict[str, Any], max_bytes: int = MAX_VALUE_BYTES, keep: int = KEEP_BYTES) -> bytes | None:
    """``event`` encoded in at most ``max_bytes``: when it is larger, its texts (completion, prompt,
    shadow completion) are cut to their first ``keep`` bytes with ``truncated: {field: {"bytes": original
    size, "sha256": hash of the original}}``, then (still too large) its log-probability and extra
    choice lists are dropped (``truncated: {field: {"items": n}}``). None when even that does not fit.
    ``event`` is changed in place."""
    raw = encode_event(event)
    if len(raw) <= max_bytes:
        return raw
    marks: dict[str, Any] = {}
    event["truncated"] = marks
    for name in _TEXT_FIELDS:
        holder, leaf = _holder(event, name)
        text = holder.get(leaf) if holder is not None else None
        if isinstance(text, str) and holder is not None:
            cut = truncate_text(text, keep)
            if cut is not None:
                holder[leaf] = cut[0]
                marks[name] = {"bytes": cut[1], "sha256": cut[2]}
    raw = encode_event(event)
    for name in _LIST_FIELDS:
        if len(raw) <= max_bytes:
            return raw
        holder, leaf = _holder(event, name)
        items = holder.get(leaf) if holder is not None else None
        if isinstance(items, list) and holder is not None:
            del holder[leaf]
            marks[name] = {"items": len(items)}
            raw = encode_event(event)
    return raw if len(raw) <= max_bytes else None
