"""OpenTelemetry GenAI spans as inference-log events: the ``otlp_proto`` and ``otlp_json`` codecs.

The OpenTelemetry Collector's Kafka exporter writes one ``ExportTraceServiceRequest`` per Kafka
record, as protobuf (``encoding: otlp_proto``) or OTLP/JSON (``otlp_json``). ``OtlpDecoder`` turns
one record into ``(events, rejected)`` with no I/O:

* a span without any ``gen_ai.*`` attribute (an HTTP or database span of the same trace) is skipped
  and counted in ``skipped``;
* a GenAI span is mapped to an event dict and checked by ``watchdog.core.events.decode_event``, exactly
  like a JSON event, so the same reasons come out (``missing_field:route``, ``bad_value:latency_ms``);
* a rejected span becomes a ``RejectedSpan`` whose ``value`` is that one span (with its resource and
  scope) encoded as the topic's codec, so the dead letter can be read and replayed on its own; a
  record that is not a trace request at all is rejected whole with its original bytes.

All events of one record carry that record's offset, so the windows hold the record back from the
commit until every event of it is in a closed window. The mapping is documented in
docs/INTEGRATIONS_otlp_litellm.md.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import orjson

from watchdog.config.settings import CODECS, OtlpOptions
from watchdog.core.events import InferenceEvent, InvalidEvent, decode_event

_STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
#: ``error.type`` (the exception class an instrumentation names, e.g. opentelemetry-instrumentation-openai-v2;
#: last dotted part, lower case) of failures that say nothing about the precision (docs/EVENTS.md, "not judged")
_NOT_JUDGED_ERRORS = {
    "ratelimiterror": "rate_limited", "cancellederror": "cancelled", "badrequesterror": "client_error",
    "authenticationerror": "client_error", "permissiondeniederror": "client_error", "notfounderror": "client_error",
    "conflicterror": "client_error", "unprocessableentityerror": "client_error",
}


class RejectedSpan(InvalidEvent):
    """A span (or a whole record) that cannot become an event; ``value`` is what the DLQ stores."""

    def __init__(self, reason: str, message: str, value: bytes) -> None:
        super().__init__(reason, message)
        self.value = value


Decoded = tuple[list[InferenceEvent], list[RejectedSpan]]
RecordDecoder = Callable[[bytes, int], Decoded]


# --- the mapping, shared by both encodings ----------------------------------------------------

def _pick(names: Iterable[str], attrs: Mapping[str, Any], resource: Mapping[str, Any]) -> Any:
    for name in names:
        v = attrs.get(name)
        if v is None:
            v = resource.get(name)
        if v is not None and v != "":
            return v
    return None


def _seconds_to_ms(v: Any) -> Any:
    """vLLM writes latencies in seconds (float); anything else is passed on for the validator to name."""
    if type(v) is float or type(v) is int:
        return v * 1000.0
    return v


#: the span attributes the mapping reads; only these are extracted from the wire (a span carries many)
_GENAI_KEYS = frozenset({
    "gen_ai.response.model", "gen_ai.request.model", "gen_ai.response.finish_reasons", "gen_ai.latency.e2e",
    "gen_ai.response.id", "gen_ai.request.id", "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens", "gen_ai.system", "gen_ai.provider.name",
    "gen_ai.latency.time_to_first_token", "gen_ai.operation.name",
})


class _Mapper:
    def __init__(self, opts: OtlpOptions) -> None:
        self.opts = opts
        #: a span holding none of these is not a GenAI span
        self.genai_keys = _GENAI_KEYS
        self.span_keys = _GENAI_KEYS | {"error.type", "http.response.status_code", *opts.route_attributes,
                                       *opts.precision_attributes, *opts.replica_attributes}
        self.resource_keys = frozenset({"service.name", *opts.route_attributes, *opts.precision_attributes,
                                        *opts.replica_attributes})
        self._exact = {k: v for k, v in opts.model_precisions.items() if not _is_pattern(k)}
        self._patterns = [(re.compile(fnmatch.translate(k)), v) for k, v in opts.model_precisions.items()
                          if _is_pattern(k)]
        self._by_model: dict[str, str | None] = {}

    def precision_for_model(self, model: Any) -> str | None:
        if type(model) is not str:
            return None
        hit = self._exact.get(model)
        if hit is not None or not self._patterns:
            return hit
        if model in self._by_model:
            return self._by_model[model]
        hit = next((p for rx, p in self._patterns if rx.match(model)), None)
        if len(self._by_model) < 4096:  # bounded: model names come from the wire
            self._by_model[model] = hit
        return hit

    def event(self, attrs: Mapping[str, Any], resource: Mapping[str, Any], start_ns: int, end_ns: int,
              status_code: int, status_message: str, trace_id: str, span_id: str) -> dict[str, Any] | None:
        """The event dict for one span (its ``span_keys`` attributes); None for a non-GenAI span."""
        if self.genai_keys.isdisjoint(attrs):
            return None
        opts = self.opts
        get = attrs.get
        model = get("gen_ai.response.model") or get("gen_ai.request.model")
        status = "ok"
        finish = _finish_reasons(get("gen_ai.response.finish_reasons"))
        if status_code == _STATUS_ERROR or "error" in finish:
            status = _failure_status(get("error.type"), get("http.response.status_code"), status_message)
        elif "abort" in finish:  # vLLM's FinishReason.ABORT: aborted by the client, not judged
            status = "cancelled"
        e2e = get("gen_ai.latency.e2e")
        ev: dict[str, Any] = {
            "schema": 1,
            "request_id": get("gen_ai.response.id") or get("gen_ai.request.id") or f"{trace_id}-{span_id}",
            "ts": end_ns / 1e9 if end_ns > 0 else None,  # no end time: missing_field:ts
            "model": model,
            "route": _pick(opts.route_attributes, attrs, resource) or opts.default_route,
            "precision": _pick(opts.precision_attributes, attrs, resource)
            or self.precision_for_model(model) or opts.default_precision,
            "status": status,
            # start > end is a broken span: negative, rejected as bad_value:latency_ms like a JSON event
            "latency_ms": _seconds_to_ms(e2e) if e2e is not None else (end_ns - start_ns) / 1e6 if end_ns > 0 else 0.0,
            "prompt_tokens": _or(get("gen_ai.usage.input_tokens"), get("gen_ai.usage.prompt_tokens")),
            "completion_tokens": _or(get("gen_ai.usage.output_tokens"), get("gen_ai.usage.completion_tokens")),
            "engine": resource.get("service.name") or get("gen_ai.system") or get("gen_ai.provider.name"),
            "trace_id": trace_id,
            "span_id": span_id,
        }
        replica = _pick(opts.replica_attributes, attrs, resource)
        if type(replica) is str:
            ev["replica"] = replica
        ttft = get("gen_ai.latency.time_to_first_token")
        if ttft is not None:
            ev["ttft_ms"] = _seconds_to_ms(ttft)
        return ev


def _finish_reasons(v: Any) -> list[Any]:
    """``gen_ai.response.finish_reasons``: a string array (semconv, vLLM), or that array JSON-encoded in
    one string (SGLang); anything else: none."""
    if type(v) is str and v.startswith("["):
        try:
            v = orjson.loads(v)
        except orjson.JSONDecodeError:
            return []
    return v if type(v) is list else []


def _failure_status(error_type: Any, http_status: Any, message: str) -> str:
    """The event status of a failed span, as the gateway and the LiteLLM hook decide it: HTTP 429
    ``rate_limited``, another 4xx but 408 ``client_error``, a cancelled call ``cancelled`` (none of them
    judged), else ``timeout`` when the error says so, else ``error``."""
    if type(http_status) is not int and type(error_type) is str and error_type.isdigit():
        http_status = int(error_type)  # HTTP semconv: error.type is the status code
    if type(http_status) is int and 400 <= http_status < 500 and http_status != 408:
        return "rate_limited" if http_status == 429 else "client_error"
    if type(error_type) is str:
        hit = _NOT_JUDGED_ERRORS.get(error_type.rsplit(".", 1)[-1].lower())
        if hit is not None:
            return hit
    err = f"{error_type or ''} {message}".lower()
    return "timeout" if "timeout" in err or "timed out" in err else "error"


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _or(a: Any, b: Any) -> Any:
    """The first that is set (0 is a value), else 0: a missing count is 0 in the event contract."""
    return a if a is not None else (b if b is not None else 0)


def _check(ev: dict[str, Any]) -> InferenceEvent:
    """The shared validator: the same checks and reasons as a JSON event."""
    try:
        raw = orjson.dumps(ev)
    except TypeError as exc:  # never from OTLP scalars, but the wire is hostile
        raise InvalidEvent("bad_type:attribute", str(exc)[:200]) from None
    return decode_event(raw)


# --- OTLP/JSON --------------------------------------------------------------------------------

def _json_value(v: Any) -> Any:
    if type(v) is not dict:
        return None
    for key, val in v.items():
        if key in ("stringValue", "boolValue", "doubleValue"):
            return val
        if key == "intValue":  # int64 is a decimal string in OTLP/JSON (a number is accepted too)
            try:
                return int(val)
            except (TypeError, ValueError):
                return val
        if key == "arrayValue":
            return [_json_value(x) for x in (val or {}).get("values") or []]
    return None


def _json_attrs(items: Any, keys: frozenset[str]) -> dict[str, Any]:
    if type(items) is not list:
        return {}
    return {k: _json_value(kv.get("value")) for kv in items if type(kv) is dict and (k := kv.get("key")) in keys}


def _json_id(v: Any) -> str:
    """Hex id: OTLP/JSON (the Collector) writes hex; protobuf's generic JSON mapping writes base64."""
    if type(v) is not str or not v:
        return ""
    if len(v) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in v):
        return v.lower()
    try:
        return base64.b64decode(v, validate=True).hex()
    except (binascii.Error, ValueError):
        return v[:64]


