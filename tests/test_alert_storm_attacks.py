"""Attacks on storm grouping: what a fleet does to a grouping channel in a bad hour, against the real
pager, alerter, Redis and local HTTP receivers (``AlertSink``). Each test counts incidents exactly:
every incident listed once (or, where a receiver may legitimately get a copy, deduplicable by an id
it was given), no resolve before its trigger, nothing left owed in Redis."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from tests.test_alert_storms import listed, slack_routes, within_slack_limits
from tests.test_pages import act, dispatch, pager, wait
from watchdog.core.keys import Keys
from watchdog.core.signals import Action
from watchdog.dev.alertsink import AlertSink
from watchdog.dev.embedded import free_port

pytestmark = pytest.mark.services

GROUP = "g"
#: what a judge writes as the reason of a rollback: ~600 characters
REASON = "exact-match drift p=0.0003 (CI 0.012-0.031) over 4,096 golden prompts, 3 windows; " * 7


def owed(client: Any, *channels: str) -> int:
    """Records not yet paged plus pages not yet delivered, read now (``Pager.backlog`` is up to 1 s old)."""
    return int(client.xlen(Keys().outbox)) + sum(int(client.xlen(Keys().pages(GROUP, c))) for c in channels)


def route_lines(sink: AlertSink) -> list[tuple[str, str]]:
    """(route, firing|resolved) of every route incident the Slack messages list (ops ones left out)."""
    return [x for r in sink.accepted if isinstance(r.body, dict) and "attachments" in r.body
            and ("route" in r.body["text"] or "incidents" in r.body["text"]) for x in listed(r.body)]


def verdict(route: str, kind: str = "rollback") -> Action:
    """A rollback (or promote) of ``route`` with a judge's reason of realistic length."""
    return Action(kind=kind, policy="p", model="m", route=route, reason=f"{kind} on {route}: {REASON}",  # type: ignore[arg-type]
                  severity="critical" if kind == "rollback" else "warning", at=1_790_000_000.0)


