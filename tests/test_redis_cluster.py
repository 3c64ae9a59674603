"""Redis Cluster: the daemon's writes (flip, checkpoint, claim), the gateway reader (RoutingFlags
with its pub/sub) and the ``flags`` CLI against a real cluster of 3 masters + 3 replicas
(``redis_cluster`` in conftest.py), also while the slot of the deployment's hash tag fails over
to its replica or migrates to another master in the middle of a stream of flips."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from watchdog.actuation.actuator import Actuator, FlagStore, FlipExtras
from watchdog.actuation.routing import RoutingFlags
from watchdog.cli.flags import add_flags_commands
from watchdog.config.redact import redacted
from watchdog.config.settings import Config, ConfigError, load_config
from watchdog.core.keys import Keys, cluster_prefix_problem, hash_tag
from watchdog.core.signals import Action
from watchdog.gateway.config import GatewayConfigError, load_gateway_config
from watchdog.runtime.maintenance import EVERY_S as MAINTENANCE_EVERY_S
from watchdog.runtime.maintenance import MaintenanceReader
from watchdog.state.checkpoint import DUPLICATE, FENCED, SAVED, CheckpointStore, PendingSave
from watchdog.state.redis_conn import client_from_url, parse_cluster_url

pytestmark = pytest.mark.services
GROUP, TOPIC = "g", "llm.logs"


def _wait(what: str, ok: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what}: not within {timeout} s")


def _every_key(keys: Keys) -> list[str]:
    return [keys.route("llama3:8b", "chat"), keys.routes_index, keys.audit, keys.state("engine"), keys.windows,
            keys.checkpoint(GROUP, TOPIC, 3), keys.owner(GROUP, TOPIC, 3), keys.owner(GROUP, TOPIC, 3) + ":gen",
            keys.engine(GROUP, "m{x}", "r"), keys.outbox, keys.pages(GROUP, "slack"), keys.incidents(GROUP),
            keys.lease("golden"), keys.golden_signals(GROUP), keys.golden_requests(GROUP),
            keys.maintenance("*", "chat"), keys.maintenance_generation, keys.evidence("e1"), keys.evidence_index, keys.evidence_summaries,
            keys.heartbeat("i1")]


def test_prefix_needs_a_hash_tag() -> None:
    url = "redis+cluster://127.0.0.1:7000"
    assert hash_tag("{llmwd}") == "llmwd" and hash_tag("a{t}b") == "t"
    assert hash_tag("llmwd") is None and hash_tag("{}x") is None and hash_tag("x{") is None
    assert cluster_prefix_problem("redis://127.0.0.1:6379/0", "llmwd") is None
    assert cluster_prefix_problem(url, "{llmwd}") is None
    problem = cluster_prefix_problem(url, "llmwd")
    assert problem is not None and "'{llmwd}'" in problem
    with pytest.raises(ValueError, match="has no hash tag"):
        Config.model_validate({"redis": {"url": url, "prefix": "llmwd"}})
    with pytest.raises(ConfigError, match=r"redis\.prefix: .*use prefix '\{llmwd\}'"):  # the default prefix too
        load_config(None, env={"LLMWD_REDIS__URL": url})
    # a value starting with "{" is JSON in the environment: the tag is written as a JSON string
    assert load_config(None, env={"LLMWD_REDIS__URL": url, "LLMWD_REDIS__PREFIX": '"{llmwd}"'}).redis.prefix == "{llmwd}"
    with pytest.raises(ValueError, match="has no hash tag"):
        RoutingFlags(url, Keys("llmwd"), start=False)
    with pytest.raises(GatewayConfigError, match=r"redis_prefix: .*use prefix '\{llmwd\}'"):  # the gateway's
        load_gateway_config(None, env={}, redis_url=url)
    assert load_gateway_config(None, env={}, redis_url=url, redis_prefix="{llmwd}").redis_prefix == "{llmwd}"
    target = parse_cluster_url("rediss+cluster://u:s3cret@10.0.0.5:6379,10.0.0.6?retries=2&ssl_ca_certs=/ca.pem")
    assert target.nodes == (("10.0.0.5", 6379), ("10.0.0.6", 6379)) and target.password == "s3cret"
    assert target.ssl and target.retries == 2 and target.ssl_options == {"ssl_ca_certs": "/ca.pem"}
    with pytest.raises(ValueError, match="only database 0"):
        parse_cluster_url("redis+cluster://h:1/2")
    with pytest.raises(ValueError, match="unknown option") as err:
        parse_cluster_url("redis+cluster://:s3cret@h:1?sentinel_password=x")
    assert "s3cret" not in str(err.value)
    assert redacted("redis+cluster://:s3cret@h1:1,h2:2") == "redis+cluster://:***@h1:1,h2:2"


def test_every_key_of_a_deployment_maps_to_one_slot(redis_cluster: Any) -> None:
    client = client_from_url(redis_cluster.url)
    try:
        slots = {client.keyslot(k) for k in _every_key(Keys("{llmwd}"))}
        assert len(slots) == 1
        # the reason for the rule: without a tag the same deployment spreads over many slots
        assert len({client.keyslot(k) for k in _every_key(Keys("llmwd"))}) > 5
        # what the evidence trim sends: one MULTI deleting several keys of the tag
        keys = Keys("{llmwd}")
        client.set(keys.evidence("a"), "1")
        client.set(keys.evidence("b"), "2")
        pipe = client.pipeline(transaction=True)
        pipe.zrem(keys.evidence_index, "a", "b")
        pipe.delete(keys.evidence("a"), keys.evidence("b"))
        assert pipe.execute() == [0, 2]
        # keys of two slots: a RedisError the callers report (redis-py's own exception is none)
        with pytest.raises(redis.ResponseError, match="same key slot"):
            client.mget(["{a}:x", "{b}:y"])
    finally:
        client.close()


def test_flip_audit_and_the_reader_on_cluster(redis_cluster: Any) -> None:
    keys = Keys("{flip}")
    client = client_from_url(redis_cluster.url)
    store = FlagStore(client, keys)
    with RoutingFlags(redis_cluster.url, keys, ttl_s=60, poll_s=0.01) as reader:
        assert reader.wait_ready(5)
        extras = FlipExtras(owner_key=keys.owner(GROUP, TOPIC, 0), token="", engine_key=keys.engine(GROUP, "m", "r"),
                            engine_json='{"cooldown": 1}', outbox_key=keys.outbox, outbox_json='{"page": 1}')
        res = store.flip("m", "r", "fp16", expected_epoch=0, reason="drift", policy="p", changed_by="t",
                         extras=extras)
        assert res.applied and res.epoch == 1
        _wait("reader hears the flip", lambda: reader.precision_for("m", "r") == "fp16")
        assert reader.messages == 1 and reader.reloads == 1  # by pub/sub, not by a reload
        # a retry of the same decision (its reply lost) writes nothing twice
        again = store.flip("m", "r", "fp16", expected_epoch=0, reason="drift", policy="p", changed_by="t",
                           extras=extras)
        assert again.unchanged and again.epoch == 1
        assert [r["epoch"] for r in store.audit()] == [1]
        assert client.xlen(keys.outbox) == 1 and client.get(keys.engine(GROUP, "m", "r")) == '{"cooldown": 1}'
        assert [(f.model, f.route, f.precision) for f in store.list()] == [("m", "r", "fp16")]
    client.close()


def test_checkpoint_save_restore_and_claim_fencing_on_cluster(redis_cluster: Any) -> None:
    keys = Keys("{ckpt}")
    a_client, b_client = client_from_url(redis_cluster.url), client_from_url(redis_cluster.url)
    a = CheckpointStore(a_client, keys, GROUP, TOPIC, "replica-a")
    b = CheckpointStore(b_client, keys, GROUP, TOPIC, "replica-b")
    claim = a.claim(7)
    assert claim.token == "1:replica-a" and claim.seq == 0 and claim.data is None
    blob = json.dumps({"schema": 2, "offset": 42})
    save = PendingSave(seq=1, blob=blob, windows=['{"w": 1}'], outbox=['{"page": 1}'],
                       engines={keys.engine(GROUP, "m", "r"): '{"streak": 2}'}, changed={"w:m:r:0": '{"n": 5}'},
                       incremental=False)
    assert a.save(7, claim.token, save) == SAVED
    assert a.save(7, claim.token, save) == DUPLICATE  # a retried save whose first attempt landed
    assert a.load_engines([("m", "r"), ("m", "none")]) == {("m", "r"): {"streak": 2}}
    taken = b.claim(7)  # a rebalance: replica b restores what a saved and fences a
    assert taken.token == "2:replica-b" and taken.seq == 1 and taken.data is not None
    assert taken.data["offset"] == 42 and taken.data["windows"] == [{"n": 5}]
    assert a.save(7, claim.token, PendingSave(seq=2, blob=blob)) == FENCED
    store = FlagStore(a_client, keys)
    zombie = FlipExtras(owner_key=a.owner_key(7), token=claim.token, engine_key=keys.engine(GROUP, "m", "r"),
                        engine_json="{}", outbox_key=keys.outbox, outbox_json='{"page": 2}')
    assert store.flip("m", "r", "fp16", expected_epoch=None, reason="x", changed_by="a", extras=zombie).refused
    assert a_client.xlen(keys.windows) == 1 and a_client.xlen(keys.outbox) == 1
    a_client.close()
    b_client.close()


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="llm-watchdog")
    add_flags_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["flags", *argv])
    return int(args.func(args))


def test_flags_cli_against_a_cluster_url(redis_cluster: Any, capsys: pytest.CaptureFixture[str]) -> None:
    url = redis_cluster.url.replace("redis+cluster://", "redis+cluster://:s3cret@")  # an unused password
    common = ["--redis-url", redis_cluster.url, "--prefix", "{cli}"]
    assert _cli("set", "llama", "chat", "fp16", "--reason", "ticket 7", "--json", "--no-announce", *common) == 0
    assert json.loads(capsys.readouterr().out)["epoch"] == 1
    assert _cli("pin", "llama", "chat", "fp8", "--ttl", "10m", "--reason", "hold", "--json", "--no-announce", *common) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp8"
    assert _cli("get", "llama", "chat", "--json", *common) == 0
    flag = json.loads(capsys.readouterr().out)
    assert flag["precision"] == "fp8" and flag["epoch"] == 2 and flag["pinned_until"]
    assert _cli("list", "--json", *common) == 0
    assert [f["route"] for f in json.loads(capsys.readouterr().out)] == ["chat"]
    assert _cli("audit", "--json", *common) == 0
    assert [r["epoch"] for r in json.loads(capsys.readouterr().out)] == [2, 1]
    # a maintenance annotation, its audit record and the generation bump: one MULTI on the tag's slot,
    # and the daemon's reader (its thread) sees it within a cycle or two
    keys = Keys("{cli}")
    client = client_from_url(redis_cluster.url)
    errors: list[str] = []
    reader = MaintenanceReader(client, keys, lambda exc, what: errors.append(f"{what}: {exc}"))
    try:
        assert reader.values([("llama", "chat")]) == {}
        reader.start()
        assert _cli("maintenance", "llama", "chat", "--for", "30m", "--reason", "deploy", *common) == 0
        assert client.get(keys.maintenance_generation) in (b"1", "1")
        _wait("the annotation read by the reader", lambda: ("llama", "chat") in reader.values([("llama", "chat")]),
              2 * MAINTENANCE_EVERY_S + 1)
        assert not errors
    finally:
        reader.stop()
        client.close()
    capsys.readouterr()
    # no hash tag: refused before Redis is contacted, with the fix in the message
    assert _cli("get", "llama", "chat", "--redis-url", url, "--prefix", "llmwd") == 2
    err = capsys.readouterr().err
    assert "'{llmwd}'" in err and "s3cret" not in err


# -- topology changes during a stream of flips ------------------------------------------------------------

def _slot_owner(cluster: Any, slot: int) -> int:
    """The port of the master serving ``slot``, as the cluster itself says."""
    for n in cluster.nodes:
        c = cluster.client(n.port)
        try:
            for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if int(lo) <= slot <= int(hi):
                    return int(master[1])
        except redis.RedisError:
            continue
        finally:
            c.close()
    raise AssertionError(f"no node serves slot {slot}")


def _flip_stream(url: str, keys: Keys, during: Callable[[], None], before: int = 20,
                 after: int = 20) -> tuple[int, float]:
    """Alternating policy flips of one route through the daemon's Actuator (each fenced by the epoch
    it decided on, with its page and engine state): ``before`` flips, then ``during`` runs in a thread
    while flips go on, then ``after`` more flips once it returned. Returns (flips, seconds)."""
    store = FlagStore(client_from_url(url, timeout_s=1.0), keys)
    owner = keys.owner(GROUP, TOPIC, 0)
    store.client.set(owner, "1:me")

    def extras(action: Action) -> FlipExtras:
        return FlipExtras(owner_key=owner, token="1:me", engine_key=keys.engine(GROUP, "m", "r"),
                          engine_json=json.dumps({"epoch": action.detail["epoch"]}), outbox_key=keys.outbox,
                          outbox_json=json.dumps({"decision": action.detail["epoch"]}))

    act = Actuator(store, backoff_initial=0.02, backoff_max=0.2, extras=extras)
    worker = threading.Thread(target=during, name="topology-change")
    t0 = time.monotonic()
    i = left = 0
    while i <= before or worker.is_alive() or left > 0:
        if i == before:
            worker.start()
            left = after
        elif i > before and not worker.is_alive():
            left -= 1
        target = "fp16" if i % 2 == 0 else "fp8"
        act.submit(Action(kind="rollback" if target == "fp16" else "promote", policy="p", model="m", route="r",
                          reason=f"decision {i}", precision=target, detail={"epoch": i}))
        deadline = time.monotonic() + 15
        while act.pending():
            assert time.monotonic() < deadline, f"flip {i} still pending: {act.last_error}"
            for res in act.pump():
                assert res.refused is None, res
            time.sleep(0.002)
        i += 1
        time.sleep(0.002)
    worker.join(30)
    store.client.close()
    return i, time.monotonic() - t0


def _errorstats(cluster: Any) -> dict[str, int]:
    """Redirections and refusals the cluster's nodes answered so far (``INFO errorstats``)."""
    total: dict[str, int] = {}
    for n in cluster.nodes:
        c = cluster.client(n.port)
        for name, value in c.info("errorstats").items():
            kind = name.removeprefix("errorstat_")
            total[kind] = total.get(kind, 0) + int(value["count"])
        c.close()
    return total


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def _assert_exactly_once(url: str, keys: Keys, n: int) -> None:
    client = client_from_url(url)
    try:
        audit = client.xrange(keys.audit)
        assert [int(f["epoch"]) for _, f in audit] == list(range(1, n + 1))  # consecutive, none twice
        assert [f["reason"] for _, f in audit] == [f"decision {i}" for i in range(n)]
        pages = [json.loads(f["json"])["decision"] for _, f in client.xrange(keys.outbox)]
        assert pages == list(range(n))  # every decision paged once
        assert client.hget(keys.route("m", "r"), "epoch") == str(n)
    finally:
        client.close()


