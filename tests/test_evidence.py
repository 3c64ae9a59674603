"""Evidence per decision (issue 21 items 1-2): a bounded record in Redis for every rollback, promote
and alert, its page on the daemon's HTTP server (checked in a real headless Chromium), the links in
every page sent, and ``evidence list|export``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from probes.golden import GoldenItem, GoldenSet, Manifest
from probes.golden_replay import replay
from tests.daemon_harness import make_config, running_daemon
from tests.helpers import wait_until
from tests.test_replay import TableEngine
from watchdog.alerting.incidents import IncidentBook
from watchdog.core.evidence_page import chart_of, highlight, render_list, render_record
from watchdog.core.keys import Keys
from watchdog.core.signals import Action
from watchdog.policy.evidence import bounded_json, evidence_id

ARTIFACTS = Path(os.environ.get("LLMWD_ARTIFACTS") or Path(__file__).parent / "artifacts")

#: the golden set: FP8 breaks three items (one answer is hostile HTML: the page must escape it)
ANSWERS = {f"What is the capital of country {i}?": f"The capital of country {i} is City{i}." for i in range(8)}
BROKEN = {
    "What is the capital of country 1?": "Banana pudding recipe with seventeen eggs",
    "What is the capital of country 4?": "<script>document.title='pwned'</script><b>bold lie</b>",
    "What is the capital of country 6?": "I cannot answer questions about geography",
}

GOLDEN_POLICY = """\
policies:
  - name: golden-guard
    cooldown: 0s
    rules:
      - name: exact-match-drop
        source: golden
        metric: exact_match
        fail_if: "paired_mean < -0.25"
        min_samples: 5
        severity: critical
        action: rollback
    promote: {mode: auto, healthy_windows: 3, after: 10m}
"""


def golden_set(root: Path) -> GoldenSet:
    manifest = Manifest.model_validate({"name": "capitals", "domain": "d", "description": "d", "languages": ["en"],
                                        "routes": ["*"], "generation": {"max_new_tokens": 16, "stop": ["\n"]},
                                        "metrics": ["exact_match", "rougeL"]})
    items = tuple(GoldenItem(f"cap{i}", q, a) for i, (q, a) in enumerate(ANSWERS.items()))
    return GoldenSet(root, manifest, items)


class Replays:
    """The golden job's replay: healthy FP8 until ``broken`` is set."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.broken = False

    def __call__(self, _job: Any) -> Any:
        fp8 = TableEngine("fp8", ANSWERS, perturb=BROKEN if self.broken else None)
        return replay(golden_set(self.root), fp8, TableEngine("fp16", ANSWERS), progress=False)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, *extra: str, timeout: float = 90.0) -> str:
    """``chromium --headless`` on ``url``: its stdout (the DOM with ``--dump-dom``)."""
    exe = chromium()
    assert exe is not None
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--disable-extensions", "--disable-background-networking", "--user-data-dir=" + str(ARTIFACTS / ".chromium"),
           *extra, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


# -- pure parts ---------------------------------------------------------------------------------

def test_page_escapes_untrusted_text_and_marks_the_changed_words() -> None:
    record = {"id": "x1", "kind": "rollback", "model": "m<i>", "route": "r", "policy": "p", "at": 1.7e9,
              "reason": "<img src=x onerror=alert(1)>", "candidate": "fp8", "baseline": "fp16",
              "rules": [{"name": "r1", "involved": True, "source": "golden", "metric": "exact_match",
                         "before": [], "after": [],
                         "broken_items": [{"id": "i1", "reference": "a <b>", "candidate": "<script>x</script> a",
                                           "baseline": "a"}]}]}
    page = render_record(record, None, "no chart")
    assert "<script>x" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    assert "<img src=x" not in page and "m&lt;i&gt;" in page
    assert highlight("the cat sat", "the dog sat") == "the <mark>cat</mark> sat"
    assert "<script" not in render_list([{"id": "<script>", "kind": "alert", "reason": "<script>"}])
    assert chart_of(record).panels  # a panel per rule that made the decision, even without windows


