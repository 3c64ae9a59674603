"""Validation of policy files: every error carries the exact file:line:col."""

from __future__ import annotations

from pathlib import Path

import pytest

from watchdog.alerting.alerter import Alerter
from watchdog.cli.policy import main as cli_main
from watchdog.policy import PolicyError, load_policy_files, parse_policy_text

REPO = Path(__file__).resolve().parents[1]

GOOD = """\
policies:
  - name: p
    cooldown: 90s
    rules:
      - name: err
        metric: error_rate
        fail_if: candidate > 0.05
        action: rollback
"""


def errors_of(text: str) -> list[str]:
    policies, errors = parse_policy_text(text, "f.yaml")
    assert not policies or not errors
    return errors


def test_good_file_parses_with_defaults() -> None:
    policies, errors = parse_policy_text(GOOD, "f.yaml")
    assert errors == []
    (p,) = policies
    assert (p.candidate, p.baseline, p.cooldown, p.dry_run) == ("fp8", "fp16", 90.0, False)
    assert p.rules[0].for_ == 1 and p.rules[0].source == "live" and p.rules[0].errors_trip_after == 3
    assert p.scope.covers("any", "thing")


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # unknown key, pointed at the key, with a suggestion
        ("    cooldown: 90s\n", "    cooldown: 90s\n    cooldwn: 1m\n", "f.yaml:4:5: unknown key 'cooldwn' (did you mean 'cooldown'?)"),
        ("        action: rollback\n", "        action: rollback\n        fro: 2\n", "f.yaml:9:9: unknown key 'fro' (did you mean 'for'?)"),
        # bad duration, pointed at the value
        ("cooldown: 90s", "cooldown: 5 minutes", "f.yaml:3:15: policies[0].cooldown: bad duration '5 minutes'"),
        # literal choices
        ("action: rollback", "action: page", "f.yaml:8:17: policies[0].rules[0].action: Input should be 'rollback' or 'alert'"),
        # unknown live metric, pointed at the metric value
        ("metric: error_rate", "metric: eror_rate", "f.yaml:6:17: unknown live metric 'eror_rate' (did you mean 'error_rate'?)"),
        # a rate written in percent: error_rate > 5 can never be true (validate said OK, the rule never fired)
        ("fail_if: candidate > 0.05", "fail_if: candidate > 5",
         "f.yaml:7:18: fail_if: error_rate is a fraction (0 to 1), so 'candidate > 5' compares it with 5 and is "
         "never or always true: 5 % is 0.05"),
        # condition errors point inside the condition (plain and quoted scalars)
        ("fail_if: candidate > 0.05", "fail_if: candidate > 0.05 and bogus < 1", "f.yaml:7:39: fail_if: unknown name 'bogus'"),
        ("fail_if: candidate > 0.05", "fail_if: \"candidate.real > 1\"", "f.yaml:7:28: fail_if: unexpected character '.'"),
        ("fail_if: candidate > 0.05", "fail_if: \"__import__('os')\"", "f.yaml:7:19: fail_if: unknown function '__import__'"),
        # missing required key: reported at the mapping that lacks it
        ("        metric: error_rate\n", "", "f.yaml:5:9: policies[0].rules[0]: missing required key 'metric'"),
        # numbers out of range
        ("        action: rollback\n", "        action: rollback\n        for: 0\n", "f.yaml:9:14: policies[0].rules[0].for: Input should be greater than or equal to 1"),
        # duplicate YAML key
        ("    cooldown: 90s\n", "    cooldown: 90s\n    cooldown: 2m\n", "f.yaml:4:5: duplicate key 'cooldown'"),
        # gpu rules have no baseline
        ("metric: error_rate\n        fail_if: candidate > 0.05", "metric: xid_critical\n        source: gpu\n        fail_if: baseline > 0",
         "f.yaml:8:18: fail_if: gpu signals have no baseline"),
        # judge options that only fit one test, pointed at the key
        ("fail_if: candidate > 0.05", "judge: {test: rate, effect: 0.01, relative_to: mean}",
         "f.yaml:7:56: judge: relative_to contrasts an upper-tail mean"),
        ("metric: error_rate\n        fail_if: candidate > 0.05",
         "metric: latency_p99_ms\n        judge: {test: quantile, effect: 0.0, relative_to: median}",
         "f.yaml:7:59: policies[0].rules[0].judge.relative_to: Input should be 'mean'"),
        ("metric: error_rate\n        fail_if: candidate > 0.05",
         "metric: latency_p99_ms\n        judge: {test: quantile, effect: 0.0, relative_to: mean}",
         "f.yaml:7:59: judge: relative_to contrasts an upper-tail mean"),
        ("fail_if: candidate > 0.05", "judge: {test: rate, effect: 0.01, null_model: sampling}",
         "f.yaml:7:55: judge: null_model applies to a learned null"),
        # per-replica failures are counted for error and timeout rates only, pointed at the key
        ("metric: error_rate\n", "metric: latency_p99_ms\n        replica_failures: leave_out\n",
         "f.yaml:7:27: replica_failures: only live error_rate and timeout_rate are counted per replica"),
        # YAML syntax
        ("    cooldown: 90s\n", "    cooldown: [90s\n", "f.yaml:4:"),
        # a name's length in characters (pydantic said "items" of a cleaned name)
        ("name: p\n", "name: " + "a" * 130 + "\n", "f.yaml:2:11: policies[0].name: should have at most 120 characters, not 130"),
        # a GPU cause that matches nothing (here with a Cyrillic 'а'), pointed at the list item
        ("    cooldown: 90s\n", "    cooldown: 90s\n    inhibit: {gpu_metrics: [xid_critical, therm\u0430l_slowdown]}\n",
         "f.yaml:4:43: policies[0].inhibit.gpu_metrics[1]: unknown GPU metric 'therm\u0430l_slowdown' "
         "(did you mean 'thermal_slowdown'?)"),
    ],
)
def test_error_positions(old: str, new: str, expected: str) -> None:
    assert old in GOOD
    errors = errors_of(GOOD.replace(old, new, 1))
    assert any(e.startswith(expected) for e in errors), errors


