"""OTLP span batches on an ordinary day of a fleet: big mixed batches, compression, retries, restarts."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from tests.test_otlp import make_request  # noqa: E402

# --- statuses as real instrumentations write them ------------------------------------------------

# what opentelemetry-instrumentation-openai-v2 2.4b0 wrote for a real openai client call against a
# scripted upstream (measured: span status ERROR, description = str(exception), error.type = its class)
def _openai_failure(error_type: str, message: str) -> dict[str, Any]:
    from opentelemetry.trace import StatusCode

    return {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m", "gen_ai.system": "openai",
            "error.type": error_type, "llmwd.route": "r", "llmwd.precision": "fp8",
            "_status": (StatusCode.ERROR, message)}


@pytest.mark.parametrize("span, want", [
    (_openai_failure("RateLimitError", "Error code: 429 - slow down"), "rate_limited"),
    (_openai_failure("BadRequestError", "Error code: 400 - context too long"), "client_error"),
    (_openai_failure("openai.AuthenticationError", "Error code: 401 - bad key"), "client_error"),
    (_openai_failure("CancelledError", ""), "cancelled"),
    (_openai_failure("429", ""), "rate_limited"),  # HTTP semconv: error.type is the status code
    (_openai_failure("404", ""), "client_error"),
    ({**_openai_failure("_OTHER", "failed"), "http.response.status_code": 429}, "rate_limited"),
    (_openai_failure("InternalServerError", "Error code: 500 - boom"), "error"),
    (_openai_failure("APITimeoutError", "Request timed out."), "timeout"),
    (_openai_failure("408", ""), "error"),  # an upstream 408 is the serving side's (docs/EVENTS.md)
])
def test_failures_a_precision_did_not_cause_are_not_judged(span, want):
    """A throttled, refused or cancelled call says nothing about the precision (docs/EVENTS.md, "not
    judged"): as a JSON event it is not counted in error_rate, so it must not be from a span either."""
    from tests.test_otlp import ENCODINGS, decode

    for encoding in ENCODINGS:
        (ev,), rejected, _ = decode(encoding, make_request([span]))
        assert (ev.status, rejected) == (want, []), encoding


def test_a_span_that_ends_before_it_starts_is_rejected_not_a_zero_latency():
    """start > end (a broken span): the JSON contract rejects a negative latency (bad_value:latency_ms);
    clamped to 0 it was folded as the fastest request of its window."""
    from tests.test_otlp import ENCODINGS, decode

    now = time.time_ns()
    span = {"gen_ai.request.model": "m", "gen_ai.response.id": "x", "llmwd.route": "r", "llmwd.precision": "fp8",
            "_start_ns": now, "_end_ns": now - 500_000_000}
    zero = {**span, "_end_ns": now}
    for encoding in ENCODINGS:
        events, rejected, _ = decode(encoding, make_request([span, zero]))
        assert [r.reason for r in rejected] == ["bad_value:latency_ms"], encoding
        assert [e.latency_ms for e in events] == [0.0], encoding  # a zero duration is a value
