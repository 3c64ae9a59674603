"""The inference-event contract: decoding, validation reasons, encoding."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from watchdog.core.events import (
    InferenceEvent,
    InvalidEvent,
    ShadowResult,
    decode_event,
    encode_event,
    event_to_dict,
)


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "request_id": "r-1",
        "ts": 1764400000.5,
        "model": "llama-3-8b",
        "route": "tenant-a",
        "precision": "fp8",
        "status": "ok",
        "latency_ms": 120.5,
    }
    for k, v in over.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()


def raw(**over: Any) -> bytes:
    return orjson.dumps(base(**over))


def test_minimal_event_defaults() -> None:
    e = decode_event(raw())
    assert e == InferenceEvent(
        request_id="r-1", ts=1764400000.5, model="llama-3-8b", route="tenant-a", precision="fp8",
        status="ok", latency_ms=120.5,
    )
    assert e.prompt_tokens == 0 and e.completion_tokens == 0 and e.schema == 1
    assert e.shadow is None and e.extra == {}


def test_full_event() -> None:
    d = base(
        schema=1, engine="vllm", gpu_uuid="GPU-1", ttft_ms=30, prompt_tokens=12, completion_tokens=5,
        prompt="hi", completion="hello there", completion_logprobs=[-0.5, -0.25, 0],
        shadow={"precision": "FP16", "completion": "hello there", "completion_logprobs": [-0.1], "latency_ms": 200},
        region="eu-west-1", trace={"id": 7},
    )
    e = decode_event(orjson.dumps(d))
    assert (e.engine, e.gpu_uuid, e.ttft_ms, e.prompt_tokens, e.completion_tokens) == ("vllm", "GPU-1", 30.0, 12, 5)
    assert e.completion == "hello there" and e.completion_logprobs == [-0.5, -0.25, 0]
    assert e.shadow == ShadowResult(precision="fp16", completion="hello there", completion_logprobs=[-0.1], latency_ms=200.0)
    assert e.extra == {"region": "eu-west-1", "trace": {"id": 7}}
    assert isinstance(e.latency_ms, float) and isinstance(e.ttft_ms, float)


@pytest.mark.parametrize(
    ("over", "field", "expected"),
    [
        ({"ts": "2025-11-29T10:00:00Z"}, "ts", 1764410400.0),
        ({"ts": "2025-11-29T11:00:00.250+01:00"}, "ts", 1764410400.25),
        ({"ts": 1764410400}, "ts", 1764410400.0),
        ({"ts": "2025-11-29t10:00:00.5z"}, "ts", 1764410400.5),
        ({"ts": "2025-11-29T10:00:00.123456789Z"}, "ts", 1764410400.123456),
        ({"precision": "BF16"}, "precision", "bf16"),
        ({"status": "Timeout"}, "status", "timeout"),
        ({"latency_ms": 0}, "latency_ms", 0.0),
        ({"completion_tokens": 7.0}, "completion_tokens", 7),
        ({"completion_logprobs": [-0.1, 3e-7]}, "completion_logprobs", [-0.1, 0.0]),
        ({"completion_logprobs": []}, "completion_logprobs", []),
        ({"engine": None}, "engine", None),
        ({"completion": ""}, "completion", ""),
    ],
)
def test_accepted_values(over: dict[str, Any], field: str, expected: Any) -> None:
    assert getattr(decode_event(raw(**over)), field) == expected


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "empty"),
        (None, "empty"),
        (b"\xff\xfe{}", "bad_utf8"),
        (b'{"request_id": "\xc3\x28"}', "bad_utf8"),
        (b"{not json", "not_json"),
        (b'{"latency_ms": NaN}', "missing_field:status"),  # NaN is read (Python writes it), then checked
        (b'{"latency_ms": NaN', "not_json"),
        (b"[1, 2]", "not_object"),
        (b'"text"', "not_object"),
        (raw(route=_DROP), "missing_field:route"),
        (raw(route=None), "missing_field:route"),
        (raw(request_id=_DROP), "missing_field:request_id"),
        (raw(ts=_DROP), "missing_field:ts"),
        (raw(model=_DROP), "missing_field:model"),
        (raw(precision=_DROP), "missing_field:precision"),
        (raw(status=_DROP), "missing_field:status"),
        (raw(latency_ms=_DROP), "missing_field:latency_ms"),
        (raw(latency_ms="12"), "bad_type:latency_ms"),
        (raw(latency_ms=True), "bad_type:latency_ms"),
        (raw(latency_ms=-1), "bad_value:latency_ms"),
        (raw(latency_ms=-0.5), "bad_value:latency_ms"),
        (raw(ttft_ms="x"), "bad_type:ttft_ms"),
        (raw(status="weird"), "bad_value:status"),
        (raw(status=1), "bad_type:status"),
        (raw(model=3), "bad_type:model"),
        (raw(request_id=""), "bad_value:request_id"),
        (raw(ts="yesterday"), "bad_value:ts"),
        (raw(ts="2025-11-29T10:00:00"), "bad_value:ts"),
        (raw(ts=-5), "bad_value:ts"),
        (raw(ts=[1]), "bad_type:ts"),
        (raw(prompt_tokens=-1), "bad_value:prompt_tokens"),
        (raw(completion_tokens=1.5), "bad_type:completion_tokens"),
        (raw(completion_tokens="3"), "bad_type:completion_tokens"),
        (raw(completion=5), "bad_type:completion"),
        (raw(engine=5), "bad_type:engine"),
        (raw(completion_logprobs=[-0.1, 0.5]), "bad_value:completion_logprobs"),
        (raw(completion_logprobs=[-0.1, 1]), "bad_value:completion_logprobs"),
        (raw(completion_logprobs=[-0.1, "x"]), "bad_type:completion_logprobs"),
        (raw(completion_logprobs=[False, -0.1]), "bad_type:completion_logprobs"),
        (raw(completion_logprobs=[[-0.1]]), "bad_type:completion_logprobs"),
        (raw(completion_logprobs=-0.1), "bad_type:completion_logprobs"),
        (raw(shadow="fp16"), "bad_type:shadow"),
        (raw(shadow={"completion": 3}), "bad_type:shadow.completion"),
        (raw(shadow={"latency_ms": -3}), "bad_value:shadow.latency_ms"),
        (raw(shadow={"completion_logprobs": [2.0]}), "bad_value:shadow.completion_logprobs"),
        (raw(schema=2), "unsupported_schema"),
        (raw(schema=True), "unsupported_schema"),
    ],
)
def test_invalid_events_give_reason(payload: bytes | None, reason: str) -> None:
    with pytest.raises(InvalidEvent) as info:
        decode_event(payload)  # type: ignore[arg-type]
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError) and info.value.message


def test_too_large() -> None:
    payload = raw(prompt="x" * 2000)
    with pytest.raises(InvalidEvent) as info:
        decode_event(payload, max_bytes=1000)
    assert info.value.reason == "too_large"
    assert decode_event(payload, max_bytes=len(payload)).prompt == "x" * 2000


def test_accepts_bytearray_and_memoryview() -> None:
    payload = raw()
    assert decode_event(bytearray(payload)) == decode_event(memoryview(payload)) == decode_event(payload)


def test_encode_round_trip() -> None:
    e = decode_event(raw(completion="ok", completion_logprobs=[-1.0], shadow={"completion": "ok"}, zone="b"))
    data = encode_event(e)
    assert decode_event(data) == e
    d = json.loads(data)
    assert d["zone"] == "b" and "engine" not in d and d["shadow"] == {"completion": "ok"}


def test_extra_cannot_override_known_fields() -> None:
    e = decode_event(raw())
    e.extra = {"route": "evil", "note": 1}
    assert event_to_dict(e)["route"] == "tenant-a" and event_to_dict(e)["note"] == 1


def test_encode_dict_as_given_and_rejects_other_types() -> None:
    assert orjson.loads(encode_event({"anything": [1, 2]})) == {"anything": [1, 2]}
    with pytest.raises(TypeError):
        encode_event("nope")  # type: ignore[arg-type]


def test_replica_and_build_are_optional_strings() -> None:
    e = decode_event(orjson.dumps({"request_id": "a", "ts": 1.0, "model": "m", "route": "r", "precision": "fp8",
                                   "status": "ok", "latency_ms": 1.0, "replica": "pod-3", "build": "vllm-0.6.3+rev9"}))
    assert (e.replica, e.build) == ("pod-3", "vllm-0.6.3+rev9")
    assert e.extra == {}
    d = event_to_dict(e)
    assert d["replica"] == "pod-3" and d["build"] == "vllm-0.6.3+rev9"
    for name in ("replica", "build"):
        with pytest.raises(InvalidEvent) as exc:
            decode_event(orjson.dumps({"request_id": "a", "ts": 1.0, "model": "m", "route": "r", "precision": "fp8",
                                       "status": "ok", "latency_ms": 1.0, name: 5}))
        assert exc.value.reason == f"bad_type:{name}"
