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

from probes.golden import load_golden_set
from tests.test_replay import TableEngine
from watchdog.config.settings import GoldenJobConfig
from watchdog.core.metrics import Metrics
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.evaluate import Verdict
from watchdog.policy.loader import load_policy_files
from watchdog.policy.pooling import line_up_entries
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
        self.scheduler.judged = lambda model, route: self.engine.policy_set.golden_rules(model, route)  # as the daemon
        self.flags = {("m", "qa"): "fp8"}
        self.rollbacks = 0

    def write(self, rows: list[Item], *, fp8_wrong: tuple[int, ...] = (), fp16_wrong: tuple[int, ...] = (),
              generation: str = "{max_new_tokens: 16}", metrics: str = "[exact_match, rougeL]") -> None:
        self.set_dir.mkdir(parents=True, exist_ok=True)
        (self.set_dir / "manifest.yaml").write_text(
            "schema: 1\nname: mini\ndomain: qa\ndescription: mini\nlanguages: [en]\nroutes: ['*']\n"
            f"template: '{{prompt}}'\ngeneration: {generation}\nmetrics: {metrics}\n")
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


# --- items edited under their ids ---------------------------------------------------------------


def test_a_set_replaced_under_the_same_ids_keeps_a_healthy_fp8(tmp_path: Path) -> None:
    """A healthy FP8 differs from FP16 on a few items either way (here 3 worse and 3 better of 200,
    1.5 % each: the shipped tolerance). After 16 hourly replays the lead replaces the questions,
    keeping the ids q0..q199; FP8 is as healthy on the new ones. Before, the per-item healthy levels
    learned on the old questions were applied to the new ones: the 3 items where FP8 had beaten FP16
    counted as broken by 1.0 in the change test, beside the 3 new FP8-sensitive ones, and 6/200
    against a learned 6/3200 failed (Fisher p = 2.6e-5 < 5e-5): a rollback of a healthy FP8 at the
    first replay after the edit."""
    lab = Lab(tmp_path)
    lab.write(items(200), fp8_wrong=(0, 1, 2), fp16_wrong=(3, 4, 5))
    for _ in range(16):
        assert lab.replay().status == "pass"
    lab.write(items(200, tag="new"), fp8_wrong=(10, 11, 12), fp16_wrong=(13, 14, 15))
    verdicts = [lab.replay() for _ in range(3)]
    assert lab.rollbacks == 0, [v.reason for v in verdicts]
    assert all(v.status == "pass" for v in verdicts)
    # the third replay judges the new questions against their own learned levels: nothing broke
    assert change_test(verdicts[-1])["count"] == 0


def test_items_edited_under_their_ids_start_afresh_and_damage_still_rolls_back(tmp_path: Path) -> None:
    """Three items' questions edited (ids kept) where FP8 had beaten FP16: no false change, and an FP8
    damaged afterwards (12 of 60 items broken) still rolls back."""
    lab = Lab(tmp_path)
    rows = items(60)
    lab.write(rows, fp8_wrong=(0,), fp16_wrong=(3, 4, 5))
    for _ in range(4):
        assert lab.replay().status == "pass"
    for k in (3, 4, 5):
        rows[k] = (f"q{k}", f"edited question {k}?", f"The edited answer {k}.")
    lab.write(rows, fp8_wrong=(0,))
    for _ in range(3):
        v = lab.replay()
        assert v.status == "pass" and change_test(v).get("count", 0) == 0, v.reason
    lab.write(rows, fp8_wrong=(0, *range(10, 60, 5)))
    assert lab.replay().status == "fail" and lab.rollbacks == 1


def test_item_versions_follow_what_is_asked(tmp_path: Path) -> None:
    """An item's version changes with its rendered prompt, its reference and the generation settings,
    not with its tags or its line; every replay's signals carry them, aligned with the ids."""
    lab = Lab(tmp_path)
    lab.write(items(3))
    gs = load_golden_set(lab.set_dir)
    first = [gs.version(i) for i in gs.items]
    assert len(set(first)) == 3
    rows = items(3)
    rows[1] = ("q1", "old question 1?", "Another reference.")
    lab.write(rows)
    again = load_golden_set(lab.set_dir)
    assert [again.version(i) for i in again.items] == [first[0], again.version(again.items[1]), first[2]]
    assert again.version(again.items[1]) != first[1]
    lab.write(items(3), generation="{max_new_tokens: 32}")
    longer = load_golden_set(lab.set_dir)
    assert not set(longer.version(i) for i in longer.items) & set(first)
    lab.write(items(3))
    lab.scheduler.run_job("mini")
    cand = next(s for s in lab.scheduler.drain() if s.precision == "fp8")
    assert cand.detail["item_ids"] == ["q0", "q1", "q2"] and cand.detail["item_versions"] == first


def test_an_edited_item_is_not_paired_with_its_old_answers() -> None:
    """The pooled look pairs items by id and version: an edited item takes the latest replay alone,
    and a rotated look never counts it beside its old question as an independent item."""
    prev = {"ids": ["a", "b", "c", "d"], "v": ["1", "1", "1", "1"]}
    edited = {"ids": ["a", "b", "c", "d"], "v": ["1", "2", "1", "1"]}
    values, ids, keys, rotated = line_up_entries(prev, [1.0, 2.0, 3.0, 4.0], edited)
    assert not rotated and ids == ["a", "b", "c", "d"] and values[0] == 1.0 and values[2:] == [3.0, 4.0]
    assert values[1] != values[1]  # NaN: b was another question then
    replaced = {"ids": ["a", "b", "c", "x"], "v": ["9", "9", "9", "9"]}
    values, ids, keys, rotated = line_up_entries(prev, [1.0, 2.0, 3.0, 4.0], replaced)
    assert rotated and ids == ["d"] and keys == ["d@1"] and values == [4.0]
    # entries from before versions: paired by id as before
    values, ids, keys, rotated = line_up_entries({"ids": ["a", "b"]}, [1.0, 2.0], {"ids": ["b", "a"], "v": ["1", "1"]})
    assert not rotated and values == [2.0, 1.0] and ids == keys == ["b", "a"]