def test_master_failover_during_flips_applies_each_flip_once(redis_cluster: Any) -> None:
    keys = Keys("{failover}")
    probe = client_from_url(redis_cluster.url)
    slot = probe.keyslot(keys.audit)
    probe.close()
    old_port = _slot_owner(redis_cluster, slot)
    replica = next(p for p in (node.port for node in redis_cluster.nodes) if p != old_port
                   and redis_cluster.client(p).info("replication").get("master_port") == old_port)
    took: list[float] = []

    def failover() -> None:
        t = time.monotonic()
        c = redis_cluster.client(replica)
        assert c.execute_command("CLUSTER", "FAILOVER") in ("OK", True, b"OK")
        _wait("replica promoted", lambda: c.info("replication")["role"] == "master", 10)
        took.append(time.monotonic() - t)
        c.close()

    errors = _errorstats(redis_cluster)
    with RoutingFlags(redis_cluster.url, keys, ttl_s=60, poll_s=0.01) as reader:
        assert reader.wait_ready(5)
        n, seconds = _flip_stream(redis_cluster.url, keys, failover)
        assert _slot_owner(redis_cluster, slot) == replica  # the flips ran across a real failover
        _assert_exactly_once(redis_cluster.url, keys, n)
        _wait("reader serves the last flip", lambda: (f := reader.flag("m", "r")) is not None and f.epoch == n)
    errors = _delta(errors, _errorstats(redis_cluster))
    assert errors.get("MOVED", 0) >= 1  # a flip met the demoted master and was redirected
    print(f"failover: promoted in {took[0]:.2f} s, {n} flips in {seconds:.2f} s, node errors {errors}, "
          f"reader: {reader.messages} messages, {reader.reloads} reloads")


