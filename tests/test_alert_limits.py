"""Alerts the receivers accept: each channel's body within its receiver's documented limits, cut at
character boundaries with a visible marker, stable idempotency keys; and a policy's ``notify`` /
``page`` channels, routed and checked (issue 20 item 5). Real HTTP receiver (AlertSink)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.test_policy_engine import DAY0, Sim, make_policy, window
from watchdog.alerting import limits
from watchdog.alerting.alerter import Alerter
from watchdog.alerting.limits import clip, size, stable_key
from watchdog.core.signals import Action
from watchdog.dev.alertsink import AlertSink, Received
from watchdog.policy import PolicyError, PolicyLoader, load_policy_files, parse_policy_text

FAST = {"backoff_initial": 0.01, "backoff_max": 0.05}
#: 200k characters: ASCII, CJK (3 UTF-8 bytes), emoji outside the BMP (4 bytes, 2 UTF-16 units), a ZWJ family
HUGE = ("rougeL fell: " + "漢字かな" * 20_000 + "😀🚀" * 30_000 + "👨‍👩‍👧" * 5_000 + "x" * 15_000)[:200_000]
KEY = "limits@example.com"


@pytest.fixture
def sink() -> Iterator[AlertSink]:
    s = AlertSink()
    s.start()
    yield s
    s.stop()


def channels(url: str, **kw: Any) -> list[dict[str, Any]]:
    return [
        {"kind": "webhook", "url": url + "/webhook", **kw},
        {"kind": "slack", "url": url + "/slack", **kw},
        {"kind": "pagerduty", "url": url + "/pd", "routing_key": "R" * 32, **kw},
        {"kind": "alertmanager", "url": url + "/am", **kw},
    ]


def huge_action(kind: str = "rollback", policy: str = "p" * 300) -> Action:
    # the alerter keeps 50 keys of 300 characters, 3 levels deep: up to ~37M characters of detail
    detail: dict[str, Any] = {"lone": "bad \udc80 surrogate"}
    detail["nested"] = {f"n{i}": {f"m{j}": ["🚀" * 299] * 50 for j in range(50)} for i in range(50)}
    detail.update({f"k{i}": "値" * 290 + "😀" for i in range(48)})
    return Action(kind=kind, policy=policy, model="llama-3-8b", route="chat", reason=HUGE, severity="critical",
                  precision="fp16" if kind == "rollback" else "fp8", at=1_790_000_000.0, detail=detail)


def cut(text: str) -> bool:
    return re.search(r"… \(truncated, \d{6} chars\)$", text) is not None


def raw_size(r: Received) -> int:
    return int({k.lower(): v for k, v in r.headers.items()}["content-length"])


def strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


# -- the cutting itself ----------------------------------------------------------------------------


def test_clip_counts_as_the_receiver_and_never_cuts_a_character() -> None:
    for limit in (1, 2, 30, 31, 32, 33, 1024):
        for unit in ("utf16", "bytes"):
            out = clip(HUGE, limit, unit)  # type: ignore[arg-type]
            assert size(out, unit) <= limit, (limit, unit)  # type: ignore[arg-type]
            out.encode("utf-8")  # whole code points only: encodes strictly
            if limit >= 32:
                assert out.endswith(f"… (truncated, {len(HUGE)} chars)")
            assert not out.endswith("\u200d")
    assert clip("short 😀", 1024) == "short 😀"
    assert size("😀") == 2 and size("😀", "bytes") == 4
    # a cut between the two halves of a surrogate pair drops the half: 🚀 is never split
    assert clip("a" * 30 + "🚀" * 100, 31 + len(limits.marker(130))) == "a" * 30 + limits.marker(130)
    assert limits.clean("x\ud800y") == "x\ufffdy" and limits.clean("\ud83d\ude00") == "😀"


def test_stable_keys_stay_within_limits_distinct_and_repeatable() -> None:
    a, b = "m/r/" + "p" * 400 + "a", "m/r/" + "p" * 400 + "b"
    ka, kb = stable_key(a, 255), stable_key(b, 255)
    assert len(ka) == len(kb) == 255 and ka != kb and ka == stable_key(a, 255)
    assert stable_key("llama-3-8b/chat/fp8-quality", 255) == "llama-3-8b/chat/fp8-quality"


# -- (a) a 200k-character alert on every channel ---------------------------------------------------


def test_a_huge_alert_reaches_every_receiver_within_its_limits(sink: AlertSink) -> None:
    alerter = Alerter(channels(sink.url), status_url="http://127.0.0.1:9464/status", **FAST).start()
    try:
        alerter.handle(huge_action("rollback"))
        alerter.handle(huge_action("promote"))
        got = sink.wait_for(8, timeout=15)
    finally:
        assert alerter.stop(5)
    assert alerter.failed == 0 and alerter.stats()["sent"] == 8
    by: dict[str, list[Received]] = {}
    for r in got:
        by.setdefault(r.path, []).append(r)
    for r in got:  # the sink parsed each as strict UTF-8 JSON; no character was cut into U+FFFD
        assert "\ufffd" not in "".join(s for s in strings(r.body) if "surrogate" not in s)

    hook = by["/webhook"][0]
    assert raw_size(hook) <= limits.WEBHOOK_BODY_MAX_BYTES
    assert cut(hook.body["summary"]) and size(hook.body["summary"], "bytes") <= 16 * 1024
    assert "_truncated" in hook.body["detail"] and hook.body["detail"]["lone"] == "bad \ufffd surrogate"
    assert len(hook.body["key"]) <= 255 and hook.body["id"]

    slack = by["/slack"][0].body
    assert size(slack["text"]) <= limits.SLACK_TEXT_MAX and cut(slack["text"])
    att = slack["attachments"][0]
    assert len(att["blocks"]) <= limits.SLACK_MAX_BLOCKS and size(att["fallback"]) <= 3000
    texts = [b["text"]["text"] for b in att["blocks"] if "text" in b]
    texts += [e["text"] for b in att["blocks"] for e in b.get("elements", [])]
    assert all(size(t) <= limits.SLACK_BLOCK_TEXT_MAX for t in texts), [size(t) for t in texts]
    assert "chars)\n<http" in texts[1] and texts[1].endswith("<http://127.0.0.1:9464/status|watchdog status>")

    trigger, resolve = (r.body for r in by["/pd"])
    assert raw_size(by["/pd"][0]) <= limits.PAGERDUTY_EVENT_MAX_BYTES
    summary = trigger["payload"]["summary"]
    assert size(summary) <= limits.PAGERDUTY_SUMMARY_MAX and cut(summary)
    assert len(trigger["dedup_key"]) <= 255 and trigger["dedup_key"] == resolve["dedup_key"]
    assert resolve["event_action"] == "resolve"
    assert "_truncated" in trigger["payload"]["custom_details"]
    assert all(len(trigger["payload"][f]) <= 255 for f in ("source", "component", "group", "class"))

    fired, ended = (r.body[0] for r in by["/am/api/v2/alerts"])
    assert all(raw_size(r) <= limits.ALERTMANAGER_BODY_MAX_BYTES for r in by["/am/api/v2/alerts"])
    assert all(len(v) <= limits.ALERTMANAGER_LABEL_MAX for v in fired["labels"].values())
    assert fired["labels"] == ended["labels"] and "endsAt" in ended  # the resolve names the same alert
    assert all(size(v, "bytes") <= 16 * 1024 and cut(v) for v in fired["annotations"].values())
    print("\nbody bytes:", {p: [raw_size(r) for r in rs] for p, rs in by.items()})


def test_a_lone_surrogate_or_nan_does_not_stop_an_alert(sink: AlertSink) -> None:
    """httpx's own JSON encoder raises on both: the page used to fail as 'could not be built'."""
    alerter = Alerter(channels(sink.url), **FAST).start()
    try:
        alerter.ops_alert("x", "summary \ud800 with a lone surrogate", "critical", {"delta": float("nan")})
        got = sink.wait_for(4)
    finally:
        assert alerter.stop(2)
    assert alerter.failed == 0
    hook = next(r.body for r in got if r.path == "/webhook")
    assert hook["summary"] == "summary \ufffd with a lone surrogate" and hook["detail"] == {"delta": "nan"}


