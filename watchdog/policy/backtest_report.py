"""Rendering of a backtest: text for humans (rich; readable at 80 columns and when piped) and a
timeline PNG (``watchdog.core.timeline_chart``; matplotlib, imported lazily). The numbers come from
``watchdog.policy.backtest.BacktestResult`` and ``watchdog.policy.backtest_stats``.

The text: the run's summary; each would-be action with its reason on lines of its own (wrapped,
never squeezed into a column); the rules that were not judged for too few samples; the
false-rollback rate on the healthy stretches (when given) with its 95 % interval; each rule's margin
to its threshold (min, 5th percentile, median) and how often it fired; what each rule could see at
this traffic (minimum detectable effect).

The PNG: one panel per (route, rule) of the plotted metric (default: the metric of the rule that
made the first flip), each with that rule's own threshold, its not-judged windows shaded, and the
decisions drawn inside the plot with legend entries.
"""

from __future__ import annotations

import logging
import math
import os
from typing import TYPE_CHECKING, Any

from watchdog.core.timeline_chart import Band, Chart, Marker, Panel, Series, timeline_png
from watchdog.policy.backtest_stats import (
    FalseRollbacks,
    HealthySpec,
    condition_threshold,
    false_rollbacks,
    margin_table,
)
from watchdog.policy.backtest_window import fmt_duration
from watchdog.policy.loader import PolicySet
from watchdog.policy.schema import Policy, Rule

if TYPE_CHECKING:
    from watchdog.policy.backtest import BacktestResult

log = logging.getLogger(__name__)

_MAX_ROUTES = 6
_MAX_PANELS = 10


def _fmt_numbers(numbers: dict[str, float]) -> str:
    keys = ("candidate", "baseline", "estimate", "ci_low", "ci_high", "p_value", "samples")
    return ", ".join(f"{k}={numbers[k]:.4g}" for k in keys if k in numbers)


def _hhmmss(t: float) -> str:
    from watchdog.policy.backtest import iso

    return iso(t)[5:-1].replace("T", " ")


def _fmt_margin(metric: str, x: float | None) -> str:
    if x is None:
        return "-"
    if metric.endswith("_rate"):
        return f"{x * 100:+.2f}pt"
    return f"{x:+.4g}"


# --- text ------------------------------------------------------------------------------------------


