"""Issue 20 §6: the LiteLLM hook's settings file is read like the daemon's config: the bounded YAML
loader, ``${VAR}`` placeholders, ``LLMWD_LITELLM__*`` overrides and errors at ``file:line:col``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch of the cost map
pytest.importorskip("litellm")

from watchdog.config.yamlfile import ConfigError  # noqa: E402
from watchdog.integrations.litellm import LiteLLMSettings  # noqa: E402

VARIANTS = "variants:\n  tiny: {fp8: tiny-fp8, fp16: tiny-fp16}\n"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "llmwd.yaml"
    p.write_text(text)
    return p


def test_placeholders_and_overrides_are_applied(tmp_path: Path) -> None:
    p = write(tmp_path, VARIANTS + "redis_url: ${REDIS_URL}\nbuffer_size: ${BUF:-500}\n")
    env = {"REDIS_URL": "redis://r:6379/2", "LLMWD_LITELLM__TOPIC": "t2",
           "LLMWD_LITELLM__KEY_ROUTES": '{"team-a": "legal"}'}
    s = LiteLLMSettings.from_file(p, env)
    assert (s.redis_url, s.buffer_size, s.topic, s.key_routes) == ("redis://r:6379/2", 500, "t2", {"team-a": "legal"})


def test_an_unset_variable_is_named_with_its_position(tmp_path: Path) -> None:
    p = write(tmp_path, VARIANTS + "redis_url: ${REDIS_URL}\n")
    with pytest.raises(ConfigError, match=r"llmwd.yaml:3:12: environment variable REDIS_URL is not set"):
        LiteLLMSettings.from_file(p, {})


def test_duplicate_keys_and_alias_bombs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"llmwd.yaml:4:1: .*duplicate"):
        LiteLLMSettings.from_file(write(tmp_path, VARIANTS + "topic: a\ntopic: b\n"), {})
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    with pytest.raises(ConfigError, match="invalid YAML"):
        LiteLLMSettings.from_file(write(tmp_path, bomb), {})


def test_unknown_keys_and_bad_values_point_at_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, VARIANTS + "redis_prefx: x\nbuffer_size: 0\n")
    with pytest.raises(ConfigError) as err:
        LiteLLMSettings.from_file(p, {})
    lines = str(err.value).splitlines()
    assert any(line.startswith(f"{p}:3:1: unknown key 'redis_prefx'") and "redis_prefix" in line for line in lines)
    assert any(line.startswith(f"{p}:4:") and "buffer_size" in line for line in lines)
    with pytest.raises(ConfigError, match=r"\$LLMWD_LITELLM__BUFFER_SIZE: buffer_size"):
        LiteLLMSettings.from_file(write(tmp_path, VARIANTS), {"LLMWD_LITELLM__BUFFER_SIZE": "-1"})


def test_a_redis_url_without_a_scheme_is_refused_with_its_position(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"llmwd\.yaml:3:\d+: redis_url: .*did you mean 'redis://localhost:6379'"):
        LiteLLMSettings.from_file(write(tmp_path, VARIANTS + "redis_url: localhost:6379\n"), {})
