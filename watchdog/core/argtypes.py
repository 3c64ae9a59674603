"""Argument types and the parser class every ``llm-watchdog`` command uses.

Bad input is refused by argparse itself (exit 2, one line on stderr naming the argument) before
any service is contacted.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

from watchdog.core.events import kept_name, name_problem

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ...``), no usage dump."""

    _argv: list[str] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{self._dash_value_hint(message)} (see {self._help_of()} --help)\n")

    def _help_of(self) -> str:
        """The command whose ``--help`` answers the error: the deepest subcommand named in the arguments
        (argparse reports an option no subcommand knows, ``run --dry-run``, from the top-level parser)."""
        parser: argparse.ArgumentParser = self
        for token in self._argv:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is None:
                break
            if token in sub.choices:
                parser = sub.choices[token]
        return parser.prog

    def _dash_value_hint(self, message: str) -> str:
        """argparse reads ``--ttl -5m`` as an option with no value; say what it actually saw."""
        match = re.match(r"argument (\S+): expected one argument", message)
        if not match:
            return ""
        names = match.group(1).split("/")
        for i, arg in enumerate(self._argv[:-1]):
            following = self._argv[i + 1]
            if arg in names and re.match(r"-\d", following):
                return f" ({following!r} is negative; give a positive value)"
        return ""


def usage_error(prog: str, message: str) -> int:
    """Print a one-line usage error and return exit code 2 (for checks done after parsing)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    return 2


def log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {value!r} (one of {', '.join(LOG_LEVELS)})")
    return level


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None


#: the largest count Redis takes (a signed 64-bit integer); beyond it Redis' "value is not an integer or out of
#: range" read as a Redis problem
MAX_INT = 2**63 - 1


def positive_int(value: str) -> int:
    n = _int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    if n > MAX_INT:
        raise argparse.ArgumentTypeError(f"too large: {value!r} (at most {MAX_INT})")
    return n


def non_negative_int(value: str) -> int:
    n = _int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return n


def positive_float(value: str) -> float:
    x = _float(value)
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value!r}")
    return x


def non_negative_float(value: str) -> float:
    x = _float(value)
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return x


def tcp_port(value: str) -> int:
    """A port to listen on: 1-65535 (the config's ``port`` fields refuse the same out-of-range values)."""
    n = _int(value)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value!r} (1-65535)")
    return n


def route_name(value: str) -> str:
    """A model or route name as events carry it: the event contract's rule
    (``watchdog.core.events.name_problem``: 1-200 characters, no space, control or invisible
    character), checked on and returned in the NFKC form the event decoder keeps."""
    name = kept_name(value)
    why = name_problem(name)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{name[:40]!r}{'...' if len(name) > 40 else ''} {why}")
    return name


def existing_file(value: str) -> str:
    p = Path(value)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"no such file: {value}")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"is a directory, not a file: {value}")
    return value


def config_file(value: str) -> str:
    """``existing_file`` for ``--config``, whose default is ``$LLMWD_CONFIG``: a bad value from there is
    named as coming from it (an operator who never typed ``--config`` looked for it)."""
    try:
        return existing_file(value)
    except argparse.ArgumentTypeError as exc:
        if value == os.environ.get("LLMWD_CONFIG"):
            raise argparse.ArgumentTypeError(f"{exc} (from $LLMWD_CONFIG)") from None
        raise


def existing_path(value: str) -> str:
    if not Path(value).exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {value}")
    return value


def output_file(value: str) -> str:
    """A file to write: its directory must exist and it must not be a directory."""
    p = Path(value)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"is a directory: {value}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory does not exist: {parent} (create it first)")
    return value


def output_dir(value: str) -> str:
    """A directory to write into, made if missing: a file there is refused now, not after the work."""
    if Path(value).exists() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"is a file, not a directory: {value}")
    return value


def choice_of(options: Iterable[str], what: str) -> Callable[[str], str]:
    """A case-insensitive choice with a "did you mean" on a near miss."""
    allowed = [o.lower() for o in options]

    def check(value: str) -> str:
        v = value.strip().lower()
        if v in allowed:
            return v
        close = difflib.get_close_matches(v, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise argparse.ArgumentTypeError(f"unknown {what} {value!r} (one of {', '.join(allowed)}){hint}")

    check.__name__ = what
    return check


def did_you_mean(value: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def add_log_level_everywhere(parser: argparse.ArgumentParser) -> None:
    """Accept ``--log-level`` after every subcommand too (it overrides the one before it)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                if not any("--log-level" in a.option_strings for a in sub._actions):
                    sub.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS,
                                     help="DEBUG, INFO, WARNING, ERROR (default INFO for run/demo/embedded, "
                                          "else WARNING)")
                add_log_level_everywhere(sub)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, log_level(level)),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    # kafka-python logs every failed connection attempt (several lines a second while a broker is
    # unreachable); the daemon reports Kafka trouble itself, in one line naming the likely cause, and
    # in /readyz. Its own lines come back with --log-level DEBUG.
    logging.getLogger("kafka").setLevel(logging.DEBUG if log_level(level) == "DEBUG" else logging.CRITICAL)
