"""The parts of a drill: real services, the daemon under test as a subprocess, traffic counted by
broker ack, and a readiness sampler.

The daemon is black box: it runs as ``python -m watchdog.cli.main run --config FILE`` from the checkout
given as ``root`` (its cwd and PYTHONPATH), so the same harness measures main and any branch.
Only its outputs are read: the Redis windows and audit streams, the alert sink, ``/readyz``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from tests.netfault import DelayProxy
from watchdog.dev.alertsink import AlertSink
from watchdog.dev.embedded import Service, find_redis_server, free_port, start_tansu, wait_for_port
from watchdog.dev.traffic import Route, TrafficGenerator

log = logging.getLogger(__name__)

MODEL = "llama-drill"
#: (route, precision, window start)
WindowKey = tuple[str, str, float]

#: The drills' policy: a quality rule on shadow agreement with real guards (cooldown, promote
#: delay, daily budget), so a lost engine state shows as a guard violation in the audit.
POLICY: dict[str, Any] = {
    "name": "drill",
    "description": "fault drills: shadow agreement with guards",
    "scope": {"models": ["*"], "routes": ["*"]},
    "cooldown": "30s",
    "max_flips_per_day": 4,
    "rules": [{"name": "shadow-agreement", "source": "live", "metric": "shadow_rougeL",
               "fail_if": "candidate < 0.85", "min_samples": 5, "for": 2, "severity": "critical",
               "action": "rollback"}],
    "promote": {"mode": "auto", "healthy_windows": 3, "after": "30s"},
}


@dataclass(frozen=True)
class Guards:
    cooldown_s: float = 30.0
    promote_after_s: float = 30.0
    max_flips_per_day: int = 4


def redis_service(workdir: Path, port: int | None = None, password: str | None = None,
                  appendonly: bool = True) -> Service:
    """A redis-server of the drill's own (so it can be killed, emptied or given a password)."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
            "--dir", str(workdir), "--daemonize", "no", "--protected-mode", "no"]
    if password:
        argv += ["--requirepass", password]
    return Service("redis", argv, port, workdir / "redis.log", workdir=workdir)


