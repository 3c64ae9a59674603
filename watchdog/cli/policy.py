"""``policy`` subcommands for the ``fp8-watchdog`` CLI (wired in by watchdog/cli/main.py).

Each command sets ``func`` on the parsed namespace; call ``args.func(args)`` and exit with the
integer it returns.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from watchdog.core.argtypes import did_you_mean, existing_file, existing_path, output_file, usage_error
from watchdog.policy.loader import PolicyError, load_policy_files

_PROG = "fp8-watchdog policy backtest"


def add_policy_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``policy validate FILE...`` to an argparse subparsers object; returns the ``policy`` parser."""
    policy = subparsers.add_parser("policy", help="work with policy files")
    sub = policy.add_subparsers(dest="policy_command", required=True)
    validate = sub.add_parser("validate", help="check policy files; prints file:line:col errors")
    validate.add_argument("files", nargs="+", metavar="FILE", type=existing_path,
                          help="policy YAML files or directories")
    validate.set_defaults(func=cmd_validate)
    bt = sub.add_parser("backtest", help="replay recorded events (and golden reports) through policies")
    bt.add_argument("--policy", action="append", required=True, metavar="FILE", type=existing_path,
                    help="policy YAML file or directory (repeatable)")
    bt.add_argument("--events", required=True, metavar="FILE", type=existing_file,
                    help="recorded events, JSON lines (.gz ok)")
    bt.add_argument("--golden-reports", metavar="DIR", type=existing_path, help="golden drift report JSON files (a file or a tree)")
    bt.add_argument("--golden-scope", metavar="MODEL/ROUTE",
                    help="(model, route) of reports that do not name theirs (default: every route)")
    bt.add_argument("--window", default=None,
                    help="window length, e.g. 5m (default: picked from the recording: the smallest length at "
                         "which the most live rules reach their min_samples)")
    bt.add_argument("--grace", default=None, help="lateness allowed past a window's end (default min(2s, window/2))")
    bt.add_argument("--healthy-until", action="append", default=[], metavar="[ROUTE=]TIME",
                    help="windows ending by TIME are known healthy (for the false-rollback rate); TIME: HH:MM "
                         "(UTC, the recording's first day), +8m (after its start), an ISO time or 'end'; "
                         "ROUTE= limits it to routes matching a pattern (repeatable)")
    bt.add_argument("--metric", help="metric to plot (default: the metric of the rule that flipped first)")
    bt.add_argument("--png", metavar="OUT.png", type=output_file, help="write a timeline plot")
    bt.add_argument("--json", action="store_true", help="print JSON instead of a table")
    bt.set_defaults(func=cmd_backtest)
    return policy


def cmd_validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        if os.path.isdir(path) and not any(f.suffix in (".yaml", ".yml") and f.is_file() for f in Path(path).iterdir()):
            failed = True  # "OK (0 policies)" for a mistyped directory read as a pass
            print(f"{path}: no policy files (*.yaml, *.yml) in this directory", file=sys.stderr)
            continue
        try:
            ps = load_policy_files([path])
        except PolicyError as exc:
            failed = True
            for msg in exc.messages:
                print(msg, file=sys.stderr)
            if any("unknown key 'kafka'" in m or "unknown key 'redis'" in m for m in exc.messages):
                print(f"{path}: this looks like a daemon config, not a policy file; check it with "
                      f"`fp8-watchdog config check --config {path}`", file=sys.stderr)
            continue
        names = ", ".join(ps.names) or "no policies"
        print(f"{path}: OK ({len(ps.policies)} polic{'y' if len(ps.policies) == 1 else 'ies'}: {names})")
    if not failed and len(args.files) > 1:
        try:
            load_policy_files(args.files)
        except PolicyError as exc:  # names clash across files
            failed = True
            for msg in exc.messages:
                print(msg, file=sys.stderr)
    return 1 if failed else 0


def _looks_like_daemon_config(path: str, messages: list[str]) -> bool:
    return any(m.startswith(f"{path}:") and ("unknown key 'kafka'" in m or "unknown key 'redis'" in m)
               for m in messages)


