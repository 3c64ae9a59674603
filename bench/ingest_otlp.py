"""Benchmark: spans/s through the daemon's full ingest pipeline with an OTLP codec vs raw consume + decode.

One Tansu broker and one Redis on free ports; one topic pre-produced with ExportTraceServiceRequest
batches as the Collector's Kafka exporter writes them (``--spans-per-record`` vLLM-style GenAI spans
each, built with the OpenTelemetry SDK and encoded with its OTLP encoder; OTLP/JSON with hex ids),
end times spread over many 10 s windows and ~50 routes. Each repetition reads the whole topic with a
fresh consumer group in every mode, interleaved; the timer runs from the first non-empty poll:

* ``raw``       kafka-python consume only
* ``parse``     consume + parse of each record (``ExportTraceServiceRequest.FromString`` / ``orjson.loads``)
* ``decode``    consume + ``watchdog.ingest.otlp.OtlpDecoder`` (parse, map, validate every span)  (the **baseline**)
* ``pipeline``  ``watchdog.runtime.daemon.Daemon.step()`` in a loop with ``kafka.codec`` set: consume -> decode
                -> DLQ check -> windows -> policies/default.yaml -> Redis -> offset commits

The result is the ratio pipeline / decode per repetition (median of the repetitions), the same
question bench/ingest.py asks of the JSON codec.

    .venv/bin/python bench/ingest_otlp.py [--codec otlp_proto|otlp_json] [--spans 100000] [--quick]
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, create_topic, machine_note, median, route_names, services, table  # noqa: E402

from watchdog.config.settings import (  # noqa: E402
    Config,
    KafkaConfig,
    OtlpOptions,  # noqa: E402
    load_config,
)
from watchdog.ingest.consumer import make_consumer  # noqa: E402
from watchdog.ingest.otlp import OtlpDecoder  # noqa: E402
from watchdog.runtime.daemon import Daemon  # noqa: E402

MODES = ("raw", "parse", "decode", "pipeline")
OPTIONS = {"model_precisions": {"*-fp8": "fp8", "*-fp16": "fp16"}}


def build_records(n_spans: int, per_record: int, n_routes: int, codec: str, end_ts: float,
                  span_s: float) -> list[bytes]:
    """vLLM-shaped spans through the real SDK and OTLP encoder, ``per_record`` to a record."""
    from google.protobuf import json_format
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.v1.engine.output_processor")
    routes = route_names(n_routes)
    start_ts = end_ts - span_s
    records = []
    for i in range(n_spans):
        end_ns = int((start_ts + span_s * i / n_spans) * 1e9)
        e2e = 0.2 + (i % 97) / 100.0
        span = tracer.start_span("llm_request", start_time=end_ns - int(e2e * 1e9))
        span.set_attributes({
            "gen_ai.response.model": "llama-3-8b-fp8" if i % 2 else "llama-3-8b-fp16",
            "gen_ai.request.id": f"cmpl-{i}",
            "gen_ai.usage.prompt_tokens": 300 + i % 200,
            "gen_ai.usage.completion_tokens": 20 + i % 80,
            "gen_ai.latency.e2e": e2e,
            "gen_ai.latency.time_to_first_token": e2e / 8,
            "gen_ai.latency.time_in_queue": 0.001,
            "gen_ai.request.max_tokens": 256,
            "gen_ai.request.temperature": 0.0,
            "llmwd.route": routes[i % n_routes],
        })
        span.end(end_time=end_ns)
        if (i + 1) % per_record == 0 or i + 1 == n_spans:
            req = encode_spans(exporter.get_finished_spans())
            exporter.clear()
            if codec == "otlp_proto":
                records.append(req.SerializeToString())
            else:  # OTLP/JSON as the Collector writes it: proto3 JSON mapping, hex ids
                doc = json_format.MessageToDict(req)
                for rs in doc["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        for sp in ss["spans"]:
                            sp["traceId"] = base64.b64decode(sp["traceId"]).hex()
                            sp["spanId"] = base64.b64decode(sp["spanId"]).hex()
                records.append(json.dumps(doc, separators=(",", ":")).encode())
    provider.shutdown()
    return records


def produce(address: str, topic: str, records: list[bytes]) -> float:
    from kafka import KafkaProducer

    create_topic(address, topic, 1)
    producer = KafkaProducer(bootstrap_servers=address, linger_ms=20, max_request_size=16 * 1024 * 1024)
    t0 = time.perf_counter()
    for raw in records:
        producer.send(topic, raw)
    producer.flush()
    producer.close()
    return time.perf_counter() - t0


def kafka_cfg(address: str, topic: str, group: str, codec: str) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=address, topic=topic, group_id=group, session_timeout_ms=6000,
                       heartbeat_interval_ms=1000, codec=codec, otlp=OtlpOptions(**OPTIONS))  # type: ignore[arg-type]


def consume(address: str, topic: str, n: int, mode: str, codec: str, timeout_s: float) -> tuple[float, float, int]:
    """(wall, CPU seconds, events) from the first non-empty poll to the n-th record."""
    consumer = make_consumer(kafka_cfg(address, topic, f"bench-{mode}-{uuid.uuid4().hex[:8]}", codec))
    consumer.subscribe([topic])
    decoder = OtlpDecoder(codec, OtlpOptions(**OPTIONS))  # type: ignore[arg-type]
    if codec == "otlp_proto":
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        parse: Any = ExportTraceServiceRequest.FromString
    else:
        import orjson

        parse = orjson.loads
    seen = events = 0
    t0 = c0 = None
    deadline = time.monotonic() + timeout_s
    try:
        while seen < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: read {seen} of {n} records in {timeout_s:.0f} s")
            batches = consumer.poll(timeout_ms=200)
            if not batches:
                continue
            if t0 is None:
                t0, c0 = time.perf_counter(), time.process_time()
            for records in batches.values():
                if mode == "parse":
                    for rec in records:
                        parse(rec.value)
                elif mode == "decode":
                    for rec in records:
                        events += len(decoder(rec.value)[0])
                seen += len(records)
        assert t0 is not None and c0 is not None
        return time.perf_counter() - t0, time.process_time() - c0, events
    finally:
        consumer.close(autocommit=False)


def daemon_config(address: str, topic: str, redis_url: str, codec: str) -> Config:
    group = f"bench-pipeline-{uuid.uuid4().hex[:8]}"
    return load_config(None, **{
        "policies": [str(ROOT / "policies" / "default.yaml")],
        "kafka": kafka_cfg(address, topic, group, codec).model_dump(),
        "redis": {"url": redis_url, "prefix": f"bench{uuid.uuid4().hex[:6]}"},
        "windows": {"length_s": 10.0, "grace_s": 2.0},
        "server": {"port": 0},
        "instance": "bench",
    })


def pipeline(address: str, topic: str, redis_url: str, n: int, codec: str,
             timeout_s: float) -> tuple[float, float, dict[str, Any]]:
    """(wall, CPU seconds, counters) for ``Daemon.step`` to take in ``n`` records."""
    daemon = Daemon(daemon_config(address, topic, redis_url, codec))
    daemon.connect_kafka()
    assert daemon.ingest is not None
    ingest = daemon.ingest
    real_poll = ingest.poll
    state: dict[str, Any] = {"seen": 0, "t0": None, "c0": 0.0}

    def counted_poll(timeout_ms: int = 200) -> int:
        got = real_poll(timeout_ms)
        if got and state["t0"] is None:
            state["t0"], state["c0"] = time.perf_counter(), time.process_time()
        state["seen"] += got
        return got

    ingest.poll = counted_poll  # type: ignore[method-assign]
    freeze = getattr(daemon, "freeze_startup_heap", None)
    if freeze is not None:
        freeze()
    deadline = time.monotonic() + timeout_s
    try:
        while state["seen"] < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline: read {state['seen']} of {n} records in {timeout_s:.0f} s")
            daemon.step()
        elapsed = time.perf_counter() - state["t0"]
        cpu = time.process_time() - state["c0"]
        return elapsed, cpu, {"windows_closed": daemon.stats.windows_closed, "folded": daemon.aggregator.folded,
                              "late": daemon.aggregator.late}
    finally:
        daemon.stop()
        daemon.shutdown()
        if freeze is not None:
            gc.unfreeze()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", choices=("otlp_proto", "otlp_json"), default="otlp_proto")
    ap.add_argument("--spans", type=int, default=100_000)
    ap.add_argument("--spans-per-record", type=int, default=100)
    ap.add_argument("--routes", type=int, default=50)
    ap.add_argument("--windows", type=int, default=20, help="10 s windows the span end times span")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--quick", action="store_true", help="20k spans, 8 windows (< 60 s)")
    args = ap.parse_args()
    if args.quick:
        args.spans, args.windows = 20_000, 8
    modes = [m for m in args.modes.split(",") if m]
    logging.basicConfig(level=logging.WARNING)

    times: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    records = build_records(args.spans, args.spans_per_record, args.routes, args.codec, time.time() - 3.0,
                            args.windows * 10.0)
    nbytes = sum(len(r) for r in records)
    print(f"built {args.spans:,} spans in {len(records):,} {args.codec} records "
          f"({nbytes / len(records) / 1024:.0f} KiB avg, {nbytes / args.spans:.0f} B/span) "
          f"in {time.perf_counter() - t0:.1f} s")
    with services() as svc:
        topic = f"bench.otlp.{uuid.uuid4().hex[:8]}"
        print(f"produced in {produce(svc.kafka_address, topic, records):.1f} s")
        n = len(records)
        timeout = max(60.0, args.spans / 1000.0)
        for rep in range(args.repeats):
            for mode in modes:
                if mode == "pipeline":
                    t, cpu, info = pipeline(svc.kafka_address, topic, svc.redis_url, n, args.codec, timeout)
                else:
                    t, cpu, got = consume(svc.kafka_address, topic, n, mode, args.codec, timeout)
                    if mode == "decode" and got != args.spans:
                        raise SystemExit(f"decode produced {got} events, expected {args.spans}")
                times[mode].append(t)
                cpus[mode].append(cpu)
                print(f"  rep {rep + 1} {mode:<9} {args.spans / t:>10,.0f} spans/s  "
                      f"{1e6 * cpu / args.spans:6.1f} us CPU/span", flush=True)
    if "pipeline" in modes and info.get("folded") != args.spans:
        raise SystemExit(f"pipeline folded {info.get('folded')} of {args.spans} spans: {info}")

    base = times.get("decode")
    rows = []
    for mode in modes:
        rates = [args.spans / t for t in times[mode]]
        ratios = [b / t for b, t in zip(base, times[mode], strict=True)] if base else []
        rows.append([mode, median(rates), min(rates), max(rates), median(ratios) if ratios else float("nan"),
                     median([1e6 * c / args.spans for c in cpus[mode]])])
    print()
    print(table(["mode", "median spans/s", "min", "max", "rate ratio vs decode", "CPU us/span"], rows))
    print(f"\npipeline: {info}")
    print(f"machine: {machine_note()}")
    if "pipeline" in times and base:
        ratio = median([b / t for b, t in zip(base, times["pipeline"], strict=True)])
        print(f"{args.codec}: pipeline / (consume + decode) = {ratio:.2f} (target >= 0.8): "
              f"{'PASS' if ratio >= 0.8 else 'MISS'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
