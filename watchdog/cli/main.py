"""fp8-watchdog (alias llm-watchdog): the FP8 serving watchdog daemon and its tools.

Examples:
  fp8-watchdog init ./wd                          # starter config, policies, golden sets
  fp8-watchdog embedded                           # local Redis + Kafka-protocol broker
  fp8-watchdog config check --config ./wd/config.yaml
  fp8-watchdog run --config ./wd/config.yaml
  fp8-watchdog flags list
"""

from __future__ import annotations

# Only what the interpreter has loaded already is imported at the top: everything else is imported
# inside main(), where Ctrl-C becomes one line (a KeyboardInterrupt during a module-level import would
# print a traceback before main() runs).
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse
    import logging

    from watchdog.config.settings import Config

#: commands that log at INFO by default; the others log only warnings unless --log-level says so
_CHATTY = {"run", "demo", "embedded", "gateway"}

#: (subcommand, module, function): the function adds the subcommand; its module is imported only when
#: the CLI starts, and only that one when the command line names its subcommand (the policy and Redis
#: modules the others import cost ~0.7 s of every command's start); each keeps heavy imports (torch,
#: pynvml) inside its handlers
_PLUGINS = [
    ("policy", "watchdog.cli.policy", "add_policy_commands"),
    ("flags", "watchdog.cli.flags", "add_flags_commands"),
    ("golden", "probes.golden", "add_golden_commands"),
    ("replay", "probes.golden_replay", "add_replay_command"),
    ("calibrate", "probes.engines.torch_engine", "add_calibrate_command"),
    ("gpu", "probes.gpu_cli", "add_gpu_commands"),
    ("gateway", "watchdog.gateway.cli", "add_gateway_commands"),
    ("evidence", "watchdog.cli.evidence", "add_evidence_commands"),
]


def _plugins_for(argv: list[str] | None) -> list[tuple[str, str, str]]:
    """The plugins to load for ``argv``: the one whose subcommand is its first word that is neither an
    option nor ``--log-level``'s value, else all (``--help``, a typo that needs the full list)."""
    words = iter(argv or ())
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return [p for p in _PLUGINS if p[0] == word] or _PLUGINS
    return _PLUGINS


def _log() -> logging.Logger:
    import logging

    return logging.getLogger("watchdog")


def _load_config(args: argparse.Namespace) -> Config | None:
    """The ``Config`` named by ``--config``, or None after printing the one-line cause."""
    from watchdog.config.settings import ConfigError, load_config

    try:
        return load_config(args.config)
    except (ConfigError, OSError) as exc:
        print(f"{args.prog}: invalid configuration: {exc}", file=sys.stderr)
        return None


def cmd_run(args: argparse.Namespace) -> int:
    from watchdog.config.settings import env_hint, env_overrides
    from watchdog.core.os_signals import SignalThread
    from watchdog.policy import PolicyError
    from watchdog.runtime.daemon import Daemon
    from watchdog.runtime.http import StatusServer

    if args.config is None:  # the built-in defaults alone are never what an operator meant to run
        print(f"{args.prog} run: no config file: pass --config FILE (or set $LLMWD_CONFIG); "
              f"'{args.prog} init DIR' writes a starter DIR/config.yaml", file=sys.stderr)
        return 2
    cfg = _load_config(args)
    if cfg is None:
        return 2
    for var in env_overrides(os.environ)[1]:  # a typo such as LLMWD_KAFKA_BOOTSTRAP_SERVERS (one _)
        _log().warning("$%s matches no config key and is ignored%s", var, env_hint(var))
    for problem in _golden_job_problems(cfg):  # said now, not at the job's first run (an hour away)
        _log().warning("%s; the job will fail when it runs (`config check` refuses this config)", problem)
    try:
        daemon = Daemon(cfg)
    except PolicyError as exc:
        print(_startup_policy_errors(f"{args.prog} run", exc.messages), file=sys.stderr)
        return 2
    try:
        server = StatusServer(cfg.server.host, cfg.server.port, daemon.metrics.registry, daemon.status,
                              daemon.problems, daemon.alive, pages=daemon.evidence_pages).start()
    except OSError as exc:
        print(f"{args.prog}: cannot serve HTTP on {cfg.server.host}:{cfg.server.port}: {exc.strerror or exc} "
              f"(another daemon there? set server.port or $LLMWD_SERVER__PORT)", file=sys.stderr)
        return 2
    _log().info("serving /metrics /healthz /readyz /status on %s", server.url)

    stopping: list[signal.Signals] = []

    def _stop(sig: signal.Signals) -> None:
        if not stopping:  # a second SIGINT/SIGTERM while it stops changes nothing: logged once
            _log().info("signal %s: checkpointing and stopping", sig.name)
        stopping.append(sig)
        daemon.stop()

    # on a thread of their own: a handler that runs inside the main thread's Event.set deadlocked
    signals = SignalThread({signal.SIGTERM: _stop, signal.SIGINT: _stop,
                            signal.SIGHUP: lambda _sig: daemon.request_reload()}).start()
    try:
        daemon.run()
    except Exception:  # noqa: BLE001 - logged with its traceback by the daemon (crash-only exit)
        return 1
    finally:
        server.stop()
        signals.close()
    return 0


