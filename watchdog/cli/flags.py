"""``llm-watchdog flags ...``: read and change routing flags by hand.

``add_flags_commands(subparsers)`` adds ``flags list|get|set|pin|unpin|maintenance|audit`` to an argparse
parser; each sub-command stores its handler in ``args.func`` (call ``args.func(args)``, which
returns the exit code: 0 ok, 1 refused or not found, 2 Redis unreachable or bad input). Every
change is written with ``changed_by = "cli:{user}@{host}"`` and so lands in the audit stream;
``set``/``pin``/``unpin`` are also announced on the config's alert channels (an info message)
unless ``alerts.announce_manual_changes`` is false or ``--no-announce`` is given.

Settings come from ``--config FILE`` (default ``$LLMWD_CONFIG``; ``LLMWD_*`` overrides apply):
the Redis URL and prefix, the allowed precisions and the alert channels. ``--redis-url`` and
``--prefix`` win over it.
"""

from __future__ import annotations

import argparse
import difflib
import getpass
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import redis
from rich.console import Console
from rich.table import Table
from rich.text import Text

from watchdog.actuation.actuator import FlagStore, FlipResult
from watchdog.config.redact import redacted
from watchdog.config.settings import Config, ConfigError, load_config
from watchdog.core.argtypes import (
    config_file,
    did_you_mean,
    non_negative_int,
    positive_float,
    positive_int,
    route_name,
)
from watchdog.core.keys import Flag, Keys, cluster_prefix_problem
from watchdog.state.redis_conn import client_from_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: the longest ``flags pin --ttl``: a pin holds a route against every policy, so one that outlives
#: the incident it was for must not be possible by a slip of the keyboard (``99999d``); pin again
#: to extend it
MAX_PIN_TTL_S = 30 * 86400.0


