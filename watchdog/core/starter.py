"""Where the starter files live: ``policies/``, ``golden_sets/`` and ``config.example.yaml``.

From the wheel they are package data under ``watchdog/starter/`` (copied there by setup.py at
build time); in a checkout they are the repository's own folders.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGED = Path(__file__).resolve().parents[1] / "starter"
_REPO = Path(__file__).resolve().parents[2]


class InitError(RuntimeError):
    """The starter files are missing or the target would be overwritten."""


def starter_path(name: str) -> Path:
    """Path of a starter item: ``policies``, ``golden_sets`` or ``config.example.yaml``."""
    packaged = _PACKAGED / name
    if packaged.exists():
        return packaged
    repo = _REPO / ("deploy/config.example.yaml" if name == "config.example.yaml" else name)
    if repo.exists():
        return repo
    raise InitError(f"starter file {name} is missing from this installation ({packaged})")
