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