def _startup_policy_errors(prog: str, messages: list[str]) -> str:
    """One start-up message per bad policy file: a header naming the file, its problems below."""
    by_file: dict[str, list[str]] = {}
    for msg in messages:  # each is file:line:col: message
        path = msg.split(":", 1)[0] if msg.count(":") >= 3 else "<policies>"
        by_file.setdefault(path, []).append(msg)
    out = []
    for path, problems in by_file.items():
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        out.append(f"{prog}: not started: policy file {path} is invalid ({count}):")
        out.extend(f"  {p}" for p in problems)
    return "\n".join(out)


def cmd_status(args: argparse.Namespace) -> int:
    import json

    import httpx

    if args.url is None:
        args.url = "http://127.0.0.1:9464"
        if args.config:
            from watchdog.config.settings import ConfigError, load_config

            try:
                server = load_config(args.config).server
            except (ConfigError, OSError) as exc:
                print(f"fp8-watchdog status: --config {args.config}: {exc}", file=sys.stderr)
                return 2
            host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
            args.url = f"http://{host}:{server.port}"
    try:
        resp = httpx.get(f"{args.url.rstrip('/')}/status", timeout=5)
    except httpx.HTTPError as exc:
        print(f"fp8-watchdog status: cannot reach {args.url}: {exc} (is the daemon running? "
              f"--url or --config picks another address)", file=sys.stderr)
        return 1
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "ready" not in body:
        print(f"fp8-watchdog status: {args.url} answered HTTP {resp.status_code} with no watchdog status "
              f"(is it the daemon's server.port? --url picks another address)", file=sys.stderr)
        return 1
    # as `systemctl is-active`: 0 ready, 3 answered but not ready (a script's `status || page` notices
    # an outage), 1 nothing or no watchdog answered
    code = 0 if body["ready"] else 3
    if args.json:
        print(json.dumps(body, indent=2))
        return code
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{body['instance']}[/] up {body['uptime_s']} s, "
                  f"{'[green]ready' if body['ready'] else '[red]not ready'}[/]  {'; '.join(body['problems'])}",
                  highlight=False)
    if body.get("policies") is not None:
        console.print(f"policies in force: {', '.join(body['policies']) or 'none'}", highlight=False)
    # open incidents: a rejected policy edit, a pinned route the policy wanted to flip, a flip budget spent...
    # (ops incidents leave readiness alone: the daemon still does its job, on the last good policies)
    incidents = body.get("incidents") or []
    if incidents:
        total = body.get("incidents_total", len(incidents))
        console.print(f"[bold]{total} open incident{'s' if total != 1 else ''}[/]:")
        for inc in incidents:
            console.print(f"  [{inc.get('severity', '')}] {inc.get('key', '')}: {inc.get('summary', '')}",
                          markup=False, highlight=False)
    table = Table("route", "precision")
    for route, precision in sorted(body.get("flags", {}).items()):
        table.add_row(route, precision)
    console.print(table)
    for a in body.get("recent_actions", [])[-10:]:
        console.print(f"{a['kind']:>9} {a['model']}/{a['route']} by {a['policy']}: {a['reason']}")
    return code


