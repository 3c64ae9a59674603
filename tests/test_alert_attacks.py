"""Attacks on paging: situations a fleet has every week, against the real pager, alerter, Redis and
local HTTP receivers. Each test counts pages exactly."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from tests.test_pages import act, dispatch, pager, wait
from watchdog.core.keys import Keys
from watchdog.dev.alertsink import AlertSink
from watchdog.dev.embedded import free_port

pytestmark = pytest.mark.services

GROUP = "g"


def _am_states(sink: AlertSink, route: str) -> list[str]:
    out = []
    for r in sink.accepted:
        for a in r.body:
            if a["labels"].get("route") == route:
                out.append("resolved" if a.get("endsAt") else "firing")
    return out


def test_a_resolved_incident_is_not_re_posted_firing_by_the_other_replica(redis_client: Any) -> None:
    """Two replicas, Alertmanager re-posting open incidents: one replica takes the trigger, the
    other (started meanwhile, so its book restored the incident) may take the resolve. After the
    resolve, no replica may re-post the incident as firing: Alertmanager would open it again."""
    with AlertSink() as sink:
        channels = [{"kind": "alertmanager", "url": sink.url, "resend_interval_s": 0.3}]
        with pager(redis_client, channels, instance="i1"):
            dispatch(redis_client, act("r0", "rollback"))
            wait(lambda: redis_client.hlen(Keys().incidents(GROUP)) == 1, 5, "the incident stored")
            with pager(redis_client, channels, instance="i2"):
                time.sleep(0.3)
                dispatch(redis_client, act("r0", "promote"))
                wait(lambda: "resolved" in _am_states(sink, "r0"), 5, "the resolve")
                resolved_at = len(sink.accepted)
                time.sleep(1.5)
                after = [s for r in sink.accepted[resolved_at:] for s in
                         ("resolved" if a.get("endsAt") else "firing" for a in r.body
                          if a["labels"].get("route") == "r0")]
    print(f"\nafter the resolve: {Counter(after)} re-posts of r0")
    assert "firing" not in after


def test_a_slow_receiver_gets_each_page_a_few_times_at_most_and_all_pages_go_through(redis_client: Any) -> None:
    """A receiver that answers every POST after longer than the channel's ``timeout_s`` (Slack
    answering in 30 s with the default 5 s), scaled down 10x: it gets each POST, but no answer comes
    within the timeout. The channel must find out it is slow and wait longer, not send the same page
    again every backoff while every other page waits behind it."""
    n = 6
    with AlertSink(delay_s=3.0) as sink:
        channels = [{"kind": "webhook", "url": sink.url, "timeout_s": 0.5}]
        with pager(redis_client, channels, backoff_initial=0.1, backoff_max=1.0, max_in_flight=4):
            dispatch(redis_client, *(act(f"r{i}") for i in range(n)))
            deadline = time.monotonic() + 25
            while time.monotonic() < deadline and len({r.body["id"] for r in sink.accepted}) < n:
                time.sleep(0.1)
            stream = Keys().pages(GROUP, "webhook")
            while time.monotonic() < deadline + 5 and redis_client.xlen(stream):
                time.sleep(0.1)  # the last answers come 3 s after the POSTs
            left = redis_client.xlen(stream)
    got = Counter(r.body["id"] for r in sink.received)
    print(f"\nslow receiver: {len(sink.received)} POSTs, {len(got)} distinct of {n}, copies per page "
          f"{sorted(got.values(), reverse=True)}, {left} still owed after 25 s")
    assert left == 0 and len(got) == n
    # copies: the first POSTs of the burst, and the probe's while the timeout doubles (0.5, 1, 2, 4 s)
    assert max(got.values()) <= 4 and len(sink.received) <= 2 * n


class RateLimitedSink(AlertSink):
    """Accepts one POST per ``every_s`` (as Slack's 1 message a second per webhook); answers the
    others 429 (Retry-After is not sent by AlertSink: the channel's backoff decides)."""

    def __init__(self, every_s: float) -> None:
        super().__init__()
        self.every_s = every_s
        self._last = 0.0

    def _record(self, path: str, body: Any, headers: dict[str, str]) -> int:
        with self._cond:
            now = time.monotonic()
            ok = now - self._last >= self.every_s
            if ok:
                self._last = now
            self.status = 200 if ok else 429
        return super()._record(path, body, headers)


def test_a_storm_of_rollbacks_stays_within_the_receivers_rate_limit(redis_client: Any) -> None:
    """A model's FP8 build goes bad: ``n`` routes roll back in the same window, and the receiver
    takes one message per 0.1 s (Slack's one a second, scaled down 10x). Every page once, in about
    the time the limit allows, without a stream of 429s (one every few ms while 4 senders run)."""
    n = 40
    with RateLimitedSink(0.09) as sink:  # a little under the pace: the clocks of two processes
        channels = [{"kind": "webhook", "url": sink.url, "min_interval_s": 0.1}]
        with pager(redis_client, channels, backoff_initial=0.05, backoff_max=1.0):
            t0 = time.monotonic()
            dispatch(redis_client, *(act(f"r{i}", "rollback") for i in range(n)))
            sink.wait_for(n, timeout=60)
            took = time.monotonic() - t0
    got = Counter(r.body["id"] for r in sink.accepted)
    refused = sum(1 for r in sink.received if r.status == 429)
    print(f"\nstorm: {n} rollbacks -> {len(sink.accepted)} accepted ({len(got)} distinct), {refused} answered 429, "
          f"{took:.1f} s (the limit allows {n * 0.1:.1f} s)")
    assert len(got) == n and sum(got.values()) == n
    assert refused <= 2 and took < n * 0.1 + 2


def test_slack_keeps_to_one_message_a_second_by_default() -> None:
    from watchdog.alerting.channels import build_channel

    assert build_channel({"kind": "slack", "url": "http://x"}).min_interval_s == 1.0
    assert build_channel({"kind": "slack", "url": "http://x", "min_interval_s": 0}).min_interval_s == 0
    assert build_channel({"kind": "pagerduty", "routing_key": "k"}).min_interval_s == 0


def test_a_channel_down_then_back_delivers_each_page_once_in_order(redis_client: Any) -> None:
    """The receiver refuses connections (a 10-minute outage, scaled to 20 backoff_max of 0.25 s),
    while routes roll back, one flaps (rollback, promote, rollback, promote) and an ops incident
    opens and closes. Once it listens again: every page once, each resolve after its trigger."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    n = 10
    channels = [{"kind": "webhook", "url": url}]
    with pager(redis_client, channels, backoff_initial=0.05, backoff_max=0.25) as p:
        dispatch(redis_client, *(act(f"r{i}", "rollback", "critical") for i in range(n)))
        dispatch(redis_client, act("flap", "rollback"), act("flap", "promote"))
        p.alerter.ops_alert("redis", "Redis unreachable", "critical")
        dispatch(redis_client, act("flap", "rollback"), act("flap", "promote"))
        dispatch(redis_client, *(act(f"r{i}", "promote") for i in range(n)))
        p.alerter.ops_resolve("redis")
        time.sleep(5.0)
        with AlertSink(port=port) as sink:
            wait(lambda: redis_client.xlen(Keys().pages(GROUP, "webhook")) == 0 and not p.alerter.stats()["queued"],
                 20, "every page delivered")
            time.sleep(0.5)
            stats = p.alerter.stats()
    got = Counter(r.body["id"] for r in sink.accepted)
    order = [(r.body["route"] or r.body["key"], r.body["status"]) for r in sink.accepted]
    print(f"\noutage: {len(sink.accepted)} POSTs after it, {len(got)} distinct, "
          f"{sum(got.values()) - len(got)} copies; sent {stats['sent']} failed {stats['failed']} "
          f"dropped {stats['dropped']} retried {stats['retried']}; ops: {[o for o in order if o[0] == 'ops/redis']}")
    assert sum(got.values()) == len(got) == 2 * n + 4 + 2
    for i in range(n):
        assert order.index((f"r{i}", "firing")) < order.index((f"r{i}", "resolved"))
    assert [s for r, s in order if r == "flap"] == ["firing", "resolved", "firing", "resolved"]
    assert [s for r, s in order if r == "ops/redis"] == ["firing", "resolved"]


def test_a_daemon_stopped_with_an_ops_incident_open_resolves_it(kafka_service, redis_service, redis_client,
                                                               topic, tmp_path, sink) -> None:
    """An ops incident is about this process and is not kept across a restart (the next process
    does not know it). Stopped while one is open (the runbook for ``thread-died`` is "restart the
    daemon"), the daemon must close it at the receivers, or PagerDuty keeps it open forever."""
    import json

    from tests.daemon_harness import make_config, running_daemon, write_policy
    from tests.helpers import wait_until

    s, url = sink
    policy = write_policy(tmp_path / "p.yaml")
    cfg = make_config(kafka_service.address, redis_service.port, topic, policy, url)
    with running_daemon(cfg) as (daemon, _server):
        policy.write_text(policy.read_text().replace('fail_if: "candidate < 0.85"', 'fail_if: "candidate <<< 0.85"'))
        wait_until(lambda: any("rejected" in json.dumps(r.body) for r in s.accepted), 15)
    ops = [r.body["status"] for r in s.accepted if r.body.get("key") == "ops/policy-reload"]
    print(f"\nops/policy-reload at the receiver across the stop: {ops}")
    assert ops == ["firing", "resolved"]


def test_one_replicas_ops_resolve_does_not_close_anothers_in_pagerduty(sink: Any) -> None:
    """Two replicas lose Redis; one gets it back first. Its resolve must not close the other's
    still-open ops incident in PagerDuty (Alertmanager's ops alerts carry a ``source`` label for
    this; a PagerDuty event is identified by its ``dedup_key`` alone)."""
    from watchdog.alerting.alerter import Alerter

    s, url = sink
    a = Alerter([{"kind": "pagerduty", "url": url, "routing_key": "k", "source": "host-a"}],
                backoff_initial=0.05, backoff_max=0.5).start()
    b = Alerter([{"kind": "pagerduty", "url": url, "routing_key": "k", "source": "host-b"}],
                backoff_initial=0.05, backoff_max=0.5).start()
    a.ops_alert("redis", "Redis unreachable", "critical")
    b.ops_alert("redis", "Redis unreachable", "critical")
    s.wait_for(2)
    a.ops_resolve("redis")
    assert a.stop(2) and b.stop(2)
    events = [(r.body["event_action"], r.body["dedup_key"]) for r in s.accepted]
    open_keys = {k for e, k in events if e == "trigger"} - {k for e, k in events if e == "resolve"}
    print(f"\nPagerDuty events: {events}; open after host-a's resolve: {open_keys}")
    assert len(open_keys) == 1  # host-b's outage is still open