def render_table(result: BacktestResult, console: Any | None = None,
                 healthy: list[HealthySpec] | None = None) -> None:
    """Print the summary, every would-be action (reasons on their own lines), the not-judged
    rules, the false-rollback rate on ``healthy`` stretches and the rules' margins (rich)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.padding import Padding
    from rich.text import Text

    from watchdog.policy.backtest import iso

    console = console or Console()
    span = "-" if result.start is None else f"{iso(result.start)} .. {iso(result.end or result.start)}"
    console.print(f"[bold]backtest[/bold] {', '.join(result.policies)}: {span}, window {result.window_s:g}s")
    if result.window_note:
        console.print(result.window_note, markup=False)
    console.print(f"events {result.events} of {result.lines} lines ({result.bad_lines} bad"
                  + (f": {dict(result.bad_reasons)}" if result.bad_reasons else "")
                  + f", {result.late} late), {result.windows} windows, {result.golden_reports} golden reports"
                  + (f" ({len(result.golden_bad)} unreadable)" if result.golden_bad else ""), markup=False)
    console.print()
    for a in result.actions:
        action = a.kind + (f" -> {a.precision}" if a.kind in ("rollback", "promote") else "") + f" ({a.severity})"
        if a.dry_run:
            action += " dry run"
        style = "bold red" if a.kind == "rollback" else "bold green" if a.kind == "promote" else "yellow"
        head = Text(f"{_hhmmss(a.at)}  {a.model}/{a.route}  ")
        head.append(action.replace(a.kind, a.kind.upper()) if a.flip else action, style=style)
        console.print(head)
        detail = Text(f"policy {a.policy}" + (f", rule {a.rule}" if a.rule else "")
                      + (f", cause {a.cause}" if a.cause else "") + "\n", style="dim")
        detail.append(a.reason)
        if a.numbers:
            detail.append("\n" + _fmt_numbers(a.numbers), style="dim")
        console.print(Padding(detail, (0, 0, 0, 4), expand=False))
    flips = result.flips
    for line in result.uncovered:
        console.print(f"[yellow]warning:[/yellow] {escape(line)}")
    console.print(f"[bold]{flips} flip{'s' if flips != 1 else ''}[/bold], "
                  f"{sum(a.kind == 'alert' for a in result.actions)} alerts; final flags: "
                  + (", ".join(f"{m}/{r}={p}" for (m, r), p in sorted(result.flags.items())) or "unchanged"))
    render_not_judged(result, console)
    render_false_rollbacks(result, console, healthy)
    render_margins(result, console, healthy)
    if result.judged:
        render_judged(result, console)


def render_not_judged(result: BacktestResult, console: Any) -> None:
    """One line per rule and route with windows it did not judge for too few samples."""
    from rich.padding import Padding
    from rich.text import Text

    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in result.verdicts:
        groups.setdefault((row["model"], row["route"], row["policy"], row["rule"]), []).append(row)
    lines: list[tuple[str, str]] = []
    for (model, route, policy, rule), rows in groups.items():
        low = [r for r in rows if r["not_judged"] == "n < min"]
        if not low:
            continue
        seen = [min(r["samples"] or 0, r["baseline_samples"] if r["baseline_samples"] is not None else 1 << 62)
                for r in low]
        lines.append((f"{model}/{route} {policy}",
                      f"{rule}: {len(low)} of {len(rows)} windows (need {low[0]['min_samples']}, "
                      f"had {min(seen)}..{max(seen)})"))
    if not lines:
        return
    console.print()
    console.print(Text("not judged (n < min): windows with too few samples per precision", style="bold"))
    head = None
    for scope, line in lines:
        if scope != head:
            head = scope
            console.print(Padding(Text(scope, style="bold"), (0, 0, 0, 2), expand=False))
        console.print(Padding(Text(line), (0, 0, 0, 4), expand=False))


def render_false_rollbacks(result: BacktestResult, console: Any, healthy: list[HealthySpec] | None) -> FalseRollbacks | None:
    console.print()
    if not healthy:
        console.print("[bold]false rollbacks[/bold]: not computed: no healthy stretch given "
                      "(--healthy-until [ROUTE=]TIME marks windows ending by TIME as known healthy)")
        return None
    fr = false_rollbacks_of(result, healthy)
    rate = "-" if fr.rate is None else f"{fr.rate:.1%}"
    console.print(f"[bold]false rollbacks on healthy stretches[/bold] ({_spec_text(healthy)}): "
                  f"{fr.rollbacks} in {fr.windows} healthy live windows that could roll back, rate {rate}, "
                  f"95 % interval [{fr.low:.1%}, {fr.high:.1%}] (Clopper-Pearson); not counted: "
                  f"{fr.not_judged} healthy windows no rollback rule judged, {fr.rolled_back} already rolled back")
    return fr


def false_rollbacks_of(result: BacktestResult, healthy: list[HealthySpec]) -> FalseRollbacks:
    rollbacks = [(a.model, a.route, a.at) for a in result.actions if a.flip and a.kind == "rollback"]
    return false_rollbacks(result.verdicts, rollbacks, healthy)


def _spec_text(specs: list[HealthySpec]) -> str:
    from watchdog.policy.backtest import iso

    return ", ".join(f"{s.route}={'end' if math.isinf(s.until) else iso(s.until)[11:-1]}" for s in specs)


def render_margins(result: BacktestResult, console: Any, healthy: list[HealthySpec] | None) -> None:
    """Per route and rule: windows judged of seen, fired, min / p5 / median margin (+ = passing)."""
    from rich.table import Table
    from rich.text import Text

    rows = margin_table(result.verdicts, healthy or None)
    if not rows:
        return
    where = "healthy stretches" if healthy else "all windows"
    table = Table(title=f"margin to threshold on {where} (+ passing, - beyond; rates in points)",
                  title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("rule", overflow="fold", min_width=16, ratio=3)
    for col in ("judged", "fired", "min", "p5", "median"):
        table.add_column(col, justify="right", no_wrap=True)
    scope = None
    for r in sorted(rows, key=lambda r: (r["model"], r["route"], result.policies.index(r["policy"])
                                         if r["policy"] in result.policies else 0)):
        if (r["model"], r["route"], r["policy"]) != scope:
            scope = (r["model"], r["route"], r["policy"])
            table.add_row(Text(f"{r['model']}/{r['route']} {r['policy']}", style="bold"), "", "", "", "", "")
        judged = f"{r['judged']}/{r['seen']}"
        table.add_row(f"  {r['rule']}", judged, str(r["fired"]), _fmt_margin(r["metric"], r["min"]),
                      _fmt_margin(r["metric"], r["p5"]), _fmt_margin(r["metric"], r["median"]))
    console.print()
    console.print(table)


def _mde(x: float | None, metric: str = "") -> str:
    """An MDE in harm units: points for a rate (0.0859 -> ``8.59pt``, as the margins), else as is
    (a log ratio for latency)."""
    if x is None:
        return "-"
    return f"{x * 100:.3g}pt" if metric.endswith("_rate") else f"{x:.3g}"


def render_judged(result: BacktestResult, console: Any) -> None:
    """What each judged rule could see at each route's traffic at the end of the replay: judged
    per window, over its horizon (sequential test), still learning, or not (and why), with its
    minimum detectable effect (harm units at 80 % power: log ratio for latency, points for rates)."""
    from rich.table import Table

    table = Table(title="judged rules at this traffic (MDE, 80 % power: rates in points, latency as log ratio)",
                  title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("rule", overflow="fold", min_width=16, ratio=3)
    for col in ("judged", "MDE window", "MDE horizon"):
        table.add_column(col, no_wrap=True)
    table.add_column("why not judged", overflow="fold", ratio=2)
    from rich.text import Text

    scope = None
    for row in sorted((r for r in result.judged if r.get("kind") == "judge"),
                      key=lambda r: (r["model"], r["route"], r["policy"])):
        if (row["model"], row["route"], row["policy"]) != scope:
            scope = (row["model"], row["route"], row["policy"])
            table.add_row(Text(f"{row['model']}/{row['route']} {row['policy']}", style="bold"), "", "", "", "")
        metric = str(row.get("metric") or "")
        table.add_row(f"  {row['rule']}", row["how"], _mde(row.get("mde"), metric),
                      _mde(row.get("horizon_mde"), metric), "" if row["judged"] else str(row.get("why") or ""))
    console.print()
    console.print(table)


# --- thresholds ------------------------------------------------------------------------------------


def threshold_at(rule: Rule, baseline: float | None, lo: float, hi: float) -> float | None:
    """The candidate value where ``rule`` starts to fail, given this window's baseline value.

    Judged rules: the effect threshold around the baseline (rate: + effect; mann_whitney:
    x (1 + effect); paired: -/+ effect). Conditions: where the condition's truth changes, searched
    from the middle of [lo, hi] (``backtest_stats.condition_threshold``)."""
    j = rule.judge
    if j is not None:
        if baseline is None:
            return None
        down = j.harm_direction == "higher_is_better"
        if j.test == "mann_whitney":
            return baseline * (1 - j.effect if down else 1 + j.effect)
        return baseline - j.effect if down else baseline + j.effect
    return condition_threshold(rule, (lo + hi) / 2, baseline)


# --- PNG -------------------------------------------------------------------------------------------


def _spans(changes: list[tuple[float, str]], end: float) -> list[tuple[float, float, str]]:
    out = []
    for i, (t, prec) in enumerate(changes):
        t2 = changes[i + 1][0] if i + 1 < len(changes) else end
        if t2 > t:
            out.append((t, t2, prec))
    return out


def _fired(result: BacktestResult) -> dict[tuple[str, str, str, str], list[tuple[str, float]]]:
    """(policy, model, route, rule) -> [(decision kind, time)] of the rules that tripped a flip:
    the action's own rule and every rule of that route whose failing streak reached its ``for``
    in the window of the decision (a rule failing once of ``for: 2`` did not fire)."""
    streaks: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in result.verdicts:
        streaks.setdefault((row["policy"], row["model"], row["route"], row["rule"]), []).append(row)
    out: dict[tuple[str, str, str, str], list[tuple[str, float]]] = {}
    for a in result.actions:
        if not a.flip:
            continue
        if a.rule:
            out.setdefault((a.policy, a.model, a.route, a.rule), []).append((a.kind, a.at))
        for key, rows in streaks.items():
            if key[1:3] != (a.model, a.route):
                continue
            upto = [r for r in sorted(rows, key=lambda r: r["t"]) if r["t"] <= a.at + 1e-6]
            if not upto or abs(upto[-1]["t"] - a.at) > 1e-6 or upto[-1]["action"] != a.kind:
                continue
            run = 0
            for r in reversed(upto):
                if r["status"] != "fail":
                    break
                run += 1
            if run >= int(upto[-1].get("for") or 1) and (a.kind, a.at) not in out.get(key, []):
                out.setdefault(key, []).append((a.kind, a.at))
    return out


def pick_metric(result: BacktestResult, policy_set: PolicySet) -> str:
    """The metric of the rule that made the first flip; else of the first rule with a failing
    window; else the first live rule's."""
    for a in result.actions:
        policy = policy_set.get(a.policy)
        rule = policy.rule(a.rule) if policy and a.rule else None
        if a.flip and rule is not None:
            return rule.metric
    for row in result.verdicts:
        if row["status"] == "fail":
            return str(row["metric"])
    first = next((r for p in policy_set.policies for r in p.rules if r.source != "gpu"), None)
    return first.metric if first else "error_rate"


