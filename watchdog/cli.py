"""``llm-watchdog`` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
from typing import Any

log = logging.getLogger("watchdog")

#: (module, function) pairs that add their subcommands; imported only when the CLI starts, and
#: each keeps heavy imports (torch, pynvml) inside its handlers
_PLUGINS = [
    ("watchdog.policy.cli", "add_policy_commands"),
    ("watchdog.flags_cli", "add_flags_commands"),
    ("probes.golden", "add_golden_commands"),
    ("probes.golden_replay", "add_replay_command"),
    ("probes.engines.torch_engine", "add_calibrate_command"),
    ("probes.gpu_cli", "add_gpu_commands"),
    ("watchdog.gateway.cli", "add_gateway_commands"),
]


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)


def cmd_run(args: argparse.Namespace) -> int:
    from watchdog.config import ConfigError, load_config
    from watchdog.daemon import Daemon
    from watchdog.policy import PolicyError
    from watchdog.server import StatusServer

    setup_logging(args.log_level)
    try:
        cfg = load_config(args.config)
    except (ConfigError, OSError) as exc:
        print(f"llm-watchdog: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    try:
        daemon = Daemon(cfg)
    except PolicyError as exc:
        print(f"llm-watchdog: invalid policies:\n{exc}", file=sys.stderr)
        return 2
    server = StatusServer(cfg.server.host, cfg.server.port, daemon.metrics.registry, daemon.status,
                          daemon.problems, daemon.alive).start()
    log.info("serving /metrics /healthz /readyz /status on %s", server.url)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %s: finishing the open windows and stopping", signal.Signals(signum).name)
        daemon.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGHUP, lambda *_: daemon.request_reload())
    try:
        daemon.run()
    finally:
        server.stop()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    try:
        resp = httpx.get(f"{args.url.rstrip('/')}/status", timeout=5)
    except httpx.HTTPError as exc:
        print(f"llm-watchdog: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    body = resp.json()
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{body['instance']}[/] up {body['uptime_s']} s, "
                  f"{'[green]ready' if body['ready'] else '[red]not ready'}[/]  {'; '.join(body['problems'])}")
    table = Table("route", "precision")
    for route, precision in sorted(body.get("flags", {}).items()):
        table.add_row(route, precision)
    console.print(table)
    for a in body.get("recent_actions", [])[-10:]:
        console.print(f"{a['kind']:>9} {a['model']}/{a['route']} by {a['policy']}: {a['reason']}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from watchdog.demo import run_demo

    setup_logging(args.log_level)
    return run_demo(duration_s=args.duration, golden=not args.no_golden)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-watchdog", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run the daemon")
    p.add_argument("--config", help="YAML config file (LLMWD_* environment variables override it)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="show a running daemon's status")
    p.add_argument("--url", default="http://127.0.0.1:9464")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("demo", help="embedded default: local broker, Redis, traffic, a real rollback")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--no-golden", action="store_true", help="skip the golden-replay part")
    p.set_defaults(func=cmd_demo)

    for module, func in _PLUGINS:
        try:
            getattr(importlib.import_module(module), func)(sub)
        except (ImportError, AttributeError) as exc:
            log.debug("subcommands of %s unavailable: %s", module, exc)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