def cmd_demo(args: argparse.Namespace) -> int:
    from watchdog.dev.demo import run_demo

    code = run_demo(duration_s=args.duration, golden=not args.no_golden)
    if getattr(args, "own_process", False):
        # run_demo stopped every service, server and thread it started. What is left is the interpreter's
        # teardown of torch and the gateway's native threads, which aborted after "demo finished"
        # ("terminate called without an active exception", exit 134: `make demo` failed); skip it, as
        # tests/conftest.py does after pytest's summary
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_config_check(args: argparse.Namespace) -> int:
    import json

    import yaml

    from watchdog.alerting.channels import channel_names
    from watchdog.config.redact import redacted
    from watchdog.config.settings import env_hint, env_overrides
    from watchdog.policy import PolicyError, load_policy_files

    cfg = _load_config(args)
    if cfg is None:
        return 2
    problems: list[str] = []
    if _gateway_only(args.config):  # a gateway's own file: no policies or golden jobs of a daemon to load
        print("note: a gateway-only file (one top-level key, gateway): the daemon's policies and golden jobs "
              "are not checked", file=sys.stderr)
    else:
        try:  # with the channels the daemon would have: a policy's actions may name those only
            load_policy_files(cfg.policies, channel_names(list(cfg.alerts.channels)) or None, cfg.precisions)
        except PolicyError as exc:
            problems.extend(exc.messages)
        problems.extend(_golden_job_problems(cfg))
    if cfg.gateway and args.config:  # the gateway section is validated by its own model
        from watchdog.gateway.config import GatewayConfigError, load_gateway_config

        try:
            for warning in load_gateway_config(args.config).warnings():
                print(f"warning: {warning}", file=sys.stderr)
        except GatewayConfigError as exc:
            problems.extend(str(exc).splitlines())
    for var in env_overrides(os.environ)[1]:
        print(f"warning: ${var} matches no config key and is ignored{env_hint(var)}", file=sys.stderr)
    if cfg.alerts.channels and not cfg.server.external_url:
        print(f"warning: alerts will link to {cfg.server.status_url}; set server.external_url to the address "
              "on-call can open", file=sys.stderr)
    dump = redacted(cfg.model_dump(mode="json"))
    if args.json:
        print(json.dumps(dump, indent=2, sort_keys=True))
    else:
        print(yaml.safe_dump(dump, sort_keys=False).rstrip())
    for line in problems:
        print(line, file=sys.stderr)
    return 2 if problems else 0


def _gateway_only(path: str | None) -> bool:
    """Whether the config file holds a ``gateway`` section and nothing else (already loaded once)."""
    if not path:
        return False
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(raw, dict) and set(raw) == {"gateway"}


def _golden_job_problems(cfg: Config) -> list[str]:
    """What the daemon's golden jobs would fail on at their first run, found now: an unknown engine
    kind or option (with "did you mean"), an engine library not installed, a set that is not there.
    Nothing is built or loaded."""
    from probes.engines import check_engine
    from probes.golden import GoldenSetError, find_golden_set

    problems = []
    for i, job in enumerate(cfg.golden.jobs):
        where = f"golden.jobs.{i} ({job.name})"
        for side, spec in (("candidate", job.candidate), ("baseline", job.baseline)):
            options = dict(spec)
            kind = options.pop("kind", None)
            if not isinstance(kind, str):
                problems.append(f"{where}: {side}: no engine kind (kind: torch, openai or tensorrt_llm)")
                continue
            try:
                check_engine(kind, **options)
            except ValueError as exc:  # UnknownEngineError is one
                problems.append(f"{where}: {side}: {exc}")
        try:
            find_golden_set(job.set, cfg.golden.root)
        except GoldenSetError as exc:
            problems.extend(f"{where}: {e}" for e in exc.errors)
    return problems


def cmd_init(args: argparse.Namespace) -> int:
    from watchdog.cli.init import InitError, init_dir

    try:
        written = init_dir(args.dir, force=args.force)
    except (InitError, OSError) as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    cfg = os.path.join(args.dir, "config.yaml")
    print(f"wrote {len(written)} files under {args.dir}: config.yaml, policies/, golden_sets/\n"
          f"next:\n  {args.prog} embedded --redis-port 0 --kafka-port 0 > services.env &   "
          "# local Redis + broker\n  until [ -s services.env ]; do sleep 0.5; done; . ./services.env\n"
          f"  {args.prog} config check --config {cfg}\n  {args.prog} run --config {cfg}")
    return 0


