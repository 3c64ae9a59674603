"""Policy backtest: recorded events (tests/data/backtest_*.jsonl[.gz]) through windows and the
policy engine, golden reports at their times, the CLI, the PNG.

The recorded files are made by ``generate()`` below (``.venv/bin/python tests/test_backtest.py``
rewrites them): synthetic traffic from watchdog/dev/traffic.py with simulated timestamps, FP8 errors
injected on chat/general at T0 + 8 min in the regression file.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from watchdog.cli.policy import main as policy_cli
from watchdog.dev.traffic import Route, TrafficGenerator
from watchdog.policy import PolicySet, load_policy_files, parse_policy_text
from watchdog.policy.backtest import load_golden_reports, read_lines, run_backtest
from watchdog.policy.backtest_report import backtest_chart, threshold_at
from watchdog.policy.backtest_stats import clopper_pearson, false_rollbacks, margin_table, parse_healthy
from watchdog.policy.backtest_window import WindowChoiceError, choose_window

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
REGRESSION = DATA / "backtest_regression.jsonl.gz"
HEALTHY = DATA / "backtest_healthy.jsonl.gz"
M = "llama-3-8b"
T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC, a multiple of 60 s
INJECT_AT = T0 + 480.0

POLICY = """\
policies:
  - name: bt
    cooldown: 5m
    min_time_in_state: 0s
    promote: {mode: manual, healthy_windows: 5}
    rules:
      - name: error-rate
        metric: error_rate
        fail_if: candidate - baseline > 0.05
        min_samples: 30
        for: 2
        severity: critical
        action: rollback
      - name: error-rate-judged
        metric: error_rate
        judge: {test: rate, effect: 0.01, min_items: 40}
        for: 2
        severity: critical
        action: rollback
      - name: latency
        metric: latency_p50_ms
        judge: {test: mann_whitney, effect: 0.10, min_items: 40}
        action: alert
        severity: warning
      - name: golden-rougeL
        source: golden
        metric: rougeL
        judge: {test: paired, effect: 0.02, min_items: 20}
        severity: critical
        action: rollback
