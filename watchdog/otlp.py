"""OpenTelemetry GenAI spans as inference-log events: the ``otlp_json`` and ``otlp_proto`` codecs.

The OpenTelemetry Collector's Kafka exporter writes one ``ExportTraceServiceRequest`` per message,
as protobuf (``encoding: otlp_proto``) or OTLP/JSON (``otlp_json``). ``decode_otlp`` turns one
such message into events and reasons, with no I/O:

* a span with no ``gen_ai.*`` attribute (an HTTP or database span of the same trace) is skipped;
* a GenAI span becomes one event (``span_to_event``), checked by ``watchdog.events.decode_event``
  exactly like a JSON event; a span that fails gets that reason (``missing_field:route``...);
* a message that is not a trace request at all gets one reason (``otlp_bad_proto``, ``not_json``...).

The ingest sends a message with any rejected span to the dead-letter topic (original bytes, the
first reason) and still folds its good spans in. Span → event mapping (docs/INTEGRATIONS.md):

| event field | from |
| --- | --- |
| request_id | ``gen_ai.response.id``, ``gen_ai.request.id`` (vLLM), else trace id + span id |
| ts | span end time |
| model | ``gen_ai.response.model``, else ``gen_ai.request.model`` |
| route / precision | the configured attribute (span first, then resource; defaults ``llmwd.route`` / ``llmwd.precision``), else the configured default |
| status | span status ERROR → ``error`` (``timeout`` when ``error.type`` mentions a timeout), else ``ok`` |
| latency_ms | ``gen_ai.latency.e2e`` (seconds, vLLM), else end − start |
| ttft_ms | ``gen_ai.latency.time_to_first_token`` (seconds) |
| prompt_tokens / completion_tokens | ``gen_ai.usage.input_tokens`` / ``output_tokens`` (or the older ``prompt_tokens`` / ``completion_tokens``) |
| engine | resource ``service.name``, else ``gen_ai.system`` |
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from watchdog.events import InferenceEvent, InvalidEvent, decode_event

Decoded = tuple[list[InferenceEvent], list[InvalidEvent]]
Decoder = Callable[[bytes, int], Decoded]
CODECS = ("json", "otlp_json", "otlp_proto")
_ERROR = 2  # STATUS_CODE_ERROR


@dataclass(frozen=True)
class OtlpOptions:
    route_attribute: str = "llmwd.route"
    precision_attribute: str = "llmwd.precision"
    #: used when a span carries no route / precision attribute; None: the span is rejected
    default_route: str | None = None
    default_precision: str | None = None
    #: a message larger than this is rejected whole (``too_large``)
    max_message_bytes: int = 16 * 1024 * 1024


# --- the mapping (shared by both encodings) ---------------------------------------------------


def _first(attrs: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        v = attrs.get(n)
        if v is not None:
            return v
    return None


def span_to_event(attrs: Mapping[str, Any], resource: Mapping[str, Any], start_ns: int, end_ns: int,
                  status_code: int, trace_id: str, span_id: str, opts: OtlpOptions) -> dict[str, Any] | None:
    """The event dict for one span (None for a span without ``gen_ai.*`` attributes)."""
    if not any(k.startswith("gen_ai.") for k in attrs):
        return None
    status = "ok"
    if status_code == _ERROR:
        err = str(attrs.get("error.type") or "")
        status = "timeout" if "timeout" in err.lower() else "error"
    e2e = attrs.get("gen_ai.latency.e2e")
    latency = e2e * 1000 if isinstance(e2e, (int, float)) and not isinstance(e2e, bool) \
        else max(0, end_ns - start_ns) / 1e6
    ev: dict[str, Any] = {
        "schema": 1,
        "request_id": _first(attrs, "gen_ai.response.id", "gen_ai.request.id") or f"{trace_id}-{span_id}",
        "ts": end_ns / 1e9,
        "model": _first(attrs, "gen_ai.response.model", "gen_ai.request.model"),
        "route": _first(attrs, opts.route_attribute) or resource.get(opts.route_attribute) or opts.default_route,
        "precision": _first(attrs, opts.precision_attribute) or resource.get(opts.precision_attribute)
        or opts.default_precision,
        "status": status,
        "latency_ms": latency,
        "prompt_tokens": _first(attrs, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"),
        "completion_tokens": _first(attrs, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"),
        "engine": resource.get("service.name") or attrs.get("gen_ai.system"),
        "trace_id": trace_id,
    }
    ttft = attrs.get("gen_ai.latency.time_to_first_token")
    if isinstance(ttft, (int, float)) and not isinstance(ttft, bool):
        ev["ttft_ms"] = ttft * 1000
    if status == "ok":
        ev["completion_tokens"] = ev["completion_tokens"] or 0
    else:
        ev["completion_tokens"] = 0
    return ev


def _validated(events: list[InferenceEvent], errors: list[InvalidEvent], ev: dict[str, Any] | None) -> None:
    if ev is None:
        return
    try:
        events.append(decode_event(orjson.dumps(ev)))
    except InvalidEvent as exc:
        errors.append(exc)
    except TypeError as exc:  # an attribute value orjson cannot write (never from OTLP scalars)
        errors.append(InvalidEvent("bad_type:attribute", str(exc)[:200]))


# --- OTLP/JSON --------------------------------------------------------------------------------


def _json_value(v: Any) -> Any:
    if not isinstance(v, dict):
        return None
    for key, val in v.items():
        if key == "stringValue" or key == "boolValue" or key == "doubleValue":
            return val
        if key == "intValue":  # int64 is a string in OTLP/JSON
            try:
                return int(val)
            except (TypeError, ValueError):
                return None
        if key == "arrayValue":
            return [_json_value(x) for x in (val or {}).get("values", [])]
    return None


def _json_attrs(items: Any) -> dict[str, Any]:
    if not isinstance(items, list):
        return {}
    return {kv["key"]: _json_value(kv.get("value")) for kv in items if isinstance(kv, dict) and "key" in kv}


def _json_id(v: Any) -> str:
    """Hex id: OTLP/JSON writes hex; protobuf's generic JSON mapping writes base64."""
    if not isinstance(v, str) or not v:
        return ""
    if len(v) in (16, 32):
        try:
            int(v, 16)
            return v.lower()
        except ValueError:
            pass
    try:
        return base64.b64decode(v, validate=True).hex()
    except (binascii.Error, ValueError):
        return v


