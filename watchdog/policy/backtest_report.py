"""Rendering of a backtest: a rich table for humans and a timeline PNG (matplotlib, Agg, imported
lazily). The numbers come from ``watchdog.policy.backtest.BacktestResult``."""

from __future__ import annotations

import logging
import math
import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from watchdog.policy.loader import PolicySet
from watchdog.policy.schema import Rule

if TYPE_CHECKING:
    from watchdog.policy.backtest import BacktestResult

log = logging.getLogger(__name__)

_MAX_ROUTES = 8


def _fmt_numbers(numbers: dict[str, float]) -> str:
    keys = ("candidate", "baseline", "estimate", "ci_low", "ci_high", "p_value", "samples")
    return ", ".join(f"{k}={numbers[k]:.4g}" for k in keys if k in numbers)


def render_table(result: BacktestResult, console: Any | None = None) -> None:
    """Print the summary and every would-be action (rich)."""
    from rich.console import Console
    from rich.table import Table

    from watchdog.policy.backtest import iso

    console = console or Console()
    span = "-" if result.start is None else f"{iso(result.start)} .. {iso(result.end or result.start)}"
    console.print(f"[bold]backtest[/bold] {', '.join(result.policies)}: {span}, window {result.window_s:g}s")
    console.print(f"events {result.events} of {result.lines} lines ({result.bad_lines} bad"
                  + (f": {dict(result.bad_reasons)}" if result.bad_reasons else "")
                  + f", {result.late} late), {result.windows} windows, {result.golden_reports} golden reports"
                  + (f" ({len(result.golden_bad)} unreadable)" if result.golden_bad else ""))
    table = Table(show_lines=False)
    table.add_column("time (UTC)", no_wrap=True)
    table.add_column("route", no_wrap=True)
    table.add_column("policy")
    table.add_column("action", no_wrap=True)
    table.add_column("cause")
    table.add_column("reason", ratio=3, overflow="fold")
    table.add_column("numbers", ratio=1, overflow="fold")
    for a in result.actions:
        action = a.kind + (f" -> {a.precision}" if a.kind in ("rollback", "promote") else "") + f" ({a.severity})"
        if a.dry_run:
            action += " dry run"
        style = "bold red" if a.kind == "rollback" else "green" if a.kind == "promote" else None
        table.add_row(iso(a.at)[5:-1].replace("T", " "), f"{a.model}/{a.route}", a.policy, action,
                      a.cause or "", a.reason, _fmt_numbers(a.numbers), style=style)
    console.print(table)
    flips = result.flips
    console.print(f"[bold]{flips} flip{'s' if flips != 1 else ''}[/bold], "
                  f"{sum(a.kind == 'alert' for a in result.actions)} alerts; final flags: "
                  + (", ".join(f"{m}/{r}={p}" for (m, r), p in sorted(result.flags.items())) or "unchanged"))
    if result.judged:
        render_judged(result, console)


