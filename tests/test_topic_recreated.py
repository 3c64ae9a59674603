"""The topic deleted and re-created under the same name while the daemon runs (no broker restart).

The daemon sees a re-created topic by its new id in the client's metadata (``Ownership.check_topic_id``).
That metadata was kafka-python's, refreshed every 5 minutes. Tansu answers a fetch beyond the new, empty
log with no records and no error, so the daemon waited at its old offsets and, once the new topic grew
past them, read on from there. It skipped the new topic's first events (725-776 of ~2,500 in an outside
review's runs), and readiness stayed green. ``kafka.metadata_max_age_ms`` (5 s) bounds that view now.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient

from tests.drills.runner import SESSION_ENV, Drill

pytestmark = [pytest.mark.services, pytest.mark.slow]
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(150)
def test_topic_recreated_under_running_daemon_loses_nothing_and_is_named(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SESSION_ENV, "2000")
    with Drill("atk-topic-recreate", ROOT, tmp_path, False) as d:
        d.start()
        d.sleep(4.0)
        d.traffic.pause()  # only the daemon can lose what follows: the old topic is fully read first
        d.sleep(4.0)
        with d.fault("topic deleted and re-created"):
            admin = KafkaAdminClient(bootstrap_servers=d.stack.tansu.address)
            try:
                admin.delete_topics([d.stack.topic])
            finally:
                admin.close()
            time.sleep(2.0)
            made = d.stack.create_topic()
            d.traffic.resume()
            d.sleep(3.0)
        d.sleep(12.0)
        r = d.finish()
    named = any("offsets-reset" in p for s in d.sampler.samples for p in s.problems)
    print(f"the re-created topic has {made} partitions")
    assert r.lost == 0, f"{r.lost} of {r.produced} events lost after the topic was re-created: {r.diffs[:6]}"
    assert r.twice == 0
    assert named, "readiness never named offsets-reset although the topic was re-created"
