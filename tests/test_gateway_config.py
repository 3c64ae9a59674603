"""Gateway settings, route resolution and the OpenAI body parsing: pure, no services."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from watchdog.config.settings import load_config
from watchdog.gateway.app import Gateway
from watchdog.gateway.config import GatewayConfigError, load_gateway_config
from watchdog.gateway.openai_io import StreamParser, parse_response

CONFIG = """\
kafka: {topic: llm.inference.logs}
gateway:
  port: 9000
  api_keys: {sk-legal: legal}
  model_routes: {llama-support: support}
  pools:
    - {model: llama, route: legal, candidate: {url: "http://fp8-legal/v1"}, baseline: {url: "http://fp16/v1"}}
    - {model: llama, candidate: {url: "http://fp8/v1/"}, baseline: {url: "http://fp16/v1"}}
    - {model: "*", candidate: {url: "http://any8/v1"}, baseline: {url: "http://any16/v1"}}
"""


def test_the_gateway_section_lives_in_the_daemon_config_file(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_text(CONFIG)
    assert load_config(path).kafka.topic == "llm.inference.logs"  # the daemon accepts the section
    cfg = load_gateway_config(path)
    assert cfg.port == 9000 and cfg.pools[1].candidate.url == "http://fp8/v1"
    assert cfg.pool_for("llama", "legal").candidate.url == "http://fp8-legal/v1"  # type: ignore[union-attr]
    assert cfg.pool_for("llama", "other").candidate.url == "http://fp8/v1"  # type: ignore[union-attr]
    assert cfg.pool_for("mistral", "legal").candidate.url == "http://any8/v1"  # type: ignore[union-attr]
    gw = Gateway(cfg, flags=None, emitter=None)
    assert gw.resolve_route({b"x-llmwd-route": b"legal", b"authorization": b"Bearer sk-legal"}, "llama") == "legal"
    assert gw.resolve_route({b"authorization": b"Bearer sk-legal"}, "llama-support") == "legal"
    assert gw.resolve_route({b"authorization": b"Bearer sk-other"}, "llama-support") == "support"
    assert gw.resolve_route({}, "llama") == "default"


def test_a_bad_gateway_section_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("gateway:\n  pools:\n    - {candidate: {url: fp8}, baseline: {url: 'http://x/v1'}}\n")
    with pytest.raises(GatewayConfigError, match=r"gateway\.pools\.0\.candidate\.url: Value error, url must start"):
        load_gateway_config(path)
    proc = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "gateway", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "url must start" in proc.stderr


def test_stream_parser_follows_chunks_split_anywhere() -> None:
    chunks = [{"choices": [{"delta": {"content": t}, "logprobs": {"content": [{"logprob": -0.5}]}}]}
              for t in (" Par", "is", ".")]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    for cut in (1, 7, 50, len(raw) - 3):
        p = StreamParser("chat")
        p.feed(raw[:cut])
        p.feed(raw[cut:])
        r = p.finish()
        assert (r.completion, r.prompt_tokens, r.completion_tokens, r.logprobs) == (" Paris.", 9, 3, [-0.5] * 3)
    p = StreamParser("completion")
    p.feed(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n')
    assert (p.finish().completion, p.result.completion_tokens) == ("ab", 2)  # no usage: chunks counted
    r = parse_response("completion", orjson.dumps({"choices": [{"text": "x", "logprobs": {"token_logprobs": [-1, None]}}],
                                                   "usage": {"prompt_tokens": 2, "completion_tokens": 1}}))
    assert (r.completion, r.logprobs, r.completion_tokens) == ("x", [-1.0], 1)
    assert parse_response("chat", b"not json").completion == ""


# --- issue 20 §6: the gateway section goes through the daemon config's loader -----------------------

def test_the_gateway_section_expands_env_refuses_duplicates_and_takes_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("gateway:\n  redis_url: ${REDIS_URL}\n  port: ${GW_PORT:-9001}\n"
                    "  pools: [{candidate: {url: 'http://a/v1'}, baseline: {url: 'http://b/v1'}}]\n")
    cfg = load_gateway_config(path, env={"REDIS_URL": "redis://r:6380/2"})
    assert (cfg.redis_url, cfg.port) == ("redis://r:6380/2", 9001)  # was the literal "${REDIS_URL}"
    cfg = load_gateway_config(path, env={"REDIS_URL": "redis://r/0", "LLMWD_GATEWAY__PORT": "9100",
                                         "LLMWD_GATEWAY__AUTH__REQUIRED": "true"})
    assert cfg.port == 9100 and cfg.auth.required
    with pytest.raises(GatewayConfigError, match=r"gw\.yaml:2:\d+: environment variable REDIS_URL is not set"):
        load_gateway_config(path, env={})
    path.write_text("gateway:\n  port: 1\n  port: 2\n")
    with pytest.raises(GatewayConfigError, match=r"gw\.yaml:3:3: invalid YAML: duplicate key 'port'"):
        load_gateway_config(path, env={})
    path.write_text("gateway:\n  routes: [ok, 'bad route']\n")
    with pytest.raises(GatewayConfigError, match=r"gw\.yaml:2:\d+: gateway\.routes\.1: .*space"):
        load_gateway_config(path, env={})


def test_clients_from_env_and_a_keys_file_with_positions(tmp_path: Path) -> None:
    (tmp_path / "keys.yaml").write_text("clients:\n  - {api_key: '${TEAM_B_KEY}', route: team-b}\n"
                                        "  - {api_key: k3, route: 'x\u200by'}\n")
    path = tmp_path / "gw.yaml"
    path.write_text("gateway:\n  auth: {required: true, keys_file: keys.yaml}\n"
                    "  clients: [{api_key: '${TEAM_A_KEY}', route: team-a, allow_routes: [team-a/eval]}]\n")
    with pytest.raises(GatewayConfigError, match=r"keys\.yaml:3:\d+: clients\.1\.route: .*U\+200B"):
        load_gateway_config(path, env={"TEAM_A_KEY": "key-team-a-1", "TEAM_B_KEY": "key-team-b-2"})
    (tmp_path / "keys.yaml").write_text("clients:\n  - {api_key: '${TEAM_B_KEY}', route: team-b}\n")
    cfg = load_gateway_config(path, env={"TEAM_A_KEY": "key-team-a-1", "TEAM_B_KEY": "key-team-b-2"})
    assert [(c.api_key, c.route) for c in cfg.all_clients()] == [("key-team-a-1", "team-a"), ("key-team-b-2", "team-b")]
    assert "key-team-a-1" not in repr(cfg) and "key-team-b-2" not in repr(cfg)
    assert cfg.known_routes() == {"default", "team-a", "team-a/eval", "team-b"}
    with pytest.raises(GatewayConfigError, match="listed twice") as err:
        load_gateway_config(path, env={"TEAM_A_KEY": "dup-key-77", "TEAM_B_KEY": "dup-key-77"})
    assert "dup-key-77" not in str(err.value)


def test_config_check_validates_the_gateway_and_hides_its_keys(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.yaml"
    path.write_text("policies: []\ngateway:\n  api_keys: {sk-live-0123456789: legal}\n"
                    "  auth: {metrics_keys: [prom-secret-42]}\n"
                    "  clients: [{api_key: sk-client-987, route: chat}]\n")
    proc = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "config", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for secret in ("sk-live-0123456789", "prom-secret-42", "sk-client-987"):
        assert secret not in proc.stdout + proc.stderr
    assert "legal" in proc.stdout and "chat" in proc.stdout  # the routes stay visible
    path.write_text("policies: []\ngateway:\n  routes: ['a\tb']\n")
    proc = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "config", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "gateway.routes.0" in proc.stderr and "watchdog.yaml:3:" in proc.stderr


def test_the_daemons_config_without_a_gateway_section_is_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """It was read whole as the gateway section: one "unknown key" error per daemon section, prefixed
    with llm-watchdog (PyPI's other project's command)."""
    from watchdog.cli.main import main

    path = tmp_path / "config.yaml"
    path.write_text("kafka: {topic: t}\npolicies: [p.yaml]\nredis: {url: 'redis://127.0.0.1:1/0'}\n")
    assert main(["gateway", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fp8-watchdog gateway: invalid configuration: {path}: no 'gateway:' section; this looks like "
                   "the daemon's config (kafka, policies): add a gateway: section (docs/INTEGRATIONS.md)"], err
    assert main(["gateway", "--config", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8-watchdog gateway: invalid configuration: ") and "nope.yaml" in err[0]


def test_a_wildcard_model_pool_is_named_as_letting_a_client_pick_its_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # with model "*" the client's model name is the model of the flag it obeys: "llama-x" on a route rolled back
    # for "llama" was served FP8 (measured through the real gateway), silently
    from watchdog.cli.main import main

    path = tmp_path / "watchdog.yaml"
    path.write_text(CONFIG)
    (warning,) = load_gateway_config(path).warnings()
    assert warning.startswith("gateway.pools[2]: model '*' lets a client pick the flag it obeys")
    assert main(["config", "check", "--config", str(path)]) == 0
    assert f"warning: {warning}" in capsys.readouterr().err
    path.write_text(CONFIG.replace('{model: "*", ', '{model: mistral, '))
    assert load_gateway_config(path).warnings() == []
    path.write_text(CONFIG.replace('{model: "*", ', '{model: "*", served_model: mistral, '))
    cfg = load_gateway_config(path)
    assert cfg.warnings() == [] and cfg.pools[2].flag_model("mistral-renamed") == "mistral"
    assert cfg.pools[1].flag_model("llama") == "llama"
    path.write_text(CONFIG.replace('{model: "*", ', '{model: "*", served_model: "a b", '))
    with pytest.raises(GatewayConfigError, match="served_model.*model 'a b'"):
        load_gateway_config(path)


def test_only_a_w3c_trace_id_from_traceparent_reaches_the_event(tmp_path: Path) -> None:
    # the header's second field went into the event whatever it held (a client's 8 KB of text, say)
    from watchdog.gateway.openai_io import Result

    path = tmp_path / "watchdog.yaml"
    path.write_text(CONFIG)
    cfg = load_gateway_config(path)
    gw = Gateway(cfg, flags=None, emitter=None)
    pool = cfg.pools[1]

    def trace_of(header: bytes) -> object:
        ev = gw._event("chat", {"messages": []}, pool, pool.candidate, "id", "llama", "legal", "fp8", "ok", 1.0,
                       None, Result(), {b"traceparent": header}, 200)
        return ev.get("trace_id")

    assert trace_of(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_of(b"00-" + b"x" * 8000 + b"-00f067aa0ba902b7-01") is None
    assert trace_of(b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01") is None
    assert trace_of(b"00-\xff\xfe-1-01") is None


def test_a_gateway_redis_url_without_a_scheme_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text("gateway:\n  redis_url: localhost:6379\n  pools:\n"
                    "    - {candidate: {url: 'http://a/v1'}, baseline: {url: 'http://b/v1'}}\n")
    with pytest.raises(GatewayConfigError, match=r"gw\.yaml:2:3: gateway\.redis_url: .*did you mean "
                                                 r"'redis://localhost:6379'"):
        load_gateway_config(path)


@pytest.mark.parametrize("which", ["port", "metrics.port"])
def test_a_port_in_use_is_one_line_and_exit_2(tmp_path: Path, which: str) -> None:
    """uvicorn logged "[Errno 98] error while attempting to bind" after "gateway on http://...", and exited 3;
    a busy metrics port was a traceback from prometheus_client."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        main_port, metrics = (port, "") if which == "port" else (0, f"  metrics: {{port: {port}}}\n")
        path = tmp_path / "gw.yaml"
        path.write_text(f"gateway:\n  host: 127.0.0.1\n  port: {main_port}\n  redis_url: redis://127.0.0.1:1/0\n"
                        f"{metrics}  events: {{enabled: false}}\n  pools:\n    - {{model: m, candidate: {{url: 'http://127.0.0.1:1/v1'}}, "
                        "baseline: {url: 'http://127.0.0.1:1/v1'}}\n")
        proc = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "gateway", "--config", str(path),
                               "--log-level", "ERROR"], capture_output=True, text=True, timeout=60)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert f"cannot serve on 127.0.0.1:{port}" in err[0] and "in use" in err[0], err


@pytest.mark.parametrize(("events", "says"), [
    ("{topic: 'bad topic!'}", "gateway.events.topic: Value error, 'bad topic!' is not a Kafka topic name"),
    ("{bootstrap_servers: 'kafka-0:abc'}", "gateway.events.bootstrap_servers: Value error, 'kafka-0:abc': port 'abc'"),
    ("{librdkafka: {acks: 1}}", "gateway.events.librdkafka: Value error, acks: 1 does not go with the idempotent"),
])
def test_an_events_address_kafka_refuses_is_a_config_error(tmp_path: Path, events: str, says: str) -> None:
    """The gateway started and logged "Broker: Invalid topic" (or a producer error) for every request."""
    path = tmp_path / "gw.yaml"
    path.write_text(f"gateway:\n  events: {events}\n  pools:\n    - {{model: m, candidate: {{url: 'http://a/v1'}}, "
                    "baseline: {url: 'http://b/v1'}}\n")
    with pytest.raises(GatewayConfigError) as err:
        load_gateway_config(path)
    assert says in str(err.value), str(err.value)