def test_records_stay_within_their_size_limit() -> None:
    big = "word " * 5000
    record = {"id": "x", "kind": "alert", "model": "m", "route": "r", "policy": "p", "at": 1.0, "reason": "why",
              "rules": [{"name": f"r{k}", "involved": k == 0, "reason": big, "before": [{"end": float(i), "x": big[:200]}
                                                                                        for i in range(200)],
                         "after": [], "broken_items": [{"id": str(i), "candidate": big} for i in range(12)]}
                        for k in range(4)], "audit": [{"reason": big[:300]}] * 20, "detail": {"x": float("nan")}}
    raw = bounded_json(record, 65_536)
    assert len(raw) <= 65_536
    back = json.loads(raw)
    assert back["id"] == "x" and back.get("truncated") is True


def test_alert_links_to_the_evidence_page() -> None:
    book = IncidentBook(status_url="https://wd.example/status", evidence_url="https://wd.example/evidence")
    action = Action(kind="rollback", policy="p", model="m", route="r", reason="bad", at=100.0)
    action.detail["evidence"] = evidence_id(action)
    (alert,) = book.on_action(action)
    assert alert.url == f"https://wd.example/evidence/{action.detail['evidence']}"
    (resolved,) = book.on_action(Action(kind="promote", policy="p", model="m", route="r", reason="ok", at=200.0))
    assert resolved.url == alert.url  # a promote without a record of its own links the incident's
    ops = book.on_ops_alert("redis", "Redis down")
    assert ops[0].url == "https://wd.example/status"  # ops alerts have no record
    assert Keys("k").evidence("a:b") == "k:evidence:a%3Ab"


# -- through the daemon, in a browser -----------------------------------------------------------