@dataclass
class EnvService(Service):
    """A ``Service`` started with extra environment variables (Tansu's S3 settings)."""

    env: dict[str, str] = field(default_factory=dict)

    def start(self, timeout: float = 15.0) -> Service:
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)  # Service.start passes the process environment on
        try:
            return super().start(timeout)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def start_s3_tansu(workdir: Path) -> tuple[Service, Service]:
    """moto's S3 server and a Tansu broker storing in it (``s3://tansu/``): data survives a broker
    kill. Needs ``moto[server]``."""
    import boto3

    workdir.mkdir(parents=True, exist_ok=True)
    s3_port = free_port()
    moto = Service("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)], s3_port,
                   workdir / "moto.log", workdir=workdir).start(30)
    endpoint = f"http://127.0.0.1:{s3_port}"
    creds = {"aws_access_key_id": "drill", "aws_secret_access_key": "drill", "region_name": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, **creds).create_bucket(Bucket="tansu")
    env = {"AWS_ENDPOINT": endpoint, "AWS_ACCESS_KEY_ID": "drill", "AWS_SECRET_ACCESS_KEY": "drill",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    from watchdog.dev.embedded import find_tansu

    argv = [find_tansu(), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "s3://tansu/"]
    tansu = EnvService("tansu", argv, port, workdir / "tansu.log", workdir=workdir, env=env).start(20)
    return moto, tansu


#: address-space cap of a daemon under test: a YAML alias bomb grows past 4 GB on this shared box
DAEMON_MEMORY_CAP = 3 << 30


def _cap_memory(pid: int) -> None:
    import resource

    with contextlib.suppress(OSError, ValueError):  # the child may already have exited
        resource.prlimit(pid, resource.RLIMIT_AS, (DAEMON_MEMORY_CAP, DAEMON_MEMORY_CAP))


class DaemonProc:
    """One replica of the daemon under test, run from ``root`` with its own config and port."""

    def __init__(self, root: Path, name: str, config: dict[str, Any], workdir: Path) -> None:
        self.root = root
        self.name = name
        self.config = config
        self.port = int(config["server"]["port"])
        self.cfg_path = workdir / f"{name}.yaml"
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        #: unexpected exits: (time, return code)
        self.deaths: list[tuple[float, int]] = []
        self._expect_exit = False
        self.starts = 0
        #: [down since, up again or None]: killed, stopped, frozen or not yet started
        self.down: list[list[float | None]] = [[0.0, None]]
        #: clock drills: a file holding the seconds this replica's ``time.time()`` is shifted by
        #: (tests/drills/clockshift/sitecustomize.py; only ``time.time``, not sleep nor monotonic)
        self.clock_file: Path | None = None

    def _went_down(self) -> None:
        if not self.down or self.down[-1][1] is not None:
            self.down.append([time.time(), None])

    def _came_up(self) -> None:
        if self.down and self.down[-1][1] is None:
            self.down[-1][1] = time.time()

    def write_config(self) -> None:
        self.cfg_path.write_text(yaml.safe_dump(self.config))

    def start(self) -> DaemonProc:
        self.note_exit()
        self.write_config()
        env = {**os.environ, "PYTHONPATH": str(self.root), "PYTHONUNBUFFERED": "1"}
        env.pop("LLMWD_CONFIG", None)
        env.pop("LLMWD_DRILL_CLOCK_FILE", None)
        if self.clock_file is not None:
            shift = Path(__file__).resolve().parent / "clockshift"
            env["PYTHONPATH"] = f"{shift}{os.pathsep}{self.root}"
            env["LLMWD_DRILL_CLOCK_FILE"] = str(self.clock_file)
        with open(self.log_path, "ab") as out:
            out.write(f"\n==== start {self.name} at {time.time():.3f}\n".encode())
            self.proc = subprocess.Popen([sys.executable, "-m", "watchdog.cli.main", "run", "--config", str(self.cfg_path)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.root, env=env, start_new_session=True)
        _cap_memory(self.proc.pid)
        self._expect_exit = False
        self.starts += 1
        self._came_up()
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def note_exit(self) -> None:
        """Record an exit nobody asked for (the daemon died on its own)."""
        if self.proc is not None and self.proc.poll() is not None and not self._expect_exit:
            self.deaths.append((time.time(), self.proc.returncode))
            self._expect_exit = True
            self._went_down()

    def signal(self, sig: int) -> None:
        if self.running():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.note_exit()
        self._expect_exit = True
        self._went_down()
        self.signal(signal.SIGKILL)
        self.wait(10)

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not stop within ``timeout``. Returns the exit code."""
        self.note_exit()
        self._expect_exit = True
        self._went_down()
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        rc = self.wait(timeout)
        if rc is None:
            self.signal(signal.SIGKILL)
            self.wait(10)
        return rc

    def freeze(self) -> None:
        self._went_down()
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)
        self._came_up()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def readyz(self, timeout: float = 0.4) -> tuple[bool | None, list[str]]:
        """(ready, problems); ready is None when nothing answers."""
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=timeout)
            body = r.json()
            return r.status_code == 200, list(body.get("problems") or [])
        except (httpx.HTTPError, ValueError):
            return None, []

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class FlagReader:
    """What precision each route serves, as a gateway reads it (cached 0.3 s; last value on error).

    A rolled-back route keeps a ``canary`` share on the candidate, so live windows of the candidate
    exist and the engine can see it heal and promote (without them a live promote never happens).
    """

    def __init__(self, client: Any, prefix: str = "llmwd", default: str = "fp8", canary: float = 0.5) -> None:
        self.client = client
        self.prefix = prefix
        self.default = default
        self.canary = canary
        self._cache: dict[str, tuple[float, str]] = {}
        self._rng = random.Random(11)

    def flag(self, model: str, route: str) -> str:
        now = time.monotonic()
        hit = self._cache.get(route)
        if hit and now - hit[0] < 0.3:
            return hit[1]
        value = hit[1] if hit else self.default
        with contextlib.suppress(Exception):
            value = self.client.hget(f"{self.prefix}:route:{model}:{route}", "precision") or self.default
        self._cache[route] = (now, value)
        return value

    def __call__(self, model: str, route: str) -> str:
        value = self.flag(model, route)
        if value != self.default and self._rng.random() < self.canary:
            return self.default
        return value


class Traffic:
    """Produces realistic events at ``rate`` per second over ``routes`` from a thread and counts each
    one that the broker acknowledged, per (route, precision, window start)."""

    def __init__(self, address: str, topic: str, routes: list[str], rate: float, window_s: float,
                 precision_of: Callable[[str, str], str], **producer_kw: Any) -> None:
        from kafka import KafkaProducer

        self.topic = topic
        self.window_s = window_s
        self.gen = TrafficGenerator([Route(MODEL, r, rate=rate / len(routes), shadow_share=0.4) for r in routes],
                                    precision_of=precision_of, seed=int.from_bytes(os.urandom(2), "big"))
        # retries=0 and a long request timeout: an ack is never ambiguous (a retried send that
        # landed twice, or a timed-out one that landed anyway, would make the count wrong)
        kw = {"acks": "all", "retries": 0, "enable_idempotence": False, "linger_ms": 10, "request_timeout_ms": 120_000, "delivery_timeout_ms": 180_000,
              "max_block_ms": 2_000, **producer_kw}
        self.producer = KafkaProducer(bootstrap_servers=address, **kw)
        self.rate = rate
        self.acked: Counter[WindowKey] = Counter()
        self.failed = 0
        self.sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None

    def window_of(self, ts: float) -> float:
        return round(math.floor(ts / self.window_s) * self.window_s, 6)

    def regress(self, route: str, kind: str | None = "quality") -> None:
        self.gen.inject(MODEL, route, kind)  # type: ignore[arg-type]

    def send_event(self, ev: dict[str, Any], *, count: bool = True, key: bytes | None = None) -> Any:
        """Send one event; when ``count``, its ack adds it to the ledger."""
        value = orjson.dumps(ev)
        return self.send_raw(value, key or f"{ev.get('model')}/{ev.get('route')}".encode(),
                             (ev["route"], ev["precision"], self.window_of(float(ev["ts"]))) if count else None)

    def send_raw(self, value: bytes, key: bytes, ledger_key: WindowKey | None) -> Any:
        try:
            fut = self.producer.send(self.topic, key=key, value=value)
        except Exception:  # noqa: BLE001 - the broker is down: the event was never produced
            with self._lock:
                self.failed += 1
            return None
        self.sent += 1

        def ok(_meta: Any) -> None:
            if ledger_key is not None:
                with self._lock:
                    self.acked[ledger_key] += 1

        def bad(_exc: Any) -> None:
            with self._lock:
                self.failed += 1

        fut.add_callback(ok)
        fut.add_errback(bad)
        return fut

    def event(self, route_index: int = 0, ts: float | None = None) -> dict[str, Any]:
        return self.gen.event(self.gen.routes[route_index], ts)

    def _run(self) -> None:
        interval = 1.0 / self.rate
        due = time.monotonic()
        i = 0
        while not self._stop.is_set():
            if self._paused.is_set():
                self._stop.wait(0.05)
                due = time.monotonic()
                continue
            now = time.monotonic()
            while due <= now:
                r = self.gen.routes[i % len(self.gen.routes)]
                i += 1
                self.send_event(self.gen.event(r))
                due += interval
            self._stop.wait(max(0.0, min(0.02, due - time.monotonic())))

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, name="drill-traffic", daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with contextlib.suppress(Exception):
            self.producer.flush(timeout=30)
        with contextlib.suppress(Exception):
            self.producer.close(timeout=5)

    def snapshot(self) -> Counter[WindowKey]:
        with self._lock:
            return Counter(self.acked)


@dataclass
class Sample:
    at: float
    replica: str
    ready: bool | None
    problems: list[str]


class ReadinessSampler:
    """Reads /readyz of every replica every ``every_s`` seconds."""

    def __init__(self, replicas: list[DaemonProc], every_s: float = 0.5) -> None:
        self.replicas = replicas
        self.every_s = every_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drill-readyz", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for rep in self.replicas:
                ready, problems = rep.readyz()
                self.samples.append(Sample(time.time(), rep.name, ready, problems))
                rep.note_exit()
            self._stop.wait(self.every_s)

    def start(self) -> ReadinessSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Stack:
    """Tansu, Redis, an alert sink and N daemon replicas of the checkout at ``root``, in ``workdir``."""

    root: Path
    workdir: Path
    replicas: int = 1
    partitions: int = 4
    window_s: float = 1.0
    grace_s: float = 0.3
    #: the daemons' Kafka session; Tansu answers a group join after about half of it (6 s: 3 s per
    #: daemon start and rebalance). tests/test_drills.py runs the CI subset with 2 s (runner.SESSION_ENV)
    session_timeout_ms: int = 6000
    policy: dict[str, Any] = field(default_factory=lambda: dict(POLICY))
    redis_password: str | None = None
    #: "memory" (Tansu's default: a restart forgets everything) or "s3" (moto's S3 server)
    storage: str = "memory"
    moto: Service | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    #: put a user-space fault proxy (tests/netfault.py) between the daemons and Redis / the broker
    redis_proxy: bool = False
    broker_proxy: bool = False
    redis_fault: DelayProxy | None = None
    broker_fault: DelayProxy | None = None
    tansu: Service | None = None
    redis: Service | None = None
    sink: AlertSink | None = None
    daemons: list[DaemonProc] = field(default_factory=list)
    topic: str = field(default_factory=lambda: f"llm.drill.{uuid.uuid4().hex[:8]}")
    #: stream entries saved before a drill wiped Redis: {stream: [(id, fields)]}
    archive: dict[str, list[tuple[str, dict[str, str]]]] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return f"g-{self.topic}"

    @property
    def redis_url(self) -> str:
        assert self.redis is not None
        auth = f":{self.redis_password}@" if self.redis_password else ""
        return f"redis://{auth}127.0.0.1:{self.redis.port}/0"

    @property
    def daemon_redis_url(self) -> str:
        """Where the daemons reach Redis: through the fault proxy when there is one."""
        if self.redis_fault is None:
            return self.redis_url
        auth = f":{self.redis_password}@" if self.redis_password else ""
        return f"redis://{auth}127.0.0.1:{self.redis_fault.port}/0"

    def start_services(self) -> Stack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.storage == "s3":
            self.moto, self.tansu = start_s3_tansu(self.workdir / "tansu")
        elif self.broker_proxy:
            # clients learn the proxy's port from the broker's metadata, so every round trip crosses it
            port = free_port()
            self.tansu = start_tansu(workdir=self.workdir / "tansu", advertised_port=port)
            self.broker_fault = DelayProxy(self.tansu.port, port)
        else:
            self.tansu = start_tansu(workdir=self.workdir / "tansu")
        self.create_topic()
        self.redis = redis_service(self.workdir / "redis", password=self.redis_password).start()
        if self.redis_proxy:
            self.redis_fault = DelayProxy(self.redis.port, free_port())
        self.sink = AlertSink()
        self.sink.start()
        self.policy_dir = self.workdir / "policies"
        self.policy_dir.mkdir(exist_ok=True)
        (self.policy_dir / "drill.yaml").write_text(yaml.safe_dump({"policies": [self.policy]}, sort_keys=False))
        for i in range(self.replicas):
            self.daemons.append(DaemonProc(self.root, f"replica{i}", self.daemon_config(i), self.workdir))
        return self

    def daemon_config(self, i: int) -> dict[str, Any]:
        assert self.sink is not None
        cfg: dict[str, Any] = {
            "instance": f"replica{i}",
            "policies": [str(self.policy_dir)],
            "kafka": {"bootstrap_servers": self.tansu.address if self.tansu else "", "topic": self.topic,
                      "group_id": self.group, "session_timeout_ms": self.session_timeout_ms,
                      "heartbeat_interval_ms": min(1000, self.session_timeout_ms // 4)},
            "redis": {"url": self.daemon_redis_url, "socket_timeout_s": 0.5},
            "windows": {"length_s": self.window_s, "grace_s": self.grace_s},
            "alerts": {"channels": [{"kind": "webhook", "url": f"{self.sink.url}/webhook", "timeout_s": 2.0}]},
            "server": {"port": free_port()},
            "policy_poll_s": 0.2,
        }
        for section, values in self.overrides.items():
            if isinstance(values, dict):
                cfg.setdefault(section, {}).update(values)
            else:
                cfg[section] = values
        return cfg

    def create_topic(self) -> int:
        """Create the topic with ``partitions`` partitions; returns how many it has (after a broker
        restart a client may have auto-created it first, with the broker's default count)."""
        from kafka.admin import KafkaAdminClient, NewTopic
        from kafka.errors import TopicAlreadyExistsError

        assert self.tansu is not None
        admin = KafkaAdminClient(bootstrap_servers=self.tansu.address)
        try:
            admin.create_topics([NewTopic(self.topic, self.partitions, 1)])
            return self.partitions
        except TopicAlreadyExistsError:
            meta = admin.describe_topics([self.topic])
            return len(meta[0].get("partitions") or []) if meta else 0
        finally:
            admin.close()

    def client(self, password: str | None = None) -> Any:
        import redis

        assert self.redis is not None
        return redis.Redis(host="127.0.0.1", port=self.redis.port, password=password or self.redis_password,
                           decode_responses=True, socket_timeout=2)

    def traffic(self, routes: list[str], rate: float = 120.0, **producer_kw: Any) -> Traffic:
        assert self.tansu is not None
        return Traffic(self.tansu.address, self.topic, routes, rate, self.window_s,
                       FlagReader(self.client()), **producer_kw)

    def restart_broker(self, kill: bool = False) -> None:
        """Stop (SIGTERM, or SIGKILL with ``kill``) and start the broker. In memory storage a restart
        forgets every topic, so the topic is re-created; with S3 storage it must come back by itself."""
        assert self.tansu is not None
        if kill:
            self.tansu.kill()
            self.tansu.start(20)
        else:
            self.tansu.restart(20)
        wait_for_port(self.tansu.port, 20)
        if self.storage == "memory":
            n = self.create_topic()
            if n != self.partitions:
                log.warning("topic re-created with %d partitions, not %d", n, self.partitions)
                self.partitions = n or self.partitions

    def stream(self, name: str) -> list[tuple[str, dict[str, str]]]:
        """Entries of stream ``llmwd:{name}``, including those saved before Redis was wiped."""
        saved = list(self.archive.get(name, []))
        seen = {i for i, _ in saved}
        try:
            live = self.client().xrange(f"llmwd:{name}")
        except Exception:  # noqa: BLE001 - Redis down or refusing: what was archived is all we have
            live = []
        return saved + [(i, f) for i, f in live if i not in seen]

    def restart_redis(self, empty: bool = False) -> None:
        assert self.redis is not None
        if empty:
            for name in ("windows", "audit"):
                self.archive[name] = self.stream(name)
        self.redis.stop()
        if empty:
            shutil.rmtree(self.workdir / "redis" / "appendonlydir", ignore_errors=True)
        self.redis.start()

    def close(self) -> None:
        for d in self.daemons:
            with contextlib.suppress(Exception):
                d.terminate(15)
        for svc in (self.tansu, self.redis, self.moto):
            if svc is not None:
                with contextlib.suppress(Exception):
                    svc.kill()  # SIGKILL also ends a process a drill left stopped
        if self.sink is not None:
            self.sink.stop()
        for proxy in (self.redis_fault, self.broker_fault):
            if proxy is not None:
                proxy.close()


@contextlib.contextmanager
def stack(root: Path, workdir: Path, **kw: Any) -> Iterator[Stack]:
    s = Stack(root=root, workdir=workdir, **kw)
    try:
        yield s.start_services()
    finally:
        s.close()


def read_topic(address: str, topic: str, partitions: int | None = None, idle_s: float = 2.0,
               limit_s: float = 30.0) -> Counter[str]:
    """Every record of ``topic`` now in the broker, as request ids (to check acks against the log).
    ``partitions`` None: as many as the broker says the topic has (none if it does not exist)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=address, enable_auto_commit=False, consumer_timeout_ms=500)
    ids: Counter[str] = Counter()
    try:
        found = sorted(c.partitions_for_topic(topic) or []) if partitions is None else list(range(partitions))
        if not found:
            return ids
        tps = [TopicPartition(topic, p) for p in found]
        c.assign(tps)
        c.seek_to_beginning()
        deadline = time.monotonic() + limit_s
        last = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - last < idle_s:
            for recs in c.poll(300, max_records=5000).values():
                last = time.monotonic()
                for r in recs:
                    try:
                        ids[str(orjson.loads(r.value).get("request_id"))] += 1
                    except (orjson.JSONDecodeError, AttributeError, TypeError):
                        ids["<invalid>"] += 1
    finally:
        c.close()
    return ids
