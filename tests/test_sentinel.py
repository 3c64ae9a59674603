"""Redis Sentinel: the daemon's client (FlagStore through redis_conn.client_from_url) and the gateway
reader (RoutingFlags, with its pub/sub invalidation) follow a failover to the new master.

A master, a replica and one sentinel (Debian's ``redis-sentinel``, quorum 1) on free ports."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from watchdog.actuation.actuator import FlagStore
from watchdog.actuation.routing import RoutingFlags
from watchdog.core.keys import Keys
from watchdog.dev.embedded import Service, find_redis_server, free_port
from watchdog.state.redis_conn import client_from_url, parse_sentinel_url

pytestmark = pytest.mark.services
SERVICE = "llmwd"
#: a failover must be followed within this many seconds (detection is not timed: the forced
#: failover starts at once; a killed master is declared down after ``down-after-milliseconds``)
FOLLOW_S = 8.0


@dataclass
class Cluster:
    master: Service
    replica: Service
    sentinel: Service

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SERVICE}/0"

    def sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel.port, decode_responses=True, socket_timeout=2)

    def master_port(self) -> int:
        return int(self.sentinel_client().sentinel_get_master_addr_by_name(SERVICE)[1])


def _redis(name: str, wd: Path, port: int, *extra: str) -> Service:
    wd.mkdir(parents=True, exist_ok=True)
    argv = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(wd), "--daemonize", "no", "--protected-mode", "no", *extra]
    return Service(name, argv, port, wd / f"{name}.log", workdir=wd).start(10)


def _wait(what: str, ok: object, timeout: float = 10.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if ok():  # type: ignore[operator]
                return time.monotonic() - t0
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    sentinel_bin = shutil.which("redis-sentinel")
    if sentinel_bin is None:
        pytest.skip("redis-sentinel is not installed (Debian: apt-get install redis-sentinel)")
    mport, rport, sport = free_port(), free_port(), free_port()
    # min-replicas-to-write: a master cut off from its replica (promoted away) refuses writes
    # instead of accepting ones its resync would wipe (see watchdog/state/redis_conn.py)
    master = _redis("master", tmp_path / "m", mport, "--min-replicas-to-write", "1", "--min-replicas-max-lag", "10")
    replica = _redis("replica", tmp_path / "r", rport, "--replicaof", "127.0.0.1", str(mport))
    rc = redis.Redis(port=rport, decode_responses=True)
    _wait("replica in sync", lambda: rc.info("replication").get("master_link_status") == "up")
    swd = tmp_path / "s"
    swd.mkdir()
    conf = swd / "sentinel.conf"
    conf.write_text(f"port {sport}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\ndir {swd}\n"
                    f"sentinel monitor {SERVICE} 127.0.0.1 {mport} 1\n"
                    f"sentinel down-after-milliseconds {SERVICE} 500\n"
                    f"sentinel failover-timeout {SERVICE} 4000\n")
    sentinel = Service("sentinel", [sentinel_bin, str(conf)], sport, swd / "sentinel.log", workdir=swd).start(10)
    c = Cluster(master, replica, sentinel)
    sc = c.sentinel_client()
    _wait("sentinel sees the replica",
          lambda: any(r["port"] == rport and "s_down" not in r["flags"] and r.get("master-link-status") == "ok"
                      for r in sc.sentinel_slaves(SERVICE)))  # type: ignore[no-untyped-call]
    try:
        yield c
    finally:
        for svc in (sentinel, replica, master):
            svc.stop()


def _follow(c: Cluster, failover: str) -> None:
    keys = Keys("llmwd-sentinel")
    store = FlagStore(client_from_url(c.url, timeout_s=0.5), keys)
    reader = RoutingFlags(c.url, keys, default_precision="fp8", reconnect_s=0.1, ttl_s=2.0)
    try:
        assert reader.wait_ready(5)
        store.flip("m", "chat", "fp16", expected_epoch=None, reason="before", changed_by="test")
        _wait("reader sees the first flip", lambda: reader.precision_for("m", "chat") == "fp16", 3)
        old = c.master.port
        if failover == "forced":
            # NOGOODSLAVE until the sentinel has the replica's first INFO: ask again until accepted
            _wait("sentinel accepts the failover",
                  lambda: c.sentinel_client().execute_command("SENTINEL", "FAILOVER", SERVICE), 12)
        else:
            c.master.kill()
        t0 = time.monotonic()
        _wait("sentinel promotes the replica", lambda: c.master_port() == c.replica.port, FOLLOW_S)

        def write() -> bool:
            return store.flip("m", "chat", "fp8", expected_epoch=None, reason="after", changed_by="test").applied

        wrote = _wait("FlagStore write lands on the new master", write, FOLLOW_S)
        seen = _wait("RoutingFlags follows", lambda: reader.precision_for("m", "chat") == "fp8", FOLLOW_S)
        print(f"{failover}: write after {time.monotonic() - t0 - seen:.2f} s, reader after "
              f"{time.monotonic() - t0:.2f} s (wrote {wrote:.2f} s after promotion, seen {seen:.2f} s after)")
        new = redis.Redis(port=c.replica.port, decode_responses=True)
        assert new.info("replication")["role"] == "master" and c.replica.port != old
        assert new.hget(keys.route("m", "chat"), "precision") == "fp8"
        assert reader.healthy
        # and a flip after the failover reaches the reader through pub/sub on the new master
        store.flip("m", "chat", "fp16", expected_epoch=None, reason="again", changed_by="test")
        _wait("pub/sub on the new master", lambda: reader.precision_for("m", "chat") == "fp16", 2)
    finally:
        reader.close()
        store.client.close()


def test_forced_failover_is_followed(cluster: Cluster) -> None:
    _follow(cluster, "forced")


def test_killed_master_is_followed(cluster: Cluster) -> None:
    _follow(cluster, "kill")


@pytest.mark.parametrize(("url", "want"), [
    ("redis+sentinel://h1:26379,h2:26380/svc/3", ((("h1", 26379), ("h2", 26380)), "svc", 3, None, False)),
    ("redis+sentinel://:pw@h1/svc", ((("h1", 26379),), "svc", 0, "pw", False)),
    ("rediss+sentinel://u:p%40w@[::1]:26379/svc/1?sentinel_password=x&ssl_ca_certs=/ca.pem",
     ((("::1", 26379),), "svc", 1, "p@w", True)),
])
def test_sentinel_url_forms(url: str, want: tuple[object, ...]) -> None:
    t = parse_sentinel_url(url)
    assert (t.sentinels, t.service_name, t.db, t.password, t.ssl) == want


@pytest.mark.parametrize(("url", "cause"), [
    ("redis+sentinel://h1:26379", "no service name"),
    ("redis+sentinel://h1:x/svc", "bad sentinel address"),
    ("redis+sentinel://h1/svc/zero", "bad database number"),
    ("redis+sentinel://:secret@h1/svc/0?bogus=1", "unknown option"),
])
def test_bad_sentinel_urls(url: str, cause: str) -> None:
    with pytest.raises(ValueError, match=cause) as exc:
        parse_sentinel_url(url)
    assert "secret" not in str(exc.value)