def test_text_that_json_escapes_stays_within_the_bounds(sink: AlertSink) -> None:
    """Quotes and backslashes take 2 bytes in JSON, control characters 6: the bodies stay bounded."""
    alerter = Alerter(channels(sink.url), **FAST).start()
    try:
        alerter.ops_alert("esc", '"\\\x01\x1b' * 50_000, "critical", {"k": "\x00" * 300})
        got = sink.wait_for(4)
    finally:
        assert alerter.stop(2)
    assert alerter.failed == 0
    bound = {"/webhook": limits.WEBHOOK_BODY_MAX_BYTES, "/slack": limits.WEBHOOK_BODY_MAX_BYTES,
             "/pd": limits.PAGERDUTY_EVENT_MAX_BYTES, "/am/api/v2/alerts": limits.ALERTMANAGER_BODY_MAX_BYTES}
    assert all(raw_size(r) <= bound[r.path] for r in got), [(r.path, raw_size(r)) for r in got]
    pd = next(r.body for r in got if r.path == "/pd")
    assert cut(pd["payload"]["summary"]) and "\x01" not in pd["payload"]["summary"]


# -- (c) notify / page route to exactly the named channels -----------------------------------------


def routed(sink: AlertSink, n: int) -> list[tuple[str, str]]:
    got = sink.wait_for(n, timeout=5)
    return sorted((r.path.strip("/"), "resolved" if "resolve" in json.dumps(r.body).lower() else "firing") for r in got)


