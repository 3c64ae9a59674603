"""The evidence pages of decisions as self-contained HTML: pure, no I/O.

``render_list(summaries)`` is the incident list, ``render_record(record, png)`` one decision's page
(the record of ``watchdog/policy/evidence.py``; ``png``: its timeline from ``chart_of(record)``
drawn by ``watchdog/core/timeline_chart.py``, embedded as a ``data:`` URI). Inline CSS, no script,
no external asset: the page is readable on a phone and from a file exported with
``fp8-watchdog evidence export``. Every text that came from events, models or policies is escaped
(``html.escape``): model outputs are untrusted.
"""

from __future__ import annotations

import base64
import difflib
import html
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from watchdog.core.timeline_chart import Band, Chart, Marker, Panel, Series

STYLE = """
*{box-sizing:border-box}body{font:15px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;
color:#1b1b1b;background:#f6f7f9}main{max-width:1100px;margin:0 auto;padding:12px}
h1{font-size:1.3em;margin:.3em 0}h2{font-size:1.1em;margin:1.2em 0 .4em}h3{font-size:1em;margin:.8em 0 .3em}
.card{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:10px 12px;margin:8px 0}
.kind-rollback{border-left:6px solid #c62828}.kind-promote{border-left:6px solid #2e7d32}
.kind-alert{border-left:6px solid #ef8c00}.muted{color:#5f6b76;font-size:.9em}
.scroll{overflow-x:auto;-webkit-overflow-scrolling:touch}table{border-collapse:collapse;width:100%;font-size:.9em}
th,td{border-bottom:1px solid #e4e7eb;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f0f2f5;white-space:nowrap}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.fail{color:#b71c1c;font-weight:600}.pass{color:#2e7d32}.badge{display:inline-block;padding:1px 7px;
border-radius:10px;background:#eceff1;font-size:.85em;margin-right:4px}
.trio{display:flex;flex-wrap:wrap;gap:8px}.trio>div{flex:1 1 260px;min-width:0;background:#fafbfc;
border:1px solid #e4e7eb;border-radius:6px;padding:6px 8px}.trio pre{white-space:pre-wrap;word-break:break-word;
margin:.2em 0;font:13px/1.4 ui-monospace,Menlo,Consolas,monospace}mark{background:#ffd6d6;color:#7f0000}
img.chart{width:100%;height:auto;border:1px solid #dde1e6;border-radius:6px;background:#fff}
a{color:#0b57d0}dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 10px;margin:0}dt{color:#5f6b76}
dd{margin:0;word-break:break-word}details>summary{cursor:pointer;color:#0b57d0}
@media (max-width:600px){body{font-size:14px}main{padding:6px}.card{padding:8px}}
"""


def esc(x: Any) -> str:
    """Any value as escaped HTML text (None -> empty)."""
    return "" if x is None else html.escape(str(x), quote=True)


def fmt(x: Any, digits: int = 4) -> str:
    if x is None or isinstance(x, bool):
        return "–" if x is None else str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return "–" if not math.isfinite(x) else f"{x:.{digits}g}"
    return esc(x)


def utc(t: Any) -> str:
    if not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta name=\"robots\" content=\"noindex\">"
            f"<title>{esc(title)}</title><style>{STYLE}</style></head><body><main>{body}</main></body></html>")


# -- the incident list --------------------------------------------------------------------------

def render_list(summaries: Sequence[Mapping[str, Any]], base: str = "/evidence") -> str:
    """The incident list: newest first, one line per decision, each linking to its page."""
    rows = []
    for s in summaries:
        eid = str(s.get("id") or "")
        kind = str(s.get("kind") or "")
        rows.append(
            f"<tr><td class=\"num\">{esc(utc(s.get('at')))}</td>"
            f"<td><a href=\"{esc(base)}/{esc(quote(eid, safe=''))}\"><span class=\"badge\">{esc(kind)}"
            f"{' (dry run)' if s.get('dry_run') else ''}</span></a></td>"
            f"<td>{esc(s.get('model'))}/{esc(s.get('route'))}</td><td>{esc(s.get('policy'))}</td>"
            f"<td>{esc(', '.join(map(str, s.get('rules') or [])))}</td><td>{esc(s.get('reason'))}</td></tr>")
    table = ("<div class=\"scroll\"><table><thead><tr><th>time</th><th>decision</th><th>model/route</th>"
             "<th>policy</th><th>rules</th><th>reason</th></tr></thead><tbody>" + "".join(rows)
             + "</tbody></table></div>") if rows else "<p>No decision recorded yet.</p>"
    body = (f"<h1>llm-watchdog evidence</h1><p class=\"muted\">{len(rows)} recorded decision(s), newest first: "
            "every rollback, promote and alert, with what the watchdog saw.</p><div class=\"card\">"
            f"{table}</div>")
    return _page("llm-watchdog evidence", body)


