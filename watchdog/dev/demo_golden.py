"""The golden-replay part of the embedded demo: a tiny model, real FP8 numerics, a real rollback.

The in-process engine serves a tiny Llama that answers the first 32 items of the shipped ``code``
golden set. The daemon gets a golden job comparing the FP8 engine (per-row weight scales, static
calibrated activation scales) with the FP16 one and runs it twice: with the calibrated scales, then
with scales gone stale (a new checkpoint served with the old calibration, simulated by scaling
them by 0.05): activations saturate at +-448, answers fall apart, the route is rolled back.

Why the healthy replay passes on any CPU, by construction rather than by luck: the model is
trained FP8-aware until every reference token leads the next best token by at least
``FP8_MARGIN`` nats, in plain and in emulated-FP8 forward passes (``probes.tiny_model``), and it is
shipped (``probes/data/demo_code_model``), so no machine retrains it. Greedy FP8 and FP16 then both
reproduce every reference; a CPU's float kernels move logits by ~1e-5, nowhere near the margin.
``prepare`` measures that margin on the machine at hand and prints it; after each replay the demo
prints how far the verdict is from the rollback line (healthy: inside, stale: beyond). A golden set
that no longer matches the shipped model makes the demo train one with the same recipe (minutes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

import probes
from probes.drift import DriftReport
from probes.engines.torch_engine import calibrate_model
from probes.golden import find_golden_set, load_golden_set
from probes.tiny_model import ensure_tiny_model
from watchdog.policy.judge.paired import broken_items_to_fail

log = logging.getLogger(__name__)

JOB = "code-assist-fp8"
SET = "code"
ITEMS = 32  # the default policy's paired test needs at least 30 measured items
STALE_MULTIPLIER = 0.05
#: the training recipe of the demo model: FP8-aware until every reference token leads by this
FP8_MARGIN = 4.0
MAX_STEPS = 2000
#: the model built by ``python -m probes.tiny_model --set code --items 32 --fp8-margin 4``
SHIPPED_MODEL = Path(probes.__file__).resolve().parent / "data" / "demo_code_model"
RULE = "golden-rougeL"
#: the FP8 engine options the golden job uses (row weight scales, static calibrated activations)
FP8_OPTIONS: dict[str, Any] = {"precision": "fp8", "fp8_weight_scale": "row"}


@dataclass(frozen=True, slots=True)
class MarginCheck:
    """The smallest logit margin along the references, teacher-forced, per engine (nats; > 0:
    greedy decoding reproduces the reference), and how many references each reproduces."""

    n: int
    fp16: float
    fp8: float
    fp8_items: int
    stale_items: int

    def describe(self) -> str:
        return (f"every reference token leads the next best by >= {self.fp16:.2f} nats in FP16 and >= "
                f"{self.fp8:.2f} in calibrated FP8: greedy FP8 reproduces {self.fp8_items}/{self.n} references, "
                f"with stale scales {self.stale_items}/{self.n} (another CPU's float kernels change logits in "
                f"their last bits; weight noise 1,000x larger moves them < 0.05 nats - docs/GOLDEN.md)")


def shipped_model_fits(pairs: list[tuple[str, str]]) -> bool:
    """Whether the shipped demo model was trained on exactly these (prompt, reference) pairs."""
    meta = SHIPPED_MODEL / "tiny_model.json"
    if not meta.exists() or not (SHIPPED_MODEL / "model.safetensors").exists():
        return False
    return [tuple(p) for p in json.loads(meta.read_text(encoding="utf-8"))["pairs"]] == pairs


def demo_model(cache: Path, pairs: list[tuple[str, str]]) -> tuple[Path, str]:
    """The demo's model directory (a writable copy under ``cache``: calibration is written next to
    it) and where it came from. The shipped model when it was trained on exactly ``pairs``, else
    one trained here with the same recipe (cached)."""
    if shipped_model_fits(pairs):
        digest = hashlib.sha256((SHIPPED_MODEL / "model.safetensors").read_bytes()).hexdigest()[:12]
        target = cache / f"demo-code-{digest}"
        if not (target / "tiny_model.json").exists():
            tmp = cache / f".demo-code-{digest}-{time.monotonic_ns()}"
            shutil.copytree(SHIPPED_MODEL, tmp)
            try:
                tmp.rename(target)
            except OSError:  # another process copied it first
                shutil.rmtree(tmp, ignore_errors=True)
        return target, "shipped"
    path = ensure_tiny_model(cache, pairs, train_seconds=3600.0, max_steps=MAX_STEPS, fp8_margin=FP8_MARGIN)
    return path, "trained here"


def margin_check(model_dir: Path, pairs: list[tuple[str, str]]) -> MarginCheck:
    """Teacher-forced margins of the FP16, healthy FP8 and stale FP8 engines on ``pairs``."""
    from probes.engines.torch_engine import TorchEngine
    from probes.tiny_model import reference_margins

    out: dict[str, list[float]] = {}
    for name, opts in (("fp16", {"precision": "fp16"}), ("fp8", FP8_OPTIONS),
                       ("stale", {**FP8_OPTIONS, "scale_multiplier": STALE_MULTIPLIER})):
        engine = TorchEngine(model_dir, fast="off", track_saturation=False, **opts)
        try:
            out[name] = reference_margins(engine.model, engine.tokenizer, pairs)
        finally:
            engine.close()
    return MarginCheck(n=len(pairs), fp16=min(out["fp16"]), fp8=min(out["fp8"]),
                       fp8_items=sum(m > 0 for m in out["fp8"]), stale_items=sum(m > 0 for m in out["stale"]))


def describe_margin(verdict: Any, rule: Any) -> list[str]:
    """How far a golden verdict of ``rule`` (a judged paired rule with ``broken``) is from the
    rollback line, on each of its two tests: the broken-items count against the fewest broken
    items that would fail, and the mean difference's interval against the threshold."""
    j = verdict.judgement or {}
    detail = j.get("detail", {})
    lines = []
    bt = detail.get("broken_test")
    judge = rule.judge
    if bt and judge is not None and judge.broken is not None:
        k0, n0 = bt["null"]
        n, count = int(bt["n"]), int(bt["count"])
        line = broken_items_to_fail(n, null_broken=float(k0), null_items=float(n0), alpha=judge.broken_alpha,
                                    effect_threshold=judge.broken.effect, tolerance=bt.get("tolerance"))
        what = f"{count}/{n} items broke by > {judge.broken.drop:g}"
        if line is None:
            lines.append(f"broken items: {what}; no count of {n} items could roll back")
        elif count < line:
            lines.append(f"broken items: {what}; rollback at {line} or more: {line - count} short of it")
        else:
            lines.append(f"broken items: {what}; rollback at {line} or more: {count - line} past it")
    if j.get("method") != "broken_items" and j.get("ci_low") is not None and j.get("ci_high") is not None:
        effect = float(j.get("effect_threshold") or 0.0)
        higher = detail.get("direction", "higher_is_better") == "higher_is_better"
        # the interval end nearest the harmful side decides: rollback when it is past -effect
        edge = float(j["ci_high"]) if higher else float(j["ci_low"])
        distance = (edge + effect) if higher else (effect - edge)
        where = "inside" if distance >= 0 else "beyond"
        line_at = -effect if higher else effect
        lines.append(f"mean {verdict.metric} difference {float(j['estimate']):+.3f}, interval "
                     f"[{float(j['ci_low']):+.3f}, {float(j['ci_high']):+.3f}]; rollback when all of it is "
                     f"{'below' if higher else 'above'} {line_at + 0.0:g}: {abs(distance):.3f} {where}")
    return lines


