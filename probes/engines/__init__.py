"""Engine registry: ``get_engine(kind, **options)`` with lazy import of heavy backends.

A backend module registers its class with ``@register(kind)`` when it is imported; ``get_engine``
imports only the module of the requested kind, so asking for ``openai`` never imports torch and
asking for ``torch`` never imports tensorrt_llm.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any, TypeVar

from probes.engines.base import Engine, Generation, ReferenceScore

__all__ = ["Engine", "Generation", "ReferenceScore", "UnknownEngineError", "available_kinds",
           "check_engine", "get_engine", "register"]

#: kind -> module that registers it (imported on first use)
_MODULES: dict[str, str] = {
    "torch": "probes.engines.torch_engine",
    "openai": "probes.engines.openai_engine",
    "tensorrt_llm": "probes.engines.tensorrt_llm_engine",
}
_REGISTRY: dict[str, Callable[..., Engine]] = {}
#: kind -> (the libraries its engines import when built, how to get them)
_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "torch": (("torch", "transformers"), "pip install 'fp8-watchdog[torch]'"),
    "tensorrt_llm": (("tensorrt_llm",), "NVIDIA's tensorrt_llm wheel on a GPU host, docs/ENGINES.md"),
}

T = TypeVar("T")


class UnknownEngineError(ValueError):
    pass


def register(kind: str) -> Callable[[T], T]:
    """Class decorator: make ``kind`` build this engine class. Duplicate kinds are rejected."""

    def deco(cls: T) -> T:
        existing = _REGISTRY.get(kind)
        if existing is not None and existing is not cls:
            raise ValueError(f"engine kind {kind!r} is already registered by {existing!r}")
        _REGISTRY[kind] = cls  # type: ignore[assignment]
        return cls

    return deco


def available_kinds() -> list[str]:
    return sorted(set(_MODULES) | set(_REGISTRY))


def get_engine(kind: str, **options: Any) -> Engine:
    """Build an engine of ``kind`` with backend-specific options."""
    factory = _factory(kind)
    _check_options(kind, factory, options)
    return factory(**options)


def check_engine(kind: str, **options: Any) -> None:
    """What ``get_engine`` would refuse, found before building anything: an unknown kind
    (``UnknownEngineError``), an option the engine does not take, or a library its engines import that
    is not installed (``ValueError``). Imports the backend's module, which imports no heavy library
    (torch, tensorrt_llm) until an engine is built; the libraries are looked up, not imported."""
    _check_options(kind, _factory(kind), options)
    libs, how = _NEEDS.get(kind, ((), ""))
    missing = [lib for lib in libs if not _installed(lib)]
    if missing:
        raise ValueError(f"engine {kind!r} needs {', '.join(missing)}, not installed here ({how})")


def _installed(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _factory(kind: str) -> Callable[..., Engine]:
    if kind not in _REGISTRY:
        module = _MODULES.get(kind)
        if module is None:
            close = difflib.get_close_matches(kind, available_kinds(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownEngineError(f"unknown engine kind {kind!r} (known: {', '.join(available_kinds())}){hint}")
        importlib.import_module(module)
    return _REGISTRY[kind]


def _check_options(kind: str, factory: Callable[..., Engine], options: dict[str, Any]) -> None:
    """An option the engine does not take is a ``ValueError`` naming it, the close match and the
    options there are (``-o modelpath=...`` used to end in ``__init__() got an unexpected keyword``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: let the engine decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [name for name, p in params.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"engine {kind!r} has no option {key!r} ({hint}options: {', '.join(known)})")
        _check_value(kind, key, params[key].annotation, options[key])


#: annotation (a string under ``from __future__ import annotations``) -> (converter, what to call it)
_NUMBERS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "int": (int, "an integer"), "int | None": (int, "an integer"),
    "float": (float, "a number"), "float | None": (float, "a number"),
}


#: boolean text the engines read (``torch_engine._flag``); options annotated ``bool | str`` also take "auto"
TRUE_TEXT = ("1", "true", "yes", "on")
FALSE_TEXT = ("0", "false", "no", "off")


def _check_value(kind: str, key: str, annotation: Any, value: Any) -> None:
    """A numeric option given something that is no number (``-o max_batch_tokens=x``) is named here, not
    as ``invalid literal for int()`` or a ``TypeError`` once a batch grows. Digits in a string pass: the
    engines convert them. A boolean option given other text (``-o logprobs=ture``, which a plain ``bool``
    parameter would take as true) is named here too."""
    if annotation == "bool" and not isinstance(value, bool):
        raise ValueError(f"engine {kind!r} option {key!r} must be true or false, not {value!r}")
    if annotation == "bool | str" and not isinstance(value, bool):
        if not (isinstance(value, str) and value.strip().lower() in (*TRUE_TEXT, *FALSE_TEXT, "auto")):
            raise ValueError(f"engine {kind!r} option {key!r} must be auto, true or false, not {value!r}")
        return
    number = _NUMBERS.get(annotation) if isinstance(annotation, str) else None
    if number is None or value is None:
        return
    convert, what = number
    try:
        if isinstance(value, bool):  # int(True) is 1: -o batch_size=yes is a typo, not one
            raise TypeError(value)
        convert(value)
    except (TypeError, ValueError):
        raise ValueError(f"engine {kind!r} option {key!r} must be {what}, not {value!r}") from None