# -- one decision -------------------------------------------------------------------------------

def _kv(pairs: Iterable[tuple[str, Any]]) -> str:
    return "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{v}</dd>" for k, v in pairs) + "</dl>"


def _interval(w: Mapping[str, Any]) -> str:
    if w.get("ci_low") is None and w.get("ci_high") is None:
        return "–"
    return f"[{fmt(w.get('ci_low'))}, {fmt(w.get('ci_high'))}]"


def _windows_table(rule: Mapping[str, Any], cand: str, base: str) -> str:
    rows = []
    for phase in ("before", "after"):
        for w in rule.get(phase) or []:
            status = str(w.get("status") or "")
            stat = ""
            if w.get("stat") and w.get("stat") not in ("candidate",):
                stat = f"{esc(w['stat'])} {fmt((w.get('extra') or {}).get(w['stat']))}"
            elif w.get("estimate") is not None:
                stat = f"{fmt(w.get('estimate'))} {_interval(w)}"
            rows.append(
                f"<tr><td>{esc(phase)}</td><td class=\"num\">{esc(utc(w.get('end'))[11:19])}</td>"
                f"<td class=\"{'fail' if status == 'fail' else 'pass' if status == 'pass' else ''}\">{esc(status)}</td>"
                f"<td class=\"num\">{fmt(w.get('candidate'))}</td><td class=\"num\">{fmt(w.get('baseline'))}</td>"
                f"<td class=\"num\">{stat or '–'}</td><td class=\"num\">{fmt(w['threshold'] if w.get('threshold') is not None else w.get('line'))}</td>"
                f"<td class=\"num\">{fmt(w.get('samples'))}/{fmt(w.get('baseline_samples'))}</td></tr>")
    if not rows:
        return "<p class=\"muted\">No judged window kept for this rule.</p>"
    head = (f"<tr><th>when</th><th>end (UTC)</th><th>verdict</th><th>{esc(cand)}</th><th>{esc(base)}</th>"
            "<th>statistic [interval]</th><th>threshold</th><th>n</th></tr>")
    return f"<div class=\"scroll\"><table><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table></div>"


def highlight(text: str, against: str) -> str:
    """``text`` escaped, its words absent from ``against`` (at their place) in ``<mark>``."""
    a, b = against.split(), text.split()
    out: list[str] = []
    for op, _i1, _i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        words = esc(" ".join(b[j1:j2]))
        if not words:
            continue
        out.append(words if op == "equal" else f"<mark>{words}</mark>")
    return " ".join(out)


def _items(items: Sequence[Mapping[str, Any]], cand: str, base: str) -> str:
    out = []
    for rank, it in enumerate(items, 1):
        ref, c, b = (str(it.get(k) or "") for k in ("reference", "candidate", "baseline"))
        harm = it.get("harm") if it.get("harm") is not None else it.get("diff")
        what = f"harm {fmt(harm)}" if it.get("harm") is not None else (
            f"{esc(it.get('metric'))} {fmt(harm)}" if harm is not None else "")
        texts = ""
        if ref or c or b:
            texts = (f"<div class=\"trio\"><div><b>{esc(cand)}</b><pre>{highlight(c, b)}</pre></div>"
                     f"<div><b>{esc(base)}</b><pre>{esc(b)}</pre></div>"
                     f"<div><b>reference</b><pre>{esc(ref)}</pre></div></div>")
        else:
            texts = "<p class=\"muted\">The golden signal carried no texts for this item.</p>"
        out.append(f"<div class=\"card\"><b>#{rank} item {esc(it.get('id'))}</b> "
                   f"<span class=\"muted\">{what}</span>{texts}</div>")
    return "".join(out) or "<p class=\"muted\">No regressed golden item recorded.</p>"


