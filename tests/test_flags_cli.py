"""The ``flags`` CLI commands, run through a real argparse parser against a real redis-server."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import pytest

from watchdog.actuation.actuator import FlagStore
from watchdog.cli.flags import _when, add_flags_commands, parse_duration, who
from watchdog.core.keys import Keys

pytestmark = pytest.mark.services


def run(url: str, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="llm-watchdog")
    add_flags_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["flags", *argv, "--redis-url", url])
    return int(args.func(args))


@pytest.fixture
def url(redis_service: Any, redis_client: Any) -> str:
    return f"redis://{redis_service.address}/0"


def out_json(capsys: pytest.CaptureFixture[str]) -> Any:
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200),
                                          ("1d", 86400), ("1h30m", 5400), ("0.5m", 30)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "10x", "0", "5m garbage"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_set_get_list_and_audit(url: str, redis_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(url, "set", "llama", "chat", "fp16", "--reason", "ticket 7", "--json") == 0
    res = out_json(capsys)
    assert res["applied"] and res["epoch"] == 1 and res["precision"] == "fp16"
    assert run(url, "set", "llama", "chat", "fp16", "--json") == 0
    assert out_json(capsys)["unchanged"]

    assert run(url, "get", "llama", "chat", "--json") == 0
    flag = out_json(capsys)
    assert flag["precision"] == "fp16" and flag["changed_by"] == who() and flag["mode"] == "manual"
    assert flag["reason"] == "ticket 7"
    assert run(url, "get", "nope", "none", "--json") == 1
    assert out_json(capsys) is None

    assert run(url, "list") == 0
    table = capsys.readouterr().out
    assert "llama" in table and "fp16" in table and who() in table

    assert run(url, "audit", "--count", "5", "--json") == 0
    (rec,) = out_json(capsys)
    assert rec["changed_by"].startswith("cli:") and "@" in rec["changed_by"]
    assert rec["mode"] == "manual" and rec["schema"] == 1 and rec["reason"] == "ticket 7"
    assert run(url, "audit") == 0
    assert "llama" in capsys.readouterr().out


def test_expected_epoch_refusal_exits_1(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    run(url, "set", "m", "r", "fp16")
    capsys.readouterr()
    assert run(url, "set", "m", "r", "fp8", "--expected-epoch", "0") == 1
    assert "stale_epoch" in capsys.readouterr().out


def test_pin_holds_against_policy_and_unpin_releases(url: str, redis_client: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = time.time()
    assert run(url, "pin", "llama", "chat", "fp16", "--ttl", "30m", "--reason", "incident", "--json") == 0
    res = out_json(capsys)
    assert res["applied"] and before + 1790 < res["pinned_until"] < time.time() + 1810
    store = FlagStore(redis_client, Keys())
    refused = store.flip("llama", "chat", "fp8", expected_epoch=None, reason="promote", changed_by="daemon")
    assert refused.refused == "pinned"
    assert run(url, "list") == 0
    assert "UTC" in capsys.readouterr().out  # pinned-until column filled
    assert run(url, "unpin", "llama", "chat") == 0
    capsys.readouterr()
    assert store.flip("llama", "chat", "fp8", expected_epoch=None, reason="promote", changed_by="d").applied
    ops = [r["op"] for r in store.audit()]
    assert ops == ["set", "unpin", "pin"]


def test_prefix_option(url: str, redis_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(url, "set", "m", "r", "fp16", "--prefix", "staging") == 0
    assert redis_client.hget("staging:route:m:r", "precision") == "fp16"
    assert redis_client.exists("llmwd:route:m:r") == 0


def test_unreachable_redis_is_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from watchdog.dev.embedded import free_port

    dead = f"redis://user:hunter2@127.0.0.1:{free_port()}/0"
    assert run(dead, "list") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: redis at") and "hunter2" not in err


def test_precision_comes_from_the_configured_set(url: str, redis_client: Any, tmp_path: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert run(url, "set", "llama", "chat", "FP9") == 2
    assert "did you mean 'fp8'" in capsys.readouterr().err and redis_client.exists("llmwd:route:llama:chat") == 0
    assert run(url, "set", "llama", "chat", "FP16", "--json") == 0  # case does not matter; stored lower-case
    assert redis_client.hget("llmwd:route:llama:chat", "precision") == "fp16"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precisions: [fp8, fp16, bf16]\nalerts: {announce_manual_changes: false}\n")
    assert run(url, "set", "llama", "chat", "bf16", "--config", str(cfg)) == 0
    assert run(url, "set", "llama", "chat", "bf16") == 2  # not in the default set


def test_manual_changes_are_announced_with_the_external_link(url: str, tmp_path: Any,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from watchdog.dev.alertsink import AlertSink

    with AlertSink() as sink:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"alerts:\n  channels: [{{kind: webhook, url: '{sink.url}/hook'}}]\n"
                       "server: {external_url: 'https://wd.example.com'}\n")
        assert run(url, "pin", "llama", "chat", "fp16", "--ttl", "30m", "--reason", "INC-42 judge flaky",
                   "--config", str(cfg)) == 0
        body = sink.wait_for(1)[0].body
        assert body["severity"] == "info" and body["url"] == "https://wd.example.com/status"
        assert "llama/chat pinned to FP16" in body["summary"] and "INC-42 judge flaky" in body["summary"]
        assert body["detail"]["changed_by"] == who()
        assert run(url, "unpin", "llama", "chat", "--config", str(cfg), "--no-announce") == 0
        assert run(url, "set", "llama", "chat", "fp16", "--config", str(cfg)) == 0  # unchanged: no message
        assert run(url, "set", "llama", "chat", "fp8", "--config", str(cfg)) == 0
        assert [r.body["summary"].split(" by ")[0] for r in sink.wait_for(2)] == [
            "manual change: llama/chat pinned to FP16 until " + body["summary"].split(" until ")[1].split(" by ")[0],
            "manual change: llama/chat set to FP8"]
    capsys.readouterr()


def test_reasons_wrap_at_words_and_are_never_cut(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    reason = ("shadow_rougeL mean 0.7412 over 3 windows < 0.80 (paired bootstrap CI [0.71, 0.77], n=412) "
              "on fp8 vs fp16; p=0.0031 budget 2/3 left; see runbook https://wiki.example.com/llmwd/rollback")
    assert run(url, "set", "llama-3-8b-instruct-long-model-name", "legal/contracts/long-route-name", "fp16",
               "--reason", reason) == 0
    capsys.readouterr()
    from rich.console import Console

    from watchdog.cli.flags import _flags_table
    from watchdog.core.keys import Flag

    flag = Flag("llama-3-8b-instruct-long-model-name", "legal/contracts/long-route-name", "fp16", 1, reason=reason,
                policy="quality-floor", changed_at=time.time(), changed_by="cli:someone@host-with-long-name")
    for width in (160,):
        console = Console(width=width, record=True)
        console.print(_flags_table([flag], time.time()))
        text = console.export_text()
        assert "…" not in text and all(len(line) <= width for line in text.splitlines())
        for token in reason.split():
            if len(token) <= 30:  # numbers and words stay whole; a longer URL folds, nothing hidden
                assert any(token in line for line in text.splitlines()), (width, token)
        assert "".join(line.split("│")[-2].strip() for line in text.splitlines() if "│" in line).count(
            "wiki.example.com/llmwd/rollback") == 1


@pytest.mark.parametrize(("text", "width", "expected"), [
    ("mean 0.7412 < 0.80 over 3 windows", 16, "mean 0.7412 <…"),
    ("mean 0.7412 < 0.80 over 3 windows", 19, "mean 0.7412 < 0.80…"),
    ("short", 70, "short"),
    ("value   <  0.80\n(n=40)", 70, "value < 0.80 (n=40)"),
    ("averyveryverylongtoken and more", 10, "averyvery…"),
])
def test_shorten_cuts_at_a_word(text: str, width: int, expected: str) -> None:
    from watchdog.core.text import shorten

    assert shorten(text, width) == expected and len(shorten(text, width)) <= width


# -- one spelling of the Redis URL variable: the daemon's LLMWD_REDIS__URL, as `embedded` exports it ---------
def _run_env(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="llm-watchdog")
    add_flags_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["flags", *argv])
    return int(args.func(args))


def _dead() -> str:
    from watchdog.dev.embedded import free_port

    return f"redis://127.0.0.1:{free_port()}/0"


def test_flags_read_the_daemons_variable_first_and_the_old_spelling_still_works(
        url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    monkeypatch.setenv("LLMWD_REDIS__URL", url)
    monkeypatch.setenv("LLMWD_REDIS_URL", _dead())  # the documented spelling wins over the old one
    assert _run_env("set", "llama", "chat", "fp16", "--json") == 0
    assert out_json(capsys)["applied"]
    monkeypatch.delenv("LLMWD_REDIS__URL")
    monkeypatch.setenv("LLMWD_REDIS_URL", url)  # what worked before still works
    assert _run_env("get", "llama", "chat", "--json") == 0
    assert out_json(capsys)["precision"] == "fp16"
    monkeypatch.setenv("LLMWD_REDIS__URL", _dead())
    assert _run_env("get", "llama", "chat", "--json") == 2  # and the new one is the one tried first


def test_help_names_the_one_spelling_the_daemon_and_embedded_use(capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from watchdog.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["flags", "list", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "$LLMWD_REDIS__URL" in text and "$LLMWD_REDIS_URL" not in text
    root = Path(__file__).resolve().parents[1]
    assert "export LLMWD_REDIS__URL=" in (root / "watchdog" / "cli" / "main.py").read_text()  # cmd_embedded
    docs = [p for p in [root / "README.md", *root.glob("docs/**/*.md"), *root.glob("deploy/**/*")] if p.is_file()]
    assert [str(p) for p in docs if "LLMWD_REDIS_URL" in p.read_text(errors="replace")] == []


def test_the_daemon_names_the_old_spelling_and_the_right_one(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from pathlib import Path

    from watchdog.cli.main import main

    monkeypatch.setenv("LLMWD_REDIS_URL", "redis://db:6379/0")
    monkeypatch.delenv("LLMWD_REDIS__URL", raising=False)
    example = Path(__file__).resolve().parents[1] / "deploy" / "config.example.yaml"
    assert main(["config", "check", "--config", str(example)]) == 0
    assert ("warning: $LLMWD_REDIS_URL matches no config key and is ignored; did you mean $LLMWD_REDIS__URL?"
            in capsys.readouterr().err)


def test_a_pin_is_at_most_30_days_and_an_absurd_one_in_redis_still_lists(
        url: str, redis_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # `--ttl 99999999999d` used to write the pin, then die on printing its date (a traceback, or
    # "error: year ... is out of range" with exit 2 after the write), and every later `flags list` died too
    with pytest.raises(SystemExit) as exc:
        run(url, "pin", "llama", "chat", "fp16", "--ttl", "99999999999d")
    assert exc.value.code == 2
    assert "longer than the longest pin, 30d" in capsys.readouterr().err
    assert redis_client.exists("llmwd:route:llama:chat") == 0
    assert run(url, "pin", "llama", "chat", "fp16", "--ttl", "30d") == 0
    redis_client.hset("llmwd:route:llama:chat", "pinned_until", "8.64e32")  # as the unbounded --ttl left it
    capsys.readouterr()
    assert run(url, "list") == 0
    assert "llama" in capsys.readouterr().out
    assert run(url, "get", "llama", "chat") == 0
    assert _when(8.64e32) == "863999999999999954129921077411840 (unix s)"


def test_a_mistyped_route_is_refused_with_the_known_one_and_a_new_route_is_written_with_a_warning(
        url: str, redis_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    keys = Keys()
    redis_client.set(keys.engine("llm-watchdog", "llama-3-8b", "support/chat"), "{}")  # the daemon judges it
    assert run(url, "pin", "llama-3-8b", "support/chta", "fp16", "--ttl", "30m") == 1
    err = capsys.readouterr().err
    assert "refused llama-3-8b/support/chta: no such route" in err
    assert "did you mean 'llama-3-8b/support/chat'?" in err and "--new-route" in err
    assert run(url, "set", "llama-3-8", "support/chat", "fp16") == 1
    assert "did you mean model 'llama-3-8b'?" in capsys.readouterr().err
    assert redis_client.smembers(keys.routes_index) == set()
    assert run(url, "pin", "llama-3-8b", "support/chat", "fp16", "--ttl", "30m") == 0  # the real one
    assert capsys.readouterr().err == ""
    assert run(url, "set", "llama-3-8b", "support/chta", "fp16", "--new-route") == 0
    assert run(url, "set", "llama-3-8b", "billing/faq", "fp16") == 0  # nothing close: new, with a warning
    assert "warning: llama-3-8b/billing/faq is a new route" in capsys.readouterr().err
    assert len(redis_client.smembers(keys.routes_index)) == 3


def test_a_set_over_someone_elses_pin_says_the_pin_now_holds_the_new_precision(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # alice pins legal to FP16 for an incident; bob's `set fp8` went through silently and the pin then held FP8
    # against every rollback for the rest of the hour
    assert run(url, "pin", "llama", "legal", "fp16", "--ttl", "1h", "--reason", "INC-1 alice") == 0
    capsys.readouterr()
    assert run(url, "set", "llama", "legal", "fp8", "--reason", "bob promote") == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "warning: llama/legal was pinned to fp16 until" in err
    assert "INC-1 alice" in err and "the pin now holds fp8 against every policy" in err
    assert run(url, "set", "llama", "legal", "fp8") == 0  # unchanged: nothing to say
    assert "warning" not in capsys.readouterr().err


def test_unpin_of_a_route_that_is_not_pinned_says_so(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # it said "already serves fp16; nothing written", an answer to a question nobody asked
    assert run(url, "set", "llama", "chat", "fp16") == 0
    capsys.readouterr()
    assert run(url, "unpin", "llama", "chat") == 0
    assert capsys.readouterr().out.strip() == "llama/chat is not pinned (serves fp16, epoch 1); nothing written"


def test_a_redis_that_wants_a_password_is_named_as_such(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # without a password in the URL the message was redis-py's "HELLO must be called with the client already
    # authenticated, otherwise the HELLO AUTH <user> <pass> option can be used ..."
    import shutil
    import subprocess

    from watchdog.dev.embedded import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--requirepass", "hunter2",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while run(f"redis://:hunter2@127.0.0.1:{port}/0", "list") != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        capsys.readouterr()
        for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong@127.0.0.1:{port}/0"):
            assert run(url, "list") == 2
            err = capsys.readouterr().err
            assert "the server refused our credentials" in err and "redis://:PASSWORD@HOST:PORT/DB" in err
            assert "wrong" not in err and err.count("\n") == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_evidence_reads_the_daemons_variable_first(
        monkeypatch: pytest.MonkeyPatch, url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # evidence read the old $LLMWD_REDIS_URL before the daemon's $LLMWD_REDIS__URL (flags: the other way round)
    # and its help named only the old spelling
    from watchdog.cli.main import main

    monkeypatch.setenv("LLMWD_REDIS__URL", url)
    monkeypatch.setenv("LLMWD_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["evidence", "list"]) == 0
    assert "no evidence records" in capsys.readouterr().out
    main(["evidence", "list", "--help"])
    assert "$LLMWD_REDIS__URL" in " ".join(capsys.readouterr().out.split())


def test_maintenance_is_declared_audited_read_by_the_judge_and_ended(
        url: str, redis_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # before, an operator had to hand-write JSON into {prefix}:maintenance:... with redis-cli, unaudited
    from watchdog.core.signals import Signal
    from watchdog.policy.changes import maintenance_spans, mark_maintenance

    keys = Keys()
    assert run(url, "set", "llama", "chat", "fp8", "--new-route") == 0
    capsys.readouterr()
    t0 = time.time()
    assert run(url, "maintenance", "llama", "chat", "--for", "30m", "--started-ago", "5m",
               "--reason", "deploy v2.3", "--json") == 0
    doc = out_json(capsys)
    assert doc["until"] - doc["start"] == pytest.approx(35 * 60, abs=5) and doc["replaced"] is None
    key = keys.maintenance("llama", "chat")
    assert 29 * 60 < redis_client.ttl(key) <= 30 * 60
    spans = maintenance_spans({("llama", "chat"): redis_client.get(key)})
    window = Signal(source="live", model="llama", route="chat", precision="fp8", start=t0 - 240, end=t0 - 230,
                    samples=1, values={})
    assert mark_maintenance([window], spans) == 1 and window.detail["maintenance"] is True
    (rec,) = [r for r in FlagStore(redis_client, keys).audit(5) if r["op"] == "maintenance"]
    assert (rec["route"], rec["reason"], rec["changed_by"]) == ("chat", "deploy v2.3", who())
    # every model of a route, and the end of it
    assert run(url, "maintenance", "*", "chat", "--for", "10m") == 0
    assert redis_client.exists(keys.maintenance("*", "chat"))
    assert run(url, "maintenance", "llama", "chat", "--end") == 0
    assert "maintenance ended" in capsys.readouterr().out and not redis_client.exists(key)
    assert FlagStore(redis_client, keys).audit(1)[0]["op"] == "maintenance-end"
    # a typo is refused like set's, and a week is the most one command declares
    assert run(url, "maintenance", "llama", "chta", "--for", "30m") == 1
    with pytest.raises(SystemExit):
        run(url, "maintenance", "llama", "chat", "--for", "8d")


def test_a_negative_duration_is_named_as_such(url: str, redis_client: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse reads `--ttl -5m` as an option without a value: "expected one argument" alone sent a user
    # looking for a missing value they had given
    from watchdog.cli.main import main

    def pin(*ttl: str) -> list[str]:
        assert main(["flags", "pin", "llama", "chat", "fp16", *ttl, "--redis-url", url]) == 2
        return capsys.readouterr().err.strip().splitlines()

    err = pin("--ttl", "-5m")
    assert len(err) == 1 and "argument --ttl: expected one argument ('-5m' is negative; give a positive value)" in err[0]
    assert redis_client.exists("llmwd:route:llama:chat") == 0
    assert "is negative" not in "".join(pin("--ttl"))


@pytest.mark.parametrize(("model", "route", "says"), [
    ("llama", "a\u202eb", "U+202E"), ("llama", "my route", "a space"), ("m" * 300, "chat", "300 characters"),
    ("llama", "r" * 100_000, "100000 characters"), ("llama", "", "is empty")])
def test_set_refuses_names_the_event_contract_refuses_even_with_new_route(
        model: str, route: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from watchdog.cli.main import main

    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    t0 = time.monotonic()
    code = main(["flags", "set", "--new-route", model, route, "fp16", "--redis-url", "redis://127.0.0.1:1/0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert len(err[0]) < 400 and time.monotonic() - t0 < 5


def test_a_route_name_with_brackets_prints_as_written(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(url, "set", "llama", "[/]", "fp16", "--new-route") == 0
    assert "llama/[/]: fp16 (epoch 1)" in capsys.readouterr().out
    assert run(url, "set", "llama", "[/]", "fp8", "--expected-epoch", "0") == 1
    assert "refused llama/[/]:" in capsys.readouterr().out
    assert run(url, "list") == 0
    assert "[/]" in capsys.readouterr().out
