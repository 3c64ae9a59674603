"""Drift report of one golden replay: per-item results, paired statistics, rendering, signals.

Pure data and statistics (plus ``save``). ``probes.golden_replay`` fills a ``DriftReport``; the
policy engine sees it through ``to_signals`` as ``source="golden"`` signals.
"""

from __future__ import annotations

import calendar
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from probes.drift_outputs import regressed_outputs
from probes.metrics import LOWER_IS_BETTER
from watchdog.core.signals import Signal

SCHEMA = 1
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
#: regressed items kept in the ranking
TOP_REGRESSIONS = 10
#: ``save``'s name of a report: ``report-<UTC finish time>.json`` (``latest.json`` is its copy)
REPORT_STAMP = "%Y%m%dT%H%M%SZ"
REPORT_NAME = re.compile(r"report-(\d{8}T\d{6}Z)\.json")


def paired_bootstrap_ci(
    diffs: Any,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    confidence: float = CONFIDENCE,
) -> tuple[float, float, float] | None:
    """Mean of per-item differences and its percentile bootstrap interval.

    Items are resampled with replacement ``resamples`` times in one vectorised draw (seeded, so a
    report is reproducible). None when there are no items."""
    d = np.asarray(diffs, dtype=float)
    if d.size == 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(resamples, d.size))
    means = d[idx].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(d.mean()), float(lo), float(hi)


def prune_reports(directory: str | os.PathLike[str], keep: int, max_age_s: float | None = None,
                  now: float | None = None) -> list[Path]:
    """Delete the reports ``DriftReport.save`` wrote in ``directory`` beyond the newest ``keep`` and,
    with ``max_age_s``, those that finished longer ago than that before ``now`` (by the time in their
    names, which a copy keeps). ``latest.json``, ``summary.txt`` and other files stay. Returns the
    deleted paths."""
    stamped = sorted(((m[1], p) for p in Path(directory).iterdir() if (m := REPORT_NAME.fullmatch(p.name))),
                     reverse=True)
    cutoff = None if max_age_s is None else (time.time() if now is None else now) - max_age_s
    gone = []
    for n, (stamp, path) in enumerate(stamped):
        finished = _stamp_time(stamp)
        if finished is None:
            continue
        if n >= keep or (cutoff is not None and finished < cutoff):
            path.unlink(missing_ok=True)
            gone.append(path)
    return gone


def _stamp_time(stamp: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(stamp, REPORT_STAMP)))
    except ValueError:  # a name like a report's, with no such date: not one save wrote
        return None


@dataclass(slots=True)
class SideResult:
    """One engine's answer to one item."""

    output: str = ""
    error: str | None = None
    latency_ms: float | None = None
    #: metric -> value for this output (text metrics and, when scored, reference perplexity)
    scores: dict[str, float] = field(default_factory=dict)


def failed_side(items: list[ItemResult]) -> str:
    """``candidate``, ``baseline`` or ``both``: whose engine failed the items that failed (``candidate``
    when no error says which)."""
    cand = any(i.candidate.error is not None for i in items)
    base = any(i.baseline.error is not None for i in items)
    return "both" if cand and base else "baseline" if base else "candidate"


@dataclass(slots=True)
class ItemResult:
    id: str
    reference: str
    candidate: SideResult
    baseline: SideResult
    tags: list[str] = field(default_factory=list)
    #: ROUGE-L between the candidate and baseline outputs
    agreement: float | None = None
    #: the baseline's second answer (an A/A replay), when the replay repeated the baseline
    repeat: SideResult | None = None
    #: ``GoldenSet.version`` of the item as replayed (None in reports written before 2026-12-08)
    version: str | None = None

    @property
    def failed(self) -> bool:
        return self.candidate.error is not None or self.baseline.error is not None

    def diff(self, metric: str) -> float | None:
        c, b = self.candidate.scores.get(metric), self.baseline.scores.get(metric)
        return None if c is None or b is None or self.failed else c - b

    def aa_diff(self, metric: str) -> float | None:
        """The baseline's second answer minus its first (None without a usable repeat)."""
        if self.repeat is None or self.repeat.error is not None or self.failed:
            return None
        r, b = self.repeat.scores.get(metric), self.baseline.scores.get(metric)
        return None if r is None or b is None else r - b


