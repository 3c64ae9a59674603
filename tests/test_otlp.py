"""OTLP codecs: spans built with the real OpenTelemetry SDK, encoded with its OTLP encoder, decoded to
events; and the daemon path on real Tansu + Redis (windows, dead letters, commits)."""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.common.trace_encoder")

from google.protobuf import json_format  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import Status, StatusCode  # noqa: E402

from tests.helpers import drain  # noqa: E402
from watchdog.config.settings import OtlpOptions  # noqa: E402
from watchdog.core.events import InferenceEvent  # noqa: E402
from watchdog.ingest.otlp import OtlpDecoder, decoder_for  # noqa: E402
from watchdog.windows.aggregator import WindowAggregator  # noqa: E402

VLLM = {  # the attribute names vllm/tracing.py SpanAttributes writes (latencies in seconds)
    "gen_ai.response.model": "llama-3-8b-fp8",
    "gen_ai.request.id": "cmpl-1",
    "gen_ai.usage.prompt_tokens": 412,
    "gen_ai.usage.completion_tokens": 17,
    "gen_ai.latency.e2e": 0.8125,
    "gen_ai.latency.time_to_first_token": 0.0952,
    "gen_ai.latency.time_in_queue": 0.001,
}


def make_request(spans: list[dict[str, Any]], resource: dict[str, Any] | None = None) -> ExportTraceServiceRequest:
    """Spans through the real SDK and its OTLP encoder. Each spec: attributes, plus optional
    ``_status`` (StatusCode, message), ``_name``, ``_start_ns`` / ``_end_ns``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", **(resource or {})}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.v1.engine.output_processor")
    now = time.time_ns()
    for spec in spans:
        attrs = {k: v for k, v in spec.items() if not k.startswith("_")}
        span = tracer.start_span(spec.get("_name", "llm_request"), start_time=spec.get("_start_ns", now - 900_000_000))
        span.set_attributes(attrs)
        if "_status" in spec:
            span.set_status(Status(*spec["_status"]))
        span.end(end_time=spec.get("_end_ns", now))
    provider.shutdown()
    return encode_spans(exporter.get_finished_spans())


def collector_json(req: ExportTraceServiceRequest) -> bytes:
    """OTLP/JSON as the Collector writes it: the proto3 JSON mapping with hex trace and span ids."""
    doc = json_format.MessageToDict(req)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(doc, separators=(",", ":")).encode()


ENCODINGS = {
    "otlp_proto": lambda req: req.SerializeToString(),
    "otlp_json": collector_json,
    # protobuf's own JSON printer (base64 ids, indented): what a hand-rolled producer may write
    "otlp_json_pb": lambda req: json_format.MessageToJson(req).encode(),
}


def decode(encoding: str, req: ExportTraceServiceRequest, **opts: Any) -> tuple[list[InferenceEvent], list, OtlpDecoder]:
    dec = OtlpDecoder("otlp_json" if encoding.startswith("otlp_json") else "otlp_proto", OtlpOptions(**opts))
    events, rejected = dec(ENCODINGS[encoding](req))
    return events, rejected, dec


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_vllm_span_maps_to_one_event(encoding):
    req = make_request([{**VLLM, "llmwd.route": "tenant-a", "llmwd.precision": "FP8"}, {"_name": "POST /v1/chat", "http.route": "/v1"}])
    events, rejected, dec = decode(encoding, req)
    assert rejected == [] and dec.skipped == 1  # the HTTP span has no gen_ai.* attribute
    (ev,) = events
    span = req.resource_spans[0].scope_spans[0].spans[0]
    assert (ev.request_id, ev.model, ev.route, ev.precision, ev.status) == ("cmpl-1", "llama-3-8b-fp8", "tenant-a", "fp8", "ok")
    assert ev.latency_ms == pytest.approx(812.5) and ev.ttft_ms == pytest.approx(95.2)
    assert (ev.prompt_tokens, ev.completion_tokens, ev.engine) == (412, 17, "vllm")
    assert ev.ts == pytest.approx(span.end_time_unix_nano / 1e9)
    assert ev.extra["trace_id"] == span.trace_id.hex() and ev.extra["span_id"] == span.span_id.hex()


SEMCONV = {"gen_ai.request.model": "m-req", "gen_ai.response.id": "chatcmpl-9", "gen_ai.usage.input_tokens": 3,
           "gen_ai.usage.output_tokens": 4, "gen_ai.system": "openai"}


@pytest.mark.parametrize("span, resource, opts, want", [
    # route: span attribute wins over resource, fallback list in order, then the default
    ({**SEMCONV, "llmwd.route": "span-r", "llmwd.precision": "fp16"}, {"llmwd.route": "res-r"}, {}, ("span-r", "fp16")),
    ({**SEMCONV, "llmwd.precision": "fp16"}, {"llmwd.route": "res-r"}, {}, ("res-r", "fp16")),
    ({**SEMCONV, "tenant": "t-1", "llmwd.precision": "bf16"}, {}, {"route_attributes": ["llmwd.route", "tenant"]}, ("t-1", "bf16")),
    ({**SEMCONV, "llmwd.precision": "fp8"}, {}, {"default_route": "default"}, ("default", "fp8")),
    # precision: attribute, else the model map (exact, then pattern), else the default
    ({**SEMCONV, "llmwd.route": "r"}, {}, {"model_precisions": {"m-req": "fp16"}}, ("r", "fp16")),
    ({**SEMCONV, "llmwd.route": "r"}, {}, {"model_precisions": {"m-*": "fp8", "x": "fp16"}}, ("r", "fp8")),
    ({**SEMCONV, "llmwd.route": "r"}, {}, {"default_precision": "fp16"}, ("r", "fp16")),
    ({**SEMCONV, "llmwd.route": "r"}, {"deployment.precision": "fp8"},
     {"precision_attributes": ["llmwd.precision", "deployment.precision"]}, ("r", "fp8")),
])
def test_route_and_precision_sources(span, resource, opts, want):
    for encoding in ENCODINGS:
        events, rejected, _ = decode(encoding, make_request([span], resource), **opts)
        assert rejected == [], (encoding, rejected)
        (ev,) = events
        assert (ev.route, ev.precision) == want
        assert (ev.request_id, ev.model, ev.prompt_tokens, ev.completion_tokens) == ("chatcmpl-9", "m-req", 3, 4)
        assert ev.latency_ms == pytest.approx(900.0, abs=0.01)  # no gen_ai.latency.e2e: end - start
        assert ev.engine == "vllm"


@pytest.mark.parametrize("status, extra, want", [
    ((StatusCode.ERROR, "engine died"), {}, "error"),
    ((StatusCode.ERROR, "upstream request timed out"), {}, "timeout"),
    ((StatusCode.ERROR,), {"error.type": "TimeoutError"}, "timeout"),
    ((StatusCode.UNSET,), {"gen_ai.response.finish_reasons": ["error"]}, "error"),
    ((StatusCode.OK,), {"gen_ai.response.finish_reasons": ["stop"]}, "ok"),
])
def test_status(status, extra, want):
    span = {**VLLM, **extra, "llmwd.route": "r", "llmwd.precision": "fp8", "_status": status}
    for encoding in ENCODINGS:
        (ev,), _, _ = decode(encoding, make_request([span]))
        assert ev.status == want, encoding


@pytest.mark.parametrize("encoding", sorted(ENCODINGS))
def test_bad_spans_are_rejected_one_by_one_and_the_good_ones_kept(encoding):
    good = {**VLLM, "llmwd.route": "r", "llmwd.precision": "fp8"}
    spans = [good, {**VLLM, "llmwd.precision": "fp8"}, {**good, "gen_ai.latency.e2e": -1.0},
             {**good, "gen_ai.usage.completion_tokens": "many"}, {**good, "gen_ai.request.id": "cmpl-2"}]
    events, rejected, _ = decode(encoding, make_request(spans))
    assert [e.request_id for e in events] == ["cmpl-1", "cmpl-2"]
    assert [r.reason for r in rejected] == ["missing_field:route", "bad_value:latency_ms", "bad_type:completion_tokens"]
    # each dead letter holds exactly its span (with the resource), in the topic's encoding
    dec = OtlpDecoder("otlp_json" if encoding.startswith("otlp_json") else "otlp_proto",
                      OtlpOptions(default_route="replayed"))
    replayed = [dec(r.value) for r in rejected]
    assert [len(ev) + len(rj) for ev, rj in replayed] == [1, 1, 1]
    assert replayed[0][0][0].route == "replayed" and replayed[0][0][0].engine == "vllm"


def test_span_without_end_time_is_rejected():
    doc = {"resourceSpans": [{"resource": {}, "scopeSpans": [{"spans": [
        {"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331", "startTimeUnixNano": "1799999999000000000",
         "attributes": [{"key": "gen_ai.request.model", "value": {"stringValue": "m"}},
                        {"key": "llmwd.route", "value": {"stringValue": "r"}},
                        {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "12"}}]}]}]}]}
    events, rejected = OtlpDecoder("otlp_json", OtlpOptions(default_precision="fp8"))(json.dumps(doc).encode())
    assert events == [] and [r.reason for r in rejected] == ["missing_field:ts"]
    doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["endTimeUnixNano"] = "1800000000000000000"
    (ev,), rejected = OtlpDecoder("otlp_json", OtlpOptions(default_precision="fp8"))(json.dumps(doc).encode())
    assert (ev.ts, ev.prompt_tokens, ev.request_id) == (1.8e9, 12, "0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331")


@pytest.mark.parametrize("codec, raw, reason", [
    ("otlp_proto", b"\xff\xff\xff\xff not protobuf", "otlp_bad_proto"),
    ("otlp_proto", b"", "empty"),
    ("otlp_proto", b"\x00", "otlp_bad_proto"),
    ("otlp_proto", b"\x08\x01", "otlp_bad_shape"),  # valid protobuf, no resource spans
    ("otlp_json", b"{not json", "not_json"),
    ("otlp_json", b'{"schema": 1, "route": "r"}', "otlp_bad_shape"),
    ("otlp_json", b"[1, 2]", "otlp_bad_shape"),
    ("otlp_json", b"x" * 2048, "too_large"),
])
def test_undecodable_records_are_rejected_whole_with_their_bytes(codec, raw, reason):
    dec = decoder_for(codec, {"max_record_bytes": 1024})
    assert dec is not None
    events, rejected = dec(raw, 1_048_576)
    assert events == [] and [r.reason for r in rejected] == [reason]
    assert rejected[0].value == raw


def test_codec_selection():
    assert decoder_for("json") is None  # the ingest keeps its own JSON fast path
    with pytest.raises(ValueError, match="unknown codec 'avro'"):
        decoder_for("avro")
    from watchdog.config.settings import load_config

    cfg = load_config(None, kafka={"codec": "otlp_proto", "otlp": {"route_attributes": ["k8s.namespace.name"]}})
    assert cfg.kafka.codec == "otlp_proto" and cfg.kafka.otlp.route_attributes == ["k8s.namespace.name"]
    with pytest.raises(Exception, match="codec"):
        load_config(None, kafka={"codec": "avro"})


def test_a_record_is_committed_only_when_all_its_events_are_in_closed_windows():
    """One record, spans in two windows: the record's offset stays the commit mark until both close."""
    now = time.time_ns()
    base = {**VLLM, "llmwd.route": "r", "llmwd.precision": "fp8"}
    req = make_request([{**base, "_start_ns": now - 13_000_000_000, "_end_ns": now - 12_500_000_000},
                        {**base, "_start_ns": now - 3_000_000_000, "_end_ns": now - 2_500_000_000}])
    events, rejected = OtlpDecoder("otlp_proto")(req.SerializeToString())
    assert len(events) == 2 and not rejected
    agg = WindowAggregator(length_s=10, grace_s=0)
    for ev in events:
        assert agg.add(ev, ("t", 0), 7)
    first_end = (events[0].ts // 10 + 1) * 10
    assert len(agg.close_due(first_end)) == 1
    assert agg.min_open_offsets() == {("t", 0): 7}  # one event of the record is still open
    agg.close_due(first_end + 20)
    assert agg.min_open_offsets() == {}


# --- the daemon path on real Tansu + Redis ------------------------------------------------------

@pytest.mark.services
@pytest.mark.parametrize("codec", ["otlp_proto"])  # OTLP/JSON shares the path; its decoding is tested above
def test_daemon_ingests_span_batches_into_windows_and_dead_letters_bad_spans(
        codec, kafka_service, redis_service, redis_client, topic, tmp_path):
    from kafka import KafkaConsumer, KafkaProducer

    from tests.daemon_harness import make_config, running_daemon, write_policy
    from tests.helpers import wait_until

    route = f"otlp-{uuid.uuid4().hex[:6]}"
    encode = ENCODINGS[codec]
    good = {**VLLM, "llmwd.route": route}
    producer = KafkaProducer(bootstrap_servers=kafka_service.address)
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml", dry_run=True),
                      None)
    cfg.kafka.codec = codec
    cfg.kafka.otlp = OtlpOptions(model_precisions={"*-fp8": "fp8", "*-fp16": "fp16"})
    sent = 0
    with running_daemon(cfg) as (daemon, _server):
        for i in range(3):  # each record: 20 FP8 spans, 20 FP16 spans, one without a route
            spans = [{**good, "gen_ai.request.id": f"{i}-{j}"} for j in range(20)]
            spans += [{**good, "gen_ai.response.model": "llama-3-8b-fp16", "gen_ai.request.id": f"{i}-h{j}"}
                      for j in range(20)]
            spans.append({**VLLM, "gen_ai.request.id": f"{i}-noroute"})
            producer.send(topic, encode(make_request(spans)))
            sent += 40
        producer.send(topic, b"\x0a\xff garbage")
        producer.flush()

        def windows() -> list[dict]:
            return [w for _id, v in redis_client.xrange("llmwd:windows")
                    if (w := json.loads(v["json"]))["route"] == route]

        wait_until(lambda: sum(w["samples"] for w in windows()) >= sent, 30, detail=windows)
        # the commit passes every record only once all of its events sit in closed windows
        wait_until(lambda: _committed(kafka_service.address, cfg.kafka.group_id, topic) >= 4, 15)
    producer.close()
    got = windows()
    assert {w["precision"] for w in got} == {"fp8", "fp16"} and sum(w["samples"] for w in got) == sent

    dlq = KafkaConsumer(cfg.kafka.dead_letter_topic, bootstrap_servers=kafka_service.address,
                        auto_offset_reset="earliest", group_id=None)
    letters = drain(dlq, 3.0)
    dlq.close()
    reasons = sorted(dict(m.headers)["llmwd.reason"].decode() for m in letters)
    assert reasons == ["missing_field:route"] * 3 + ["otlp_bad_proto" if codec == "otlp_proto" else "not_json"]
    one = next(m for m in letters if dict(m.headers)["llmwd.reason"] == b"missing_field:route")
    replay = OtlpDecoder(codec, OtlpOptions(default_route="x", default_precision="fp8"))  # type: ignore[arg-type]
    events, rejected = replay(one.value)
    assert [e.request_id.endswith("-noroute") for e in events] == [True] and not rejected


def _committed(address: str, group: str, topic: str) -> int:
    """The group's committed offsets, asked by a consumer of its own (the daemon's is not thread-safe)."""
    from kafka import KafkaConsumer
    from kafka.structs import TopicPartition

    c = KafkaConsumer(bootstrap_servers=address, group_id=group, enable_auto_commit=False)
    try:
        return sum(c.committed(TopicPartition(topic, p)) or 0 for p in (c.partitions_for_topic(topic) or []))
    finally:
        c.close(autocommit=False)
