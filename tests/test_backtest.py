"""Policy backtest: recorded events (tests/data/backtest_*.jsonl[.gz]) through windows and the
policy engine, golden reports at their times, the CLI, the PNG.

The recorded files are made by ``generate()`` below (``.venv/bin/python tests/test_backtest.py``
rewrites them): synthetic traffic from watchdog/dev/traffic.py with simulated timestamps, FP8 errors
injected on chat/general at T0 + 8 min in the regression file.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

import pytest

from watchdog.cli.policy import main as policy_cli
from watchdog.dev.traffic import Route, TrafficGenerator
from watchdog.policy import PolicySet, load_policy_files, parse_policy_text
from watchdog.policy.backtest import load_golden_reports, read_lines, run_backtest
from watchdog.policy.backtest_report import threshold_at

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


if __name__ == "__main__":
    generate()
    print(f"wrote {REGRESSION} and {HEALTHY}", file=sys.stderr)
