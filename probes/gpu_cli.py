"""``gpu`` command: print GPU health as a table (rich) or JSON.

Exit codes: 0 = read (or NVML unavailable, which is printed clearly and is not a GPU failure),
2 = at least one GPU has a critical problem. Wire it with ``add_gpu_commands(subparsers)``; run
alone with ``python -m probes.gpu_cli``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from probes.gpu import GpuHealth, decode_reading
from probes.gpu_read import init_nvml, read_all
from probes.xid import XidListener, XidLog
from watchdog.core.argtypes import non_negative_float, non_negative_int, output_file, positive_float

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CRITICAL = 2


def add_gpu_commands(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gpu", help="show GPU health read through NVML")
    _add_arguments(p)
    p.set_defaults(func=run_gpu_command)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--watch", action="store_true", help="repeat every --interval seconds until Ctrl-C")
    p.add_argument("--interval", type=positive_float, default=2.0, help="seconds between readings with --watch")
    p.add_argument("--count", type=non_negative_int, default=0, help="with --watch: stop after this many readings")
    p.add_argument("--raw", action="store_true", help="include the raw NVML reading in the JSON")
    p.add_argument("--record", metavar="PATH", type=output_file, help="also write the raw NVML reading to PATH (JSON)")
    p.add_argument("--listen", type=non_negative_float, default=0.0, metavar="SECONDS",
                   help="register for XID events and wait this long for them before reading")


def _listen(seconds: float) -> dict[str, Any]:
    """Register for XID events on every GPU, wait, and report registrations and events seen."""
    nv, reason = init_nvml()
    if nv is None:
        return {"state": "unavailable", "reason": reason}
    xlog = XidLog()
    listener = XidListener(xlog, timeout_ms=200)
    try:
        n = listener.start(nv)
        time.sleep(seconds)
    finally:
        listener.stop()
        nv.nvmlShutdown()
    return {"registered": n, "registrations": listener.registrations, "error": listener.error,
            "waited_s": seconds, "events": [e.to_dict() for e in xlog.recent]}


def snapshot() -> tuple[dict[str, Any], list[GpuHealth]]:
    reading = read_all()
    return reading, decode_reading(reading)


def _fmt(value: Any, unit: str = "") -> str:
    return "-" if value is None else f"{value}{unit}"


def render_table(reading: dict[str, Any], health: list[GpuHealth], console: Any) -> None:
    from rich.table import Table

    if not reading.get("nvml_available"):
        console.print(f"[yellow]NVML unavailable[/yellow]: {reading.get('error')}\n"
                      "GPU health cannot be read on this host; nothing is rolled back because of it.")
        return
    sf = reading.get("system", {}).get("fields", {})
    cuda = sf.get("cuda_driver_version")
    cuda_txt = f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "-"
    table = Table(title=f"GPU health — driver {sf.get('driver_version', '-')}, CUDA {cuda_txt}")
    for col in ("gpu", "name", "cc", "temp/slow", "power", "clocks SM/mem", "reasons", "ECC unc",
                "remap c/u/pend/fail", "FP8", "status"):
        table.add_column(col)
    for h in health:
        cc = f"{h.compute_capability[0]}.{h.compute_capability[1]}" if h.compute_capability else "-"
        rows = "-" if h.remap_pending is None else (
            f"{h.remapped_rows_correctable}/{h.remapped_rows_uncorrectable}/"
            f"{int(bool(h.remap_pending))}/{int(bool(h.remap_failure))}")
        problems = [p for p in h.problems if p.severity != "info"]
        status = ("[red]CRITICAL[/red] " if h.critical else "[yellow]warn[/yellow] " if problems else "[green]ok[/green]")
        status += "; ".join(p.code for p in problems)
        table.add_row(
            f"{h.index}" + (f" MIG {h.mig_gpu_instance_id}" if h.parent_uuid else ""), _fmt(h.name), cc,
            f"{_fmt(h.temperature_c)}/{_fmt(h.slowdown_c)} C",
            f"{_fmt(h.power_w)}/{_fmt(h.power_limit_w)} W",
            f"{_fmt(h.sm_clock_mhz)}/{_fmt(h.mem_clock_mhz)} MHz", ",".join(h.clock_event_names) or "-",
            _fmt(h.ecc_uncorrected_volatile), rows,
            "-" if h.fp8_capable is None else ("yes" if h.fp8_capable else "no"), status)
    console.print(table)
    for h in health:
        for p in h.problems:
            console.print(f"gpu {h.index}: {p.severity.upper()} {p.code}: {p.reason}", markup=False)
        if h.absent:
            console.print(f"gpu {h.index}: not supported here: {', '.join(h.absent)}")


def _once(args: argparse.Namespace, console: Any) -> int:
    reading, health = snapshot()
    if args.record:
        with open(args.record, "w", encoding="utf-8") as fh:
            json.dump(reading, fh, indent=1, sort_keys=True)
    if args.json:
        out: dict[str, Any] = {"nvml_available": reading["nvml_available"], "error": reading["error"],
                               "time": reading["time"], "system": reading.get("system", {}).get("fields", {}),
                               "gpus": [h.to_dict() for h in health]}
        if args.raw:
            out["reading"] = reading
        print(json.dumps(out, indent=1, default=str))
    else:
        render_table(reading, health, console)
    return EXIT_CRITICAL if any(h.critical for h in health) else EXIT_OK


def run_gpu_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if args.listen > 0:
        print(json.dumps({"xid_listen": _listen(args.listen)}, indent=1, default=str))
    if not args.watch:
        return _once(args, console)
    code, n = EXIT_OK, 0
    try:
        while True:
            if not args.json:
                console.clear()
            code = _once(args, console)
            n += 1
            if args.count and n >= args.count:
                return code
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return code


def main(argv: list[str] | None = None) -> int:
    from watchdog.core.argtypes import Parser

    parser = Parser(prog="python -m probes.gpu_cli", description="GPU health via NVML")
    _add_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run_gpu_command(parser.parse_args(argv))


__all__ = ["add_gpu_commands", "run_gpu_command", "main", "render_table"]

if __name__ == "__main__":
    sys.exit(main())
