"""The one way a config file is read: the bounded YAML loader, ``${VAR}`` placeholders, ``__``
environment overrides and pydantic errors that name ``file:line:col``.

The daemon's config (``watchdog.config.settings``), the gateway's section
(``watchdog.gateway.config``) and the LiteLLM hook's settings (``watchdog.integrations.litellm``) all
go through here, so a hostile or mistyped file gets the same limits and the same one-line errors
everywhere. The module needs only PyYAML and pydantic: the LiteLLM hook's separate distribution
copies it.

Placeholders: ``${VAR}`` and ``${VAR:-default}`` in any string value (``$${`` is a literal ``${``);
an unset variable without a default is an error naming it and its ``file:line:col``. A plain
(unquoted) value is typed after expansion, so ``port: ${PORT:-9464}`` is an integer.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from watchdog.config import yamlpos
from watchdog.config.yamlpos import PosDoc
from watchdog.core import safe_yaml
from watchdog.core.model_keys import unknown_key_message


class ConfigError(ValueError):
    """The configuration file or environment is invalid; ``str()`` is ready to print."""


_VAR_RE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand(value: str, env: Mapping[str, str], where: str) -> str:
    """Replace ``${VAR}`` / ``${VAR:-default}`` in ``value``; ``$${`` stays a literal ``${``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$${":
            return "${"
        body = m.group(1)
        name, sep, default = body.partition(":-")
        if not _NAME_RE.fullmatch(name):
            raise ConfigError(f"{where}: bad placeholder ${{{body}}} (use ${{VAR}} or ${{VAR:-default}})")
        if name in env and (env[name] != "" or not sep):
            return env[name]
        if sep:
            return default
        raise ConfigError(f"{where}: environment variable {name} is not set "
                          f"(set it, or write ${{{name}:-default}})")

    return _VAR_RE.sub(sub, value)


def _expand_nodes(root: yaml.Node, loader: yaml.SafeLoader, name: str, env: Mapping[str, str]) -> None:
    """Expand every placeholder; all the problems are reported together, in file order."""
    seen: set[int] = set()  # an alias shares its node: visit each once (no alias-bomb walk)
    problems: list[tuple[int, int, str]] = []
    work = [root]
    while work:
        node = work.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if "${" not in node.value:
                continue
            where = f"{name}:{node.start_mark.line + 1}:{node.start_mark.column + 1}"
            try:
                node.value = expand(node.value, env, where)
            except ConfigError as exc:
                problems.append((node.start_mark.line, node.start_mark.column, str(exc)))
                continue
            if node.style is None and node.tag == "tag:yaml.org,2002:str":  # plain: type the result
                node.tag = loader.resolve(yaml.ScalarNode, node.value, (True, False))
        elif isinstance(node, yaml.MappingNode):
            work.extend(value for _key, value in node.value)
        elif isinstance(node, yaml.SequenceNode):
            work.extend(node.value)
    if problems:
        raise ConfigError("\n".join(msg for _line, _col, msg in sorted(problems)))


def read_config_file(path: str | Path, env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], PosDoc]:
    """The file's mapping with placeholders expanded, and where every key and value sits in it."""
    name = str(path)
    env = os.environ if env is None else env
    loader = yaml.SafeLoader("")  # resolves the type of expanded plain scalars
    try:
        node = safe_yaml.compose(safe_yaml.read_text(path))
        if node is None:
            return {}, PosDoc(data={})
        _expand_nodes(node, loader, name, env)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from exc
    finally:
        loader.dispose()
    doc = yamlpos.from_node(node)
    if doc.errors:
        raise ConfigError("\n".join(f"{name}:{p.line}:{p.col}: invalid YAML: {msg}"
                                     for p, msg in sorted(doc.errors, key=lambda e: (e[0].line, e[0].col))))
    if not isinstance(doc.data, dict):
        raise ConfigError(f"{name}:1:1: the config must be a mapping")
    return doc.data, doc


def env_path(var: str, prefix: str) -> tuple[str, ...]:
    """The config path an override names: ``LLMWD_KAFKA__BOOTSTRAP_SERVERS`` (prefix ``LLMWD_``) ->
    ``("kafka", "bootstrap_servers")``; an empty part (``A____B``) stays empty for the caller to refuse."""
    return tuple(part.lower() for part in var[len(prefix):].split("__"))


def env_value(var: str, raw: str) -> Any:
    """An override's value: JSON when it starts with ``{`` or ``[`` (it replaces the whole value at
    its path) or ``"`` (a JSON string: how to write a value that starts with ``{``, such as a Redis
    Cluster hash-tag prefix ``'"{llmwd}"'``), else the string."""
    if raw.lstrip()[:1] in ("{", "[", '"'):
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"${var}: not valid JSON ({exc})") from exc
    return raw


def set_path(data: dict[str, Any], path: tuple[str, ...], value: Any, var: str, label: str = "") -> None:
    """Set ``data[path[0]]...[path[-1]] = value`` for the override ``var``, creating mappings on the way."""
    node: Any = data
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"${var}: {label}{'.'.join(path[:-1])} is not a mapping, cannot set {path[-1]}")
        node = child
    node[path[-1]] = value


def validate(model: type[BaseModel], data: dict[str, Any], name: str, doc: PosDoc | None,
             from_env: Mapping[tuple[Any, ...], str] | None = None, prefix: tuple[str, ...] = (),
             section: tuple[str, ...] | None = None) -> Any:
    """``model(**data)``, or a ConfigError with one line per problem at ``file:line:col`` (or at the
    environment variable that set the value). ``prefix`` is where ``data`` sits in the file,
    ``section`` how messages name it (default: ``prefix``)."""
    from_env = from_env or {}
    section = prefix if section is None else section
    try:
        return model(**data)
    except ValidationError as exc:
        label = "".join(f"{p}." for p in section)
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            env_var = next((from_env[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in from_env), None)
            where = f"${env_var}" if env_var else name
            if not env_var and doc is not None:  # a missing key: point at its parent's key
                pos = doc.pos((*prefix, *(loc[:-1] if err["type"] == "missing" else loc)), key=True)
                where = f"{name}:{pos.line}:{pos.col}"
            if err["type"] == "extra_forbidden":
                lines.append(f"{where}: {unknown_key_message(model, loc, section)}")
            else:
                lines.append(f"{where}: {label}{'.'.join(str(p) for p in loc) or 'config'}: {err['msg']}")
        raise ConfigError("\n".join(lines)) from exc
