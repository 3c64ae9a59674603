"""The watchdog's own Prometheus alert rules (promtool) and its Grafana dashboard (structure, metric names)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.helpers import missing

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/llm-watchdog-rules.yaml"
RULE_TESTS = ROOT / "deploy/prometheus/tests/llm-watchdog-rules.test.yaml"
DASHBOARD = ROOT / "deploy/grafana/llm-watchdog.json"

#: the metric-name contract of this wave (docs/OPERATIONS.md); names the daemon adds to watchdog/core/metrics.py
CONTRACT = {
    "llmwd_ready": "gauge",
    "llmwd_not_ready": "gauge",
    "llmwd_loop_last_timestamp_seconds": "gauge",
    "llmwd_flip_budget_exhausted_total": "counter",
    "llmwd_ops_alerts_total": "counter",
}
_SERIES_SUFFIX = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def known_series() -> set[str]:
    """Every series name the daemon exports: watchdog/core/metrics.py's metrics plus the contract."""
    text = (ROOT / "watchdog/core/metrics.py").read_text()
    found = {name: kind.lower() for kind, name in re.findall(r"\b(Counter|Gauge|Histogram)\(\s*\"(llmwd_\w+)\"", text)}
    assert len(found) >= 10, "watchdog/core/metrics.py changed shape; update this parser"
    merged = {**CONTRACT, **found}
    return {name + suffix for name, kind in merged.items() for suffix in _SERIES_SUFFIX[kind]}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bllmwd_\w+", expr))


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing("promtool missing: scripts/setup.sh installs Debian's prometheus package",
                "promtool not installed (apt-get install prometheus)")
    return path


def test_rules_pass_promtool_check_and_unit_tests() -> None:
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert f"SUCCESS: {len(rules)} rules found" in check.stdout
    unit = subprocess.run([tool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout


def test_every_rule_is_unit_tested_and_uses_exported_metrics() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    series = known_series()
    for rule in rules:
        assert rule["alert"] in firing, f"{rule['alert']} has no promtool case where it fires"
        assert rule["labels"]["severity"] in {"warning", "critical"}
        names = metric_names(rule["expr"])
        assert names and names <= series, f"{rule['alert']}: unknown metric(s) {sorted(names - series)}"


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "llm-watchdog" and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    series = known_series()
    covered: set[str] = set()
    for p in panels:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) and g[k] >= 0 for k in "hwxy") and g["w"] >= 1 and g["h"] >= 1
        assert g["x"] + g["w"] <= 24, f"panel {p['id']} is wider than the grid"
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['id']} ({p['title']}) overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", f"panel {p['id']} is not on the datasource variable"
        assert p["targets"], f"panel {p['id']} has no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            names = metric_names(t["expr"])
            assert names, f"panel {p['id']}: {t['expr']!r} reads no llmwd_ metric"
            assert names <= series, f"panel {p['id']}: unknown metric(s) {sorted(names - series)}"
            assert '$instance' in t["expr"], f"panel {p['id']} ignores the instance selector"
            covered |= names
    # what the dashboard is for: routes/flags, verdicts, lag, DLQ, flips, readiness
    for needed in ("llmwd_route_precision_is_candidate", "llmwd_actions_total", "llmwd_consumer_lag",
                   "llmwd_dead_letters_total", "llmwd_flips_total", "llmwd_ready", "llmwd_not_ready"):
        assert needed in covered, f"no panel shows {needed}"
