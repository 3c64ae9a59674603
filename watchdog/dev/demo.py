"""The embedded default: everything on this machine, and real rollbacks to watch.

Starts a Tansu broker and a redis-server on free ports, a local alert sink standing in for
on-call, the daemon with the shipped default policy, and a traffic generator that logs events for
three routes the way a gateway would (it reads the flags the daemon writes). When torch and the
gateway extra are installed, the fourth route is served for real: client threads → ``llm-watchdog
gateway`` → two OpenAI-compatible servers (a tiny model, FP8 and FP16) → events on the broker.
After a healthy phase the demo injects an FP8 quality regression on a synthetic route, then rolls a
stale FP8 calibration out to the gateway's FP8 replica; the daemon rolls both routes back and the
gateway's served-precision header switches. Then a golden replay with the in-process engine
catches a stale FP8 calibration on a third route. Library logs go to ``<workdir>/demo.log``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from watchdog.config.settings import Config, load_config
from watchdog.core.starter import starter_path
from watchdog.core.text import shorten
from watchdog.dev.alertsink import AlertSink
from watchdog.dev.embedded import free_port, start_redis, start_tansu
from watchdog.dev.evidence_link import print_evidence_link
from watchdog.dev.traffic import Route, TrafficGenerator
from watchdog.runtime.daemon import Daemon
from watchdog.runtime.http import StatusServer

log = logging.getLogger(__name__)

MODEL = "llama-3.1-8b-instruct"
ROUTES = ["support/chat", "legal/contracts", "medical/triage", "code/assist"]
REGRESSED = "legal/contracts"
GOLDEN_ROUTE = "code/assist"
GATEWAY_ROUTE = "support/chat"
ROOT = Path(__file__).resolve().parents[2]  # the checkout, when there is one


def _default_policy() -> Path:
    """The shipped default policy: packaged with the wheel, else the checkout's (watchdog.core.starter)."""
    return starter_path("policies") / "default.yaml"


def _default_workdir() -> Path:
    """``.demo/`` in a checkout; outside one (an installed wheel) a folder under the temp dir."""
    if (ROOT / "pyproject.toml").exists():
        return ROOT / ".demo"
    import tempfile

    return Path(tempfile.gettempdir()) / "llm-watchdog-demo"


