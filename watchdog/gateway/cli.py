"""``llm-watchdog gateway --config FILE``: serve the OpenAI-compatible routing gateway."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from watchdog.core.argtypes import tcp_port

log = logging.getLogger(__name__)


def cmd_gateway(args: argparse.Namespace) -> int:
    from watchdog.gateway.config import GatewayConfigError, load_gateway_config

    logging.getLogger("kafka").setLevel(logging.WARNING)
    prog = getattr(args, "prog", "fp8-watchdog")
    try:
        cfg = load_gateway_config(args.config)
    except (GatewayConfigError, OSError) as exc:
        problems = str(exc).splitlines()
        sep = " " if len(problems) == 1 else "\n"
        print(f"{prog} gateway: invalid configuration:{sep}{str(exc)}", file=sys.stderr)
        return 2
    for warning in cfg.warnings():
        print(f"{prog} gateway: warning: {warning}", file=sys.stderr)
    if args.port is not None:
        cfg.port = args.port
    if not cfg.pools:
        print(f"{prog} gateway: invalid configuration: gateway.pools is empty", file=sys.stderr)
        return 2
    try:
        import uvicorn
    except ImportError:
        print(f"{prog} gateway: needs the 'gateway' extra (pip install 'fp8-watchdog[gateway]')", file=sys.stderr)
        return 2
    from watchdog.gateway.server import build_gateway, raise_fd_limit, serve_metrics, uvicorn_config

    fd_warning = raise_fd_limit(cfg.max_connections)
    if fd_warning:
        print(f"{prog} gateway: warning: {fd_warning}", file=sys.stderr)

    try:  # bound here, not by uvicorn: a busy port is one line and exit 2, and port 0 logs the real one
        sock = _bind(cfg.host, cfg.port)
    except OSError as exc:
        print(f"{prog} gateway: cannot serve on {cfg.host}:{cfg.port}: {exc.strerror or exc} "
              "(another gateway there? set gateway.port or --port)", file=sys.stderr)
        return 2
    app = build_gateway(cfg)
    try:
        try:
            serve_metrics(app)
        except OSError as exc:
            print(f"{prog} gateway: cannot serve on {cfg.metrics.host}:{cfg.metrics.port}: {exc.strerror or exc} "
                  "(set gateway.metrics.port)", file=sys.stderr)
            return 2
        log.info("gateway on http://%s:%s/v1, %d pool(s), events %s", cfg.host, sock.getsockname()[1],
                 len(cfg.pools), f"to {cfg.events.topic}" if cfg.events.enabled else "off")
        uvicorn.Server(uvicorn_config(app, cfg.host, cfg.port)).run(sockets=[sock])
    finally:
        sock.close()
        if app.emitter is not None:
            app.emitter.close()
        app.flags.close()
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket as uvicorn's ``Config.bind_socket`` makes one, which exits on failure instead."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def add_gateway_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gateway", help="OpenAI-compatible routing gateway that obeys the Redis flags")
    p.add_argument("--config", required=True, help="YAML file with a gateway: section")
    p.add_argument("--port", type=tcp_port, default=None, help="overrides gateway.port (1-65535)")
    p.set_defaults(func=cmd_gateway)
