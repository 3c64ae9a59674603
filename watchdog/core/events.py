"""The inference-log event contract: one JSON object per served request.

``decode_event`` turns the raw bytes of one Kafka message into an ``InferenceEvent`` or raises
``InvalidEvent`` with a short machine-readable ``reason`` (the ingest sends such messages to the
dead-letter topic with that reason). It sits on the ingest hot path, so validation is hand-written
(a few microseconds per event) rather than a pydantic model. See docs/EVENTS.md for the contract.
"""

from __future__ import annotations

import json
import logging
import math
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

try:
    import orjson

    _loads = orjson.loads
    _JSONError: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
    #: orjson rejects NaN, Infinity and out-of-range numbers such as 1e999: every float it returns is finite
    _FINITE_FLOATS = True

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - orjson is a declared dependency
    def _reject_constant(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    def _loads(raw: Any) -> Any:
        return json.loads(raw, parse_constant=_reject_constant)

    _JSONError = (ValueError,)
    _FINITE_FLOATS = False  # json.loads turns 1e999 into inf

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


log = logging.getLogger(__name__)

#: The schema version this module decodes and encodes.
SCHEMA_VERSION = 1
#: Default cap on the size of one raw event (bytes).
MAX_EVENT_BYTES = 1_048_576
STATUSES = frozenset({"ok", "error", "timeout", "cancelled", "client_error", "rate_limited"})
#: statuses that say nothing about the precision that served the request: the client went away
#: (``cancelled``), sent a bad request (``client_error``) or was throttled (``rate_limited``). The
#: windows count them apart (``not_judged``), never as errors and never in ``samples``
NOT_JUDGED = frozenset({"cancelled", "client_error", "rate_limited"})
#: Engines report logprobs through float32; tiny positive values are rounding noise, clamped to 0.
_LOGPROB_TOLERANCE = 1e-4
_NEG_INF = -math.inf
_NUMBER_TYPES = frozenset({float, int})
#: Absurd but well-typed values are refused with reason ``out_of_range:<field>``:
#: event time must fall in [1970-01-01, 2100-01-01) (year 0001 or 9999 is a broken clock; how far
#: from *now* an event may be is the ingest's max_future / allowed lateness, not decided here)
TS_MIN = 0.0
TS_MAX = 4_102_444_800.0
#: one request lasting more than a day (latency_ms, ttft_ms, shadow.latency_ms)
MAX_DURATION_MS = 86_400_000.0
#: token counts beyond a billion
MAX_TOKENS = 1_000_000_000
#: a log-probability below this is not one an engine reports (exp(-1e4) underflows to 0)
MIN_LOGPROB = -1e4
#: the longest model or route name (characters) that ``name_problem`` (and so ``decode_event``) accepts
MAX_NAME_CHARS = 200
#: names ``name_problem`` accepted, as sent -> as kept (NFKC): most events repeat a few names, so
#: checking each name once keeps the check off the hot path; at most ``_NAMES_MAX`` are remembered
_NAMES: dict[str, str] = {}
_NAMES_MAX = 4096

_KNOWN_FIELDS = frozenset(
    {
        "schema", "request_id", "ts", "model", "route", "precision", "engine", "gpu_uuid", "status",
        "latency_ms", "ttft_ms", "prompt_tokens", "completion_tokens", "prompt", "completion",
        "completion_logprobs", "shadow", "replica", "build",
    }
)


class InvalidEvent(ValueError):
    """An event that breaks the contract. ``reason`` is a short code, e.g. ``missing_field:route``."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message or reason


@dataclass(slots=True)
class ShadowResult:
    """The same request mirrored to the other precision (e.g. an FP8 request replayed on FP16)."""

    precision: str | None = None
    completion: str | None = None
    completion_logprobs: list[float] | None = None
    latency_ms: float | None = None


@dataclass(slots=True)
class InferenceEvent:
    """One served request, as logged by the gateway/serving engine."""

    request_id: str
    ts: float
    model: str
    route: str
    precision: str
    status: str
    latency_ms: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    schema: int = SCHEMA_VERSION
    engine: str | None = None
    gpu_uuid: str | None = None
    ttft_ms: float | None = None
    prompt: str | None = None
    completion: str | None = None
    completion_logprobs: list[float] | None = None
    shadow: ShadowResult | None = None
    #: the serving instance that answered (pod name, host:port); windows keep per-replica latency
    #: so that one stalled replica cannot speak for its precision (docs/EVENTS.md). Optional
    replica: str | None = None
    #: the serving build that answered (engine version + model revision + image digest, as the
    #: producer spells it); a change is a deploy, judged only after both precisions settled. Optional
    build: str | None = None
    #: fields this version does not know, kept as they came
    extra: dict[str, Any] = field(default_factory=dict)


# --- field checks (hand-written: they run once per event on the ingest hot path) -------------


def _missing(name: str) -> InvalidEvent:
    return InvalidEvent(f"missing_field:{name}", f"required field {name!r} is missing or null")


def _bad_type(name: str, want: str, got: Any) -> InvalidEvent:
    return InvalidEvent(f"bad_type:{name}", f"{name} must be {want}, got {type(got).__name__}")


def _bad_value(name: str, message: str) -> InvalidEvent:
    return InvalidEvent(f"bad_value:{name}", message)


def _out_of_range(name: str, message: str) -> InvalidEvent:
    return InvalidEvent(f"out_of_range:{name}", message)


def _req_str(d: dict[str, Any], name: str) -> str:
    v = d.get(name)
    if type(v) is str:
        if v:
            return v
        raise _bad_value(name, f"{name} must not be empty")
    if v is None:
        raise _missing(name)
    raise _bad_type(name, "a string", v)


def _opt_str(d: dict[str, Any], name: str) -> str | None:
    v = d.get(name)
    if v is None or type(v) is str:
        return v
    raise _bad_type(name, "a string", v)


def _number(v: Any, name: str) -> float:
    """A duration in ms: a finite number in [0, MAX_DURATION_MS] (bools are not numbers here)."""
    t = type(v)
    if t is float:
        if not (v >= 0.0 and v != math.inf):  # also false for NaN
            raise _bad_value(name, f"{name} must be a finite number >= 0, got {v!r}")
    elif t is int:
        if v < 0:
            raise _bad_value(name, f"{name} must be >= 0, got {v!r}")
    else:
        raise _bad_type(name, "a number", v)
    if v > MAX_DURATION_MS:
        raise _out_of_range(name, f"{name} = {v:.3g} is more than a day ({MAX_DURATION_MS:.0f} ms)")
    return float(v)


def _opt_number(d: dict[str, Any], name: str) -> float | None:
    v = d.get(name)
    return None if v is None else _number(v, name)


def _count(d: dict[str, Any], name: str) -> int:
    v = d.get(name)
    if v is None:
        return 0
    if type(v) is int:
        if v < 0:
            raise _bad_value(name, f"{name} must be >= 0, got {v}")
    elif type(v) is float and v.is_integer() and v >= 0:  # 12.0 from some JSON writers
        v = int(v)
    else:
        raise _bad_type(name, "a non-negative integer", v)
    if v > MAX_TOKENS:
        raise _out_of_range(name, f"{name} = {v:.3g} is more than {MAX_TOKENS:,}")
    return v


def _timestamp(v: Any) -> float:
    ts = _timestamp_value(v)
    if not TS_MIN <= ts < TS_MAX:
        raise _out_of_range("ts", f"ts {ts:.0f} is outside the years 1970-2099 (a broken clock?)")
    return ts


def _timestamp_value(v: Any) -> float:
    t = type(v)
    if t is float or t is int:
        if not (v >= 0 and v != math.inf):
            raise _bad_value("ts", f"ts must be finite unix seconds >= 0, got {v!r}")
        return float(v)
    if t is str:
        try:
            dt = datetime.fromisoformat(v)
        except ValueError:
            try:  # RFC 3339 allows a lower-case 't' and 'z'; fromisoformat does not
                dt = datetime.fromisoformat(v.upper())
            except ValueError:
                raise _bad_value("ts", f"ts is not an RFC 3339 timestamp: {v[:40]!r}") from None
        if dt.tzinfo is None:  # RFC 3339 requires an offset; a naive time is ambiguous
            raise _bad_value("ts", "ts has no UTC offset (RFC 3339 needs 'Z' or '+hh:mm')")
        return dt.timestamp()
    if v is None:
        raise _missing("ts")
    raise _bad_type("ts", "unix seconds or an RFC 3339 string", v)


def _above_floor(v: list[float]) -> bool:
    """Every value >= MIN_LOGPROB, for a list already known to be <= 0: then a sum above the floor
    settles it (sum() is about 4x cheaper than min() in CPython); min() only for long lists. A NaN
    (only from the lenient parse) makes the sum NaN, and the list goes to the careful path."""
    total = sum(v)
    return total >= MIN_LOGPROB or (total == total and min(v) >= MIN_LOGPROB)  # a NaN sum: not settled


def _logprobs(v: Any, name: str) -> list[float] | None:
    if v is None:
        return None
    if type(v) is not list:
        raise _bad_type(name, "a list of numbers", v)
    if not v:
        return v
    # fast path in C: a list of plain numbers (no bools: type() is exact) that are all <= 0 and
    # finite needs no more checks; engines often report exact 0.0 for confident tokens
    if _NUMBER_TYPES.issuperset(map(type, v)) and max(v) <= 0.0 and _above_floor(v):
        return v
    out = v
    for i, x in enumerate(v):
        t = type(x)
        if t is not float and t is not int:
            raise _bad_type(name, "a list of numbers", x)
        if MIN_LOGPROB <= x <= 0.0:
            continue
        if x < MIN_LOGPROB or x != x:
            # -inf, NaN or below the floor: what an engine whose logits overflowed reports. Counted
            # as the worst token there is, so a broken engine shows as the worst perplexity instead
            # of vanishing into the dead-letter topic
            fixed = MIN_LOGPROB
        elif t is float and x <= _LOGPROB_TOLERANCE:
            fixed = 0.0  # float32 rounding
        else:
            raise _bad_value(name, f"{name}[{i}] = {x!r} is not a log-probability (must be <= 0)")
        if out is v:  # copy only when something needs normalising
            out = list(v)
        out[i] = fixed
    return out


def _shadow(v: Any) -> ShadowResult | None:
    if v is None:
        return None
    if type(v) is not dict:
        raise _bad_type("shadow", "an object", v)
    precision = _opt_str(v, "precision")
    completion = v.get("completion")
    if completion is not None and type(completion) is not str:
        raise _bad_type("shadow.completion", "a string", completion)
    latency = v.get("latency_ms")
    return ShadowResult(
        precision=precision.lower() if precision else None,
        completion=completion,
        completion_logprobs=_logprobs(v.get("completion_logprobs"), "shadow.completion_logprobs"),
        latency_ms=None if latency is None else _number(latency, "shadow.latency_ms"),
    )


def kept_name(raw: str) -> str:
    """A model or route name in the form events keep it: NFKC (ASCII is already)."""
    return raw if raw.isascii() else unicodedata.normalize("NFKC", raw)


def _checked_name(raw: str, field: str) -> str:
    """``raw`` NFKC-normalised if ``name_problem`` accepts it (remembered in ``_NAMES``); otherwise
    ``out_of_range:<field>`` when too long, ``bad_value:<field>`` for a space, control, invisible or
    unassigned character."""
    name = kept_name(raw)
    why = name_problem(name)
    if why is not None:
        if len(name) > MAX_NAME_CHARS:
            raise _out_of_range(field, f"{field} {why}")
        raise _bad_value(field, f"{field} {name[:40]!r} {why}")
    if len(_NAMES) >= _NAMES_MAX:  # a flood of distinct names: start again (bounded memory)
        _NAMES.clear()
    _NAMES[raw] = name
    return name


def loads_lenient(raw: bytes) -> Any:
    """The JSON that strict parsing refused, read again as Python's ``json.dumps`` writes it by
    default, ``NaN`` and ``Infinity`` included (FastAPI-based engine servers send them when an
    engine's logits overflow); numbers come back as floats, non-finite ones too, so every caller
    must check finiteness. ``ValueError`` when it holds no such literal or is not JSON either."""
    if b"NaN" not in raw and b"Infinity" not in raw:
        raise ValueError("no NaN or Infinity literal")
    return json.loads(raw)


def _parse(raw: Any, max_bytes: int) -> tuple[Any, bool]:
    """The decoded document, and whether every float in it is known to be finite."""
    if raw is None or len(raw) == 0:
        raise InvalidEvent("empty", "message has no value")
    if len(raw) > max_bytes:
        raise InvalidEvent("too_large", f"{len(raw)} bytes > limit {max_bytes}")
    try:
        return _loads(raw), _FINITE_FLOATS
    except _JSONError as exc:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            data = bytes(raw)
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidEvent("bad_utf8", "value is not valid UTF-8") from None
            # a NaN or Infinity literal: every field's own check then names it (a NaN latency is
            # ``bad_value:latency_ms``; a NaN log-probability is the worst token, see _logprobs)
            try:
                return loads_lenient(data), False
            except ValueError:
                pass
        raise InvalidEvent("not_json", str(exc)[:200]) from None


def decode_event(raw: bytes, max_bytes: int = MAX_EVENT_BYTES) -> InferenceEvent:
    """Decode and validate one raw event; raise ``InvalidEvent`` (with ``reason``) if it breaks the contract."""
    d, finite = _parse(raw, max_bytes)
    if type(d) is not dict:
        raise InvalidEvent("not_object", f"top-level JSON value is a {type(d).__name__}, not an object")

    schema = d.get("schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION or type(schema) is not int:
        raise InvalidEvent("unsupported_schema", f"schema {schema!r} is not {SCHEMA_VERSION}")

    status = d.get("status")
    if type(status) is str:
        if status not in STATUSES:
            status = status.lower()
            if status not in STATUSES:
                raise _bad_value("status", f"status must be one of {'/'.join(sorted(STATUSES))}, got {d['status'][:40]!r}")
    elif status is None:
        raise _missing("status")
    else:
        raise _bad_type("status", "a string", status)

    latency = d.get("latency_ms")
    if latency is None:
        raise _missing("latency_ms")
    completion = d.get("completion")
    if completion is not None and type(completion) is not str:
        raise _bad_type("completion", "a string", completion)

    # Each field is checked inline for its common valid form and only handed to its helper (which
    # raises the precise error, or normalises an unusual valid form) otherwise: a function call per
    # field costs as much as the rest of the decoding. Fields are checked in the same order as the
    # constructor's arguments, so the first bad field reported does not change.
    get = d.get
    request_id = get("request_id")
    if type(request_id) is not str or not request_id:
        request_id = _req_str(d, "request_id")
    ts = get("ts")
    if not (type(ts) is float and TS_MIN <= ts < TS_MAX):
        ts = _timestamp(ts)
    model = get("model")
    if type(model) is not str or not model:
        model = _req_str(d, "model")
    route = get("route")
    if type(route) is not str or not route:
        route = _req_str(d, "route")
    precision = get("precision")
    if type(precision) is not str or not precision:
        precision = _req_str(d, "precision")
    # names are keys of per-route state, metrics and Redis: NFKC (as policy scopes are,
    # watchdog/policy/names.py), bounded in length and charset (``name_problem``); a name seen
    # before costs one dict lookup
    names = _NAMES
    checked = names.get(model)
    model = checked if checked is not None else _checked_name(model, "model")
    checked = names.get(route)
    route = checked if checked is not None else _checked_name(route, "route")
    if not (type(latency) is float and 0.0 <= latency <= MAX_DURATION_MS):
        latency = _number(latency, "latency_ms")
    prompt_tokens = get("prompt_tokens")
    if type(prompt_tokens) is not int or not 0 <= prompt_tokens <= MAX_TOKENS:
        prompt_tokens = _count(d, "prompt_tokens")
    completion_tokens = get("completion_tokens")
    if type(completion_tokens) is not int or not 0 <= completion_tokens <= MAX_TOKENS:
        completion_tokens = _count(d, "completion_tokens")
    engine = get("engine")
    if engine is not None and type(engine) is not str:
        _opt_str(d, "engine")
    gpu_uuid = get("gpu_uuid")
    if gpu_uuid is not None and type(gpu_uuid) is not str:
        _opt_str(d, "gpu_uuid")
    ttft = get("ttft_ms")
    if ttft is not None and not (type(ttft) is float and 0.0 <= ttft <= MAX_DURATION_MS):
        ttft = _number(ttft, "ttft_ms")
    prompt = get("prompt")
    if prompt is not None and type(prompt) is not str:
        _opt_str(d, "prompt")
    replica = get("replica")
    if replica is not None and type(replica) is not str:
        _opt_str(d, "replica")
    build = get("build")
    if build is not None and type(build) is not str:
        _opt_str(d, "build")
    # Log-probability lists, the bulk of an event: one C-level max() settles the common case.
    # max() raises TypeError for anything not comparable with numbers (str, None, lists,
    # objects); a positive maximum (including True) goes to _logprobs for the precise error or
    # the clamp; orjson yields no NaN or inf (the lenient parse may: then ``finite`` is False). That leaves False, the one non-number max() can
    # miss: it can only come from the JSON literal, so the fast path needs "false" absent.
    plain = finite and type(raw) is bytes and b"false" not in raw
    logprobs = get("completion_logprobs")
    if logprobs is not None:
        try:
            fast = plain and type(logprobs) is list and (not logprobs or (max(logprobs) <= 0.0
                                                                          and _above_floor(logprobs)))
        except TypeError:
            fast = False
        if not fast:
            logprobs = _logprobs(logprobs, "completion_logprobs")
    shadow = get("shadow")
    if shadow is not None:
        fast = False
        if type(shadow) is dict:
            sget = shadow.get
            s_precision: Any = sget("precision")
            s_completion = sget("completion")
            s_logprobs = sget("completion_logprobs")
            s_latency = sget("latency_ms")
            try:
                fast = (type(s_precision) is str and s_precision != "" and type(s_completion) is str
                        and (s_latency is None or (type(s_latency) is float and 0.0 <= s_latency <= MAX_DURATION_MS))
                        and (s_logprobs is None or (plain and type(s_logprobs) is list
                                                    and (not s_logprobs or (max(s_logprobs) <= 0.0
                                                                            and _above_floor(s_logprobs))))))
            except TypeError:
                fast = False
        if fast:
            shadow = ShadowResult(s_precision.lower(), s_completion, s_logprobs, s_latency)
        else:
            shadow = _shadow(shadow)

    # positional arguments: noticeably cheaper than 17 keywords on the hot path
    event = InferenceEvent(
        request_id, ts, model, route, precision.lower(), status, latency, prompt_tokens, completion_tokens,
        schema, engine, gpu_uuid, ttft, prompt, completion, logprobs, shadow, replica, build,
    )
    if not d.keys() <= _KNOWN_FIELDS:
        event.extra = {k: v for k, v in d.items() if k not in _KNOWN_FIELDS}
    return event


def event_to_dict(event: InferenceEvent) -> dict[str, Any]:
    """The JSON object for ``event``: optional fields that are None are left out, extras kept."""
    out: dict[str, Any] = {k: v for k, v in event.extra.items() if k not in _KNOWN_FIELDS}
    out.update(
        schema=event.schema,
        request_id=event.request_id,
        ts=event.ts,
        model=event.model,
        route=event.route,
        precision=event.precision,
        status=event.status,
        latency_ms=event.latency_ms,
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
    )
    for name in ("engine", "gpu_uuid", "ttft_ms", "prompt", "completion", "completion_logprobs", "replica", "build"):
        v = getattr(event, name)
        if v is not None:
            out[name] = v
    if event.shadow is not None:
        s = event.shadow
        out["shadow"] = {
            k: v
            for k, v in (
                ("precision", s.precision),
                ("completion", s.completion),
                ("completion_logprobs", s.completion_logprobs),
                ("latency_ms", s.latency_ms),
            )
            if v is not None
        }
    return out


_BAD_NAME_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp"})


def name_problem(name: str) -> str | None:
    """Why ``name`` (a model or route name, NFKC already) cannot be one, or None: a name is 1 to
    ``MAX_NAME_CHARS`` characters with no space, control, invisible (format) or unassigned
    character. Producers that take names from clients (the gateway's route header) check them
    with this rule; confusable letters are ``watchdog.policy.names.problems``."""
    if not name:
        return "is empty"
    if len(name) > MAX_NAME_CHARS:
        return f"is {len(name)} characters long (at most {MAX_NAME_CHARS})"
    if name.isascii():
        if name.isprintable() and " " not in name:
            return None
        bad = next(ch for ch in name if not ch.isprintable() or ch == " ")
        return f"holds {bad!r}, a space or control character"
    for ch in name:
        if unicodedata.category(ch) in _BAD_NAME_CATEGORIES:
            return (f"holds U+{ord(ch):04X} ({unicodedata.name(ch, 'unnamed character')}), a space, "
                    "control or invisible character")
    return None


def partition_key(model: str, route: str) -> bytes:
    """The Kafka message key of a route's events: ``model/route``. The daemon places a route on the
    partition its key hashes to (murmur2, as Java and kafka-python do), so every producer keys by it
    and a route's windows and policy state live in one partition (docs/OPERATIONS.md, "Ownership")."""
    return f"{model}/{route}".encode()


def encode_event(event: InferenceEvent | dict[str, Any]) -> bytes:
    """Serialise an event (or a plain dict, written as given) to the bytes a producer sends."""
    if isinstance(event, InferenceEvent):
        return _dumps(event_to_dict(event))
    if isinstance(event, dict):
        return _dumps(event)
    raise TypeError(f"encode_event takes an InferenceEvent or a dict, not {type(event).__name__}")
