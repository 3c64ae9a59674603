"""Golden sets edited between scheduled replays while the daemon runs: an ML lead's ordinary day.

Items appended, removed or edited under their ids, the set replaced under its name, made invalid and
valid again, ``max_items`` changed. The scheduler's own replay (``default_replay``: the set is read
from disk at every replay) with table engines, judged by the shipped policies through
``PolicyEngine``: a healthy FP8 must stay, a damaged one must roll back, an invalid set must be an
error that pages ops and decides nothing."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_replay import TableEngine
from watchdog.config.settings import GoldenJobConfig
from watchdog.core.metrics import Metrics
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.evaluate import Verdict
from watchdog.policy.loader import load_policy_files
from watchdog.runtime.golden import golden_readiness
from watchdog.runtime.health import Readiness
from watchdog.sources.engine_cache import EngineCache
from watchdog.sources.golden import GoldenJob, GoldenLeader, GoldenScheduler

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "policies" / "default.yaml"
WRONG = "no idea at all"
Item = tuple[str, str, str]  # id, prompt, reference


def items(n: int, tag: str = "old", prefix: str = "q") -> list[Item]:
    return [(f"{prefix}{k}", f"{tag} question {k}?", f"The {tag} answer {k} is this one.") for k in range(n)]


class Lab:
    """A golden set on disk, two table engines answering from it, the scheduler and the shipped policies."""

    def __init__(self, root: Path, **job: Any) -> None:
        self.root = root
        self.set_dir = root / "mini"
        self.answers: dict[str, str] = {}
        #: precision -> prompts it answers wrongly
        self.wrong: dict[str, set[str]] = {"fp8": set(), "fp16": set()}
        spec = GoldenJobConfig.model_validate({
            "name": "mini", "set": "mini", "model": "m", "routes": ["qa"], "every_s": None, "jitter_s": 0.0,
            "candidate": {"kind": "table", "precision": "fp8"}, "baseline": {"kind": "table", "precision": "fp16"},
            **job})
        engines = EngineCache(build=lambda options: _LabEngine(self, str(options["precision"])), idle_s=None)
        self.scheduler = GoldenScheduler([GoldenJob(spec, root=str(root))], engines=engines)
        self.engine = PolicyEngine(load_policy_files([str(POLICY)]))
        self.flags = {("m", "qa"): "fp8"}
        self.rollbacks = 0

    def write(self, rows: list[Item], *, fp8_wrong: tuple[int, ...] = (), fp16_wrong: tuple[int, ...] = (),
              generation: str = "{max_new_tokens: 16}") -> None:
        self.set_dir.mkdir(parents=True, exist_ok=True)
        (self.set_dir / "manifest.yaml").write_text(
            "schema: 1\nname: mini\ndomain: qa\ndescription: mini\nlanguages: [en]\nroutes: ['*']\n"
            f"template: '{{prompt}}'\ngeneration: {generation}\nmetrics: [exact_match, rougeL]\n")
        (self.set_dir / "items.jsonl").write_text(
            "".join(json.dumps({"id": i, "prompt": p, "reference": r}) + "\n" for i, p, r in rows))
        self.answers.update({p: r for _, p, r in rows})
        self.wrong = {"fp8": {rows[k][1] for k in fp8_wrong}, "fp16": {rows[k][1] for k in fp16_wrong}}

    def replay(self) -> Verdict:
        self.scheduler.run_job("mini")
        sigs = self.scheduler.drain()
        for action in self.engine.observe(sigs, max(s.end for s in sigs) + 1.0, self.flags):
            if action.kind == "rollback":
                self.rollbacks += 1
                self.flags[("m", "qa")] = "fp16"
        verdict = self.engine.states[("fp8-default", "m", "qa")].rules["golden-rougeL"].last
        assert verdict is not None
        return verdict


class _LabEngine(TableEngine):
    """A resident table engine that answers from the lab's current set (edited between replays)."""

    def __init__(self, lab: Lab, precision: str) -> None:
        super().__init__(precision, lab.answers)
        self.lab = lab

    def generate(self, prompts, max_new_tokens):  # type: ignore[no-untyped-def]
        self.perturb = {p: WRONG for p in self.lab.wrong[self.precision]}
        return super().generate(prompts, max_new_tokens)


def change_test(v: Verdict) -> dict[str, Any]:
    bt = ((v.judgement or {}).get("detail") or {}).get("broken_test") or {}
    return bt.get("change") or {}


# --- the set made invalid ---------------------------------------------------------------------------


def _break(set_dir: Path, how: str) -> str:
    """Make the set invalid one way; returns what the error must name."""
    if how == "bad-json-line":
        with (set_dir / "items.jsonl").open("a") as f:
            f.write('{"id": "x", "prompt": "p",\n')
        return "items.jsonl:61: invalid JSON"
    if how == "missing-items":
        (set_dir / "items.jsonl").unlink()
        return "items.jsonl: cannot read items"
    if how == "bad-yaml":
        with (set_dir / "manifest.yaml").open("a") as f:
            f.write("generation: [\n")
        return "manifest.yaml:"
    assert how == "set-removed"
    for f in set_dir.iterdir():
        f.unlink()
    set_dir.rmdir()
    return "no golden set 'mini'"


