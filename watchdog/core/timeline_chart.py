"""Timeline charts of rule verdicts, from plain data: one panel per (route, rule).

``timeline_figure(chart)`` returns a matplotlib ``Figure``; ``timeline_png(chart)`` its PNG bytes.
The input is plain dataclasses (times in epoch seconds), so anything that can say what a rule saw
can draw it: ``policy backtest --png`` (watchdog/policy/backtest_report.py) today, an evidence
page of a decision later. It lives in ``core`` so that every room may import it; matplotlib (the
``plot`` extra) is imported only when a chart is drawn, with the Agg backend (no display).

Each panel shows, on the rule's own scale: lines (FP8 and FP16 values, or the judge's estimate
with its interval as error bars), the rule's threshold (dashed red, labelled with the rule),
failed windows (red crosses), shaded windows that were **not judged** and why (hatched grey:
too few samples, ``n < min``; yellow: the learned null is still warming up), shaded stretches
while the route served the baseline, and decision markers (rollback red, promote green, alert
orange dotted) drawn inside the plot area, each with a legend entry. The legend sits outside
the plot to the right so it never hides data.
"""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

#: band kinds -> (face colour, hatch, alpha)
BAND_STYLE: dict[str, tuple[str, str | None, float]] = {
    "not_judged": ("0.55", "//", 0.22),
    "learning": ("gold", None, 0.18),
    "baseline": ("tab:red", None, 0.10),
}
#: marker kinds -> (colour, line style, width)
MARKER_STYLE: dict[str, tuple[str, str, float]] = {
    "rollback": ("darkred", "-", 2.2),
    "promote": ("tab:green", "-", 2.2),
    "alert": ("tab:orange", ":", 1.4),
}


@dataclass(slots=True)
class Series:
    """A line (``points``: (t, y)); with ``intervals`` ((t, low, high)) drawn as error bars."""

    label: str
    points: list[tuple[float, float]]
    color: str = "tab:blue"
    intervals: list[tuple[float, float, float]] = field(default_factory=list)
    dashed: bool = False
    #: draw markers only (no connecting line), e.g. failed windows
    scatter: bool = False
    marker: str = "."


@dataclass(slots=True)
class Band:
    """A shaded time span [t0, t1) of a ``BAND_STYLE`` kind."""

    t0: float
    t1: float
    kind: str
    label: str


@dataclass(slots=True)
class Marker:
    """A decision at time ``t`` of a ``MARKER_STYLE`` kind."""

    t: float
    kind: str
    label: str


@dataclass(slots=True)
class Panel:
    title: str
    ylabel: str = ""
    series: list[Series] = field(default_factory=list)
    bands: list[Band] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    #: y values are shares (0..1) shown as percent
    percent: bool = False
    #: a line of text inside the panel (e.g. why nothing was judged)
    note: str | None = None
    #: draw the title in bold red (the rule that made a decision)
    highlight: bool = False
    #: a horizontal reference line at 0 (e.g. "FP8 = FP16" for a drift)
    zero_line: bool = False
    #: a second, smaller title line (e.g. what the rule tests)
    subtitle: str = ""


@dataclass(slots=True)
class Chart:
    title: str
    panels: list[Panel]
    #: x range (epoch seconds), widened to the data; None: from the data
    t0: float | None = None
    t1: float | None = None
    footer: str = ""


def _dt(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=UTC)


def _span(chart: Chart) -> tuple[float, float]:
    ts = [t for p in chart.panels for s in p.series for t, _ in s.points]
    ts += [t for p in chart.panels for b in p.bands for t in (b.t0, b.t1)]
    ts += [m.t for p in chart.panels for m in p.markers]
    lo = min([*ts, *([chart.t0] if chart.t0 is not None else [])], default=0.0)
    hi = max([*ts, *([chart.t1] if chart.t1 is not None else [])], default=lo + 1.0)
    if hi <= lo:
        hi = lo + 1.0
    pad = (hi - lo) * 0.04
    return lo - pad, hi + pad


