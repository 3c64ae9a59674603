"""The chart's ConfigMaps start a real daemon: the rendered config.yaml and policies, run by
``python -m watchdog.cli run`` against the test Redis and Kafka-protocol broker, as the pod would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from watchdog.embedded import Service, free_port
from watchdog.policy.loader import parse_policy_text

try:  # the dev extra; CI installs it, so there a missing one is a failure
    import helm_python as helm
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("dev extra not installed: helm-python-sdk, kubernetes-validate", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/llm-watchdog"
pytestmark = pytest.mark.services


def test_rendered_config_and_policies_start_the_daemon(tmp_path: Path, redis_service: Service,
                                                       kafka_service: Service, topic: str) -> None:
    port = free_port()
    values = {
        "config": {
            "kafka": {"bootstrap_servers": f"127.0.0.1:{kafka_service.port}", "topic": topic,
                      "group_id": f"wd-{topic[-10:]}", "session_timeout_ms": 6000},
            "redis": {"url": f"redis://127.0.0.1:{redis_service.port}/0", "prefix": f"wd{topic[-10:]}"},
        },
        "service": {"port": port},
    }
    helm.disable_logging()
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="wd", namespace="ml")
    docs = {d["metadata"]["name"]: d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d and d["kind"] == "ConfigMap"}
    (tmp_path / "config.yaml").write_text(docs["wd-llm-watchdog"]["data"]["config.yaml"])
    policies = tmp_path / "policies"  # what the kubelet mounts at /etc/llm-watchdog/policies
    policies.mkdir()
    expected = 0
    for name, text in docs["wd-llm-watchdog-policies"]["data"].items():
        (policies / name).write_text(text)
        expected += len(parse_policy_text(text, name)[0])
    state = tmp_path / "state"
    state.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(state),
           "LLMWD_POLICIES": f'["{policies}"]',      # the pod's mount path, moved here
           "LLMWD_SERVER__HOST": "127.0.0.1"}         # the chart binds 0.0.0.0 for the kubelet's probes
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "watchdog.cli", "run", "--config", str(tmp_path / "config.yaml")],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                if ready.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        assert ready is not None and ready.status_code == 200, (tmp_path / "daemon.log").read_text()[-3000:]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        values_of = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                     if line and not line.startswith("#") and " " in line}
        assert values_of["llmwd_redis_up"] == 1 and values_of["llmwd_kafka_up"] == 1
        assert values_of["llmwd_policies_loaded"] == expected > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            rc = None
        log.close()
    assert rc == 0, (tmp_path / "daemon.log").read_text()[-3000:]
