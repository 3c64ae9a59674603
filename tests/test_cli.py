"""The command line refuses bad input with exit 2 and one line, and every --help works."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from watchdog.cli.main import _PLUGINS, build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


ALL = list(_commands(build_parser()))


def test_the_tree_has_the_commands_operators_use() -> None:
    for cmd in [("run",), ("config", "check"), ("init",), ("embedded",), ("flags", "set"), ("flags", "audit"),
                ("policy", "backtest"), ("golden", "validate"), ("replay",), ("gpu",)]:
        assert cmd in ALL


@pytest.mark.parametrize("path", ALL, ids=lambda p: " ".join(p) or "top")
def test_every_help(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*path, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fp8-watchdog") and "--log-level" in out


def test_replay_help_shows_the_real_engine_keys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["replay", "--help"])
    out = capsys.readouterr().out
    assert "-o model_path=" in out and "base_url=" in out and "model=/models" not in out


@pytest.mark.parametrize("command", [c for c, _module, _func in _PLUGINS])
def test_a_command_line_naming_a_plugin_loads_that_plugin_alone_with_the_same_parser(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    helps = []
    for parser in (build_parser(), build_parser(argv=[command, "--help"])):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        helps.append(capsys.readouterr().out)
    assert helps[0] == helps[1]
    named = build_parser(argv=["--log-level", "debug", command])
    others = {c for c, _m, _f in _PLUGINS} - {command}
    listed = next(a for a in named._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert command in listed and not others & set(listed) and "run" in listed


def test_replay_starts_without_the_policy_and_redis_modules() -> None:
    """The one-off replay's process does not pay for the other subcommands' imports (~0.7 s)."""
    code = ("import sys; from watchdog.cli.main import build_parser; build_parser('x', ['replay', '--set', 'a']); "
            "print(sorted(m for m in ('redis', 'watchdog.policy', 'watchdog.cli.flags') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stderr[-500:]


def test_log_level_before_and_after_the_subcommand() -> None:
    assert build_parser().parse_args(["--log-level", "debug", "flags", "list"]).log_level == "DEBUG"
    assert build_parser().parse_args(["flags", "list", "--log-level", "error"]).log_level == "ERROR"
    assert build_parser().parse_args(["--log-level", "debug", "run", "--log-level", "warning"]).log_level == "WARNING"


def _dead_redis() -> str:
    from watchdog.dev.embedded import free_port

    return f"redis://127.0.0.1:{free_port()}/0"


BAD: list[tuple[list[str], str]] = [
    (["run", "--dry-run"], "unrecognized arguments: --dry-run (see fp8-watchdog run --help)"),
    (["flags", "list", "--al"], "(see fp8-watchdog flags list --help)"),
    (["flags", "set", "llama", "chat", "FP9"], "did you mean 'fp8'"),
    (["flags", "pin", "llama", "chat", "bf16", "--ttl", "30m"], "not one of the configured precisions"),
    (["flags", "set", "", "chat", "fp16"], "is empty"),
    (["flags", "pin", "llama", " ", "fp16", "--ttl", "5m"], "a space or control character"),
    (["flags", "get", "llama", "chat\n"], "control character"),
    (["flags", "unpin", "", "chat"], "argument model"),
    (["flags", "audit", "--count", "-1"], "--count"),
    (["flags", "audit", "--count", "0"], "--count"),
    (["flags", "audit", "--count", "99999999999999999999"], "--count"),  # was Redis' "not an integer or out of range"
    (["evidence", "list", "--count", "99999999999999999999"], "--count"),
    (["flags", "pin", "llama", "chat", "fp16", "--ttl", "-5m"], "--ttl"),
    (["flags", "list", "--timeout", "0"], "--timeout"),
    (["flags", "set", "llama", "chat", "fp16", "--expected-epoch", "-2"], "--expected-epoch"),
    (["gpu", "--record", "missing/dir/x.json"], "missing/dir"),
    (["gpu", "--interval", "0", "--watch"], "--interval"),
    (["policy", "backtest", "--policy", "policies/default.yaml", "--events", "tests/no-such.jsonl"], "no such file"),
    (["policy", "backtest", "--policy", "policies/default.yaml", "--events", "README.md"], "not a JSON object"),
    (["policy", "backtest", "--policy", "policies/default.yaml", "--events", "{events}", "--png",
      "missing/dir/x.png"], "missing/dir"),
    (["policy", "backtest", "--policy", "policies/default.yaml", "--events", "{events}", "--metric",
      "eror_rate"], "did you mean 'error_rate'"),
    (["policy", "validate", "no/such/policy.yaml"], "no such file"),
    (["--log-level", "bogus", "flags", "list"], "unknown log level"),
    (["flags", "list", "--log-level", "bogus"], "unknown log level"),
    (["replay", "--set", "code", "--batch-size", "0"], "--batch-size"),
    # both were a FileExistsError traceback, --out only after the whole replay had run
    (["replay", "--set", "code", "--out", "README.md"], "argument --out: is a file, not a directory: README.md"),
    (["replay", "--set", "code", "--compile-cache", "README.md"], "argument --compile-cache: is a file, not a directory"),
    (["calibrate", "--model", "bench/data/drift_tiny", "--set", "code", "--out", "missing/dir/cal.json"],
     "directory does not exist: missing/dir"),
    (["demo", "--duration", "-1"], "--duration"),
    (["embedded", "--redis-port", "70000"], "not a port"),
    (["gateway", "--config", "deploy/config.example.yaml", "--port", "99999"], "not a port: '99999' (1-65535)"),
    (["gateway", "--config", "deploy/config.example.yaml", "--port=-1"], "not a port: '-1'"),
    (["config", "check", "--config", "no/such.yaml"], "no/such.yaml"),
    (["run", "--config", "no/such.yaml"], "no/such.yaml"),
    (["nosuchcommand"], "invalid choice"),
    (["init", "README.md"], "README.md exists and is not a directory"),
    (["golden", "list", "--root", "README.md"], "README.md: not a directory"),
    (["golden", "list", "--root", "no/such/dir"], "no/such/dir: no such directory"),
]


@pytest.mark.parametrize(("argv", "says"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_invocations_exit_2_with_one_line(argv: list[str], says: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text('{"ts": 1, "model": "m", "route": "r"}\n')
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("LLMWD_REDIS__URL", _dead_redis())  # a check that reached Redis would say so
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    try:
        code = main([a.replace("{events}", str(events)) for a in argv])
    except SystemExit as exc:
        code = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert says in lines[0] and "redis at" not in lines[0], lines[0]


def test_a_usage_error_found_after_parsing_names_the_command(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLMWD_REDIS__URL", _dead_redis())
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    assert main(["flags", "set", "llama", "chat", "FP9"]) == 2
    assert capsys.readouterr().err.startswith("fp8-watchdog flags set: error: argument precision:")


def test_backtest_png_without_matplotlib_is_one_line_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra sees
    code = main(["policy", "backtest", "--policy", str(ROOT / "policies/default.yaml"), "--events",
                 str(ROOT / "tests/data/backtest_healthy.jsonl.gz"), "--png", str(tmp_path / "t.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "fp8-watchdog[plot]" in err[0], err
    assert err[0].startswith("fp8-watchdog policy backtest: error:")
    assert not (tmp_path / "t.png").exists()


def test_policy_validate_of_a_daemon_config_points_at_config_check(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(ROOT / "deploy/config.example.yaml")
    assert main(["policy", "validate", config]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"{config}: this looks like a daemon config, not a policy file; check it with "
                       f"`fp8-watchdog config check --config {config}`")
    assert main(["policy", "validate", str(ROOT / "policies/default.yaml")]) == 0
    assert "daemon config" not in capsys.readouterr().err


def test_status_without_a_daemon_says_where_it_looked(capsys: pytest.CaptureFixture[str]) -> None:
    from watchdog.dev.embedded import free_port

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["status", "--url", url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fp8-watchdog status: cannot reach {url}")
    assert "is the daemon running" in err[0]


def test_init_into_an_unwritable_place_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("x")
    assert main(["init", str(tmp_path / "a-file" / "wd")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and "a-file" in err[0], err


def test_run_on_a_taken_port_is_one_line_and_a_mistyped_variable_is_named(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("LLMWD_SERVER__PORT", str(taken.getsockname()[1]))
        monkeypatch.setenv("LLMWD_REDIS__URL", _dead_redis())
        code = main(["run", "--config", str(ROOT / "deploy/config.example.yaml")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "cannot serve HTTP on 127.0.0.1:" in err[0], err
        monkeypatch.setenv("LLMWD_KAFKA_BOOTSTRAP_SERVERS", "typo:9092")  # one underscore: not a config key
        code = main(["run", "--config", str(ROOT / "deploy/config.example.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["fp8-watchdog: invalid configuration: $LLMWD_KAFKA_BOOTSTRAP_SERVERS matches no "
                                 "config key; did you mean $LLMWD_KAFKA__BOOTSTRAP_SERVERS?"], err


def test_a_real_process_prints_one_line_and_no_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLMWD_REDIS__URL": _dead_redis()}
    out = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "flags", "set", "m", "r", "FP9"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr


@pytest.mark.services
def test_embedded_prints_sourceable_exports_and_stops_on_sigterm(tmp_path: Path) -> None:
    import signal

    import redis

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "watchdog.cli.main", "embedded", "--redis-port", "0",
                             "--kafka-port", "0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        exports = dict(proc.stdout.readline().strip().removeprefix("export ").split("=", 1) for _ in range(2))
        assert redis.Redis.from_url(exports["LLMWD_REDIS__URL"]).ping()
        host, port = exports["LLMWD_KAFKA__BOOTSTRAP_SERVERS"].split(":")
        import socket

        socket.create_connection((host, int(port)), timeout=2).close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_run_without_a_config_is_one_line_naming_config_and_init(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    monkeypatch.setenv("LLMWD_REDIS__URL", _dead_redis())  # a daemon that started would try it
    assert main(["run"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and captured.out == "", err
    assert err[0].startswith("fp8-watchdog run: no config file") and "--config" in err[0], err
    assert "fp8-watchdog init DIR" in err[0] and "$LLMWD_CONFIG" in err[0], err


@pytest.mark.parametrize("argv", [["config", "check", "--config"], ["run", "--config"], ["policy", "validate"]],
                         ids=" ".join)
def test_a_file_that_is_not_utf8_is_one_line_with_its_position(argv: list[str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("policies: []\n# caf\xe9\n".encode("latin-1"))  # saved by an editor in Latin-1
    monkeypatch.setenv("LLMWD_REDIS__URL", _dead_redis())
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    code = main([*argv, str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and len(err) == 1, err
    assert f"{bad}:2:6:" in err[0] and "not UTF-8: byte 0xe9" in err[0], err


def test_policy_validate_of_a_directory_without_policy_files_fails(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("not a policy\n")
    assert main(["policy", "validate", str(tmp_path)]) == 1  # was "OK (0 policies: no policies)" and 0
    assert capsys.readouterr().err.strip() == f"{tmp_path}: no policy files (*.yaml, *.yml) in this directory"
    assert main(["policy", "validate", str(ROOT / "policies")]) == 0


@pytest.mark.parametrize("argv", [["flags", "list"], ["evidence", "list"], ["run"], ["status"], ["config", "check"]])
def test_a_missing_config_from_the_environment_names_the_variable(argv: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # "argument --config: no such file" sent an operator who never typed --config looking for it
    monkeypatch.setenv("LLMWD_CONFIG", str(tmp_path / "gone.yaml"))
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"no such file: {tmp_path / 'gone.yaml'} (from $LLMWD_CONFIG)" in lines[0], lines


def test_calibrate_without_the_torch_extra_names_it(tmp_path: Path) -> None:
    # in a wheel installed without [torch], `calibrate` was a ModuleNotFoundError traceback
    code = ("import sys; sys.modules['torch'] = None; from watchdog.cli.main import main; "
            f"sys.exit(main(['calibrate', '--model', 'bench/data/drift_tiny', '--set', 'code', "
            f"'--out', {str(tmp_path / 'cal.json')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("calibrate: ") and "pip install 'fp8-watchdog[torch]'" in lines[0], lines[0]
