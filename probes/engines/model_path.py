"""A model path an engine is asked to load, checked in the project's words before any heavy import.

``transformers`` (and TensorRT-LLM's ``LLM``) take a string that is not an existing directory for a
Hugging Face Hub repo id; a mistyped local path then fails deep inside ``huggingface_hub`` with
"Repo id must be in the form ...". Here a path that does not exist and cannot be a repo id is named
as a missing path. A string in repo-id form (``org/name``) is left to the engine: it may be in the
local Hugging Face cache or on the Hub.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: huggingface_hub's repo id rule (``validate_repo_id``): ``name`` or ``namespace/name``, 96 characters
#: at most per part, letters, digits, ``-``, ``_`` and ``.``, no ``--`` or ``..``
_REPO_ID = re.compile(r"(?:[\w.-]{1,96}/)?[\w.-]{1,96}")


class ModelPathError(ValueError):
    """A model path that names no directory; ``str()`` is ready to print."""


def looks_like_repo_id(text: str) -> bool:
    return (bool(_REPO_ID.fullmatch(text)) and "--" not in text and ".." not in text
            and not text.startswith((".", "-")) and not text.endswith((".", "-")))


def check_model_path(model_path: str | os.PathLike[str]) -> None:
    """Raise ``ModelPathError`` for a path that does not exist (or is a file) and is no repo id, or for a
    directory without ``config.json``."""
    text = os.fspath(model_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():  # else transformers blames a tokenizer or sentencepiece
            raise ModelPathError(f"model path {text} has no config.json (give a model directory: a Hugging Face "
                                 "checkpoint or a TensorRT-LLM engine directory)")
        return
    if path.exists():
        raise ModelPathError(f"model path {text} is a file, not a model directory (one with config.json)")
    if text.startswith(("/", "~", "./", "../")) or not looks_like_repo_id(text):
        raise ModelPathError(f"model path {text} does not exist (give a local model directory with "
                             "config.json, or a Hugging Face repo id such as org/name)")


def files_fingerprint(path: str | os.PathLike[str], limit: int = 64) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the entries of directory ``path`` (at most ``limit``, by name), or of the
    file itself: a model or calibration replaced or re-saved at the same path changes it. ``OSError`` when
    it cannot be read."""
    p = Path(path)
    entries = sorted(p.iterdir())[:limit] if p.is_dir() else [p]
    return [(f.name, st.st_size, st.st_mtime_ns) for f in entries for st in (f.stat(),)]