@pytest.mark.parametrize("how", ["bad-json-line", "missing-items", "bad-yaml", "set-removed"])
def test_an_invalid_set_is_an_error_that_never_rolls_back(tmp_path: Path, how: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Before, a set left invalid by an edit raised out of the replay: a traceback in the log and an
    error signal blamed on the candidate, which ``errors_trip_after`` (3) turned into a rollback of the
    healthy FP8 at the third scheduled replay. Now: an error verdict naming the file and line, no
    rollback, no traceback, the job listed as failing (readiness ``golden``), and back to valid the
    next replay judges FP8 again."""
    lab = Lab(tmp_path)
    rows = items(60)
    lab.write(rows)
    assert lab.replay().status == "pass"
    named = _break(lab.set_dir, how)
    caplog.set_level(logging.INFO)
    for _ in range(4):
        v = lab.replay()
        assert v.status == "error" and named in v.reason, v.reason
    assert lab.rollbacks == 0 and lab.flags[("m", "qa")] == "fp8"
    assert not [r for r in caplog.records if r.exc_info], "a traceback for an invalid golden set"
    assert named in lab.scheduler.failing()["mini"]
    lab.write(rows)
    assert lab.replay().status == "pass" and lab.scheduler.failing() == {}


def test_readiness_names_a_golden_job_that_judges_nothing(tmp_path: Path) -> None:
    """The readiness reason ``golden`` holds while a job's last replay judged nothing of FP8, on the
    lease holder only; it pages once (warning) and clears at the next replay that judged."""
    lab = Lab(tmp_path)
    lab.write(items(30))
    pages: list[tuple[str, str, str]] = []
    readiness = Readiness(Metrics(), lambda *a: pages.append(a), lambda key: None, fire_after_s=0.0)

    class Held:
        def tick(self, now: float) -> bool:
            return True

        def release(self) -> None:
            pass

    leader = GoldenLeader(lab.scheduler, Held())
    leader.running = True  # the scheduler itself is driven by run_job here
    lab.replay()
    golden_readiness(readiness, leader, 1.0)
    assert readiness.problems() == []
    (lab.set_dir / "items.jsonl").write_text("{oops\n")
    lab.replay()
    golden_readiness(readiness, leader, 2.0)
    readiness.tick(2.0)
    assert [p for p in readiness.problems() if p.startswith("golden: ") and "items.jsonl:1" in p]
    assert [p[0] for p in pages] == ["golden"]
    lab.write(items(30))
    lab.replay()
    golden_readiness(readiness, leader, 3.0)
    assert readiness.problems() == []
    leader.running = False  # another replica holds the lease: not ours to name
    lab.scheduler.jobs["mini"].last_error = "x"
    golden_readiness(readiness, leader, 4.0)
    assert readiness.problems() == []


@pytest.mark.services
def test_daemon_keeps_fp8_and_pages_while_an_edit_leaves_the_set_invalid(kafka_service, redis_service, redis_client,
                                                                          topic, tmp_path: Path) -> None:
    """The whole daemon (real Redis and broker, OpenAI-compatible engines, the shipped policies): four
    scheduled replays of a set an edit left invalid keep the route on FP8 and raise readiness
    ``golden`` with one page; the fixed set clears it and is judged again."""
    import threading
    from http.server import ThreadingHTTPServer

    from tests.daemon_harness import make_config, running_daemon
    from tests.helpers import wait_until, write_golden_set
    from tests.test_golden_baseline_failed import ITEMS, _Healthy

    set_dir = write_golden_set(tmp_path / "mini", ITEMS.items(), name="mini", languages="en")
    good = (set_dir / "items.jsonl").read_text()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    opts = {"kind": "openai", "model": "m", "timeout_s": 2.0, "retries": 0,
            "base_url": f"http://127.0.0.1:{server.server_port}"}
    cfg = make_config(kafka_service.address, redis_service.port, topic, POLICY, None,
                      golden={"jobs": [{"name": "mini", "set": str(set_dir), "model": "llama-3-8b", "routes": ["qa"],
                                        "every_s": 3600, "candidate": {**opts, "precision": "fp8"},
                                        "baseline": {**opts, "precision": "fp16"}}]})
    try:
        with running_daemon(cfg) as (daemon, _server):
            scheduler = daemon.golden
            wait_until(lambda: daemon.golden_leader.running, 15)
            assert scheduler.run_job("mini")
            (set_dir / "items.jsonl").write_text(good + '{"id": "t9", "prompt": \n')
            for _ in range(4):
                assert scheduler.run_job("mini") is False
                time.sleep(0.5)
            wait_until(lambda: any(p.startswith("golden: ") for p in daemon.problems()), 10,
                       detail=daemon.problems)
            wait_until(lambda: daemon.metrics.ops_alerts.labels("golden")._value.get() == 1, 10)
            time.sleep(1.0)  # the loop judged every replay
            flag = daemon.flags.precision_for("llama-3-8b", "qa")
            verdicts = json.dumps(daemon.status()["verdicts"])
            (set_dir / "items.jsonl").write_text(good)
            assert scheduler.run_job("mini")
            wait_until(lambda: not any(p.startswith("golden: ") for p in daemon.problems()), 10)
            audit = redis_client.xrange("llmwd:audit")
    finally:
        server.shutdown()
    assert flag == "fp8" and audit == []
    assert "golden set invalid" in verdicts and "items.jsonl:9" in verdicts