def _null(null: Mapping[str, Any] | None) -> str:
    if not null:
        return "<span class=\"muted\">none learned</span>"
    parts = []
    if null.get("windows"):
        parts.append(f"mean {fmt(null.get('mean'))} (sd {fmt(null.get('sd'))}) over {fmt(null.get('windows'))} "
                     "healthy windows")
    if null.get("aa_items"):
        parts.append(f"A/A: {fmt(null.get('aa_broken'))} of {fmt(null.get('aa_items'))} items moved")
    if null.get("healthy_items"):
        parts.append(f"healthy replays: {fmt(null.get('healthy_broken'))} of {fmt(null.get('healthy_items'))} broke")
    return esc("; ".join(parts)) if parts else "<span class=\"muted\">none learned</span>"


def _rule_card(rule: Mapping[str, Any], cand: str, base: str) -> str:
    st = rule.get("statistic") or {}
    status = str(rule.get("status") or "")
    pairs: list[tuple[str, Any]] = [
        ("verdict", f"<span class=\"{'fail' if status == 'fail' else ''}\">{esc(status or '–')}</span>"),
        ("metric", f"{esc(rule.get('metric'))} <span class=\"muted\">({esc(rule.get('source'))})</span>"),
        ("fail_if", esc(rule.get("fail_if") or "–")),
        (f"{cand} / {base}", f"{fmt(rule.get('candidate'))} / {fmt(rule.get('baseline'))}"),
    ]
    if st and st.get("estimate") is not None:
        pairs += [("statistic", f"{esc(st.get('method'))}: {fmt(st.get('estimate'))} "
                                f"[{fmt(st.get('ci_low'))}, {fmt(st.get('ci_high'))}]"),
                  ("threshold", fmt(st.get("threshold"))), ("p-value", fmt(st.get("p_value"))), ("n", fmt(st.get("n")))]
    pairs += [("learned null", _null(rule.get("null"))),
              ("trips after", f"{fmt(rule.get('for'))} failing window(s), min_samples {fmt(rule.get('min_samples'))}"),
              ("reason", esc(rule.get("reason")))]
    body = _kv(pairs) + "<h3>Judged windows</h3>" + _windows_table(rule, cand, base)
    if rule.get("before_missing"):
        body += (f"<p class=\"muted\">{esc(rule.get('before_missing'))} earlier windows of this rule were judged but "
                 "not kept (the route's history was cut: too many routes, or a restart).</p>")
    if "broken_items" in rule:
        body += "<h3>Golden items that regressed, worst first</h3>" + _items(rule.get("broken_items") or [], cand, base)
    return f"<div class=\"card\"><h2>rule {esc(rule.get('name'))}</h2>{body}</div>"


def _audit(audit: Sequence[Mapping[str, Any]]) -> str:
    if not audit:
        return "<p class=\"muted\">No flag change of this route in the audit stream.</p>"
    rows = "".join(
        f"<tr><td class=\"num\">{esc(utc(_float(a.get('ts'))))}</td><td>{esc(a.get('op'))} {esc(a.get('mode'))}</td>"
        f"<td>{esc(a.get('previous') or 'default')} → {esc(a.get('precision'))}</td><td class=\"num\">{esc(a.get('epoch'))}</td>"
        f"<td>{esc(a.get('changed_by'))}</td><td>{esc(a.get('reason'))}</td></tr>" for a in audit)
    return ("<div class=\"scroll\"><table><thead><tr><th>time</th><th>op</th><th>precision</th><th>epoch</th>"
            f"<th>by</th><th>reason</th></tr></thead><tbody>{rows}</tbody></table></div>")


