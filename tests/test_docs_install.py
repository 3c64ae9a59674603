"""Issue 20 §7: the docs install this project as ``fp8-watchdog`` (or its LiteLLM hook as
``fp8-watchdog-litellm``), never as ``llm-watchdog``, an unrelated project's name on PyPI."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("integrations/*/README.md"))]
#: a pip/uv/pipx install naming llm-watchdog as a requirement (not a file or folder)
WRONG = re.compile(r"\b(?:pip3?|pipx|uv pip)\s+install\b[^\n`]*?(?<![\w./-])['\"]?llm[-_]watchdog\b", re.I)


def test_no_doc_installs_the_unrelated_llm_watchdog_project() -> None:
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in DOCS
           for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if WRONG.search(line)]
    assert not bad, "\n".join(bad)
    assert WRONG.search("pip install 'llm-watchdog[gateway]'") and WRONG.search("pip install llm_watchdog")
    assert not WRONG.search('pip install "$(ls dist/fp8_watchdog-*.whl)[gateway]"')
    assert not WRONG.search("pip install ./integrations/litellm-hook")


def test_no_hint_in_the_code_installs_it_either() -> None:
    """The demo's "part skipped" hint said pip install 'llm-watchdog[torch,gateway]' (issue 20 §7 looked
    at the docs only)."""
    sources = [p for d in ("watchdog", "probes", "integrations") for p in sorted((ROOT / d).rglob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sources
           for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if WRONG.search(line)]
    assert not bad, "\n".join(bad)
