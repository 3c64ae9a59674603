"""``policy`` subcommands for the ``llm-watchdog`` CLI (wired in by watchdog/cli.py).

Each command sets ``func`` on the parsed namespace; call ``args.func(args)`` and exit with the
integer it returns.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from watchdog.policy.loader import PolicyError, load_policy_files


def add_policy_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``policy validate FILE...`` to an argparse subparsers object; returns the ``policy`` parser."""
    policy = subparsers.add_parser("policy", help="work with policy files")
    sub = policy.add_subparsers(dest="policy_command", required=True)
    validate = sub.add_parser("validate", help="check policy files; prints file:line:col errors")
    validate.add_argument("files", nargs="+", metavar="FILE", help="policy YAML files or directories")
    validate.set_defaults(func=cmd_validate)
    return policy


def cmd_validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            ps = load_policy_files([path])
        except PolicyError as exc:
            failed = True
            for msg in exc.messages:
                print(msg, file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llm-watchdog")
    add_policy_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
