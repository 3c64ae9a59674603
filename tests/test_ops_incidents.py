"""Ops incidents resolve when their cause clears (issue 18): a failing signal source pages, its
next good call resolves the page, and a later failure pages again (it used to page once and never
resolve, so later failures were never paged)."""

from __future__ import annotations

import json

from tests.daemon_harness import make_config, running_daemon, traffic, write_policy
from tests.helpers import wait_until


class FlakySource:
    """A signal source that fails while ``failing`` is set."""

    def __init__(self) -> None:
        self.failing = False

    def __call__(self, now: float) -> list:  # type: ignore[type-arg]
        if self.failing:
            raise RuntimeError("probe exploded")
        return []


def test_a_failing_source_pages_resolves_and_pages_again(kafka_service, redis_service, redis_client, topic,
                                                           tmp_path, sink) -> None:
    s, url = sink
    source = FlakySource()
    cfg = make_config(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), url)

    def statuses() -> list[str]:
        return [r.body["status"] for r in s.received
                if r.path.endswith("webhook") and "source-failed" in json.dumps(r.body)]

    with running_daemon(cfg, sources=[source]) as (daemon, _server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for):
        wait_until(lambda: daemon.stats.windows_closed >= 1, 30)
        source.failing = True
        wait_until(lambda: statuses() == ["firing"], 15, detail=statuses)
        source.failing = False
        wait_until(lambda: statuses() == ["firing", "resolved"], 15, detail=statuses)
        source.failing = True
        wait_until(lambda: statuses() == ["firing", "resolved", "firing"], 15, detail=statuses)
