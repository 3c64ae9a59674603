"""Pages from the outbox, one channel at a time: a dead channel holds back only itself, every page
arrives once (by id) through refusal and slowness, a restart resumes each channel where it stood.

Real parts only: the shared redis-server (``redis_client``), the real ``Pager``/``Alerter`` and local
HTTP receivers (``AlertSink``) on free ports; "refused" is a port nothing listens on yet.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from watchdog.actuation.outbox import Pager, action_record
from watchdog.alerting.alerter import Alerter
from watchdog.alerting.message import Alert
from watchdog.alerting.queue import Delivery, DeliveryQueue
from watchdog.core.keys import Keys
from watchdog.core.signals import Action
from watchdog.dev.alertsink import AlertSink
from watchdog.dev.embedded import free_port

pytestmark = pytest.mark.services

GROUP = "g"
FAST = {"backoff_initial": 0.05, "backoff_max": 0.5}


def act(route: str, kind: str = "alert", severity: str = "warning") -> Action:
    return Action(kind=kind, policy="p", model="m", route=route, reason=f"{kind} on {route}", severity=severity,  # type: ignore[arg-type]
                  at=1_790_000_000.0)


def dispatch(client: Any, *actions: Action) -> None:
    """What ``flip.lua`` and ``checkpoint.lua`` do: one outbox record per action."""
    for a in actions:
        client.xadd(Keys().outbox, {"json": action_record(a, "i1")})


@contextmanager
def pager(client: Any, channels: list[dict[str, Any]], instance: str = "i1", lease_ttl_s: float = 10.0,
          **kw: Any) -> Iterator[Pager]:
    """An alerter and its pager, pumped every 20 ms as the daemon's loop does; stopped on exit."""
    alerter = Alerter(channels, **{**FAST, **kw}).start()
    p = Pager(client, Keys(), GROUP, instance, alerter, lease_ttl_s=lease_ttl_s)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            p.pump()
            stop.wait(0.02)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield p
    finally:
        stop.set()
        t.join(2)
        if alerter.stop(5):  # as the daemon stops: the leases go to the next replica once nothing is in flight
            p.release()


def ids(sink: AlertSink) -> list[str]:
    return [r.body["id"] for r in sink.accepted if isinstance(r.body, dict)]


def wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_queue_keeps_each_incident_in_order_and_lets_others_pass() -> None:
    q = DeliveryQueue(max_queue=3)
    a1, a2, b1 = (Delivery(Alert(k, "firing", "warning", "s", "d", "alert", 0.0)) for k in ("a", "a", "b"))
    for d in (a1, a2, b1):
        q.put(d)
    assert q.take(0.0) is a1
    assert q.take(0.0) is b1  # a2 waits behind a1 in flight; b goes past
    assert q.take(0.0) is None
    a1.due = 5.0
    q.retry(a1)
    assert q.take(1.0) == 4.0  # a1 waits out its retry, and a2 with it
    assert q.take(5.0) is a1
    q.finish(a1)
    assert q.take(5.0) is a2
    # in-memory messages are bounded (in flight included), durable ones are not dropped
    assert [d.alert.key for d in q.put(Delivery(Alert("c", "firing", "warning", "s", "d", "alert", 0.0)))] == []
    dropped = q.put(Delivery(Alert("e", "firing", "warning", "s", "d", "alert", 0.0)))
    assert [d.alert.key for d in dropped] == ["c"]
    assert q.put(Delivery(Alert("f", "firing", "warning", "s", "d", "alert", 0.0), entry="1-0")) == []
    assert (q.in_memory(), q.durable()) == (3, 1)