def _merge_bands(bands: list[Band]) -> list[Band]:
    out: list[Band] = []
    for b in sorted(bands, key=lambda b: (b.kind, b.label, b.t0)):
        last = out[-1] if out else None
        if last and (last.kind, last.label) == (b.kind, b.label) and b.t0 <= last.t1 + 1e-6:
            last.t1 = max(last.t1, b.t1)
        else:
            out.append(Band(b.t0, b.t1, b.kind, b.label))
    return out


def _rule_words(rule: Rule) -> str:
    j = rule.judge
    if j is None:
        return f"fails if {rule.fail_if}" + (f" in {rule.for_} windows in a row" if rule.for_ > 1 else "")
    down = j.harm_direction == "higher_is_better"
    more = f" in {rule.for_} windows in a row" if rule.for_ > 1 else ""
    return (f"judged ({j.test}, alpha {j.alpha:g}): fails when the interval lies wholly "
            f"{'below' if down else 'above'} the threshold{more}")


def _panel(result: BacktestResult, policy: Policy, rule: Rule, model: str, route: str,
           fired: list[tuple[str, float]]) -> Panel:
    rows = sorted((r for r in result.verdicts if (r["policy"], r["model"], r["route"], r["rule"])
                   == (policy.name, model, route, rule.name)), key=lambda r: r["t"])
    live = rule.source == "live"
    half = result.window_s / 2 if live else 0.0

    def mid(t: float) -> float:
        return t - half

    percent = rule.metric.endswith("_rate")
    panel = Panel(title=f"{model}/{route}   {policy.name}:{rule.name}", subtitle=_rule_words(rule), percent=percent)
    if fired:
        panel.highlight = True
        panel.title += "   >> THIS RULE FIRED THE " + ", ".join(sorted({k for k, _ in fired})).upper()
    fails = [(mid(r["t"]), float(r["stat"])) for r in rows if r["status"] == "fail" and r["stat"] is not None]
    thr_label = f"{rule.name} threshold"
    if rule.judge is not None:
        pts = [(mid(r["t"]), float(r["stat"])) for r in rows if r["stat"] is not None]
        ivs = [(mid(r["t"]), float(r["lo"]), float(r["hi"])) for r in rows if r["stat"] is not None]
        learned = any(((r.get("reason") or "").find("learned") >= 0) for r in rows)
        what = "shift from learned level" if learned else f"{policy.candidate} - {policy.baseline}"
        panel.series.append(Series(f"{what} (estimate, judge's interval)", pts, "tab:blue", intervals=ivs))
        thr = [(mid(r["t"]), float(r["threshold"])) for r in rows if r["threshold"] is not None]
        if thr:
            unit = " pts" if percent else ""
            val = thr[-1][1] * (100 if percent else 1)
            panel.series.append(Series(f"{thr_label} ({val:+g}{unit})", thr, "tab:red", dashed=True, marker=""))
        panel.zero_line = True
        panel.ylabel = f"{rule.metric} drift"
    else:
        by_prec: dict[str, list[tuple[float, float]]] = {}
        for p in result.timeline:
            if (p["model"], p["route"]) == (model, route) and p["source"] == rule.source and rule.metric in p["values"]:
                v = float(p["values"][rule.metric])
                if math.isfinite(v):
                    by_prec.setdefault(p["precision"] or "value", []).append((mid(p["t"]), v))
        cand = sorted(by_prec.get(policy.candidate, by_prec.get("value", [])))
        base = sorted(by_prec.get(policy.baseline, []))
        if cand:
            panel.series.append(Series(f"{policy.candidate} {rule.metric}", cand, "tab:blue"))
        if base:
            panel.series.append(Series(f"{policy.baseline} {rule.metric}", base, "tab:gray"))
        bmap = dict(base)
        thr = []
        for t, v in cand:
            x = condition_threshold(rule, v, bmap.get(t))
            if x is not None:
                thr.append((t, x))
        if thr:
            panel.series.append(Series(f"{thr_label} ({rule.fail_if})", thr, "tab:red", dashed=True, marker=""))
        panel.ylabel = rule.metric
    if fails:
        panel.series.append(Series(f"{rule.name} failed this window", fails, "red", scatter=True, marker="X"))
    bands = []
    for r in rows:
        if not live:
            continue
        t0, t1 = r["t"] - result.window_s, r["t"]
        if r["not_judged"] == "n < min":
            bands.append(Band(t0, t1, "not_judged", f"not judged: n < min ({r['min_samples']} per precision)"))
        elif r["not_judged"] == "learning":
            bands.append(Band(t0, t1, "learning", "not judged: learning the healthy level"))
    changes = result.serving.get((model, route), [])
    end = max([result.end or 0.0, *(r["t"] for r in rows)])
    for t0, t1, prec in _spans(changes, end):
        if prec != policy.candidate:
            bands.append(Band(t0, t1, "baseline", f"serving {prec} (rolled back)"))
    panel.bands = _merge_bands(bands)
    for a in result.actions:
        if (a.model, a.route) != (model, route):
            continue
        if a.flip:
            who = ", ".join(n for (p, m, rt, n), ks in _fired(result).items()
                            if (m, rt) == (model, route) and (a.kind, a.at) in ks)
            panel.markers.append(Marker(a.at, a.kind, f"{a.kind} -> {a.precision} at {_hhmmss(a.at)[6:-3]}"
                                                      + (f" by {who}" if who else "")))
        elif a.kind == "alert" and a.rule == rule.name and a.policy == policy.name:
            panel.markers.append(Marker(a.at, "alert", f"alert ({a.rule})"))
    if rows and not any(r["judged"] for r in rows):
        low = [r for r in rows if r["not_judged"] == "n < min"]
        if low:
            panel.note = (f"NOT JUDGED in any window: n < {low[0]['min_samples']} per precision "
                          f"(min_samples); a longer --window gives more samples per window")
        elif any(r["not_judged"] == "learning" for r in rows):
            panel.note = "NOT JUDGED in any window: still learning this route's healthy level"
        else:
            panel.note = f"NOT JUDGED in any window: {rows[-1]['reason'][:70]}"
    elif not rows:
        panel.note = "no window of this rule on this route"
    return panel


