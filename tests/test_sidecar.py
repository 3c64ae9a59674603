"""Sidecar discipline: the daemon path imports no heavy library unless an in-process engine is set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ["torch", "transformers", "evaluate", "datasets", "pynvml", "rouge_score", "nltk", "scipy", "matplotlib"]

SCRIPT = f"""
import json, sys, time
from watchdog.cli.main import build_parser
from watchdog.config.settings import load_config
from watchdog.runtime.daemon import Daemon
from watchdog.core.events import decode_event
from watchdog.policy import PolicyEngine, load_policy_files
from watchdog.dev.traffic import Route, TrafficGenerator
from watchdog.windows.aggregator import WindowAggregator
build_parser()
load_config(None)
engine = PolicyEngine(load_policy_files(["policies/default.yaml", "policies/strict-legal-medical.yaml"]))
gen = TrafficGenerator([Route("m", "legal/a", shadow_share=1.0)])
gen.inject("m", "legal/a", "quality")
agg = WindowAggregator(length_s=1.0, grace_s=0.0)
for i in range(200):
    agg.add(decode_event(gen.encoded(gen.routes[0], now=1000.0 + i / 100)[1]))
signals = agg.close_all()
assert any("shadow_rougeL" in s.values for s in signals)
engine.observe(signals, 1003.0, {{}})
print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
"""


def test_daemon_path_imports_no_heavy_library() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