def test_a_refusing_channel_does_not_hold_back_the_other(redis_client: Any) -> None:
    dead_port = free_port()  # nothing listens there: connection refused
    with AlertSink() as good, pager(redis_client, [
            # one message per page (no storm grouping): this test counts Slack's pages one by one
            {"kind": "slack", "url": f"http://127.0.0.1:{dead_port}/slack", "timeout_s": 1, "group_wait_s": 0},
            {"kind": "pagerduty", "url": good.url + "/pd", "routing_key": "k"}]) as p:
        t0 = time.monotonic()
        dispatch(redis_client, act("chat", "rollback"))
        good.wait_for(1, timeout=2)
        took = time.monotonic() - t0
        # the page is gone from the outbox and from PagerDuty's stream; Slack's still holds it
        wait(lambda: p.backlog() == {"slack": 1, "pagerduty": 0}, 3, "the backlog per channel")
        assert redis_client.xlen(Keys().outbox) == 0
        stats = p.alerter.stats()["channels"]
        assert stats["slack"]["retried"] >= 1 and "ConnectError" in stats["slack"]["last_error"]
        t1 = time.monotonic()
        dispatch(redis_client, act("code", "rollback"))
        good.wait_for(2, timeout=2)
        took2 = time.monotonic() - t1
        # Slack comes back: its two pages arrive and its stream is emptied
        with AlertSink(port=dead_port) as slack:
            slack.wait_for(2, timeout=5)
            wait(lambda: p.backlog() == {"slack": 0, "pagerduty": 0}, 3, "an empty backlog")
    print(f"\nPagerDuty pages with Slack refusing: {took:.3f} s after dispatch (first, threads starting), "
          f"{took2:.3f} s (second)")
    assert took < 2.0 and took2 < 2.0
    assert [r.body["dedup_key"] for r in good.accepted] == ["m/chat/p", "m/code/p"]
    assert sorted("`chat`" in r.body["attachments"][0]["blocks"][2]["elements"][0]["text"]
                  for r in slack.accepted) == [False, True]


def test_drill_refused_then_slow_every_page_arrives_exactly_once(redis_client: Any) -> None:
    n, refused_s, delay_s = 32, 3.0, 1.0  # 4x the 8 in flight: a queue behind every slot
    port = free_port()
    sink = AlertSink(port=port, delay_s=delay_s)
    with pager(redis_client, [{"kind": "webhook", "url": f"http://127.0.0.1:{port}", "timeout_s": 3}],
               max_in_flight=8, backoff_max=1.0) as p:
        t0 = time.monotonic()
        dispatch(redis_client, *(act(f"r{i}") for i in range(n)))
        time.sleep(refused_s)
        sink.start()  # the endpoint comes back, answering each POST after delay_s (< timeout_s)
        try:
            wait(lambda: len(ids(sink)) >= n, 18, f"{n} pages")
            done = time.monotonic() - t0
            time.sleep(1.5)  # anything sent twice would land now
            wait(lambda: p.backlog() == {"webhook": 0}, 3, "an empty page stream")
        finally:
            sink.stop()
    got = Counter(ids(sink))
    missing, twice = n - len(got), sum(c - 1 for c in got.values())
    print(f"\ndrill: {n} dispatched, refused {refused_s:.0f} s then {delay_s:.1f} s per answer: "
          f"{len(got)} delivered in {done:.1f} s, {missing} missing, {twice} twice; "
          f"{p.alerter.retried} retried attempts")
    assert (missing, twice, len(sink.received)) == (0, 0, n)
    assert p.alerter.failed == 0 and redis_client.xlen(Keys().outbox) == 0


def test_restart_mid_delivery_resumes_each_channel_without_loss_or_duplicates(redis_client: Any) -> None:
    n = 24
    with AlertSink() as fast, AlertSink(delay_s=0.3) as slow:
        channels_at = {"fast": fast.url, "slow": slow.url}
        channels = [{"kind": "webhook", "name": k, "url": u, "timeout_s": 2} for k, u in channels_at.items()]
        # the outbox as the old pager (consumer group "pager") left it: r0 delivered and acknowledged,
        # r1 and r2 read but not acknowledged when it stopped
        dispatch(redis_client, act("r0"), act("r1"), act("r2"))
        redis_client.xgroup_create(Keys().outbox, "pager", id="0", mkstream=True)
        first_id = redis_client.xreadgroup("pager", "i1", {Keys().outbox: ">"}, count=3)[0][1][0][0]
        redis_client.xack(Keys().outbox, "pager", first_id)
        with pager(redis_client, channels, max_in_flight=2):
            dispatch(redis_client, *(act(f"r{i}") for i in range(3, n)))
            fast.wait_for(n - 1, timeout=5)
            wait(lambda: len(slow.accepted) >= 5, 5, "five slow pages")
            # stopped mid-delivery (SIGTERM): the slow channel's requests in flight end, the rest wait in Redis
        first = len(slow.accepted)
        left = redis_client.xlen(Keys().pages(GROUP, "slow"))
        assert 0 < left < n and redis_client.xlen(Keys().pages(GROUP, "fast")) == 0
        with pager(redis_client, channels, max_in_flight=2) as p2:
            wait(lambda: len(slow.accepted) >= n - 1, 10, "the slow channel's pages after the restart")
            time.sleep(0.5)
            wait(lambda: p2.backlog() == {"fast": 0, "slow": 0}, 3, "empty page streams")
    print(f"\nrestart: slow channel had {first}/{n - 1} before the restart, {left} left in Redis, "
          f"{len(slow.accepted)} after; fast channel {len(fast.accepted)}")
    for sink in (fast, slow):
        got = Counter(ids(sink))
        assert len(got) == n - 1 and max(got.values()) == 1, got.most_common(3)
        assert {r.body["route"] for r in sink.accepted} == {f"r{i}" for i in range(1, n)}  # r0 was delivered before
    assert "pager" not in [g["name"] for g in redis_client.xinfo_groups(Keys().outbox)]