def _mde(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def render_judged(result: BacktestResult, console: Any) -> None:
    """What each judged rule could see at each route's traffic at the end of the replay: judged
    per window, over its horizon (sequential test), still learning, or not (and why), with its
    minimum detectable effect (harm units at 80 % power: log ratio for latency, points for rates)."""
    from rich.table import Table

    table = Table(title="judged rules at this traffic (MDE: log ratio / rate points, 80 % power)", show_lines=False)
    for col in ("route", "rule", "judged", "MDE window", "MDE horizon"):
        table.add_column(col, overflow="fold")
    for row in result.judged:
        if row.get("kind") != "judge":
            continue
        table.add_row(f"{row['model']}/{row['route']}", f"{row['policy']}:{row['rule']}", row["how"],
                      _mde(row.get("mde")), _mde(row.get("horizon_mde")))
    console.print(table)


# --- thresholds ------------------------------------------------------------------------------------


def _rule_for(policy_set: PolicySet, metric: str) -> Rule | None:
    return next((r for p in policy_set.policies for r in p.rules if r.metric == metric), None)


def threshold_at(rule: Rule, baseline: float | None, lo: float, hi: float) -> float | None:
    """The candidate value where ``rule`` starts to fail, given this window's baseline value.

    Judged rules: the effect threshold around the baseline (rate: + effect; mann_whitney:
    x (1 + effect); paired: -/+ effect). Conditions: the first change of the condition's truth on
    a fine grid over [lo, hi] (so any condition over candidate and baseline works)."""
    j = rule.judge
    if j is not None:
        if baseline is None:
            return None
        down = j.harm_direction == "higher_is_better"
        if j.test == "mann_whitney":
            return baseline * (1 - j.effect if down else 1 + j.effect)
        return baseline - j.effect if down else baseline + j.effect
    cond = rule.condition
    if cond is None or not cond.names <= {"candidate", "baseline"}:
        return None
    if "baseline" in cond.names and baseline is None:
        return None
    env = {"baseline": baseline if baseline is not None else 0.0}
    steps = 400
    prev: bool | None = None
    for i in range(steps + 1):
        x = lo + (hi - lo) * i / steps
        env["candidate"] = x
        now = cond.evaluate(env)
        if prev is not None and now != prev:
            return x
        prev = now
    return None


# --- PNG -------------------------------------------------------------------------------------------


def _spans(changes: list[tuple[float, str]], end: float) -> list[tuple[float, float, str]]:
    out = []
    for i, (t, prec) in enumerate(changes):
        t2 = changes[i + 1][0] if i + 1 < len(changes) else end
        if t2 > t:
            out.append((t, t2, prec))
    return out


def render_png(result: BacktestResult, policy_set: PolicySet, path: str | os.PathLike[str],
               metric: str | None = None) -> str:
    """Plot ``metric`` (default: the first rule's metric) per route: candidate and baseline lines,
    the rule's threshold, shading where the route served the baseline, flips and alerts. Returns
    the metric plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    if metric is None:
        first = next((r for p in policy_set.policies for r in p.rules if r.source != "gpu"), None)
        metric = first.metric if first else "error_rate"
    rule = _rule_for(policy_set, metric)
    policy = next((p for p in policy_set.policies if rule in p.rules), None)
    candidate = policy.candidate if policy else "fp8"
    baseline_p = policy.baseline if policy else "fp16"
    routes = sorted({(p["model"], p["route"]) for p in result.timeline if p["source"] == "live"}
                    | set(result.serving))
    routes = [r for r in routes if "*" not in r][:_MAX_ROUTES] or [("*", "*")]
    fig, axes = plt.subplots(len(routes), 1, figsize=(11, 2.8 * len(routes)), sharex=True, squeeze=False)

    def dt(t: float) -> datetime:
        return datetime.fromtimestamp(t, tz=UTC)

    end = result.end or 0.0
    for ax, (model, route) in zip(axes[:, 0], routes, strict=True):
        pts = [p for p in result.timeline if metric in p["values"]
               and (p["model"], p["route"]) in ((model, route), ("*", "*"), (model, "*"))]
        series: dict[str, list[tuple[float, float]]] = {}
        for p in pts:
            series.setdefault(p["precision"] or "value", []).append((p["t"], float(p["values"][metric])))
        values = [v for s in series.values() for _, v in s if math.isfinite(v)]
        for prec, color in ((candidate, "tab:blue"), (baseline_p, "tab:gray")):
            s = sorted(series.get(prec, []))
            if s:
                ax.plot([dt(t) for t, _ in s], [v for _, v in s], marker=".", lw=1, color=color, label=prec)
        if rule is not None and values:
            lo, hi = min(values), max(values)
            pad = (hi - lo) * 0.5 or abs(hi) * 0.5 or 1.0
            base = dict(sorted(series.get(baseline_p, [])))
            times = sorted({t for t, _ in series.get(candidate, [])} | set(base))
            line = [(t, threshold_at(rule, base.get(t), lo - pad, hi + pad)) for t in times]
            line = [(t, v) for t, v in line if v is not None]
            if line:
                ax.plot([dt(t) for t, _ in line], [v for _, v in line], ls="--", color="tab:red", lw=1,
                        label=f"{rule.name} threshold")
        changes = result.serving.get((model, route), [])
        for t0, t1, prec in _spans(changes, max(end, changes[-1][0] if changes else end)):
            if prec != candidate:
                ax.axvspan(dt(t0), dt(t1), color="tab:red", alpha=0.12, lw=0)
        for a in result.actions:
            if (a.model, a.route) != (model, route):
                continue
            if a.flip:
                ax.axvline(dt(a.at), color="tab:red" if a.kind == "rollback" else "tab:green", lw=1.5)
            elif a.kind == "alert":
                ax.axvline(dt(a.at), color="tab:orange", lw=0.8, ls=":")
        ax.set_title(f"{model}/{route}: {metric}", fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].xaxis.set_major_formatter(mdates.DateFormatter("%H:%M", tz=UTC))
    axes[-1, 0].set_xlabel("time (UTC); shaded: serving the baseline; red/green lines: rollback/promote; "
                           "orange dotted: alerts", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return metric