@pytest.mark.services
@pytest.mark.timeout(240)
def test_golden_rollback_evidence_page_in_headless_chromium(kafka_service, redis_service, redis_client, topic,
                                                             tmp_path: Path, sink) -> None:
    if chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; scripts/setup.sh installs it)")
    s, sink_url = sink
    policy = tmp_path / "golden.yaml"
    policy.write_text(GOLDEN_POLICY)
    from watchdog.dev.embedded import free_port

    port = free_port()
    replays = Replays(tmp_path)
    cfg = make_config(kafka_service.address, redis_service.port, topic, policy, sink_url,
                      server={"port": port, "external_url": f"http://127.0.0.1:{port}"},
                      golden={"jobs": [{"name": "capitals", "set": "capitals", "model": "geo-llm", "routes": ["qa"],
                                        "every_s": None, "candidate": {"kind": "table", "precision": "fp8"},
                                        "baseline": {"kind": "table", "precision": "fp16"}}]})
    keys = Keys()
    with running_daemon(cfg) as (daemon, server):
        daemon.golden.replay_fn = replays
        wait_until(lambda: daemon.golden_leader.running, 30, what="the golden lease", detail=daemon.problems)

        def judged() -> float:
            st = daemon.engine.states.get(("golden-guard", "geo-llm", "qa"))
            last = st.rules["exact-match-drop"].last if st is not None else None
            return last.end if last is not None else 0.0

        def replay_judged() -> None:  # one replay, judged on its own (one window each)
            before = judged()
            assert daemon.golden.run_job("capitals")
            wait_until(lambda: judged() > before, 30, what="the replay to be judged")

        for _ in range(2):  # healthy FP8: the windows before
            replay_judged()
        replays.broken = True
        replay_judged()
        wait_until(lambda: daemon.flags.precision_for("geo-llm", "qa") == "fp16", 30, what="the golden rollback",
                   detail=lambda: json.dumps({k: daemon.status().get(k) for k in ("verdicts", "golden", "problems")},
                                             default=str)[:3000])
        replay_judged()  # a window after, while FP16 serves
        wait_until(lambda: any(json.loads(redis_client.get(keys.evidence(i)) or "{}").get("rules", [{}])[0].get("after")
                               for i in redis_client.zrange(keys.evidence_index, 0, -1)), 30,
                   what="the record's window after")
        ids = [i for i in redis_client.zrange(keys.evidence_index, 0, -1) if "-rollback-" in i]
        assert len(ids) == 1, ids
        eid = ids[0]
        record = json.loads(redis_client.get(keys.evidence(eid)))
        assert 0 < redis_client.ttl(keys.evidence(eid)) <= cfg.evidence.ttl_s
        assert daemon.metrics.evidence.labels("written")._value.get() >= 2  # the record, then its "after"
        assert daemon.status()["evidence"]["written"] >= 2
        assert len(redis_client.get(keys.evidence(eid))) <= cfg.evidence.max_bytes
        rule = record["rules"][0]
        assert rule["name"] == "exact-match-drop" and rule["involved"] and rule["status"] == "fail"
        assert [w["status"] for w in rule["before"]] == ["pass", "pass", "fail"]
        assert rule["after"] and rule["before"][-1]["extra"]["paired_mean"] == pytest.approx(-3 / 8)
        assert {it["id"] for it in rule["broken_items"]} >= {"cap1", "cap4", "cap6"}
        assert any(a["precision"] == "fp16" for a in record["audit"])  # the flip's audit entry
        assert "promote back to fp8 automatically after 3" in record["undo"]["text"]

        # every page sent links to the record
        wait_until(lambda: any(r.body.get("event") == "rollback" for r in s.received if r.path.endswith("webhook")),
                   30, what="the rollback page")
        page = next(r.body for r in s.received if r.path.endswith("webhook") and r.body.get("event") == "rollback")
        url = f"http://127.0.0.1:{port}/evidence/{eid}"
        assert page["url"] == url and page["detail"]["evidence"] == eid

        assert httpx.get(f"{server.url}/evidence/{eid}.json").json()["id"] == eid
        assert httpx.get(f"{server.url}/evidence/nope").status_code == 404
        png = httpx.get(f"{server.url}/evidence/{eid}.png")
        assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "evidence_rollback_chart.png").write_bytes(png.content)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        listing = browse(f"{server.url}/evidence", "--dump-dom")
        assert eid in listing and "geo-llm/qa" in listing
        dom = browse(url, "--dump-dom")
        shot = ARTIFACTS / "evidence_rollback.png"
        browse(url, f"--screenshot={shot}", "--window-size=412,3000", "--hide-scrollbars")

    # what the browser rendered: the rule, its numbers, the broken items' texts side by side
    assert "ROLLBACK" in dom and "exact-match-drop" in dom and "paired_mean &lt; -0.25" in dom
    assert "-0.375" in dom  # paired_mean of the failing window: 3 of 8 items lost
    assert "Banana pudding recipe with seventeen eggs" in dom
    assert "I cannot answer questions about geography" in dom
    assert "The capital of country 1 is City1." in dom
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom  # shown as text, never run
    assert "<title>rollback geo-llm/qa</title>" in dom  # the script did not retitle the page
    assert 'src="data:image/png;base64,' in dom
    assert shot.stat().st_size > 10_000

    # evidence list / export
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    redis_url = f"redis://127.0.0.1:{redis_service.port}/0"
    listed = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "evidence", "list", "--redis-url", redis_url],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert listed.returncode == 0 and eid in listed.stdout, listed.stderr
    out = tmp_path / "export"
    exported = subprocess.run([sys.executable, "-m", "watchdog.cli.main", "evidence", "export", eid, "--out", str(out),
                               "--redis-url", redis_url], capture_output=True, text=True, env=env, timeout=60,
                              check=False)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((out / f"{eid}.json").read_text())["id"] == eid
    html_page = (out / f"{eid}.html").read_text()
    assert "Banana pudding" in html_page and 'src="data:image/png;base64,' in html_page
    assert "<script" not in html_page and "<link" not in html_page and "href=" not in html_page  # no server needed


