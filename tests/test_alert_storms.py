"""Storms: many routes trip at once (a bad FP8 build deployed fleet-wide, a GPU node lost).

Against the real pager, alerter, Redis and local HTTP receivers (``AlertSink``), with the channels'
shipped defaults unless a test says otherwise: every rollback and every resolve reaches on-call,
listed by route, in a few grouped messages rather than one message per route, and grouping keeps
the delivery guarantees (each listed once across a restart and across two replicas, every resolve
after its trigger). Each test counts messages and routes exactly.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.test_pages import act, dispatch, pager, wait
from watchdog.alerting import limits
from watchdog.alerting.channels import build_channel, channel_config
from watchdog.alerting.message import Alert
from watchdog.config.settings import ConfigError, load_config
from watchdog.core.keys import Keys
from watchdog.dev.alertsink import AlertSink, Received

pytestmark = pytest.mark.services

GROUP = "g"
_LINE = re.compile(r"• (\w+): .*?route (\S+) \(m\)")
_ONE = re.compile(r"^\[(\w+)\] .*?route (\S+) \(m\)")


def listed(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(route, firing|resolved) of every incident a Slack message lists."""
    blocks = body["attachments"][0]["blocks"]
    if re.match(r"\[\w+\] \d+ incidents: ", body["text"]):
        out = []
        for b in blocks[1:]:
            if b["type"] == "section":
                assert "more incidents" not in b["text"]["text"], "an incident was only counted"
                for ln in b["text"]["text"].split("\n"):
                    m = _LINE.match(ln)
                    assert m, ln
                    out.append((m[2], "resolved" if m[1] == "RESOLVED" else "firing"))
        return out
    m = _ONE.match(body["text"])
    assert m, body["text"]
    return [(m[2], "resolved" if m[1] == "RESOLVED" else "firing")]


def slack_routes(sink: AlertSink, path: str = "") -> list[tuple[str, str]]:
    return [x for r in sink.accepted if r.path.startswith(path) for x in listed(r.body)]


def within_slack_limits(r: Received) -> None:
    blocks = r.body["attachments"][0]["blocks"]
    assert len(blocks) <= limits.SLACK_MAX_BLOCKS
    for b in blocks:
        text = b["text"]["text"] if b["type"] == "section" else b["elements"][0]["text"]
        assert limits.size(text) <= limits.SLACK_BLOCK_TEXT_MAX


def storm(client: Any, kind: str, n: int, over_s: float = 1.0, prefix: str = "r") -> None:
    """``n`` actions spread over ``over_s`` seconds, in 10 bursts (windows closing on many routes)."""
    per = n // 10
    for b in range(10):
        dispatch(client, *(act(f"{prefix}{i}", kind) for i in range(b * per, (b + 1) * per)))
        time.sleep(over_s / 10)


def test_a_storm_of_200_rollbacks_and_their_resolves_reaches_slack_as_four_messages(redis_client: Any) -> None:
    """200 routes roll back within a second, then all 200 are promoted back. Slack with its shipped
    defaults (1 message a second, ``group_wait_s`` 1, ``group_max`` 100): 2 messages for the 200
    rollbacks and 2 for the 200 resolves, every route listed once in each, each message within
    Slack's block limits. Before: 400 messages, one a second, the last page 6.7 minutes late."""
    n = 200
    with AlertSink() as sink, pager(redis_client, [{"kind": "slack", "url": sink.url + "/slack"}]) as p:
        t0 = time.monotonic()
        storm(redis_client, "rollback", n)
        wait(lambda: len(slack_routes(sink)) >= n, 15, "every rollback listed")
        took = time.monotonic() - t0
        firing_msgs = len(sink.accepted)
        t1 = time.monotonic()
        storm(redis_client, "promote", n)
        wait(lambda: len(slack_routes(sink)) >= 2 * n, 15, "every resolve listed")
        took2 = time.monotonic() - t1
        time.sleep(1.5)  # nothing more comes
        backlog = p.backlog()
    got = Counter(slack_routes(sink))
    print(f"\nstorm: {n} rollbacks -> {firing_msgs} Slack messages in {took:.1f} s; {n} resolves -> "
          f"{len(sink.accepted) - firing_msgs} messages in {took2:.1f} s; "
          f"lines per message {[len(listed(r.body)) for r in sink.accepted]}")
    assert got == Counter({(f"r{i}", s): 1 for i in range(n) for s in ("firing", "resolved")})
    assert firing_msgs <= 3 and len(sink.accepted) - firing_msgs <= 3
    assert len(sink.received) == len(sink.accepted) and backlog == {"slack": 0}
    for r in sink.accepted:
        within_slack_limits(r)
    first = sink.accepted[0].body
    assert first["text"].startswith("[CRITICAL] 100 incidents: 100 firing (100 rollback)")
    assert sink.accepted[-1].body["attachments"][0]["color"] == "#2ca02c"  # the resolves, green


