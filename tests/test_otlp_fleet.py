"""OTLP span batches on an ordinary day of a fleet: big mixed batches, compression, retries, restarts."""

from __future__ import annotations

import json
import time
import uuid
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


# --- one Collector batch: 1,000 GenAI spans of which 3 are bad, 503 HTTP / DB spans of the same traces ----

def _windows(redis_client: Any, route: str) -> list[dict[str, Any]]:
    return [w for _id, v in redis_client.xrange("llmwd:windows") if (w := json.loads(v["json"]))["route"] == route]


def _count(daemon: Any, result: str) -> float:
    return daemon.metrics.registry.get_sample_value("llmwd_events_total", {"result": result}) or 0.0


@pytest.mark.services
def test_a_mixed_batch_keeps_its_good_spans_dead_letters_its_bad_ones_and_counts_the_others(
        kafka_service, redis_service, redis_client, topic, tmp_path):
    """One record as a Collector batches a fleet's traces, gzip and zstd: 994 spans folded, 3 dead-lettered
    (one dead letter each), the 503 HTTP and database spans skipped quietly but counted
    (``llmwd_events_total{result="skipped"}``): an operator whose spans all miss the mapping sees why
    nothing arrives. The same batch written twice (a Collector retrying an export whose acknowledgement
    was lost) counts twice: spans are not deduplicated, as JSON events are not."""
    from kafka import KafkaConsumer, KafkaProducer

    from tests.daemon_harness import make_config, running_daemon, write_policy
    from tests.helpers import drain, wait_until
    from tests.test_otlp import VLLM
    from watchdog.config.settings import OtlpOptions

    route = f"fleet-{uuid.uuid4().hex[:6]}"
    good = {**VLLM, "llmwd.route": route}
    end = time.time_ns() - 3_000_000_000
    spans = [{**good, "gen_ai.request.id": f"g{j}", "_end_ns": end} for j in range(997)]
    spans[100] = {**VLLM, "gen_ai.request.id": "noroute", "_end_ns": end}
    spans[500] = {**good, "gen_ai.request.id": "neg", "gen_ai.latency.e2e": -1.0, "_end_ns": end}
    spans[900] = {**good, "gen_ai.request.id": "str", "gen_ai.usage.completion_tokens": "many", "_end_ns": end}
    spans += [{"_name": "GET /v1/models", "http.request.method": "GET", "http.route": "/v1/models"}] * 500
    spans += [{"_name": "SELECT", "db.system": "postgresql"}] * 3
    batch = make_request(spans).SerializeToString()
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml", dry_run=True),
                      None)
    cfg.kafka.codec = "otlp_proto"
    cfg.kafka.otlp = OtlpOptions(model_precisions={"*-fp8": "fp8"})
    with running_daemon(cfg) as (daemon, _server):
        for compression in ("gzip", "zstd"):
            producer = KafkaProducer(bootstrap_servers=kafka_service.address, compression_type=compression)
            producer.send(topic, batch)
            producer.flush()
            producer.close()
        wait_until(lambda: sum(w["samples"] for w in _windows(redis_client, route)) >= 2 * 994, 30)
        ok, skipped = _count(daemon, "ok"), _count(daemon, "skipped")
    assert sum(w["samples"] for w in _windows(redis_client, route)) == 2 * 994
    assert (ok, skipped) == (2 * 994, 2 * 503)
    dlq = KafkaConsumer(cfg.kafka.dead_letter_topic, bootstrap_servers=kafka_service.address,
                        auto_offset_reset="earliest", group_id=None)
    letters = drain(dlq, 3.0)
    dlq.close()
    assert sorted(dict(m.headers)["llmwd.reason"].decode() for m in letters) == sorted(
        ["missing_field:route", "bad_value:latency_ms", "bad_type:completion_tokens"] * 2)


def test_the_serving_replica_comes_from_the_resource():
    """The windows keep latency per replica so one stalled pod cannot speak for its precision
    (docs/EVENTS.md, ``replica``); a span's resource names its pod (the Collector's k8sattributes
    processor) or its SDK instance (the Python SDK sets ``service.instance.id`` per process), and the
    event carries it."""
    from tests.test_otlp import ENCODINGS, VLLM, decode

    span = {**VLLM, "llmwd.route": "r", "llmwd.precision": "fp8"}
    for encoding in ENCODINGS:
        (ev,), _, _ = decode(encoding, make_request([span], {"k8s.pod.name": "vllm-fp8-7", "service.instance.id": "i-1"}))
        assert ev.replica == "vllm-fp8-7", encoding
        (ev,), _, _ = decode(encoding, make_request([span], {"service.instance.id": "i-1"}))
        assert ev.replica == "i-1", encoding
        (ev,), _, _ = decode(encoding, make_request([span], {"k8s.pod.name": "p"}), replica_attributes=[])
        assert ev.replica is None, encoding
        (ev,), _, _ = decode(encoding, make_request([span], {"host.name": "gpu-3"}), replica_attributes=["host.name"])
        assert ev.replica == "gpu-3", encoding


