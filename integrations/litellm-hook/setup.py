"""Build of ``fp8-watchdog-litellm``: the LiteLLM hook of fp8-watchdog under its own import name.

The source of truth is the main package (``watchdog/``, the same files the gateway and the daemon
run and the test suite, ruff and mypy check). Building this distribution in a checkout first
copies the modules in ``SOURCES`` to ``fp8_watchdog_litellm/_watchdog/`` (git-ignored), rewriting
``watchdog.`` imports to ``fp8_watchdog_litellm._watchdog.``, so the installed hook never imports
a top-level ``watchdog`` (in a LiteLLM environment that name is often PyPI's file-system library).
The copy is checked to be closed: a module in ``SOURCES`` that imports a project module missing
from ``SOURCES`` fails the build. Building from an sdist uses the copies it carries.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PACKAGE = "fp8_watchdog_litellm"
OUT = HERE / PACKAGE / "_watchdog"

#: the hook's modules in the main package, and everything they import from it (nothing else:
#: no policy engine, no daemon, no gateway server)
SOURCES = (
    "watchdog/integrations/litellm.py",
    "watchdog/ingest/emitter.py",
    "watchdog/core/brokers.py",
    "watchdog/core/events.py",
    "watchdog/core/truncation.py",
    "watchdog/core/keys.py",
    "watchdog/policy/names.py",
    "watchdog/actuation/routing.py",
    "watchdog/state/redis_conn.py",
    "watchdog/config/redact.py",
    "watchdog/config/yamlfile.py",
    "watchdog/config/yamlpos.py",
    "watchdog/core/safe_yaml.py",
    "watchdog/core/model_keys.py",
)
_IMPORT = re.compile(r"^(\s*)(from|import)\s+watchdog((?:\.\w+)*)\b", re.M)
_FROM_NAMES = re.compile(r"\s+import\s+(\w+(?:\s*,\s*\w+)*)\s*$", re.M)
_HEADER = ("# Generated from {src} by integrations/litellm-hook/setup.py at build time.\n"
           "# Edit {src} in the fp8-watchdog repository, not this copy.\n")


def rewrite(src: str, text: str) -> str:
    """``text`` of ``src`` with its project imports pointed at the copy; ValueError when it imports
    a project module that is not copied."""
    copied = {s[:-3].replace("/", ".") for s in SOURCES}

    def sub(m: re.Match[str]) -> str:
        target = "watchdog" + m.group(3)
        names = _FROM_NAMES.match(text, m.end()) if m.group(2) == "from" else None
        # ``from watchdog.core import safe_yaml`` imports the module watchdog.core.safe_yaml
        modules = [f"{target}.{n.strip()}" for n in names.group(1).split(",")] if names else []
        if target not in copied and not (modules and all(mod in copied for mod in modules)):
            raise ValueError(f"{src} imports {(modules or [target])[0]}, which is not in SOURCES of {__file__}")
        return f"{m.group(1)}{m.group(2)} {PACKAGE}._{target}"

    return _HEADER.format(src=src) + _IMPORT.sub(sub, text)


def generate(repo: Path = REPO, out: Path = OUT) -> list[Path]:
    """Write the copies (and empty ``__init__.py`` files) under ``out``; the paths written."""
    written = []
    for src in SOURCES:
        dest = out / Path(src).relative_to("watchdog")
        dest.parent.mkdir(parents=True, exist_ok=True)
        for d in [dest.parent, *dest.parent.parents]:
            if d == out.parent:
                break
            init = d / "__init__.py"
            if not init.exists():
                init.write_text(_HEADER.format(src="(package marker)"))
        text = rewrite(src, (repo / src).read_text(encoding="utf-8"))
        tmp = dest.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(dest)  # atomic: two builds at once see whole files
        written.append(dest)
    return written


def main() -> None:
    if (REPO / "watchdog" / "integrations" / "litellm.py").is_file():
        generate()
    elif not (OUT / "integrations" / "litellm.py").is_file():
        raise SystemExit(f"{OUT} is missing and no fp8-watchdog checkout is at {REPO}: build from the repository")
    setup()


if __name__ == "__main__":  # setuptools runs setup.py as __main__; tests import it for SOURCES/generate
    main()
