"""Daemon configuration (YAML + LLMWD_ env, line-precise errors) and the HTTP/CLI surface."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from watchdog.cli.main import main
from watchdog.config.settings import ConfigError, load_config
from watchdog.runtime.http import StatusServer

ROOT = Path(__file__).resolve().parent.parent


def test_yaml_values_env_overrides_and_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("kafka:\n  topic: inference\n  security: {security_protocol: SASL_SSL}\n"
                        "windows: {length_s: 5}\nalerts:\n  channels:\n    - {kind: slack, url: 'http://x/y'}\n")
    monkeypatch.setenv("LLMWD_REDIS__URL", "redis://redis-routing:6379/2")
    monkeypatch.setenv("LLMWD_KAFKA__GROUP_ID", "fleet-a")
    cfg = load_config(cfg_file)
    assert cfg.kafka.topic == "inference" and cfg.kafka.dead_letter_topic == "inference.dlq"
    assert cfg.kafka.group_id == "fleet-a" and cfg.kafka.security == {"security_protocol": "SASL_SSL"}
    assert cfg.redis.url == "redis://redis-routing:6379/2"
    assert cfg.windows.length_s == 5 and cfg.windows.grace_s == 2.0
    assert cfg.alerts.channels[0].kind == "slack"


@pytest.mark.parametrize(("text", "where", "what"), [
    ("kafka:\n  topic: t\n  session_timeout_ms: 10\n", ":3:3:", "greater than or equal to 1000"),
    ("windows:\n  length_s: -1\n", ":2:3:", "greater than 0"),
    ("redis:\n  url: redis://x\n  prefx: a\n", ":3:3:", "unknown key 'prefx' in redis (did you mean 'prefix'?)"),
    ("kafka: [1, 2\n", ":", "invalid YAML"),
])
def test_config_errors_name_file_line_and_column(tmp_path: Path, text: str, where: str, what: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"bad.yaml{where}" in str(err.value) and what in str(err.value)


def test_run_with_a_bad_config_exits_2_and_says_where(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  port: 99999999\n")
    out = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "run", "--config", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bad.yaml:2:3" in out.stderr


def test_http_surface_and_status_command(capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    Counter("llmwd_events_total", "events", ["result"], registry=registry).labels("ok").inc(3)
    problems: list[str] = []
    status = {"instance": "pod-0", "uptime_s": 1.0, "ready": True, "problems": [],
              "flags": {"llama/legal": "fp16"}, "recent_actions": []}
    server = StatusServer("127.0.0.1", 0, registry, lambda: status, lambda: problems).start()
    try:
        assert 'llmwd_events_total{result="ok"} 3.0' in httpx.get(f"{server.url}/metrics").text
        assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        problems.append("redis: connection refused")
        ready = httpx.get(f"{server.url}/readyz")
        assert ready.status_code == 503 and ready.json()["problems"] == ["redis: connection refused"]
        assert httpx.get(f"{server.url}/nope").status_code == 404
        assert main(["status", "--url", server.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["flags"] == {"llama/legal": "fp16"}
        assert main(["status", "--url", server.url]) == 0
        assert "llama/legal" in capsys.readouterr().out
        status["ready"], status["problems"] = False, ["redis: connection refused"]
        # answered but not ready: 3, as `systemctl is-active`, so that `status || page` notices an outage
        assert main(["status", "--url", server.url]) == 3
        assert "not ready" in capsys.readouterr().out
        assert main(["status", "--url", server.url, "--json"]) == 3
        assert json.loads(capsys.readouterr().out)["ready"] is False
    finally:
        server.stop()
    assert main(["status", "--url", server.url]) == 1  # stopped: a clear error, not a traceback


def test_status_command_shows_the_policies_in_force_and_open_incidents(capsys: pytest.CaptureFixture[str]) -> None:
    # a rejected policy edit is an open ops incident, not a readiness reason: the text view said only "ready"
    status = {"instance": "pod-0", "uptime_s": 1.0, "ready": True, "problems": [], "flags": {},
              "recent_actions": [], "policies": ["fp8-default"], "incidents_total": 1,
              "incidents": [{"key": "ops/policy-reload", "severity": "warning",
                             "summary": "policy edit rejected: p.yaml:15:5: unknown key 'cooldwn'; the last good "
                                        "policies stay in force"}]}
    server = StatusServer("127.0.0.1", 0, CollectorRegistry(), lambda: status, lambda: []).start()
    try:
        assert main(["status", "--url", server.url]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "policies in force: fp8-default" in out
        assert "1 open incident: [warning] ops/policy-reload: policy edit rejected: p.yaml:15:5" in out
        assert main(["status", "--url", f"{server.url}/nope"]) == 1  # not the status: one line, no traceback
        assert "no watchdog status" in capsys.readouterr().err
    finally:
        server.stop()


def test_status_finds_the_daemon_from_its_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # status asked 127.0.0.1:9464 whatever the config's server.port said
    status = {"instance": "pod-7", "uptime_s": 1.0, "ready": True, "problems": [], "flags": {}, "recent_actions": []}
    server = StatusServer("127.0.0.1", 0, CollectorRegistry(), lambda: status, lambda: []).start()
    try:
        port = server.url.rsplit(":", 1)[1].strip("/")
        cfg = tmp_path / "config.yaml"
        cfg.write_text(f"server:\n  host: 0.0.0.0\n  port: {port}\n")
        assert main(["status", "--config", str(cfg)]) == 0
        assert "pod-7" in capsys.readouterr().out
    finally:
        server.stop()
