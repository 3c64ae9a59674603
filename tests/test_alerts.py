"""Alerting: channel payloads, incident dedup, retries and non-blocking delivery, against a real local HTTP sink."""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from watchdog.alerting.alerter import Alerter
from watchdog.alerting.channels import (
    SLACK_COLORS,
    WEBHOOK_SCHEMA,
    Channel,
    build_channel,
    channel_config,
    register_channel,
)
from watchdog.alerting.incidents import IncidentBook
from watchdog.core.signals import Action
from watchdog.dev.alertsink import AlertSink, summarize

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
FAST = {"backoff_initial": 0.01, "backoff_max": 0.05}


@pytest.fixture
def sink() -> Iterator[AlertSink]:
    s = AlertSink()
    s.start()
    yield s
    s.stop()


def action(kind: str = "alert", *, route: str = "chat", severity: str = "warning", dry_run: bool = False,
           reason: str = "rougeL dropped 4.1% (CI -5.0..-3.2)", **kw: Any) -> Action:
    return Action(kind=kind, policy="fp8-quality", model="llama-3-8b", route=route, reason=reason,
                  severity=severity, dry_run=dry_run, at=kw.pop("at", 1_790_000_000.0), **kw)  # type: ignore[arg-type]


def all_channels(url: str) -> list[dict[str, Any]]:
    return [
        {"kind": "webhook", "url": url + "/webhook"},
        {"kind": "slack", "url": url + "/slack"},
        {"kind": "pagerduty", "url": url + "/pd", "routing_key": "R0UT1NGKEY0000000000000000000000"},
        {"kind": "alertmanager", "url": url + "/am"},
    ]