def test_notify_goes_to_slack_only_and_page_pages_pagerduty_only(sink: AlertSink) -> None:
    named = [{"kind": "webhook", "url": sink.url + "/webhook"}, {"kind": "slack", "url": sink.url + "/slack"},
             {"kind": "pagerduty", "url": sink.url + "/pagerduty", "routing_key": "R" * 32}]
    alerter = Alerter(named, **FAST).start()
    try:
        # a warning alert: notify only (slack), not the webhook, not the pager
        warn = Sim(make_policy(action="alert", rule_for=1).replace("severity: critical", "severity: warning"))
        (a,) = warn.step(window(DAY0, 0.10), DAY0)
        assert a.kind == "alert" and a.severity == "warning"
        alerter.handle(a)
        assert routed(sink, 1) == [("slack", "firing")]
        sink.clear()

        # a rollback: critical, so slack (notify) and pagerduty (page); its resolve reaches both
        sim = Sim(make_policy(rule_for=1, healthy=1, name="q"))
        (rb,) = sim.step(window(DAY0, 0.10), DAY0)
        assert rb.kind == "rollback" and rb.detail["channels"] == ["slack", "pagerduty"]
        alerter.handle(rb)
        assert routed(sink, 2) == [("pagerduty", "firing"), ("slack", "firing")]
        sink.clear()
        acts = sim.step(window(DAY0 + 60, 0.01), DAY0 + 60) + sim.step(window(DAY0 + 120, 0.01), DAY0 + 120)
        (promote,) = [x for x in acts if x.kind == "promote"]
        alerter.handle(promote)
        assert routed(sink, 2) == [("pagerduty", "resolved"), ("slack", "resolved")]
        sink.clear()

        # an ops alert names no policy: every channel
        alerter.ops_alert("redis", "Redis unreachable", "critical")
        assert {r.path for r in sink.wait_for(3)} == {"/webhook", "/slack", "/pagerduty"}
        # a policy that names no channel: every channel too
        bare = Sim(make_policy(action="alert", rule_for=1, name="r").replace(
            "    actions: {notify: [slack], page: [pagerduty]}\n", ""))
        (b,) = bare.step(window(DAY0, 0.10), DAY0)
        assert "routing" not in b.detail
        alerter.handle(b)
        sink.wait_for(6)
    finally:
        assert alerter.stop(2)
    assert alerter.failed == 0 and alerter.stats()["sent"] == 11