def test_a_scalar_spread_over_two_keys_is_one_error_at_the_path_the_file_writes() -> None:
    # min_time_in_state: 5 minutes gave two lines, ...min_time_in_state.candidate and ....baseline
    errors = errors_of(GOOD.replace("cooldown: 90s", "cooldown: 90s\n    min_time_in_state: 5 minutes"))
    assert errors == ["f.yaml:4:24: policies[0].min_time_in_state: bad duration '5 minutes': use e.g. 30s, 5m, "
                      "1h30m, 1d"]


def test_duplicate_rule_and_policy_names() -> None:
    text = GOOD + GOOD.replace("policies:\n", "").replace("cooldown: 90s", "cooldown: 1m")
    errors = errors_of(text)
    assert errors == ["f.yaml:9:11: duplicate policy name 'p'"]
    dup_rule = GOOD + "      - name: err\n        metric: timeout_rate\n        fail_if: value > 1\n"
    assert errors_of(dup_rule) == ["f.yaml:9:15: duplicate rule name 'err' in policy 'p'"]


def test_several_errors_sorted_by_position() -> None:
    text = GOOD.replace("cooldown: 90s", "cooldown: soon").replace("metric: error_rate", "metric: nope")
    errors = errors_of(text)
    assert [e.split(": ")[0] for e in errors] == ["f.yaml:3:15", "f.yaml:6:17"]


def test_not_a_mapping_and_empty() -> None:
    assert errors_of("- a\n- b\n")[0].startswith("f.yaml:1:1: a policy file must be a mapping")
    assert errors_of("")[0].startswith("f.yaml:1:1:")
    assert errors_of("policies: []\n")[0].startswith("f.yaml:1:11: policies: List should have at least 1 item")


def test_one_file_named_twice_is_loaded_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pol").mkdir()
    (tmp_path / "pol" / "a.yaml").write_text(GOOD)
    monkeypatch.chdir(tmp_path)
    ps = load_policy_files(["pol", "pol/a.yaml", "./pol/a.yaml", tmp_path / "pol" / "a.yaml"])
    assert [p.name for p in ps.policies] == ["p"] and ps.origin == {"p": "pol/a.yaml"}


def test_load_policy_files_across_files(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GOOD)
    b.write_text(GOOD)
    with pytest.raises(PolicyError) as info:
        load_policy_files([a, b])
    assert info.value.messages == [f"{b}:2:11: duplicate policy name 'p' (first defined at {a}:2:11)"]
    b.write_text(GOOD.replace("name: p\n", "name: q\n"))
    ps = load_policy_files([tmp_path])
    assert ps.names == ["p", "q"] and ps.origin["q"] == str(b)
    with pytest.raises(PolicyError) as info:
        load_policy_files([tmp_path / "missing.yaml"])
    assert "cannot read file" in info.value.messages[0]


