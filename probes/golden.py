"""Golden sets: load and validate ``golden_sets/<name>/manifest.yaml`` + ``items.jsonl``.

A golden set is a fixed list of prompts with short reference answers, replayed through the FP8
candidate and the FP16 baseline. Validation reports every problem at once, each located:
``file:line: message`` for JSONL items and ``file:line:col: message`` for the YAML manifest.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from probes.metrics import KNOWN_METRICS
from watchdog.core import safe_yaml

log = logging.getLogger(__name__)

MANIFEST = "manifest.yaml"
ITEMS = "items.jsonl"
CUSTOM_PREFIX = "evaluate:"
DEFAULT_TEMPLATE = "{prompt}"
DEFAULT_CONTEXT_TEMPLATE = "Context:\n{context}\n\nQuestion: {prompt}\nAnswer:"
ITEM_KEYS = ("id", "prompt", "reference", "context", "tags")


def _check_metric(name: str) -> str:
    if name.startswith(CUSTOM_PREFIX):
        if not name[len(CUSTOM_PREFIX) :].strip():
            raise ValueError(f"{name!r}: give the path of a local evaluate metric script")
        return name
    if name not in KNOWN_METRICS:
        close = difflib.get_close_matches(name, KNOWN_METRICS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown metric {name!r}{hint}; known: {', '.join(KNOWN_METRICS)}")
    return name


#: a built-in metric name or ``evaluate:<path of a local metric script>``
MetricName = Annotated[str, AfterValidator(_check_metric)]


class GenerationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = Field(gt=0, le=4096)
    #: replays must be deterministic, so only greedy decoding is accepted
    greedy: Literal[True] = True
    stop: tuple[str, ...] = ()

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal[1] = Field(1, alias="schema")
    name: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9_-]*$")
    domain: str = Field(min_length=1)
    description: str = Field(min_length=1)
    languages: tuple[str, ...] = Field(min_length=1)
    #: fnmatch globs of the routes this set guards
    routes: tuple[str, ...] = Field(min_length=1)
    generation: GenerationSpec
    metrics: tuple[MetricName, ...] = Field(min_length=1)
    #: prompt template; ``{prompt}`` and, for items with context, ``{context}``
    template: str | None = None

    @field_validator("metrics")
    @classmethod
    def _unique_metrics(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(v)) != len(v):
            raise ValueError("metrics listed twice")
        return v

    @field_validator("template")
    @classmethod
    def _template_has_prompt(cls, v: str | None) -> str | None:
        if v is not None and "{prompt}" not in v:
            raise ValueError("template must contain {prompt}")
        return v


@dataclass(frozen=True, slots=True)
class GoldenItem:
    id: str
    prompt: str
    reference: str
    context: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    line: int = 0


@dataclass(frozen=True, slots=True)
class GoldenSet:
    path: Path
    manifest: Manifest
    items: tuple[GoldenItem, ...]

    @property
    def name(self) -> str:
        return self.manifest.name

    def render(self, item: GoldenItem) -> str:
        """The prompt sent to the engines: the manifest template filled with the item."""
        template = self.manifest.template or (DEFAULT_CONTEXT_TEMPLATE if item.context else DEFAULT_TEMPLATE)
        context = "\n".join(f"[{n}] {p}" for n, p in enumerate(item.context, 1))
        return template.replace("{context}", context).replace("{prompt}", item.prompt)

    def version(self, item: GoldenItem) -> str:
        """A short hash of what the item asks and expects: its rendered prompt, its reference and the
        generation settings. An item edited under the same id is another item to the judge (what it
        learned about the old question is not carried over to the new one)."""
        g = self.manifest.generation
        text = json.dumps([self.render(item), item.reference, g.max_new_tokens, list(g.stop)], ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def pairs(self) -> list[tuple[str, str]]:
        """(rendered prompt, reference) pairs: exactly what replay sends and scores (use these to
        train a tiny test model, e.g. ``probes.tiny_model --pairs``)."""
        return [(self.render(i), i.reference) for i in self.items]

    def head(self, n: int) -> GoldenSet:
        """The first ``n`` items (a quick smoke replay)."""
        return GoldenSet(path=self.path, manifest=self.manifest, items=self.items[: max(0, n)])

    def guards(self, route: str) -> bool:
        return any(fnmatch.fnmatchcase(route, pattern) for pattern in self.manifest.routes)

    def custom_metric_paths(self) -> list[Path]:
        return [
            (self.path / m[len(CUSTOM_PREFIX) :].strip()).resolve()
            for m in self.manifest.metrics
            if m.startswith(CUSTOM_PREFIX)
        ]


class GoldenSetError(Exception):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


# --- manifest -------------------------------------------------------------------------------------


def _node_at(root: yaml.Node | None, loc: tuple[Any, ...], at_key: bool = False) -> yaml.Node | None:
    """The deepest YAML node along a pydantic error location (for line:col); ``at_key`` points at
    the last mapping key instead of its value (for unknown keys)."""
    node = root
    for depth, key in enumerate(loc):
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if k.value == key), None)
            if pair is None:
                return node
            node = pair[0] if at_key and depth == len(loc) - 1 else pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
    return node


def _load_manifest(path: Path) -> tuple[Manifest | None, list[str]]:
    try:
        text = safe_yaml.read_text(path)  # refuses an oversized file before reading it
    except safe_yaml.SafeYamlError as exc:
        return None, [f"{path}:{exc.line}:{exc.col}: {exc.message}"]
    except (OSError, UnicodeDecodeError) as exc:
        return None, [f"{path}: cannot read manifest: {getattr(exc, 'strerror', None) or exc}"]
    try:
        node, data = safe_yaml.node_and_data(text)  # bounded size, depth, aliases; core tags only
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        return None, [f"{where}: invalid YAML: {exc.problem or exc}"]
    if not isinstance(data, dict):
        return None, [f"{path}:1:1: manifest must be a mapping"]
    try:
        return Manifest.model_validate(data), []
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            loc = tuple("schema" if part == "schema_" else part for part in err["loc"])
            at = _node_at(node, loc, at_key=err["type"] == "extra_forbidden")
            mark = at.start_mark if at is not None else None
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else f"{path}:1:1"
            field = ".".join(str(p) for p in loc) or "manifest"
            msg = err["msg"].removeprefix("Value error, ")
            errors.append(f"{where}: {field}: {msg}")
        return None, errors


# --- items ----------------------------------------------------------------------------------------


def _check_item(obj: Any, where: str) -> tuple[GoldenItem | None, list[str]]:
    if not isinstance(obj, dict):
        return None, [f"{where}: item must be a JSON object"]
    errors = []
    for key in obj:
        if key not in ITEM_KEYS:
            close = difflib.get_close_matches(key, ITEM_KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{where}: unknown field {key!r}{hint}")
    for key in ("id", "prompt", "reference"):
        value = obj.get(key)
        if not isinstance(value, str):
            errors.append(f"{where}: {key!r} must be a string" if key in obj else f"{where}: missing {key!r}")
        elif key != "reference" and not value.strip():
            errors.append(f"{where}: empty {key!r}")
    for key in ("context", "tags"):
        value = obj.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            errors.append(f"{where}: {key!r} must be a list of strings")
    if errors:
        return None, errors
    return (
        GoldenItem(
            id=obj["id"],
            prompt=obj["prompt"],
            reference=obj["reference"],
            context=tuple(obj.get("context", ())),
            tags=tuple(obj.get("tags", ())),
        ),
        [],
    )


def _load_items(path: Path) -> tuple[list[GoldenItem], list[str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        return [], [f"{path}: cannot read items: {exc.strerror or exc}"]
    except UnicodeDecodeError as exc:
        return [], [f"{path}: not UTF-8: {exc.reason}"]
    items: list[GoldenItem] = []
    errors: list[str] = []
    first_line: dict[str, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"{where}: invalid JSON at column {exc.colno}: {exc.msg}")
            continue
        item, problems = _check_item(obj, where)
        errors.extend(problems)
        if item is None:
            continue
        if item.id in first_line:
            errors.append(f"{where}: duplicate id {item.id!r} (first at line {first_line[item.id]})")
            continue
        first_line[item.id] = n
        items.append(GoldenItem(item.id, item.prompt, item.reference, item.context, item.tags, line=n))
    if not items and not errors:
        errors.append(f"{path}: no items")
    return items, errors


def load_golden_set(path: str | os.PathLike[str]) -> GoldenSet:
    """Load a golden set directory; raises ``GoldenSetError`` listing every problem."""
    root = Path(path)
    if root.is_file():
        root = root.parent
    if not root.is_dir():
        raise GoldenSetError([f"{root}: not a golden set directory"])
    manifest, errors = _load_manifest(root / MANIFEST)
    items, item_errors = _load_items(root / ITEMS)
    errors += item_errors
    if manifest is not None:
        if manifest.name != root.name:
            errors.append(f"{root / MANIFEST}: name {manifest.name!r} differs from directory {root.name!r}")
        for script in [
            (root / m[len(CUSTOM_PREFIX) :].strip()) for m in manifest.metrics if m.startswith(CUSTOM_PREFIX)
        ]:
            if not script.is_file():
                errors.append(f"{root / MANIFEST}: custom metric script not found: {script}")
        if manifest.template and "{context}" not in manifest.template:
            for item in items:
                if item.context:
                    errors.append(
                        f"{root / ITEMS}:{item.line}: item has context but the template has no {{context}}"
                    )
                    break
    if errors or manifest is None:
        raise GoldenSetError(errors)
    return GoldenSet(path=root, manifest=manifest, items=tuple(items))


def validate_golden_set(path: str | os.PathLike[str]) -> list[str]:
    """Every problem in a golden set as ``file:line[:col]: message`` strings (empty when valid)."""
    try:
        load_golden_set(path)
    except GoldenSetError as exc:
        return exc.errors
    return []


# --- discovery ------------------------------------------------------------------------------------


def default_root() -> Path:
    """``$WATCHDOG_GOLDEN_DIR``, else ``./golden_sets``, else the shipped sets (the wheel's starter
    copy, or the repository's ``golden_sets`` in a checkout)."""
    env = os.environ.get("WATCHDOG_GOLDEN_DIR")
    if env:
        return Path(env)
    local = Path.cwd() / "golden_sets"
    if local.is_dir():
        return local
    from watchdog.core.starter import InitError, starter_path

    try:
        return starter_path("golden_sets")
    except InitError:
        return local


def list_golden_sets(root: str | os.PathLike[str] | None = None) -> list[Path]:
    base = Path(root) if root is not None else default_root()
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if (p / MANIFEST).is_file())