class SizeLimitedSink(AlertSink):
    """A receiver that refuses a body over ``max_bytes`` with 413, as Express's ``express.json()``
    does past its default 100 kB (nginx past ``client_max_body_size``, 1 MB by default)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes

    def _record(self, path: str, body: Any, headers: dict[str, str]) -> int:
        big = int(headers.get("Content-Length") or 0) > self.max_bytes
        with self._cond:
            self.status = 413 if big else 200
        return super()._record(path, body, headers)


def test_a_group_refused_as_too_large_is_split_not_given_up(redis_client: Any) -> None:
    """A webhook receiver behind Express's default body limit (100 kB) and a storm of 200
    rollbacks, each with a judge's reason of ~600 characters. One incident's message is ~2 kB and
    always went through; a group of 100 is ~150 kB and is answered 413. Before: the channel gave the
    whole group up (413 is not retried) and deleted its pages: 200 rollbacks never reached on-call.
    A refused group must be split until its parts fit; only one message refused alone is given up."""
    n = 200
    with SizeLimitedSink(100_000) as sink:
        channels = [{"kind": "webhook", "url": sink.url, "group_wait_s": 0.3}]
        with pager(redis_client, channels) as p:
            for b in range(10):
                dispatch(redis_client, *(verdict(f"r{i}") for i in range(b * 20, (b + 1) * 20)))
                time.sleep(0.05)
            wait(lambda: owed(redis_client, "webhook") == 0, 15, "every page delivered or given up")
            time.sleep(0.3)
            stats = p.alerter.stats()["channels"]["webhook"]
    items = [a for r in sink.accepted for a in r.body.get("alerts", [r.body])]
    refused = [r for r in sink.received if r.status == 413]
    print(f"\n413 receiver: {len(sink.received)} POSTs, {len(refused)} refused (413), {len(sink.accepted)} accepted "
          f"listing {len(items)} incidents ({len({a['route'] for a in items})} distinct); failed {stats['failed']}")
    assert Counter(a["route"] for a in items) == Counter({f"r{i}": 1 for i in range(n)})
    assert stats["failed"] == 0


class PoisonSink(AlertSink):
    """A receiver that refuses (400, as Slack's ``invalid_blocks``) any body mentioning ``word``."""

    def __init__(self, word: str) -> None:
        super().__init__()
        self.word = word

    def _record(self, path: str, body: Any, headers: dict[str, str]) -> int:
        with self._cond:
            self.status = 400 if self.word in json.dumps(body) else 200
        return super()._record(path, body, headers)


def test_one_message_the_receiver_refuses_costs_only_itself_not_its_group(redis_client: Any) -> None:
    """Slack refuses a body it cannot render with 400. Before grouping, the one message it refused
    was given up alone; a group of 50 holding it was given up whole, 49 incidents with it. The group
    is split until the refused message is alone: 49 delivered, 1 given up, in a few requests."""
    n = 50
    with PoisonSink("r13 ") as sink:
        channels = [{"kind": "slack", "url": sink.url + "/slack", "min_interval_s": 0.05}]
        with pager(redis_client, channels) as p:
            dispatch(redis_client, *(act(f"r{i}", "rollback") for i in range(n)))
            wait(lambda: len(slack_routes(sink)) >= n - 1, 15, "every other incident listed")
            wait(lambda: owed(redis_client, "slack") == 0, 5, "an empty page stream")
            time.sleep(0.3)
            stats = p.alerter.stats()["channels"]["slack"]
    got = Counter(slack_routes(sink))
    print(f"\none refused message in a group of {n}: {len(sink.received)} POSTs, {len(sink.accepted)} accepted "
          f"listing {sum(got.values())} incidents; failed {stats['failed']}")
    assert got == Counter({(f"r{i}", "firing"): 1 for i in range(n) if i != 13})
    assert stats["failed"] == 1 and len(sink.received) <= 2 * 6 + 1
    for r in sink.accepted:
        within_slack_limits(r)


class SlowFirstSink(AlertSink):
    """Records every POST; answers the first ``slow`` of them only after ``delay`` seconds (a
    receiver that got the message and is slow to say so), the others at once."""

    def __init__(self, slow: int, delay: float) -> None:
        super().__init__()
        self.slow, self.delay = slow, delay

    def _record(self, path: str, body: Any, headers: dict[str, str]) -> int:
        with self._cond:
            self.delay_s = self.delay if len(self.received) < self.slow else 0.0
        return super()._record(path, body, headers)


def test_a_group_retried_after_no_answer_keeps_its_id_and_its_members(redis_client: Any) -> None:
    """A webhook receiver deduplicating by ``Idempotency-Key`` (what the key is for) got a group of
    30 rollbacks but answered after the channel's timeout; 30 more routes roll back meanwhile. The
    retry must be the same group with the same key, so the receiver drops it as a copy; the new 30 go
    in a message of their own. Before: the retry took the 30 new ones in too, so it carried a new key
    and the receiver listed the first 30 twice."""
    with SlowFirstSink(slow=1, delay=1.5) as sink:
        channels = [{"kind": "webhook", "url": sink.url, "group_wait_s": 1.0, "timeout_s": 0.3}]
        with pager(redis_client, channels):
            dispatch(redis_client, *(act(f"a{i}", "rollback") for i in range(30)))
            sink.wait_for(1, timeout=5, accepted=False)
            dispatch(redis_client, *(act(f"b{i}", "rollback") for i in range(30)))
            wait(lambda: owed(redis_client, "webhook") == 0 and len(sink.received) >= 2, 15, "every page delivered")
            time.sleep(0.5)
    kept: dict[str, Any] = {}
    for r in sink.received:  # the receiver's view: the first body of each key
        kept.setdefault(r.headers.get("Idempotency-Key") or "", r.body)
    routes = Counter(a["route"] for b in kept.values() for a in b.get("alerts", [b]))
    posts = [(round(r.at - sink.received[0].at, 2), r.body.get("count", 1)) for r in sink.received]
    print(f"\nslow answer to a group: POSTs (s, incidents) {posts}, {len(kept)} distinct keys "
          f"({[b.get('count', 1) for b in kept.values()]} incidents each); "
          f"{sum(routes.values()) - len(routes)} listed twice after dedup by key")
    assert routes == Counter({f"{x}{i}": 1 for x in "ab" for i in range(30)})


def test_an_ops_alert_is_not_held_behind_a_backlog_of_full_groups(redis_client: Any) -> None:
    """Slack was down during a storm; 128 rollbacks wait in Redis. It comes back, and at that moment
    the daemon raises an ops alert (a policy edit rejected, a flag lost from Redis). Scaled down 5x
    (groups of 16, so the channel holds two full groups as it holds two of 100 by default; Slack's one
    message a second): the backlog of 128 drains as 8 groups over ~8 s. The ops alert
    must go at once (the docs: "never held for grouping"), not after every full group: a full group
    is always ready, so before it waited for the whole backlog (at Slack's defaults and a backlog of
    5,000 pages, 50 s)."""
    n = 128
    with AlertSink() as sink:
        sink.status = 503
        channels = [{"kind": "slack", "url": sink.url + "/slack", "group_max": 16}]
        with pager(redis_client, channels, backoff_initial=0.2, backoff_max=0.4) as p:
            dispatch(redis_client, *(act(f"r{i}", "rollback") for i in range(n)))
            wait(lambda: redis_client.xlen(Keys().outbox) == 0 and len(sink.received) >= 2, 10, "the storm paged")
            sink.status = 200
            sink.wait_for(1, timeout=5)
            t0 = time.monotonic()
            p.alerter.ops_alert("policy-reload", "policy edit rejected: p.yaml:3:5: unknown field", "critical")
            wait(lambda: any("policy edit rejected" in r.body["text"] for r in sink.accepted), 10, "the ops alert")
            took = time.monotonic() - t0
            wait(lambda: len(route_lines(sink)) >= n, 20, "every rollback listed")
    texts = [r.body["text"] for r in sink.accepted]
    at = next(i for i, t in enumerate(texts) if "policy edit rejected" in t)
    print(f"\nops alert during a backlog of {n} pages: delivered {took:.2f} s after it was raised, message "
          f"{at + 1} of {len(texts)} after the receiver came back")
    assert Counter(route_lines(sink)) == Counter({(f"r{i}", "firing"): 1 for i in range(n)})
    assert took < 1.5 and at <= 2


def test_a_storm_through_a_receiver_down_then_slow_then_rate_limiting(redis_client: Any) -> None:
    """150 rollbacks and 75 of their resolves while Slack is down (connection refused), then slow
    (answers after the channel's timeout, having taken the message), then answering 429 with
    Retry-After, then well. Scaled down (a group waits 0.3 s, 20 a group, one message per 0.1 s). A
    receiver that drops copies by ``Idempotency-Key`` lists every rollback and resolve exactly once,
    each resolve in a later message than its trigger; Retry-After is honoured; nothing is left owed."""
    n, back = 150, 75
    port = free_port()
    sink = AlertSink(port=port)
    channels = [{"kind": "slack", "url": f"http://127.0.0.1:{port}/slack", "group_wait_s": 0.3, "group_max": 20,
                 "min_interval_s": 0.1, "timeout_s": 0.5}]
    try:
        with pager(redis_client, channels, backoff_initial=0.1, backoff_max=1.0) as p:
            for b in range(5):
                dispatch(redis_client, *(act(f"r{i}", "rollback") for i in range(b * 30, (b + 1) * 30)))
                dispatch(redis_client, *(act(f"r{i}", "promote") for i in range(b * 15, (b + 1) * 15)))
                time.sleep(0.2)
            time.sleep(1.0)  # down: connection refused
            sink.delay_s = 1.2  # slow: it takes the message and answers after the 0.5 s timeout
            sink.start()
            wait(lambda: len(sink.received) >= 2, 10, "two slow answers")
            sink.delay_s = 0.0
            sink.retry_after = 0.6
            sink.fail_next(3, status=429)
            wait(lambda: sum(r.status == 429 for r in sink.received) >= 3, 10, "three 429s")
            t429 = [r.at for r in sink.received if r.status == 429]
            wait(lambda: owed(redis_client, "slack") == 0, 30, "an empty page stream")
            time.sleep(0.5)
            stats = p.alerter.stats()["channels"]["slack"]
    finally:
        sink.stop()
    kept: dict[str, Any] = {}
    order: dict[tuple[str, str], int] = {}
    for i, r in enumerate(sink.accepted):  # what a receiver keeping the first of each key shows
        key = r.headers.get("Idempotency-Key") or ""
        if key not in kept:
            kept[key] = r.body
            for x in listed(r.body):
                order.setdefault(x, i)
    shown = Counter(x for b in kept.values() for x in listed(b))
    raw = Counter(x for r in sink.accepted for x in listed(r.body))
    gaps = [round(b - a, 2) for a, b in zip(t429, t429[1:], strict=False)]
    print(f"\ndown/slow/429: {len(sink.received)} POSTs ({sum(r.status == 429 for r in sink.received)} 429, "
          f"{len(sink.accepted)} accepted, {len(kept)} distinct keys); {sum(raw.values()) - len(raw)} lines seen "
          f"twice without dedup, {sum(shown.values()) - len(shown)} with; gaps between 429s {gaps} s; "
          f"failed {stats['failed']}, dropped {stats['dropped']}")
    want = {(f"r{i}", "firing") for i in range(n)} | {(f"r{i}", "resolved") for i in range(back)}
    assert shown == Counter(dict.fromkeys(want, 1))
    assert all(order[(f"r{i}", "firing")] < order[(f"r{i}", "resolved")] for i in range(back))
    assert stats["failed"] == 0 and stats["dropped"] == 0
    assert all(g >= 0.55 for g in gaps)  # Retry-After: 0.6 s (within clock jitter of two processes)


_CHILD = """
import sys, time, redis
sys.path.insert(0, {root!r})
from tests.test_pages import pager
client = redis.Redis(port={port}, decode_responses=True)
with pager(client, {channels!r}, instance="i1", lease_ttl_s=1.0, max_in_flight=2):
    print("up", flush=True)
    time.sleep(60)
"""


def test_a_daemon_killed_with_groups_in_flight_loses_nothing_and_resends_only_those(
        redis_client: Any, tmp_path: Any) -> None:
    """The daemon is SIGKILLed while grouped messages are on the wire (the receiver has them and
    has not answered: no XDEL yet) and pages wait for their group. A new process (lease 1 s) lists
    every route; only the groups that were in flight at the kill are listed a second time."""
    import os
    import signal
    import subprocess
    import sys

    n = 200
    with AlertSink(delay_s=0.8) as sink:
        channels = [{"kind": "slack", "url": sink.url + "/slack", "group_max": 20, "min_interval_s": 0.1,
                     "timeout_s": 5}]
        port = redis_client.connection_pool.connection_kwargs["port"]
        code = _CHILD.format(root=os.getcwd(), port=port, channels=channels)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                 stderr=(tmp_path / "child.log").open("w"))
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "up"
            dispatch(redis_client, *(act(f"r{i}", "rollback") for i in range(n)))
            wait(lambda: len(sink.received) >= 4, 15, "four groups on the wire")
            time.sleep(0.3)  # two of them still waiting for their answer
            child.send_signal(signal.SIGKILL)
            child.wait(5)
        finally:
            if child.poll() is None:
                child.kill()
        before = list(sink.received)
        answered = [r for r in before if r.at < time.time() - 0.8]
        left = redis_client.xlen(Keys().pages(GROUP, "slack"))
        with pager(redis_client, channels, instance="i2", lease_ttl_s=1.0):
            wait(lambda: owed(redis_client, "slack") == 0, 30, "an empty page stream")
            time.sleep(1.0)
    got = Counter(x for r in sink.received for x in listed(r.body))
    twice = {x for x, c in got.items() if c > 1}
    in_flight = {x for r in before[len(answered):] for x in listed(r.body)}
    print(f"\nSIGKILL with groups in flight: {len(before)} groups sent before the kill, {left} pages left in Redis; "
          f"{len(sink.received)} messages in all, {len(got)} of {n} routes listed, {len(twice)} twice "
          f"(in flight at the kill: {len(in_flight)})")
    assert set(got) == {(f"r{i}", "firing") for i in range(n)}
    assert max(got.values()) <= 2 and twice <= in_flight


