"""A bad policy at start-up is reported once per file, worded as a start-up failure ("not started"),
never as a "policy reload rejected" warning on top of the CLI's own message (real process)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from watchdog.policy import PolicyError, PolicyLoader

ROOT = Path(__file__).resolve().parent.parent


def _bad_copies(tmp_path: Path) -> Path:
    pol = tmp_path / "policies"
    pol.mkdir()
    text = (ROOT / "policies" / "default.yaml").read_text()
    assert "metric:" in text and "severity:" in text
    (pol / "a.yaml").write_text(text.replace("metric:", "metrik:", 1))
    (pol / "b.yaml").write_text(text.replace("severity:", "sevrity:", 1).replace("name: ", "name: other-", 1))
    return pol


def test_run_with_two_bad_policy_files_says_not_started_once_per_file(tmp_path: Path) -> None:
    from watchdog.dev.embedded import free_port

    pol = _bad_copies(tmp_path)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"policies: [{pol}]\nredis: {{url: 'redis://127.0.0.1:{free_port()}/0'}}\n"
                   f"kafka: {{bootstrap_servers: '127.0.0.1:{free_port()}'}}\nserver: {{port: 0}}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "run", "--config", str(cfg)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    err = out.stderr.splitlines()
    assert out.returncode == 2, out.stderr
    assert "reload" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    headers = [line for line in err if not line.startswith("  ")]
    assert headers == [f"fp8-watchdog run: not started: policy file {pol / 'a.yaml'} is invalid (3 problems):",
                       f"fp8-watchdog run: not started: policy file {pol / 'b.yaml'} is invalid (1 problem):"], err
    assert sum("unknown key 'metrik' (did you mean 'metric'?)" in line for line in err) == 1, err
    assert sum("unknown key 'sevrity' (did you mean 'severity'?)" in line for line in err) == 1, err
    assert "redis" not in out.stderr.lower(), out.stderr  # the policies are checked before Redis is tried


def test_the_loader_raises_at_start_without_logging_and_says_load_not_reload(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pol = _bad_copies(tmp_path)
    caplog.set_level(logging.DEBUG, logger="watchdog.policy.loader")
    with pytest.raises(PolicyError):
        PolicyLoader([pol / "a.yaml"], raise_at_start=True)
    assert caplog.records == []
    errors: list[list[str]] = []
    loader = PolicyLoader([pol / "a.yaml"], on_error=errors.append)  # a library caller: told, and logged once
    assert loader.last_errors and len(errors) == 1
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["policies rejected at load, none in force"]
    (pol / "a.yaml").write_text((ROOT / "policies" / "default.yaml").read_text())
    assert loader.reload()
    (pol / "a.yaml").write_text("policies: [")
    caplog.clear()
    assert not loader.reload()
    assert caplog.records[0].getMessage().startswith("policy reload rejected, keeping 1 policies in force")
