"""Policies edited while an incident is open, end to end: real Tansu, real Redis, the daemon's policy
poll and a real alert sink (outside review, policy edits mid-incident)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import MODEL, POLICY, make_config, running_daemon, traffic
from tests.helpers import wait_until
from watchdog.actuation.actuator import FlagStore
from watchdog.core.keys import Keys

pytestmark = pytest.mark.services

ROUTE = "legal/contracts"
KEY = f"{MODEL}/{ROUTE}/e2e"
#: a second policy file, so that deleting the first leaves a valid (non-empty) directory
OTHER = """\
policies:
  - name: other
    scope: {routes: ["code/*"]}
    rules:
      - {name: err, metric: error_rate, fail_if: "candidate > 0.5", action: alert}
"""


def _messages(sink, key: str) -> list[dict]:
    return [r.body for r in sink.received if r.path.endswith("webhook") and r.body.get("key") == key]


def _policies(tmp_path: Path, **others: str) -> Path:
    """A policy directory with the e2e policy (rolls back, manual promote) and ``others`` (name=YAML)."""
    pdir = tmp_path / "policies"
    pdir.mkdir()
    (pdir / "e2e.yaml").write_text(POLICY.format(dry_run="false"))
    for name, text in others.items():
        (pdir / f"{name}.yaml").write_text(text)
    return pdir


def test_deleting_the_policy_whose_rollback_is_in_force_tells_on_call_and_resolves_on_restore(
        kafka_service, redis_service, redis_client, topic, tmp_path, sink):
    s, url = sink
    pdir = _policies(tmp_path, other=OTHER)
    cfg = make_config(kafka_service.address, redis_service.port, topic, pdir, url)
    store = FlagStore(redis_client, Keys())
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, [ROUTE], daemon.flags.precision_for) as gen:
        gen.inject(MODEL, ROUTE, "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, ROUTE) == "fp16", 30)
        wait_until(lambda: _messages(s, KEY), 10, what="the rollback page")
        gen.inject(MODEL, ROUTE, None)
        (pdir / "e2e.yaml").unlink()  # the ML lead deletes the policy mid-incident
        wait_until(lambda: daemon.policies.loader.policy_set.names == ["other"], 10)
        # on-call is told, on the rollback's incident, that nothing will restore FP8 by itself
        told = wait_until(lambda: [m for m in _messages(s, KEY) if "flags set" in m.get("description", "")], 15,
                          what="a message saying the route is left on fp16",
                          detail=lambda: _messages(s, KEY))
        closed = daemon.stats.windows_closed
        wait_until(lambda: daemon.stats.windows_closed >= closed + 4, 15)
        assert daemon.flags.precision_for(MODEL, ROUTE) == "fp16"  # never restored without evidence
        status = httpx.get(f"{server.url}/status", params={"route": ROUTE}).json()
        assert any(i["key"] == KEY for i in status["incidents"]), status["incidents"]
        # the operator restores FP8 by hand: the incident resolves
        store.flip(MODEL, ROUTE, "fp8", expected_epoch=None, reason="INC-1 done", changed_by="test", manual=True)
        resolved = wait_until(lambda: [m for m in _messages(s, KEY) if m.get("status") == "resolved"], 15,
                              what="the rollback's incident resolved", detail=lambda: _messages(s, KEY))
        time.sleep(1.5)
        status = httpx.get(f"{server.url}/status").json()
    assert len(told) == 1 and told[0]["status"] == "firing", told
    assert len(resolved) == 1, resolved
    assert not any(i["key"] == KEY for i in status["incidents"])
    # nothing of the deleted policy is kept once its rollback is over
    assert not [k for k in daemon.policies.engine.states if k[0] == "e2e"]
    firing = [m for m in _messages(s, KEY) if m.get("status") == "firing"]
    assert len(firing) == 2, json.dumps(firing)[:2000]  # the rollback and the notice, no more


AUTO = """\
policies:
  - name: auto
    scope: {routes: ["legal/*"]}
    cooldown: 0s
    promote: {mode: auto, healthy_windows: 2, after: 0s}
    rules:  # lenient: passes through the regression (shadow ROUGE-L 0.15-0.45 in 1-s windows) and after
      - {name: shadow-floor, metric: shadow_rougeL, fail_if: "candidate < 0.05", min_samples: 3, action: rollback}