def _json_status(span: dict[str, Any]) -> int:
    code = (span.get("status") or {}).get("code", 0)
    if isinstance(code, str):
        return _ERROR if code.upper().endswith("ERROR") else 0
    return code if isinstance(code, int) else 0


def _json_spans(doc: Any) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for rs in doc.get("resourceSpans") or []:
        if not isinstance(rs, dict):
            raise InvalidEvent("otlp_bad_shape", "resourceSpans holds a non-object")
        resource = _json_attrs((rs.get("resource") or {}).get("attributes"))
        for ss in rs.get("scopeSpans") or []:
            for span in (ss or {}).get("spans") or []:
                if isinstance(span, dict):
                    yield resource, span


def decode_otlp_json(raw: bytes, opts: OtlpOptions = OtlpOptions()) -> Decoded:
    events: list[InferenceEvent] = []
    errors: list[InvalidEvent] = []
    if not raw:
        return events, [InvalidEvent("empty", "message has no value")]
    if len(raw) > opts.max_message_bytes:
        return events, [InvalidEvent("too_large", f"{len(raw)} bytes > limit {opts.max_message_bytes}")]
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return events, [InvalidEvent("not_json", str(exc)[:200])]
    if not isinstance(doc, dict) or "resourceSpans" not in doc:
        return events, [InvalidEvent("otlp_bad_shape", "not an ExportTraceServiceRequest (no resourceSpans)")]
    try:
        for resource, span in _json_spans(doc):
            try:
                start, end = int(span.get("startTimeUnixNano") or 0), int(span.get("endTimeUnixNano") or 0)
            except (TypeError, ValueError):
                errors.append(InvalidEvent("bad_value:ts", "span times are not integers"))
                continue
            ev = span_to_event(_json_attrs(span.get("attributes")), resource, start, end, _json_status(span),
                               _json_id(span.get("traceId")), _json_id(span.get("spanId")), opts)
            _validated(events, errors, ev)
    except InvalidEvent as exc:
        errors.append(exc)
    return events, errors


# --- OTLP protobuf ----------------------------------------------------------------------------


def _pb_value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_pb_value(x) for x in v.array_value.values]
    if which in ("kvlist_value", "bytes_value"):
        return None
    return getattr(v, which)


def _pb_attrs(items: Any) -> dict[str, Any]:
    return {kv.key: _pb_value(kv.value) for kv in items}


def decode_otlp_proto(raw: bytes, opts: OtlpOptions = OtlpOptions()) -> Decoded:
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    events: list[InferenceEvent] = []
    errors: list[InvalidEvent] = []
    if not raw:
        return events, [InvalidEvent("empty", "message has no value")]
    if len(raw) > opts.max_message_bytes:
        return events, [InvalidEvent("too_large", f"{len(raw)} bytes > limit {opts.max_message_bytes}")]
    try:
        req = ExportTraceServiceRequest.FromString(bytes(raw))
    except (DecodeError, ValueError) as exc:
        return events, [InvalidEvent("otlp_bad_proto", str(exc)[:200])]
    if not req.resource_spans:
        return events, [InvalidEvent("otlp_bad_shape", "an ExportTraceServiceRequest without resource spans")]
    for rs in req.resource_spans:
        resource = _pb_attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for span in ss.spans:
                ev = span_to_event(_pb_attrs(span.attributes), resource, span.start_time_unix_nano,
                                   span.end_time_unix_nano, span.status.code, span.trace_id.hex(),
                                   span.span_id.hex(), opts)
                _validated(events, errors, ev)
    return events, errors


# --- codec selection (the ingest's hook) ------------------------------------------------------


def _json_codec(raw: bytes, max_bytes: int) -> Decoded:
    try:
        return [decode_event(raw, max_bytes)], []
    except InvalidEvent as exc:
        return [], [exc]


def decoder_for(codec: str = "json", options: Mapping[str, Any] | None = None) -> Decoder:
    """``(raw, max_event_bytes) -> (events, reasons)`` for a topic's ``codec``."""
    if codec == "json":
        return _json_codec
    opts = OtlpOptions(**(options or {}))
    if codec == "otlp_json":
        return lambda raw, _max: decode_otlp_json(raw, opts)
    if codec == "otlp_proto":
        import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401 - fail at start-up, not per message

        return lambda raw, _max: decode_otlp_proto(raw, opts)
    raise ValueError(f"unknown codec {codec!r}: one of {', '.join(CODECS)}")
