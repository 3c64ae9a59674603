"""``make demo`` end to end: all four parts of ``llm-watchdog demo`` and each part's outcome.

1. healthy traffic on four routes (synthetic, and ``support/chat`` through the real gateway);
2. an injected FP8 quality regression on ``legal/contracts`` is rolled back;
3. a stale FP8 checkpoint behind the gateway is rolled back and the gateway serves FP16;
4. golden replays with the in-process engine: healthy FP8 stays, stale FP8 is rolled back, each
   with its distance from the rollback line.

No test ran the demo's golden part before issue 17, so a demo that failed on a newcomer's CPU sat
beside a green suite. The demo starts its own broker and Redis (as a newcomer's ``make demo`` does).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("uvicorn")

from watchdog.dev import demo  # noqa: E402
from watchdog.dev.demo_golden import ITEMS, SET, GoldenDemo, demo_model, margin_check, shipped_model_fits  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.torch, pytest.mark.slow]


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The demo sends library logs to its own file (it replaces the root logger's stream handlers):
    put the root logger back as it was afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


def test_the_shipped_demo_model_fits_the_code_set_with_its_margin(tmp_path: Path) -> None:
    """The fast guard: the shipped model answers exactly the demo's 32 'code' items (edit the set and
    this fails, instead of every newcomer's demo silently training for minutes), and on this CPU
    every reference token leads by margins a CPU's float kernels cannot bridge."""
    from probes.engines.torch_engine import calibrate_model
    from probes.golden import find_golden_set, load_golden_set

    pairs = load_golden_set(find_golden_set(SET)).head(ITEMS).pairs()
    assert shipped_model_fits(pairs), "rebuild probes/data/demo_code_model (docs/GOLDEN.md)"
    model_dir, origin = demo_model(tmp_path, pairs)
    assert origin == "shipped"
    calibrate_model(model_dir, [p + r for p, r in pairs])
    check = margin_check(model_dir, pairs)
    assert check.fp16 > 3.0 and check.fp8 > 2.0 and check.fp8_items == len(pairs), check
    assert check.stale_items == 0, check


@pytest.mark.timeout(600)
def test_make_demo_runs_all_four_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch, root_logging: None) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps at 80 columns otherwise
    probes: list[GoldenDemo] = []
    make_probe = demo._golden_probe

    def keep_probe(*args: Any) -> Any:
        probe = make_probe(*args)
        probes.append(probe)
        return probe

    monkeypatch.setattr(demo, "_golden_probe", keep_probe)
    code = demo.run_demo(workdir=tmp_path)
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out
    assert "demo finished" in out
    assert "Traceback" not in captured.err, captured.err  # a stranger's first command prints none

    # 1. healthy traffic: every route on FP8, the gateway answering
    assert re.search(r"gateway: [1-9]\d* client requests answered", out), out
    # 2. the injected quality regression is rolled back, with evidence and an on-call alert
    assert re.search(r"ROLLED BACK \S+/legal/contracts to FP16", out), out
    # 3. the stale checkpoint behind the gateway is rolled back and the gateway switches to FP16
    assert re.search(r"ROLLED BACK \S+/support/chat to FP16", out), out
    assert "the gateway served FP16 from the next request on" in out
    # 4. golden replays: the healthy one stays on FP8 inside the rollback line, the stale one is
    #    rolled back beyond it, each with its margin printed
    (probe,) = probes
    assert probe.check is not None and probe.check.fp8 > 1.0 and probe.check.fp8_items == probe.check.n, probe.check
    assert probe.check.stale_items < probe.check.n // 2
    assert [(kind, status) for kind, status, _ in probe.outcomes] == [("healthy", "pass"), ("stale", "fail")], out
    healthy, stale = probe.outcomes[0][2], probe.outcomes[1][2]
    assert any("short of it" in line for line in healthy) and any("past it" in line for line in stale), out
    assert any(line.endswith("inside") for line in healthy) and any(line.endswith("beyond") for line in stale), out
    assert "robust by construction" in out and "stays on FP8" in out
    assert re.search(r"ROLLED BACK \S+/code/assist to FP16", out), out
    # each rollback's evidence page is printed (docs/EVIDENCE.md)
    links = re.findall(r"evidence: (http://127\.0\.0\.1:\d+/evidence/\S+-rollback-\w+)", out)
    assert len(links) == 3, out
    reports = sorted((tmp_path / "golden-reports" / "code-assist-fp8").glob("report-*.json"))
    assert len(reports) >= 1  # one file per second: two replays within a second share a name
    latest = json.loads((tmp_path / "golden-reports" / "code-assist-fp8" / "latest.json").read_text())
    rouge = next(m for m in latest["metrics"] if m["metric"] == "rougeL")
    assert rouge["candidate"] < rouge["baseline"] - 0.5  # the stale replay: answers fell apart


def test_a_skipped_part_names_the_real_distribution_with_its_extras(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """The hint went through rich unescaped: ``[torch,gateway]`` was taken for markup and vanished,
    leaving ``pip install 'llm-watchdog'``, which installs PyPI's unrelated llm-watchdog."""
    import importlib.util

    from rich.console import Console

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("uvicorn", "torch") else real(name, *a))
    console = Console(record=True, width=200)
    assert demo._gateway_demo(console, tmp_path) is None
    assert demo._golden_probe(console, tmp_path) is None
    text = console.export_text()
    assert "gateway part skipped: torch, uvicorn not installed (pip install 'fp8-watchdog[torch,gateway]')" in text
    assert "golden replay part skipped: torch not installed (pip install 'fp8-watchdog[torch]')" in text