@dataclass(slots=True)
class MetricSummary:
    """``candidate``/``baseline`` are the set-level values (corpus BLEU/chrF/length ratio, pooled
    perplexity, mean of the rest, over the items both engines answered); ``diff_mean`` and its
    interval are the paired mean of per-item candidate - baseline differences."""

    metric: str
    candidate: float | None
    baseline: float | None
    diff_mean: float | None
    ci_low: float | None
    ci_high: float | None
    n: int
    higher_is_better: bool = True


@dataclass(slots=True)
class EngineInfo:
    name: str
    precision: str


@dataclass
class DriftReport:
    golden_set: str
    candidate: EngineInfo
    baseline: EngineInfo
    started_at: float
    finished_at: float
    n_items: int
    primary_metric: str
    metrics: list[MetricSummary]
    items: list[ItemResult]
    #: engine errors: generation errors per side, reference-scoring errors per side, items excluded
    errors: dict[str, int]
    #: ids of the items that regressed most on the primary metric, worst first
    regressions: list[str]
    bootstrap: dict[str, float] = field(
        default_factory=lambda: {
            "resamples": BOOTSTRAP_RESAMPLES,
            "seed": BOOTSTRAP_SEED,
            "confidence": CONFIDENCE,
        }
    )
    schema: int = SCHEMA

    # --- derived -------------------------------------------------------------------------------

    @property
    def measured(self) -> int:
        return sum(not i.failed for i in self.items)

    def summary(self, metric: str) -> MetricSummary | None:
        return next((m for m in self.metrics if m.metric == metric), None)

    def error_rate(self, side: str) -> float | None:
        if not self.n_items:
            return None
        return self.errors.get(side, 0) / self.n_items

    # --- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"schema": d.pop("schema"), **d}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DriftReport:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"unsupported drift report schema {d.get('schema')!r} (expected {SCHEMA})")
        items = [
            ItemResult(
                id=i["id"],
                reference=i["reference"],
                candidate=SideResult(**i["candidate"]),
                baseline=SideResult(**i["baseline"]),
                tags=list(i.get("tags", [])),
                agreement=i.get("agreement"),
                repeat=SideResult(**i["repeat"]) if i.get("repeat") else None,
                version=i.get("version"),
            )
            for i in d["items"]
        ]
        return cls(
            golden_set=d["golden_set"],
            candidate=EngineInfo(**d["candidate"]),
            baseline=EngineInfo(**d["baseline"]),
            started_at=d["started_at"],
            finished_at=d["finished_at"],
            n_items=d["n_items"],
            primary_metric=d["primary_metric"],
            metrics=[MetricSummary(**m) for m in d["metrics"]],
            items=items,
            errors=dict(d["errors"]),
            regressions=list(d["regressions"]),
            bootstrap=dict(d["bootstrap"]),
        )

    @classmethod
    def from_json(cls, text: str) -> DriftReport:
        return cls.from_dict(json.loads(text))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``report-<UTC time>.json``, ``latest.json`` and ``summary.txt``; returns the first."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime(REPORT_STAMP, time.gmtime(self.finished_at))
        path = out / f"report-{stamp}.json"
        text = self.to_json()
        for target in (path, out / "latest.json"):
            tmp = target.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)
        (out / "summary.txt").write_text(self.render_text(), encoding="utf-8")
        return path

    # --- signals -------------------------------------------------------------------------------

    def per_item(self, measured: list[ItemResult], diff: Callable[[ItemResult, str], float | None]
                 ) -> dict[str, list[float]]:
        """metric -> ``diff(item, metric)`` of the measured items where it is defined (metrics with
        none are left out; the pairwise agreement is not a per-item difference)."""
        out: dict[str, list[float]] = {}
        for m in self.metrics:
            if m.metric == "agreement_rougeL":
                continue
            diffs = [d for d in (diff(i, m.metric) for i in measured) if d is not None]
            if diffs:
                out[m.metric] = diffs
        return out

    def to_signals(self, model: str, route: str) -> list[Signal]:
        """A candidate and a baseline ``source="golden"`` signal. Values are the set-level metric
        values plus ``error_rate``; the candidate also carries ``agreement_rougeL`` and the per-item
        paired differences. When no item could be measured the signals carry ``error``."""
        measured = [i for i in self.items if not i.failed]
        error = failed = None
        if not measured:
            failed = failed_side(self.items)
            first = next((i.baseline.error if failed == "baseline" else i.candidate.error or i.baseline.error
                          for i in self.items if i.failed), None)
            error = f"no golden item measured ({self.errors.get('excluded', 0)}/{self.n_items} failed)"
            if first:
                error += f": {first}"
        signals = []
        for side, info in (("candidate", self.candidate), ("baseline", self.baseline)):
            values: dict[str, float] = {}
            for m in self.metrics:
                v = getattr(m, side)
                if v is not None and (side == "candidate" or m.metric != "agreement_rougeL"):
                    values[m.metric] = v
            rate = self.error_rate(side)
            if rate is not None:
                values["error_rate"] = rate
            paired = self.per_item(measured, ItemResult.diff) if side == "candidate" else None
            # item ids aligned with the paired lists: the judge ranks broken items by id and
            # tells a rotated set (different items) from a repeated one
            item_ids = [i.id for i in measured] if paired and all(
                len(v) == len(measured) for v in paired.values()) else None
            # what each item asked: the judge learns per item id and version, so an edited item starts afresh
            versions = [i.version for i in measured] if item_ids is not None else None
            # the A/A differences (baseline again - baseline) of the measured items: the judge's
            # null for how much answers move by themselves
            aa = self.per_item(measured, ItemResult.aa_diff) if side == "candidate" else {}
            signals.append(
                Signal(
                    source="golden",
                    model=model,
                    route=route,
                    precision=info.precision,
                    start=self.started_at,
                    end=self.finished_at,
                    samples=len(measured),
                    values=values,
                    paired=paired,
                    error=error,
                    detail={
                        **({"item_ids": item_ids} if item_ids is not None else {}),
                        **({"item_versions": versions} if versions and all(versions) else {}),
                        # the regressed items' texts, for the evidence page (probes/drift_outputs.py)
                        **({"outputs": regressed_outputs(self)} if side == "candidate" else {}),
                        **({"aa": aa} if aa else {}),
                        # which engine failed when none was measured: a baseline that failed says
                        # nothing about FP8 (the rule's verdict is an error that never trips it)
                        **({"failed_side": failed} if failed else {}),
                        "golden_set": self.golden_set,
                        "engine": info.name,
                        "role": side,
                        "errors": self.errors.get(side, 0),
                        "ci": {
                            m.metric: [m.ci_low, m.ci_high]
                            for m in self.metrics
                            if side == "candidate" and m.ci_low is not None
                        },
                    },
                )
            )
        return signals

    # --- rendering -----------------------------------------------------------------------------

    def _fmt(self, v: float | None, metric: str) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return f"{v:.2f}" if metric in ("bleu", "chrf") or metric in LOWER_IS_BETTER else f"{v:.4f}"

    def tables(self) -> list[Any]:
        from rich.table import Table

        c, b = self.candidate, self.baseline
        title = (
            f"golden replay {self.golden_set}: {c.precision} ({c.name}) vs {b.precision} ({b.name}), "
            f"{self.measured}/{self.n_items} items measured"
        )
        summary = Table(title=title)
        for col in ("metric", b.precision, c.precision, "diff (paired)", "95% CI", "n", ""):
            summary.add_column(col, justify="left" if col == "metric" else "right")
        for m in self.metrics:
            ci = (
                "-"
                if m.ci_low is None
                else f"[{self._fmt(m.ci_low, m.metric)}, {self._fmt(m.ci_high, m.metric)}]"
            )
            mark = ""
            if m.diff_mean is not None and m.ci_high is not None and m.ci_low is not None:
                worse = m.ci_high < 0 if m.higher_is_better else m.ci_low > 0
                better = m.ci_low > 0 if m.higher_is_better else m.ci_high < 0
                mark = "[red]worse[/red]" if worse else "[green]better[/green]" if better else ""
            summary.add_row(
                m.metric,
                self._fmt(m.baseline, m.metric),
                self._fmt(m.candidate, m.metric),
                self._fmt(m.diff_mean, m.metric),
                ci,
                str(m.n),
                mark,
            )
        errs = ", ".join(f"{k}={v}" for k, v in self.errors.items())
        summary.caption = f"engine errors: {errs} (items with an error are excluded from the means)"
        out: list[Any] = [summary]
        if self.regressions:
            by_id = {i.id: i for i in self.items}
            worst = Table(title=f"items that regressed most on {self.primary_metric}")
            for col in ("id", "diff", "reference", b.precision, c.precision):
                worst.add_column(col, overflow="fold")
            for item_id in self.regressions:
                item = by_id[item_id]
                worst.add_row(
                    item.id,
                    self._fmt(item.diff(self.primary_metric), self.primary_metric),
                    item.reference,
                    item.baseline.output,
                    item.candidate.output,
                )
            out.append(worst)
        return out

    def render_text(self, width: int = 140) -> str:
        from rich.console import Console

        console = Console(record=True, width=width, file=open(os.devnull, "w"))  # noqa: SIM115
        try:
            for t in self.tables():
                console.print(t)
            return console.export_text()
        finally:
            console.file.close()


