"""The Redis lease (watchdog/state/lease.py) and the claim script against a real redis-server."""

from __future__ import annotations

from typing import Any

import pytest

from watchdog.core.keys import Keys
from watchdog.state.checkpoint import CheckpointStore
from watchdog.state.lease import Lease

pytestmark = pytest.mark.services


def test_release_never_deletes_a_lease_another_replica_took(redis_client: Any) -> None:
    a = Lease(redis_client, "llmwd:lease:test", "replica-a", ttl_s=5)
    assert a.tick(0.0)
    # a's lease expired and replica b took it, while a still believes it holds it
    redis_client.set("llmwd:lease:test", "replica-b", px=5000)
    a.release()
    assert redis_client.get("llmwd:lease:test") == "replica-b"
    b = Lease(redis_client, "llmwd:lease:test", "replica-b", ttl_s=5)
    assert b.tick(0.0)
    b.release()
    assert redis_client.get("llmwd:lease:test") is None


def test_claim_touches_only_the_keys_it_declares(redis_client: Any) -> None:
    """claim.lua declares its generation counter in KEYS (ACL key patterns and Cluster routing)."""
    cps = CheckpointStore(redis_client, Keys(), "g", "t", "replica-a")
    first, second = cps.claim(3), cps.claim(3)
    owner = Keys().owner("g", "t", 3)
    assert first.token.startswith("1:") and second.token.startswith("2:")
    assert redis_client.get(owner + ":gen") == "2" and redis_client.get(owner) == second.token
