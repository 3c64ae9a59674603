"""``fp8-watchdog evidence list|export``: the evidence records of the daemon's decisions.

``evidence list`` prints the newest records (id, time, decision, route, policy, rules, reason);
``evidence export ID [--out DIR]`` writes ``<ID>.json`` (the record) and ``<ID>.html`` (its page,
self-contained: inline CSS, the timeline as an embedded PNG) into DIR. Settings come from
``--config`` (default ``$LLMWD_CONFIG``) as for ``flags``; ``--redis-url`` and ``--prefix`` win.
Exit codes: 0 done, 1 no such record, 2 bad input or Redis unreachable. docs/EVIDENCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from watchdog.cli.flags import DEFAULT_REDIS_URL, LEGACY_REDIS_URL_VAR, REDIS_URL_VAR, redis_error_line
from watchdog.config.settings import ConfigError, load_config
from watchdog.core.argtypes import config_file, positive_float, positive_int
from watchdog.core.keys import Keys
from watchdog.state.redis_conn import client_from_url


def _connect(args: argparse.Namespace) -> tuple[Any, Keys]:
    cfg = load_config(args.config)
    # as ``flags``: --redis-url, the daemon's variable (in cfg.redis.url already), the old spelling, the file's
    url = args.redis_url or os.environ.get(REDIS_URL_VAR) or os.environ.get(LEGACY_REDIS_URL_VAR) or cfg.redis.url
    args.redis_url = url
    return client_from_url(url, timeout_s=args.timeout), Keys(args.prefix or cfg.redis.prefix)


def _when(ts: Any) -> str:
    try:
        return datetime.fromtimestamp(float(ts), tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
    except (TypeError, ValueError, OverflowError, OSError):
        return ""


def cmd_list(args: argparse.Namespace, client: Any, keys: Keys) -> int:
    from watchdog.runtime.evidence import list_records

    records = list_records(client, keys, args.count)
    if args.json:
        sys.stdout.write(json.dumps(records, indent=2, default=str) + "\n")
        return 0
    if not records:
        print("no evidence records")
        return 0
    for r in records:
        print(f"{r['id']}  {_when(r.get('at'))}  {r.get('kind')}{' (dry run)' if r.get('dry_run') else ''}  "
              f"{r.get('model')}/{r.get('route')}  {r.get('policy')}  {','.join(map(str, r.get('rules') or []))}\n"
              f"    {r.get('reason')}")
    return 0


def cmd_export(args: argparse.Namespace, client: Any, keys: Keys) -> int:
    from watchdog.runtime.evidence import read_record
    from watchdog.runtime.evidence_http import page_html

    record = read_record(client, keys, args.id)
    if record is None:
        sys.stderr.write(f"no evidence record {args.id!r} (expired, or never written; see `evidence list`)\n")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in args.id)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
    (out / f"{stem}.html").write_text(page_html(record, standalone=True), encoding="utf-8")
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.html')}")
    return 0


def _guarded(handler: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        client = None
        try:
            client, keys = _connect(args)
            return int(handler(args, client, keys))
        except redis.RedisError as exc:
            sys.stderr.write(redis_error_line(args.redis_url, exc) + "\n")
            return 2
        except (ConfigError, OSError) as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 2
        finally:
            if client is not None:
                client.close()

    return run


def add_evidence_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``evidence list|export`` to an argparse ``subparsers`` object."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=os.environ.get("LLMWD_CONFIG") or None, metavar="FILE",
                        type=config_file, help="daemon config: Redis URL and prefix (default: $LLMWD_CONFIG)")
    common.add_argument("--redis-url", default=None, help=f"Redis URL (default: ${REDIS_URL_VAR}, the config's redis.url, or {DEFAULT_REDIS_URL})")
    common.add_argument("--prefix", default=None, help="key prefix (default: the config's, llmwd)")
    common.add_argument("--timeout", type=positive_float, default=2.0, help="Redis socket timeout in seconds")
    p = subparsers.add_parser("evidence", help="evidence records of rollbacks, promotes and alerts")
    sub = p.add_subparsers(dest="evidence_command", metavar="COMMAND", required=True)
    c = sub.add_parser("list", parents=[common], help="the newest evidence records")
    c.add_argument("--count", type=positive_int, default=50, help="how many (default %(default)s)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=_guarded(cmd_list))
    c = sub.add_parser("export", parents=[common], help="write one record as ID.json + a self-contained ID.html")
    c.add_argument("id", metavar="ID")
    c.add_argument("--out", default=".", metavar="DIR", help="directory to write into (default: here)")
    c.set_defaults(func=_guarded(cmd_export))
    return p
