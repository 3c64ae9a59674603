"""What each receiver accepts, and the cutting that keeps an alert within it (pure functions).

Receivers refuse (HTTP 400) or silently cut what is too long: a Slack section block over 3,000
characters, a PagerDuty event over 512 KB, or a text cut in the middle of an emoji. The channels
(:mod:`watchdog.alerting.channels`) build their bodies through these helpers:

* :func:`clip` cuts a text to a limit counted in UTF-16 code units (``"utf16"``: an emoji outside
  the BMP counts 2, never less than characters however the receiver counts) or UTF-8 bytes
  (``"bytes"``), at a character boundary (never inside a surrogate pair or a UTF-8 sequence, not
  after a zero-width joiner), and ends it with ``… (truncated, N chars)``, N the original length;
* :func:`stable_key` keeps an idempotency key (PagerDuty ``dedup_key``, an Alertmanager label, a
  webhook ``id``) within its limit *and* the same on every send: a key too long becomes its head
  plus a hash of the whole key, so two long keys that share a head stay two keys;
* :func:`fit_mapping` drops the last keys of a detail mapping until its JSON fits a byte budget;
* :func:`encode` is the one JSON encoding of a body: UTF-8, lone surrogates and control characters
  replaced by U+FFFD and non-finite floats by strings, so no alert fails to encode (httpx's own
  encoder raises on both) and escaping cannot blow a body past its bound.

Limits (checked against the receivers' documentation; see docs/ALERTS.md, "Receiver limits").
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

Unit = Literal["utf16", "bytes"]

#: Slack: a message's top-level ``text`` is cut by Slack past 40,000 characters
SLACK_TEXT_MAX = 40_000
#: Slack Block Kit: the text of a section block, or of a context element, at most 3,000 characters
SLACK_BLOCK_TEXT_MAX = 3_000
#: Slack Block Kit: at most 50 blocks in a message (we send 3)
SLACK_MAX_BLOCKS = 50
#: Slack attachment ``fallback`` (the notification line): no documented limit, kept short
SLACK_FALLBACK_MAX = 3_000
#: PagerDuty Events API v2: ``payload.summary`` at most 1,024 characters
PAGERDUTY_SUMMARY_MAX = 1_024
#: PagerDuty Events API v2: ``dedup_key`` at most 255 characters
PAGERDUTY_DEDUP_KEY_MAX = 255
#: PagerDuty Events API v2: a whole event at most 512 KB (read as 512,000 bytes, as Alertmanager's
#: own PagerDuty notifier does; PagerDuty answers 400 past it)
PAGERDUTY_EVENT_MAX_BYTES = 512_000
#: PagerDuty ``source``, ``component``, ``group``, ``class``: no documented limit, kept to 255
PAGERDUTY_FIELD_MAX = 255
#: Alertmanager: no hard limit on a label value; labels identify the alert, keep them small
ALERTMANAGER_LABEL_MAX = 1_024
#: Alertmanager: no hard limit on an annotation; each is kept to 16 KiB of UTF-8
ALERTMANAGER_ANNOTATION_MAX_BYTES = 16 * 1024
#: Alertmanager: our bound on one POST (a list of at most two alerts)
ALERTMANAGER_BODY_MAX_BYTES = 256 * 1024
#: generic webhook: our bound on the body, its summary/description and its ``detail``
WEBHOOK_BODY_MAX_BYTES = 256 * 1024
WEBHOOK_TEXT_MAX_BYTES = 16 * 1024
#: the ``key`` and ``id`` of a webhook body
WEBHOOK_KEY_MAX = 255
#: a URL in a body (status page, Alertmanager generatorURL); a longer one is left out
URL_MAX = 2_048

#: C0 controls but tab, newline and carriage return, and DEL
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
#: characters a cut must not end on: a zero-width joiner or a variation selector needs what follows
_DANGLING = frozenset({"\u200d", "\ufe0e", "\ufe0f"})


def clean(text: str) -> str:
    """``text`` with lone surrogates (not encodable as UTF-8) replaced by U+FFFD (two surrogates
    that make a pair become the one character they encode), and control characters other than tab
    and newline too: JSON writes each as 6 bytes, which would make a cut text 6 times its limit."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return _CONTROL.sub("\ufffd", text)


def size(text: str, unit: Unit = "utf16") -> int:
    """Length of ``text`` as a receiver counts it: UTF-16 code units, or UTF-8 bytes."""
    if unit == "bytes":
        return len(text.encode("utf-8"))
    return len(text.encode("utf-16-le")) // 2


def marker(original_chars: int) -> str:
    return f"… (truncated, {original_chars} chars)"


def clip(text: str, limit: int, unit: Unit = "utf16") -> str:
    """``text`` if it fits ``limit``; else its longest head that fits with the truncation marker."""
    text = clean(text)
    if size(text, unit) <= limit:
        return text
    tail = marker(len(text))
    room = limit - size(tail, unit)
    if room <= 0:
        return _head(tail, limit, unit)
    return _head(text, room, unit) + tail


def _head(text: str, limit: int, unit: Unit) -> str:
    """The longest prefix of whole characters whose size is at most ``limit``."""
    if unit == "bytes":
        head = text.encode("utf-8")[:limit].decode("utf-8", "ignore")  # drops a cut sequence
    else:
        head = text.encode("utf-16-le")[: 2 * limit].decode("utf-16-le", "ignore")  # drops half a pair
    while head and (head[-1] in _DANGLING or 0xD800 <= ord(head[-1]) <= 0xDFFF):
        head = head[:-1]
    return head


def stable_key(key: str, limit: int) -> str:
    """``key`` if it fits ``limit`` (UTF-16 units); else its head, ``~`` and 16 hex digits of its
    SHA-256: the same long key always gives the same result, two different ones differ."""
    key = clean(key)
    if size(key) <= limit:
        return key
    digest = "~" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return _head(key, limit - len(digest), "utf16") + digest


def safe(obj: Any) -> Any:
    """A JSON-able copy of ``obj``: strings cleaned, non-finite floats as strings, keys as strings."""
    if isinstance(obj, str):
        return clean(obj)
    if isinstance(obj, bool) or obj is None or isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, Mapping):
        return {clean(str(k)): safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [safe(v) for v in obj]
    return clean(str(obj))


def encode(obj: Any) -> bytes:
    """The request body: compact JSON in UTF-8 of :func:`safe` ``(obj)``."""
    return json.dumps(safe(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def fit_mapping(data: Mapping[str, Any], budget: int) -> dict[str, Any]:
    """``data`` (made :func:`safe`) if its JSON fits ``budget`` bytes; else its first keys that fit,
    plus ``"_truncated": "<n> of <m> keys left out"``."""
    out = safe(data)
    if len(encode(out)) <= budget:
        return dict(out)
    kept: dict[str, Any] = {}
    used = 2 + 64  # the braces and room for the _truncated note
    for k, v in out.items():
        item = len(encode({k: v})) - 1  # '{"k":v}' less one brace, plus the comma
        if used + item > budget:
            continue
        kept[k] = v
        used += item
    kept["_truncated"] = f"{len(out) - len(kept)} of {len(out)} keys left out"
    return kept