def test_a_webhook_group_of_200_lists_every_incident_with_tenant_prefixed_routes() -> None:
    """A webhook with ``group_max`` 200 and routes named as fleets name them
    (``tenant-acme-corp/chat-completions-eu-west-1-prod-tier2-0001-...``, 80 to 140 characters), a
    judge's reason of ~1,200 characters and evidence links: the group must list all 200 within
    256 KiB, the reasons cut shorter, rather than only count some (``omitted``). Before: 8 of 200
    only counted at 140 characters (the texts' share assumed 700 bytes for the other fields, and
    each text kept 304 bytes whatever the names took)."""
    from watchdog.alerting import limits
    from watchdog.alerting.channels import build_channel
    from watchdog.alerting.incidents import IncidentBook

    hook = build_channel({"kind": "webhook", "url": "http://x", "group_wait_s": 1, "group_max": 200})
    for length in (80, 100, 140):
        book = IncidentBook(evidence_url="http://llm-watchdog.ml-platform.svc.cluster.local:9464")
        alerts = []
        for i in range(200):
            route = f"tenant-acme-corp/chat-completions-eu-west-1-prod-tier2-{i:04d}-" + "x" * 100
            action = Action(kind="rollback", policy="fp8-quality-guard-golden-replay", route=route[:length],
                            model="meta-llama/Llama-3.1-405B-Instruct-FP8", reason=REASON * 2, severity="critical",
                            at=1_790_000_000.0, detail={"evidence_id": f"{i:032x}"})
            alerts += [replace(a, page_id=f"llmwd:1796032800000-{i}:0") for a in book.on_action(action)]
        data = hook.body(alerts, "gid")
        body = json.loads(data)
        print(f"\nwebhook group of 200, routes of {length} chars: {len(data)} bytes, {len(body['alerts'])} listed, "
              f"{body['omitted']} only counted, summaries cut to {len(body['alerts'][0]['summary'].encode())} bytes")
        assert len(data) <= limits.WEBHOOK_BODY_MAX_BYTES
        assert body["omitted"] == 0 and [a["route"] for a in body["alerts"]] == [a.route for a in alerts]


