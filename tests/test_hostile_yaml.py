"""Hostile YAML (policies, config, golden manifests): every file is refused quickly, with
``file:line:col`` and the cause, and nothing escapes a reload."""

from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path

import pytest
import yaml

from watchdog.core import safe_yaml
from watchdog.policy import PolicyError, PolicyLoader, load_policy_files
from watchdog.policy.schema import MAX_SCOPE_GLOBS, Scope

REPO = Path(__file__).resolve().parents[1]
GOOD = """\
policies:
  - name: p
    rules:
      - name: r
        metric: error_rate
        fail_if: candidate > 0.05
"""


def laughs(levels: int = 9) -> str:
    out = 'x0: &x0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    for i in range(1, levels + 1):
        out += f"x{i}: &x{i} [" + ",".join([f"*x{i - 1}"] * 9) + "]\n"
    return out


def where(text: str, needle: str) -> str:
    """``line:col`` (1-based) of the first ``needle`` in ``text``."""
    i = text.index(needle)
    line = text.count("\n", 0, i) + 1
    return f"{line}:{i - (text.rfind(chr(10), 0, i) + 1) + 1}"


def policy(extra: str = "", cond: str = "candidate > 0.05") -> str:
    return ("policies:\n  - name: p\n" + extra +
            f"    rules:\n      - name: r\n        metric: error_rate\n        fail_if: {cond}\n")


def rejected(tmp_path: Path, text: str) -> tuple[Path, list[str]]:
    path = tmp_path / "p.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError) as exc:
        load_policy_files([path])
    return path, exc.value.messages


# --- safe_yaml itself ------------------------------------------------------------------------


def test_plain_yaml_loads_like_safe_load() -> None:
    for path in [*sorted((REPO / "policies").glob("*.yaml")), *sorted(REPO.glob("golden_sets/*/manifest.yaml"))]:
        text = path.read_text()
        assert safe_yaml.load(text) == yaml.safe_load(text), path
    text = "a: &x {b: [1, 2.5, true, null, '3']}\nc: *x\nd: 2024-01-02\n"
    assert safe_yaml.load(text) == yaml.safe_load(text)