class GoldenDemo:
    def __init__(self, model: str, route: str, workdir: Path) -> None:
        self.model = model
        self.route = route
        self.workdir = workdir
        self.reports = workdir / "golden-reports"
        self.model_dir: Path | None = None
        self.check: MarginCheck | None = None
        #: the golden rule's verdict on each replay: ("healthy" | "stale", status, margin lines)
        self.outcomes: list[tuple[str, str, list[str]]] = []

    def prepare(self, console: Console) -> None:
        import torch

        # a tiny model's matrices gain nothing from threads, and on a loaded 2-core machine the
        # thread hand-offs dominate (measured: a 32-item replay 44 s on 2 threads, 4.3 s on 1)
        torch.set_num_threads(1)
        golden = load_golden_set(find_golden_set(SET)).head(ITEMS)
        pairs = golden.pairs()
        cache = self.workdir / "models"
        started = time.monotonic()
        if not shipped_model_fits(pairs):
            console.print(f"   training the in-process engine's tiny Llama on {len(pairs)} '{SET}' golden items, "
                          f"FP8-aware until every reference token leads by {FP8_MARGIN:g} nats (minutes on CPU "
                          f"the first time, cached in {cache})")
        self.model_dir, origin = demo_model(cache, pairs)
        if not (self.model_dir / "fp8_calibration.json").exists():
            calibrate_model(self.model_dir, [p + r for p, r in pairs])
        self.check = margin_check(self.model_dir, pairs)
        console.print(f"   in-process engine: a tiny Llama ({origin}) answering {len(pairs)} '{SET}' golden items, "
                      f"FP8 scales calibrated, ready in {time.monotonic() - started:.0f} s")
        console.print(f"   robust by construction: {self.check.describe()}")

    def job_config(self) -> dict[str, Any]:
        assert self.model_dir is not None
        engine = {"kind": "torch", "model_path": str(self.model_dir)}
        return {"name": JOB, "set": SET, "model": self.model, "routes": [self.route], "max_items": ITEMS,
                # per-output-channel weight scales, static calibrated activation scales
                "candidate": {**engine, **FP8_OPTIONS},
                "baseline": {**engine, "precision": "fp16"},
                # no schedule: the demo runs its replays itself (a scheduled one could run between them)
                "every_s": None, "jitter_s": 0, "on_suspicion": True}

    def run_phase(self, console: Console, daemon: Any) -> bool:
        scheduler = daemon.golden
        job = scheduler.jobs[JOB]
        console.print("   replay 1: FP8 with its calibrated activation scales")
        report = self._replay(console, scheduler)
        if report is None:
            return False
        verdict = self._verdict(daemon, report)
        if daemon.flags.precision_for(self.model, self.route) != "fp8":
            console.print("[red]   a healthy FP8 replay rolled the route back[/]")
            self._show_verdict(console, "healthy", verdict, daemon)
            return False
        self._show_verdict(console, "healthy", verdict, daemon)
        console.print(f"   verdict: {self.route} stays on FP8")
        console.print(f"   replay 2: FP8 with stale activation scales (x{STALE_MULTIPLIER})")
        job.spec.candidate["scale_multiplier"] = STALE_MULTIPLIER
        t0 = time.monotonic()
        report = self._replay(console, scheduler)
        if report is None:
            return False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and daemon.flags.precision_for(self.model, self.route) != "fp16":
            time.sleep(0.2)
        self._show_verdict(console, "stale", self._verdict(daemon, report), daemon)
        if daemon.flags.precision_for(self.model, self.route) != "fp16":
            console.print("[red]   the stale FP8 calibration was not rolled back[/]")
            return False
        console.print(f"   [bold red]ROLLED BACK[/] {self.model}/{self.route} to FP16 "
                      f"{time.monotonic() - t0:.1f} s after the replay started")
        return True

    def _verdict(self, daemon: Any, report: DriftReport, timeout: float = 15.0) -> tuple[str, Any] | None:
        """(policy name, the golden rule's verdict on this report) once the daemon judged it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = list(daemon.engine.states.items())
            except RuntimeError:  # the daemon's loop changed the dict while we copied it
                continue
            for (policy, model, route), st in states:
                rs = st.rules.get(RULE)
                if (model, route) == (self.model, self.route) and rs is not None and rs.last is not None \
                        and rs.last.end >= report.finished_at - 1e-3:
                    return policy, rs.last
            time.sleep(0.2)
        return None

    def _show_verdict(self, console: Console, kind: str, found: tuple[str, Any] | None, daemon: Any) -> None:
        if found is None:
            console.print(f"[yellow]     no {RULE} verdict on this replay yet[/]")
            self.outcomes.append((kind, "missing", []))
            return
        policy_name, verdict = found
        policy = daemon.engine.policy_set.get(policy_name)
        rule = policy.rule(RULE) if policy is not None else None
        lines = describe_margin(verdict, rule) if rule is not None else []
        self.outcomes.append((kind, verdict.status, lines))
        style = "red" if verdict.status == "fail" else "green"
        console.print(f"     {policy_name}/{RULE}: [{style}]{verdict.status}[/]")
        for line in lines:
            console.print(f"       {line}")

    def _replay(self, console: Console, scheduler: Any) -> DriftReport | None:
        started = time.monotonic()
        if not scheduler.run_job(JOB):
            console.print(f"[red]   golden replay failed: {scheduler.jobs[JOB].last_error}[/]")
            return None
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
        return report