def _migrate_slot(cluster: Any, slot: int, src_port: int, dst_port: int) -> None:
    """Move ``slot`` from one master to another the way ``redis-cli --cluster reshard`` does:
    IMPORTING/MIGRATING, MIGRATE one key at a time (so scripts meet ASK and TRYAGAIN), then NODE."""
    src, dst = cluster.client(src_port), cluster.client(dst_port)
    src_id, dst_id = src.execute_command("CLUSTER", "MYID"), dst.execute_command("CLUSTER", "MYID")
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1):
        src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys)
        time.sleep(0.05)  # flips run in between: some keys here, some there
    for port in (dst_port, src_port):
        cluster.client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    for n in cluster.nodes:  # the other masters learn it by gossip too; tell them now
        c = cluster.client(n.port)
        if c.info("replication")["role"] == "master" and n.port not in (src_port, dst_port):
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        c.close()
    src.close()
    dst.close()


def test_slot_migration_during_flips_applies_each_flip_once(redis_cluster: Any) -> None:
    keys = Keys("{migrate}")
    probe = client_from_url(redis_cluster.url)
    slot = probe.keyslot(keys.audit)
    probe.close()
    src_port = _slot_owner(redis_cluster, slot)
    masters = [node.port for node in redis_cluster.nodes
               if redis_cluster.client(node.port).info("replication")["role"] == "master"]
    dst_port = next(p for p in masters if p != src_port)
    errors = _errorstats(redis_cluster)
    with RoutingFlags(redis_cluster.url, keys, ttl_s=60, poll_s=0.01) as reader:
        assert reader.wait_ready(5)
        n, seconds = _flip_stream(redis_cluster.url, keys,
                                  lambda: _migrate_slot(redis_cluster, slot, src_port, dst_port))
        assert _slot_owner(redis_cluster, slot) == dst_port
        _assert_exactly_once(redis_cluster.url, keys, n)
        _wait("reader serves the last flip", lambda: (f := reader.flag("m", "r")) is not None and f.epoch == n)
    errors = _delta(errors, _errorstats(redis_cluster))
    # flips met the slot half moved (ASK: keys gone from the source; TRYAGAIN: a script's keys on
    # both sides) and, after it moved, the old owner (MOVED)
    assert errors.get("ASK", 0) + errors.get("TRYAGAIN", 0) >= 1 and errors.get("MOVED", 0) >= 1
    print(f"migration: {n} flips in {seconds:.2f} s, node errors {errors}, "
          f"reader: {reader.messages} messages, {reader.reloads} reloads")