def _wait(cond: Callable[[], bool], timeout: float, tick: Callable[[], None] | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if tick:
            tick()
        time.sleep(0.5)
    return cond()


def _flag_table(daemon: Daemon) -> Table:
    table = Table("route", "precision", "epoch", "changed by", "reason", title="Redis routing flags")
    flags = {(f.model, f.route): f for f in daemon.store.list()}
    for route in ROUTES:
        f = flags.get((MODEL, route))
        if f is None:
            table.add_row(route, f"{daemon.cfg.default_precision} (default)", "-", "-", "-")
        else:
            style = "bold red" if f.precision != daemon.cfg.default_precision else "green"
            table.add_row(route, f"[{style}]{f.precision}[/]", str(f.epoch), f.changed_by, shorten(f.reason, 70))
    return table


def _log_to_file(path: Path) -> None:
    """Library logs (kafka, the daemon, the gateway) go to ``path``; the console keeps the story."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            root.removeHandler(h)
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:  # transformers' weight-loading progress bars would interleave with the story
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def run_demo(duration_s: float | None = None, golden: bool = True, workdir: Path | None = None,
             gateway: bool = True) -> int:
    console = Console()
    workdir = workdir or _default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    _log_to_file(workdir / "demo.log")
    console.rule("[bold]llm-watchdog embedded default")
    console.print(f"library logs: {workdir / 'demo.log'}")
    kafka = start_tansu(workdir=workdir / "tansu")
    redis_svc = start_redis(workdir=workdir / "redis", appendonly=False)
    sink = AlertSink(echo=False)
    sink_url = sink.start()
    console.print(f"Kafka-protocol broker (Tansu) on {kafka.address}, redis-server on {redis_svc.address}, "
                  f"on-call sink on {sink_url}")
    topic = "llm.inference.logs"
    gw, golden_probe, policies, golden_cfg = _prepare_parts(console, workdir, gateway, golden)
    cfg = _demo_config(kafka.address, redis_svc.address, sink_url, topic, policies, golden_cfg)
    daemon = Daemon(cfg)
    server = StatusServer(cfg.server.host, cfg.server.port, daemon.metrics.registry, daemon.status,
                          daemon.problems, daemon.alive, pages=daemon.evidence_pages).start()
    console.print(f"daemon: /metrics /healthz /readyz /status on {server.url}")
    thread = threading.Thread(target=daemon.run, name="llmwd-daemon", daemon=True)
    thread.start()

    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=kafka.address, linger_ms=20)
    synthetic = [r for r in ROUTES if gw is None or r != GATEWAY_ROUTE]
    traffic = TrafficGenerator([Route(MODEL, r, rate=70.0) for r in synthetic], precision_of=daemon.flags.precision_for)
    traffic.start(producer, topic)
    started = time.monotonic()
    code = 0
    try:
        if gw is not None:
            gw.start_gateway(console, cfg.redis.url, daemon.keys.prefix, kafka.address, topic)
            gw.start_clients()
        code = _story(console, daemon, sink, traffic, gw, golden_probe, duration_s, started)
    finally:
        if gw is not None:
            gw.stop()
        traffic.stop()
        producer.close(timeout=5)
        daemon.stop()
        thread.join(timeout=20)
        server.stop()
        sink.stop()
        kafka.stop()
        redis_svc.stop()
    console.rule("[bold green]demo finished" if code == 0 else "[bold red]demo failed")
    return code


def _prepare_parts(console: Console, workdir: Path, gateway: bool,
                   golden: bool) -> tuple[Any, Any, list[str], dict[str, Any]]:
    """The optional parts (the real gateway, the golden replay) that are installed, prepared:
    (gateway demo or None, golden demo or None, policy files, ``golden:`` settings)."""
    gw = _gateway_demo(console, workdir) if gateway else None
    policies = [str(_default_policy())]
    if gw is not None:
        gw.prepare(console)
        policies.append(str(gw.policy_file()))
    golden_probe = _golden_probe(console, workdir) if golden else None
    golden_cfg: dict[str, Any] = {}
    if golden_probe is not None:
        golden_probe.prepare(console)
        golden_cfg = {"jobs": [golden_probe.job_config()], "reports_dir": str(golden_probe.reports)}
    return gw, golden_probe, policies, golden_cfg


def _demo_config(kafka_address: str, redis_address: str, sink_url: str, topic: str, policies: list[str],
                 golden_cfg: dict[str, Any]) -> Config:
    """The daemon's settings for the demo: 2 s windows, the local broker, Redis and alert sink."""
    return load_config(
        None,
        policies=policies,
        kafka={"bootstrap_servers": kafka_address, "topic": topic, "group_id": "llm-watchdog-demo",
               "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
        redis={"url": f"redis://{redis_address}/0"},
        windows={"length_s": 2.0, "grace_s": 0.5},
        # the shipped policy routes to slack and pages pagerduty; the webhook hears ops alerts
        alerts={"channels": [{"kind": "webhook", "url": f"{sink_url}/webhook"},
                             {"kind": "slack", "url": f"{sink_url}/slack"},
                             {"kind": "pagerduty", "url": f"{sink_url}/pagerduty", "routing_key": "demo"}]},
        server={"port": free_port()},
        golden=golden_cfg,
    )


def _story(console: Console, daemon: Daemon, sink: AlertSink, traffic: TrafficGenerator, gw: Any,
           golden_probe: Any, duration_s: float | None, started: float) -> int:
    """The demo's phases, told on the console; 0 when every expected rollback happened."""
    code = 0
    _healthy_phase(console, daemon, traffic, gw)
    if not _regression_phase(console, daemon, sink, traffic):
        code = 1

    if gw is not None and not _gateway_phase(console, daemon, sink, gw):
        code = 1

    if golden_probe is not None:
        console.print(f"[bold]{4 if gw else 3}. Golden replay[/] with the in-process engine on {GOLDEN_ROUTE}: a healthy FP8 "
                      "calibration, then a stale one (real FP8 numerics)")
        if not golden_probe.run_phase(console, daemon):
            code = 1
        else:
            _show_evidence(console, daemon, sink, GOLDEN_ROUTE)

    if duration_s is not None:
        remaining = duration_s - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)
    console.print(_flag_table(daemon))
    stats = daemon.status()
    console.print(f"Status: ready={stats['ready']} windows_closed={stats['windows_closed']} "
                  f"incidents={len(stats['incidents'])} alerts={json.dumps(stats['alerts'].get('sent', stats['alerts']))}")
    return code


def _healthy_phase(console: Console, daemon: Daemon, traffic: TrafficGenerator, gw: Any) -> None:
    console.print(f"[bold]1. Healthy traffic[/] on {len(ROUTES)} routes (FP8 + a FP16 baseline slice + shadows); "
                  "windows of 2 s" + (f"; {GATEWAY_ROUTE} through the gateway, the others synthetic" if gw else ""))
    _wait(lambda: daemon.stats.windows_closed >= 4 * len(ROUTES) * 2, 40)
    console.print(f"   {traffic.sent} synthetic events sent, {daemon.stats.windows_closed} windows closed, "
                  f"actions so far: {daemon.stats.actions}")
    if gw is not None:
        counts = gw.counts()
        console.print(f"   gateway: {sum(counts.values())} client requests answered, served precision "
                      f"{dict(counts)}; events sent {gw.gateway.app.emitter.sent}, "
                      f"dropped {gw.gateway.app.emitter.dropped}")
    console.print(_flag_table(daemon))


def _regression_phase(console: Console, daemon: Daemon, sink: AlertSink, traffic: TrafficGenerator) -> bool:
    """Inject an FP8 quality regression on a synthetic route; True when the daemon rolled it back."""
    console.print(f"[bold]2. Injecting an FP8 quality regression[/] on {REGRESSED}: FP8 answers drift from "
                  "their FP16 shadows, token log-probabilities drop")
    t_inject = time.monotonic()
    traffic.inject(MODEL, REGRESSED, "quality")
    flipped = _wait(lambda: daemon.flags.precision_for(MODEL, REGRESSED) == "fp16", 90)
    if not flipped:
        console.print("[red]the route was not rolled back within 90 s[/]")
        return False
    console.print(f"   [bold red]ROLLED BACK[/] {MODEL}/{REGRESSED} to FP16 "
                  f"{time.monotonic() - t_inject:.1f} s after the regression began")
    _show_evidence(console, daemon, sink, REGRESSED)
    return True


def _show_evidence(console: Console, daemon: Daemon, sink: AlertSink, route: str) -> None:
    print_evidence_link(console, daemon, MODEL, route)
    flag = daemon.store.get(MODEL, route)
    if flag is not None:
        console.print(f"   Redis hash {daemon.keys.route(MODEL, route)}: precision={flag.precision} epoch={flag.epoch} "
                      f"policy={flag.policy} changed_by={flag.changed_by}")
        console.print(f"     reason: {flag.reason}")
    for rec in daemon.store.audit(count=20):
        if rec.get("route") == route:
            console.print(f"   audit stream {daemon.keys.audit}: {rec.get('previous') or 'default'} -> {rec.get('precision')}"
                          f" epoch {rec.get('epoch')} by {rec.get('changed_by')}")
            break
    _wait(lambda: any(route in json.dumps(r.body) for r in sink.received), 10)
    for r in sink.received:
        if r.path.endswith("slack") and route in json.dumps(r.body):
            body: Any = r.body
            console.print(f"   on-call alert received at {r.path}: {body.get('text')}")
            break


def _gateway_phase(console: Console, daemon: Daemon, sink: AlertSink, gw: Any) -> bool:
    console.print(f"[bold]3. Through the gateway[/]: a checkpoint with stale FP8 scales (x0.05) reaches the FP8 "
                  f"replica behind {GATEWAY_ROUTE}")
    precision, answer = gw.sample_answer()
    console.print(f"   before: X-LLMWD-Precision: {precision}, answer {answer!r}")
    t_inject, wall_inject = time.monotonic(), time.time()
    gw.inject_stale_fp8()
    precision, answer = gw.sample_answer()
    console.print(f"   after the rollout: X-LLMWD-Precision: {precision}, answer {answer!r} "
                  "(its FP16 shadow still says ' Paris.')")
    if not _wait(lambda: daemon.flags.precision_for(MODEL, GATEWAY_ROUTE) == "fp16", 60):
        console.print("[red]   the gateway route was not rolled back within 60 s[/]")
        return False
    flag = daemon.store.get(MODEL, GATEWAY_ROUTE)
    flipped_after = (flag.changed_at - wall_inject) if flag is not None and flag.changed_at else \
        time.monotonic() - t_inject
    console.print(f"   [bold red]ROLLED BACK[/] {MODEL}/{GATEWAY_ROUTE} to FP16 {flipped_after:.1f} s after the rollout")
    if not _wait(lambda: gw.first_switch is not None, 10):
        console.print("[red]   the gateway did not switch to FP16[/]")
        return False
    precision, answer = gw.sample_answer()
    counts = gw.counts(t_inject)
    console.print(f"   the gateway served FP16 from the next request on ({gw.first_switch[0] - t_inject:.1f} s after "
                  f"the rollout): X-LLMWD-Precision: {precision}, answer {answer!r}; served since the rollout "
                  f"{dict(counts)}")
    _show_evidence(console, daemon, sink, GATEWAY_ROUTE)
    return precision == "fp16"


def _gateway_demo(console: Console, workdir: Path) -> Any:
    missing = [m for m in ("torch", "transformers", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        console.print(f"[yellow]gateway part skipped: {', '.join(missing)} not installed "
                      f"({escape(_install_hint('torch,gateway'))})[/]")
        return None
    from watchdog.dev.gateway_demo import GatewayDemo

    return GatewayDemo(MODEL, GATEWAY_ROUTE, workdir)


def _install_hint(extras: str) -> str:
    """How to add ``extras``: printed through rich, so the caller escapes the brackets (unescaped,
    ``[torch,gateway]`` was taken for markup and vanished). The distribution is fp8-watchdog; PyPI's
    ``llm-watchdog`` is another project."""
    return f"pip install 'fp8-watchdog[{extras}]'"


def _golden_probe(console: Console, workdir: Path) -> Any:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        console.print(f"[yellow]golden replay part skipped: {', '.join(missing)} not installed "
                      f"({escape(_install_hint('torch'))})[/]")
        return None
    from watchdog.dev.demo_golden import GoldenDemo

    return GoldenDemo(MODEL, GOLDEN_ROUTE, workdir)