def test_a_storm_of_500_rollbacks_reaches_slack_in_five_seconds(redis_client: Any) -> None:
    """The 500 routes of the problem statement, over 1 s, to Slack with its defaults: 5 messages of
    100 routes, one a second, every route listed once (before: 500 messages, the last after ~8 min)."""
    n = 500
    with AlertSink() as sink, pager(redis_client, [{"kind": "slack", "url": sink.url + "/slack"}]):
        t0 = time.monotonic()
        storm(redis_client, "rollback", n)
        wait(lambda: len(slack_routes(sink)) >= n, 15, "every rollback listed")
        took = time.monotonic() - t0
        time.sleep(1.5)
    spread = sink.accepted[-1].at - sink.accepted[0].at
    print(f"\nstorm: {n} rollbacks -> {len(sink.accepted)} Slack messages, all listed {took:.1f} s after the "
          f"storm began, the last {spread:.1f} s after the first")
    assert Counter(slack_routes(sink)) == Counter({(f"r{i}", "firing"): 1 for i in range(n)})
    assert len(sink.received) == len(sink.accepted) <= 6


def test_a_lone_rollback_is_prompt_a_burst_is_one_message_and_ops_alerts_go_alone(redis_client: Any) -> None:
    """A lone rollback still goes as the ordinary one-incident message, ``group_wait_s`` (1 s) after
    it reached the channel; five routes tripping together a moment later are one message; an ops
    alert ("Redis unreachable") is never held for grouping and goes as its own message."""
    with AlertSink() as sink, pager(redis_client, [{"kind": "slack", "url": sink.url + "/slack"}]) as p:
        time.sleep(0.3)  # the sender threads and the lease are up, as in a running daemon
        t0 = time.monotonic()
        dispatch(redis_client, act("lone", "rollback"))
        sink.wait_for(1, timeout=5)
        latency = time.monotonic() - t0
        time.sleep(1.2)
        t1 = time.monotonic()
        dispatch(redis_client, *(act(f"b{i}", "rollback") for i in range(5)))
        p.alerter.ops_alert("redis", "Redis unreachable: Connection refused", "critical")
        sink.wait_for(3, timeout=5)
        burst = time.monotonic() - t1
        time.sleep(1.5)
    texts = [r.body["text"] for r in sink.accepted]
    print(f"\nlone rollback to Slack: {latency:.2f} s after dispatch; a burst of 5 and an ops alert: "
          f"{len(sink.accepted) - 1} messages, the last {burst:.2f} s after dispatch")
    assert latency < 1.6
    assert listed(sink.accepted[0].body) == [("lone", "firing")]
    assert sink.accepted[0].body["attachments"][0]["blocks"][2]["type"] == "context"  # the one-incident form
    assert len(sink.accepted) == 3, texts
    assert sorted(listed(sink.accepted[1].body) + listed(sink.accepted[2].body)
                  if "Redis" not in texts[1] else listed(sink.accepted[2].body)) == [(f"b{i}", "firing")
                                                                                   for i in range(5)]
    assert sum("Redis unreachable" in t for t in texts) == 1


def test_a_storm_across_a_restart_lists_every_route_once(redis_client: Any) -> None:
    """Grouped messages to a slow Slack-like receiver (0.3 s an answer, groups of 20); the daemon is
    stopped after a few and started again: the groups it had delivered are not sent again, what was
    left in Redis follows after the restart, every route listed exactly once."""
    n = 200
    channels = [{"kind": "slack", "url": "", "group_max": 20, "min_interval_s": 0.2, "timeout_s": 3}]
    with AlertSink(delay_s=0.3) as sink:
        channels[0]["url"] = sink.url + "/slack"
        with pager(redis_client, channels, max_in_flight=2):
            storm(redis_client, "rollback", n)
            wait(lambda: len(sink.accepted) >= 3, 10, "three grouped messages")
        before = len(sink.accepted)
        left = redis_client.xlen(Keys().pages(GROUP, "slack"))
        assert 0 < left < n
        with pager(redis_client, channels, max_in_flight=2) as p2:
            wait(lambda: len(slack_routes(sink)) >= n, 20, "every route after the restart")
            time.sleep(1.0)
            wait(lambda: p2.backlog() == {"slack": 0}, 3, "an empty page stream")
    got = Counter(slack_routes(sink))
    print(f"\nrestart: {before} grouped messages before the stop, {left} pages left in Redis, "
          f"{len(sink.accepted)} messages in all for {n} rollbacks, {sum(got.values()) - len(got)} listed twice")
    assert got == Counter({(f"r{i}", "firing"): 1 for i in range(n)})
    assert len(sink.received) == len(sink.accepted) <= n // 20 + 3