def summarise(
    items: list[ItemResult],
    metrics: list[str],
    corpus: dict[str, dict[str, float]],
    primary: str,
) -> tuple[list[MetricSummary], list[str]]:
    """Metric summaries (paired bootstrap CI per metric) and the ranked regressions.

    ``corpus[side][metric]`` holds the set-level value where the metric has one (corpus BLEU,
    pooled perplexity...); other metrics use the mean over measured items."""
    measured = [i for i in items if not i.failed]
    out = []
    for metric in metrics:
        higher = metric not in LOWER_IS_BETTER
        if metric == "agreement_rougeL":
            vals = [i.agreement for i in measured if i.agreement is not None]
            stats = paired_bootstrap_ci(vals)
            mean = stats[0] if stats else None
            out.append(
                MetricSummary(
                    metric,
                    mean,
                    None,
                    None,
                    stats[1] if stats else None,
                    stats[2] if stats else None,
                    len(vals),
                    True,
                )
            )
            continue
        diffs = [d for d in (i.diff(metric) for i in measured) if d is not None]
        stats = paired_bootstrap_ci(diffs)
        values: dict[str, float | None] = {}
        for side in ("candidate", "baseline"):
            if metric in corpus.get(side, {}):
                values[side] = corpus[side][metric]
            else:
                vs = [getattr(i, side).scores[metric] for i in measured if metric in getattr(i, side).scores]
                values[side] = float(np.mean(vs)) if vs else None
        out.append(
            MetricSummary(
                metric=metric,
                candidate=values["candidate"],
                baseline=values["baseline"],
                diff_mean=stats[0] if stats else None,
                ci_low=stats[1] if stats else None,
                ci_high=stats[2] if stats else None,
                n=len(diffs),
                higher_is_better=higher,
            )
        )
    sign = -1.0 if primary in LOWER_IS_BETTER else 1.0
    ranked = sorted(
        ((sign * d, i.id) for i in measured if (d := i.diff(primary)) is not None and sign * d < 0),
        key=lambda t: t[0],
    )
    return out, [item_id for _, item_id in ranked[:TOP_REGRESSIONS]]