def test_shipped_policies_validate() -> None:
    ps = load_policy_files([REPO / "policies" / "default.yaml", REPO / "policies" / "strict-legal-medical.yaml"])
    default, strict = ps.policies
    assert default.promote.mode == "auto" and strict.promote.mode == "manual"
    assert strict.scope.covers("llama-3-8b", "legal/contracts")
    assert not strict.scope.covers("llama-3-8b", "chat/general")
    assert {r.action for r in default.rules} == {"rollback", "alert"}


def test_cli_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("metric: error_rate", "metric: eror_rate"))
    assert cli_main(["policy", "validate", str(good)]) == 0
    assert f"{good}: OK (1 policy: p)" in capsys.readouterr().out
    assert cli_main(["policy", "validate", str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}:6:17: unknown live metric 'eror_rate'" in captured.err
    assert f"{good}: OK" in captured.out


def test_hidden_files_in_a_policy_directory_are_not_policies(tmp_path: Path) -> None:
    # an editor's or a tool's hidden file (.#default.yaml, .default.yaml being written) was read as a policy, and
    # a hot reload rejected the whole directory for it
    (tmp_path / "default.yaml").write_text(GOOD)
    (tmp_path / ".#default.yaml").write_text("not: [valid")
    (tmp_path / ".default.yaml").write_text(GOOD)
    assert [p.name for p in load_policy_files([tmp_path]).policies] == ["p"]
    assert cli_main(["policy", "validate", str(tmp_path)]) == 0


def test_candidate_and_baseline_must_be_precisions_the_config_has(tmp_path: Path) -> None:
    """A config with ``precisions: [fp8]`` and a policy rolling back to fp16: the daemon could never set
    the flag (``flags set`` refuses it too), so loading refuses the policy where it names the precision,
    or at the policy where the default is taken."""
    (tmp_path / "p.yaml").write_text(GOOD)
    assert load_policy_files([tmp_path / "p.yaml"], precisions={"fp8", "fp16"}).names == ["p"]
    with pytest.raises(PolicyError) as info:
        load_policy_files([tmp_path / "p.yaml"], precisions={"fp8"})
    assert info.value.messages == [f"{tmp_path / 'p.yaml'}:2:5: baseline 'fp16' is not one of the config's "
                                   "precisions (fp8): the daemon could not set a route to it"]
    (tmp_path / "p.yaml").write_text(GOOD.replace("    cooldown: 90s\n", "    cooldown: 90s\n    candidate: int8\n"))
    with pytest.raises(PolicyError) as info:
        load_policy_files([tmp_path / "p.yaml"], precisions={"fp8", "fp16"})
    assert [m.split(": ", 1)[0] for m in info.value.messages] == [f"{tmp_path / 'p.yaml'}:4:16"]


def test_config_check_and_the_daemon_refuse_a_policy_whose_baseline_the_config_lacks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from watchdog.cli.main import main
    from watchdog.config.settings import Config
    from watchdog.core.metrics import Metrics
    from watchdog.runtime.policies import PolicyReloader

    (tmp_path / "p.yaml").write_text(GOOD)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"policies: [{tmp_path / 'p.yaml'}]\nprecisions: [fp8]\ndefault_precision: fp8\n")
    assert main(["config", "check", "--config", str(cfg)]) == 2
    assert "baseline 'fp16' is not one of the config's precisions (fp8)" in capsys.readouterr().err
    config = Config(policies=[str(tmp_path / "p.yaml")], precisions=["fp8"], default_precision="fp8")
    with pytest.raises(PolicyError, match="baseline 'fp16'"):
        PolicyReloader(config, Metrics(), Alerter([]))
    cfg.write_text(f"policies: [{tmp_path / 'p.yaml'}]\n")
    assert main(["config", "check", "--config", str(cfg)]) == 0


def test_a_missing_policy_file_names_a_close_one_beside_it(tmp_path: Path) -> None:
    # a config's `policies: [policies/defualt.yaml]` said "[Errno 2] No such file or directory"
    (tmp_path / "default.yaml").write_text(GOOD)
    with pytest.raises(PolicyError) as info:
        load_policy_files([tmp_path / "defualt.yaml"])
    assert info.value.messages == [f"{tmp_path / 'defualt.yaml'}:1:1: cannot read file: no such file; did you mean "
                                   f"{str(tmp_path / 'default.yaml')!r}?"]
