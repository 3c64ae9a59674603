"""Build a Redis client from one URL: a plain server, TLS, a master found through Sentinel, or a
Redis Cluster.

URL forms (``client_from_url``):

- ``redis://[[user]:password@]host:port[/db]`` and ``rediss://...`` (TLS), ``unix:///path.sock?db=0``:
  redis-py's own ``from_url`` (query options such as ``ssl_ca_certs=`` pass through).
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?options]``:
  the sentinels at ``host:port,...`` are asked for the master of ``service_name``; every new
  connection asks again, so after a failover the next connection goes to the new master (a
  demoted master's ``READONLY`` reply closes the connection the same way). The user/password are
  the data nodes'; ``sentinel_password=`` (and ``sentinel_username=``) authenticate to the
  sentinels when those need it. ``rediss+sentinel://`` speaks TLS to the data nodes
  (``ssl_ca_certs=``, ``ssl_certfile=``, ``ssl_keyfile=``, ``ssl_cert_reqs=``).
  Example: ``redis+sentinel://:s3cret@10.0.0.5:26379,10.0.0.6:26379/llmwd/0``.

  ``master_recheck_s=`` (default 0): how often a command asks the sentinels who the master is
  (see below); 0 means before every command (one loopback round trip, ~0.1 ms).

- ``redis+cluster://[[user]:password@]host:port[,host:port...][?options]`` (``rediss+cluster://``
  for TLS, with the ``ssl_*`` options): a ``RedisCluster`` that discovers every node from the
  listed ones (one reachable node is enough). There is no database number (a cluster has only 0).
  The key prefix must be a hash tag such as ``{llmwd}`` (``watchdog.core.keys.cluster_prefix_problem``;
  the config, the CLI and the gateway reader refuse one without). ``retries=`` (default 0): how
  often redis-py retries a command after a connection error, timeout or ``CLUSTERDOWN`` (after
  refreshing the slot map). ``MOVED``, ``ASK`` and ``TRYAGAIN`` are followed inside redis-py
  whatever ``retries`` says (up to 16 redirections, 50 ms pauses on ``TRYAGAIN``): a slot
  migration or a coordinated failover (``CLUSTER FAILOVER``) costs the caller no error. Every
  Lua script is safe to run twice (the flip is idempotent per decision, a checkpoint per sequence
  number, a claim just takes a newer generation); a MULTI that appends to a stream is not, which
  is why the default stays 0. redis-py raises ``RedisClusterException`` (not a ``RedisError``)
  when no node answers; this client raises ``ClusterUnreachable``, a ``redis.ConnectionError``,
  so callers see an outage as they do on one server (and ``ClusterRefused``, a ``ResponseError``,
  for a transaction redis-py will not send, such as keys of two slots). The cluster client is built at its first
  command (``LazyCluster``), so building one needs no reachable node.
  Example: ``redis+cluster://:s3cret@10.0.0.5:6379,10.0.0.6:6379``.

Why ask again: redis-py's Sentinel pool only re-resolves the master when a connection breaks, and
it reads ``SENTINEL MASTERS``, which names the old master until the whole failover is finished.
On a forced failover the old master keeps serving meanwhile, and a write accepted there is wiped
by its resync as a replica (measured here: a flip "applied" on the old master after the replica's
promotion, gone afterwards). ``FollowingSentinelPool`` re-asks the sentinels with
``SENTINEL GET-MASTER-ADDR-BY-NAME`` (which names the promoted replica as soon as it is master)
every ``master_recheck_s`` and drops connections to a master they no longer name. A window stays
between the replica's promotion and the sentinel noticing it (up to ~1 s, its INFO period during a
failover); set ``min-replicas-to-write 1`` on the master so that it refuses writes in that window
(the tests run that way).

Clients fail fast: ``timeout_s`` socket timeouts and no retry loop inside redis-py (its default
retries a dead server for seconds per command); callers own their retry policy.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from watchdog.config.redact import redacted
from watchdog.core.keys import is_cluster_url

log = logging.getLogger(__name__)

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
#: after a failed sentinel query, commands go to the last known master for this long unasked
_SENTINEL_DOWN_BACKOFF_S = 1.0
_SSL_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """A parsed ``redis+cluster://`` URL."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_options: dict[str, str] = field(default_factory=dict)
    retries: int = 0


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    ssl_options: dict[str, str] = field(default_factory=dict)
    master_recheck_s: float = 0.0


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def _userinfo_and_hosts(url: str, netloc: str, what: str, default_port: int) -> tuple[
        str | None, str | None, list[tuple[str, int]]]:
    """(user, password, [(host, port), ...]) of ``[user:pass@]h1:p1[,h2:p2...]``."""
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, sep, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    addrs: list[tuple[str, int]] = []
    for item in hosts.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(default_port)
        host = host.strip("[]")
        try:
            addrs.append((host, int(port)))
        except ValueError:
            raise ValueError(f"bad {what} address {item!r} in {redacted(url)}: use host:port") from None
    if not addrs:
        raise ValueError(f"no {what} host:port in {redacted(url)}")
    return username, password, addrs