def _json_nanos(v: Any) -> int:
    if v is None:
        return 0
    if type(v) is bool:
        raise ValueError("boolean time")
    return int(v)


def _json_status(span: dict[str, Any]) -> tuple[int, str]:
    st = span.get("status")
    if type(st) is not dict:
        return 0, ""
    code = st.get("code", 0)
    if type(code) is str:
        code = _STATUS_ERROR if code.upper().endswith("ERROR") else 0
    return (code if type(code) is int else 0), str(st.get("message") or "")


# --- the decoder ------------------------------------------------------------------------------

class OtlpDecoder:
    """``decoder(raw, max_event_bytes) -> (events, rejected)`` for one Kafka record."""

    def __init__(self, encoding: Literal["otlp_json", "otlp_proto"], options: OtlpOptions | None = None) -> None:
        if encoding not in ("otlp_json", "otlp_proto"):
            raise ValueError(f"unknown OTLP encoding {encoding!r}: otlp_json or otlp_proto")
        self.encoding = encoding
        self.options = options or OtlpOptions()
        self._map = _Mapper(self.options)
        #: spans without gen_ai.* attributes, passed over
        self.skipped = 0
        if encoding == "otlp_proto":
            # imported here so a JSON-only daemon never needs protobuf, and a missing package fails at
            # start-up rather than on the first record
            from google.protobuf.message import DecodeError
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

            self._request_type: Any = ExportTraceServiceRequest
            self._decode_error: Any = DecodeError

    def __call__(self, raw: bytes, max_event_bytes: int = 0) -> Decoded:
        # max_event_bytes bounds one JSON event; a record here is a batch, bounded by max_record_bytes
        if not raw:
            return [], [RejectedSpan("empty", "message has no value", b"")]
        if len(raw) > self.options.max_record_bytes:
            return [], [RejectedSpan("too_large", f"{len(raw)} bytes > limit {self.options.max_record_bytes}",
                                     bytes(raw))]
        if self.encoding == "otlp_proto":
            return self._proto(bytes(raw))
        return self._json(bytes(raw))

    def _keep(self, ev: dict[str, Any] | None, events: list[InferenceEvent], rejected: list[RejectedSpan],
              one_span: Callable[..., bytes], *parts: Any) -> None:
        if ev is None:
            self.skipped += 1
            return
        try:
            events.append(_check(ev))
        except InvalidEvent as exc:
            rejected.append(RejectedSpan(exc.reason, exc.message, one_span(*parts)))

    def _json(self, raw: bytes) -> Decoded:
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return [], [RejectedSpan("not_json", str(exc)[:200], raw)]
        if type(doc) is not dict or type(doc.get("resourceSpans")) is not list:
            return [], [RejectedSpan("otlp_bad_shape", "not an ExportTraceServiceRequest (no resourceSpans list)",
                                     raw)]
        events: list[InferenceEvent] = []
        rejected: list[RejectedSpan] = []
        span_keys = self._map.span_keys
        for rs in doc["resourceSpans"]:
            if type(rs) is not dict:
                rejected.append(RejectedSpan("otlp_bad_shape", "resourceSpans holds a non-object", orjson.dumps(rs)))
                continue
            res_obj: dict[str, Any] = rs["resource"] if type(rs.get("resource")) is dict else {}
            resource = _json_attrs(res_obj.get("attributes"), self._map.resource_keys)
            for ss in rs.get("scopeSpans") or []:
                if type(ss) is not dict:
                    continue
                for span in ss.get("spans") or []:
                    if type(span) is not dict:
                        continue
                    try:
                        start = _json_nanos(span.get("startTimeUnixNano"))
                        end = _json_nanos(span.get("endTimeUnixNano"))
                    except (TypeError, ValueError):
                        rejected.append(RejectedSpan("bad_value:ts", "span times are not integers",
                                                     _json_one_span(res_obj, ss, span)))
                        continue
                    code, message = _json_status(span)
                    ev = self._map.event(_json_attrs(span.get("attributes"), span_keys), resource, start, end, code, message,
                                         _json_id(span.get("traceId")), _json_id(span.get("spanId")))
                    self._keep(ev, events, rejected, _json_one_span, res_obj, ss, span)
        return events, rejected

    def _proto(self, raw: bytes) -> Decoded:
        try:
            req = self._request_type.FromString(raw)
        except (self._decode_error, ValueError) as exc:
            return [], [RejectedSpan("otlp_bad_proto", str(exc)[:200], raw)]
        if not req.resource_spans:
            return [], [RejectedSpan("otlp_bad_shape", "an ExportTraceServiceRequest without resource spans", raw)]
        events: list[InferenceEvent] = []
        rejected: list[RejectedSpan] = []
        span_keys = self._map.span_keys
        for rs in req.resource_spans:
            resource = _pb_attrs(rs.resource.attributes, self._map.resource_keys)
            for ss in rs.scope_spans:
                for span in ss.spans:
                    st = span.status
                    ev = self._map.event(_pb_attrs(span.attributes, span_keys), resource, span.start_time_unix_nano,
                                         span.end_time_unix_nano, st.code, st.message, span.trace_id.hex(),
                                         span.span_id.hex())
                    self._keep(ev, events, rejected, self._proto_one_span, rs, ss, span)
        return events, rejected

    def _proto_one_span(self, rs: Any, ss: Any, span: Any) -> bytes:
        out = self._request_type()
        part = out.resource_spans.add()
        part.resource.CopyFrom(rs.resource)
        part.schema_url = rs.schema_url
        scope = part.scope_spans.add()
        scope.scope.CopyFrom(ss.scope)
        scope.spans.add().CopyFrom(span)
        return bytes(out.SerializeToString())


