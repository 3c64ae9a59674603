"""Absurd but well-typed event values are dead-lettered with a named reason, not counted."""

from __future__ import annotations

import json

import pytest

from watchdog.core.events import InvalidEvent, decode_event

BASE = {"schema": 1, "request_id": "r1", "ts": 1_764_000_000.0, "model": "m", "route": "chat", "precision": "fp8",
        "status": "ok", "latency_ms": 120.0, "prompt_tokens": 10, "completion_tokens": 20}


def raw(**fields: object) -> bytes:
    return json.dumps({**BASE, **fields}).encode()


@pytest.mark.parametrize(("fields", "reason"), [
    ({"latency_ms": 1e308}, "out_of_range:latency_ms"),
    ({"latency_ms": 86_400_001}, "out_of_range:latency_ms"),
    ({"ttft_ms": 1e20}, "out_of_range:ttft_ms"),
    ({"shadow": {"precision": "fp16", "completion": "x", "latency_ms": 1e300}}, "out_of_range:shadow.latency_ms"),
    ({"completion_tokens": 2**65}, "out_of_range:completion_tokens"),
    ({"prompt_tokens": 2**40}, "out_of_range:prompt_tokens"),
    ({"ts": "0001-01-01T00:00:00Z"}, "out_of_range:ts"),
    ({"ts": "9999-12-31T23:59:59Z"}, "out_of_range:ts"),
    ({"ts": 253_402_300_799}, "out_of_range:ts"),
    ({"ts": "1969-12-31T23:59:59Z"}, "out_of_range:ts"),
    ({"ts": 4_102_444_800}, "out_of_range:ts"),
    ({"latency_ms": -5.0}, "bad_value:latency_ms"),
    ({"ttft_ms": -1}, "bad_value:ttft_ms"),
    # log-probabilities below the floor are a broken engine's, counted as the worst token:
    # tests/test_broken_engine_events.py
])
def test_absurd_values_rejected_with_reason(fields: dict[str, object], reason: str) -> None:
    with pytest.raises(InvalidEvent) as exc:
        decode_event(raw(**fields))
    assert exc.value.reason == reason


@pytest.mark.parametrize("text", ['"latency_ms": NaN', '"latency_ms": Infinity', '"latency_ms": 1e999',
                                  '"ts": -Infinity'])
def test_non_finite_json_rejected(text: str) -> None:
    body = json.dumps(BASE)[:-1] + ", " + text + "}"
    with pytest.raises(InvalidEvent) as exc:
        decode_event(body.encode())
    assert exc.value.reason in ("not_json", "bad_value:latency_ms", "bad_value:ts")


def test_edges_still_accepted_and_routes_nfkc() -> None:
    ev = decode_event(raw(latency_ms=86_400_000.0, completion_tokens=1_000_000_000, ts="2099-12-31T23:59:59Z",
                          completion_logprobs=[-9999.0, 0.0], route="\uff43\uff48\uff41\uff54", model="m"))
    assert ev.latency_ms == 86_400_000.0 and ev.completion_tokens == 1_000_000_000
    assert ev.route == "chat"  # fullwidth letters: NFKC, as policy scopes are


@pytest.mark.parametrize(("fields", "reason", "says"), [
    ({"route": "r" * 201}, "out_of_range:route", "201 characters long (at most 200)"),
    ({"model": "m" * 5000}, "out_of_range:model", "5000 characters long"),
    ({"route": "tenant a"}, "bad_value:route", "a space or control character"),
    ({"route": "a\tb"}, "bad_value:route", "control"),
    ({"model": "m\x00"}, "bad_value:model", "control"),
    ({"route": "a\u200bb"}, "bad_value:route", "U+200B (ZERO WIDTH SPACE)"),
    ({"route": "a\u00a0b"}, "bad_value:route", "a space"),  # NFKC makes the no-break space a space
    ({"model": "m\u202eevil"}, "bad_value:model", "RIGHT-TO-LEFT OVERRIDE"),
    ({"route": "\ue000"}, "bad_value:route", "U+E000"),  # private use
    ({"route": "\uff43" * 201}, "out_of_range:route", "201 characters"),  # long after NFKC too
])
def test_bad_names_are_dead_letters_with_a_reason(fields: dict[str, object], reason: str, says: str) -> None:
    with pytest.raises(InvalidEvent) as exc:
        decode_event(raw(**fields))
    assert exc.value.reason == reason
    assert says in exc.value.message


@pytest.mark.parametrize("name", ["r" * 200, "legal/contracts", "llama3:8b", "a.b-c_d~!@#$%^&*()", "法务/合同",
                                  "équipe-ventes", "x"])
def test_good_names_pass(name: str) -> None:
    ev = decode_event(raw(model=name, route=name))
    assert (ev.model, ev.route) == (name, name)
