"""Benchmark: the OTLP span codecs through the daemon's ingest stage vs the JSON event codec.

One Tansu broker on a free port; three topics hold the same number of requests: JSON events
(``watchdog.traffic.TrafficGenerator``, ~600 bytes), and OpenTelemetry GenAI spans built with the
real opentelemetry-sdk (vLLM's attribute names, a route and precision on the resource), 50 spans
per ``ExportTraceServiceRequest`` as the Collector's Kafka exporter batches them, encoded with the
OTLP protobuf encoder and as OTLP/JSON. Each repetition reads every topic with a fresh consumer
group, interleaved, timed from the first non-empty poll to the last event:

* ``json.loads``   consume + ``json.loads`` per JSON event (the baseline of bench/ingest.py)
* ``json``         ``watchdog.ingest.Ingest`` with the ``json`` codec (decode + validate + sink)
* ``otlp_proto``   the same ``Ingest`` with the ``otlp_proto`` codec
* ``otlp_json``    the same with ``otlp_json``

    .venv/bin/python bench/ingest_otlp.py [--events 50000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson  # noqa: E402
from common import create_topic, machine_note, median, produce_events, route_names, services, table  # noqa: E402

from watchdog.config import KafkaConfig  # noqa: E402
from watchdog.ingest import Ingest, make_consumer  # noqa: E402
from watchdog.metrics import Metrics  # noqa: E402
from watchdog.otlp import decoder_for  # noqa: E402

BATCH = 50


def span_batches(n: int, n_routes: int, end_ts: float) -> tuple[list[bytes], list[bytes]]:
    """(protobuf, OTLP/JSON) messages holding ``n`` GenAI spans in batches of ``BATCH``."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    routes = route_names(n_routes)
    exporters = []
    for i, route in enumerate(routes):
        exp = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "llmwd.route": route,
                                                            "llmwd.precision": "fp8" if i % 2 else "fp16"}))
        provider.add_span_processor(SimpleSpanProcessor(exp))
        exporters.append((provider.get_tracer("vllm"), exp))
    start_ns = int((end_ts - n / 1000) * 1e9)
    for k in range(n):
        tracer, _ = exporters[k % n_routes]
        t0 = start_ns + k * 1_000_000
        span = tracer.start_span("llm_request", start_time=t0)
        span.set_attributes({"gen_ai.request.id": f"cmpl-{k}", "gen_ai.response.model": "llama-3-8b-instruct",
                             "gen_ai.usage.prompt_tokens": 400 + k % 300, "gen_ai.usage.completion_tokens": 20,
                             "gen_ai.latency.e2e": 0.42, "gen_ai.latency.time_to_first_token": 0.05,
                             "gen_ai.request.max_tokens": 256, "gen_ai.request.temperature": 0.0})
        span.end(end_time=t0 + 420_000_000)
    spans = [s for _, exp in exporters for s in exp.get_finished_spans()]
    protos, jsons = [], []
    for i in range(0, len(spans), BATCH):
        req = encode_spans(spans[i:i + BATCH])
        protos.append(req.SerializeToString())
        doc = json_format.MessageToDict(req)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in s:
                            s[key] = base64.b64decode(s[key]).hex()
        jsons.append(orjson.dumps(doc))
    return protos, jsons


def produce(address: str, topic: str, values: list[bytes]) -> int:
    from kafka import KafkaProducer

    create_topic(address, topic, 1)
    producer = KafkaProducer(bootstrap_servers=address, linger_ms=20, batch_size=256 * 1024,
                             max_request_size=8 * 1024 * 1024)
    for v in values:
        producer.send(topic, value=v)
    producer.flush(timeout=120)
    producer.close(timeout=10)
    return sum(len(v) for v in values)


def kafka_cfg(address: str, topic: str, codec: str) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=address, topic=topic, group_id=f"bench-{codec}-{uuid.uuid4().hex[:8]}",
                       session_timeout_ms=6000, heartbeat_interval_ms=1000, codec=codec)


def run_loads(address: str, topic: str, n: int) -> float:
    consumer = make_consumer(kafka_cfg(address, topic, "json"))
    consumer.subscribe([topic])
    seen, t0 = 0, None
    try:
        while seen < n:
            batches = consumer.poll(timeout_ms=200)
            if batches and t0 is None:
                t0 = time.perf_counter()
            for records in batches.values():
                for rec in records:
                    json.loads(rec.value)
                seen += len(records)
        assert t0 is not None
        return time.perf_counter() - t0
    finally:
        consumer.close(autocommit=False)


def run_ingest(address: str, topic: str, codec: str, n: int) -> float:
    cfg = kafka_cfg(address, topic, codec)
    count = [0]

    def sink(_e: Any, _p: Any, _o: int) -> None:
        count[0] += 1

    ingest = Ingest(make_consumer(cfg), None, topic=topic, dlq_topic=cfg.dead_letter_topic,
                    max_event_bytes=1_048_576, metrics=Metrics(), sink=sink, decode=decoder_for(codec, cfg.otlp))
    t0 = None
    try:
        while count[0] < n:
            if ingest.poll(200) and t0 is None:
                t0 = time.perf_counter()
        assert t0 is not None
        return time.perf_counter() - t0
    finally:
        ingest.consumer.close(autocommit=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--routes", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.events - args.events % BATCH
    print(f"machine: {machine_note()} (shared: other work may run)")
    with services() as svc:
        end_ts = time.time()
        json_topic, proto_topic, ojson_topic = (f"bench.{k}.{uuid.uuid4().hex[:6]}" for k in ("json", "proto", "ojson"))
        json_bytes, _ = produce_events(svc.kafka_address, json_topic, n, args.routes, events_per_s=1000, end_ts=end_ts)
        t0 = time.perf_counter()
        protos, jsons = span_batches(n, args.routes, end_ts)
        print(f"{n} requests: JSON events {json_bytes / n:.0f} B each; OTLP spans built and encoded in "
              f"{time.perf_counter() - t0:.1f} s, protobuf {sum(map(len, protos)) / n:.0f} B/span, "
              f"OTLP/JSON {sum(map(len, jsons)) / n:.0f} B/span ({BATCH} spans per message)")
        produce(svc.kafka_address, proto_topic, protos)
        produce(svc.kafka_address, ojson_topic, jsons)
        times: dict[str, list[float]] = {m: [] for m in ("json.loads", "json", "otlp_proto", "otlp_json")}
        for _ in range(args.repeats):
            times["json.loads"].append(run_loads(svc.kafka_address, json_topic, n))
            times["json"].append(run_ingest(svc.kafka_address, json_topic, "json", n))
            times["otlp_proto"].append(run_ingest(svc.kafka_address, proto_topic, "otlp_proto", n))
            times["otlp_json"].append(run_ingest(svc.kafka_address, ojson_topic, "otlp_json", n))
        base = times["json.loads"]
        rows = [[m, median([n / t for t in ts]), median([b / t for b, t in zip(base, ts, strict=True)]),
                 median([b / t for b, t in zip(times["json"], ts, strict=True)])] for m, ts in times.items()]
        print(table(["mode", "events/s", "ratio vs consume+json.loads", "ratio vs json codec"], rows))
        print(f"(medians over {args.repeats} interleaved repetitions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