def test_two_replicas_group_a_storm_without_losing_or_repeating_and_pagerduty_keeps_its_keys(
        redis_client: Any) -> None:
    """Two replicas share the outbox; 200 routes roll back and are promoted back at once. Slack: a
    few messages, each route's rollback listed once and its resolve once, in a later message.
    PagerDuty keeps one event per incident change (``dedup_key`` = incident): 200 triggers and
    200 resolves, each once, each resolve after its trigger."""
    n = 200
    with AlertSink() as sink:
        channels = [{"kind": "slack", "url": sink.url + "/slack"},
                    {"kind": "pagerduty", "url": sink.url + "/pd", "routing_key": "k"}]
        with pager(redis_client, channels, instance="i1"), pager(redis_client, channels, instance="i2"):
            for b in range(10):
                dispatch(redis_client, *(act(f"r{i}", k) for i in range(b * 20, (b + 1) * 20)
                                         for k in ("rollback", "promote")))
                time.sleep(0.1)
            wait(lambda: len(slack_routes(sink, "/slack")) >= 2 * n, 20, "every Slack line")
            wait(lambda: sum(r.path == "/pd" for r in sink.accepted) >= 2 * n, 20, "every PagerDuty event")
            time.sleep(1.5)
    slack = [r for r in sink.accepted if r.path == "/slack"]
    pd = [r.body for r in sink.accepted if r.path == "/pd"]
    got = Counter(slack_routes(sink, "/slack"))
    print(f"\ntwo replicas: {2 * n} pages -> {len(slack)} Slack messages, {len(pd)} PagerDuty events")
    assert got == Counter({(f"r{i}", s): 1 for i in range(n) for s in ("firing", "resolved")})
    at = {x: i for i, r in enumerate(slack) for x in listed(r.body)}
    assert all(at[(f"r{i}", "firing")] < at[(f"r{i}", "resolved")] for i in range(n))
    assert len(slack) <= 8
    events = Counter((b["dedup_key"], b["event_action"]) for b in pd)
    assert events == Counter({(f"m/r{i}/p", a): 1 for i in range(n) for a in ("trigger", "resolve")})
    order = [(b["dedup_key"], b["event_action"]) for b in pd]
    assert all(order.index((f"m/r{i}/p", "trigger")) < order.index((f"m/r{i}/p", "resolve")) for i in range(n))


def test_a_webhook_storm_is_grouped_when_asked_and_a_failed_group_is_retried_whole(redis_client: Any) -> None:
    """The generic webhook groups only when ``group_wait_s`` is set (a machine receiver's contract
    does not change under it): then a storm is a few ``llm-watchdog.alert-group/v1`` bodies, each
    listing its incidents as v1 objects with their page ids. The first POST fails (503): the whole
    group is retried and no incident is lost or listed twice."""
    n = 200
    with AlertSink() as sink:
        sink.fail_next(1, status=503)
        channels = [{"kind": "webhook", "url": sink.url, "group_wait_s": 0.5}]
        with pager(redis_client, channels):
            storm(redis_client, "rollback", n)
            wait(lambda: sum(len(r.body["alerts"]) for r in sink.accepted) >= n, 15, "every incident")
            time.sleep(1.0)
    bodies = [r.body for r in sink.accepted]
    items = [a for b in bodies for a in b["alerts"]]
    print(f"\nwebhook storm: {n} rollbacks -> {len(bodies)} grouped bodies "
          f"({[b['count'] for b in bodies]}), {len(sink.received) - len(bodies)} failed POST retried")
    assert {b["schema"] for b in bodies} == {"llm-watchdog.alert-group/v1"}
    assert Counter(a["route"] for a in items) == Counter({f"r{i}": 1 for i in range(n)})
    assert len({a["id"] for a in items}) == n and all(b["omitted"] == 0 and b["count"] == len(b["alerts"])
                                                     for b in bodies)
    assert len(bodies) <= 4 and len(sink.received) == len(bodies) + 1
    assert all(r.headers.get("Idempotency-Key") == r.body["id"] for r in sink.accepted)
    assert len({b["id"] for b in bodies}) == len(bodies)