def cmd_backtest(args: argparse.Namespace) -> int:
    from watchdog.policy.backtest import load_golden_reports, read_lines, run_backtest
    from watchdog.policy.backtest_report import false_rollbacks_of, render_png, render_table
    from watchdog.policy.backtest_stats import margin_table, parse_healthy
    from watchdog.policy.backtest_window import WindowChoiceError, choose_window
    from watchdog.policy.schema import LIVE_METRICS, parse_duration

    try:
        ps = load_policy_files(args.policy)
    except PolicyError as exc:
        configs = [p for p in args.policy if _looks_like_daemon_config(p, exc.messages)]
        for path in configs:
            print(f"{path}: this looks like a daemon config, not a policy file; pass the policy files its "
                  "policies: list names", file=sys.stderr)
        for msg in exc.messages:
            if not any(msg.startswith(f"{path}:") for path in configs):
                print(msg, file=sys.stderr)
        return 2
    try:
        window = None if args.window is None else parse_duration(args.window)
        grace = None if args.grace is None else parse_duration(args.grace)
    except ValueError as exc:
        return usage_error(_PROG, f"--window/--grace: {exc}")
    if window is not None and window <= 0:
        return usage_error(_PROG, "--window must be > 0")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        return usage_error(_PROG, "--png needs matplotlib: pip install 'fp8-watchdog[plot]'")
    problem = _not_json_lines(args.events, read_lines)
    if problem:
        return usage_error(_PROG, f"--events {args.events}: {problem}")
    if args.metric:
        known = set(LIVE_METRICS) | {r.metric for p in ps.policies for r in p.rules}
        if args.metric not in known:
            return usage_error(_PROG, f"--metric {args.metric!r} is not a metric of these policies or a live "
                                      f"metric{did_you_mean(args.metric, sorted(known))}")
    scope = None
    if args.golden_scope:
        model, sep, route = args.golden_scope.partition("/")
        if not sep or not model or not route:
            return usage_error(_PROG, "--golden-scope is MODEL/ROUTE")
        scope = (model, route)
    golden: list[Any] = []
    bad: list[str] = []
    if args.golden_reports:
        golden, bad = load_golden_reports(args.golden_reports, scope)
    for spec in args.healthy_until:  # the syntax, before a long replay
        try:
            parse_healthy(spec, 0.0)
        except ValueError as exc:
            return usage_error(_PROG, f"--healthy-until {exc}")
    note = None
    if window is None:
        try:
            choice = choose_window(ps, read_lines(args.events))
        except WindowChoiceError as exc:
            print(f"{_PROG}: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"{_PROG}: cannot read events: {exc}", file=sys.stderr)
            return 2
        window, note = choice.window_s, choice.summary()
    try:
        result = run_backtest(ps, read_lines(args.events), golden, window_s=window, grace_s=grace)
    except OSError as exc:
        print(f"{_PROG}: cannot read events: {exc}", file=sys.stderr)
        return 2
    if result.events == 0:  # "0 flips" would read as a pass (without --window this stops at the window choice)
        bad_note = f", {result.bad_lines} bad: {dict(result.bad_reasons)}" if result.bad_lines else ""
        print(f"{_PROG}: --events {args.events}: the recording holds no valid event ({result.lines} "
              f"lines{bad_note}); nothing to backtest", file=sys.stderr)
        return 2
    result.golden_bad = bad
    result.window_note = note
    try:
        healthy = [parse_healthy(spec, result.start or 0.0) for spec in args.healthy_until]
    except ValueError as exc:
        return usage_error(_PROG, f"--healthy-until {exc}")
    routes = sorted({(p["model"], p["route"]) for p in result.timeline})
    for spec, h in zip(args.healthy_until, healthy, strict=True):
        if routes and not any(h.matches(m, r) for m, r in routes):  # a typo marked nothing healthy
            names = sorted({r for _m, r in routes} | {f"{m}/{r}" for m, r in routes})
            return usage_error(_PROG, f"--healthy-until {spec!r}: {h.route!r} matches none of the recording's "
                                      f"routes ({', '.join(f'{m}/{r}' for m, r in routes[:5])}"
                                      f"{', ...' if len(routes) > 5 else ''}){did_you_mean(h.route, names)}")
        if result.start is not None and h.until < result.start:
            return usage_error(_PROG, f"--healthy-until {spec!r}: that is before the recording starts "
                                      f"({datetime.fromtimestamp(result.start, tz=UTC):%Y-%m-%d %H:%M:%S} UTC), "
                                      f"so it marks nothing healthy")
    metric = None
    if args.png:
        metric = render_png(result, ps, args.png, args.metric)
    if args.json:
        out = result.to_dict()
        out["margins"] = margin_table(result.verdicts, healthy or None)
        out["false_rollbacks"] = false_rollbacks_of(result, healthy).to_dict() if healthy else None
        if args.png:
            out["png"] = {"path": args.png, "metric": metric}
        print(json.dumps(out, indent=2))
    else:
        render_table(result, healthy=healthy)
        if args.png:
            print(f"timeline of {metric} written to {args.png}")
    return 0


#: lines ``_not_json_lines`` reads to tell a recording with a few bad lines from another kind of file
_SNIFF_LINES = 20


def _not_json_lines(path: str, read_lines: Any) -> str | None:
    """Why ``path`` is not JSON lines, or None. It sniffs the first ``_SNIFF_LINES`` non-blank
    lines to catch another kind of file (a README, a YAML file, one JSON array) before any work:
    one of them being a JSON object is enough, so a corrupt line 1 is skipped and counted by the
    backtest like a corrupt line anywhere else."""
    seen = 0
    try:
        for line in read_lines(path):
            if not line.strip():
                continue
            try:
                if isinstance(json.loads(line), dict):
                    return None
            except ValueError:
                pass
            seen += 1
            if seen >= _SNIFF_LINES:
                break
    except (OSError, EOFError) as exc:
        return f"cannot read: {exc}"
    if seen == 0:
        return None
    return (f"line 1 is not a JSON object{f', nor are the next {seen - 1} lines' if seen > 1 else ''} "
            "(expected JSON lines, one event per line)")


def main(argv: list[str] | None = None) -> int:
    from watchdog.core.argtypes import Parser

    parser = Parser(prog="fp8-watchdog")
    add_policy_commands(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors: exit code 2, already printed
        return int(exc.code or 0)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
