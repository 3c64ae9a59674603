"""Load YAML into plain Python while remembering where every key and value sits in the file.

PyYAML's ``compose`` keeps start marks on every node; we walk the node tree ourselves so that a
later validation error (a pydantic ``loc`` such as ``("policies", 0, "rules", 2, "metric")``)
can be reported as ``file:line:col``. Duplicate mapping keys, which PyYAML silently accepts, are
reported as errors here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

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


def load_with_positions(text: str) -> PosDoc:
    """Parse one YAML document. Raises ``YamlSyntaxError`` on malformed YAML."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        pos = Pos(mark.line + 1, mark.column + 1) if mark else Pos(1, 1)
        raise YamlSyntaxError(pos, f"YAML syntax error: {exc.problem or exc}") from None
    finally:
        loader.dispose()
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
        return ctor.construct_object(node, deep=True)
    except yaml.constructor.ConstructorError as exc:
        doc.errors.append((_pos(node), f"cannot read value: {exc.problem}"))
        return None
