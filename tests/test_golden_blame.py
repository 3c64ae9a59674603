"""A golden replay that raises is blamed on the engine that failed, never on FP8 by default.

Found by an outside review: when the replay itself raised (the FP16 engine could not be built: a bad
model path, an OpenAI-compatible FP16 server refusing connections at construction, out of memory while
loading it), the error signal counted toward the candidate's ``errors_trip_after`` (3), and the third
scheduled replay rolled the route back to the engine that was failing. Now an engine that cannot be
built names its side: a baseline that cannot be built, a replay that fails in neither engine (scoring,
the scheduler) and a report that cannot be saved never trip the rule and page ops (readiness
``golden``); an FP8 engine that cannot be built is FP8's failure and still rolls back.

The scheduler's own replay (``default_replay`` through ``EngineCache``) with table engines, judged by
the shipped policies (``tests/test_golden_edits.py``'s ``Lab``), and the whole daemon with real Redis
and a real broker."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.test_golden_edits import POLICY, Lab, _LabEngine, items
from watchdog.policy.evaluate import BASELINE_FAILED


def _build_failing(lab: Lab, precision: str, exc: Exception) -> None:
    """``lab``'s engines of ``precision`` fail to build (raise ``exc``); the other side builds as before.
    The resident engines are released first (as after ``idle_s`` or a lease handover), so the next
    replay builds both again."""
    def build(options: dict[str, Any]) -> Any:
        if options["precision"] == precision:
            raise exc
        return _LabEngine(lab, str(options["precision"]))

    assert lab.scheduler.engines is not None
    lab.scheduler.engines.close("idle")
    lab.scheduler.engines.build = build


def test_a_baseline_that_cannot_be_built_never_rolls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: the third replay rolled the healthy FP8 back to the FP16 engine that could not load."""
    lab = Lab(tmp_path)
    lab.write(items(60))
    assert lab.replay().status == "pass"
    _build_failing(lab, "fp16", FileNotFoundError("no model at /models/llama-3-8b-fp16"))
    caplog.set_level(logging.INFO)
    verdicts = [lab.replay() for _ in range(4)]
    assert lab.rollbacks == 0 and lab.flags[("m", "qa")] == "fp8", [v.reason for v in verdicts]
    assert all(v.status == "error" and v.extra.get(BASELINE_FAILED) for v in verdicts)
    assert "baseline engine could not be built" in verdicts[-1].reason
    assert "/models/llama-3-8b-fp16" in verdicts[-1].reason
    assert "baseline engine could not be built" in lab.scheduler.failing()["mini"]  # readiness golden
    assert not [r for r in caplog.records if r.exc_info], "a traceback for an engine that cannot be built"
    lab.scheduler.engines.build = lambda options: _LabEngine(lab, str(options["precision"]))  # type: ignore[union-attr]
    assert lab.replay().status == "pass" and lab.scheduler.failing() == {}


