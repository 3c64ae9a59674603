"""``init DIR``: write a starter config, the shipped policies and golden sets into DIR.

The files come from the wheel (``watchdog/starter/``, copied there by setup.py at build time)
or, in a checkout, from the repository (``policies/``, ``golden_sets/``,
``deploy/config.example.yaml``). The config written starts as-is against ``embedded``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from watchdog.core.starter import InitError, starter_path


def starter_config() -> str:
    """The example config with its policy path pointing at ``policies/`` beside it."""
    text = starter_path("config.example.yaml").read_text()
    return (text.replace("  - ../policies/default.yaml", "  - policies/default.yaml")
            .replace("run --config deploy/config.example.yaml", "run --config DIR/config.yaml"))


def init_dir(target: str | Path, *, force: bool = False) -> list[Path]:
    """Write ``config.yaml``, ``policies/`` and ``golden_sets/`` under ``target``; returns what was
    written. Refuses to overwrite an existing file unless ``force``."""
    root = Path(target)
    if root.exists() and not root.is_dir():
        raise InitError(f"{root} exists and is not a directory")
    plan: list[tuple[Path, Path | None]] = [(root / "config.yaml", None)]
    for name in ("policies", "golden_sets"):
        src = starter_path(name)
        for f in sorted(src.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                plan.append((root / name / f.relative_to(src), f))
    existing = [dst for dst, _ in plan if dst.exists()]
    if existing and not force:
        raise InitError(f"{existing[0]} exists ({len(existing)} file(s) would be overwritten; use --force)")
    for dst, origin in plan:
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            if origin is None:
                dst.write_text(starter_config())
            else:
                shutil.copyfile(origin, dst)
        except OSError as exc:
            raise InitError(f"cannot write {dst}: {exc.strerror or exc}") from exc
    return [dst for dst, _ in plan]