def not_sets(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Directories under ``root`` that ``list_golden_sets`` passes over for want of a manifest (hidden ones aside)."""
    base = Path(root) if root is not None else default_root()
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
                  and not (p / MANIFEST).is_file())


def _say_not_sets(root: str | os.PathLike[str] | None) -> None:
    for p in not_sets(root):
        print(f"{p}: skipped, no {MANIFEST} (not a golden set)", file=sys.stderr)


def find_golden_set(name_or_path: str, root: str | os.PathLike[str] | None = None) -> Path:
    """A set directory from a name (looked up under ``root``) or a path."""
    direct = Path(name_or_path)
    if (direct / MANIFEST).is_file():
        return direct
    sets = list_golden_sets(root)
    for p in sets:
        if p.name == name_or_path:
            return p
    close = difflib.get_close_matches(name_or_path, [p.name for p in sets], n=1)
    base = Path(root) if root is not None else default_root()
    if close:
        hint = f" (did you mean {close[0]!r}?)"
    elif sets:
        hint = f" (there: {', '.join(p.name for p in sets)})"
    else:
        hint = " (no set there; --root picks the directory)" if base.is_dir() else " (no such directory)"
    raise GoldenSetError([f"no golden set {name_or_path!r} under {base}{hint}"])


def sets_for_route(route: str, root: str | os.PathLike[str] | None = None) -> list[GoldenSet]:
    """Valid golden sets whose ``routes`` globs match ``route`` (invalid ones are logged, skipped)."""
    out = []
    for p in list_golden_sets(root):
        try:
            gs = load_golden_set(p)
        except GoldenSetError as exc:
            log.warning("skipping invalid golden set %s: %d problem(s)", p, len(exc.errors))
            continue
        if gs.guards(route):
            out.append(gs)
    return out


# --- CLI ------------------------------------------------------------------------------------------


def _cmd_validate(args: argparse.Namespace) -> int:
    paths = [Path(p) for p in args.paths] or list_golden_sets(args.root)
    if not args.paths:
        _say_not_sets(args.root)
    if not paths:
        base = Path(args.root) if args.root is not None else default_root()
        why = ("no set directories (with manifest.yaml) in it" if base.is_dir()
               else "not a directory" if base.exists() else "no such directory")
        print(f"no golden sets found under {base}: {why}", file=sys.stderr)
        return 1
    failed = 0
    for p in paths:
        errors = validate_golden_set(p)
        if errors:
            failed += 1
            for e in errors:
                print(e, file=sys.stderr)
        else:
            print(f"{p}: ok")
    return 1 if failed else 0


def _cmd_list(args: argparse.Namespace) -> int:
    if args.root is not None and not Path(args.root).is_dir():
        print(f"{args.root}: {'not a directory' if Path(args.root).exists() else 'no such directory'}", file=sys.stderr)
        return 2
    _say_not_sets(args.root)
    rows: list[dict[str, Any]] = []
    for p in list_golden_sets(args.root):
        try:
            gs = load_golden_set(p)
        except GoldenSetError as exc:
            rows.append({"name": p.name, "path": str(p), "error": f"{len(exc.errors)} problem(s)"})
            continue
        m = gs.manifest
        rows.append(
            {
                "name": m.name,
                "path": str(p),
                "items": len(gs.items),
                "domain": m.domain,
                "languages": list(m.languages),
                "routes": list(m.routes),
                "metrics": list(m.metrics),
            }
        )
    if args.json:
        print(json.dumps(rows, ensure_ascii=False, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="golden sets")
    for col in ("name", "items", "domain", "languages", "routes", "status"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["name"], "", "", "", "", f"[red]{r['error']}[/red]")
        else:
            table.add_row(
                r["name"], str(r["items"]), r["domain"], ",".join(r["languages"]), " ".join(r["routes"]), "ok"
            )
    Console().print(table)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    try:
        gs = load_golden_set(find_golden_set(args.name, args.root))
    except GoldenSetError as exc:
        for e in exc.errors:
            print(e, file=sys.stderr)
        return 2
    for item, (prompt, reference) in zip(gs.items, gs.pairs(), strict=True):
        print(json.dumps({"id": item.id, "prompt": prompt, "reference": reference}, ensure_ascii=False))
    return 0


def add_golden_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``golden validate [PATH...]``, ``golden list`` and ``golden export NAME``; each sets
    ``func(args) -> exit code``."""
    golden = subparsers.add_parser("golden", help="golden prompt sets")
    golden.add_argument("--root", default=None, help="directory of golden sets (default: golden_sets)")
    sub = golden.add_subparsers(dest="golden_command", required=True)
    v = sub.add_parser("validate", help="validate golden sets; non-zero exit on any error")
    v.add_argument("paths", nargs="*", help="set directories (default: every set under --root)")
    v.set_defaults(func=_cmd_validate)
    ls = sub.add_parser("list", help="list golden sets")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_cmd_list)
    ex = sub.add_parser("export", help="print a set's rendered (prompt, reference) pairs as JSONL")
    ex.add_argument("name", help="set name or directory")
    ex.set_defaults(func=_cmd_export)
    for p in (v, ls, ex):  # `golden validate --root DIR` as well as `golden --root DIR validate`
        p.add_argument("--root", default=argparse.SUPPRESS, help="directory of golden sets (as before the subcommand)")
    return golden
