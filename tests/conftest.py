"""Fixtures that start real services on free loopback ports: redis-server and the Tansu broker."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from watchdog.dev.embedded import ClusterUnsupported, Service, start_redis, start_redis_cluster, start_tansu

# LiteLLM, once imported (the LiteLLM tests), fetches its model cost map from GitHub and, with no internet, retries on a
# thread that logs a warning to stderr seconds later, inside whichever test is capturing it then (CI saw it in a
# one-line-error test of the CLI). The bundled map is enough here; set before any import, subprocesses inherit it.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="session")
def redis_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_redis(workdir=tmp_path_factory.mktemp("redis"))
    yield svc
    svc.stop()


@pytest.fixture
def redis_client(redis_service: Service) -> Iterator[object]:
    """A client on the shared Redis, flushed before and after each test."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_service.port, decode_responses=True)
    client.flushall()
    yield client
    client.flushall()
    client.close()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Service]:
    """A Redis for this test alone, so the test may kill and restart it (append-only file on)."""
    svc = start_redis(workdir=tmp_path / "redis")
    yield svc
    svc.stop()


@dataclass
class RedisClusterNodes:
    """Three masters and three replicas of one Redis Cluster on loopback ports."""

    nodes: list[Service]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes[:3])

    def client(self, port: int) -> Any:
        import redis

        return redis.Redis(port=port, decode_responses=True, socket_timeout=5)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A Redis Cluster of 3 masters + 3 replicas (``redis-server --cluster-enabled yes``, joined by
    ``redis-cli --cluster create``), ready (``cluster_state:ok`` everywhere, replicas in sync)."""
    try:
        nodes = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    except ClusterUnsupported as exc:
        pytest.skip(str(exc))
    yield RedisClusterNodes(nodes)
    for n in nodes:
        n.stop()


@pytest.fixture(scope="session")
def kafka_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_tansu(workdir=tmp_path_factory.mktemp("tansu"))
    yield svc
    # clients a test left open are closed while the broker is still up, and named in the summary: a
    # librdkafka handle outliving the broker logs "Connection refused" after pytest's summary
    LEFT_OPEN.extend(close_leftover_kafka_clients())
    # SIGKILL, not SIGTERM: Tansu drains connections still open for 5 s on SIGTERM (the session's
    # last teardown took 6.3 s); its memory storage holds nothing worth a graceful stop
    svc.kill()


#: Kafka clients the session found open at its end (see close_leftover_kafka_clients)
LEFT_OPEN: list[str] = []


def close_leftover_kafka_clients() -> list[str]:
    """Close the event emitters and Kafka clients still open; returns what each was."""
    found: list[tuple[str, Any]] = []
    for obj in gc.get_objects():
        cls = type(obj)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name == "watchdog.ingest.emitter.EventEmitter":
            if obj._producer is not None or (obj._thread is not None and obj._thread.is_alive()):
                found.append((f"EventEmitter({obj.name})", lambda o=obj: o.close(timeout=0.5)))
        elif name in ("kafka.producer.kafka.KafkaProducer", "kafka.consumer.group.KafkaConsumer"):
            if not getattr(obj, "_closed", True):
                found.append((cls.__name__, obj.close))
        elif name.endswith("cimpl.Producer") and len(obj):  # confluent-kafka: a purge drops the callbacks
            found.append(("confluent_kafka.Producer", lambda o=obj: (o.purge(), o.flush(0.5))))
    for _what, close in found:
        with contextlib.suppress(Exception):  # best effort at the end of the session
            close()
    gc.collect()
    return [what for what, _close in found]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if LEFT_OPEN:
        terminalreporter.write_line(f"conftest: closed {len(LEFT_OPEN)} Kafka client(s) that tests left open: "
                                    f"{', '.join(sorted(set(LEFT_OPEN)))} (close them in the test)", yellow=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker (``make test`` runs two): the controller names them
        workeroutput["left_open"] = list(LEFT_OPEN)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    LEFT_OPEN.extend(getattr(node, "workeroutput", {}).get("left_open", []))


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit as soon as pytest is done (results, summary and reports are written by then): the
    interpreter's own teardown of a heap holding torch, transformers, LiteLLM and many clients
    (pytest's last garbage collection, then module finalization; gdb shows the time in
    Py_FinalizeEx's collections) took 4.7-6 s after the summary on a 10-test subset, more on the full
    suite. Skipped with it: pytest's last sweep for unraisable exceptions and atexit handlers.
    LLMWD_TEST_FULL_EXIT=1 keeps the normal exit; so does a run under coverage (it writes its data
    at exit), an xdist worker, and an interrupted run (pytest reports the KeyboardInterrupt here)."""
    status = config.stash.get(_EXIT_STATUS, None)
    if (status is None or status == pytest.ExitCode.INTERRUPTED or os.environ.get("LLMWD_TEST_FULL_EXIT")
            or "coverage" in sys.modules or hasattr(config, "workerinput")):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture
def sink() -> Iterator[tuple[object, str]]:
    """A local alert receiver (``watchdog.dev.alertsink.AlertSink``) and its URL."""
    from watchdog.dev.alertsink import AlertSink

    s = AlertSink()
    url = s.start()
    yield s, url
    s.stop()


@pytest.fixture
def topic() -> str:
    """A topic name no other test uses (Tansu creates topics on first use)."""
    return f"llm.inference.logs.{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama trained offline on ``probes.tiny_model.DEFAULT_PAIRS``, with its FP8
    calibration; built once per test session (needs the torch extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from probes.engines.torch_engine import calibrate_model
    from probes.tiny_model import DEFAULT_PAIRS, ensure_tiny_model

    path = ensure_tiny_model(tmp_path_factory.getbasetemp() / "tiny-cache")
    if not (path / "fp8_calibration.json").exists():
        calibrate_model(path, [p + r for p, r in DEFAULT_PAIRS])
    return path