def by_path(received: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for r in received:
        out.setdefault(r.path, []).append(r.body)
    return out


# -- registry and config ---------------------------------------------------------------------------


def test_unknown_kind_suggests_the_close_one() -> None:
    with pytest.raises(ValueError, match=r"did you mean 'slack'"):
        channel_config({"kind": "slak", "url": "http://x"})
    with pytest.raises(ValueError, match=r"did you mean 'pagerduty'"):
        build_channel({"kind": "pagerduty2", "routing_key": "k"})


def test_config_checks_required_fields_and_duplicate_kinds() -> None:
    with pytest.raises(ValueError, match="routing_key"):
        channel_config({"kind": "pagerduty"})
    with pytest.raises(ValueError, match="'url' is required"):
        channel_config({"kind": "webhook"})
    with pytest.raises(ValueError, match="min_severity"):
        channel_config({"kind": "webhook", "url": "http://x", "min_severity": "loud"})
    with pytest.raises(ValueError, match="unknown field"):
        channel_config({"kind": "webhook", "url": "http://x", "colour": "red"})
    pd = build_channel({"kind": "pagerduty", "routing_key": "k"})
    assert pd.endpoint() == "https://events.pagerduty.com/v2/enqueue"
    assert "S3CR3T" not in repr(channel_config({"kind": "pagerduty", "routing_key": "S3CR3T"}))

    class Impostor(Channel):
        kind = "slack"

    with pytest.raises(ValueError, match="already registered"):
        register_channel(Impostor)


def test_daemon_config_model_is_accepted() -> None:
    from watchdog.config.settings import AlertChannelConfig

    cfg = AlertChannelConfig(kind="alertmanager", url="http://am:9093/", min_severity="warning",
                             name="am-prod", resend_interval_s=30)
    for given in (cfg, cfg.model_dump()):  # one schema: the model itself or its dump
        alerter = Alerter.from_config([given])
        channel = alerter.workers[0].channel
        assert channel.config == cfg and channel.name == "am-prod" and channel.resend_interval_s == 30
        assert channel.endpoint() == "http://am:9093/api/v2/alerts"
    assert channel_config(cfg) is cfg


def test_one_severity_scale_for_config_policies_alerts_and_docs(tmp_path: Any) -> None:
    from pathlib import Path

    from watchdog.config.settings import AlertsConfig
    from watchdog.core.signals import SEVERITIES
    from watchdog.policy.schema import Rule

    assert SEVERITIES == ("info", "warning", "critical")
    for severity in SEVERITIES:
        AlertsConfig(channels=[{"kind": "webhook", "url": "http://x", "min_severity": severity}])
        Rule(name="r", metric="error_rate", fail_if="> 0.1", severity=severity)
        channel_config({"kind": "webhook", "url": "http://x", "min_severity": severity})
    with pytest.raises(ValueError, match="min_severity"):
        AlertsConfig(channels=[{"kind": "webhook", "url": "http://x", "min_severity": "error"}])
    with pytest.raises(ValueError, match="severity"):
        Rule(name="r", metric="error_rate", fail_if="> 0.1", severity="error")
    with pytest.raises(ValueError, match="min_severity"):
        channel_config({"kind": "webhook", "url": "http://x", "min_severity": "error"})
    book = IncidentBook()
    with pytest.raises(ValueError, match="unknown severity 'error'"):
        book.on_action(action("alert", severity="error"))
    with pytest.raises(ValueError, match="unknown severity 'error'"):
        book.on_ops_alert("x", "y", "error")  # type: ignore[arg-type]
    docs = (Path(__file__).resolve().parent.parent / "docs" / "ALERTS.md").read_text()
    assert " < ".join(f"`{s}`" for s in SEVERITIES) in docs and "`error`" not in docs.split("### Severity")[0]


# -- payload shapes --------------------------------------------------------------------------------


def test_each_channel_payload_shape_for_rollback_and_promote(sink: AlertSink) -> None:
    alerter = Alerter(all_channels(sink.url), status_url="http://127.0.0.1:9464/status", **FAST).start()
    try:
        rb = action("rollback", precision="fp16", detail={"rougeL_delta": -0.041, "prompt": "secret customer text",
                                                          "items": [{"completion": "also secret", "id": 3}]})
        sent = alerter.handle(rb)
        assert len(sent) == 1 and sent[0].severity == "critical"
        got = by_path(sink.wait_for(4))
        assert set(got) == {"/webhook", "/slack", "/pd", "/am/api/v2/alerts"}
        for r in sink.received:
            assert "secret" not in str(r.body)

        hook = got["/webhook"][0]
        assert hook["schema"] == WEBHOOK_SCHEMA
        assert hook["status"] == "firing" and hook["severity"] == "critical" and hook["event"] == "rollback"
        assert hook["summary"].startswith("FP8 rolled back to FP16 on route chat (llama-3-8b) because rougeL")
        assert hook["key"] == rb.incident_key == "llama-3-8b/chat/fp8-quality"
        assert hook["detail"] == {"rougeL_delta": -0.041, "items": [{"id": 3}]}
        assert RFC3339.match(hook["started_at"]) and hook["ended_at"] is None

        slack = got["/slack"][0]
        assert slack["text"].startswith("[CRITICAL] FP8 rolled back")
        att = slack["attachments"][0]
        assert att["color"] == SLACK_COLORS["critical"]
        assert [b["type"] for b in att["blocks"]] == ["section", "section", "context"]
        assert "http://127.0.0.1:9464/status" in att["blocks"][1]["text"]["text"]

        pd = got["/pd"][0]
        assert pd["routing_key"] == "R0UT1NGKEY0000000000000000000000"
        assert pd["event_action"] == "trigger" and pd["dedup_key"] == rb.incident_key
        p = pd["payload"]
        assert p["severity"] == "critical" and p["severity"] in {"critical", "error", "warning", "info"}
        assert p["component"] == "llama-3-8b" and p["group"] == "chat" and p["source"]
        assert p["summary"] == hook["summary"] and len(p["summary"]) <= 1024
        assert p["custom_details"]["policy"] == "fp8-quality" and p["custom_details"]["rougeL_delta"] == -0.041
        assert pd["client_url"] == "http://127.0.0.1:9464/status"

        am = got["/am/api/v2/alerts"][0]
        assert isinstance(am, list) and len(am) == 1
        assert am[0]["labels"] == {"alertname": "LLMWatchdogIncident", "severity": "critical",
                                   "model": "llama-3-8b", "route": "chat", "policy": "fp8-quality"}
        assert set(am[0]["annotations"]) == {"summary", "description"}
        assert RFC3339.match(am[0]["startsAt"]) and "endsAt" not in am[0]
        assert am[0]["generatorURL"] == "http://127.0.0.1:9464/status"

        sink.clear()
        alerter.handle(action("promote", precision="fp8", reason="golden replay passed 3 times"))
        got = by_path(sink.wait_for(4))
        assert got["/webhook"][0]["status"] == "resolved" and RFC3339.match(got["/webhook"][0]["ended_at"])
        assert "promoted route chat (llama-3-8b) back to FP8" in got["/webhook"][0]["summary"]
        assert got["/slack"][0]["attachments"][0]["color"] == SLACK_COLORS["resolved"]
        assert got["/pd"][0] == {"routing_key": "R0UT1NGKEY0000000000000000000000", "event_action": "resolve",
                                 "dedup_key": rb.incident_key}
        resolved = got["/am/api/v2/alerts"][0][0]
        assert resolved["labels"] == am[0]["labels"] and RFC3339.match(resolved["endsAt"])
        assert alerter.open_incidents() == []
    finally:
        assert alerter.stop(2)
    assert alerter.stats()["sent"] == 8 and alerter.failed == 0


def test_dry_run_rollback_is_marked_and_keeps_policy_severity(sink: AlertSink) -> None:
    alerter = Alerter([{"kind": "webhook", "url": sink.url}], **FAST).start()
    alerter.handle(action("rollback", dry_run=True, severity="warning"))
    body = sink.wait_for(1)[0].body
    alerter.stop(2)
    assert body["summary"].startswith("DRY RUN: would roll back FP8 to FP16 on route chat")
    assert body["severity"] == "warning" and body["dry_run"] is True


def test_min_severity_filters_per_channel(sink: AlertSink) -> None:
    alerter = Alerter([{"kind": "webhook", "url": sink.url + "/all"},
                       {"kind": "webhook", "url": sink.url + "/page", "min_severity": "critical"}], **FAST).start()
    alerter.handle(action("alert", route="a", severity="warning"))
    alerter.handle(action("rollback", route="b"))
    sink.wait_for(3)
    assert alerter.stop(2)
    got = by_path(sink.received)
    assert len(got["/all"]) == 2 and len(got["/page"]) == 1 and got["/page"][0]["route"] == "b"
    assert set(alerter.stats()["channels"]) == {"webhook", "webhook-2"}


# -- incidents -------------------------------------------------------------------------------------


def test_ten_failing_windows_give_one_alert_and_one_resolve(sink: AlertSink) -> None:
    alerter = Alerter([{"kind": "webhook", "url": sink.url}], **FAST).start()
    for i in range(10):
        alerter.handle(action("alert", at=1_790_000_000.0 + 60 * i))
    incidents = alerter.open_incidents()
    assert len(incidents) == 1 and incidents[0]["repeats_suppressed"] == 9
    assert incidents[0]["key"] == "llama-3-8b/chat/fp8-quality"
    assert alerter.handle(action("resolve", reason="metrics back within bounds")) != []
    assert alerter.handle(action("resolve")) == []  # nothing open any more
    assert alerter.stop(2)
    bodies = [r.body for r in sink.received]
    assert [b["status"] for b in bodies] == ["firing", "resolved"]
    assert bodies[1]["ended_at"] is not None and "was: fp8-quality on route chat" in bodies[1]["description"]
    s = alerter.stats()
    assert (s["sent"], s["suppressed"], s["open_incidents"]) == (2, 10, 0)


def test_escalation_reopens_the_message_and_ends_old_alertmanager_alert(sink: AlertSink) -> None:
    alerter = Alerter([{"kind": "alertmanager", "url": sink.url}], **FAST).start()
    alerter.handle(action("alert", severity="warning"))
    alerter.handle(action("alert", severity="warning"))  # suppressed
    alerter.handle(action("alert", severity="critical"))  # escalates
    alerter.handle(action("alert", severity="warning"))  # lower: suppressed
    assert alerter.stop(2)
    posts = [r.body for r in sink.received]
    assert len(posts) == 2
    old, new = posts[1]
    assert old["labels"]["severity"] == "warning" and "endsAt" in old
    assert new["labels"]["severity"] == "critical" and "endsAt" not in new
    assert alerter.suppressed == 2


def test_incident_book_rollback_announcements() -> None:
    book = IncidentBook(clock=lambda: 1_790_000_000.0)
    assert [a.event for a in book.on_action(action("alert"))] == ["alert"]
    # a rollback on an open incident is news (and critical), a replayed one is not
    rb = book.on_action(action("rollback"))
    assert len(rb) == 1 and rb[0].severity == "critical" and rb[0].previous_severity == "warning"
    assert book.on_action(action("rollback")) == []
    assert book.on_action(action("alert", severity="critical")) == []
    # dry-run then real rollback on another route: both announced
    dry = book.on_action(action("rollback", route="code", dry_run=True))
    real = book.on_action(action("rollback", route="code"))
    assert dry[0].summary.startswith("DRY RUN") and real[0].summary.startswith("FP8 rolled back")
    assert len(book) == 2 and book.suppressed == 2
    # promote of an incident this process never saw (restart) is still announced, to every channel
    p = book.on_action(action("promote", route="unknown"))
    assert p[0].status == "resolved" and p[0].severity == "critical"
    with pytest.raises(ValueError):
        book.on_action(action("explode"))


def test_ops_alerts(sink: AlertSink) -> None:
    alerter = Alerter([{"kind": "pagerduty", "url": sink.url, "routing_key": "k", "source": "h1"}], **FAST).start()
    alerter.ops_alert("redis", "Redis unreachable: Connection refused", "critical", {"host": "127.0.0.1"})
    alerter.ops_alert("redis", "Redis unreachable: Connection refused", "critical", {})
    alerter.ops_alert("policy-reload", "policy reload rejected: policies/default.yaml:12:7 unknown metric 'rouge'",
                      "warning")
    assert alerter.ops_alert("x", "bad", "loud") == []  # type: ignore[arg-type]
    assert alerter.handle(action("alert", detail=None)) == []  # a malformed action is counted, not raised
    assert {i["key"] for i in alerter.open_incidents()} == {"ops/redis", "ops/policy-reload"}
    alerter.ops_resolve("redis")
    alerter.ops_resolve("never-opened")
    assert alerter.stop(2)
    # two incidents go out side by side (max_in_flight): the order holds per incident
    posts = sorted((r.body for r in sink.received), key=lambda p: p["dedup_key"])
    assert [(p["event_action"], p["dedup_key"]) for p in posts] == [
        ("trigger", "ops/policy-reload@h1"), ("trigger", "ops/redis@h1"), ("resolve", "ops/redis@h1")]
    assert posts[1]["payload"]["group"] == "ops" and posts[1]["payload"]["custom_details"]["host"] == "127.0.0.1"
    assert "policies/default.yaml:12:7" in posts[0]["payload"]["summary"]
    s = alerter.stats()
    assert (s["open_incidents"], s["suppressed"], s["invalid"]) == (1, 2, 2)


# -- delivery --------------------------------------------------------------------------------------


def test_retries_after_500s_then_succeeds_in_order(sink: AlertSink) -> None:
    sink.fail_next(3)
    alerter = Alerter([{"kind": "webhook", "url": sink.url}], seed=1, **FAST).start()
    alerter.handle(action("alert"))
    alerter.handle(action("resolve"))  # must not overtake the trigger that is being retried
    sink.wait_for(2, timeout=5)
    assert alerter.stop(2)
    assert [r.status for r in sink.received] == [500, 500, 500, 200, 200]
    assert [r.body["status"] for r in sink.accepted] == ["firing", "resolved"]
    assert (alerter.sent, alerter.retried, alerter.failed) == (2, 3, 0)


def test_client_errors_are_not_retried_and_attempts_are_bounded(sink: AlertSink) -> None:
    alerter = Alerter([{"kind": "webhook", "url": sink.url}], max_attempts=3, **FAST).start()
    sink.fail_next(1, status=400)
    alerter.handle(action("alert", route="a"))
    sink.wait_for(1, accepted=False)
    sink.fail_next(10, status=503)
    alerter.handle(action("alert", route="b"))
    sink.wait_for(4, accepted=False)
    assert alerter.stop(2)
    assert [r.status for r in sink.received] == [400, 503, 503, 503]
    assert (alerter.sent, alerter.failed, alerter.retried) == (0, 2, 2)
    assert "HTTP 503" in alerter.stats()["channels"]["webhook"]["last_error"]


def test_handle_never_blocks_when_receiver_is_down_and_queue_is_bounded() -> None:
    down = AlertSink()
    url = down.start()
    down.stop()  # nothing listens on that port any more
    alerter = Alerter([{"kind": "webhook", "url": url, "timeout_s": 0.2}], max_queue=50, **FAST).start()
    t0 = time.perf_counter()
    for i in range(3000):
        alerter.handle(action("alert", route=f"r{i}"))
    spent = time.perf_counter() - t0
    s = alerter.stats()
    assert s["queued"] <= 50 and s["dropped"] >= 3000 - 51
    assert s["open_incidents"] == 3000
    t0 = time.perf_counter()
    assert alerter.stop(0.3) is False
    assert time.perf_counter() - t0 < 1.5
    assert alerter.dropped >= 3000 - 1 - alerter.failed and alerter.sent == 0
    print(f"3000 handle() calls with receiver down: {spent * 1e6 / 3000:.1f} µs each")
    assert spent < 1.5


def test_handle_never_blocks_on_a_receiver_that_hangs() -> None:
    # a listening socket that never accepts: connects succeed, requests hang until timeout_s
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(1)
    try:
        url = f"http://127.0.0.1:{hang.getsockname()[1]}"
        alerter = Alerter([{"kind": "slack", "url": url, "timeout_s": 0.3}], max_queue=10, **FAST).start()
        t0 = time.perf_counter()
        for i in range(200):
            alerter.handle(action("alert", route=f"r{i}"))
        assert time.perf_counter() - t0 < 0.5
        time.sleep(0.4)
        # stop() returns on time even though a request is still hanging; that one ends by timeout_s
        t0 = time.perf_counter()
        assert alerter.stop(0.2) is False
        assert time.perf_counter() - t0 < 0.4
        deadline = time.monotonic() + 2
        while alerter.stats()["queued"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert alerter.retried >= 1 and alerter.sent == 0 and alerter.stats()["queued"] == 0
    finally:
        hang.close()


def test_alertmanager_open_incidents_are_resent(sink: AlertSink) -> None:
    alerter = Alerter([{"kind": "alertmanager", "url": sink.url, "resend_interval_s": 0.15}], **FAST).start()
    alerter.ops_alert("fp8-slow", "FP8 no faster than FP16 on route chat (0.97x)", "warning")
    posts = sink.wait_for(3, timeout=3)
    assert alerter.stop(2)
    assert all(p.body[0]["labels"] == {"alertname": "LLMWatchdogOps", "severity": "warning", "key": "ops/fp8-slow",
                                       "source": socket.gethostname()} for p in posts)


def test_sink_summaries_and_echo(sink: AlertSink, capsys: pytest.CaptureFixture[str]) -> None:
    alerter = Alerter(all_channels(sink.url), **FAST).start()
    alerter.handle(action("rollback"))
    sink.wait_for(4)
    alerter.stop(2)
    lines = sorted(summarize(r.path, r.body) for r in sink.received)
    assert lines[0].startswith("alertmanager: firing critical FP8 rolled back")
    assert lines[1].startswith("pagerduty trigger critical llama-3-8b/chat/fp8-quality: FP8 rolled back")
    assert lines[2].startswith("slack: [CRITICAL] FP8 rolled back")
    assert lines[3].startswith("webhook firing critical: FP8 rolled back")
    loud = AlertSink(echo=True)
    with loud:
        import httpx

        httpx.post(loud.url + "/x", json={"schema": WEBHOOK_SCHEMA, "status": "firing", "severity": "info",
                                          "summary": "hello [not markup]"})
    assert "on-call" in capsys.readouterr().out and loud.received[0].body["summary"] == "hello [not markup]"


def test_backoff_is_exponential_with_jitter_and_capped() -> None:
    alerter = Alerter([{"kind": "webhook", "url": "http://127.0.0.1:9"}], backoff_initial=0.5, backoff_max=60, seed=7)
    w = alerter.workers[0]
    for attempt in range(1, 12):
        d = min(60.0, 0.5 * 2 ** (attempt - 1))
        delays = [w._retry_delay(attempt, None) for _ in range(50)]
        assert all(d / 2 <= x < d for x in delays) and len(set(delays)) > 1
    assert w._retry_delay(1, 5.0) == 5.0  # Retry-After wins when longer
    assert w._retry_delay(1, 3600.0) == 60.0  # but never past backoff_max
