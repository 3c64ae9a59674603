"""Read policy files into a validated ``PolicySet``; every problem becomes ``file:line:col: message``.

``PolicyLoader`` polls the files (mtime and size) and swaps in a new set only when every file is
valid; on a bad edit the last good set stays in force and the errors go to ``on_error``. With
``background=True`` the reading and validating run on a worker thread, so ``check()`` and
``reload()`` never block the caller; the result is swapped in by a later ``check()``.

Nothing a file contains makes loading raise: size, nesting, aliases and tags are bounded by
``watchdog.core.safe_yaml``; anything unexpected still becomes a ``file:line:col`` error.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from watchdog.config.yamlpos import Pos, PosDoc, YamlSyntaxError, load_with_positions
from watchdog.core import safe_yaml
from watchdog.core.model_keys import allowed_keys as _allowed_keys
from watchdog.policy.conditions import ConditionError, parse_condition
from watchdog.policy.routing import unknown_channels
from watchdog.policy.schema import (
    LATENCY_METRICS,
    LIVE_METRICS,
    RATE_COUNTS,
    REPLICA_RATES,
    Policy,
    PolicyFile,
)

log = logging.getLogger(__name__)


class PolicyError(Exception):
    """Invalid policy files. ``messages`` are ``file:line:col: message`` strings."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = messages


@dataclass(frozen=True, slots=True)
class PolicySet:
    policies: tuple[Policy, ...] = ()
    #: policy name -> file it came from
    origin: dict[str, str] = field(default_factory=dict)
    #: sha256 of the file contents, for status pages
    digest: str = ""
    #: name -> the first policy of that name (``get`` is asked per route: 10,000 a second at scale)
    _by_name: dict[str, Policy] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {p.name: p for p in reversed(self.policies)})

    def get(self, name: str) -> Policy | None:
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.policies]

    def covering(self, model: str, route: str) -> list[Policy]:
        """The policies whose scope covers (model, route), in file order."""
        return [p for p in self.policies if p.scope.covers(model, route)]

    def golden_rules(self, model: str, route: str) -> dict[str, list[str]]:
        """{metric: [rule names]} of the ``source: golden`` rules of the policies covering (model, route)."""
        out: dict[str, list[str]] = {}
        for p in self.covering(model, route):
            for r in p.rules:
                if r.source == "golden":
                    out.setdefault(r.metric, []).append(r.name)
        return out