def test_levels_of_items_still_asked_outlive_those_of_edited_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Edits leave levels of old versions behind; beyond ``MAX_LEARNED_ITEMS`` the least recently replayed
    go first. Before, the first learned went first: items never edited lost their level every time the
    edited ones' old versions filled the map (1,140 item-replays without a level in 1,500 replays of a
    200-item set with 10 items edited each time, at the 5,000 cap)."""
    from watchdog.policy import pooling

    monkeypatch.setattr(pooling, "MAX_LEARNED_ITEMS", 30)
    null: list[dict[str, Any]] = []
    ids = [f"q{k}" for k in range(20)]
    for t in range(10):
        versions = [str(t) if k < 5 else "0" for k in range(20)]  # q0..q4 edited every replay
        pooling.learn_items(null, {"ids": ids, "v": versions, "diffs": [0.0] * 20}, 24)
    levels = pooling.item_levels(null)
    assert len(levels) == 30
    assert all(f"q{k}@0" in levels and levels[f"q{k}@0"][1] == 10 for k in range(5, 20))


# --- the set cut, grown, and max_items ----------------------------------------------------------


def test_items_appended_removed_and_cut_below_min_items(tmp_path: Path) -> None:
    """Appending and removing items keeps a healthy FP8 (pass); a set cut below the rule's 20 items
    is inconclusive (visible, decides nothing); back to full size a damaged FP8 rolls back."""
    lab = Lab(tmp_path)
    rows = items(100)
    lab.write(rows, fp8_wrong=(0,), fp16_wrong=(1,))
    for _ in range(3):
        assert lab.replay().status == "pass"
    grown = rows + items(60, tag="added", prefix="a")
    lab.write(grown, fp8_wrong=(0, 120), fp16_wrong=(1,))
    assert lab.replay().status == "pass"
    lab.write(grown[40:], fp8_wrong=(80,))
    assert lab.replay().status == "pass"
    lab.write(rows[:10])
    cut = lab.replay()
    assert cut.status == "inconclusive" and "10 < min_samples 20" in cut.reason
    lab.write(rows, fp8_wrong=tuple(range(0, 100, 4)))
    assert lab.replay().status == "fail" and lab.rollbacks == 1


def test_max_items_changed_between_replays(tmp_path: Path) -> None:
    """``max_items`` (read at each replay; a changed config takes a restart, whose state comes back from
    the checkpoints): fewer items, then all again, keeps a healthy FP8; under the rule's minimum it is
    inconclusive."""
    lab = Lab(tmp_path)
    lab.write(items(120), fp8_wrong=(0,), fp16_wrong=(1,))
    spec = lab.scheduler.jobs["mini"].spec
    for max_items in (None, None, 40, 40, None, 12):
        spec.max_items = max_items
        v = lab.replay()
        assert v.status == ("inconclusive" if max_items == 12 else "pass"), (max_items, v.reason)
    assert lab.rollbacks == 0


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


def test_a_manifest_edit_that_drops_the_judged_metric_is_named(tmp_path: Path) -> None:
    """The lead swaps ``rougeL`` for ``chrf`` in the manifest's metrics. The shipped ``golden-rougeL``
    rule then has nothing to judge: an FP8 with 20 of 60 items broken stayed on FP8, every verdict
    ``inconclusive`` ("no paired values for rougeL"), readiness green. It still cannot judge, but the
    job is named as failing (readiness ``golden``, one page) until the metric is back."""
    lab = Lab(tmp_path)
    rows = items(60)
    lab.write(rows)
    assert lab.replay().status == "pass" and lab.scheduler.failing() == {}
    lab.write(rows, metrics="[exact_match, chrf]", fp8_wrong=tuple(range(0, 60, 3)))
    v = lab.replay()
    assert v.status == "inconclusive" and "no paired values for rougeL" in v.reason
    assert lab.scheduler.failing() == {"mini": "rougeL not measured by set mini (rules golden-rougeL judge nothing)"}
    lab.write(rows, fp8_wrong=tuple(range(0, 60, 3)))
    assert lab.replay().status == "fail" and lab.rollbacks == 1 and lab.scheduler.failing() == {}


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
                                        "every_s": None, "candidate": {**opts, "precision": "fp8"},
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
            # a manifest edit that drops the metric the shipped golden rule judges: named, not silent
            manifest = (set_dir / "manifest.yaml").read_text()
            (set_dir / "manifest.yaml").write_text(manifest.replace("[exact_match, rougeL]", "[exact_match]"))
            assert scheduler.run_job("mini")
            wait_until(lambda: any("rougeL not measured" in p for p in daemon.problems()), 10, detail=daemon.problems)
            (set_dir / "manifest.yaml").write_text(manifest)
            assert scheduler.run_job("mini")
            wait_until(lambda: not any(p.startswith("golden: ") for p in daemon.problems()), 10)
            audit = redis_client.xrange("llmwd:audit")
    finally:
        server.shutdown()
    assert flag == "fp8" and audit == []
    assert "golden set invalid" in verdicts and "items.jsonl:9" in verdicts