def backtest_chart(result: BacktestResult, policy_set: PolicySet, metric: str | None = None) -> Chart:
    """The timeline of ``metric`` (default ``pick_metric``): one panel per (route, rule of that
    metric), routes with a flip first; at most ``_MAX_PANELS``."""
    metric = metric or pick_metric(result, policy_set)
    fired = _fired(result)
    flipped = {(a.model, a.route) for a in result.actions if a.flip}
    routes = sorted({(r["model"], r["route"]) for r in result.verdicts if r["metric"] == metric},
                    key=lambda mr: (mr not in flipped, mr))[:_MAX_ROUTES]
    panels = []
    for model, route in routes:
        here = []
        for policy in policy_set.policies:
            if not policy.scope.covers(model, route):
                continue
            for rule in policy.rules:
                if rule.metric == metric and rule.source != "gpu":
                    here.append(_panel(result, policy, rule, model, route,
                                       fired.get((policy.name, model, route, rule.name), [])))
        panels += sorted(here, key=lambda p: not p.highlight)  # the rule that fired first
    panels = panels[:_MAX_PANELS]
    alerts = sum(a.kind == "alert" for a in result.actions)
    title = (f"policy backtest: {', '.join(result.policies)}   window {fmt_duration(result.window_s)}   "
             f"{result.flips} flip{'s' if result.flips != 1 else ''}, {alerts} alert{'s' if alerts != 1 else ''}"
             f"   metric {metric}")
    what = []
    for a in result.actions:
        if a.flip:
            who = sorted({k[3] for k, ks in fired.items() if k[1:3] == (a.model, a.route) and (a.kind, a.at) in ks})
            what.append(f"{a.kind.upper()} of {a.model}/{a.route} to {a.precision} at {_hhmmss(a.at)[6:-3]}"
                        + (f" by {', '.join(who)}" if who else ""))
    rows = [r for r in result.verdicts if r["metric"] == metric and r["source"] == "live"]
    low = sum(r["not_judged"] == "n < min" for r in rows)
    if low:
        what.append(f"{low} of {len(rows)} rule-windows of {metric} NOT JUDGED (n < min_samples)")
    if not any(a.flip for a in result.actions):
        what.insert(0, "no flip")
    title += "\n" + "; ".join(what)
    return Chart(title, panels, t0=result.start, t1=result.end,
                 footer="points at window middles; bands span the windows")


def render_png(result: BacktestResult, policy_set: PolicySet, path: str | os.PathLike[str],
               metric: str | None = None) -> str:
    """Write ``backtest_chart`` as a PNG to ``path``; returns the metric plotted."""
    metric = metric or pick_metric(result, policy_set)
    data = timeline_png(backtest_chart(result, policy_set, metric))
    with open(path, "wb") as fh:
        fh.write(data)
    return metric