def test_receivers_idempotency_keys_are_stable(redis_client: Any) -> None:
    with AlertSink() as sink:
        channels = [{"kind": "pagerduty", "url": sink.url + "/pd", "routing_key": "k"},
                    {"kind": "alertmanager", "url": sink.url + "/am", "resend_interval_s": 3600},
                    {"kind": "webhook", "url": sink.url + "/hook"}]
        sink.fail_next(2, status=503)  # the first two POSTs fail and are retried
        with pager(redis_client, channels):
            dispatch(redis_client, act("chat", "rollback"))
            sink.wait_for(3, timeout=5)
        with pager(redis_client, channels):  # a restart between the trigger and its resolve
            dispatch(redis_client, act("chat", "promote"))
            sink.wait_for(6, timeout=5)
    posts: dict[str, list[Any]] = {}
    for r in sink.received:
        posts.setdefault(r.path, []).append(r)
    pd = [r.body for r in posts["/pd"] if r.accepted]
    assert [(b["event_action"], b["dedup_key"]) for b in pd] == [("trigger", "m/chat/p"), ("resolve", "m/chat/p")]
    am = [r.body[0] for r in posts["/am/api/v2/alerts"] if r.accepted]
    assert len(am) == 2 and am[0]["labels"] == am[1]["labels"] and "endsAt" in am[1]
    # a retried POST carries the same id (body and Idempotency-Key header) as the one that failed
    for path in posts:
        tried = [(r.body["id"] if path == "/hook" else r.headers.get("Idempotency-Key")) for r in posts[path]]
        assert len(set(tried)) == len([r for r in posts[path] if r.accepted]), (path, tried)
    hook = [r.body["id"] for r in posts["/hook"] if r.accepted]
    assert all(i.startswith("llmwd:") for i in hook) and len(set(hook)) == 2


def test_two_replicas_share_the_outbox_without_losing_a_resolve_or_sending_twice(redis_client: Any) -> None:
    """Both replicas pump the outbox (one takes each record, in order: WATCH); one delivers the
    channel (its lease), so each incident's resolve reaches the receiver after its trigger."""
    n = 20
    with AlertSink() as sink:
        channels = [{"kind": "webhook", "url": sink.url}]
        with pager(redis_client, channels, instance="i1"), pager(redis_client, channels, instance="i2"):
            for i in range(n):  # each incident's trigger and resolve may be taken by either replica
                dispatch(redis_client, act(f"r{i}"), act(f"r{i}", "resolve"))
            sink.wait_for(2 * n, timeout=10)
            time.sleep(0.5)
    got = Counter((r.body["route"], r.body["status"]) for r in sink.accepted)
    assert got == Counter({(f"r{i}", s): 1 for i in range(n) for s in ("firing", "resolved")})
    assert len(set(ids(sink))) == 2 * n and redis_client.hlen(Keys().incidents(GROUP)) == 0
    order = [(r.body["route"], r.body["status"]) for r in sink.accepted]
    assert all(order.index((f"r{i}", "firing")) < order.index((f"r{i}", "resolved")) for i in range(n))