def _json_one_span(resource: Any, ss: dict[str, Any], span: Any) -> bytes:
    scope = {"scope": ss["scope"]} if "scope" in ss else {}
    return orjson.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [{**scope, "spans": [span]}]}]})


def _pb_value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which is None or which in ("kvlist_value", "bytes_value"):
        return None
    if which == "array_value":
        return [_pb_value(x) for x in v.array_value.values]
    return getattr(v, which)


def _pb_attrs(items: Any, keys: frozenset[str]) -> dict[str, Any]:
    return {k: _pb_value(kv.value) for kv in items if (k := kv.key) in keys}


def decoder_for(codec: str, options: OtlpOptions | Mapping[str, Any] | None = None) -> RecordDecoder | None:
    """The ingest's hook: None for plain JSON events (the ingest's own fast path), else an OTLP decoder."""
    if codec == "json":
        return None
    if codec in ("otlp_json", "otlp_proto"):
        opts = options if isinstance(options, OtlpOptions) else OtlpOptions(**(options or {}))
        return OtlpDecoder(codec, opts)  # type: ignore[arg-type]
    raise ValueError(f"unknown codec {codec!r}: one of {', '.join(CODECS)}")


__all__ = ["OtlpDecoder", "RecordDecoder", "RejectedSpan", "decoder_for"]
