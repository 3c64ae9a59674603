"""Config: ${VAR} expansion, env overrides that replace a section, config check, the shipped example."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from watchdog.cli.main import main
from watchdog.config.redact import redacted
from watchdog.config.settings import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_placeholders_expand_with_defaults_and_typed_results(tmp_path: Path) -> None:
    path = write(tmp_path, "server:\n  port: ${PORT:-9500}\n  host: '${HOST:-127.0.0.1}'\n"
                           "redis:\n  url: redis://:${REDIS_PASSWORD}@db:6379/0\n"
                           "kafka:\n  topic: ${EMPTY:-fallback}\n  group_id: a$${b}\n")
    cfg = load_config(path, env={"REDIS_PASSWORD": "pw", "EMPTY": ""})
    assert cfg.server.port == 9500 and cfg.server.host == "127.0.0.1"
    assert cfg.redis.url == "redis://:pw@db:6379/0"
    assert cfg.kafka.topic == "fallback" and cfg.kafka.group_id == "a${b}"
    assert load_config(path, env={"REDIS_PASSWORD": "x", "PORT": "9600"}).server.port == 9600


def test_an_unset_variable_is_named_with_its_position(tmp_path: Path) -> None:
    path = write(tmp_path, "alerts:\n  channels:\n    - kind: pagerduty\n      routing_key: ${PAGERDUTY_KEY}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert "c.yaml:4:20:" in str(err.value) and "PAGERDUTY_KEY is not set" in str(err.value)


def test_every_unset_variable_is_named_in_file_order(tmp_path: Path) -> None:
    path = write(tmp_path, "alerts:\n  channels:\n    - kind: pagerduty\n      routing_key: ${PD_KEY}\n"
                           "    - kind: slack\n      url: https://hooks.slack.com/services/${SLACK_PATH}\n"
                           "redis:\n  url: ${REDIS_URL:-redis://127.0.0.1:6379/0}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    lines = str(err.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("PD_KEY is not set (set it, or write ${PD_KEY:-default})") and "c.yaml:4:20:" in lines[0]
    assert "PD_KEY is not set" in lines[0] and "SLACK_PATH is not set" in lines[1] and "c.yaml:6:12:" in lines[1]


def test_env_json_replaces_a_section_and_nested_keys_merge(tmp_path: Path) -> None:
    path = write(tmp_path, "kafka:\n  topic: t\n  security: {security_protocol: SASL_SSL, sasl_mechanism: PLAIN}\n"
                           "policies: [a.yaml, /abs/b.yaml]\n")
    assert load_config(path, env={"LLMWD_KAFKA__SECURITY": "{}"}).kafka.security == {}
    cfg = load_config(path, env={"LLMWD_KAFKA__SECURITY__SASL_MECHANISM": "SCRAM-SHA-512"})
    assert cfg.kafka.security == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}
    assert cfg.kafka.topic == "t" and cfg.policies == [str(tmp_path / "a.yaml"), "/abs/b.yaml"]
    assert load_config(path, env={"LLMWD_POLICIES": '["/p/x.yaml"]'}).policies == ["/p/x.yaml"]
    with pytest.raises(ConfigError, match=r"\$LLMWD_SERVER__PORT: server.port"):
        load_config(path, env={"LLMWD_SERVER__PORT": "nope"})
    with pytest.raises(ConfigError, match=r"\$LLMWD_KAFKA__SECURITY: not valid JSON"):
        load_config(path, env={"LLMWD_KAFKA__SECURITY": "{oops"})


def test_precisions_and_external_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="default_precision 'bf16' is not one of"):
        load_config(write(tmp_path, "default_precision: bf16\n"), env={})
    cfg = load_config(write(tmp_path, "server: {host: 0.0.0.0, port: 9464}\n"), env={})
    assert cfg.server.status_url == "http://127.0.0.1:9464/status"
    cfg = load_config(write(tmp_path, "server: {external_url: 'https://wd.example.com/'}\n"), env={})
    assert cfg.server.status_url == "https://wd.example.com/status"
    with pytest.raises(ConfigError, match="external_url"):
        load_config(write(tmp_path, "server: {external_url: 'wd.example.com'}\n"), env={})


def test_redaction() -> None:
    dump = {"redis": {"url": "rediss://user:hunter2@r:6380/0"},
            "kafka": {"security": {"sasl_plain_password": "pw", "ssl_keyfile": "/k.pem"}},
            "alerts": {"channels": [{"kind": "slack", "url": "https://hooks.slack.com/services/T0/B0/XyZ",
                                     "routing_key": "R", "headers": {"Authorization": "Bearer t"}}]}}
    text = json.dumps(redacted(dump))
    for secret in ("hunter2", '"pw"', "XyZ", '"R"', "Bearer"):
        assert secret not in text
    assert "/k.pem" in text and "rediss://user:***@r:6380/0" in text


@pytest.mark.parametrize(("raw", "shown"), [
    ("redis://:hunter2@db:6379/0", "redis://:***@db:6379/0"),
    ("rediss://user:hunter2@db:6380/0", "rediss://user:***@db:6380/0"),
    ("redis://user:p@ss/w0rd@db/0", "redis://user:***@db/0"),  # an '@' (or '/') in the password
    ("redis://user@db:6379/0", "redis://user@db:6379/0"),  # no password: nothing to hide
    ("redis+sentinel://:hunter2@s1:26379,s2:26379/llmwd/0?sentinel_password=hunter2&master_recheck_s=1",
     "redis+sentinel://:***@s1:26379,s2:26379/llmwd/0?sentinel_password=***&master_recheck_s=1"),
    ("redis+sentinel://s1/llmwd?ssl_keyfile=/k.pem&sentinel_username=u&sentinel_password=hunter2",
     "redis+sentinel://s1/llmwd?ssl_keyfile=/k.pem&sentinel_username=u&sentinel_password=***"),
    ("bad sentinel address 'x' in redis+sentinel://u:hunter2@x/svc: use host:port",
     "bad sentinel address 'x' in redis+sentinel://u:***@x/svc: use host:port"),
    ("https://api.example.com/v1?api_key=hunter2#top", "https://api.example.com/v1?api_key=***#top"),
    ("https://hooks.slack.com/services/T0/B0/hunter2", "https://hooks.slack.com/services/***"),
])
def test_one_redactor_hides_url_passwords_and_secret_parameters(raw: str, shown: str) -> None:
    assert redacted(raw) == shown


def test_config_check_prints_redacted_and_fails_on_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLMWD_REDIS__URL", "redis://:topsecret@db:6379/0")
    good = write(tmp_path, f"policies: [{ROOT / 'policies' / 'default.yaml'}]\n")
    assert main(["config", "check", "--config", str(good)]) == 0
    out, err = capsys.readouterr()
    assert "redis://:***@db:6379/0" in out and "topsecret" not in out + err
    monkeypatch.setenv("LLMWD_KAFAK__TOPIC", "typo")
    assert main(["config", "check", "--config", str(good)]) == 2
    assert "$LLMWD_KAFAK__TOPIC matches no config key; did you mean $LLMWD_KAFKA__TOPIC?" in capsys.readouterr().err
    monkeypatch.delenv("LLMWD_KAFAK__TOPIC")
    bad_policy = tmp_path / "p.yaml"
    bad_policy.write_text("policies:\n  - name: x\n    rules: 3\n")
    assert main(["config", "check", "--config", str(write(tmp_path, "policies: [p.yaml]\n"))]) == 2
    assert "p.yaml:" in capsys.readouterr().err
    assert main(["config", "check", "--config", str(write(tmp_path, "windows: {length_s: -1}\n"))]) == 2
    assert "c.yaml:1:11: windows.length_s" in capsys.readouterr().err


def test_the_shipped_example_checks_clean_as_is(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    for var in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "LLMWD_REDIS__URL", "LLMWD_KAFKA__BOOTSTRAP_SERVERS"):
        monkeypatch.delenv(var, raising=False)
    assert main(["config", "check", "--config", str(ROOT / "deploy" / "config.example.yaml")]) == 0
    out = capsys.readouterr().out
    assert "bootstrap_servers: 127.0.0.1:9092" in out and "redis://127.0.0.1:6379/0" in out


def test_init_writes_a_starter_that_checks_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["init", "wd"]) == 0
    assert main(["config", "check", "--config", "wd/config.yaml"]) == 0
    assert "wd/policies/default.yaml" in capsys.readouterr().out
    assert "deploy/config.example.yaml" not in (tmp_path / "wd/config.yaml").read_text()  # no checkout here
    assert main(["init", "wd"]) == 2 and "--force" in capsys.readouterr().err
    assert main(["init", "wd", "--force"]) == 0


def test_an_alias_bomb_is_refused_quickly(tmp_path: Path) -> None:
    import time

    lines = ['a0: &a0 ["${X:-lol}"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = write(tmp_path, "\n".join(lines) + "\n")
    start = time.monotonic()
    with pytest.raises(ConfigError):
        load_config(path, env={})
    assert time.monotonic() - start < 5


def test_yaml_problems_and_missing_keys_are_placed_by_the_shared_position_tracker(tmp_path: Path) -> None:
    # watchdog.config.yamlpos places these, as it does for policy files: all YAML problems at once
    path = write(tmp_path, "kafka:\n  topic: a\n  topic: b\nredis: {url: x, socket_timeout_s: .nan}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value).splitlines() == [f"{path}:3:3: invalid YAML: duplicate key 'topic'",
                                           f"{path}:4:35: invalid YAML: number '.nan' is not finite"]
    path = write(tmp_path, "golden:\n  jobs:\n    - {set: s, model: m, routes: [r], candidate: {}, baseline: {}}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:3:7: golden.jobs.0.name: Field required"):
        load_config(path, env={})


def test_an_unknown_key_says_where_and_what_was_meant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("kafka:\n  topic: t\n  bootstrap_servrs: a:9092\nserverr: {port: 1}\n"
                    "alerts:\n  zzz_nothing_like_it: 1\n")
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    assert main(["config", "check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3:3: unknown key 'bootstrap_servrs' in kafka (did you mean 'bootstrap_servers'?)" in err
    assert f"{path}:4:1: unknown key 'serverr' at the top level (did you mean 'server'?)" in err
    assert f"{path}:6:3: unknown key 'zzz_nothing_like_it' in alerts; allowed here: " in err and "channels" in err
    assert "Extra inputs" not in err


def test_an_unknown_key_from_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMWD_KAFKA__TOPICC", "t")
    with pytest.raises(ConfigError) as err:
        load_config(None)
    assert str(err.value) == "$LLMWD_KAFKA__TOPICC: unknown key 'topicc' in kafka (did you mean 'topic'?)"


def test_an_unknown_gateway_key_says_what_was_meant(tmp_path: Path) -> None:
    from watchdog.gateway.config import GatewayConfigError, load_gateway_config

    path = tmp_path / "config.yaml"
    path.write_text("gateway:\n  host: 127.0.0.1\n  prot: 8080\n")
    with pytest.raises(GatewayConfigError) as err:
        load_gateway_config(path)
    assert "unknown key 'prot' in gateway (did you mean 'port'?)" in str(err.value) and "Extra inputs" not in str(err.value)


def test_config_check_finds_what_a_golden_job_would_fail_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """An engine kind or option typo, or a set that is not there, failed only at the job's first run."""
    from watchdog.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"policies: [{ROOT / 'policies' / 'default.yaml'}]\ngolden:\n  jobs:\n    - name: nightly\n      set: cdoe\n      model: m\n"
                   "      routes: ['code/*']\n      candidate: {kind: torhc, model_path: /m, precision: fp8}\n"
                   "      baseline: {kind: torch, modelpath: /m, precision: fp16}\n")
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    assert main(["config", "check", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err
    assert err[0].startswith("golden.jobs.0 (nightly): candidate: unknown engine kind 'torhc'") and "'torch'?" in err[0]
    assert err[1].startswith("golden.jobs.0 (nightly): baseline: engine 'torch' has no option 'modelpath' "
                             "(did you mean 'model_path'?"), err[1]
    assert err[2].startswith("golden.jobs.0 (nightly): no golden set 'cdoe' under ") and "'code'?" in err[2]
    fixed = cfg.read_text().replace("cdoe", "code").replace("torhc", "torch").replace("modelpath", "model_path")
    cfg.write_text(fixed)
    assert main(["config", "check", "--config", str(cfg)]) == 0


def test_config_check_names_an_engine_library_that_is_not_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A torch golden job in an install without the torch extra (the README's `[embedded,gpu]`) passed
    `config check` and failed at the job's first run, an hour after start. The libraries are looked up,
    not imported (sys.modules[...] = None is how a test hides an installed one)."""
    from probes.engines import check_engine
    from watchdog.cli.main import main

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ValueError, match=r"engine 'torch' needs torch, not installed here \(pip install "
                                         r"'fp8-watchdog\[torch\]'\)"):
        check_engine("torch", model_path="/m", precision="fp8")
    check_engine("openai", base_url="http://x/v1")  # needs nothing beyond the daemon's own
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"policies: [{ROOT / 'policies' / 'default.yaml'}]\ngolden:\n  jobs:\n    - name: hourly\n"
                   "      set: code\n      model: m\n      routes: ['code/*']\n"
                   "      candidate: {kind: torch, model_path: /m, precision: fp8}\n"
                   "      baseline: {kind: openai, base_url: 'http://x/v1'}\n")
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    assert main(["config", "check", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["golden.jobs.0 (hourly): candidate: engine 'torch' needs torch, not installed here "
                   "(pip install 'fp8-watchdog[torch]')"], err


def test_config_check_of_a_gateway_only_file_checks_the_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A gateway's own file (only `gateway:`) failed on the daemon's default policy file, which its user
    never named; now the gateway section alone is checked, and a typo in it is still one line."""
    monkeypatch.chdir(tmp_path)  # no policies/ here
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("gateway:\n  port: 8080\n  pools:\n    - {model: m, candidate: {url: 'http://a/v1'}, "
                   "baseline: {url: 'http://b/v1'}}\n")
    assert main(["config", "check", "--config", str(cfg)]) == 0
    err = capsys.readouterr().err
    assert "gateway-only file" in err and "policies" not in err.replace("policies and golden", ""), err
    cfg.write_text(cfg.read_text().replace("port:", "prot:"))
    assert main(["config", "check", "--config", str(cfg)]) == 2
    err_lines = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("note:")]
    assert err_lines == [f"{cfg}:2:3: unknown key 'prot' in gateway (did you mean 'port'?)"], err_lines


def test_a_golden_job_finds_its_set_beside_the_config_that_init_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``init wd`` writes wd/config.yaml beside wd/golden_sets: a set added there is the one a job names,
    whatever directory the daemon runs in (it was looked up in the working directory and the shipped sets)."""
    import shutil

    from watchdog.sources.golden import GoldenScheduler

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMWD_CONFIG", raising=False)
    monkeypatch.delenv("WATCHDOG_GOLDEN_DIR", raising=False)
    assert main(["init", "wd"]) == 0
    shutil.copytree(tmp_path / "wd/golden_sets/code", tmp_path / "wd/golden_sets/mine")
    manifest = tmp_path / "wd/golden_sets/mine/manifest.yaml"
    manifest.write_text(re.sub(r"(?m)^name: .*$", "name: mine", manifest.read_text()))
    job = ("golden:\n  jobs:\n    - name: nightly\n      set: mine\n      model: m\n      routes: ['code/*']\n"
           "      candidate: {kind: torch, model_path: /m, precision: fp8}\n"
           "      baseline: {kind: torch, model_path: /m, precision: fp16}\n")
    (tmp_path / "wd/config.yaml").write_text((tmp_path / "wd/config.yaml").read_text() + job)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["config", "check", "--config", "../wd/config.yaml"]) == 0, capsys.readouterr().err
    cfg = load_config("../wd/config.yaml", env={})
    assert cfg.golden.root == os.path.normpath("../wd/golden_sets")
    scheduler = GoldenScheduler.from_config(cfg.golden)
    assert scheduler is not None and scheduler.jobs["nightly"].root == cfg.golden.root
    # $WATCHDOG_GOLDEN_DIR still wins over the directory beside the config, and golden.root over both
    assert load_config("../wd/config.yaml", env={"WATCHDOG_GOLDEN_DIR": "/srv/sets"}).golden.root is None
    (tmp_path / "wd/config.yaml").write_text((tmp_path / "wd/config.yaml").read_text() + "  root: sets\n")
    assert load_config("../wd/config.yaml", env={}).golden.root == os.path.normpath("../wd/sets")
    (tmp_path / "wd/config.yaml").write_text("golden:\n")  # an empty section, as an editor leaves it
    assert load_config("../wd/config.yaml", env={}).golden.root == os.path.normpath("../wd/golden_sets")


@pytest.mark.parametrize("url", ["localhost:6379", "http://db:6379", ":pw@db:6379"])
def test_a_redis_url_without_a_served_scheme_fails_config_check_and_run_in_one_line(
        url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LLMWD_REDIS__URL", url)
    good = write(tmp_path, f"policies: [{ROOT / 'policies' / 'default.yaml'}]\n")
    for argv in (["config", "check"], ["run"]):
        assert main([*argv, "--config", str(good)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err
        assert "$LLMWD_REDIS__URL: redis.url:" in err and "redis://, rediss://, unix://" in err
        assert "pw" not in err


@pytest.mark.parametrize("url", ["redis://db:6379/0", "rediss://db:6380", "unix:///run/redis.sock?db=1",
                                 "redis+sentinel://h1:26379,h2:26379/llmwd/0", "REDIS://db"])
def test_every_redis_url_form_the_client_serves_passes(url: str, tmp_path: Path) -> None:
    assert load_config(write(tmp_path, f"redis: {{url: '{url}'}}\n")).redis.url == url
    cluster = load_config(write(tmp_path, "redis: {url: 'rediss+cluster://h1:7000', prefix: '{llmwd}'}\n"))
    assert cluster.redis.url == "rediss+cluster://h1:7000"


@pytest.mark.parametrize(("var", "meant"), [
    ("LLMWD_REDS__URL", "$LLMWD_REDIS__URL"), ("LLMWD_SERVER_PORT", "$LLMWD_SERVER__PORT"),
    ("LLMWD_SERVR_PORT", "$LLMWD_SERVER__PORT"), ("LLMWD_POLICY_POLL", "$LLMWD_POLICY_POLL_S")])
def test_a_misspelt_env_override_fails_config_check_and_run_with_did_you_mean(
        var: str, meant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(var, "1")
    good = write(tmp_path, f"policies: [{ROOT / 'policies' / 'default.yaml'}]\n")
    for argv in (["config", "check"], ["run"]):
        assert main([*argv, "--config", str(good)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"fp8-watchdog: invalid configuration: ${var} matches no config key; did you mean {meant}?"], err


def test_variables_other_readers_own_are_not_config_typos(tmp_path: Path) -> None:
    env = {"LLMWD_LITELLM__TOPIC": "t", "LLMWD_TEST_FULL_EXIT": "1", "LLMWD_TANSU": "/x", "LLMWD_REDIS_URL": "redis://d",
           "LLMWD_DRILL_CLOCK_FILE": "/c", "LLMWD_XYZZY": "1"}  # like no key: config check and run only warn
    assert load_config(write(tmp_path, "instance: a\n"), env=env).instance == "a"


@pytest.mark.parametrize("field", ["length_s", "grace_s", "max_age_s", "route_idle_s"])
def test_window_durations_are_bounded_like_policy_durations(field: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"c\.yaml:1:\d+: windows\.{field}: .*1e\+300 s is out of range: "
                                          r"at most 366 days"):
        load_config(write(tmp_path, f"windows: {{{field}: 1e300}}\n"), env={})
    assert getattr(load_config(write(tmp_path, f"windows: {{{field}: 31622400}}\n"), env={}).windows, field) == 31622400


@pytest.mark.parametrize(("servers", "says"), [
    ("kafka-0:abc", "'kafka-0:abc': port 'abc' is not a number"),
    ("127.0.0.1:99999", "'127.0.0.1:99999': port 99999 is out of range (1-65535)"),
    ("", "no broker given"),
    ("k0:9092,,k1:9092", "an empty entry"),
])
def test_a_bootstrap_address_no_client_can_use_fails_config_check_and_run_in_one_line(
        servers: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It passed config check, and run retried the start-up for ever ("invalid literal for int()")."""
    monkeypatch.setenv("LLMWD_KAFKA__BOOTSTRAP_SERVERS", servers)
    good = write(tmp_path, f"policies: [{ROOT / 'policies' / 'default.yaml'}]\n")
    for argv in (["config", "check"], ["run"]):
        assert main([*argv, "--config", str(good)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "$LLMWD_KAFKA__BOOTSTRAP_SERVERS: kafka.bootstrap_servers:" in err[0], err
        assert says in err[0], err


@pytest.mark.parametrize("servers", ["k0:9092", "k0:9092, k1:9093", "[::1]:9092", "kafka-0", "10.0.0.1:9092,kafka-1"])
def test_every_bootstrap_form_the_client_takes_passes(servers: str, tmp_path: Path) -> None:
    assert load_config(write(tmp_path, f"kafka: {{bootstrap_servers: '{servers}'}}\n")).kafka.bootstrap_servers == servers


@pytest.mark.parametrize(("var", "topic", "says"), [
    ("LLMWD_KAFKA__TOPIC", "bad topic!", "'bad topic!' is not a Kafka topic name"),
    ("LLMWD_KAFKA__TOPIC", "", "'' is not a Kafka topic name"),
    ("LLMWD_KAFKA__DLQ_TOPIC", "..", "'..' is not a Kafka topic name"),
    ("LLMWD_KAFKA__TOPIC", "t" * 250, "at most 249 characters"),
])
def test_a_topic_kafka_refuses_fails_config_check_and_run_in_one_line(
        var: str, topic: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """It passed config check, and run ended in kafka-python's ValueError traceback once it subscribed."""
    monkeypatch.setenv(var, topic)
    good = write(tmp_path, f"policies: [{ROOT / 'policies' / 'default.yaml'}]\n")
    for argv in (["config", "check"], ["run"]):
        assert main([*argv, "--config", str(good)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"${var}: kafka." in err[0] and says in err[0], err


def test_a_bare_broker_host_is_diagnosed_at_kafkas_default_port() -> None:
    """kafka-python takes 'kafka-0' as kafka-0:9092 (and config check lets it pass); the start-up diagnosis
    called it "bad address (want host:port)" whatever the real problem was."""
    from watchdog.ingest.startup import diagnose

    line = diagnose("nosuchhost.invalid", {}, timeout_s=1.0)
    assert line.startswith("broker nosuchhost.invalid: DNS lookup failed"), line


@pytest.mark.parametrize("var", ["LLMWD_INSTANCE", "LLMWD_KAFKA__GROUP_ID"])
def test_an_empty_instance_or_consumer_group_is_refused(var: str, tmp_path: Path) -> None:
    """``LLMWD_INSTANCE=`` ran a replica named '' (in alerts, heartbeats, ownership) and an empty
    ``group_id`` joined a consumer group named ''."""
    path = write(tmp_path, f"policies: [{ROOT / 'policies' / 'default.yaml'}]\n")
    with pytest.raises(ConfigError, match="at least 1 character"):
        load_config(path, env={var: ""})