"""


def _events(routes: list[Route], start: float, seconds: float, inject: tuple[str, float] | None, seed: int) -> list[dict]:
    gen = TrafficGenerator(routes, seed=seed)
    arrivals = random.Random(seed + 1)
    out: list[dict] = []
    for r in routes:
        t = start
        while True:
            t += arrivals.expovariate(r.rate)
            if t >= start + seconds:
                break
            r.regression = "errors" if inject and r.route == inject[0] and t >= inject[1] else None
            ev = gen.event(r, now=round(t, 3))
            ev.pop("completion_logprobs", None)  # keeps the recorded file small; not used here
            out.append(ev)
    out.sort(key=lambda e: e["ts"])
    return out


def generate() -> None:
    """Write the recorded examples (deterministic)."""
    routes = [Route(M, "chat/general", rate=2.0, baseline_share=0.5, shadow_share=0.0),
              Route(M, "legal/contracts", rate=2.0, baseline_share=0.5, shadow_share=0.0)]
    events = _events(routes, T0, 900.0, ("chat/general", INJECT_AT), seed=11)
    lines = [json.dumps(e, separators=(",", ":")) for e in events]
    lines.insert(100, "this is not json")
    lines.insert(200, json.dumps({"schema": 1, "model": M}))  # missing fields
    with gzip.GzipFile(REGRESSION, "wb", mtime=0) as fh:
        fh.write(("\n".join(lines) + "\n").encode())
    healthy = _events([Route(M, "chat/general", rate=2.0, baseline_share=0.5, shadow_share=0.0)], T0, 600.0,
                      None, seed=12)
    with gzip.GzipFile(HEALTHY, "wb", mtime=0) as fh:
        fh.write("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in healthy).encode())


def policy_set(text: str = POLICY) -> PolicySet:
    found, errors = parse_policy_text(text, "bt.yaml")
    assert errors == []
    return PolicySet(tuple(found))


def test_regression_flip_found_at_the_right_time() -> None:
    r = run_backtest(policy_set(), read_lines(REGRESSION), window_s=60)
    assert r.bad_lines == 2 and sum(r.bad_reasons.values()) == 2
    assert r.events > 3000 and r.late == 0
    flips = [a for a in r.actions if a.flip]
    assert len(flips) == 1 and r.flips == 1
    (f,) = flips
    assert (f.kind, f.route, f.precision, f.severity, f.cause) == ("rollback", "chat/general", "fp16", "critical", "candidate")
    # errors start at 08:08:00: the windows ending 08:09 and 08:10 fail, for: 2 -> rollback at 08:10
    assert INJECT_AT + 60 <= f.at <= INJECT_AT + 120, f
    assert f.rule in ("error-rate", "error-rate-judged") and f.numbers["candidate"] > 0.05
    assert not any(a.flip for a in r.actions if a.route == "legal/contracts")
    assert not any(a.at <= INJECT_AT for a in r.actions if a.kind in ("rollback", "alert") and a.rule != "latency")
    assert r.flags[(M, "chat/general")] == "fp16" and r.serving[(M, "chat/general")][-1] == (f.at, "fp16")
    json.dumps(r.to_dict())


def test_healthy_history_gives_no_flips() -> None:
    r = run_backtest(policy_set(), read_lines(HEALTHY), window_s=60)
    assert r.bad_lines == 0 and r.windows >= 18
    assert r.flips == 0 and not [a for a in r.actions if a.kind == "rollback"]
    assert not [a for a in r.actions if a.kind == "alert" and a.rule and a.rule.startswith("error")]


def test_shipped_policies_run_on_the_recording() -> None:
    ps = load_policy_files([Path(__file__).resolve().parents[1] / "policies"])
    # the shipped live rules want >= 200 requests per precision: 5-minute windows at 1 rps each
    r = run_backtest(ps, read_lines(REGRESSION), window_s=300)
    rollbacks = [a for a in r.actions if a.kind == "rollback"]
    assert [a.route for a in rollbacks] == ["chat/general"] and rollbacks[0].at > INJECT_AT


def test_gz_and_plain_read_the_same(tmp_path: Path) -> None:
    plain = tmp_path / "r.jsonl"
    plain.write_bytes(gzip.decompress(REGRESSION.read_bytes()))
    gz_lines = list(read_lines(REGRESSION))
    assert gz_lines == list(read_lines(plain)) and len(gz_lines) > 3000
    # gzip is recognised by content, not by name
    odd = tmp_path / "h.data"
    odd.write_bytes(HEALTHY.read_bytes())
    assert list(read_lines(odd)) == list(read_lines(HEALTHY))


def _report(t: float, drop: float) -> dict:
    from probes.drift import DriftReport, EngineInfo, ItemResult, MetricSummary, SideResult

    rng = random.Random(int(t))
    items = []
    for i in range(40):
        base = rng.uniform(0.4, 0.9)
        cand = base - drop + rng.gauss(0, 0.01)
        items.append(ItemResult(f"i{i}", "ref", SideResult("a", scores={"rougeL": cand}),
                                SideResult("b", scores={"rougeL": base})))
    mean_c = sum(i.candidate.scores["rougeL"] for i in items) / 40
    mean_b = sum(i.baseline.scores["rougeL"] for i in items) / 40
    rep = DriftReport("set", EngineInfo("cand", "fp8"), EngineInfo("base", "fp16"), t - 20, t, 40, "rougeL",
                      [MetricSummary("rougeL", mean_c, mean_b, mean_c - mean_b, None, None, 40)], items, {}, [])
    return {**rep.to_dict(), "model": M, "routes": ["legal/contracts"]}


def test_golden_reports_fed_at_their_times(tmp_path: Path) -> None:
    reports = tmp_path / "golden" / "job"
    reports.mkdir(parents=True)
    for k, (t, drop) in enumerate([(T0 + 200, 0.0), (T0 + 700, 0.08)]):
        (reports / f"report-{k}.json").write_text(json.dumps(_report(t, drop)))
    (reports / "latest.json").write_text(json.dumps(_report(T0 + 700, 0.08)))  # a copy: skipped
    (reports / "broken.json").write_text("{")
    feed, bad = load_golden_reports(tmp_path / "golden")
    assert [t for t, _ in feed] == [T0 + 200, T0 + 700] and len(bad) == 1 and "broken.json" in bad[0]
    r = run_backtest(policy_set(), read_lines(REGRESSION), feed, window_s=60)
    legal = [a for a in r.actions if a.route == "legal/contracts" and a.flip]
    assert [(a.kind, a.at, a.rule, a.source) for a in legal] == [("rollback", T0 + 700, "golden-rougeL", "golden")]
    assert r.golden_reports == 2


def test_cli_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pol = tmp_path / "bt.yaml"
    pol.write_text(POLICY)
    png = tmp_path / "timeline.png"
    rc = policy_cli(["policy", "backtest", "--policy", str(pol), "--events", str(REGRESSION), "--window", "1m",
                     "--png", str(png), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flips"] == 1 and out["bad_lines"] == 2 and out["png"]["metric"] == "error_rate"
    (flip,) = [a for a in out["actions"] if a["flip"]]
    assert flip["time"] == "2027-01-15T08:10:00Z" or flip["time"] == "2027-01-15T08:09:00Z"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 300 and img.shape[1] > 600
    plain = tmp_path / "healthy.jsonl"
    plain.write_bytes(gzip.decompress(HEALTHY.read_bytes()))
    rc = policy_cli(["policy", "backtest", "--policy", str(pol), "--events", str(plain), "--window", "60s"])
    text = capsys.readouterr().out
    assert rc == 0 and "0 flips" in text and "backtest" in text
    assert policy_cli(["policy", "backtest", "--policy", str(pol), "--events", str(tmp_path / "nope")]) == 2
    assert policy_cli(["policy", "backtest", "--policy", str(pol), "--events", str(HEALTHY), "--window", "x"]) == 2


@pytest.mark.parametrize(("cond", "baseline", "expected"), [
    ("candidate > 0.05", None, 0.05),
    ("candidate - baseline > 0.02", 0.01, 0.03),
    ("candidate / baseline > 1.5", 100.0, 150.0),
    ("value < 0.8", None, 0.8),
])
def test_threshold_line(cond: str, baseline: float | None, expected: float) -> None:
    text = f"policies:\n  - name: x\n    rules:\n      - {{name: r, metric: error_rate, fail_if: '{cond}'}}\n"
    rule = policy_set(text).policies[0].rules[0]
    got = threshold_at(rule, baseline, 0.0, 200.0 if baseline == 100.0 else 1.0)
    assert got == pytest.approx(expected, abs=0.5 if baseline == 100.0 else 0.003)


# --- the README example, the window choice, not-judged windows, the picture, the risk numbers --------


def _readme_backtest_command() -> str:
    lines = [ln for ln in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
             if ln.startswith("fp8-watchdog policy backtest") and "backtest_regression" in ln]
    assert len(lines) == 1, lines
    return lines[0]


def test_readme_example_run_literally_finds_the_rollback_piped_at_80_columns(tmp_path: Path) -> None:
    # the README's command in a directory that looks like the checkout (its relative paths), piped
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(DATA)
    (tmp_path / "policies").symlink_to(ROOT / "policies")
    argv = shlex.split(_readme_backtest_command())
    assert "--window" not in argv
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(COLUMNS="80", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "watchdog.cli.main", *argv[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "window 5m picked from the recording" in out
    assert re.search(r"08:15:00\s+llama-3-8b/chat/general\s+ROLLBACK -> fp16", out), out
    assert "1 flip," in out and "final flags: llama-3-8b/chat/general=fp16" in out
    # the reason is there in full, wrapped, not squeezed to nothing
    assert all(len(line) <= 80 for line in out.splitlines()), [ln for ln in out.splitlines() if len(ln) > 80]
    flat = " ".join(out.split())
    assert "error-rate-absolute failed 2 window(s) in a row: error_rate: candidate > 0.05 (candidate=0.1276)" in flat
    assert "not judged (n < min)" in out and "latency-p99: 3 of 3 windows (need 500" in flat
    assert "false rollbacks on healthy stretches" in out and "95 % interval [0.0%," in flat
    assert "margin to threshold on healthy stretches" in out
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_window_is_picked_from_the_recording_or_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    shipped = load_policy_files([ROOT / "policies"])
    choice = choose_window(shipped, read_lines(REGRESSION))
    assert choice.window_s == 300
    assert "fp8-default:error-rate" in choice.reachable
    assert "300 per precision" in choice.unreachable["fp8-default:latency-typical"]
    strict = load_policy_files([ROOT / "policies" / "strict-legal-medical.yaml"])
    with pytest.raises(WindowChoiceError, match="covers none of the recording's routes"):
        choose_window(strict, read_lines(HEALTHY))  # legal/* only; the healthy file is chat/general
    rc = policy_cli(["policy", "backtest", "--policy", str(ROOT / "policies" / "strict-legal-medical.yaml"),
                     "--events", str(HEALTHY)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "pass --window" in err
    rc = policy_cli(["policy", "backtest", "--policy", str(ROOT / "policies"), "--events", str(HEALTHY),
                     "--healthy-until", "chat/general=soon"])
    err = capsys.readouterr().err
    assert rc == 2 and "--healthy-until" in err and "bad time 'soon'" in err


def test_windows_below_min_samples_are_reported_not_judged(capsys: pytest.CaptureFixture[str]) -> None:
    ps = load_policy_files([ROOT / "policies" / "default.yaml"])
    r = run_backtest(ps, read_lines(REGRESSION), window_s=10)
    rows = [v for v in r.verdicts if v["rule"] == "error-rate-absolute"]
    assert rows and all(v["not_judged"] == "n < min" and not v["judged"] for v in rows)
    assert r.flips == 0
    chart = backtest_chart(r, ps)
    panel = next(p for p in chart.panels if p.title.endswith("fp8-default:error-rate-absolute"))
    assert panel.note and "NOT JUDGED" in panel.note and "n < 200" in panel.note
    assert {b.label for b in panel.bands} == {"not judged: n < min (200 per precision)"}
    from watchdog.policy.backtest_report import render_table

    render_table(r)
    out = " ".join(capsys.readouterr().out.split())
    assert "not judged (n < min)" in out and "error-rate-absolute:" in out and "(need 200, had" in out


def test_png_draws_the_rule_that_fired_and_the_rollback_in_the_legend() -> None:
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    from watchdog.core.timeline_chart import timeline_figure

    ps = load_policy_files([ROOT / "policies"])
    r = run_backtest(ps, read_lines(REGRESSION), window_s=300)
    (flip,) = [a for a in r.actions if a.flip]
    fig = timeline_figure(backtest_chart(r, ps))
    try:
        fired = [ax for ax in fig.axes if "THIS RULE FIRED THE ROLLBACK" in ax.get_title(loc="left")]
        assert fired, [ax.get_title(loc="left") for ax in fig.axes]
        titles = [ax.get_title(loc="left") for ax in fired]
        assert any(f"fp8-default:{flip.rule}" in t for t in titles)
        for ax in fired:
            rule = ax.get_title(loc="left").split("fp8-default:")[1].split()[0]
            legend = [t.get_text().replace("\n", " ").replace("   ", " ").replace("  ", " ")
                      for t in ax.get_legend().get_texts()]
            assert any(t.startswith(f"{rule} threshold") for t in legend), legend
            assert any(t.startswith("rollback -> fp16 at 08:15") for t in legend), legend
            # the decision line is inside the plot, not on its border
            lo, hi = ax.get_xlim()
            assert lo < mdates.date2num(datetime.fromtimestamp(flip.at, tz=UTC)) < hi
        # the rule that did not fire on that route has its own panel and threshold, not the fired one's
        # (error-rate failed only the last window of its for: 2; it is drawn, not marked as the one that fired)
        others = [ax for ax in fig.axes if "chat/general" in ax.get_title(loc="left") and ax not in fired]
        assert [ax.get_title(loc="left").split("\n")[0].split()[-1] for ax in others] == ["fp8-default:error-rate"]
        for ax in others:
            assert "rollback -> fp16 at 08:15" in " ".join(t.get_text() for t in ax.get_legend().get_texts())
    finally:
        plt.close(fig)


def test_clopper_pearson_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for k, n in [(0, 10), (3, 10), (10, 10), (1, 400), (17, 250)]:
        lo, hi = clopper_pearson(k, n)
        want_lo = 0.0 if k == 0 else stats.beta.ppf(0.025, k, n - k + 1)
        want_hi = 1.0 if k == n else stats.beta.ppf(0.975, k + 1, n - k)
        assert lo == pytest.approx(want_lo, abs=1e-9) and hi == pytest.approx(want_hi, abs=1e-9)


TRIGGER_HAPPY = """\
policies:
  - name: jumpy
    cooldown: 0s
    min_time_in_state: 0s
    promote: {mode: auto, healthy_windows: 1, after: 0s}
    rules:
      - {name: any-error, metric: error_rate, fail_if: candidate > 0.004, min_samples: 30, action: rollback}