def _fmt(fname: str, pos: Pos, message: str) -> str:
    return f"{fname}:{pos.line}:{pos.col}: {message}"


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _pydantic_messages(fname: str, doc: PosDoc, exc: ValidationError) -> list[tuple[Pos, str]]:
    out: list[tuple[Pos, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        where = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            key = str(loc[-1])
            allowed = _allowed_keys(PolicyFile, loc)
            hint = difflib.get_close_matches(key, allowed, n=1)
            msg = f"unknown key '{key}'" + (f" (did you mean '{hint[0]}'?)" if hint else "")
            if allowed:
                msg += f"; allowed here: {', '.join(sorted(allowed))}"
            out.append((doc.pos(loc, key=True), msg))
        elif kind == "missing":
            out.append((doc.pos(loc[:-1]), f"{_dotted(loc[:-1]) or 'file'}: missing required key '{loc[-1]}'"))
        else:
            msg = err["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
            elif kind in ("too_long", "too_short") and isinstance(err.get("input"), str):
                # a cleaned name is a "Value" to pydantic, which then counts "items"
                ctx = err.get("ctx", {})
                bound = f"at most {ctx.get('max_length')}" if kind == "too_long" else f"at least {ctx.get('min_length')}"
                msg = f"should have {bound} characters, not {ctx.get('actual_length', len(err['input']))}"
            pos = doc.pos(loc)
            if len(loc) > 1 and pos == doc.pos(loc[:-1]):
                # a key the file does not write: a scalar the model spread over several keys
                # (min_time_in_state: 5m -> candidate and baseline), one mistake, said once
                where = _dotted(loc[:-1])
            if (pos, f"{where}: {msg}") not in out:
                out.append((pos, f"{where}: {msg}"))
    return out


def _condition_pos(base: Pos, offset: int) -> Pos:
    if not base.single_line or base.style in ("|", ">"):
        return base
    shift = 1 if base.style in ("'", '"') else 0
    return Pos(base.line, base.col + shift + offset)


def _semantic_checks(data: dict[str, Any], doc: PosDoc, channels: Collection[str] | None = None,
                     precisions: Collection[str] | None = None) -> list[tuple[Pos, str]]:
    """Checks pydantic cannot place well; runs on the raw data so they report even when the
    structure has other errors. ``channels``: the alert channel names ``actions`` may use;
    ``precisions``: the ones a route flag may take (the config's), which candidate and baseline must be."""
    out: list[tuple[Pos, str]] = []
    policies = data.get("policies")
    if not isinstance(policies, list):
        return out
    names: set[str] = set()
    for pi, pol in enumerate(policies):
        if not isinstance(pol, dict):
            continue
        ppath: tuple[str | int, ...] = ("policies", pi)
        pname = pol.get("name")
        if isinstance(pname, str):
            if pname in names:
                out.append((doc.pos((*ppath, "name")), f"duplicate policy name '{pname}'"))
            names.add(pname)
        if channels is not None:
            out += unknown_channels(pol, ppath, channels, doc)
        cand, base = pol.get("candidate", "fp8"), pol.get("baseline", "fp16")
        if cand == base:
            out.append((doc.pos((*ppath, "baseline")), "baseline must differ from candidate"))
        if precisions is not None:
            for key, value in (("candidate", cand), ("baseline", base)):
                if isinstance(value, str) and value.lower() not in precisions:
                    where = doc.pos((*ppath, key)) if key in pol else doc.pos(ppath)
                    out.append((where, f"{key} '{value}' is not one of the config's precisions "
                                       f"({', '.join(sorted(precisions))}): the daemon could not set a route to it"))
        rules = pol.get("rules")
        seen: set[str] = set()
        for ri, rule in enumerate(rules if isinstance(rules, list) else []):
            if not isinstance(rule, dict):
                continue
            rpath = (*ppath, "rules", ri)
            name = rule.get("name")
            if isinstance(name, str):
                if name in seen:
                    out.append((doc.pos((*rpath, "name")), f"duplicate rule name '{name}' in policy '{pol.get('name')}'"))
                seen.add(name)
            source, metric = rule.get("source", "live"), rule.get("metric")
            if source == "live" and isinstance(metric, str) and metric not in LIVE_METRICS:
                hint = difflib.get_close_matches(metric, LIVE_METRICS, n=1)
                msg = f"unknown live metric '{metric}'" + (f" (did you mean '{hint[0]}'?)" if hint else "")
                out.append((doc.pos((*rpath, "metric")), msg + f"; live metrics: {', '.join(LIVE_METRICS)}"))
            if rule.get("fail_if") is None and rule.get("judge") is None:
                out.append((doc.pos(rpath), f"rule '{name}' needs fail_if, judge or both"))
            for key in ("fail_if", "restore_if"):
                text = rule.get(key)
                if not isinstance(text, str):
                    continue
                try:
                    cond = parse_condition(text)
                except ConditionError as exc:
                    pos = _condition_pos(doc.pos((*rpath, key)), exc.offset)
                    out.append((pos, f"{key}: {exc.message}"))
                    continue
                if source == "gpu" and "baseline" in cond.names:
                    out.append((doc.pos((*rpath, key)), f"{key}: gpu signals have no baseline"))
                if source == "live" and metric in RATE_COUNTS:
                    beyond = _rate_bound_beyond_one(cond.tree)
                    if beyond is not None:
                        out.append((doc.pos((*rpath, key)),
                                    f"{key}: {metric} is a fraction (0 to 1), so {text!r} compares it with "
                                    f"{beyond:g} and is never or always true: {beyond:g} % is {beyond / 100:g}"))
            out += _judge_checks(rule, rpath, source, metric, doc)
            if rule.get("replica_failures", "count") != "count" and isinstance(metric, str) and (
                    source != "live" or metric not in REPLICA_RATES):
                out.append((doc.pos((*rpath, "replica_failures")),
                            f"replica_failures: only live {' and '.join(REPLICA_RATES)} are counted per replica"))
            confirm = rule.get("confirm_with")
            if confirm is not None:
                if source != "live":
                    out.append((doc.pos((*rpath, "confirm_with")), "confirm_with: only live rules wait for confirmation"))
                if rule.get("action", "alert") != "rollback":
                    out.append((doc.pos((*rpath, "confirm_with")),
                                "confirm_with: only a rule with action: rollback has a rollback to confirm"))
                if isinstance(confirm, str) and not any(isinstance(r, dict) and r.get("source") == confirm
                                                        for r in rules or []):
                    out.append((doc.pos((*rpath, "confirm_with")),
                                f"confirm_with: policy '{pol.get('name')}' has no {confirm} rule to confirm with"))
    return out


def _rate_bound_beyond_one(tree: tuple[Any, ...]) -> float | None:
    """The first number above 1 that a condition compares ``candidate``, ``baseline`` or their
    difference with (a rate written in percent), else None."""

    def rate_side(node: tuple[Any, ...]) -> bool:
        if node[0] == "name":
            return bool(node[1] in ("candidate", "baseline"))
        return node[0] == "bin" and node[1] == "-" and rate_side(node[2]) and rate_side(node[3])

    if tree[0] == "cmp":
        operands = tree[2]
        for a, b in zip(operands, operands[1:], strict=False):
            for side, num in ((a, b), (b, a)):
                if rate_side(side) and num[0] == "num" and abs(num[1]) > 1:
                    return float(num[1])
        return None
    for child in tree[1:]:
        if isinstance(child, tuple) and child and isinstance(child[0], str):
            found = _rate_bound_beyond_one(child)
            if found is not None:
                return found
        elif isinstance(child, list):
            for c in child:
                if isinstance(c, tuple):
                    found = _rate_bound_beyond_one(c)
                    if found is not None:
                        return found
    return None


def _judge_checks(rule: dict[str, Any], rpath: tuple[str | int, ...], source: object, metric: object,
                  doc: PosDoc) -> list[tuple[Pos, str]]:
    """Which judge test fits which source and metric (pydantic checks the keys and types)."""
    judge = rule.get("judge")
    if not isinstance(judge, dict):
        return []
    jpath = (*rpath, "judge")
    out: list[tuple[Pos, str]] = []
    test = judge.get("test")
    where = doc.pos((*jpath, "test"))
    if source == "gpu":
        out.append((doc.pos(jpath), "judge: gpu signals have no baseline to judge against"))
    elif test == "paired" and source != "golden":
        out.append((where, "judge: test paired needs per-item values: use it on source: golden"))
    elif test == "mann_whitney" and (source != "live" or metric not in LATENCY_METRICS):
        out.append((where, f"judge: test mann_whitney compares live latency sketches: metric must be one of "
                           f"{', '.join(LATENCY_METRICS)} on source: live"))
    elif test == "rate" and (source != "live" or metric not in RATE_COUNTS):
        out.append((where, f"judge: test rate needs live counts: metric must be one of {', '.join(RATE_COUNTS)}"))
    if judge.get("pool") is not None and test == "paired":
        out.append((doc.pos((*jpath, "pool")), "judge: pool sums live windows (mann_whitney, rate); a paired "
                                               "golden rule pools replays with replays: 2"))
    if judge.get("replays") is not None and test != "paired":
        out.append((doc.pos((*jpath, "replays")), "judge: replays pools golden replays (test: paired); a live "
                                                  "rule pools windows with pool: N"))
    if judge.get("relative_to") is not None and (test != "quantile" or not judge.get("tail")):
        out.append((doc.pos((*jpath, "relative_to")), "judge: relative_to contrasts an upper-tail mean with the "
                                                      "mean of the same sketch: use it with test: quantile and "
                                                      "tail: p (0 < p < 1)"))
    if judge.get("null_model") == "sampling" and judge.get("learn") is None and test != "quantile":
        out.append((doc.pos((*jpath, "null_model")), "judge: null_model applies to a learned null: add learn: N"))
    if judge.get("horizon") is not None and (source != "live" or test == "paired"):
        out.append((doc.pos((*jpath, "horizon")), "judge: horizon accumulates live windows: use it on a live rule"))
    if judge.get("anchor") is not None and judge.get("learn") is None:
        out.append((doc.pos((*jpath, "anchor")), "judge: anchor caps a learned null: add learn: N"))
    if test == "rate" and judge.get("direction") == "higher_is_better":
        out.append((doc.pos((*jpath, "direction")), "judge: a rate (errors, timeouts) is lower_is_better"))
    effect, marginal = judge.get("effect"), judge.get("marginal")
    if isinstance(effect, int | float) and isinstance(marginal, int | float) and marginal > effect:
        out.append((doc.pos((*jpath, "marginal")), f"judge: marginal ({marginal}) must not exceed effect ({effect})"))
    if test == "mann_whitney" and judge.get("direction") == "higher_is_better" and isinstance(effect, int | float) \
            and effect >= 1:
        out.append((doc.pos((*jpath, "effect")), "judge: a relative drop must be below 1 (100 %)"))
    broken = judge.get("broken")
    b_alpha = broken.get("alpha") if isinstance(broken, dict) else None
    alpha = judge.get("alpha", 0.01)
    if isinstance(b_alpha, int | float) and isinstance(alpha, int | float) and b_alpha >= alpha:
        out.append((doc.pos((*jpath, "broken", "alpha")), f"judge: broken.alpha ({b_alpha}) is taken from the "
                    f"rule's alpha ({alpha}) and must be below it"))
    return out


def parse_policy_text(text: str, fname: str, channels: Collection[str] | None = None
                      ) -> tuple[list[Policy], list[str]]:
    """Validate one file's text. Returns (policies, error messages); policies only when no errors.
    ``channels``: the alert channel names ``actions.notify``/``page`` may use (None: not checked)."""
    found, errors, _ = _parse_text(text, fname, channels)
    return found, errors


def _parse_text(text: str, fname: str, channels: Collection[str] | None = None,
                precisions: Collection[str] | None = None) -> tuple[list[Policy], list[str], PosDoc | None]:
    try:
        return _parse_text_unguarded(text, fname, channels, precisions)
    except RecursionError:
        return [], [f"{fname}:1:1: the file is nested too deeply to validate"], None
    except Exception as exc:  # a bug here must not take a running daemon down with it
        log.exception("policy validation failed unexpectedly for %s", fname)
        return [], [f"{fname}:1:1: cannot validate the file ({type(exc).__name__}: {exc})"], None


def _parse_text_unguarded(text: str, fname: str, channels: Collection[str] | None,
                          precisions: Collection[str] | None = None
                          ) -> tuple[list[Policy], list[str], PosDoc | None]:
    try:
        doc = load_with_positions(text)
    except YamlSyntaxError as exc:
        return [], [_fmt(fname, exc.pos, exc.message)], None
    problems: list[tuple[Pos, str]] = list(doc.errors)
    if not isinstance(doc.data, dict):
        problems.append((doc.pos(()), "a policy file must be a mapping with a 'policies:' list"))
        return [], [_fmt(fname, p, m) for p, m in sorted(problems, key=lambda x: (x[0].line, x[0].col))], doc
    pf: PolicyFile | None = None
    try:
        pf = PolicyFile.model_validate(doc.data)
    except ValidationError as exc:
        # a value the YAML layer refused (reported above) is None here: one message per cause
        refused = {(p.line, p.col) for p, _ in doc.errors}
        problems += [(p, m) for p, m in _pydantic_messages(fname, doc, exc) if (p.line, p.col) not in refused]
    problems += _semantic_checks(doc.data, doc, channels, precisions)
    if problems:
        ordered = sorted(problems, key=lambda x: (x[0].line, x[0].col))
        return [], [_fmt(fname, p, m) for p, m in ordered], doc
    assert pf is not None
    return list(pf.policies), [], doc


def _sibling_hint(path: Path) -> str:
    """``; did you mean 'x.yaml'?`` for a missing file with a close name beside it, else ""."""
    try:
        names = [x.name for x in path.parent.iterdir() if x.suffix in (".yaml", ".yml")]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1)
    return f"; did you mean {str(path.parent / close[0])!r}?" if close else ""


def _expand(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The policy files ``paths`` name, each once: a file named twice (``policies`` and
    ``policies/default.yaml``, or two spellings of one path) is read at its first mention, so its
    policies are not reported as duplicates of themselves."""
    out: list[Path] = []
    seen: set[Path] = set()
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            # hidden files are an editor's or a tool's (emacs' .#x.yaml, a .x.yaml being written), not policies
            found = sorted(x for x in p.iterdir()
                           if x.suffix in (".yaml", ".yml") and not x.name.startswith(".") and x.is_file())
        else:
            found = [p]
        for x in found:
            try:
                key = x.resolve()
            except (OSError, RuntimeError):  # a symlink loop: its own spelling (reading it fails, named)
                key = x.absolute()
            if key not in seen:
                seen.add(key)
                out.append(x)
    return out


def load_policy_files(paths: Iterable[str | os.PathLike[str]], channels: Collection[str] | None = None,
                      precisions: Collection[str] | None = None) -> PolicySet:
    """Load and validate policy files (directories: their *.yaml / *.yml, hidden ones skipped). Raises ``PolicyError``.
    ``channels``: the alert channel names ``actions.notify``/``page`` may use (None: not checked);
    ``precisions``: the config's, which each policy's candidate and baseline must be (None: not checked)."""
    errors: list[str] = []
    policies: list[Policy] = []
    origin: dict[str, str] = {}
    name_pos: dict[str, str] = {}
    sha = hashlib.sha256()
    paths = list(paths)
    for raw in paths:  # a listed directory with nothing in it judged nothing, silently
        if Path(raw).is_dir() and not _expand([raw]):
            errors.append(f"{os.fspath(raw)}: no policy files (*.yaml, *.yml) in this directory")
    for path in _expand(paths):
        fname = str(path)
        try:
            text = safe_yaml.read_text(path)
        except safe_yaml.SafeYamlError as exc:
            errors.append(f"{fname}:{exc.line}:{exc.col}: {exc.message}")
            continue
        except FileNotFoundError:
            errors.append(f"{fname}:1:1: cannot read file: no such file{_sibling_hint(path)}")
            continue
        except (OSError, UnicodeDecodeError) as exc:
            errors.append(f"{fname}:1:1: cannot read file: {exc}")
            continue
        sha.update(fname.encode() + b"\0" + text.encode() + b"\0")
        found, errs, doc = _parse_text(text, fname, channels, precisions)
        errors += errs
        if errs or doc is None:
            continue
        for i, pol in enumerate(found):
            pos = doc.pos(("policies", i, "name"))
            where = f"{fname}:{pos.line}:{pos.col}"
            if pol.name in name_pos:
                errors.append(f"{where}: duplicate policy name '{pol.name}' (first defined at {name_pos[pol.name]})")
                continue
            name_pos[pol.name] = where
            origin[pol.name] = fname
            policies.append(pol)
    if errors:
        raise PolicyError(errors)
    return PolicySet(tuple(policies), origin, sha.hexdigest())


def _fingerprint(paths: Sequence[str | os.PathLike[str]]) -> tuple[tuple[str, int, int], ...]:
    out: list[tuple[str, int, int]] = []
    for p in _expand(paths):
        try:
            st = p.stat()
            out.append((str(p), st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((str(p), -1, -1))
    return tuple(out)


class PolicyLoader:
    """Keeps the last good ``PolicySet`` of ``paths``; ``check()`` reloads when a file changed.

    ``on_error(messages)`` receives the file:line:col errors of a rejected load; the previous set
    stays in force. Call ``check()`` about once a second and ``reload()`` on SIGHUP.

    ``background=True``: the first load (in the constructor) is synchronous; after that ``check()``
    and ``reload()`` only start a load on a worker thread and return at once (False). The thread
    builds the new ``PolicySet`` aside; the next ``check()`` swaps it in with one assignment,
    calls ``on_change``/``on_error`` on the caller's thread and returns True if it was accepted.

    ``raise_at_start=True``: an invalid first load raises ``PolicyError`` from the constructor and
    logs nothing (the daemon reports it once, as a start-up failure, not as a rejected reload).

    ``settle_s``: ``check()`` loads a change only once the files have stayed as they are for this long.
    An editor saves in steps: emacs renames the old file aside and writes a new one, and an in-place
    save truncates, then writes. A poll between two steps saw a valid set without the file, or with a
    prefix of it (8-22 % of the shipped files' byte prefixes are valid policies with rules missing). The
    engine then dropped the missing policy's state, its streaks, learned nulls and flip budget. Found by
    an outside review. ``reload()`` (SIGHUP) does not wait.
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        on_error: Callable[[list[str]], None] | None = None,
        on_change: Callable[[PolicySet], None] | None = None,
        *,
        background: bool = False,
        channels: Collection[str] | None = None,
        precisions: Collection[str] | None = None,
        raise_at_start: bool = False,
        settle_s: float = 0.0,
    ) -> None:
        self.paths = list(paths)
        self.settle_s = settle_s
        #: a change seen but not loaded yet: its fingerprint and since when the files have stayed so
        self._settling: tuple[tuple[str, int, int], ...] | None = None
        self._settling_since = 0.0
        #: the alert channel names policies may route to (None: not checked)
        self.channels = None if channels is None else frozenset(channels)
        #: the precisions a policy's candidate and baseline may be (None: not checked)
        self.precisions = None if precisions is None else frozenset(precisions)
        self.on_error = on_error
        self.on_change = on_change
        self.background = background
        self.policy_set = PolicySet()
        self.last_errors: list[str] = []
        self.loads = 0
        self.rejects = 0
        self._seen: tuple[tuple[str, int, int], ...] | None = None
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._again = False
        self._result: PolicySet | PolicyError | None = None
        if raise_at_start:  # the caller reports a bad start (once, as a start-up failure); nothing is logged
            self._seen = _safe_fingerprint(self.paths)
            first = _load_guarded(self.paths, self.channels, self.precisions)
            if isinstance(first, PolicyError):
                self.last_errors = first.messages
                raise first
            self._apply(first)
        else:
            self._sync_reload()

    @property
    def loading(self) -> bool:
        """True while a background load runs or waits to be swapped in."""
        with self._lock:
            return self._worker is not None or self._result is not None

    def check(self) -> bool:
        """Reload if any file's mtime/size changed (or files appeared/vanished). True if a new set loaded."""
        if not self.background:
            return self._settled_change() and self._sync_reload()
        accepted = self._collect()
        if not self.loading and self._settled_change():
            self._start()
        return accepted

    def _settled_change(self) -> bool:
        """True when the files differ from the last load and have stayed so for ``settle_s``."""
        seen = _safe_fingerprint(self.paths)
        if seen == self._seen:
            self._settling = None
            return False
        if self.settle_s <= 0:
            return True
        now = time.monotonic()
        if self._settling is None or seen != self._settling:
            self._settling, self._settling_since = seen, now
            return False
        return now - self._settling_since >= self.settle_s

    def reload(self) -> bool:
        """Re-read all files now. True when the new set was accepted (background: starts a load
        and returns False; a later ``check()`` swaps it in)."""
        if not self.background:
            return self._sync_reload()
        accepted = self._collect()
        self._start()
        return accepted

    def wait(self, timeout: float = 10.0) -> bool:
        """Background mode: wait for a running load and swap it in; True if a new set was accepted."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout)
        return self._collect()

    # -- internals --------------------------------------------------------------------------

    def _sync_reload(self) -> bool:
        self._seen = _safe_fingerprint(self.paths)
        return self._apply(_load_guarded(self.paths, self.channels, self.precisions))

    def _start(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._again = True  # a change arrived mid-load: load once more afterwards
                return
            self._seen = _safe_fingerprint(self.paths)
            self._worker = threading.Thread(target=self._work, name="llmwd-policy-load", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while True:
            result = _load_guarded(self.paths, self.channels, self.precisions)
            with self._lock:
                if not self._again:
                    self._result = result
                    self._worker = None
                    return
                self._again = False
                self._seen = _safe_fingerprint(self.paths)

    def _collect(self) -> bool:
        with self._lock:
            result, self._result = self._result, None
        return False if result is None else self._apply(result)

    def _apply(self, result: PolicySet | PolicyError) -> bool:
        if isinstance(result, PolicyError):
            self.rejects += 1
            self.last_errors = result.messages
            if self.loads:
                log.warning("policy reload rejected, keeping %d policies in force: %s",
                            len(self.policy_set.policies), "; ".join(result.messages[:20]))
            else:
                log.warning("policies rejected at load, none in force: %s", "; ".join(result.messages[:20]))
            if self.on_error is not None:
                self.on_error(result.messages)
            return False
        self.last_errors = []
        self.loads += 1
        changed = result.digest != self.policy_set.digest
        self.policy_set = result
        log.info("policies loaded: %s", ", ".join(result.names))
        if changed and self.on_change is not None:
            self.on_change(result)
        return True


def _safe_fingerprint(paths: Sequence[str | os.PathLike[str]]) -> tuple[tuple[str, int, int], ...] | None:
    try:
        return _fingerprint(paths)
    except OSError:  # the directory itself vanished: compare unequal to anything seen, load reports it
        return None


def _load_guarded(paths: Sequence[str | os.PathLike[str]], channels: Collection[str] | None = None,
                  precisions: Collection[str] | None = None) -> PolicySet | PolicyError:
    try:
        return load_policy_files(paths, channels, precisions)
    except PolicyError as exc:
        return exc
    except Exception as exc:  # never let a reload raise into the daemon loop
        log.exception("policy load failed unexpectedly")
        return PolicyError([f"{p}:1:1: cannot load policies ({type(exc).__name__}: {exc})" for p in paths[:1]]
                           or [f"<policies>:1:1: cannot load policies ({type(exc).__name__}: {exc})"])
