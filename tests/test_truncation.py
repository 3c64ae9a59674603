"""The one truncation rule (watchdog.core.truncation): dead letters and oversized events share it."""

from __future__ import annotations

import hashlib

from watchdog.core.events import decode_event
from watchdog.core.truncation import KEEP_BYTES, fit_event, truncate_text


def test_text_is_cut_on_a_character_boundary_with_size_and_hash() -> None:
    text = "€" * 30_000  # 3 bytes each: 90,000 bytes
    cut = truncate_text(text)
    assert cut is not None
    kept, size, sha = cut
    assert size == 90_000 and sha == hashlib.sha256(text.encode()).hexdigest()
    assert text.startswith(kept) and len(kept.encode()) <= KEEP_BYTES and len(kept) == KEEP_BYTES // 3
    assert truncate_text("short") is None


def test_fit_event_cuts_texts_then_drops_lists_then_gives_up() -> None:
    base = {"schema": 1, "request_id": "r", "ts": 1.0, "model": "m", "route": "r", "precision": "fp8",
            "status": "ok", "latency_ms": 1.0}
    small = fit_event(dict(base))
    assert small is not None and b"truncated" not in small
    ev = {**base, "prompt": "p" * 500_000, "completion": "c" * 600_000, "completion_logprobs": [-0.5] * 200_000,
          "shadow": {"precision": "fp16", "completion": "s" * 600_000}}
    raw = fit_event(ev, max_bytes=900_000)
    assert raw is not None and len(raw) <= 900_000
    got = decode_event(raw)
    marks = got.extra["truncated"]
    assert set(marks) == {"prompt", "completion", "shadow.completion", "completion_logprobs"}
    assert marks["completion_logprobs"] == {"items": 200_000} and got.completion_logprobs is None
    assert marks["shadow.completion"]["bytes"] == 600_000 and got.shadow is not None
    assert got.shadow.completion == "s" * KEEP_BYTES
    assert fit_event({**base, "huge": "x" * 2_000_000}, max_bytes=900_000) is None  # nothing it may cut