def test_a_baseline_out_of_memory_while_loading_never_rolls_back(tmp_path: Path) -> None:
    lab = Lab(tmp_path)
    lab.write(items(60))
    _build_failing(lab, "fp16", MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    verdicts = [lab.replay() for _ in range(4)]
    assert lab.rollbacks == 0, [v.reason for v in verdicts]
    assert all(v.status == "error" and "out of memory" in v.reason for v in verdicts)


def test_a_candidate_that_cannot_be_built_still_rolls_back(tmp_path: Path) -> None:
    """An FP8 engine that cannot be built is FP8's failure: ``errors_trip_after`` (3) rolls it back."""
    lab = Lab(tmp_path)
    lab.write(items(60))
    assert lab.replay().status == "pass"
    _build_failing(lab, "fp8", RuntimeError("FP8 checkpoint has no scales for layer 3"))
    verdicts = [lab.replay() for _ in range(3)]
    assert all(v.status == "error" and not v.extra.get(BASELINE_FAILED) for v in verdicts)
    assert "candidate engine could not be built" in verdicts[-1].reason
    assert lab.rollbacks == 1 and lab.flags[("m", "qa")] == "fp16"


def test_a_replay_that_fails_in_neither_engine_never_rolls_back(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Both engines built and answered; the scoring raised (a broken scorer install): nothing of FP8 is
    known, so it pages and never trips."""
    import probes.golden_replay

    def broken(*_a: Any, **_k: Any) -> Any:
        raise ImportError("rouge_score is not installed")

    lab = Lab(tmp_path)
    lab.write(items(60))
    monkeypatch.setattr(probes.golden_replay, "Scorer", broken)
    verdicts = [lab.replay() for _ in range(4)]
    assert lab.rollbacks == 0, [v.reason for v in verdicts]
    assert all(v.status == "error" and v.extra.get(BASELINE_FAILED) for v in verdicts)
    assert "rouge_score is not installed" in lab.scheduler.failing()["mini"]


def test_a_report_that_cannot_be_saved_is_still_judged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``golden.reports_dir`` unwritable (here a file; a full disk alike): before, the save raised out of
    the replay and the healthy FP8 was rolled back at the third replay. The replay is judged as usual and
    the lost report is one logged line."""
    lab = Lab(tmp_path)
    lab.write(items(60), fp8_wrong=tuple(range(0, 60, 3)))
    blocker = tmp_path / "reports"
    blocker.write_text("not a directory")
    lab.scheduler.reports_dir = blocker
    caplog.set_level(logging.INFO)
    v = lab.replay()
    assert v.status == "fail" and lab.rollbacks == 1, v.reason  # a damaged FP8 is judged and rolled back
    assert [r for r in caplog.records if "report not saved" in r.getMessage() and not r.exc_info]
    lab.write(items(60))
    lab.flags[("m", "qa")] = "fp8"
    assert lab.replay().status == "pass" and lab.scheduler.failing() == {}


def _refused_port() -> int:
    """A local port nothing listens on (connections are refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


@pytest.mark.services
def test_daemon_keeps_fp8_while_the_fp16_server_refuses_connections(kafka_service, redis_service, redis_client,
                                                                    topic, tmp_path: Path) -> None:
    """The whole daemon, the shipped policies, OpenAI-compatible engines: the FP16 server is down, so
    the baseline engine cannot be built (it asks the server for its model name). Four scheduled replays
    keep the route on FP8 and raise readiness ``golden`` with one page."""
    from tests.daemon_harness import make_config, running_daemon
    from tests.helpers import wait_until, write_golden_set
    from tests.test_golden_baseline_failed import ITEMS, _Healthy

    set_dir = write_golden_set(tmp_path / "mini", ITEMS.items(), name="mini", languages="en")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    opts = {"kind": "openai", "timeout_s": 2.0, "connect_timeout_s": 0.5, "retries": 0}
    cfg = make_config(kafka_service.address, redis_service.port, topic, POLICY, None,
                      golden={"jobs": [{"name": "mini", "set": str(set_dir), "model": "llama-3-8b", "routes": ["qa"],
                                        "every_s": None,
                                        "candidate": {**opts, "model": "m", "precision": "fp8",
                                                      "base_url": f"http://127.0.0.1:{server.server_port}"},
                                        "baseline": {**opts, "precision": "fp16",
                                                     "base_url": f"http://127.0.0.1:{_refused_port()}"}}]})
    try:
        with running_daemon(cfg) as (daemon, _server):
            scheduler = daemon.golden
            wait_until(lambda: daemon.golden_leader.running, 15)
            for _ in range(4):
                assert scheduler.run_job("mini") is False
                time.sleep(0.5)
            wait_until(lambda: any(p.startswith("golden: ") for p in daemon.problems()), 10, detail=daemon.problems)
            wait_until(lambda: daemon.metrics.ops_alerts.labels("golden")._value.get() == 1, 10)
            time.sleep(1.0)  # the loop judged every replay
            flag = daemon.flags.precision_for("llama-3-8b", "qa")
            verdicts = json.dumps(daemon.status()["verdicts"])
            audit = redis_client.xrange("llmwd:audit")
    finally:
        server.shutdown()
    assert flag == "fp8", f"route rolled back to the FP16 engine that cannot be built: {audit}"
    assert audit == []
    assert "baseline engine could not be built" in verdicts and "ConnectError" in verdicts