@pytest.mark.parametrize(("text", "needle", "cause"), [
    (laughs(), "x5:", "nodes once aliases are expanded"),
    ("a: " + "[" * 500 + "]" * 500, "[" * 436, "nested deeper than 64 levels"),
    ("a: !!python/object/apply:os.system {args: [true]}\n", "!!python", "tag '!!python/object/apply:os.system'"),
    ("a: !!python/tuple [1, 2]\n", "!!python", "tag '!!python/tuple' is not allowed"),
    ("a: !!python/name:os.system ''\n", "!!python", "not allowed"),
    ("a: !custom 1\n", "!custom", "tag '!custom' is not allowed"),
    ("a: !!binary aGk=\n", "!!binary", "not allowed"),
    ("a: .nan\n", ".nan", "not finite"),
    ("a: [1, -.inf]\n", "-.inf", "not finite"),
    ("a: 1.0e+999\n", "1.0e", "not finite"),
    ("a: 99999999999999999999\n", "9999", "out of range (64 bits)"),
    ("a: &r [*r]\n", "*r", "no complete anchored node"),
    ("a: 1\n---\nb: 2\n", "---", "a single YAML document"),
    ("a: 1\na: 2\n", "a: 2", "duplicate key 'a'"),
    ("<<: {a: 1}\n", "<<", "merge keys"),
    ("policies:\n\t- name: x\n", "\t", "a tab: YAML indents with spaces only"),  # was "cannot start any token"
    ("a: [${P}]\n", "{P}", "quote a ${VAR} inside [...] or {...}"),  # was only "did not find expected ','"
    ("a: {b: ${P:-x}}\n", "{P:", "quote a ${VAR} inside [...] or {...}"),
])
def test_refused_with_position(text: str, needle: str, cause: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(safe_yaml.SafeYamlError) as exc:
        safe_yaml.load(text)
    assert time.perf_counter() - t0 < 1.0
    assert cause in exc.value.message
    line, col = where(text, needle).split(":")
    assert exc.value.line == int(line)
    if "aliases" not in cause and "deeper" not in cause:  # a bomb or a deep nest stops inside the line
        assert exc.value.col == int(col)


def test_big_file_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    with path.open("wb") as fh:
        fh.truncate(20 * 1024 * 1024)
    t0 = time.perf_counter()
    with pytest.raises(safe_yaml.SafeYamlError, match="20,971,520 bytes; the limit is 1,048,576 bytes"):
        safe_yaml.load_file(path)
    assert time.perf_counter() - t0 < 0.1


def test_limits_are_configurable() -> None:
    text = "a: [[[1]]]\n"
    assert safe_yaml.load(text, safe_yaml.Limits(max_depth=4)) == {"a": [[[1]]]}
    with pytest.raises(safe_yaml.SafeYamlError, match="deeper than 3"):
        safe_yaml.load(text, safe_yaml.Limits(max_depth=3))
    with pytest.raises(safe_yaml.SafeYamlError, match="more than 2 aliases"):
        safe_yaml.load("a: &a 1\nb: [*a, *a, *a]\n", safe_yaml.Limits(max_aliases=2))


# --- policy files ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "needle", "cause"), [
    (laughs() + GOOD, "x5:", "alias bomb"),
    ("policies: " + "[" * 500 + "]" * 500 + "\n", "[" * 436, "nested deeper"),
    (policy(cond="'" + "(" * 120 + "candidate > 1" + ")" * 120 + "'"), "'((", "nested too deeply"),
    (policy(cond="'" + "not " * 1000 + "candidate > 1'"), "'not", "too long"),
    (policy(cond="'" + "not " * 40 + "candidate > 1'"), "'not", "nested too deeply"),
    (policy("    cooldown: .nan\n"), ".nan", "not finite"),
    (policy("    promote:\n      after: .nan\n"), ".nan", "not finite"),
    (policy("    cooldown: 100000d\n"), "100000d", "out of range"),
    (policy("    min_time_in_state: {candidate: -.inf}\n"), "-.inf", "not finite"),
    (policy(cond="candidate > 0 / 0"), "candidate > 0", "division by zero"),
    (policy(cond="candidate > 1e308 * 10"), "candidate > 1e", "overflows"),
    (policy(cond="candidate > 1e999"), "candidate > 1e", "out of range"),
    (policy(cond="candidate > 1 or 2 < 1"), "candidate > 1 or", "always false"),
    (policy("    scope: !!python/object/apply:os.system {args: ['true']}\n"), "!!python", "not allowed"),
    (policy("    scope: {routes: [\"\u0441hat/*\"]}\n"), "\"\u0441hat", "U+0441 CYRILLIC SMALL LETTER ES"),
    (policy("    scope: {models: [\"llama\u200b\"]}\n"), "\"llama", "invisible"),
    (policy().replace("name: p", "name: \u0440olicy"), "\u0440olicy", "looks like the Latin 'p'"),
    (policy("    scope: {routes: [" + ", ".join(f'"r{i}"' for i in range(MAX_SCOPE_GLOBS + 1)) + "]}\n"),
     "[\"r0", "at most 10000 items"),
])
def test_hostile_policy_rejected(tmp_path: Path, text: str, needle: str, cause: str) -> None:
    t0 = time.perf_counter()
    path, messages = rejected(tmp_path, text)
    assert time.perf_counter() - t0 < 5.0
    assert len(messages) >= 1
    first = messages[0]
    assert first.startswith(f"{path}:"), first
    assert cause in first, first
    line = where(text, needle).split(":")[0]
    assert first.startswith(f"{path}:{line}:"), (first, where(text, needle))


def test_judge_effect_inf_rejected(tmp_path: Path) -> None:
    text = ("policies:\n  - name: p\n    rules:\n      - name: r\n        metric: latency_p99_ms\n"
            "        judge: {test: mann_whitney, effect: .inf}\n")
    path, messages = rejected(tmp_path, text)
    assert messages == [f"{path}:{where(text, '.inf')}: number '.inf' is not finite"]


def test_finite_numbers_also_enforced_without_yaml() -> None:
    from pydantic import ValidationError

    from watchdog.policy.schema import Judge, Policy

    with pytest.raises(ValidationError, match="finite"):
        Judge(test="rate", effect=float("inf"))
    with pytest.raises(ValidationError, match="finite"):
        Policy.model_validate({"name": "p", "cooldown": float("nan"),
                               "rules": [{"name": "r", "metric": "error_rate", "fail_if": "candidate > 1"}]})


def test_size_limit_for_policy_file(tmp_path: Path) -> None:
    text = policy("    description: " + "x" * (20 * 1024 * 1024) + "\n")
    t0 = time.perf_counter()
    path, messages = rejected(tmp_path, text)
    assert time.perf_counter() - t0 < 1.0
    assert messages == [f"{path}:1:1: file is {len(text):,} bytes; the limit is 1,048,576 bytes"]