def _alert(i: int, summary: str, status: str = "firing") -> Alert:
    return Alert(f"m/r{i}/p", status, "critical", summary, summary, "rollback", 1_790_000_000.0,  # type: ignore[arg-type]
                 model="m", route=f"r{i}", policy="p", url="http://wd:9464/evidence/e1", page_id=f"llmwd:{i}-0:0")


def test_grouped_bodies_stay_within_the_receivers_limits_and_count_what_they_cannot_list() -> None:
    """The pure formatting, past what ``group_max`` allows: 700 incidents with 10,000-character
    summaries (emoji, CJK) to Slack list what fits 50 blocks of 3,000 characters and count the rest
    with a link to the status page; 200 incidents with 100 KB summaries to the webhook fit 256 KiB,
    listed or counted in ``omitted``."""
    text = "FP8 rolled back on route rX (m) 🧑‍🚀 漢字 " * 250
    slack = build_channel({"kind": "slack", "url": "http://x"})
    alerts = [_alert(i, text) for i in range(700)]
    body = slack.group_payload(alerts, "gid")
    blocks = body["attachments"][0]["blocks"]
    assert len(blocks) == limits.SLACK_MAX_BLOCKS
    sections = [b["text"]["text"] for b in blocks if b["type"] == "section"]
    assert all(limits.size(t) <= limits.SLACK_BLOCK_TEXT_MAX for t in sections)
    lines = sum(t.count("\n• ") + t.startswith("• ") for t in sections)
    more = re.search(r"and (\d+) more incidents: <http://wd:9464/status\|watchdog status>", sections[-1])
    assert more and lines + int(more[1]) == 700
    assert body["text"].startswith("[CRITICAL] 700 incidents: 700 firing (700 rollback), 1 model")
    assert len(slack.body(alerts, "gid")) < 200_000

    hook = build_channel({"kind": "webhook", "url": "http://x", "group_wait_s": 1})
    big = [_alert(i, "x" * 100_000, "resolved" if i % 2 else "firing") for i in range(200)]
    data = hook.body(big, "gid")
    parsed = __import__("json").loads(data)
    assert len(data) <= limits.WEBHOOK_BODY_MAX_BYTES
    assert len(parsed["alerts"]) + parsed["omitted"] == 200 and parsed["omitted"] == 0
    assert (parsed["firing"], parsed["resolved"], parsed["status"]) == (100, 100, "firing")
    # one alert: the ordinary v1 body, as before grouping
    assert "alerts" not in __import__("json").loads(hook.body([big[0]], None))


def test_group_settings_are_checked_with_their_position(tmp_path: Path) -> None:
    """``group_wait_s`` and ``group_max`` are validated at load with ``file:line:col``; Alertmanager
    and PagerDuty group on their own side and refuse ``group_wait_s``."""
    cases = {
        "    - kind: pagerduty\n      routing_key: k\n      group_wait_s: 2\n":
            (3, "pagerduty groups alerts on its own side"),
        "    - kind: alertmanager\n      url: http://am:9093\n      group_wait_s: 1\n":
            (3, "alertmanager groups alerts on its own side"),
        "    - kind: slack\n      url: http://x\n      group_wait_s: -1\n": (3, "greater than or equal to 0"),
        "    - kind: webhook\n      url: http://x\n      group_max: 1\n": (3, "greater than or equal to 2"),
    }
    for i, (channel, (line, words)) in enumerate(cases.items()):
        path = tmp_path / f"c{i}.yaml"
        path.write_text("alerts:\n  channels:\n" + channel)
        with pytest.raises(ConfigError) as exc:
            load_config(path, env={})
        msg = str(exc.value)
        assert len(msg.splitlines()) == 1 and re.match(rf"{re.escape(str(path))}:{line + 2}:\d+: ", msg), msg
        assert words in msg, msg
    ok = tmp_path / "ok.yaml"
    ok.write_text("alerts:\n  channels:\n    - kind: slack\n      url: http://x\n    - kind: webhook\n"
                  "      url: http://y\n      group_wait_s: 0.5\n      group_max: 50\n")
    cfg = load_config(ok, env={})
    slack, hook = (build_channel(c) for c in cfg.alerts.channels)
    assert (slack.group_wait_s, slack.group_max, hook.group_wait_s, hook.group_max) == (1.0, 100, 0.5, 50)
    assert build_channel({"kind": "webhook", "url": "http://x"}).group_wait_s == 0
    assert build_channel({"kind": "slack", "url": "http://x", "group_wait_s": 0}).group_wait_s == 0
    with pytest.raises(ValueError, match="groups alerts on its own side"):
        channel_config({"kind": "alertmanager", "url": "http://am", "group_wait_s": 1})