@pytest.mark.services
def test_retention_keeps_the_newest_records_with_a_ttl(redis_client) -> None:
    from watchdog.config.settings import EvidenceConfig
    from watchdog.policy import PolicyEngine
    from watchdog.runtime.evidence import EvidenceRecorder, list_records, read_record

    keys = Keys("ret")
    rec = EvidenceRecorder(EvidenceConfig(max_records=3, ttl_s=3600), keys, redis_client, PolicyEngine(), "i1")
    ids = []
    for i in range(5):
        action = Action(kind="alert", policy="p", model="m", route="r", reason=f"alert {i}", at=1000.0 + i)
        ids.append(rec.decided(action, None))
        assert action.detail["evidence"] == ids[-1]
    assert rec.decided(Action(kind="resolve", policy="p", model="m", route="r", reason="ok"), None) is None
    assert rec.flush(2000.0) == 5 and rec.pending() == 0
    assert [r["id"] for r in list_records(redis_client, keys)] == ids[:1:-1]  # newest first, 3 kept
    assert redis_client.get(keys.evidence(ids[0])) is None and redis_client.hlen(keys.evidence_summaries) == 3
    assert 0 < redis_client.ttl(keys.evidence(ids[-1])) <= 3600
    assert read_record(redis_client, keys, ids[-1])["reason"] == "alert 4"
    # records older than ttl_s leave the index on the next write
    late = Action(kind="alert", policy="p", model="m", route="r", reason="late", at=10_000.0)
    rec.decided(late, None)
    rec.flush(10_000.0)
    assert [r["id"] for r in list_records(redis_client, keys)] == [late.detail["evidence"]]


@pytest.mark.services
def test_a_flush_past_the_iterations_deadline_waits_a_few_iterations_not_for_ever(redis_client) -> None:
    from watchdog.config.settings import EvidenceConfig
    from watchdog.policy import PolicyEngine
    from watchdog.runtime.evidence import MAX_WAITS, EvidenceRecorder

    rec = EvidenceRecorder(EvidenceConfig(), Keys("wait"), redis_client, PolicyEngine(), "i1")
    rec.decided(Action(kind="alert", policy="p", model="m", route="r", reason="x", at=1000.0), None)
    rec.step.start(-1.0)  # the loop's work for this iteration is done
    assert [rec.flush(2000.0) for _ in range(MAX_WAITS)] == [0] * MAX_WAITS and rec.pending() == 1
    assert rec.flush(2000.0) == 1 and rec.pending() == 0  # the next one writes, deadline or not


def test_a_live_rollback_record_has_both_precisions_and_the_threshold_per_window(tmp_path: Path) -> None:
    """The live path without services: engine -> recorder -> record -> page and chart."""
    from tests.daemon_harness import write_policy
    from watchdog.config.settings import EvidenceConfig
    from watchdog.core.signals import Signal
    from watchdog.policy import PolicyEngine
    from watchdog.policy.loader import load_policy_files
    from watchdog.runtime.evidence import EvidenceRecorder

    engine = PolicyEngine(load_policy_files([write_policy(tmp_path / "p.yaml")]))
    recorder = EvidenceRecorder(EvidenceConfig(windows_after=2), Keys("t"), None, engine, "i1")
    route = ("m", "legal/contracts")
    decided: list[Action] = []
    flags: dict[tuple[str, str], str] = {}
    for i in range(8):
        bad = 4 <= i < 6
        t0 = 1000.0 + 10 * i
        sigs = [Signal(source="live", model=route[0], route=route[1], precision=p, start=t0, end=t0 + 10, samples=100,
                       values={"error_rate": 0.2 if (bad and p == "fp8") else 0.01, "shadow_rougeL": 0.95})
                for p in ("fp8", "fp16")]
        actions = engine.observe(sigs, t0 + 10, flags)
        recorder.observe(sigs, {route}, t0 + 10)
        for a in actions:
            recorder.decided(a, flags.get(route))
            decided.append(a)
            if a.kind == "rollback":
                flags[route] = "fp16"
    (rollback,) = [a for a in decided if a.kind == "rollback"]
    record = recorder._queue[rollback.detail["evidence"]]  # built, not yet written (no Redis here)
    rule = next(r for r in record["rules"] if r["name"] == "error-rate")
    assert rule["involved"] and [w["status"] for w in rule["before"]][-2:] == ["fail", "fail"]
    last = rule["before"][-1]
    assert (last["candidate"], last["baseline"]) == (0.2, 0.01)
    assert last["line"] == pytest.approx(0.09)  # fail_if: candidate - baseline > 0.08
    assert len(rule["after"]) == 2 and record["complete"]
    assert record["serving_before"] is None and record["precision"] == "fp16"
    page = render_record(record, None, "no chart")
    assert "0.2</td>" in page and "0.01</td>" in page and "candidate - baseline &gt; 0.08" in page
    panel = chart_of(record).panels[0]
    assert [s.label for s in panel.series][:3] == ["fp8 error_rate", "fp16 error_rate",
                                                   "threshold (candidate - baseline > 0.08)"]
    assert panel.markers[0].kind == "rollback" and panel.bands  # the time served at FP16 after it


