"""A YAML loader for files an operator (or an attacker with write access to a config map) hands us.

PyYAML's ``safe_load`` expands aliases without limit (a "billion laughs" file grows past 4 GB),
recurses once per nesting level (about 500 levels raise ``RecursionError``) and ignores unknown
tags on mappings and sequences. Here the node tree is composed from PyYAML's event stream by a loop
(no recursion), and the file is refused, with the ``line:col`` of the cause, when it is

- larger than ``max_bytes`` (checked before anything is parsed),
- nested deeper than ``max_depth``,
- larger than ``max_nodes`` nodes once every alias is expanded (sizes are added up, never expanded),
- tagged with anything but the core tags (``!!str``, ``!!int``, ``!!float``, ``!!bool``,
  ``!!null``, ``!!seq``, ``!!map``; ``!!python/...`` and custom ``!tags`` are refused),
- holding a number that is not finite (``.nan``, ``.inf``, ``1e999``) or an integer beyond 64 bits,
- or more than one document.

An alias may only refer to a node that is complete, so self-referencing structures are refused too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    DocumentEndEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
    StreamStartEvent,
)
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_CORE = "tag:yaml.org,2002:"
ALLOWED_TAGS = frozenset(_CORE + t for t in ("str", "int", "float", "bool", "null", "seq", "map"))
#: implicit tags the resolver may give plain scalars / keys besides the core ones
_IMPLICIT_OK = ALLOWED_TAGS | {_CORE + "timestamp", _CORE + "merge"}
_INT_LIMIT = 2**63
#: libyaml's parser when PyYAML was built with it (about 10x faster); the events are the same
_Loader: Any = getattr(yaml, "CSafeLoader", None) if getattr(yaml, "__with_libyaml__", False) else None
_Loader = _Loader or yaml.SafeLoader


@dataclass(frozen=True, slots=True)
class Limits:
    #: a policy/config/manifest file larger than this is refused before parsing
    max_bytes: int = 1_048_576
    #: nesting levels of mappings and sequences
    max_depth: int = 64
    #: nodes after alias expansion (a 1 MiB file of plain YAML has well under 200k nodes)
    max_nodes: int = 200_000
    #: alias uses (``*name``) in one file
    max_aliases: int = 1_000


DEFAULT_LIMITS = Limits()


class SafeYamlError(yaml.MarkedYAMLError, ValueError):
    """A refused or malformed YAML file; ``line``/``col`` are 1-based. It is a
    ``yaml.MarkedYAMLError`` (``problem``, ``problem_mark``), so code that handled PyYAML's errors
    handles it unchanged."""

    def __init__(self, line: int, col: int, message: str) -> None:
        super().__init__(problem=message, problem_mark=yaml.Mark("<yaml>", 0, line - 1, col - 1, None, 0))
        self.line = line
        self.col = col
        self.message = message

    def __str__(self) -> str:
        return f"{self.line}:{self.col}: {self.message}"


def _at(mark: Any, message: str) -> SafeYamlError:
    if mark is None:
        return SafeYamlError(1, 1, message)
    return SafeYamlError(mark.line + 1, mark.column + 1, message)


def _show_tag(tag: str) -> str:
    return "!!" + tag[len(_CORE):] if tag.startswith(_CORE) else tag


def check_size(size: int, limits: Limits = DEFAULT_LIMITS) -> None:
    if size > limits.max_bytes:
        raise SafeYamlError(1, 1, f"file is {size:,} bytes; the limit is {limits.max_bytes:,} bytes")


def read_text(path: str | os.PathLike[str], limits: Limits = DEFAULT_LIMITS) -> str:
    """Read a UTF-8 file, refusing one over ``limits.max_bytes`` without reading it all, and one
    that is not UTF-8 with the line and column of its first bad byte (``SafeYamlError``)."""
    p = Path(path)
    with p.open("rb") as fh:
        check_size(os.fstat(fh.fileno()).st_size, limits)
        raw = fh.read(limits.max_bytes + 1)
    check_size(len(raw), limits)  # a file that grew (or a pipe) between stat and read
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = raw.rfind(b"\n", 0, exc.start) + 1
        raise SafeYamlError(raw.count(b"\n", 0, exc.start) + 1, exc.start - line_start + 1,
                            f"not UTF-8: byte 0x{raw[exc.start]:02x} ({exc.reason}); save the file as UTF-8") from None


class _Open:
    """A mapping or sequence being composed: its node, expanded size so far and pending key."""

    __slots__ = ("node", "size", "key", "anchor")

    def __init__(self, node: Node, anchor: str | None) -> None:
        self.node = node
        self.size = 1
        self.key: Node | None = None
        self.anchor = anchor


def compose(text: str, limits: Limits = DEFAULT_LIMITS) -> Node | None:
    """Compose one YAML document into PyYAML nodes under ``limits``; None for an empty file.

    Raises ``SafeYamlError``. The nodes are the ones ``yaml.compose`` would build, so position
    information (``start_mark``) is kept for error messages."""
    check_size(len(text.encode("utf-8")) if not text.isascii() else len(text), limits)
    loader = _Loader(text)
    try:
        return _compose(loader, limits)
    except SafeYamlError:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        raise _at(mark, f"YAML syntax error: {exc.problem or exc}{_syntax_hint(text, mark)}") from None
    except yaml.YAMLError as exc:
        raise SafeYamlError(1, 1, f"YAML error: {exc}") from None
    finally:
        loader.dispose()


def _syntax_hint(text: str, mark: Any) -> str:
    """What PyYAML's message leaves out: a tab is "found character that cannot start any token", and an
    unquoted ``${VAR}`` in a flow collection is "did not find expected ','" (its ``{`` opens a mapping)."""
    if mark is None:
        return ""
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    if line[mark.column:mark.column + 1] == "\t":
        return "; a tab: YAML indents with spaces only"
    if mark.column > 0 and line[mark.column - 1:mark.column + 1] == "${":
        return "; quote a ${VAR} inside [...] or {...}: '${VAR}'"
    return ""


def _compose(loader: Any, limits: Limits) -> Node | None:
    first = loader.get_event()  # StreamStartEvent
    if loader.check_event(StreamEndEvent):
        return None
    doc_start = loader.get_event()
    if not isinstance(first, StreamStartEvent) or not isinstance(doc_start, DocumentStartEvent):  # pragma: no cover
        raise SafeYamlError(1, 1, "not a YAML document")
    anchors: dict[str, tuple[Node, int]] = {}
    stack: list[_Open] = []
    aliases = 0
    root: Node | None = None
    total = 0
    while True:
        ev: Any = loader.get_event()
        start: Any = ev.start_mark  # typed loosely: the stubs mix the C and Python Mark classes
        end: Any = ev.end_mark
        node: Node
        if isinstance(ev, DocumentEndEvent):
            break
        if isinstance(ev, AliasEvent):
            aliases += 1
            if aliases > limits.max_aliases:
                raise _at(ev.start_mark, f"more than {limits.max_aliases} aliases")
            if ev.anchor not in anchors:
                raise _at(ev.start_mark, f"alias '*{ev.anchor}' refers to no complete anchored node "
                                         "(undefined, or a structure that contains itself)")
            node, size = anchors[ev.anchor]
            total += size
        elif isinstance(ev, ScalarEvent):
            tag = _tag(loader, ScalarNode, ev)
            node = ScalarNode(tag, ev.value, start, end, style=ev.style)
            size = 1
            total += 1
            if ev.anchor is not None:
                anchors[ev.anchor] = (node, 1)
        elif isinstance(ev, SequenceStartEvent | MappingStartEvent):
            if len(stack) >= limits.max_depth:
                raise _at(ev.start_mark, f"nested deeper than {limits.max_depth} levels")
            if isinstance(ev, SequenceStartEvent):
                tag = _tag(loader, SequenceNode, ev)
                cnode: Node = SequenceNode(tag, [], start, None, flow_style=ev.flow_style)
            else:
                tag = _tag(loader, MappingNode, ev)
                cnode = MappingNode(tag, [], start, None, flow_style=ev.flow_style)
            stack.append(_Open(cnode, ev.anchor))
            total += 1
            if total > limits.max_nodes:
                raise _at(ev.start_mark, f"more than {limits.max_nodes:,} nodes")
            continue
        elif isinstance(ev, SequenceEndEvent | MappingEndEvent):
            done = stack.pop()
            done.node.end_mark = end
            if isinstance(done.node, MappingNode) and done.key is not None:  # pragma: no cover - parser guarantees pairs
                raise _at(ev.start_mark, "mapping key without a value")
            node, size = done.node, done.size
            if done.anchor is not None:
                anchors[done.anchor] = (node, size)
        else:  # pragma: no cover - the parser emits nothing else inside a document
            raise _at(ev.start_mark, f"unexpected YAML event {type(ev).__name__}")
        if total > limits.max_nodes:
            raise _at(ev.start_mark, f"more than {limits.max_nodes:,} nodes once aliases are expanded "
                                     "(an alias bomb?)")
        if not stack:
            root = node
            continue
        parent = stack[-1]
        parent.size += size
        if isinstance(parent.node, SequenceNode):
            parent.node.value.append(node)
        elif parent.key is None:
            parent.key = node
        else:
            parent.node.value.append((parent.key, node))
            parent.key = None
    if not loader.check_event(StreamEndEvent):
        ev = loader.peek_event()
        raise _at(ev.start_mark, "expected a single YAML document, found another one")
    return root


def _tag(loader: Any, kind: type[Node], ev: Any) -> str:
    tag = ev.tag
    if tag is None or tag == "!":
        implicit = ev.implicit if isinstance(ev, ScalarEvent) else ev.implicit
        resolved: str = loader.resolve(kind, ev.value if isinstance(ev, ScalarEvent) else None, implicit)
        if resolved not in _IMPLICIT_OK:  # pragma: no cover - the safe resolver only knows core tags
            raise _at(ev.start_mark, f"tag '{_show_tag(resolved)}' is not allowed")
        return resolved
    if tag not in ALLOWED_TAGS:
        raise _at(ev.start_mark, f"tag '{_show_tag(tag)}' is not allowed (only the core tags "
                                 "!!str, !!int, !!float, !!bool, !!null, !!seq, !!map)")
    return str(tag)


def construct_scalar(ctor: yaml.SafeLoader, node: ScalarNode) -> Any:
    """The Python value of one scalar node; refuses non-finite floats and integers beyond 64 bits."""
    try:
        value = ctor.construct_object(node, deep=True)
    except (yaml.constructor.ConstructorError, ValueError, OverflowError) as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise _at(node.start_mark, f"cannot read value: {problem}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise _at(node.start_mark, f"number {node.value!r} is not finite")
    if isinstance(value, int) and not isinstance(value, bool) and not -_INT_LIMIT <= value < _INT_LIMIT:
        raise _at(node.start_mark, f"integer {node.value[:30]!r} is out of range (64 bits)")
    return value


def to_python(root: Node | None) -> Any:
    """Plain Python data for a node tree from ``compose`` (a loop, not recursion). Mapping keys
    must be scalars; a duplicate key is an error."""
    if root is None:
        return None
    ctor = yaml.SafeLoader("")
    try:
        return _build(root, ctor)
    finally:
        ctor.dispose()


def _build(root: Node, ctor: yaml.SafeLoader) -> Any:
    # children are built before their parent: an explicit post-order walk with a work stack
    built: dict[int, Any] = {}
    work: list[tuple[Node, bool]] = [(root, False)]
    while work:
        node, ready = work.pop()
        if id(node) in built:
            continue
        if isinstance(node, ScalarNode):
            if node.tag == _CORE + "merge":
                raise _at(node.start_mark, "YAML merge keys (<<) are not supported")
            built[id(node)] = construct_scalar(ctor, node)
            continue
        children: list[Node] = (list(node.value) if isinstance(node, SequenceNode)
                                else [n for pair in node.value for n in pair])
        if not ready:
            work.append((node, True))
            work.extend((c, False) for c in children if id(c) not in built)
            continue
        if isinstance(node, SequenceNode):
            built[id(node)] = [built[id(c)] for c in node.value]
        else:
            out: dict[Any, Any] = {}
            for k, v in node.value:
                if not isinstance(k, ScalarNode):
                    raise _at(k.start_mark, "mapping keys must be plain scalars")
                if k.tag == _CORE + "merge":
                    raise _at(k.start_mark, "YAML merge keys (<<) are not supported")
                key = built[id(k)]
                if key in out:
                    raise _at(k.start_mark, f"duplicate key '{key}'")
                out[key] = built[id(v)]
            built[id(node)] = out
    return built[id(root)]


def node_and_data(text: str, limits: Limits = DEFAULT_LIMITS) -> tuple[Node | None, Any]:
    """The node tree (for line:col of later errors) and the plain data of one document."""
    root = compose(text, limits)
    return root, to_python(root)


def load(text: str, limits: Limits = DEFAULT_LIMITS) -> Any:
    """``yaml.safe_load`` under ``limits``; raises ``SafeYamlError``."""
    return to_python(compose(text, limits))


def load_file(path: str | os.PathLike[str], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Read and load a YAML file; raises ``SafeYamlError`` (with line:col) or ``OSError``."""
    return load(read_text(path, limits), limits)