@pytest.mark.services
@pytest.mark.parametrize("codec", ["otlp_proto", "json"])
def test_a_crash_in_the_middle_of_a_record_loses_and_doubles_nothing(
        kafka_service, redis_service, redis_client, topic, tmp_path, codec):
    """Two 1,000-span records (json: two runs of 1,000 events, each a record, read in one poll batch); the
    loop fails after 499 events of the second. Crash-only: no checkpoint of that half-folded state, the
    next start re-reads from the last good checkpoint and counts each event once. (Closing the consumer at
    the crash ran the revoke callback, which checkpointed the half-folded windows at the consumer's fetch
    position: 501 spans were never counted.)"""
    import threading

    from kafka import KafkaProducer

    from tests.daemon_harness import make_config, write_policy
    from tests.helpers import wait_until
    from tests.test_otlp import VLLM
    from watchdog.config.settings import OtlpOptions
    from watchdog.runtime.daemon import Daemon

    route = f"crash-{uuid.uuid4().hex[:6]}"
    now = time.time_ns()

    def records(tag: str, end_ns: int, n: int = 1000) -> list[bytes]:
        if codec == "json":
            return [json.dumps({"request_id": f"{tag}{j}", "ts": (end_ns + j * 1_000_000) / 1e9,
                                "model": VLLM["gen_ai.response.model"], "route": route, "precision": "fp8",
                                "status": "ok", "latency_ms": 812.5}).encode() for j in range(n)]
        return [make_request([{**VLLM, "llmwd.route": route, "gen_ai.request.id": f"{tag}{j}",
                               "_end_ns": end_ns + j * 1_000_000} for j in range(n)]).SerializeToString()]

    def send(tag: str, end_ns: int, n: int = 1000) -> None:
        for value in records(tag, end_ns, n):
            producer.send(topic, value, partition=0)
        producer.flush()

    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml", dry_run=True),
                      None)
    if codec == "otlp_proto":
        cfg.kafka.codec = "otlp_proto"
        cfg.kafka.otlp = OtlpOptions(model_precisions={"*-fp8": "fp8"})
    producer = KafkaProducer(bootstrap_servers=kafka_service.address, linger_ms=20)
    send("a", now - 60_000_000_000)
    send("b", now - 40_000_000_000)

    first = Daemon(cfg)
    fold = first.ownership.fold
    seen_b = [0]

    def failing_fold(event: Any, pk: Any, offset: int) -> str | None:
        if event.request_id.startswith("b"):
            seen_b[0] += 1
            if seen_b[0] == 500:
                raise RuntimeError("the loop failed mid-record")
        return fold(event, pk, offset)

    first.ownership.fold = failing_fold  # type: ignore[method-assign]
    failed: list[BaseException] = []

    def run() -> None:
        try:
            first.run()
        except RuntimeError as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert len(failed) == 1 and seen_b[0] == 500

    second = Daemon(cfg)
    thread = threading.Thread(target=second.run, daemon=True)
    thread.start()
    try:
        send("c", now - 5_000_000_000, 10)  # moves the watermark on
        wait_until(lambda: sum(w["samples"] for w in _windows(redis_client, route)) >= 2010, 60,
                   detail=lambda: [w["samples"] for w in _windows(redis_client, route)])
        time.sleep(2)
    finally:
        second.stop()
        thread.join(30)
        producer.close()
    # windows of a and b closed, c's window closed at the stop: every span once
    assert sum(w["samples"] for w in _windows(redis_client, route)) == 2010


@pytest.mark.parametrize("finish, want", [
    (("abort",), "cancelled"),      # vLLM's FinishReason.ABORT: the client went away
    ('["abort"]', "cancelled"),     # SGLang writes the list JSON-encoded, as one string
    ('["error"]', "error"),
    ('["stop"]', "ok"),
    (("length",), "ok"),
    ("stop", "ok"),
])
def test_finish_reasons_as_list_or_json_string(finish, want):
    """An aborted request (client disconnect) is ``cancelled`` and not judged, as the gateway records
    it; counted ``ok`` it added its cut-short latency and tokens to the precision's numbers."""
    from tests.test_otlp import ENCODINGS, VLLM, decode

    span = {**VLLM, "llmwd.route": "r", "llmwd.precision": "fp8", "gen_ai.response.finish_reasons": finish}
    for encoding in ENCODINGS:
        (ev,), rejected, _ = decode(encoding, make_request([span]))
        assert (ev.status, rejected) == (want, []), encoding