def test_a_channel_busy_with_slow_requests_keeps_its_lease(redis_client: Any) -> None:
    """Every sender thread of the channel waits on a slow receiver for longer than the lease's TTL:
    the pump renews the lease, so the other replica does not take over and send the pages again."""
    n = 8
    with AlertSink(delay_s=1.2) as sink:
        channels = [{"kind": "webhook", "url": sink.url, "timeout_s": 3}]
        with pager(redis_client, channels, instance="i1", lease_ttl_s=2.0, max_in_flight=2), \
                pager(redis_client, channels, instance="i2", lease_ttl_s=2.0, max_in_flight=2):
            dispatch(redis_client, *(act(f"r{i}") for i in range(n)))
            sink.wait_for(n, timeout=10)
            time.sleep(1.5)
    got = Counter(ids(sink))
    assert len(got) == n and len(sink.received) == n, got.most_common(3)


_PAGER_PROCESS = """
import sys, time, redis
from watchdog.actuation.outbox import Pager
from watchdog.alerting.alerter import Alerter
from watchdog.core.keys import Keys
client = redis.Redis(port=int(sys.argv[1]), decode_responses=True)
alerter = Alerter([{"kind": "webhook", "url": sys.argv[2], "timeout_s": 3}], max_in_flight=2,
                  backoff_initial=0.05, backoff_max=0.5).start()
pager = Pager(client, Keys(), "g", "i1", alerter)
while True:
    pager.pump()
    time.sleep(0.02)
"""


def test_sigkill_mid_delivery_loses_nothing_and_resends_only_what_was_in_flight(redis_client: Any) -> None:
    """A real crash: the pager's process is SIGKILLed while pages are on the wire. The restarted one
    delivers every page; a copy can only be a page that was in flight at the kill, with its id."""
    import subprocess
    import sys

    n = 16
    port = redis_client.connection_pool.connection_kwargs["port"]
    with AlertSink(delay_s=0.4) as sink:
        argv = [sys.executable, "-c", _PAGER_PROCESS, str(port), sink.url]
        proc = subprocess.Popen(argv)
        try:
            dispatch(redis_client, *(act(f"r{i}") for i in range(n)))
            wait(lambda: len(sink.received) >= 5, 10, "five pages")
            proc.kill()
            proc.wait(5)
            before = Counter(r.body["id"] for r in sink.received)
            proc = subprocess.Popen(argv)
            wait(lambda: len(set(ids(sink))) >= n, 15, f"{n} distinct pages after the restart")
            time.sleep(1.0)
        finally:
            proc.kill()
            proc.wait(5)
    got = Counter(ids(sink))
    copies = {i for i, c in got.items() if c > 1}
    print(f"\nSIGKILL: {sum(before.values())} POSTs before the kill, {len(got)} distinct of {n} after the "
          f"restart, {sum(got.values()) - len(got)} sent twice (in flight at the kill: at most 2)")
    assert len(got) == n and copies <= set(before) and len(copies) <= 2
    assert redis_client.xlen(Keys().pages(GROUP, "webhook")) == 0


def test_page_streams_hand_a_channel_to_its_lease_holder_only(redis_client: Any) -> None:
    """``PageStreams`` on real Redis: pages in order, none twice while held, None once another
    replica holds the channel's lease (the worker then forgets what it had not sent), and the head
    of the stream again when the lease comes back; a delivered page is deleted by its id."""
    from watchdog.actuation.pages import PageStreams

    streams = PageStreams(redis_client, Keys(), GROUP, "i1", lease_ttl_s=1.0)
    stream = streams.stream("slack")
    for i in range(3):
        redis_client.xadd(stream, {"json": Alert(f"k{i}", "firing", "warning", "s", "d", "alert", 0.0).to_json()})
    got = streams.fetch("slack", 10)
    assert got is not None and [a.key for _e, a in got] == ["k0", "k1", "k2"]
    assert streams.fetch("slack", 10) == []  # held: not handed out twice
    streams.ack("slack", got[0][0])
    assert redis_client.xlen(stream) == 2
    lease = Keys().lease(f"pages:{GROUP}:slack")
    redis_client.set(lease, "i2", px=5000)  # i1 lost it (it paused past the TTL) and i2 took it
    time.sleep(1.1)
    assert streams.fetch("slack", 10) is None
    redis_client.delete(lease)
    time.sleep(0.4)
    again = streams.fetch("slack", 10)
    assert again is not None and [a.key for _e, a in again] == ["k1", "k2"]