def test_an_unreachable_cluster_is_a_connection_error() -> None:
    from watchdog.dev.embedded import free_port

    url = f"redis+cluster://:s3cret@127.0.0.1:{free_port()}"
    client = client_from_url(url, timeout_s=0.2)  # connects at its first command: a daemon starts without Redis
    store = FlagStore(client, Keys("{dead}"))
    for attempt in (1, 2):
        with pytest.raises(redis.ConnectionError) as err:  # what every caller handles, not RedisClusterException
            store.flip("m", "r", "fp16", expected_epoch=None, reason="x", changed_by="t")
        assert "s3cret" not in str(err.value) and type(err.value).__name__ == "ClusterUnreachable", attempt
    client.close()
    with RoutingFlags(url, Keys("{dead}"), reconnect_s=0.05, timeout_s=0.2) as reader:
        assert not reader.wait_ready(0.5)
        assert not reader.healthy and (reader.last_error or "").startswith("ClusterUnreachable")
        assert reader.precision_for("m", "r") == "fp8"


def test_the_daemon_rolls_back_once_on_cluster(redis_cluster: Any, kafka_service: Any, topic: str,
                                               tmp_path: Any, sink: Any) -> None:
    """The whole daemon on the cluster: checkpoints, the flip with its page, the outbox's WATCH/MULTI,
    evidence, the windows stream, all under one hash tag."""
    from tests.daemon_harness import MODEL, make_config, running_daemon, traffic, write_policy
    from tests.helpers import wait_until

    s, sink_url = sink
    keys = Keys("{e2e}")
    cfg = make_config(kafka_service.address, 0, topic, write_policy(tmp_path / "p.yaml"), sink_url,
                      redis={"url": redis_cluster.url, "prefix": keys.prefix, "socket_timeout_s": 0.5})
    with running_daemon(cfg) as (daemon, _server), \
            traffic(kafka_service.address, topic, ["legal/contracts", "support/chat"],
                    daemon.flags.precision_for) as gen:
        wait_until(lambda: daemon.stats.windows_closed >= 8, 30, what="windows to close")
        gen.inject(MODEL, "legal/contracts", "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16", 30)
        closed = daemon.stats.windows_closed
        wait_until(lambda: daemon.stats.windows_closed >= closed + 8, 30)
        wait_until(lambda: any(r.path.endswith("webhook") and "legal/contracts" in json.dumps(r.body)
                               for r in s.received), 10, what="the page")
        problems = daemon.problems()
    client = client_from_url(redis_cluster.url)
    try:
        store = FlagStore(client, keys)
        assert [r["route"] for r in store.audit(100)] == ["legal/contracts"]
        assert store.get(MODEL, "support/chat") is None
        firing = [r.body for r in s.received if r.path.endswith("webhook") and "legal/contracts" in json.dumps(r.body)
                  and r.body.get("status") == "firing"]
        assert len(firing) == 1, firing
        assert client.xlen(keys.windows) >= 10
        ckpts = [k for k in client.scan_iter(match=f"{keys.prefix}:ckpt:*")]
        assert ckpts and {client.keyslot(k) for k in ckpts} == {client.keyslot(keys.audit)}
        assert not problems, problems
    finally:
        client.close()


