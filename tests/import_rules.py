"""Which way imports may point, checked on source text (``ast``, no import is executed).

``check(root)`` parses every module of ``root/watchdog`` and ``root/probes`` and returns the
violations of these rules, each naming ``file:line`` and the rule:

* ``rank``: a room is the first folder under ``watchdog/`` (``watchdog/policy/judge/x.py`` is in
  ``policy``), or ``probes``. Rooms are ranked (``RANKS``); a lower room never imports a higher one,
  and two rooms of the same rank never import each other.
* ``probes``: ``probes/`` imports nothing of ``watchdog`` but ``watchdog.core``.
* ``cycle``: no import cycle between modules. Every import counts, at module level or inside a
  function or an ``if TYPE_CHECKING:`` block: a function-local import only moves the circle to run
  time.
* ``private``: no ``from x import _name`` of a project module other than the importing one (dunder
  names are not private).
* ``runtime-dev``: nothing in ``watchdog/runtime/`` imports ``watchdog.dev``.

Imports of modules outside ``watchdog`` and ``probes`` (stdlib, third party) are not checked.
Imports made from a string (``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: room -> rank; a room may import rooms of a lower rank and itself only
RANKS: dict[str, int] = {
    "core": 0,
    "config": 1,
    "probes": 2,
    "windows": 3, "ingest": 3, "alerting": 3,
    "policy": 4,
    "state": 5,
    "actuation": 6, "sources": 6,
    "runtime": 7, "gateway": 7,
    "integrations": 8,
    "dev": 9,
    "cli": 10,
}
PACKAGES = ("watchdog", "probes")


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module (or name of a module) as written at ``file:line``."""

    importer: str  # dotted module that imports
    file: str  # path relative to the root, with forward slashes
    line: int
    target: str  # the dotted module imported (resolved to a module of the tree when it is one)
    names: tuple[str, ...] = ()  # for ``from target import a, b``: the names


@dataclass(frozen=True, slots=True)
class Violation:
    file: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.message}"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    """``probes`` for anything in probes, the first folder under ``watchdog``; None for the bare
    ``watchdog`` package and for modules outside the project."""
    parts = module.split(".")
    if parts[0] == "probes":
        return "probes"
    if parts[0] == "watchdog" and len(parts) > 1:
        return parts[1]
    return None


def _in_project(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def modules(root: Path) -> dict[str, Path]:
    """Every module of the project under ``root``: dotted name -> file."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        base = root / pkg
        if base.is_dir():
            for path in sorted(base.rglob("*.py")):
                out[module_name(root, path)] = path
    return out


def imports_of(root: Path, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """Every project import in ``path``, wherever it stands in the file."""
    me = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_project(alias.name):
                    yield Import(me, rel, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = me.split(".") if is_pkg else me.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _in_project(source):
                continue
            names = tuple(a.name for a in node.names)
            submodules = [n for n in names if f"{source}.{n}" in known]
            if submodules:  # ``from pkg import module``: an import of that module
                for n in submodules:
                    yield Import(me, rel, node.lineno, f"{source}.{n}", (n,))
            rest = tuple(n for n in names if n not in submodules)
            if rest or not submodules:
                yield Import(me, rel, node.lineno, source, rest)


def _resolve(target: str, known: dict[str, Path]) -> str | None:
    """The module of the tree that ``target`` names (its longest known prefix), or None."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in known:
            return name
        parts.pop()
    return None


def _rule_violations(imp: Import, known: dict[str, Path]) -> Iterator[Violation]:
    src, dst = room_of(imp.importer), room_of(imp.target)
    where = (imp.file, imp.line)
    if src == "probes" and imp.target.split(".")[0] == "watchdog" and dst not in ("core",):
        yield Violation(*where, "probes", f"{imp.importer} imports {imp.target}: probes may import watchdog.core only")
    if src == "runtime" and dst == "dev":
        yield Violation(*where, "runtime-dev", f"{imp.importer} imports {imp.target}: the daemon never runs dev tooling")
    if src is not None and dst is not None and src != dst:
        if src not in RANKS or dst not in RANKS:
            unknown = src if src not in RANKS else dst
            yield Violation(*where, "rank", f"room {unknown!r} has no rank; add it to RANKS (tests/import_rules.py)")
        elif RANKS[src] < RANKS[dst]:
            yield Violation(*where, "rank", f"{imp.importer} imports {imp.target}: {src} (rank {RANKS[src]}) may not "
                                            f"import the higher {dst} (rank {RANKS[dst]})")
        elif RANKS[src] == RANKS[dst]:
            yield Violation(*where, "rank", f"{imp.importer} imports {imp.target}: {src} and {dst} share rank "
                                            f"{RANKS[src]} and may not import each other")
    target = _resolve(imp.target, known)
    if target is not None and target != imp.importer:
        for n in imp.names:
            if n.startswith("_") and not (n.startswith("__") and n.endswith("__")):
                yield Violation(*where, "private", f"{imp.importer} imports the private {n} of {target}")


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[Import]]:
    """One cycle (as its imports, in order) per strongly connected component of the graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # Tarjan, iterative over each node's successors
        work = [(v, iter(sorted(edges.get(v, {}))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, succ = work[-1]
            for w in succ:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, {})))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    components.append(comp)

    for v in sorted(edges):
        if v not in index:
            connect(v)
    out: list[list[Import]] = []
    for comp in components:
        members = set(comp)
        if len(comp) == 1 and comp[0] not in edges.get(comp[0], {}):
            continue
        # a shortest way back to the first member, inside the component
        start = min(comp)
        prev: dict[str, tuple[str, Import]] = {}
        queue = [start]
        found: str | None = None
        while queue and found is None:
            nxt = []
            for node in queue:
                for w, imp in sorted(edges.get(node, {}).items()):
                    if w == start:
                        found = node
                        prev[start] = (node, imp)
                        break
                    if w in members and w not in prev:
                        prev[w] = (node, imp)
                        nxt.append(w)
                if found is not None:
                    break
            queue = nxt
        path: list[Import] = []
        node = start
        while True:
            parent, imp = prev[node]
            path.append(imp)
            node = parent
            if node == start:
                break
        out.append(list(reversed(path)))
    return out


def check(root: Path) -> list[Violation]:
    """Every violation of the import rules in the project under ``root``."""
    known = modules(root)
    found: list[Violation] = []
    edges: dict[str, dict[str, Import]] = {}
    for name, path in known.items():
        for imp in imports_of(root, path, known):
            found.extend(_rule_violations(imp, known))
            target = _resolve(imp.target, known)
            if target is not None and target != name:
                edges.setdefault(name, {}).setdefault(target, imp)
    for cycle in _cycles(edges):
        ring = " -> ".join([cycle[0].importer] + [_resolve(i.target, known) or i.target for i in cycle])
        steps = ", ".join(f"{i.file}:{i.line}" for i in cycle)
        found.append(Violation(cycle[0].file, cycle[0].line, "cycle", f"import cycle {ring} (at {steps})"))
    return sorted(found, key=lambda v: (v.file, v.line, v.rule))