def test_a_flapping_route_inside_a_storm_keeps_its_order_one_state_per_message(redis_client: Any) -> None:
    """Route ``f`` rolls back, is promoted and rolls back again within one group wait, amid 40 other
    rollbacks, with Alertmanager and PagerDuty beside Slack. Slack: each of ``f``'s three messages in
    its own message, in order, every other route once. PagerDuty and Alertmanager: per incident, as
    without grouping (trigger, resolve, trigger for ``f``)."""
    with AlertSink() as sink:
        channels = [{"kind": "slack", "url": sink.url + "/slack", "group_wait_s": 0.3, "min_interval_s": 0.1},
                    {"kind": "pagerduty", "url": sink.url + "/pd", "routing_key": "k"},
                    {"kind": "alertmanager", "url": sink.url + "/am"}]
        with pager(redis_client, channels):
            dispatch(redis_client, act("f", "rollback"), *(act(f"r{i}", "rollback") for i in range(20)),
                     act("f", "promote"), *(act(f"r{i}", "rollback") for i in range(20, 40)), act("f", "rollback"))
            wait(lambda: len(route_lines(sink)) >= 43 and sum(r.path == "/pd" for r in sink.accepted) >= 43
                 and sum(r.path.startswith("/am") for r in sink.accepted) >= 43, 10, "every page")
            wait(lambda: owed(redis_client, "slack", "pagerduty", "alertmanager") == 0, 5, "nothing owed")
            time.sleep(0.5)
    slack = [listed(r.body) for r in sink.accepted if r.path == "/slack"]
    flaps = [(i, s) for i, lines in enumerate(slack) for (route, s) in lines if route == "f"]
    pd = [b["event_action"] for r in sink.accepted if r.path == "/pd" for b in [r.body] if b["dedup_key"] == "m/f/p"]
    am = [("resolved" if a.get("endsAt") else "firing") for r in sink.accepted if r.path.startswith("/am") for a in r.body
          if a["labels"]["route"] == "f"]
    print(f"\nflapping route in a storm: Slack {len(slack)} messages, f in {flaps}; PagerDuty {pd}; Alertmanager {am}")
    assert [s for _, s in flaps] == ["firing", "resolved", "firing"]
    assert len({i for i, _ in flaps}) == 3 and [i for i, _ in flaps] == sorted(i for i, _ in flaps)
    assert Counter(x for lines in slack for x in lines if x[0] != "f") == Counter(
        {(f"r{i}", "firing"): 1 for i in range(40)})
    assert pd == ["trigger", "resolve", "trigger"] and am[:3] == ["firing", "resolved", "firing"]