"""


def test_a_pinned_route_whose_policy_is_deleted_stays_on_fp16_until_an_operator_restores_it(
        kafka_service, redis_service, redis_client, topic, tmp_path, sink):
    """The e2e policy (manual promote) rolls back and holds back the lenient auto policy; the operator pins
    FP16; the e2e policy is deleted. Before: the auto policy promoted one window later on healthy windows it
    had counted while the route still served FP8 (refused by the pin, then retried). Now it counts from the
    rollback, and on FP16 this traffic gives it no FP8 window to judge: the route stays on FP16, on-call
    is told which policy may restore it, and the operator's restore resolves the deleted policy's incident."""
    s, url = sink
    pdir = _policies(tmp_path, auto=AUTO)
    cfg = make_config(kafka_service.address, redis_service.port, topic, pdir, url)
    store = FlagStore(redis_client, Keys())
    with running_daemon(cfg) as (daemon, _server), \
            traffic(kafka_service.address, topic, [ROUTE], daemon.flags.precision_for) as gen:
        gen.inject(MODEL, ROUTE, "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, ROUTE) == "fp16", 30)
        gen.inject(MODEL, ROUTE, None)
        pin_s = 4.0
        store.pin(MODEL, ROUTE, "fp16", pin_s, reason="INC-2 investigating", changed_by="test")
        pinned_at = time.time()
        (pdir / "e2e.yaml").unlink()
        wait_until(lambda: [m for m in _messages(s, KEY) if m.get("event") == "alert"], 15,
                   what="the notice on the rollback's incident", detail=lambda: _messages(s, KEY))
        wait_until(lambda: time.time() > pinned_at + pin_s + 3, 15)
        closed = daemon.stats.windows_closed
        wait_until(lambda: daemon.stats.windows_closed >= closed + 3, 15)
        assert daemon.flags.precision_for(MODEL, ROUTE) == "fp16"
        store.flip(MODEL, ROUTE, "fp8", expected_epoch=None, reason="INC-2 done", changed_by="test", manual=True)
        wait_until(lambda: [m for m in _messages(s, KEY) if m.get("status") == "resolved"], 15,
                   what="the deleted policy's incident resolved", detail=lambda: _messages(s, KEY))
        time.sleep(1.5)
    mine = _messages(s, KEY)
    assert [(m["status"], m["event"]) for m in mine] == [("firing", "rollback"), ("firing", "alert"),
                                                         ("resolved", "resolve")], mine
    assert "policy auto covers it" in mine[1]["description"], mine[1]
    assert not [r.body for r in s.received if "refused" in json.dumps(r.body) or r.body.get("event") == "promote"]
    assert [r["mode"] for r in reversed(store.audit(10))] == ["policy", "manual", "manual"]  # rollback, pin, restore


def test_a_rejected_edit_mid_incident_keeps_the_policy_its_state_and_the_incident(
        kafka_service, redis_service, redis_client, topic, tmp_path, sink):
    s, url = sink
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY.format(dry_run="false"))
    cfg = make_config(kafka_service.address, redis_service.port, topic, policy, url)
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, [ROUTE], daemon.flags.precision_for) as gen:
        gen.inject(MODEL, ROUTE, "quality")
        wait_until(lambda: daemon.flags.precision_for(MODEL, ROUTE) == "fp16", 30)
        engine = daemon.policies.engine
        before = engine.states[("e2e", MODEL, ROUTE)]
        last_flip, flips = before.last_flip, before.flips_today
        # the edit removes the rule that rolled back and breaks the file: nothing of it may apply
        policy.write_text(POLICY.format(dry_run="false").replace("      - name: shadow-agreement", "      - nme: x"))
        wait_until(lambda: any(i["key"] == "ops/policy-reload" for i in daemon.alerter.open_incidents()), 10)
        status = httpx.get(f"{server.url}/status").json()
        ready = httpx.get(f"{server.url}/readyz")
        st = engine.states[("e2e", MODEL, ROUTE)]
        assert "shadow-agreement" in st.rules and (st.last_flip, st.flips_today) == (last_flip, flips)
        assert daemon.flags.precision_for(MODEL, ROUTE) == "fp16"
        policy.write_text(POLICY.format(dry_run="false").replace("min_samples: 5", "min_samples: 6"))
        wait_until(lambda: not any(i["key"] == "ops/policy-reload" for i in daemon.alerter.open_incidents()), 10)
        wait_until(lambda: engine.policy_set.get("e2e").rules[0].min_samples == 6, 5)  # type: ignore[union-attr]
        st = engine.states[("e2e", MODEL, ROUTE)]
        assert (st.last_flip, st.flips_today, st.retired) == (last_flip, flips, None)
        time.sleep(1.5)
        incidents = [i["key"] for i in httpx.get(f"{server.url}/status").json()["incidents"]]
    assert ready.status_code == 200  # the last good policies are in force (docs/OPERATIONS.md)
    reload_incident = [i for i in status["incidents"] if i["key"] == "ops/policy-reload"]
    assert reload_incident and "p.yaml:" in reload_incident[0]["summary"], status["incidents"]
    assert KEY in [i["key"] for i in status["incidents"]]
    assert incidents == [KEY]  # the rollback's incident stays open; the reload's resolved
    ops = [r.body for r in s.received if r.body.get("key") == "ops/policy-reload"]
    assert [m["status"] for m in ops] == ["firing", "resolved"], ops
