"""OTLP span batches (as the OpenTelemetry Collector's Kafka exporter writes them) → events.

Spans are built with the real opentelemetry-sdk and encoded with the OTLP encoder of
opentelemetry-exporter-otlp-proto-common (protobuf) and protobuf's json_format (JSON)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.common")

import orjson  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import Status, StatusCode  # noqa: E402

from watchdog.otlp import OtlpOptions, decode_otlp_json, decode_otlp_proto, decoder_for  # noqa: E402


def vllm_spans(route: str | None = "support", n_ok: int = 2, bad: bool = False) -> list[Any]:
    """Finished spans as vLLM emits them (its attribute names), plus one HTTP span of the same trace."""
    res = {"service.name": "vllm-fp8", "llmwd.precision": "fp8"}
    if route:
        res["llmwd.route"] = route
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(res))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm")
    with tracer.start_as_current_span("POST /v1/chat/completions"):  # not a GenAI span: skipped
        for i in range(n_ok):
            with tracer.start_as_current_span("llm_request") as span:
                span.set_attributes({"gen_ai.request.id": f"cmpl-{i}", "gen_ai.response.model": "llama-3-8b",
                                     "gen_ai.usage.prompt_tokens": 12, "gen_ai.usage.completion_tokens": 7,
                                     "gen_ai.latency.e2e": 0.25, "gen_ai.latency.time_to_first_token": 0.04})
        with tracer.start_as_current_span("llm_request") as span:
            span.set_attributes({"gen_ai.request.id": "cmpl-late", "gen_ai.request.model": "llama-3-8b",
                                 "error.type": "TimeoutError", "llmwd.route": "legal"})
            span.set_status(Status(StatusCode.ERROR, "deadline"))
        if bad:
            with tracer.start_as_current_span("llm_request") as span:
                span.set_attributes({"gen_ai.request.id": "cmpl-bad", "gen_ai.response.model": "llama-3-8b",
                                     "gen_ai.usage.prompt_tokens": -3})
    provider.shutdown()
    return list(exporter.get_finished_spans())


def as_proto(spans: list[Any]) -> bytes:
    return encode_spans(spans).SerializeToString()


def as_json(spans: list[Any], hex_ids: bool = True) -> bytes:
    doc = json_format.MessageToDict(encode_spans(spans))
    if hex_ids:  # OTLP/JSON (what the Collector writes) uses hex ids; protobuf's mapping uses base64
        import base64

        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    for k in ("traceId", "spanId", "parentSpanId"):
                        if k in s:
                            s[k] = base64.b64decode(s[k]).hex()
    return orjson.dumps(doc)


def summary(events: list[Any]) -> list[tuple[Any, ...]]:
    return [(e.request_id, e.model, e.route, e.precision, e.status, round(e.latency_ms, 3), e.ttft_ms,
             e.prompt_tokens, e.completion_tokens, e.engine, e.extra["trace_id"]) for e in events]


def test_genai_spans_become_events_in_both_encodings() -> None:
    spans = vllm_spans()
    events, errors = decode_otlp_proto(as_proto(spans))
    assert errors == []
    got = summary(events)
    trace = spans[0].context.trace_id.to_bytes(16, "big").hex()
    assert got[:2] == [(f"cmpl-{i}", "llama-3-8b", "support", "fp8", "ok", 250.0, 40.0, 12, 7, "vllm-fp8", trace)
                       for i in range(2)]
    late = got[2]
    assert late[:5] == ("cmpl-late", "llama-3-8b", "legal", "fp8", "timeout") and late[8] == 0
    assert events[0].ts == pytest.approx(spans[0].end_time / 1e9)
    assert abs(events[0].ts - time.time()) < 60
    for hex_ids in (True, False):
        j_events, j_errors = decode_otlp_json(as_json(spans, hex_ids))
        assert j_errors == [] and summary(j_events) == got


def test_bad_spans_and_bad_messages_get_reasons() -> None:
    events, errors = decode_otlp_proto(as_proto(vllm_spans(bad=True)))
    assert len(events) == 3 and [e.reason for e in errors] == ["bad_value:prompt_tokens"]
    events, errors = decode_otlp_proto(as_proto(vllm_spans(route=None)))
    assert [e.route for e in events] == ["legal"] and [e.reason for e in errors] == ["missing_field:route"] * 2
    events, _ = decode_otlp_json(as_json(vllm_spans(route=None)), OtlpOptions(default_route="shared"))
    assert [e.route for e in events] == ["shared", "shared", "legal"]
    assert [e.reason for e in decode_otlp_proto(b"\xff\xff\xff garbage")[1]] == ["otlp_bad_proto"]
    assert [e.reason for e in decode_otlp_json(b"{not json")[1]] == ["not_json"]
    assert [e.reason for e in decode_otlp_json(b'{"schema": 1}')[1]] == ["otlp_bad_shape"]
    assert [e.reason for e in decode_otlp_proto(b"")[1]] == ["empty"]
    with pytest.raises(ValueError, match="unknown codec"):
        decoder_for("avro")


@pytest.mark.services
def test_the_ingest_reads_an_otlp_topic_and_dead_letters_bad_spans(kafka_service: Any, topic: str) -> None:
    from kafka import KafkaConsumer, KafkaProducer

    from watchdog.config import KafkaConfig
    from watchdog.ingest import Ingest, make_consumer, make_producer
    from watchdog.metrics import Metrics

    good, mixed = as_proto(vllm_spans()), as_proto(vllm_spans(bad=True))
    producer = KafkaProducer(bootstrap_servers=kafka_service.address)
    for value in (good, mixed, b"\x00garbage"):
        producer.send(topic, value=value)
    producer.flush()
    producer.close()
    cfg = KafkaConfig(bootstrap_servers=kafka_service.address, topic=topic, group_id=f"g-{topic}",
                      session_timeout_ms=6000, heartbeat_interval_ms=1000, codec="otlp_proto")
    got: list[Any] = []
    metrics = Metrics()
    ingest = Ingest(make_consumer(cfg), make_producer(cfg), topic=topic, dlq_topic=cfg.dead_letter_topic,
                    max_event_bytes=1_048_576, metrics=metrics, sink=lambda e, p, o: got.append((e, o)),
                    decode=decoder_for(cfg.codec, cfg.otlp))
    deadline = time.monotonic() + 20
    while len(got) < 6 and time.monotonic() < deadline:
        ingest.poll(200)
    ingest.commit({})
    ingest.close()
    assert sorted(e.request_id for e, _ in got) == sorted(["cmpl-0", "cmpl-1", "cmpl-late"] * 2)
    dlq = KafkaConsumer(cfg.dead_letter_topic, bootstrap_servers=kafka_service.address,
                        auto_offset_reset="earliest", consumer_timeout_ms=3000)
    dead = [(m.value, dict(m.headers)["llmwd.reason"]) for m in dlq]
    dlq.close()
    assert sorted(dead) == sorted([(mixed, b"bad_value:prompt_tokens"), (b"\x00garbage", b"otlp_bad_proto")])
    assert metrics.dlq.labels("otlp_bad_proto")._value.get() == 1