def test_routing_survives_the_durable_page_stream_and_the_incident_store() -> None:
    from watchdog.alerting.incidents import IncidentBook
    from watchdog.alerting.message import Alert

    sim = Sim(make_policy(rule_for=1))
    (rb,) = sim.step(window(DAY0, 0.10), DAY0)
    book = IncidentBook()
    (alert,) = book.on_action(rb)
    assert alert.notify == ("slack",) and alert.page == ("pagerduty",) and "routing" not in alert.detail
    again = Alert.from_json(alert.to_json())
    assert again.routed_to("pagerduty") and again.routed_to("slack") and not again.routed_to("webhook")
    restored = IncidentBook()  # a restart: the incident from Redis keeps its routing for the resolve
    restored.restore(book.export())
    (resolved,) = restored.on_action(Action(kind="resolve", policy="p", model=rb.model, route=rb.route,
                                            reason="ok", severity="info", at=DAY0 + 60,
                                            detail={"routing": rb.detail["routing"]}))
    assert resolved.routed_to("pagerduty") and not resolved.routed_to("webhook")


# -- unknown channel names -------------------------------------------------------------------------


TYPO = make_policy().replace("notify: [slack]", "notify: [slak]")


def test_an_unknown_channel_name_is_a_file_line_col_error(tmp_path: Any) -> None:
    _, errors = parse_policy_text(TYPO, "t.yaml", channels={"slack", "pagerduty"})
    assert len(errors) == 1
    line = next(i for i, text in enumerate(TYPO.splitlines(), 1) if "slak" in text)
    col = TYPO.splitlines()[line - 1].index("slak") + 1
    assert errors[0] == (f"t.yaml:{line}:{col}: actions.notify: unknown alert channel 'slak' (did you mean "
                         "'slack'?); the daemon's alert channels: pagerduty, slack")
    _, errors = parse_policy_text(make_policy(), "t.yaml", channels={"slack"})
    assert [e.split(": ", 1)[1] for e in errors] == [
        "actions.page: unknown alert channel 'pagerduty'; the daemon's alert channels: slack (a channel's name is "
        "its `name:`, else its kind: add `name: pagerduty` to the channel that should get these, or change "
        "actions.page)"]
    assert parse_policy_text(TYPO, "t.yaml")[1] == []  # no channels given (policy validate): not checked
    path = tmp_path / "p.yaml"
    path.write_text(TYPO)
    with pytest.raises(PolicyError, match=r"p\.yaml:\d+:\d+: actions.notify: unknown alert channel 'slak'"):
        load_policy_files([path], channels=["slack", "pagerduty"])
    errors_seen: list[list[str]] = []
    loader = PolicyLoader([path], on_error=errors_seen.append, channels=["slack", "pagerduty"])
    assert loader.policy_set.policies == () and "unknown alert channel 'slak'" in loader.last_errors[0]


def test_the_daemon_refuses_a_policy_naming_a_channel_it_lacks(tmp_path: Any) -> None:
    """The daemon's policy loader gets the alerter's channel names (runtime/policies.py)."""
    from watchdog.config.settings import load_config
    from watchdog.core.metrics import Metrics
    from watchdog.runtime.policies import PolicyReloader

    path = tmp_path / "p.yaml"
    path.write_text(TYPO)
    cfg = load_config(None, policies=[str(path)],
                      alerts={"channels": [{"kind": "slack", "url": "http://127.0.0.1:9/slack"},
                                           {"kind": "pagerduty", "url": "http://127.0.0.1:9/pd", "routing_key": "k"}]})
    alerter = Alerter([c.model_dump() for c in cfg.alerts.channels])
    with pytest.raises(PolicyError) as exc:
        PolicyReloader(cfg, Metrics(), alerter)
    assert len(str(exc.value).splitlines()) == 1 and "unknown alert channel 'slak' (did you mean 'slack'?)" in str(exc.value)
    path.write_text(make_policy())
    assert PolicyReloader(cfg, Metrics(), alerter).engine is not None


def test_config_check_reports_a_policy_naming_a_missing_channel(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from watchdog.cli.main import main

    (tmp_path / "p.yaml").write_text(make_policy())
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"policies: [{tmp_path / 'p.yaml'}]\n"
                   "alerts: {channels: [{kind: slack, url: 'http://127.0.0.1:9/s'}]}\n")
    assert main(["config", "check", "--config", str(cfg)]) == 2
    assert "actions.page: unknown alert channel 'pagerduty'; the daemon's alert channels: slack" in capsys.readouterr().err
    cfg.write_text(f"policies: [{tmp_path / 'p.yaml'}]\nalerts: {{channels: []}}\n")  # no channel: nothing to check
    assert main(["config", "check", "--config", str(cfg)]) == 0