"""


def test_false_rollback_rate_on_healthy_stretches_and_margins() -> None:
    start = T0
    specs = [parse_healthy("chat/general=08:08", start), parse_healthy("end", start)]
    assert specs[0].until == INJECT_AT and specs[0].matches(M, "chat/general") and not specs[0].matches(M, "legal/x")
    assert parse_healthy("+8m", start).until == INJECT_AT
    assert parse_healthy("2027-01-15T08:08:00Z", start).until == INJECT_AT
    with pytest.raises(ValueError):
        parse_healthy("chat/general=soon", start)
    # the test policy: no rollback in the healthy stretches
    r = run_backtest(policy_set(), read_lines(REGRESSION), window_s=60)
    rollbacks = [(a.model, a.route, a.at) for a in r.actions if a.flip and a.kind == "rollback"]
    fr = false_rollbacks(r.verdicts, rollbacks, specs)
    assert fr.rollbacks == 0 and fr.windows >= 15 and fr.low == 0.0 and 0 < fr.high < 0.25
    # a policy that rolls back on one error in 30 requests does it on healthy traffic too
    j = run_backtest(policy_set(TRIGGER_HAPPY), read_lines(HEALTHY), window_s=60)
    jr = [(a.model, a.route, a.at) for a in j.actions if a.flip and a.kind == "rollback"]
    fj = false_rollbacks(j.verdicts, jr, [parse_healthy("end", start)])
    assert fj.rollbacks >= 1 and fj.rate is not None and fj.low <= fj.rate <= fj.high
    assert fj.rolled_back >= 1 or fj.rollbacks == len(jr)
    (row,) = margin_table(j.verdicts, [parse_healthy("end", start)])
    assert row["rule"] == "any-error" and row["fired"] >= fj.rollbacks and row["min"] < 0 < row["judged"]
    # margins of a condition rule: threshold - value, negative when failing
    fails = [v for v in j.verdicts if v["status"] == "fail"]
    assert fails and all(v["margin"] == pytest.approx(v["threshold"] - v["stat"]) for v in fails)
    assert all(v["threshold"] == pytest.approx(0.004, abs=1e-9) for v in j.verdicts if v["judged"])


if __name__ == "__main__":
    generate()
    print(f"wrote {REGRESSION} and {HEALTHY}", file=sys.stderr)


def test_judged_table_gives_rate_mdes_in_points_and_says_why_a_rule_is_not_judged() -> None:
    # the header said "rate points" while the cells held fractions (error-rate 0.0859 = 8.59 points), and a
    # rule shown "no" did not say why
    import io

    from rich.console import Console

    from watchdog.policy.backtest_report import render_judged

    ps = load_policy_files([ROOT / "policies" / "default.yaml"])
    r = run_backtest(ps, read_lines(REGRESSION), window_s=300)
    row = next(x for x in r.judged if x["route"] == "chat/general" and x["rule"] == "error-rate")
    assert row["metric"] == "error_rate" and 0.01 < row["mde"] < 1
    buf = io.StringIO()
    render_judged(r, Console(file=buf, width=200))
    lines = buf.getvalue().splitlines()
    cells = next(ln for ln in lines if ln.strip().startswith("error-rate ") and "window" in ln).split()
    assert f"{row['mde'] * 100:.3g}pt" in cells
    p99 = next(ln for ln in lines if ln.strip().startswith("latency-p99 "))
    assert "no" in p99.split() and "too few samples" in p99


def test_a_policy_whose_scope_covers_none_of_the_recording_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # a typo in the scope ("supprt/*") gave "0 flips, 0 alerts": a clean pass, for a policy that judged nothing
    from watchdog.policy import parse_policy_text
    from watchdog.policy.backtest_report import render_table
    from watchdog.policy.loader import PolicySet

    shipped = load_policy_files([ROOT / "policies"])
    assert run_backtest(shipped, read_lines(REGRESSION), window_s=300).uncovered == []
    text = (ROOT / "policies" / "default.yaml").read_text().replace('routes: ["*"]', 'routes: ["supprt/*"]', 1)
    policies, errors = parse_policy_text(text, "typo.yaml")
    assert not errors
    r = run_backtest(PolicySet(tuple(policies)), read_lines(REGRESSION), window_s=300)
    assert r.uncovered == ["policy fp8-default judged nothing: its scope (models ['*'], routes ['supprt/*']) covers "
                           "none of the 2 routes in the recording (llama-3-8b/chat/general, llama-3-8b/legal/contracts)"]
    assert r.to_dict()["uncovered"] == r.uncovered
    render_table(r)
    out = " ".join(capsys.readouterr().out.split())
    assert "warning: policy fp8-default judged nothing" in out


@pytest.mark.parametrize("spec,says", [
    ("chat/genral=08:08", "'chat/genral' matches none of the recording's routes (llama-3-8b/chat/general, "
                          "llama-3-8b/legal/contracts); did you mean 'chat/general'?"),
    ("chat/general=07:00", "that is before the recording starts (2027-01-15 08:00:00 UTC), so it marks nothing"),
])
def test_a_healthy_stretch_that_marks_nothing_is_refused(tmp_path: Path, spec: str, says: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # both printed "0 in 0 healthy live windows ... interval [0.0%, 100.0%]" with exit 0
    pol = tmp_path / "bt.yaml"
    pol.write_text(POLICY)
    rc = policy_cli(["policy", "backtest", "--policy", str(pol), "--events", str(REGRESSION), "--window", "1m",
                     "--healthy-until", spec])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--healthy-until '{spec}': {says}" in err and err.count("\n") == 1


def test_a_bad_first_line_is_skipped_and_counted_like_any_other(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    lines = list(read_lines(REGRESSION))
    pol = tmp_path / "bt.yaml"
    pol.write_text(POLICY)
    counts = []
    for bad_at in (0, 1):  # {oops as line 1, then as line 2
        events = tmp_path / f"bad{bad_at}.jsonl"
        events.write_bytes(b"\n".join([*lines[:bad_at], b"{oops", *lines[bad_at:]]) + b"\n")
        assert policy_cli(["policy", "backtest", "--policy", str(pol), "--events", str(events), "--window", "1m",
                           "--json"]) == 0
        counts.append(json.loads(capsys.readouterr().out)["bad_lines"])
    assert counts[0] == counts[1] >= 1
    readme = tmp_path / "notes.jsonl"  # another kind of file is still refused before any work
    readme.write_text("# notes\n" + "text\n" * 30 + '{"ts": 1}\n')
    assert policy_cli(["policy", "backtest", "--policy", str(pol), "--events", str(readme)]) == 2
    assert "line 1 is not a JSON object, nor are the next 19 lines" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "corrupt-early", "corrupt-late"])
@pytest.mark.parametrize("window", [None, "1m"])
def test_a_damaged_gzip_recording_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              damage: str, window: str | None) -> None:
    data = bytearray(REGRESSION.read_bytes())
    if damage == "truncated":  # a copy cut short: EOFError from gzip
        data = data[:3000]
    else:  # flipped bits in the deflate stream, in or past the sniffed lines: zlib.error
        at = 40 if damage == "corrupt-early" else 3000
        for i in range(at, at + 20):
            data[i] ^= 0x55
    events = tmp_path / "damaged.jsonl.gz"
    events.write_bytes(bytes(data))
    pol = tmp_path / "bt.yaml"
    pol.write_text(POLICY)
    argv = ["policy", "backtest", "--policy", str(pol), "--events", str(events)]
    assert policy_cli([*argv, *(["--window", window] if window else [])]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and "damaged gzip file" in err and err.count("\n") == 1


def test_a_daemon_config_as_policy_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it printed one "unknown key ...; allowed here: policies" per config section (9 lines for the starter config)
    cfg = tmp_path / "config.yaml"
    cfg.write_text("instance: a\npolicies: [p.yaml]\nkafka: {topic: t}\nredis: {url: 'redis://127.0.0.1:1/0'}\n"
                   "server: {port: 9464}\n")
    assert policy_cli(["policy", "backtest", "--policy", str(cfg), "--events", str(REGRESSION)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{cfg}: this looks like a daemon config, not a policy file; pass the policy files its "
                   "policies: list names"], err