@pytest.mark.services
def test_one_read_of_the_audit_stream_gives_each_route_what_a_read_per_route_gave(redis_client) -> None:
    """``flush`` reads the audit stream once for all its records' routes (``audits_of``): the same entries,
    in the same order, as ``audit_of`` route by route."""
    from watchdog.runtime.evidence import audit_of, audits_of

    def one_route(model: str, route: str) -> list[dict[str, str]]:  # audit_of before audits_of
        out = []
        for entry_id, fields in redis_client.xrevrange(keys.audit, count=60):
            if fields.get("model") == model and fields.get("route") == route:
                out.append({**fields, "id": entry_id})
                if len(out) >= 6:
                    break
        return out[::-1]

    keys = Keys()
    for i in range(90):
        redis_client.xadd(keys.audit, {"model": "m" if i % 7 else "other", "route": f"r{i % 4}", "n": str(i)})
    routes = {("m", "r0"), ("m", "r1"), ("m", "r3"), ("other", "r1"), ("m", "absent")}
    got = audits_of(redis_client, keys, routes, count=60, kept=6)
    assert got == {r: one_route(*r) for r in routes} == {r: audit_of(redis_client, keys, *r, count=60, kept=6)
                                                           for r in routes}
    assert [len(got[r]) for r in sorted(routes)] == [0, 6, 6, 6, 2]


@pytest.mark.services
def test_a_record_rewritten_with_the_windows_after_its_decision_does_not_trim_again(own_redis) -> None:
    """A record is written again after each window that follows its decision (``windows_after``); each
    write also trimmed the index (2-4 more round trips, on the loop: ~2 s an iteration on a 0.45 s
    link). Now a write trims when the index grew, or once ``PRUNE_EVERY_S`` for records past ``ttl_s``."""
    from watchdog.config.settings import EvidenceConfig
    from watchdog.policy import PolicyEngine
    from watchdog.runtime.evidence import PRUNE_EVERY_S, EvidenceRecorder

    redis_client = redis.Redis(host="127.0.0.1", port=own_redis.port, decode_responses=True)  # its own counts

    def trims() -> int:
        stats = redis_client.info("commandstats")
        return int(stats.get("cmdstat_zrangebyscore", {}).get("calls", 0))

    keys = Keys("retrim")
    rec = EvidenceRecorder(EvidenceConfig(max_records=3, ttl_s=3600), keys, redis_client, PolicyEngine(), "i1")
    action = Action(kind="alert", policy="p", model="m", route="r", reason="x", at=1000.0)
    eid = rec.decided(action, None)
    before = trims()
    assert rec.flush(1000.0) == 1 and trims() == before + 1  # a new id: trimmed
    for i in range(3):  # the same record rewritten, as windows after it close
        rec._queue[eid] = {**rec._queue.get(eid, {}), **read_record_raw(redis_client, keys, eid), "updated_at": i}
        assert rec.flush(1001.0 + i) == 1
    assert trims() == before + 1
    rec._queue[eid] = read_record_raw(redis_client, keys, eid)
    assert rec.flush(1000.0 + PRUNE_EVERY_S + 1) == 1 and trims() == before + 2  # and once a PRUNE_EVERY_S
    redis_client.close()


def read_record_raw(client, keys: Keys, eid: str) -> dict:
    import json

    return json.loads(client.get(keys.evidence(eid)))
