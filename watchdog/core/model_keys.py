"""Which keys a pydantic model allows at a validation error's ``loc``: the "did you mean" of an
unknown key in a config or policy file."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel


def allowed_keys(model: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """Walk the model classes along ``loc`` to find which keys are allowed where an extra one is
    (``loc[-1]``); [] when the path leaves the models (a free-form mapping)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        fld = current.model_fields.get(part) if hasattr(current, "model_fields") else None
        if fld is None:
            for f in getattr(current, "model_fields", {}).values():
                if f.alias == part:
                    fld = f
        if fld is None:
            return []
        current = model_in(fld.annotation)
        if current is None:
            return []
    fields = getattr(current, "model_fields", {})
    return [f.alias or n for n, f in fields.items()]


def model_in(ann: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()) or ():
        found = model_in(arg)
        if found is not None:
            return found
    origin = getattr(ann, "__origin__", None)
    if origin is not None and origin is not ann:
        return model_in(origin)
    return None


def unknown_key_message(model: type[BaseModel], loc: Sequence[str | int], prefix: Sequence[str] = ()) -> str:
    """``unknown key 'brokr' in kafka (did you mean 'brokers'?)``, or the allowed keys when none is
    close; ``prefix`` names the section ``model`` sits in (``("gateway",)``)."""
    key = str(loc[-1])
    parent = ".".join(str(p) for p in (*prefix, *loc[:-1]))
    allowed = allowed_keys(model, loc)
    close = difflib.get_close_matches(key, allowed, n=1)
    msg = f"unknown key '{key}'" + (f" in {parent}" if parent else " at the top level")
    if close:
        return f"{msg} (did you mean '{close[0]}'?)"
    return f"{msg}; allowed here: {', '.join(sorted(allowed))}" if allowed else msg
