"""Golden decisions with several replicas (issue 18): the lease holder replays, each route's owner
judges and flips it (fenced, with its own engine state), requests raised anywhere reach the holder,
and a restarted owner reads the golden stream again without counting a replay twice."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from probes.golden_replay import replay
from tests.daemon_harness import make_config, running_daemon
from tests.drills.golden import routes_on_partitions
from tests.helpers import wait_until
from tests.test_golden_source import ANSWERS, GOLDEN_POLICY, mini_set
from tests.test_replay import TableEngine
from watchdog.core.keys import Keys
from watchdog.core.signals import Signal, signal_from_dict, signal_to_dict
from watchdog.state.golden_stream import GoldenStream

MODEL = "m"
#: the single-replica tests' golden rule, with a ``for`` streak to fill in
GROUP_POLICY = GOLDEN_POLICY.replace("        severity: critical", "        for: {for_}\n        severity: critical")
#: half the answers wrong: exact_match paired mean -0.5, past the rule's -0.25
BROKEN = {q: "nonsense" for q in list(ANSWERS)[:3]}


def broken_replay(root: Path, calls: list[str] | None = None):
    def run(job):
        if calls is not None:
            calls.append(job.name)
        return replay(mini_set(root), TableEngine("fp8", ANSWERS, perturb=BROKEN), TableEngine("fp16", ANSWERS),
                      progress=False, repeat_baseline=False)
    return run


def create_topic(address: str, topic: str, partitions: int) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=address)
    try:
        admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()


def golden_cfg(kafka_service, redis_service, topic: str, tmp_path: Path, instance: str, routes: list[str],
               for_: int = 1):
    policy = tmp_path / "golden.yaml"
    policy.write_text(GROUP_POLICY.format(for_=for_))
    job = {"name": "mini", "set": "mini", "model": MODEL, "routes": routes, "every_s": None, "jitter_s": 0.0,
           "candidate": {"kind": "table", "precision": "fp8"}, "baseline": {"kind": "table", "precision": "fp16"}}
    return make_config(kafka_service.address, redis_service.port, topic, policy, None, instance=instance,
                       golden={"jobs": [job], "debounce_s": 60.0})


def flag(redis_client, route: str) -> str | None:
    return redis_client.hget(f"llmwd:route:{MODEL}:{route}", "precision")


# -- the parts -----------------------------------------------------------------------------------
def test_a_signal_survives_its_json_record() -> None:
    sig = Signal(source="golden", model="m", route="r", precision="fp8", start=1.5, end=2.5, samples=6,
                 values={"exact_match": 0.5}, paired={"exact_match": [0.0, -1.0]}, error=None,
                 detail={"item_ids": ["a", "b"], "golden_set": "mini"})
    assert signal_from_dict(json.loads(json.dumps(signal_to_dict(sig)))) == sig
    with pytest.raises(ValueError, match="schema"):
        signal_from_dict({**signal_to_dict(sig), "schema": 2})
    with pytest.raises(ValueError, match="source"):
        signal_from_dict({**signal_to_dict(sig), "source": "gossip"})


@pytest.mark.services
def test_the_stream_keeps_a_replay_whole_and_requests_are_taken_once(redis_client) -> None:
    stream = GoldenStream(redis_client, Keys(), "g")
    sigs = [Signal(source="golden", model="m", route=r, precision=p, start=1.0, end=2.0, samples=3)
            for r in ("r1", "r2") for p in ("fp8", "fp16")]
    stream.publish([("mini", sigs)])
    redis_client.xadd(stream.key, {"json": "{not json"})  # a malformed entry is skipped, not fatal
    recent, cursor = stream.recent(3600, 100)
    assert [e.signals for e in recent] == [sigs] and recent[0].job == "mini"
    assert stream.read(cursor) == []
    assert [e.signals for e in stream.read("0-0")] == [sigs, []]
    stream.push_request("m", "r1", "suspected", 10.0, "b")
    redis_client.rpush(stream.requests_key, "garbage", '{"model": "m", "route": "r1", "at": "soon"}')
    assert [r["route"] for r in stream.pop_requests()] == ["r1"]
    assert stream.pop_requests() == []


# -- two replicas --------------------------------------------------------------------------------
@pytest.mark.services
def test_the_owner_of_a_route_flips_it_on_the_holders_replay(kafka_service, redis_service, redis_client, topic,
                                                            tmp_path: Path) -> None:
    create_topic(kafka_service.address, topic, 2)
    on_part = dict(enumerate(routes_on_partitions(MODEL, 2)))
    routes = [on_part[0], on_part[1]]
    cfg_a = golden_cfg(kafka_service, redis_service, topic, tmp_path, "a", routes)
    cfg_b = golden_cfg(kafka_service, redis_service, topic, tmp_path, "b", routes)
    calls: dict[str, list[str]] = {"a": [], "b": []}
    with running_daemon(cfg_a) as (a, _):
        a.golden.replay_fn = broken_replay(tmp_path, calls["a"])
        wait_until(lambda: a.golden_leader.running and len(a.parts) == 2, 30, what="a holds the lease and both parts")
        with running_daemon(cfg_b) as (b, _):
            b.golden.replay_fn = broken_replay(tmp_path, calls["b"])
            wait_until(lambda: len(a.parts) == 1 and len(b.parts) == 1, 40, what="a rebalance",
                       detail=lambda: (a.parts.keys(), b.parts.keys()))
            assert not b.golden_leader.running
            owner = {r: ("a" if (topic, p) in a.parts else "b") for p, r in on_part.items()}
            assert sorted(owner.values()) == ["a", "b"]
            t0 = time.monotonic()
            assert a.golden.run_job("mini")  # the holder replays; the report says FP8 broke
            wait_until(lambda: all(flag(redis_client, r) == "fp16" for r in routes), 15,
                       what="both routes rolled back", detail=lambda: redis_client.xrange("llmwd:audit"))
            reaction = time.monotonic() - t0
            time.sleep(2.0)  # room for a second, wrong flip
            b_route = next(r for r, o in owner.items() if o == "b")
            # the holder neither judged nor flipped b's route: no engine state of it there
            assert a.engine.scopes_of((MODEL, b_route)) == {}
            assert b.engine.scopes_of((MODEL, b_route))["golden-guard"].rules["exact-match-drop"].fails == 1
    audit = [f for _id, f in redis_client.xrange("llmwd:audit")]
    assert sorted(f["route"] for f in audit) == sorted(routes)  # exactly one flip per route
    for f in audit:
        assert f["changed_by"] == f"watchdog@{owner[f['route']]}" and f["policy"] == "golden-guard"
    assert calls == {"a": ["mini"], "b": []}
    # each owner recorded its own route's golden signals for backtests, once
    recorded = [json.loads(f["json"]) for _id, f in redis_client.xrange("llmwd:windows")]
    golden = sorted((w["route"], w["precision"], w["instance"]) for w in recorded if w["source"] == "golden")
    assert golden == sorted((r, p, owner[r]) for r in routes for p in ("fp16", "fp8")), recorded
    print(f"replay finished -> both owners' flips in Redis: {reaction:.2f} s")


@pytest.mark.services
def test_a_replay_asked_for_on_another_replica_runs_on_the_holder(kafka_service, redis_service, redis_client,
                                                                 topic, tmp_path: Path) -> None:
    create_topic(kafka_service.address, topic, 2)
    on_part = dict(enumerate(routes_on_partitions(MODEL, 2)))
    routes = [on_part[0], on_part[1]]
    cfg_a = golden_cfg(kafka_service, redis_service, topic, tmp_path, "a", routes)
    cfg_b = golden_cfg(kafka_service, redis_service, topic, tmp_path, "b", routes)
    calls: dict[str, list[str]] = {"a": [], "b": []}
    with running_daemon(cfg_a) as (a, _):
        a.golden.replay_fn = broken_replay(tmp_path, calls["a"])
        wait_until(lambda: a.golden_leader.running, 30, what="a holds the golden lease")
        with running_daemon(cfg_b) as (b, _):
            b.golden.replay_fn = broken_replay(tmp_path, calls["b"])
            wait_until(lambda: len(b.parts) == 1, 40, what="a rebalance")
            b_route = next(r for p, r in on_part.items() if (topic, p) in b.parts)
            for _ in range(3):  # what Decisions.dispatch does with a ``request_replay`` alert; debounced
                b.golden_leader.request(MODEL, b_route, "suspected: live rule failing", b.clock())
            wait_until(lambda: calls["a"] == ["mini"], 15, what="the holder replays",
                       detail=lambda: redis_client.lrange("llmwd:golden:" + cfg_a.kafka.group_id + ":requests", 0, -1))
            # the replay it ran is judged by the owner: b's route rolled back by b
            wait_until(lambda: flag(redis_client, b_route) == "fp16", 15, what="b rolls its route back")
            time.sleep(1.5)
            assert calls == {"a": ["mini"], "b": []}
            doc = b.status()
            assert doc["golden_lease"] is False and doc["golden_stream"]["unpublished"] == 0
            assert doc["golden_stream"]["cursor"] is not None
            assert b.metrics.golden_stream.labels("requested")._value.get() == 1
    audit = [f for _id, f in redis_client.xrange("llmwd:audit") if f["route"] == b_route]
    assert [f["changed_by"] for f in audit] == ["watchdog@b"]


@pytest.mark.services
def test_a_restarted_owner_reads_the_stream_again_and_counts_each_replay_once(
        kafka_service, redis_service, redis_client, topic, tmp_path: Path) -> None:
    create_topic(kafka_service.address, topic, 2)
    route = routes_on_partitions(MODEL, 2)[0]
    cfg = golden_cfg(kafka_service, redis_service, topic, tmp_path, "a", [route], for_=2)
    stream = GoldenStream(redis_client, Keys(), cfg.kafka.group_id)

    def report_signals() -> list[Signal]:
        return broken_replay(tmp_path)(None).to_signals(MODEL, route)

    def fails(daemon) -> int:
        scopes = daemon.engine.scopes_of((MODEL, route))
        return scopes["golden-guard"].rules["exact-match-drop"].fails if scopes else 0

    first = report_signals()
    with running_daemon(cfg) as (d, _):
        wait_until(lambda: len(d.parts) == 2, 30, what="both partitions")
        stream.publish([("mini", first)])
        wait_until(lambda: fails(d) == 1, 10, what="one failing replay judged")
        stream.publish([("mini", first)])  # the same replay again (a writer retried)
        time.sleep(1.5)
        assert fails(d) == 1 and flag(redis_client, route) is None
    # restarted: it reads the last hour of the stream again (both copies); the engine state the
    # checkpoint saved says that replay was judged
    with running_daemon(cfg) as (d, _):
        wait_until(lambda: len(d.parts) == 2 and d.golden_relay.cursor is not None, 30, what="restored, stream read")
        time.sleep(1.5)
        assert fails(d) == 1 and flag(redis_client, route) is None
        stream.publish([("mini", report_signals())])  # a new failing replay: the second in a row
        wait_until(lambda: flag(redis_client, route) == "fp16", 10, what="rolled back on the second replay")
        time.sleep(1.0)
    assert len(redis_client.xrange("llmwd:audit")) == 1
    recorded = [json.loads(f["json"]) for _id, f in redis_client.xrange("llmwd:windows")]
    assert sum(1 for w in recorded if w["source"] == "golden") == 4  # 2 replays x (fp8, fp16), none twice


# -- the relay alone: routes nobody owns yet, Redis failures ------------------------------------
class _Ownership:
    def __init__(self) -> None:
        self.parts: dict[tuple[str, int], object] = {}
        self.mine: set[tuple[str, str]] = set()

    def owner_of(self, model: str, route: str):
        return ("t", 0) if (model, route) in self.mine and ("t", 0) in self.parts else None


class _Health:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def failed(self, exc, what: str) -> None:
        self.failures.append(what)

    def recovered(self) -> None:
        self.failures.clear()


class _Scheduler:
    debounce_s = 60.0

    def __init__(self, runs) -> None:
        self.runs = runs
        self.requested: list[tuple[str, str]] = []

    def drain_runs(self):
        out, self.runs = self.runs, []
        return out

    def request(self, model, route, reason, now):
        self.requested.append((model, route))
        return ["mini"]


class _Leader:
    running = False
    forward = None


def _relay(client, runs, ownership=None):
    from watchdog.core.metrics import Metrics
    from watchdog.policy import PolicyEngine
    from watchdog.runtime.golden import GoldenRelay

    health = _Health()
    relay = GoldenRelay(GoldenStream(client, Keys(), "g"), _Scheduler(runs), _Leader(), ownership or _Ownership(),
                        PolicyEngine(), health, Metrics(), "a", lambda: 0.0)
    return relay, health


@pytest.mark.services
def test_a_route_nobody_owns_waits_in_the_stream_until_its_partition_is_assigned(redis_client) -> None:
    sigs = [Signal(source="golden", model="m", route="r", precision=p, start=1.0, end=2.0, samples=3)
            for p in ("fp8", "fp16")]
    own = _Ownership()
    holder, _ = _relay(redis_client, [("mini", sigs)], own)
    assert holder(0.0) == []  # published; no partition assigned here yet: judged by no one
    own.mine.add(("m", "r"))
    assert holder(1.0) == []  # ours by the key's partition, but that partition is not assigned
    own.parts[("t", 0)] = part = SimpleNamespace(last_seen={})  # assigned: the recent span is read again
    assert holder(2.0) == sigs  # candidate and baseline together
    assert part.last_seen == {("m", "r"): 2.0}  # a judged replay keeps a golden-only route from idle eviction
    assert holder(3.0) == []
    own.parts[("t", 1)] = SimpleNamespace(last_seen={})  # another assignment: read again, nothing handed back twice
    assert holder(4.0) == []


def test_a_golden_stream_redis_cannot_serve_is_a_redis_failure_and_nothing_is_lost() -> None:
    import redis

    from watchdog.dev.embedded import free_port

    dead = redis.Redis(port=free_port(), socket_timeout=0.2, socket_connect_timeout=0.2)
    sig = Signal(source="golden", model="m", route="r", precision="fp8", start=1.0, end=2.0, samples=3)
    relay, health = _relay(dead, [("mini", [sig])])
    assert relay(0.0) == [] and health.failures == ["golden signal stream"]
    assert relay.unpublished == [("mini", [sig])]  # kept for the next try
    assert relay.metrics.golden_stream.labels("error")._value.get() == 1
    relay.forward("m", "r", "suspected", 0.0)
    assert health.failures[-1] == "golden replay request"


@pytest.mark.services
def test_the_holder_takes_requests_once_and_drops_stale_ones(redis_client) -> None:
    relay, _ = _relay(redis_client, [])
    relay.leader.running = True
    stream = relay.stream
    stream.push_request("m", "old", "suspected", 100.0, "b")
    stream.push_request("m", "r", "suspected", 900.0, "b")
    assert relay(1000.0) == []
    assert relay.scheduler.requested == [("m", "r")]  # 900 s old: dropped
    relay(1001.0)
    assert relay.scheduler.requested == [("m", "r")]
