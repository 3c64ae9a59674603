"""Load YAML into plain Python while remembering where every key and value sits in the file.

PyYAML's ``compose`` keeps start marks on every node; we walk the node tree ourselves so that a
later validation error (a pydantic ``loc`` such as ``("policies", 0, "rules", 2, "metric")``)
can be reported as ``file:line:col``. Duplicate mapping keys, which PyYAML silently accepts, are
reported as errors here. Composition goes through ``watchdog.core.safe_yaml`` (size, depth, alias and
tag limits), so the walk below is bounded by ``safe_yaml.Limits``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from watchdog.core import safe_yaml

Path_ = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Pos:
    """A 1-based line and column in a file; ``style`` is the scalar quote style (None = plain)."""

    line: int
    col: int
    style: str | None = None
    single_line: bool = True


@dataclass(slots=True)
class PosDoc:
    """A loaded document: the plain data plus value and key positions by path."""

    data: Any
    values: dict[Path_, Pos] = field(default_factory=dict)
    keys: dict[Path_, Pos] = field(default_factory=dict)
    errors: list[tuple[Pos, str]] = field(default_factory=list)

    def pos(self, path: Path_, *, key: bool = False) -> Pos:
        """The position of ``path`` (its key if ``key``), or of its nearest known ancestor."""
        p = tuple(path)
        if key and p in self.keys:
            return self.keys[p]
        while p:
            if p in self.values:
                return self.values[p]
            p = p[:-1]
        return self.values.get((), Pos(1, 1))


class YamlSyntaxError(Exception):
    def __init__(self, pos: Pos, message: str) -> None:
        super().__init__(message)
        self.pos = pos
        self.message = message


def _pos(node: yaml.Node) -> Pos:
    m = node.start_mark
    style = getattr(node, "style", None) if isinstance(node, yaml.ScalarNode) else None
    single = node.start_mark.line == node.end_mark.line
    return Pos(m.line + 1, m.column + 1, style, single)


def load_with_positions(text: str, limits: safe_yaml.Limits = safe_yaml.DEFAULT_LIMITS) -> PosDoc:
    """Parse one YAML document. Raises ``YamlSyntaxError`` on malformed or refused YAML."""
    try:
        root = safe_yaml.compose(text, limits)
    except safe_yaml.SafeYamlError as exc:
        raise YamlSyntaxError(Pos(exc.line, exc.col), exc.message) from None
    return from_node(root)


def from_node(root: yaml.Node | None) -> PosDoc:
    """The data and positions of a node tree from ``safe_yaml.compose`` (which bounds its size),
    e.g. one whose scalars the caller rewrote first (the daemon config expands ``${VAR}``)."""
    doc = PosDoc(data=None)
    if root is None:
        return doc
    ctor = yaml.SafeLoader("")
    try:
        doc.data = _walk(root, (), doc, ctor)
    finally:
        ctor.dispose()
    return doc


def _walk(node: yaml.Node, path: Path_, doc: PosDoc, ctor: yaml.SafeLoader) -> Any:
    doc.values[path] = _pos(node)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                doc.errors.append((_pos(key_node), "YAML merge keys (<<) are not supported"))
                continue
            key = _walk(key_node, (*path, "\0key"), doc, ctor)
            if not isinstance(key, str | int | float | bool) or key is None:
                doc.errors.append((_pos(key_node), "mapping keys must be plain strings"))
                continue
            skey = str(key)
            if skey in out:
                doc.errors.append((_pos(key_node), f"duplicate key '{skey}'"))
                continue
            doc.keys[(*path, skey)] = _pos(key_node)
            out[skey] = _walk(value_node, (*path, skey), doc, ctor)
        doc.values.pop((*path, "\0key"), None)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(item, (*path, i), doc, ctor) for i, item in enumerate(node.value)]
    try:
        return safe_yaml.construct_scalar(ctor, node)  # type: ignore[arg-type]
    except safe_yaml.SafeYamlError as exc:
        doc.errors.append((_pos(node), exc.message))
        return None
