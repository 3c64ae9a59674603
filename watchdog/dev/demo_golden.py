"""The golden-replay part of the embedded demo: a tiny model, real FP8 numerics, a real rollback.

A tiny Llama is trained on CPU for about a minute to answer the shipped ``code`` golden set (cached
under the demo folder afterwards), its FP8 activation scales are calibrated, and the daemon gets a
golden job comparing the in-process FP8 engine with the FP16 one. The demo runs the job twice: with
the calibrated scales (FP8 tracks FP16), then with scales gone stale (a new checkpoint served with
the old calibration, simulated by scaling them by 0.05): activations saturate at ±448, answers
drift, the paired test fails and the route is rolled back.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from probes.drift import DriftReport
from probes.engines.torch_engine import calibrate_model
from probes.golden import find_golden_set, load_golden_set
from probes.tiny_model import ensure_tiny_model

log = logging.getLogger(__name__)

JOB = "code-assist-fp8"
SET = "code"
ITEMS = 32  # the default policy's paired test needs at least 30 measured items
STALE_MULTIPLIER = 0.05
TRAIN_STEPS = 260


class GoldenDemo:
    def __init__(self, model: str, route: str, workdir: Path) -> None:
        self.model = model
        self.route = route
        self.workdir = workdir
        self.reports = workdir / "golden-reports"
        self.model_dir: Path | None = None

    def prepare(self, console: Console) -> None:
        golden = load_golden_set(find_golden_set(SET)).head(ITEMS)
        pairs = golden.pairs()
        cache = self.workdir / "models"
        console.print(f"   preparing the in-process engine: a tiny Llama trained on {len(pairs)} '{SET}' golden items "
                      f"(one to three minutes on CPU the first time, cached in {cache})")
        started = time.monotonic()
        # a fixed step budget (the time cap is only a safety net) gives the same model everywhere
        self.model_dir = ensure_tiny_model(cache, pairs, train_seconds=900.0, max_steps=TRAIN_STEPS)
        if not (self.model_dir / "fp8_calibration.json").exists():
            calibrate_model(self.model_dir, [p + r for p, r in pairs])
        console.print(f"   model ready in {time.monotonic() - started:.0f} s: {self.model_dir}")

    def job_config(self) -> dict[str, Any]:
        assert self.model_dir is not None
        engine = {"kind": "torch", "model_path": str(self.model_dir)}
        return {"name": JOB, "set": SET, "model": self.model, "routes": [self.route], "max_items": ITEMS,
                # per-output-channel weight scales, static calibrated activation scales
                "candidate": {**engine, "precision": "fp8", "fp8_weight_scale": "row"},
                "baseline": {**engine, "precision": "fp16"},
                "every_s": 6 * 3600, "jitter_s": 0, "on_suspicion": True}

    def run_phase(self, console: Console, daemon: Any) -> bool:
        scheduler = daemon.golden
        job = scheduler.jobs[JOB]
        console.print("   replay 1: FP8 with its calibrated activation scales")
        if not self._replay(console, scheduler):
            return False
        time.sleep(2)  # the daemon's loop picks the report up
        if daemon.flags.precision_for(self.model, self.route) != "fp8":
            console.print("[red]   a healthy FP8 replay rolled the route back[/]")
            return False
        console.print(f"   verdict: {self.route} stays on FP8")
        console.print(f"   replay 2: FP8 with stale activation scales (x{STALE_MULTIPLIER})")
        job.candidate["scale_multiplier"] = STALE_MULTIPLIER
        t0 = time.monotonic()
        if not self._replay(console, scheduler):
            return False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and daemon.flags.precision_for(self.model, self.route) != "fp16":
            time.sleep(0.2)
        if daemon.flags.precision_for(self.model, self.route) != "fp16":
            console.print("[red]   the stale FP8 calibration was not rolled back[/]")
            return False
        console.print(f"   [bold red]ROLLED BACK[/] {self.model}/{self.route} to FP16 "
                      f"{time.monotonic() - t0:.1f} s after the replay started")
        return True

    def _replay(self, console: Console, scheduler: Any) -> bool:
        started = time.monotonic()
        if not scheduler.run_job(JOB):
            console.print(f"[red]   golden replay failed: {scheduler.jobs[JOB].last_error}[/]")
            return False
        report = DriftReport.from_json((self.reports / JOB / "latest.json").read_text())
        s = report.summary("rougeL")
        agree = report.summary("agreement_rougeL")
        if s is not None:
            console.print(f"     {report.measured}/{report.n_items} items in {time.monotonic() - started:.0f} s: "
                          f"ROUGE-L FP8 {s.candidate:.3f} vs FP16 {s.baseline:.3f}, "
                          f"paired diff {s.diff_mean:+.3f} [95% CI {s.ci_low:+.3f}, {s.ci_high:+.3f}]"
                          + (f", FP8/FP16 agreement {agree.candidate:.2f}" if agree is not None else ""))
        saturation = scheduler.jobs[JOB].last_extra.get("fp8_saturation")
        if saturation is not None:
            console.print(f"     FP8 activations clipped at +-448: {saturation:.2%}")
        return True