def timeline_figure(chart: Chart) -> Any:
    """A matplotlib Figure of ``chart`` (close it with ``matplotlib.pyplot.close(fig)``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import PercentFormatter

    n = max(1, len(chart.panels))
    fig, axes = plt.subplots(n, 1, figsize=(13, 1.2 + 2.8 * n), sharex=True, squeeze=False)
    lo, hi = _span(chart)
    for ax, panel in zip(axes[:, 0], chart.panels or [Panel("nothing to draw")], strict=False):
        handles: dict[str, Any] = {}
        for b in panel.bands:
            color, hatch, alpha = BAND_STYLE.get(b.kind, ("0.7", None, 0.2))
            ax.axvspan(_dt(b.t0), _dt(b.t1), facecolor=color, alpha=alpha, hatch=hatch, edgecolor="0.45", lw=0)
            handles.setdefault(b.label, Patch(facecolor=color, alpha=min(1.0, alpha * 2), hatch=hatch,
                                              edgecolor="0.45", label=b.label))
        if panel.zero_line:
            ax.axhline(0.0, color="0.6", lw=0.8)
        for s in panel.series:
            if not s.points:
                continue
            xs = [_dt(t) for t, _ in s.points]
            ys = [y for _, y in s.points]
            if s.intervals:
                iv = {t: (lo_, hi_) for t, lo_, hi_ in s.intervals}
                pts = [(t, y) for t, y in s.points if t in iv]
                h = ax.errorbar([_dt(t) for t, _ in pts], [y for _, y in pts],
                                yerr=[[y - iv[t][0] for t, y in pts], [iv[t][1] - y for t, y in pts]],
                                fmt="o", ms=4, color=s.color, capsize=3, lw=1.2, label=s.label)
            elif s.scatter:
                h = ax.scatter(xs, ys, marker=s.marker, s=70, color=s.color, zorder=5, label=s.label)
            else:
                (h,) = ax.plot(xs, ys, marker=s.marker, ms=5, lw=1.3, color=s.color,
                               ls="--" if s.dashed else "-", drawstyle="default", label=s.label)
            handles.setdefault(s.label, h)
        for m in panel.markers:
            color, ls, lw = MARKER_STYLE.get(m.kind, ("black", "-", 1.5))
            h = ax.axvline(_dt(m.t), color=color, ls=ls, lw=lw, label=m.label, zorder=6)
            handles.setdefault(m.label, h)
            if m.kind != "alert":  # name the decision beside its line, inside the plot
                ax.annotate(m.kind.upper() + " ", (_dt(m.t), 0.97), xycoords=("data", "axes fraction"),
                            ha="right", va="top", fontsize=8, fontweight="bold", color=color)
        ax.set_xlim(_dt(lo), _dt(hi))
        if panel.percent:
            ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=None))
        ax.set_title(panel.title + (f"\n{panel.subtitle}" if panel.subtitle else ""), fontsize=9, loc="left",
                     color="darkred" if panel.highlight else "black",
                     fontweight="bold" if panel.highlight else "normal")
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if panel.note:
            ax.text(0.5, 0.96, panel.note, transform=ax.transAxes, ha="center", va="top", fontsize=9.5, zorder=7,
                    color="0.25", bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "0.6"})
        if handles:
            labels = [textwrap.fill(label, 34, subsequent_indent="  ") for label in handles]
            ax.legend(list(handles.values()), labels, fontsize=7.5, loc="upper left",
                      bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0, frameon=False)
    # a span of minutes (an evidence page of short windows) needs the seconds to tell ticks apart
    axes[-1, 0].xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if hi - lo < 900 else "%H:%M", tz=UTC))
    axes[-1, 0].set_xlabel("time (UTC)" + (f"; {chart.footer}" if chart.footer else ""), fontsize=8)
    fig.suptitle(chart.title, fontsize=11, x=0.01, ha="left", fontweight="bold")
    lines = chart.title.count("\n") + 1
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.3 * lines / fig.get_figheight()))
    return fig


def timeline_png(chart: Chart, dpi: int = 80) -> bytes:
    """``timeline_figure(chart)`` as PNG bytes."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(chart)
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, pil_kwargs={"optimize": True})
        return buf.getvalue()
    finally:
        plt.close(fig)