def test_nfkc_scope_matches_normalised_route(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(policy("    scope: {routes: [\"\uff43\uff48\uff41\uff54/*\"]}\n"), encoding="utf-8")  # fullwidth
    scope = load_policy_files([path]).policies[0].scope
    assert scope.routes == ["chat/*"] and scope.covers("m", "chat/general")


def test_scope_matcher_agrees_with_fnmatch_and_compiles_once() -> None:
    globs = ["chat/*", "legal/[ab]?", "exact", "x*y*z", "q?", "[!a]bc"]
    names = ["chat/general", "chat", "legal/a1", "legal/c1", "exact", "exactly", "xayz", "xz", "q1", "q12",
             "abc", "bbc", "Chat/x"]
    scope = Scope(routes=globs)
    for name in names:
        assert scope.covers("m", name) == any(fnmatch.fnmatchcase(name, g) for g in globs), name
    many = Scope(routes=[f"route-{i}/*" for i in range(MAX_SCOPE_GLOBS - 1)] + ["exact-0"])
    t0 = time.perf_counter()
    hits = sum(many.covers("m", f"route-{i * 4}/x") for i in range(2000))
    assert hits == 2000 and many.covers("m", "exact-0") and not many.covers("m", "nope")
    assert time.perf_counter() - t0 < 2.0  # fnmatch past its 32,768-pattern cache recompiles every glob


# --- reload ----------------------------------------------------------------------------------


def bump(path: Path, text: str) -> None:
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


@pytest.mark.parametrize("hostile", [laughs() + GOOD, "policies: " + "[" * 2000 + "]" * 2000,
                                     policy(cond="'" + "(" * 900 + "candidate > 1" + ")" * 900 + "'"),
                                     "\xff\xfe not utf-8"])
def test_reload_keeps_last_good_and_never_raises(tmp_path: Path, hostile: str) -> None:
    path = tmp_path / "p.yaml"
    bump(path, GOOD)
    errors: list[list[str]] = []
    loader = PolicyLoader([path], on_error=errors.append)
    if hostile.startswith("\xff"):
        path.write_bytes(b"\xff\xfe not utf-8")
        st = path.stat()
        os.utime(path, ns=(st.st_mtime_ns + 10**9, st.st_mtime_ns + 10**9))
    else:
        bump(path, hostile)
    assert loader.check() is False
    assert loader.policy_set.names == ["p"] and len(errors) == 1 and errors[0][0].startswith(f"{path}:")
    path.unlink()
    assert loader.reload() is False and loader.policy_set.names == ["p"]


def test_background_reload_never_blocks_and_swaps_atomically(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    rules = "".join(f"      - name: r{i}\n        metric: error_rate\n        fail_if: candidate > 0.{i % 9 + 1}\n"
                    for i in range(1200))
    body = "policies:\n  - name: p\n    description: " + "x" * 600_000 + "\n    rules:\n" + rules
    bump(path, body)
    changes: list[object] = []
    loader = PolicyLoader([path], on_change=changes.append, background=True)
    assert loader.policy_set.names == ["p"]
    t0 = time.perf_counter()
    bump(path, body.replace("name: p\n", "name: q\n", 1))
    assert loader.check() is False  # started in the background
    first_call = time.perf_counter() - t0
    worst = 0.0
    seen: set[tuple[str, ...]] = set()
    deadline = time.monotonic() + 30
    while loader.policy_set.names != ["q"] and time.monotonic() < deadline:
        t1 = time.perf_counter()
        loader.check()
        worst = max(worst, time.perf_counter() - t1)
        seen.add(tuple(loader.policy_set.names))
        time.sleep(0.002)
    assert loader.policy_set.names == ["q"] and len(changes) == 2
    assert seen <= {("p",), ("q",)}  # never a half-built set
    assert first_call < 0.05 and worst < 0.05, (first_call, worst)
    # SIGHUP path: reload() starts a load and returns; wait() swaps it in
    bump(path, laughs() + GOOD)
    errors: list[list[str]] = []
    loader.on_error = errors.append
    assert loader.reload() is False and loader.wait(10) is False
    assert loader.policy_set.names == ["q"] and "alias bomb" in errors[0][0]


# --- config and golden manifests -------------------------------------------------------------


def test_config_refuses_alias_bomb_and_tags(tmp_path: Path) -> None:
    from watchdog.config.settings import ConfigError, load_config

    path = tmp_path / "watchdog.yaml"
    path.write_text(laughs(), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{path}:\d+:\d+: .*alias bomb"):
        load_config(path)
    path.write_text("redis: !!python/object/apply:os.system {args: ['true']}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{path}:1:8: .*tag '!!python/object/apply:os.system'"):
        load_config(path)


def test_golden_manifest_refuses_tags_and_bombs(tmp_path: Path) -> None:
    from probes.golden import GoldenSetError, load_golden_set

    gs = tmp_path / "set"
    gs.mkdir()
    (gs / "items.jsonl").write_text('{"id": "a", "prompt": "p", "reference": "r"}\n')
    (gs / "manifest.yaml").write_text("name: set\nmetrics: !!python/object/apply:os.system {args: [x]}\n")
    with pytest.raises(GoldenSetError, match=r"manifest.yaml:2:10: .*not allowed"):
        load_golden_set(gs)
    (gs / "manifest.yaml").write_text(laughs())
    with pytest.raises(GoldenSetError, match="alias bomb"):
        load_golden_set(gs)
    (gs / "manifest.yaml").write_text("name: set\ndescription: " + "x" * 2_000_000 + "\n")
    with pytest.raises(GoldenSetError, match=r"manifest.yaml:1:1: file is 2,000,024 bytes; the limit is 1,048,576"):
        load_golden_set(gs)
