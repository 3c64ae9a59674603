"""The chart's ConfigMaps start a real daemon: the rendered config.yaml and policies, run by
``python -m watchdog.cli.main run`` against the test Redis and Kafka-protocol broker, as the pod would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from watchdog.dev.embedded import Service, free_port
from watchdog.policy.loader import parse_policy_text

try:  # the dev extra; CI installs it, so there a missing one is a failure
    import helm_python as helm
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("dev extra not installed: helm-python-sdk", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/llm-watchdog"
pytestmark = pytest.mark.services


@dataclass
class Running:
    url: str
    container: dict[str, Any]  # the watchdog container as rendered
    policies: int  # policies in the rendered policies ConfigMap
    log: Path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, redis_service: Service,
           kafka_service: Service) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("deploy-daemon")
    tag = uuid.uuid4().hex[:10]
    port = free_port()
    values = {
        "config": {
            "kafka": {"bootstrap_servers": f"127.0.0.1:{kafka_service.port}", "topic": f"llm.inference.logs.{tag}",
                      "group_id": f"wd-{tag}", "session_timeout_ms": 2000, "heartbeat_interval_ms": 500},
            "redis": {"url": f"redis://127.0.0.1:{redis_service.port}/0", "prefix": f"wd{tag}"},
        },
        "service": {"port": port},
    }
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="wd", namespace="ml")
    rendered = [d for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    maps = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "ConfigMap"}
    container = next(d for d in rendered if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    (tmp / "config.yaml").write_text(maps["wd-llm-watchdog"]["data"]["config.yaml"])
    policies = tmp / "policies"  # what the kubelet mounts at /etc/llm-watchdog/policies
    policies.mkdir()
    count = 0
    for name, text in maps["wd-llm-watchdog-policies"]["data"].items():
        (policies / name).write_text(text)
        count += len(parse_policy_text(text, name)[0])
    (tmp / "state").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp / "state"),
           "LLMWD_POLICIES": f'["{policies}"]',      # the pod's mount path, moved here
           "LLMWD_SERVER__HOST": "127.0.0.1"}         # the chart binds 0.0.0.0 for the kubelet's probes
    log_path = tmp / "daemon.log"
    log = log_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "watchdog.cli.main", "run", "--config", str(tmp / "config.yaml")],
                            cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        code = None
        while time.monotonic() < deadline and proc.poll() is None and code != 200:
            try:
                code = httpx.get(url + "/readyz", timeout=1).status_code
            except httpx.HTTPError:
                time.sleep(0.25)
                continue
            time.sleep(0.25)
        assert code == 200, f"not ready (rc {proc.poll()}): {log_path.read_text()[-3000:]}"
        yield Running(url, container, count, log_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            rc = None
        log.close()
    assert rc == 0, f"SIGTERM exit {rc}: {log_path.read_text()[-3000:]}"


def test_rendered_config_and_policies_start_the_daemon(daemon: Running) -> None:
    metrics = httpx.get(daemon.url + "/metrics", timeout=2).text
    value = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
             if line and not line.startswith("#") and " " in line}
    assert value["llmwd_redis_up"] == 1 and value["llmwd_kafka_up"] == 1
    assert value["llmwd_policies_loaded"] == daemon.policies > 0


def test_the_charts_probe_paths_answer_on_a_healthy_daemon(daemon: Running) -> None:
    paths = sorted({daemon.container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")})
    codes = {path: httpx.get(daemon.url + path, timeout=2).status_code for path in paths}
    # a 404 is the failure this guards: the chart probing a path the daemon does not serve
    assert all(code == 200 for code in codes.values()), f"the chart's probes got {codes}"