def test_a_killed_master_fails_over_and_the_flips_go_on(redis_cluster: Any) -> None:
    """SIGKILL of the tag's master: the replica takes over after ``cluster-node-timeout`` (3 s here);
    meanwhile flips stay pending in the Actuator (connection errors), then go on. Replication is asynchronous, so a flip acknowledged just before the kill may be lost: then
    the next decision is refused as stale, re-read and applied. No flip is ever written twice. Runs
    last: the killed node stays down."""
    keys = Keys("{killed}")
    probe = client_from_url(redis_cluster.url)
    slot = probe.keyslot(keys.audit)
    probe.close()
    port = _slot_owner(redis_cluster, slot)
    victim = next(node for node in redis_cluster.nodes if node.port == port)
    replica = next(node.port for node in redis_cluster.nodes if node.port != port
                   and redis_cluster.client(node.port).info("replication").get("master_port") == port)
    took: list[float] = []

    def kill() -> None:
        t = time.monotonic()
        assert victim.proc is not None
        victim.proc.kill()
        c = redis_cluster.client(replica)
        _wait("replica promoted", lambda: c.info("replication")["role"] == "master", 20)
        took.append(time.monotonic() - t)
        c.close()

    with RoutingFlags(redis_cluster.url, keys, ttl_s=60, poll_s=0.01, reconnect_s=0.1) as reader:
        assert reader.wait_ready(5)
        n, seconds = _flip_stream(redis_cluster.url, keys, kill, before=20, after=10)
        assert _slot_owner(redis_cluster, slot) == replica
        client = client_from_url(redis_cluster.url)
        audit = client.xrange(keys.audit)
        epochs = [int(f["epoch"]) for _, f in audit]
        decisions = [int(f["reason"].split()[-1]) for _, f in audit]
        assert epochs == list(range(1, len(epochs) + 1))  # none twice, none skipped
        assert decisions == sorted(set(decisions)) and decisions[-1] == n - 1  # each once, in order, the last one in
        assert len(decisions) >= n - 2  # at most the flips in flight at the kill are lost
        assert client.hget(keys.route("m", "r"), "precision") == ("fp16" if (n - 1) % 2 == 0 else "fp8")
        pages = [json.loads(f["json"])["decision"] for _, f in client.xrange(keys.outbox)]
        assert len(pages) == len(set(pages))  # no page twice
        client.close()
        _wait("reader serves the last flip", lambda: (f := reader.flag("m", "r")) is not None
              and f.epoch == len(epochs), 10)
    print(f"killed master: replica promoted after {took[0]:.2f} s, {n} decisions in {seconds:.2f} s, "
          f"{n - len(decisions)} lost to asynchronous replication, reader reloads {reader.reloads}")


def test_the_daemon_starts_while_no_node_answers_and_says_redis(kafka_service: Any, topic: str,
                                                                 tmp_path: Any) -> None:
    from tests.daemon_harness import make_config, running_daemon, write_policy
    from tests.helpers import wait_until
    from watchdog.dev.embedded import free_port

    cfg = make_config(kafka_service.address, 0, topic, write_policy(tmp_path / "p.yaml"), None,
                      redis={"url": f"redis+cluster://127.0.0.1:{free_port()}", "prefix": "{down}",
                             "socket_timeout_s": 0.5})
    with running_daemon(cfg) as (daemon, _server):
        wait_until(lambda: any(p.startswith("redis: ") and "ClusterUnreachable" in p for p in daemon.problems()),
                   15, what="readiness to name redis")
