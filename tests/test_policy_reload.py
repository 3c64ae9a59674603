"""Hot reload: a bad edit is rejected with positions, the last good set stays, engine state survives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from watchdog.core.signals import Signal
from watchdog.policy import LIVE_METRICS, PolicyEngine, PolicyLoader

GOOD = """\
policies:
  - name: p
    rules:
      - name: err
        metric: error_rate
        fail_if: candidate - baseline > 0.02
        for: 2
        action: rollback
      - name: tmo
        metric: timeout_rate
        fail_if: candidate > 0.5
"""


def bump(path: Path, text: str) -> None:
    """Write and move the mtime forward, so a same-size edit is seen on coarse-clock filesystems."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def window(t: float, cand: float) -> list[Signal]:
    return [Signal(source="live", model="m", route="r", precision=p, start=t - 60, end=t, samples=500,
                   values={"error_rate": v, "timeout_rate": 0.0}) for p, v in (("fp8", cand), ("fp16", 0.01))]


def test_reload_rejects_bad_edit_and_keeps_last_good(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    bump(path, GOOD)
    errors: list[list[str]] = []
    changes: list[object] = []
    loader = PolicyLoader([path], on_error=errors.append, on_change=changes.append)
    assert loader.policy_set.names == ["p"] and len(changes) == 1
    assert loader.check() is False  # nothing changed

    bump(path, GOOD.replace("metric: error_rate", "metric: error_rte"))
    assert loader.check() is False
    assert errors == [[f"{path}:5:17: unknown live metric 'error_rte' (did you mean 'error_rate'?); "
                       "live metrics: " + ", ".join(LIVE_METRICS)]]
    assert loader.policy_set.names == ["p"] and loader.rejects == 1
    assert loader.policy_set.get("p").rules[0].metric == "error_rate"  # type: ignore[union-attr]
    assert loader.check() is False and len(errors) == 1  # the same bad file is not re-reported

    bump(path, GOOD.replace("name: p\n", "name: q\n"))
    assert loader.check() is True
    assert loader.policy_set.names == ["q"] and loader.last_errors == [] and len(changes) == 2


def test_same_size_edit_and_sighup_reload(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    bump(path, GOOD)
    loader = PolicyLoader([path])
    bump(path, GOOD.replace("for: 2", "for: 3"))  # same size
    assert loader.check() is True
    assert loader.policy_set.get("p").rules[0].for_ == 3  # type: ignore[union-attr]
    assert loader.reload() is True


def test_directory_and_new_files(tmp_path: Path) -> None:
    bump(tmp_path / "a.yaml", GOOD)
    loader = PolicyLoader([tmp_path])
    assert loader.policy_set.names == ["p"]
    bump(tmp_path / "b.yml", GOOD.replace("name: p\n", "name: q\n"))
    assert loader.check() is True and loader.policy_set.names == ["p", "q"]
    (tmp_path / "b.yml").unlink()
    assert loader.check() is True and loader.policy_set.names == ["p"]


def test_initial_bad_file_gives_empty_set_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    bump(path, "policies:\n  - name: p\n    rules: nope\n")
    errors: list[list[str]] = []
    loader = PolicyLoader([path], on_error=errors.append)
    assert loader.policy_set.policies == ()
    assert errors[0][0].startswith(f"{path}:3:12: policies[0].rules: Input should be a valid list")


def test_engine_keeps_state_across_reload(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    bump(path, GOOD)
    loader = PolicyLoader([path])
    engine = PolicyEngine(loader.policy_set)
    assert engine.observe(window(1000.0, 0.10), 1000.0, {}) == []  # err fails once (for: 2)
    bump(path, GOOD.replace("candidate > 0.5", "candidate > 0.4"))  # only tmo changes
    assert loader.check() is True
    engine.set_policy_set(loader.policy_set)
    acts = engine.observe(window(1060.0, 0.10), 1060.0, {})
    assert [a.kind for a in acts] == ["rollback"]
    bump(path, GOOD.replace("for: 2", "for: oops"))  # rejected: engine keeps the last good set
    assert loader.check() is False
    engine.set_policy_set(loader.policy_set)
    assert engine.states[("p", "m", "r")].rules["err"].fails == 2


def test_a_policy_directory_left_empty_is_rejected_and_the_last_good_set_stays(tmp_path: Path) -> None:
    # before: "policies reloaded: 0 in force", the reload alert resolved, and nothing was judged any more
    # (one deleted file keeps the last good set; all of a directory's files deleted dropped them all)
    pdir = tmp_path / "policies"
    pdir.mkdir()
    bump(pdir / "a.yaml", GOOD)
    errors: list[list[str]] = []
    loader = PolicyLoader([pdir], on_error=errors.append)
    assert loader.policy_set.names == ["p"]
    (pdir / "a.yaml").unlink()
    assert loader.check() is False
    assert loader.policy_set.names == ["p"] and loader.rejects == 1
    assert errors == [[f"{pdir}: no policy files (*.yaml, *.yml) in this directory"]]


def test_config_check_refuses_an_empty_policy_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from watchdog.cli.main import main

    (tmp_path / "policies").mkdir()
    cfg = tmp_path / "config.yaml"
    cfg.write_text("policies: [policies]\n")
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    assert main(["config", "check", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{tmp_path / 'policies'}: no policy files (*.yaml, *.yml) in this directory"], err