def _float(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _gpu(gpu: Mapping[str, Any] | None) -> str:
    if not gpu:
        return "<p class=\"muted\">No GPU source on this daemon, or no reading for this route.</p>"
    parts = []
    route = gpu.get("route")
    if isinstance(route, Mapping):
        parts.append(_kv([("reading at", esc(utc(route.get("at")))),
                          ("problems", esc(", ".join(map(str, route.get("problems") or [])) or "none"))]))
    for d in gpu.get("devices") or []:
        if isinstance(d, Mapping):
            shown = [(str(k), esc(fmt(v) if isinstance(v, float) else v)) for k, v in list(d.items())[:14]
                     if not isinstance(v, dict | list)]
            parts.append(f"<div class=\"card\">{_kv(shown)}</div>")
    return "".join(parts)


def render_record(record: Mapping[str, Any], png: bytes | None = None, chart_note: str = "",
                  base: str = "/evidence", standalone: bool = False) -> str:
    """One decision's page; ``standalone`` (an exported file): without links to the server."""
    kind = str(record.get("kind") or "")
    cand, basep = str(record.get("candidate") or "candidate"), str(record.get("baseline") or "baseline")
    rules = [r for r in record.get("rules") or [] if isinstance(r, Mapping)]
    involved = [r for r in rules if r.get("involved")]
    others = [r for r in rules if not r.get("involved")]
    undo = record.get("undo") or {}
    head = (f"<div class=\"card kind-{esc(kind)}\"><h1>{esc(kind.upper())}{' (dry run)' if record.get('dry_run') else ''}"
            f" · {esc(record.get('model'))}/{esc(record.get('route'))}</h1>"
            + _kv([("when", esc(utc(record.get("at")))), ("policy", esc(record.get("policy"))),
                   ("rules", esc(", ".join(str(r.get("name")) for r in involved)) or "–"),
                   ("severity", esc(record.get("severity"))),
                   ("precision", f"{esc(record.get('serving_before') or 'default')} → "
                                 f"{esc(record.get('precision') or 'unchanged')}"),
                   ("reason", esc(record.get("reason"))), ("instance", esc(record.get("instance"))),
                   ("evidence id", esc(record.get("id")))])
            + "</div>")
    undo_html = (f"<div class=\"card\"><h2>What would undo it</h2><p>{esc(undo.get('text'))}</p>"
                 + (f"<p>Earliest: <b>{esc(utc(undo.get('earliest')))}</b>"
                    + (f"; healthy windows so far: {fmt(undo.get('healthy_now'))} of {fmt(undo.get('healthy_windows'))}"
                       if undo.get("healthy_windows") else "") + "</p>" if undo.get("earliest") else "")
                 + "</div>") if undo else ""
    eid = quote(str(record.get("id") or ""), safe="")
    if png and standalone:
        chart = (f"<img class=\"chart\" alt=\"timeline of the rules' windows with thresholds and the decision\" "
                 f"src=\"data:image/png;base64,{base64.b64encode(png).decode()}\">")
    elif png:
        chart = (f"<a href=\"{esc(base)}/{esc(eid)}.png\"><img class=\"chart\" "
                 "alt=\"timeline of the rules' windows with thresholds and the decision\" "
                 f"src=\"data:image/png;base64,{base64.b64encode(png).decode()}\"></a>"
                 "<p class=\"muted\">Tap the chart for full size.</p>")
    else:
        chart = f"<p class=\"muted\">{esc(chart_note or 'No chart (matplotlib is not installed).')}</p>"
    parts = [head, undo_html, f"<div class=\"card\"><h2>Timeline</h2>{chart}</div>"]
    parts += [_rule_card(r, cand, basep) for r in involved]
    if others:
        parts.append("<div class=\"card\"><details><summary>other rules of the policy "
                     f"({len(others)})</summary>{''.join(_rule_card(r, cand, basep) for r in others)}</details></div>")
    parts.append(f"<div class=\"card\"><h2>GPU health at the time</h2>{_gpu(record.get('gpu'))}</div>")
    parts.append(f"<div class=\"card\"><h2>Flag history (audit stream)</h2>{_audit(record.get('audit') or [])}</div>")
    trunc = " This record was cut to fit its size limit." if record.get("truncated") else ""
    if standalone:
        parts.append(f"<p class=\"muted\">Exported evidence record {esc(record.get('id'))}.{esc(trunc)}</p>")
    else:
        parts.append(f"<p class=\"muted\"><a href=\"{esc(base)}\">all decisions</a> · "
                     f"<a href=\"{esc(base)}/{esc(eid)}.json\">JSON</a>.{esc(trunc)}</p>")
    return _page(f"{kind} {record.get('model')}/{record.get('route')}", "".join(parts))


# -- the chart ----------------------------------------------------------------------------------

def chart_of(record: Mapping[str, Any]) -> Chart:
    """The decision's timeline: one panel per rule that made it (every rule if none did), the
    plotted statistic per precision (or the judge's estimate with its interval), the threshold,
    failed windows and the decision marker."""
    cand, base = str(record.get("candidate") or "candidate"), str(record.get("baseline") or "baseline")
    rules = [r for r in record.get("rules") or [] if isinstance(r, Mapping)]
    shown = [r for r in rules if r.get("involved")] or rules[:3]
    at = float(record.get("at") or 0.0)
    kind = str(record.get("kind") or "alert")
    panels = []
    for r in shown:
        ws = [w for w in [*(r.get("before") or []), *(r.get("after") or [])] if isinstance(w, Mapping)]
        ws.sort(key=lambda w: float(w.get("end") or 0.0))
        panel = Panel(title=f"{record.get('policy')}:{r.get('name')}   ({r.get('source')} {r.get('metric')})",
                      subtitle=str(r.get("fail_if") or ""), highlight=bool(r.get("involved")),
                      percent=str(r.get("metric") or "").endswith("_rate"))
        stat = next((w.get("stat") for w in ws if w.get("stat")), None)
        judged = any(w.get("estimate") is not None for w in ws)
        pts: list[tuple[float, float]] = []
        if judged:
            pts = [(float(w["end"]), float(w["estimate"])) for w in ws if w.get("estimate") is not None]
            ivs = [(float(w["end"]), float(w["ci_low"]), float(w["ci_high"])) for w in ws
                   if w.get("estimate") is not None and w.get("ci_low") is not None and w.get("ci_high") is not None]
            panel.series.append(Series(f"{cand} - {base} (estimate, interval)", pts, "tab:blue", intervals=ivs))
            thr = [(float(w["end"]), float(w["threshold"])) for w in ws if w.get("threshold") is not None]
            if thr:
                panel.series.append(Series(f"threshold ({thr[-1][1]:+g})", thr, "tab:red", dashed=True, marker=""))
            panel.zero_line = True
            panel.ylabel = f"{r.get('metric')} drift"
        elif stat and stat != "candidate":
            pts = [(float(w["end"]), float(w["extra"][stat])) for w in ws
                   if isinstance(w.get("extra"), Mapping) and w["extra"].get(stat) is not None]
            panel.series.append(Series(f"{stat} ({cand} - {base} per item)", pts, "tab:blue"))
            panel.zero_line = True
            panel.ylabel = str(stat)
        else:
            pts = [(float(w["end"]), float(w["candidate"])) for w in ws if w.get("candidate") is not None]
            panel.series.append(Series(f"{cand} {r.get('metric')}", pts, "tab:blue"))
            bpts = [(float(w["end"]), float(w["baseline"])) for w in ws if w.get("baseline") is not None]
            if bpts:
                panel.series.append(Series(f"{base} {r.get('metric')}", bpts, "tab:gray"))
            panel.ylabel = str(r.get("metric") or "")
        if not judged:
            line = [(float(w["end"]), float(w["line"])) for w in ws if w.get("line") is not None]
            if line:
                panel.series.append(Series(f"threshold ({r.get('fail_if')})", line, "tab:red", dashed=True, marker=""))
        y = dict(pts)
        fails = [(float(w["end"]), y[float(w["end"])]) for w in ws
                 if w.get("status") == "fail" and float(w["end"]) in y]
        if fails:
            panel.series.append(Series("failed window", fails, "red", scatter=True, marker="X"))
        after = [float(w["end"]) for w in r.get("after") or [] if isinstance(w, Mapping)]
        if kind == "rollback" and not record.get("dry_run") and after:
            panel.bands.append(Band(at, max(after), "baseline", f"serving {base} (rolled back)"))
        if not ws:
            panel.note = "no judged window kept for this rule"
        panel.markers.append(Marker(at, kind if kind in ("rollback", "promote") else "alert",
                                    f"{kind} at {utc(at)[11:19]}"))
        panels.append(panel)
    return Chart(title=f"{kind} of {record.get('model')}/{record.get('route')} by {record.get('policy')}",
                 panels=panels, footer="evidence " + str(record.get("id") or ""))