def parse_duration(value: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d``, ``1h30m`` -> seconds (positive)."""
    text = value.strip().lower()
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd]?)", text)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd]?)", "", text).strip():
        raise argparse.ArgumentTypeError(f"not a duration: {value!r} (use e.g. 90s, 30m, 2h, 1d)")
    seconds = sum(float(num) * _UNITS[unit] for num, unit in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"duration must be positive: {value!r}")
    return seconds


def _at_most(limit_s: float, longest: str, again: str) -> Callable[[str], float]:
    """An argparse type: a duration (``parse_duration``) of at most ``limit_s``."""

    def parse(value: str) -> float:
        seconds = parse_duration(value)
        if seconds > limit_s:
            raise argparse.ArgumentTypeError(f"{value!r} is longer than the longest {longest} ({again})")
        return seconds

    return parse


#: ``--ttl`` of ``flags pin``: at most ``MAX_PIN_TTL_S`` (30 days)
pin_ttl = _at_most(MAX_PIN_TTL_S, "pin, 30d", "pin again to extend it")

#: the longest maintenance one command declares (declare again to extend it)
MAX_MAINTENANCE_S = 7 * 86400.0
#: ``--for`` of ``flags maintenance``: at most ``MAX_MAINTENANCE_S``
maintenance_length = _at_most(MAX_MAINTENANCE_S, "maintenance, 7d", "declare again to extend it")


def parse_duration_or_zero(value: str) -> float:
    """A duration, or ``0``."""
    return 0.0 if value.strip() in ("0", "0s") else min(parse_duration(value), MAX_MAINTENANCE_S)


def who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = os.environ.get("USER") or "unknown"
    return f"cli:{user}@{socket.gethostname()}"


#: the one spelling, the daemon's own (config key redis.url, ``__`` between levels), as ``embedded`` exports it
REDIS_URL_VAR = "LLMWD_REDIS__URL"
#: read by ``flags`` before the spelling was unified; still honoured after REDIS_URL_VAR, not documented
LEGACY_REDIS_URL_VAR = "LLMWD_REDIS_URL"


def default_redis_url() -> str:
    return os.environ.get(REDIS_URL_VAR) or os.environ.get(LEGACY_REDIS_URL_VAR) or DEFAULT_REDIS_URL


def redis_error_line(url: str | None, exc: BaseException) -> str:
    """One line for a Redis failure of a CLI command (the URL's password hidden)."""
    if isinstance(exc, redis.AuthenticationError):
        # without a password redis-py's first command is HELLO, whose refusal does not say "password"
        return (f"error: redis at {redacted(url or '')}: the server refused our credentials ({exc}); give them "
                f"in the URL, redis://:PASSWORD@HOST:PORT/DB or redis://USER:PASSWORD@..., or with --config")
    return f"error: redis at {redacted(url or '')}: {type(exc).__name__}: {exc}"


def _store(args: argparse.Namespace) -> FlagStore:
    return FlagStore(client_from_url(args.redis_url, timeout_s=args.timeout), Keys(args.prefix))


def _console() -> Console:
    # no markup: model, route and reason texts are printed as written ("[/]" is a valid route name)
    return Console(file=sys.stdout, width=160, markup=False)


def _when(ts: float | None) -> str:
    if ts is None:
        return ""
    try:
        return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):  # a time no datetime holds (written by hand, or before --ttl was bounded)
        return f"{ts:.0f} (unix s)" if ts == ts else str(ts)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


#: a reason column is never narrower than its longest word up to this width, so numbers and names
#: stay whole; a longer word (a URL) folds onto the next line, nothing is hidden
_MAX_TOKEN_WIDTH = 30


_NARROW = {"time", "changed at", "pinned until", "op", "precision", "previous", "epoch"}


def _table(*columns: str, reasons: Sequence[str] = ()) -> Table:
    """A table whose cells wrap at spaces and never hide text behind "…"; the reason column is
    at least as wide as its longest word, so numbers such as "0.80" are never split."""
    table = Table()
    longest = max((len(w) for r in reasons for w in r.split()), default=10)
    for name in columns:
        if name == "reason":
            table.add_column(name, overflow="fold", min_width=min(max(longest, 20), _MAX_TOKEN_WIDTH))
        else:  # identifiers fold (every character shown) within a bounded width
            table.add_column(name, overflow="fold", max_width=16 if name not in _NARROW else 12)
    return table


def _flags_table(flags: list[Flag], now: float) -> Table:
    table = _table("model", "route", "precision", "epoch", "pinned until", "changed at", "changed by",
                   "policy", "reason", reasons=[f.reason for f in flags])
    for f in flags:
        table.add_row(f.model, f.route, f.precision, str(f.epoch),
                      _when(f.pinned_until) if f.pinned(now) else "", _when(f.changed_at), f.changed_by,
                      f.policy, f.reason)
    return table


def _report(args: argparse.Namespace, result: FlipResult) -> int:
    args.result = result
    if args.json:
        _print_json({"applied": result.applied, "unchanged": result.unchanged, "refused": result.refused,
                     "model": result.model, "route": result.route, "precision": result.precision,
                     "epoch": result.epoch, "pinned_until": result.pinned_until})
    elif result.applied:
        pin = f", pinned until {_when(result.pinned_until)}" if result.pinned_until else ""
        _console().print(f"{result.model}/{result.route}: {result.precision} (epoch {result.epoch}{pin})")
    elif result.unchanged and getattr(args, "handler", "") == "cmd_unpin":
        _console().print(f"{result.model}/{result.route} is not pinned (serves {result.precision}, "
                         f"epoch {result.epoch}); nothing written")
    elif result.unchanged:
        _console().print(f"{result.model}/{result.route} already serves {result.precision} "
                         f"(epoch {result.epoch}); nothing written")
    else:
        _console().print(Text.assemble(("refused", "red"), f" {result.model}/{result.route}: {result.refused} "
                                       f"(current {result.precision or 'none'}, epoch {result.epoch})"))
    return 0 if result.refused is None else 1


def cmd_list(args: argparse.Namespace, store: FlagStore) -> int:
    flags = store.list()
    if args.json:
        _print_json([f.to_dict() for f in flags])
    elif not flags:
        _console().print("no route flags (gateways serve their default precision)")
    else:
        _console().print(_flags_table(flags, time.time()))
    return 0


def cmd_get(args: argparse.Namespace, store: FlagStore) -> int:
    flag = store.get(args.model, args.route)
    if args.json:
        _print_json(flag.to_dict() if flag else None)
    elif flag is None:
        _console().print(f"{args.model}/{args.route}: no flag (gateways serve their default precision)")
    else:
        _console().print(_flags_table([flag], time.time()))
    return 0 if flag is not None else 1


#: at most this many routes are read to tell a mistyped route from a known one (a SCAN of the
#: daemons' engine-state keys, one per route they judge)
MAX_KNOWN_ROUTES = 50_000


def known_routes(store: FlagStore, group: str) -> set[tuple[str, str]]:
    """Routes that exist for the daemons of consumer group ``group``: those with a flag and those
    the daemons keep policy state for (seen within ``windows.route_idle_s``), at most
    ``MAX_KNOWN_ROUTES`` of the latter."""
    known = {(f.model, f.route) for f in store.list()}
    for n, key in enumerate(store.client.scan_iter(match=store.keys.engine_pattern(group), count=1000)):
        if n >= MAX_KNOWN_ROUTES:
            break
        route = store.keys.engine_route(group, key.decode() if isinstance(key, bytes) else key)
        if route is not None:
            known.add(route)
    return known


def check_route_exists(args: argparse.Namespace, store: FlagStore, flag: Flag | None = None) -> int | None:
    """Before ``set``/``pin`` writes a flag for a route that has none: a route the daemons do not
    know is refused (exit 1) when it is close to one they know - a typo would leave the real route
    on its precision in the middle of an incident - and written with a warning otherwise (a route
    about to go live, or a deployment whose daemons have not judged it yet). ``--new-route`` skips
    the check (``flag``: the route's flag when the caller read it already). None when the command may go on."""
    if args.new_route or (flag or store.get(args.model, args.route)) is not None:
        return None
    known = known_routes(store, args.group)
    if (args.model, args.route) in known:
        return None
    name = f"{args.model}/{args.route}"
    routes = sorted(r for m, r in known if m == args.model)
    if routes:  # a known model: the route is what was mistyped
        close = difflib.get_close_matches(args.route, routes, n=1)
        hint = f"; did you mean {args.model + '/' + close[0]!r}?" if close else ""
    else:
        close = difflib.get_close_matches(args.model, sorted({m for m, _r in known}), n=1)
        hint = f"; did you mean model {close[0]!r}?" if close else ""
    if hint:
        sys.stderr.write(f"refused {name}: no such route (no flag, and no daemon of group {args.group!r} "
                         f"judges it){hint} (--new-route writes it anyway)\n")
        return 1
    sys.stderr.write(f"warning: {name} is a new route: no flag, and no daemon of group {args.group!r} "
                     f"judges it yet ({len(known)} known routes); writing it\n")
    return None


def cmd_set(args: argparse.Namespace, store: FlagStore) -> int:
    before = store.get(args.model, args.route)
    refused = check_route_exists(args, store, before)
    if refused is not None:
        return refused
    result = store.flip(args.model, args.route, args.precision, expected_epoch=args.expected_epoch,
                               reason=args.reason, policy="", changed_by=who(), manual=True)
    if result.applied and before is not None and before.pinned(time.time()) and before.precision != result.precision:
        # a manual set keeps the pin: it now holds the new precision against every policy (docs/ROUTING.md, "Pins")
        sys.stderr.write(f"warning: {args.model}/{args.route} was pinned to {before.precision} until "
                         f"{_when(before.pinned_until)} (last change by {before.changed_by or '?'}: "
                         f"{before.reason or '-'}); the pin now holds {result.precision} against every policy "
                         f"(`flags unpin` releases it)\n")
    return _report(args, result)


def cmd_pin(args: argparse.Namespace, store: FlagStore) -> int:
    refused = check_route_exists(args, store)
    if refused is not None:
        return refused
    result = store.pin(args.model, args.route, args.precision, args.ttl, reason=args.reason,
                              changed_by=who())
    return _report(args, result)


def cmd_unpin(args: argparse.Namespace, store: FlagStore) -> int:
    result = store.unpin(args.model, args.route, reason=args.reason, changed_by=who())
    return _report(args, result)


def cmd_maintenance(args: argparse.Namespace, store: FlagStore) -> int:
    """Declare (``--for``) or end (``--end``) an operator's maintenance on a route: the learned live
    latency rules re-baseline over it and judge nothing until it ended and both precisions settled
    (docs/JUDGE.md, "Deploys and maintenance"). Audited; model ``*``: every model of the route."""
    name = f"{args.model}/{args.route}"
    if args.end:
        old = store.maintenance(args.model, args.route, start=0.0, until=None, reason=args.reason,
                                changed_by=who())
        if old is None:
            print(f"{name}: no maintenance was declared (nothing to end)")
            return 0
        print(f"{name}: maintenance ended (it was declared until {_when(old.get('until'))} by "
              f"{old.get('by') or '?'}: {old.get('reason') or '-'})")
        return 0
    if args.duration is None:
        raise _UsageError("give --for DURATION (e.g. 30m) to declare maintenance, or --end to end it")
    if args.model == "*":
        if not any(r == args.route for _m, r in known_routes(store, args.group)) and not args.new_route:
            sys.stderr.write(f"warning: no model of route {args.route!r} has a flag or daemon state yet\n")
    else:
        refused = check_route_exists(args, store)
        if refused is not None:
            return refused
    now = time.time()
    start, until = now - args.started_ago, now + args.duration
    old = store.maintenance(args.model, args.route, start=start, until=until, reason=args.reason, changed_by=who())
    doc = {"model": args.model, "route": args.route, "start": start, "until": until, "reason": args.reason,
           "replaced": old}
    if args.json:
        _print_json(doc)
        return 0
    print(f"{name}: maintenance from {_when(start)} until {_when(until)} ({args.reason}); the live latency rules "
          f"re-baseline over it and judge nothing until both precisions settled after it"
          + (f"; it replaces the one until {_when(old.get('until'))}" if old else ""))
    return 0


def cmd_audit(args: argparse.Namespace, store: FlagStore) -> int:
    records = store.audit(args.count)
    if args.json:
        _print_json(records)
        return 0
    table = _table("time", "op", "model", "route", "precision", "previous", "epoch", "by", "policy", "reason",
                   reasons=[str(r.get("reason", "")) for r in records])
    for r in records:
        table.add_row(_when(r.get("ts")), f"{r.get('op', '')} ({r.get('mode', '')})", r.get("model", ""),
                      r.get("route", ""), r.get("precision", ""), r.get("previous", ""), str(r.get("epoch", "")),
                      r.get("changed_by", ""), r.get("policy", ""), r.get("reason", ""))
    _console().print(table)
    return 0


class _UsageError(ValueError):
    """Bad input found after parsing: exit 2 before Redis is contacted."""


def _settings(args: argparse.Namespace) -> Config:
    """Load the config and fill in --redis-url / --prefix; check the precision argument."""
    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as exc:
        raise _UsageError(f"--config {args.config or '(environment)'}: {exc}") from exc
    # --redis-url, then $LLMWD_REDIS__URL (already in cfg.redis.url), then the legacy spelling, then the file's
    args.redis_url = (args.redis_url or os.environ.get(REDIS_URL_VAR) or os.environ.get(LEGACY_REDIS_URL_VAR)
                      or cfg.redis.url)
    args.prefix = args.prefix or cfg.redis.prefix
    args.group = cfg.kafka.group_id
    problem = cluster_prefix_problem(args.redis_url, args.prefix)
    if problem is not None:
        raise _UsageError(f"{problem} (--prefix)")
    if getattr(args, "precision", None) is not None:
        precision = args.precision.strip().lower()
        if precision not in cfg.precisions:
            raise _UsageError(f"argument precision: {args.precision!r} is not one of the configured precisions "
                              f"({', '.join(cfg.precisions)}){did_you_mean(precision, cfg.precisions)}")
        args.precision = precision
    return cfg


def _summary(result: FlipResult, args: argparse.Namespace, by: str) -> str:
    what = {"cmd_set": f"set to {result.precision.upper()}",
            "cmd_pin": f"pinned to {result.precision.upper()} until {_when(result.pinned_until)}",
            "cmd_unpin": f"unpinned (serves {(result.precision or 'the default').upper()})"}[args.handler]
    return f"manual change: {result.model}/{result.route} {what} by {by} (epoch {result.epoch}): {args.reason}"


def announce(cfg: Config, result: FlipResult, args: argparse.Namespace, timeout_s: float = 5.0) -> bool | None:
    """Post an info message about a manual change on the configured channels; None when there is
    nothing to do, else whether every channel took it."""
    from watchdog.alerting.alerter import Alerter

    if not cfg.alerts.announce_manual_changes or not cfg.alerts.channels or getattr(args, "no_announce", False):
        return None
    by = who()
    alerter = Alerter.from_config([c.model_dump() for c in cfg.alerts.channels],
                                  status_url=cfg.server.status_url, max_attempts=3).start()
    alerter.ops_alert(f"manual/{result.model}/{result.route}/{result.epoch}", _summary(result, args, by), "info",
                      {"model": result.model, "route": result.route, "precision": result.precision,
                       "epoch": result.epoch, "changed_by": by, "reason": args.reason,
                       "pinned_until": result.pinned_until})
    return alerter.stop(timeout=timeout_s) and alerter.failed == 0


def _guarded(handler: Callable[[argparse.Namespace, FlagStore], int]) -> Callable[[argparse.Namespace], int]:
    """Checks the input, connects, runs ``handler``, closes, announces a manual change; bad input
    and Redis trouble become one line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        store: FlagStore | None = None
        try:
            cfg = _settings(args)
            store = _store(args)
            code = handler(args, store)
        except _UsageError as exc:
            sys.stderr.write(f"fp8-watchdog flags {getattr(args, 'flags_command', '')}: error: {exc}\n")
            return 2
        except (redis.RedisError, OSError) as exc:
            sys.stderr.write(redis_error_line(args.redis_url, exc) + "\n")
            return 2
        except ValueError as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 2
        finally:
            if store is not None:
                store.client.close()
        result: FlipResult | None = getattr(args, "result", None)
        if result is not None and result.applied:
            delivered = announce(cfg, result, args)
            if delivered is False:
                sys.stderr.write("warning: the change is applied and audited, but its announcement did not "
                                 "reach every alert channel\n")
        return code

    run.__name__ = handler.__name__
    return run


def _handler(p: argparse.ArgumentParser, handler: Callable[[argparse.Namespace, FlagStore], int]) -> None:
    p.set_defaults(func=_guarded(handler), handler=handler.__name__)


def add_flags_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``flags`` command (and its sub-commands) to an argparse ``subparsers`` object."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=os.environ.get("LLMWD_CONFIG") or None, metavar="FILE", type=config_file,
                        help="daemon config: Redis, precisions, alert channels (default: $LLMWD_CONFIG)")
    common.add_argument("--redis-url", default=None,
                        help=f"Redis URL (default: ${REDIS_URL_VAR}, the config's redis.url, or {DEFAULT_REDIS_URL})")
    common.add_argument("--prefix", default=None, help="key prefix (default: the config's, llmwd)")
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    common.add_argument("--timeout", type=positive_float, default=2.0, help="Redis socket timeout in seconds")
    change = argparse.ArgumentParser(add_help=False)
    change.add_argument("--no-announce", action="store_true",
                        help="do not post this change on the alert channels (it is audited either way)")
    new_route = argparse.ArgumentParser(add_help=False)
    new_route.add_argument("--new-route", action="store_true",
                           help="write the flag even if the route has none and no daemon judges it (by "
                                "default such a route is refused when its name is close to a known one)")

    flags = subparsers.add_parser("flags", help="read and change per-route precision flags in Redis")
    sub = flags.add_subparsers(dest="flags_command", metavar="COMMAND", required=True)

    p = sub.add_parser("list", parents=[common], help="every route flag")
    _handler(p, cmd_list)

    p = sub.add_parser("get", parents=[common], help="one route's flag (exit 1 when none)")
    p.add_argument("model", type=route_name)
    p.add_argument("route", type=route_name)
    _handler(p, cmd_get)

    p = sub.add_parser("set", parents=[common, change, new_route], help="set a route's precision (manual, audited)")
    p.add_argument("model", type=route_name)
    p.add_argument("route", type=route_name)
    p.add_argument("precision")
    p.add_argument("--reason", default="manual change")
    p.add_argument("--expected-epoch", type=non_negative_int, default=None,
                   help="refuse unless the flag is still at this epoch")
    _handler(p, cmd_set)

    p = sub.add_parser("pin", parents=[common, change, new_route], help="set a precision and hold it against policies for --ttl")
    p.add_argument("model", type=route_name)
    p.add_argument("route", type=route_name)
    p.add_argument("precision")
    p.add_argument("--ttl", type=pin_ttl, required=True, help="how long, e.g. 30m, 2h (at most 30d)")
    p.add_argument("--reason", default="manual pin")
    _handler(p, cmd_pin)

    p = sub.add_parser("unpin", parents=[common, change], help="let policies change the route again")
    p.add_argument("model", type=route_name)
    p.add_argument("route", type=route_name)
    p.add_argument("--reason", default="manual unpin")
    _handler(p, cmd_unpin)

    p = sub.add_parser("maintenance", parents=[common, new_route],
                       help="declare maintenance on a route (a deploy, a restart): latency rules re-baseline "
                            "and judge nothing until it ended and the route settled; audited")
    p.add_argument("model", type=route_name, help="the model, or '*' for every model of the route")
    p.add_argument("route", type=route_name)
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--for", dest="duration", type=maintenance_length, metavar="DURATION",
                      help="how long from now, e.g. 30m (at most 7d)")
    when.add_argument("--end", action="store_true", help="end the maintenance declared on the route")
    p.add_argument("--started-ago", type=parse_duration_or_zero, default=0.0, metavar="DURATION",
                   help="it began this long ago (the windows since are re-baselined too); default now")
    p.add_argument("--reason", default="maintenance")
    _handler(p, cmd_maintenance)

    p = sub.add_parser("audit", parents=[common], help="recent flag changes, newest first")
    p.add_argument("--count", type=positive_int, default=50, help="how many records (default %(default)s)")
    _handler(p, cmd_audit)
    return flags