def parse_cluster_url(url: str) -> ClusterTarget:
    """Parse ``redis+cluster://[user:pass@]h1:p1[,h2:p2][?opts]``; ValueError names the fault."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if not is_cluster_url(url):
        raise ValueError(f"not a cluster URL (scheme {scheme!r}; use redis+cluster://)")
    username, password, nodes = _userinfo_and_hosts(url, parts.netloc, "cluster node", 6379)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has only database 0: drop the path of {redacted(url)}")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"retries", *_SSL_OPTIONS}
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))} in {redacted(url)}")
    try:
        retries = int(query.get("retries", "0"))
    except ValueError:
        retries = -1
    if not 0 <= retries <= 10:
        raise ValueError(f"retries must be 0 to 10 in {redacted(url)}")
    return ClusterTarget(nodes=tuple(nodes), username=username, password=password, ssl=scheme == "rediss+cluster",
                         ssl_options={k: v for k, v in query.items() if k in _SSL_OPTIONS}, retries=retries)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Parse ``redis+sentinel://[user:pass@]h1:p1[,h2:p2]/service[/db][?opts]``; ValueError names the fault."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a sentinel URL (scheme {scheme!r}; use redis+sentinel://)")
    username, password, sentinels = _userinfo_and_hosts(url, parts.netloc, "sentinel", 26379)
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(f"no service name in {redacted(url)}: use redis+sentinel://host:port/<service_name>/<db>")
    if len(path) > 2:
        raise ValueError(f"too many path parts in {redacted(url)}: /<service_name>/<db>")
    db = 0
    if len(path) == 2:
        try:
            db = int(path[1])
        except ValueError:
            raise ValueError(f"bad database number {path[1]!r} in {redacted(url)}") from None
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"sentinel_password", "sentinel_username", "master_recheck_s", *_SSL_OPTIONS}
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))} in {redacted(url)}")
    return SentinelTarget(
        sentinels=tuple(sentinels), service_name=unquote(path[0]), db=db, username=username, password=password,
        ssl=scheme == "rediss+sentinel", sentinel_username=query.get("sentinel_username"),
        sentinel_password=query.get("sentinel_password"),
        ssl_options={k: v for k, v in query.items() if k in _SSL_OPTIONS},
        master_recheck_s=_seconds(query.get("master_recheck_s", "0"), url),
    )


def _seconds(raw: str, url: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:  # also false for NaN
        raise ValueError(f"master_recheck_s must be 0 to 3600 seconds in {redacted(url)}")
    return value


@functools.cache
def _following_pool_class() -> type:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.sentinel import SentinelConnectionPool

    class FollowingSentinelPool(SentinelConnectionPool):
        """A Sentinel pool that re-asks the sentinels for the master every ``master_recheck_s``
        and drops connections to one they no longer name (see the module docstring)."""

        def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
            self.master_recheck_s = float(kwargs.pop("master_recheck_s", 0.0))
            self._next_check = 0.0
            super().__init__(service_name, sentinel_manager, **kwargs)

        def follow_master(self) -> tuple[str, int] | None:
            """The master the sentinels name now (rate-limited); idle connections elsewhere close."""
            now = time.monotonic()
            if now >= self._next_check:
                try:
                    self.get_master_address()  # disconnects idle connections if the master moved
                    self._next_check = now + self.master_recheck_s
                except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                    log.warning("sentinel query failed (%s); using the last known master", exc)
                    self._next_check = now + _SENTINEL_DOWN_BACKOFF_S
            addr = self.master_address
            return None if addr is None else (str(addr[0]), int(addr[1]))

        def get_connection(self, *args: Any, **kwargs: Any) -> Any:
            self.follow_master()
            return super().get_connection(*args, **kwargs)

    return FollowingSentinelPool


@functools.cache
def _sentinel_class() -> type:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.sentinel import MasterNotFoundError, Sentinel

    class AddrSentinel(Sentinel):
        """Discovers the master with GET-MASTER-ADDR-BY-NAME (see the module docstring)."""

        def discover_master(self, service_name: str) -> tuple[str, int]:
            errors = []
            for i, sentinel in enumerate(self.sentinels):
                try:
                    addr = sentinel.sentinel_get_master_addr_by_name(service_name)
                except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                    errors.append(f"{exc}")
                    continue
                if addr:
                    if i:  # ask the one that answered first next time
                        self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
                    host = addr[0].decode() if isinstance(addr[0], bytes) else str(addr[0])
                    return host, int(addr[1])
            raise MasterNotFoundError(f"no sentinel names a master for {service_name!r}"
                                      + (f" ({'; '.join(errors)})" if errors else ""))

    return AddrSentinel


@functools.cache
def _cluster_class() -> type:
    import redis
    from redis.cluster import RedisCluster
    from redis.exceptions import CrossSlotTransactionError, InvalidPipelineStack, RedisClusterException

    class ClusterUnreachable(redis.ConnectionError):
        """No node of the cluster answered, or none serves the slot (redis-py's own
        ``RedisClusterException``, which is no ``RedisError``, as the ``ConnectionError`` every
        caller already handles)."""

    class ClusterRefused(redis.ResponseError):
        """A command redis-py refuses to send in cluster mode (keys of two slots in one
        transaction, ...): a ``RedisError`` too, so it is reported, not a crash."""

    def mapped(call: Any) -> Any:
        @functools.wraps(call)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except RedisClusterException as exc:
                # redis-py raises the bare class for both "no node answers" and "keys of two slots"
                refused = isinstance(exc, CrossSlotTransactionError | InvalidPipelineStack) or "same key slot" in str(exc)
                raise (ClusterRefused if refused else ClusterUnreachable)(f"redis cluster: {exc}") from exc
        return run

    class WatchdogCluster(RedisCluster):
        """``RedisCluster`` whose commands and pipelines raise only ``RedisError``s."""

        unreachable = ClusterUnreachable

        @mapped
        def execute_command(self, *args: Any, **kwargs: Any) -> Any:
            return super().execute_command(*args, **kwargs)

        def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
            pipe = super().pipeline(transaction, shard_hint)
            pipe.execute = mapped(pipe.execute)
            return pipe

    return WatchdogCluster


class LazyCluster:
    """A ``RedisCluster`` built at its first command: building one asks a node for the slot map, and
    a daemon must start (and say ``redis`` in readiness) while no node answers, as it does with one
    server. Until then a command raises ``ClusterUnreachable`` and the next one tries again."""

    def __init__(self, build: Any, decode_responses: bool) -> None:
        from redis.connection import Encoder

        self._build = build
        self._client: Any = None
        self._lock = threading.Lock()
        self._encoder = Encoder("utf-8", "strict", decode_responses)

    def register_script(self, script: str) -> Any:
        from redis.commands.core import Script

        return Script(self, script)  # type: ignore[arg-type]  # it only needs get_encoder and the commands

    def get_encoder(self) -> Any:
        """What ``Script`` asks for: registering a script needs no node."""
        return self._encoder

    def _get(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._build()
            return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _cluster_client(url: str, common: dict[str, Any]) -> LazyCluster:
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.cluster import ClusterNode
    from redis.exceptions import RedisClusterException
    from redis.retry import Retry

    target = parse_cluster_url(url)
    kwargs: dict[str, Any] = {k: v for k, v in common.items() if k != "retry"}
    if target.ssl:
        kwargs["ssl"] = True
        kwargs.update(target.ssl_options)
    cls: Any = _cluster_class()

    def build() -> Any:
        try:
            return cls(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes], username=target.username,
                       password=target.password, retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5),
                                                             target.retries), **kwargs)
        except RedisClusterException as exc:
            raise cls.unreachable(f"redis cluster at {redacted(url)}: {exc}") from exc

    return LazyCluster(build, bool(common.get("decode_responses")))


def connection_is_current(client: Any, connection: Any) -> bool:
    """False when ``client`` follows a Sentinel master and ``connection`` (e.g. a pub/sub one,
    which the pool never re-checks) is connected to a server the sentinels no longer name."""
    pool = getattr(client, "connection_pool", None)
    follow = getattr(pool, "follow_master", None)
    if follow is None or connection is None or getattr(connection, "_sock", None) is None:
        return True
    addr = follow()
    return addr is None or (connection.host, int(connection.port)) == addr


def client_from_url(url: str, timeout_s: float = 1.0, decode_responses: bool = True) -> Any:
    """A ``redis.Redis`` for ``url`` (see the module docstring for the forms)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    common: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 0), decode_responses=decode_responses,
                                  health_check_interval=0)
    if is_cluster_url(url):
        return _cluster_client(url, common)
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **common)

    target = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        sentinel_kwargs["username"] = target.sentinel_username
    node_kwargs: dict[str, Any] = dict(common, db=target.db, username=target.username, password=target.password)
    if target.ssl:
        node_kwargs["ssl"] = True
        node_kwargs.update(target.ssl_options)
    sentinel = _sentinel_class()(list(target.sentinels), sentinel_kwargs=sentinel_kwargs, **node_kwargs)
    return sentinel.master_for(target.service_name, connection_pool_class=_following_pool_class(),
                               master_recheck_s=target.master_recheck_s, **node_kwargs)
