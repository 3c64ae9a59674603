"""Doc lines that quote the shipped tools or cite tests are true: the backtest example in
docs/POLICIES.md is what the tool prints, and every test file the docs and deploy files cite exists."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cited_test_file_exists() -> None:
    files = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *(p for p in ROOT.glob("deploy/**/*") if p.is_file())]
    cited = {(f.relative_to(ROOT), m) for f in files
             for m in re.findall(r"tests/[\w/]+\.py", f.read_text(errors="replace"))}
    assert cited, "no citations found: the pattern is wrong"
    assert sorted((str(f), m) for f, m in cited if not (ROOT / m).exists()) == []


def test_the_systemd_unit_cites_the_test_that_checks_it() -> None:
    unit = (ROOT / "deploy/systemd/llm-watchdog.service").read_text()
    cited = re.search(r"systemd-analyze verify` \((tests/\w+\.py)\)", unit)
    assert cited and "systemd-analyze" in (ROOT / cited.group(1)).read_text()


def test_the_policies_backtest_example_is_what_the_tool_prints() -> None:
    doc = (ROOT / "docs/POLICIES.md").read_text()
    block = doc[doc.index("$ llm-watchdog policy backtest --policy policies/ --events tests/data/"):]
    block = block[:block.index("```")]
    lines = block.splitlines()
    command_text = ""
    for line in lines:  # the command, with its continuation lines
        command_text += line.removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            break
    command = shlex.split(command_text.removeprefix("$ "))
    assert command[:3] == ["llm-watchdog", "policy", "backtest"]
    args = [a for i, a in enumerate(command[1:]) if a != "--png" and command[i] != "--png"]
    out = subprocess.run([sys.executable, "-m", "watchdog.cli.main", *args, "--json"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["actions"], "the tool finds no action"
    text = " ".join(" ".join(lines).split())  # the doc's wrapped lines as one
    for a in result["actions"]:
        head = f"{a['model']}/{a['route']} {a['kind'].upper()} -> {a['precision']} ({a['severity']})"
        assert head in text, head
        assert f"policy {a['policy']}, rule {a['rule']}" in text
        assert " ".join(a["reason"].split()) in text
    summary = next(line for line in lines if " flip" in line and "alerts" in line)
    assert summary.startswith(f"{result['flips']} flip{'s' if result['flips'] != 1 else ''}, {result['alerts']} alerts")
    assert "n=859" not in doc