def cmd_embedded(args: argparse.Namespace) -> int:
    import threading

    from watchdog.core.os_signals import SignalThread
    from watchdog.dev.embedded import ServiceError, start_redis, start_tansu

    busy = [f"{what} port {port}" for what, port in (("--redis-port", args.redis_port),
                                                        ("--kafka-port", args.kafka_port)) if port and _in_use(port)]
    if busy:
        print(f"{args.prog} embedded: {', '.join(busy)} already in use (another Redis or broker?); "
              "pass 0 for a free port", file=sys.stderr)
        return 2
    services = []
    stop = threading.Event()
    signals = SignalThread({signal.SIGTERM: lambda _sig: stop.set(), signal.SIGINT: lambda _sig: stop.set()}).start()
    try:
        services.append(start_redis(args.redis_port or None, appendonly=False))
        services.append(start_tansu(args.kafka_port or None))
        redis_svc, kafka_svc = services
        print(f"export LLMWD_REDIS__URL=redis://{redis_svc.address}/0\n"
              f"export LLMWD_KAFKA__BOOTSTRAP_SERVERS={kafka_svc.address}\n"
              f"# Redis {redis_svc.address} and Tansu {kafka_svc.address} are up; Ctrl-C stops them",
              flush=True)
        while not stop.wait(1.0):
            if not all(s.running() for s in services):
                print(f"{args.prog} embedded: a service exited; stopping", file=sys.stderr)
                return 1
        return 0
    except ServiceError as exc:
        print(f"{args.prog} embedded: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    finally:
        for svc in reversed(services):
            svc.stop()
        signals.close()


def _in_use(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _port(value: str) -> int:
    import argparse

    n = int(value) if value.isdigit() else -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value!r} (0-65535, 0 = a free one)")
    return n


def _config_arg(p: argparse.ArgumentParser) -> None:
    from watchdog.core.argtypes import config_file

    p.add_argument("--config", default=os.environ.get("LLMWD_CONFIG") or None, metavar="FILE", type=config_file,
                   help="YAML config file (default $LLMWD_CONFIG; LLMWD_* variables override it)")


def build_parser(prog: str = "fp8-watchdog", argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: every subcommand, or with ``argv`` the built-in ones and the plugin it names."""
    import argparse
    import importlib

    from watchdog.core.argtypes import Parser, add_log_level_everywhere, log_level, positive_float

    parser = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", type=log_level, default=None,
                        help="DEBUG, INFO, WARNING, ERROR (default INFO for run/demo/embedded, else WARNING); "
                             "also accepted after the subcommand")
    parser.set_defaults(prog=prog)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the daemon")
    _config_arg(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="show a running daemon's status")
    p.add_argument("--url", default=None,
                   help="the daemon's HTTP address (default: from --config's server.host/port, else "
                        "http://127.0.0.1:9464)")
    _config_arg(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("config", help="check a config file")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="COMMAND")
    c = csub.add_parser("check", help="print the effective config (secrets redacted); exit 2 on a problem")
    _config_arg(c)
    c.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    c.set_defaults(func=cmd_config_check)

    p = sub.add_parser("init", help="write a starter config, policies and golden sets into DIR")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("embedded", help="start local Redis and a Kafka-protocol broker for the example config")
    p.add_argument("--redis-port", type=_port, default=6379, help="0 = a free port (default %(default)s)")
    p.add_argument("--kafka-port", type=_port, default=9092, help="0 = a free port (default %(default)s)")
    p.set_defaults(func=cmd_embedded)

    p = sub.add_parser("demo", help="embedded default: local broker, Redis, traffic, a real rollback")
    p.add_argument("--duration", type=positive_float, default=None,
                   help="keep it running until this many seconds after the traffic started (each part still runs "
                        "to its end: about a minute in all, more on a busy CPU)")
    p.add_argument("--no-golden", action="store_true", help="skip the golden-replay part")
    p.set_defaults(func=cmd_demo)

    for _command, module, func in _plugins_for(argv):
        try:
            getattr(importlib.import_module(module), func)(sub)
        except (ImportError, AttributeError) as exc:
            _log().debug("subcommands of %s unavailable: %s", module, exc)
    add_log_level_everywhere(parser)
    return parser


#: set by the process's SIGINT handler: whatever a library makes of the KeyboardInterrupt (wraps it, or
#: replaces it while cleaning up), the command was interrupted
_SIGINT_SEEN: list[bool] = []
#: set once ``main`` is inside its ``try``: before that the handler only records the signal, since a
#: KeyboardInterrupt raised on the way into ``main`` (its first instruction checks for signals) is outside it
_ARMED: list[bool] = []
_NAMES = ("fp8-watchdog", "llm-watchdog")


def _on_sigint(signum: int, frame: object) -> None:
    _SIGINT_SEEN.append(True)
    if _ARMED:
        raise KeyboardInterrupt


def _on_unraisable(hook: object) -> None:
    """A Ctrl-C that lands inside a weakref callback or ``__del__`` (importlib's module-lock callback, seen
    in CI 0.4 s into ``flags list``) is printed as "Exception ignored" and swallowed there: deliver it again
    a moment later, when that callback has returned."""
    if isinstance(getattr(hook, "exc_value", None), KeyboardInterrupt):
        import contextlib
        import threading

        # no new thread while the interpreter shuts down (RuntimeError): it is ending anyway
        with contextlib.suppress(RuntimeError):
            threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()
        return
    sys.__unraisablehook__(hook)  # type: ignore[arg-type]


def _take_sigint(argv: list[str] | None) -> None:
    if argv is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = _on_unraisable


# the console script imports this module and then calls main(): a Ctrl-C between the two is recorded here
# and turned into one line by main
if os.path.basename(sys.argv[0] if sys.argv else "") in _NAMES:
    _take_sigint(None)


def main(argv: list[str] | None = None) -> int:
    prog = "fp8-watchdog"
    try:  # first thing: a Ctrl-C that lands even in the name lookup below is one line too
        _take_sigint(argv)
        if signal.getsignal(signal.SIGINT) is _on_sigint:  # this process's handler (never a caller's)
            _ARMED.append(True)
            if _SIGINT_SEEN:  # it came between the import of this module and here
                raise KeyboardInterrupt
        name = os.path.basename(sys.argv[0]) if argv is None else prog
        if name in _NAMES:
            prog = name
        _import_unsafe_to_interrupt()
        return _main(argv, prog)
    except KeyboardInterrupt:  # Ctrl-C anywhere (the first second is spent importing): one line, no traceback
        return _interrupted(prog, argv)
    except Exception as exc:
        # CPython 3.11 wraps an exception raised while a class is created (``__set_name__``, e.g. in a
        # dataclass of a module being imported) in a RuntimeError: a Ctrl-C there is still a Ctrl-C
        if not _SIGINT_SEEN and not _caused_by_ctrl_c(exc):
            raise
        return _interrupted(prog, argv)


def _caused_by_ctrl_c(exc: BaseException) -> bool:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        cause = todo.pop()
        if cause is None or id(cause) in seen:
            continue
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        todo += [cause.__cause__, cause.__context__]
    return False


def _import_unsafe_to_interrupt() -> None:
    """Import, with SIGINT blocked, the extension modules whose initialisation crashes the process when a
    Ctrl-C lands inside it: orjson's init imports Python modules, a KeyboardInterrupt raised there leaves it a
    NULL it does not check, and the process dies of SIGSEGV (seen at a Ctrl-C 50 ms into ``config check``, 1 in
    3). Blocked, the signal waits at the OS until the import is done and then lands in Python code, where
    ``main`` turns it into one line."""
    if "orjson" in sys.modules or not hasattr(signal, "pthread_sigmask"):
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        import orjson  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _interrupted(prog: str, argv: list[str] | None) -> int:
    if argv is None:  # a real process: a second Ctrl-C while it exits ends it at once, silently
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130


def _main(argv: list[str] | None, prog: str) -> int:
    from watchdog.core.argtypes import setup_logging

    parser = build_parser(prog, sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    setup_logging(args.log_level or ("INFO" if args.command in _CHATTY else "WARNING"))
    args.own_process = argv is None  # the console script, not a caller in the same interpreter
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
