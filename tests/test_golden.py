"""Golden sets: the shipped sets are valid, and every kind of mistake is reported with its location."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from probes.golden import (
    GoldenSetError,
    add_golden_commands,
    find_golden_set,
    list_golden_sets,
    load_golden_set,
    sets_for_route,
    validate_golden_set,
)
from probes.metrics import has_cjk

REPO_SETS = Path(__file__).resolve().parents[1] / "golden_sets"

GOOD_MANIFEST = """\
schema: 1
name: demo
domain: test
description: a tiny set
languages: [en]
routes: ["chat/*"]
generation:
  max_new_tokens: 16
  greedy: true
  stop: ["\\n"]
metrics: [rougeL, bleu]
"""


def make_set(tmp_path: Path, manifest: str = GOOD_MANIFEST, items: list[str] | None = None) -> Path:
    d = tmp_path / "demo"
    d.mkdir()
    (d / "manifest.yaml").write_text(manifest)
    if items is None:
        items = [
            json.dumps({"id": "a", "prompt": "p1", "reference": "r1"}),
            json.dumps({"id": "b", "prompt": "p2", "reference": "r2", "context": ["c"], "tags": ["x"]}),
        ]
    (d / "items.jsonl").write_text("\n".join(items) + "\n")
    return d


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_golden_commands(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_shipped_sets_are_valid_and_big_enough() -> None:
    paths = list_golden_sets(REPO_SETS)
    assert {p.name for p in paths} >= {"rag-enterprise", "legal-clauses", "code"}
    chinese = 0
    for p in paths:
        assert validate_golden_set(p) == []
        gs = load_golden_set(p)
        assert len(gs.items) >= 50, p.name
        assert gs.manifest.generation.greedy is True
        for item in gs.items:
            assert item.reference.strip() and len(item.reference) <= 200, item.id
        chinese += sum(has_cjk(i.prompt) for i in gs.items)
    assert chinese >= 10
    rag = load_golden_set(REPO_SETS / "rag-enterprise")
    assert all(i.context for i in rag.items)
    prompt = rag.render(rag.items[0])
    assert rag.items[0].context[0] in prompt and prompt.endswith(f"Question: {rag.items[0].prompt}\nAnswer:")
    assert rag.guards("rag/hr") and not rag.guards("code")
    assert [g.name for g in sets_for_route("code/python", REPO_SETS)] == ["code"]


def test_good_set_loads(tmp_path: Path) -> None:
    gs = load_golden_set(make_set(tmp_path))
    assert [i.id for i in gs.items] == ["a", "b"]
    assert [i.line for i in gs.items] == [1, 2]
    assert gs.render(gs.items[0]) == "p1"
    assert gs.render(gs.items[1]) == "Context:\n[1] c\n\nQuestion: p2\nAnswer:"
    assert find_golden_set("demo", tmp_path) == tmp_path / "demo"
    with pytest.raises(GoldenSetError, match="did you mean 'demo'"):
        find_golden_set("demi", tmp_path)


def test_manifest_errors_have_line_and_column(tmp_path: Path) -> None:
    bad = GOOD_MANIFEST.replace("metrics: [rougeL, bleu]", "metrics: [rougeL, rogueL]")
    bad = bad.replace("greedy: true", "greedy: false").replace(
        "domain: test\n", "domain: test\ncolour: red\n"
    )
    errors = validate_golden_set(make_set(tmp_path, bad))
    path = tmp_path / "demo" / "manifest.yaml"
    # after inserting 'colour' on line 4: greedy is on line 10, metrics on line 12
    assert f"{path}:4:1: colour: Extra inputs are not permitted" in errors
    assert any(e.startswith(f"{path}:10:11: generation.greedy:") for e in errors)
    metric = [e for e in errors if "rogueL" in e]
    assert (
        metric and metric[0].startswith(f"{path}:12:19: metrics.1:") and "did you mean 'rougeL'" in metric[0]
    )


def test_manifest_yaml_syntax_and_missing_fields(tmp_path: Path) -> None:
    errors = validate_golden_set(make_set(tmp_path, "name: demo\nroutes: [a, b\nmetrics: []\n"))
    assert len(errors) == 1 and errors[0].startswith(f"{tmp_path / 'demo' / 'manifest.yaml'}:3:")
    assert "invalid YAML" in errors[0]
    (tmp_path / "x").mkdir()
    missing = GOOD_MANIFEST.replace("domain: test\n", "")
    errors = validate_golden_set(make_set(tmp_path / "x", missing))
    assert any(": domain: Field required" in e for e in errors)


def test_item_errors_have_lines(tmp_path: Path) -> None:
    items = [
        json.dumps({"id": "a", "prompt": "p", "reference": "r"}),
        "{not json",
        json.dumps({"id": "a", "prompt": "p2", "reference": "r"}),
        json.dumps({"id": "c", "prompt": "  ", "reference": "r"}),
        json.dumps({"id": "d", "prompt": "p", "referense": "r"}),
        "",
        json.dumps({"id": "e", "prompt": "p", "reference": "r", "context": "not a list"}),
    ]
    d = make_set(tmp_path, items=items)
    errors = validate_golden_set(d)
    f = d / "items.jsonl"
    assert f"{f}:2: invalid JSON at column 2: Expecting property name enclosed in double quotes" in errors
    assert f"{f}:3: duplicate id 'a' (first at line 1)" in errors
    assert f"{f}:4: empty 'prompt'" in errors
    assert f"{f}:5: unknown field 'referense' (did you mean 'reference'?)" in errors
    assert f"{f}:5: missing 'reference'" in errors
    assert f"{f}:7: 'context' must be a list of strings" in errors
    assert len(errors) == 6


def test_cli_validate_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = make_set(tmp_path)
    assert cli(["golden", "validate", str(good)]) == 0
    (good / "items.jsonl").write_text('{"id": "a", "prompt": "", "reference": "r"}\n')
    assert cli(["golden", "validate", str(good)]) == 1
    assert f"{good / 'items.jsonl'}:1: empty 'prompt'" in capsys.readouterr().err
    assert cli(["golden", "--root", str(REPO_SETS), "validate"]) == 0
    capsys.readouterr()
    assert cli(["golden", "--root", str(REPO_SETS), "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"]: r["items"] for r in rows}["legal-clauses"] >= 50
    assert cli(["golden", "--root", str(REPO_SETS), "export", "code"]) == 0
    exported = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    code = load_golden_set(REPO_SETS / "code")
    assert [(e["prompt"], e["reference"]) for e in exported] == code.pairs()
    assert exported[0]["prompt"] == f"Task: {code.items[0].prompt}\nAnswer:\n"


def test_a_directory_without_a_manifest_under_the_root_is_named_as_skipped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_set(tmp_path)
    (tmp_path / "draft").mkdir()
    (tmp_path / ".hidden").mkdir()
    assert cli(["golden", "--root", str(tmp_path), "validate"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{tmp_path / 'draft'}: skipped, no manifest.yaml (not a golden set)"]
    assert cli(["golden", "--root", str(tmp_path), "list", "--json"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out)) == 1 and "draft: skipped" in out.err


def test_cli_root_after_the_subcommand_and_a_missing_root_is_named(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["golden", "validate", "--root", str(REPO_SETS)]) == 0  # was "unrecognized arguments: --root"
    assert capsys.readouterr().out.count(": ok") == len(list_golden_sets(REPO_SETS))
    assert cli(["golden", "validate", "--root", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err.strip() == f"no golden sets found under {tmp_path / 'nope'}: no such directory"
    assert cli(["golden", "--root", str(tmp_path), "validate"]) == 1
    assert "no set directories (with manifest.yaml) in it" in capsys.readouterr().err


def test_cli_validate_with_a_file_as_root_says_it_is_not_a_directory(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # it said "no such directory" of a file that is there (`golden list` already said "not a directory")
    afile = tmp_path / "sets.yaml"
    afile.write_text("x: 1\n")
    assert cli(["golden", "validate", "--root", str(afile)]) == 1
    assert capsys.readouterr().err.strip() == f"no golden sets found under {afile}: not a directory"
