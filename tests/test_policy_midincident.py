"""Policies edited and hot-reloaded while a route is rolled back and its incident is open (outside review,
2026-12-07). Pure engine and the pager's incident book: no services, time passed in.

What an on-call engineer expects (docs/POLICIES.md, "Hot reload"): an edit never restores FP8 by
itself and never leaves the route on FP16 without anyone told; the rollback's incident resolves when
FP8 comes back, whoever brings it back; FP8 comes back only on the evidence the policies now in force
ask for; the state of what was removed does not stay behind.
"""

from __future__ import annotations

import json

from tests.test_policy_engine import DAY0, M, R, Sim, kinds, make_policy, policy_set, window
from watchdog.alerting.incidents import IncidentBook
from watchdog.core.signals import Action
from watchdog.policy import PolicyEngine

KEY = f"{M}/{R}/p"
#: a policy that covers none of these routes, to stand for "the other files"
ELSEWHERE = make_policy(name="q", routes='["nomatch/*"]')


def merged(*texts: str) -> str:
    return "policies:\n" + "".join(t.split("policies:\n", 1)[1] for t in texts)


class Pager:
    """The engine, the flags as the actuator leaves them and the pager's incident book together."""

    def __init__(self, text: str) -> None:
        self.sim = Sim(text)
        self.book = IncidentBook()
        self.sent: list[tuple[str, str, str, str]] = []  # (key, status, event, text) of every message

    def step(self, t: float, cand: float, apply: bool = True) -> list[Action]:
        acts = self.sim.step(window(t, cand), t, apply=apply)
        for a in acts:
            for m in self.book.on_action(a):
                self.sent.append((m.key, m.status, m.event, m.description))
        return acts

    def reload(self, text: str) -> None:
        self.sim.engine.set_policy_set(policy_set(text))

    @property
    def flag(self) -> str:
        return self.sim.flags.get((M, R), "fp8")

    def open_keys(self) -> list[str]:
        return [i["key"] for i in self.book.open_incidents()]


def rolled_back(text: str) -> Pager:
    pg = Pager(text)
    assert kinds(pg.step(DAY0, 0.10)) == ["rollback"] and pg.flag == "fp16" and pg.open_keys() == [KEY]
    return pg


def test_a_deleted_policy_leaves_fp16_in_force_tells_once_and_resolves_when_fp8_is_restored() -> None:
    # before: the route stayed on FP16 for ever, nothing said so, and the rollback's incident stayed open
    # even after an operator restored FP8 by hand (the deleted policy's state was dropped at the reload)
    pg = rolled_back(merged(make_policy(rule_for=1), ELSEWHERE))
    pg.reload(ELSEWHERE)  # the ML lead deletes policy p
    for i in range(1, 6):
        pg.step(DAY0 + 60 * i, 0.01)
    assert pg.flag == "fp16"  # nothing restores FP8 without the evidence a policy asks for
    notes = [s for s in pg.sent if s[0] == KEY and s[1] == "firing" and s[2] == "alert"]
    assert len(notes) == 1, pg.sent  # once, on the rollback's own incident
    assert "was removed" in notes[0][3] and f"flags set {M} {R} fp8" in notes[0][3], notes[0][3]
    assert pg.open_keys() == [KEY]
    assert pg.sim.engine.snapshot()["scopes"][0]["retired"]["why"] == "removed"
    pg.sim.flags[(M, R)] = "fp8"  # the operator: `flags set ... fp8`
    acts = pg.step(DAY0 + 400, 0.01)
    assert [(a.kind, a.policy) for a in acts] == [("resolve", "p")]
    assert pg.open_keys() == [] and pg.sent[-1][:2] == (KEY, "resolved")
    assert pg.sim.engine.states == {}  # nothing of p stays behind
    assert pg.step(DAY0 + 460, 0.01) == []


def test_a_narrowed_scope_is_a_removal_for_the_routes_it_left_and_leaves_no_state_behind() -> None:
    # before: the scope state of a route the policy no longer covers was kept for ever (checkpointed,
    # re-asserted after a Redis loss), and its rollback was never resolved
    pg = rolled_back(make_policy(rule_for=1))
    other = (M, "chat/other")
    pg.sim.engine.observe(window(DAY0, 0.01, route="chat/other"), DAY0, pg.sim.flags)
    assert ("p", *other) in pg.sim.engine.states
    pg.reload(make_policy(rule_for=1, routes='["code/*"]'))
    assert ("p", *other) not in pg.sim.engine.states  # nothing in force there: forgotten at once
    pg.step(DAY0 + 60, 0.01)
    (note,) = [s for s in pg.sent if s[2] == "alert"]
    assert "no longer covers" in note[3] and "nothing will promote" in note[3], note
    pg.sim.flags[(M, R)] = "fp8"
    assert kinds(pg.step(DAY0 + 120, 0.01)) == ["resolve"] and pg.open_keys() == []
    assert pg.sim.engine.states == {}


def test_a_rollback_still_pending_when_its_policy_is_deleted_is_followed_until_it_lands() -> None:
    pg = Pager(merged(make_policy(rule_for=1), ELSEWHERE))
    assert kinds(pg.step(DAY0, 0.10, apply=False)) == ["rollback"]  # Redis away: the flip waits
    pg.reload(ELSEWHERE)
    pg.step(DAY0 + 60, 0.01)
    assert pg.flag == "fp8" and [s for s in pg.sent if s[2] == "alert"] == []
    pg.sim.flags[(M, R)] = "fp16"  # the actuator's retry lands
    pg.step(DAY0 + 120, 0.01)
    assert [s[2] for s in pg.sent if s[0] == KEY] == ["rollback", "alert"]
    pg.sim.flags[(M, R)] = "fp8"
    pg.step(DAY0 + 180, 0.01)
    assert pg.open_keys() == [] and pg.sim.engine.states == {}


def test_a_policy_put_back_takes_its_rollback_back() -> None:
    text = merged(make_policy(rule_for=1, healthy=3), ELSEWHERE)
    pg = rolled_back(text)
    pg.reload(ELSEWHERE)
    pg.step(DAY0 + 60, 0.01)
    pg.reload(text)  # deleted by mistake, put back
    for i in range(2, 8):
        pg.step(DAY0 + 60 * i, 0.01)
    assert pg.flag == "fp8" and pg.open_keys() == []
    assert [s[1] for s in pg.sent if s[0] == KEY] == ["firing", "firing", "resolved"]
    assert pg.sim.engine.states[("p", M, R)].retired is None


def test_a_retired_rollback_survives_a_restart_and_the_checkpoint_path() -> None:
    from watchdog.state import partitions as P

    pg = rolled_back(merged(make_policy(rule_for=1), ELSEWHERE))
    pg.reload(ELSEWHERE)
    saved = json.loads(json.dumps(pg.sim.engine.export_state()))
    by_route = P.engine_states_by_route(pg.sim.engine, {(M, R)})  # what a checkpoint of the route writes
    assert "p" in by_route[(M, R)]
    for restored in (saved, None):
        fresh = PolicyEngine(policy_set(ELSEWHERE))
        if restored is not None:
            fresh.import_state(restored)
        else:  # the policy file was deleted while the daemon was down: its state comes back from Redis
            P.load_engine_states(fresh, {(M, R): {"scopes": json.loads(json.dumps(by_route[(M, R)]))}})
        acts = fresh.observe(window(DAY0 + 60, 0.01), DAY0 + 60, {(M, R): "fp16"})
        assert [(a.kind, a.policy) for a in acts] == [("alert", "p")]
        acts = fresh.observe(window(DAY0 + 120, 0.01), DAY0 + 120, {(M, R): "fp8"})
        assert [(a.kind, a.policy) for a in acts] == [("resolve", "p")]


def test_a_policy_deleted_while_the_daemon_was_down_keeps_its_rollback() -> None:
    """The state in Redis names a policy the new files lack: the rollback it holds is still followed."""
    pg = rolled_back(merged(make_policy(rule_for=1), ELSEWHERE))
    saved = json.loads(json.dumps(pg.sim.engine.export_state()))
    fresh = PolicyEngine(policy_set(ELSEWHERE))
    fresh.import_state(saved)
    acts = fresh.observe(window(DAY0 + 60, 0.01), DAY0 + 60, {(M, R): "fp16"})
    assert [(a.kind, a.policy) for a in acts] == [("alert", "p")]
    assert "was removed" in acts[0].reason


def test_a_rule_edited_mid_incident_restarts_the_healthy_count() -> None:
    # before: 4 windows counted healthy under the old rule + 1 under the new restore_if = a promote after
    # one window of the evidence the edited policy asks for (healthy_windows: 5)
    base = make_policy(rule_for=1, healthy=5)
    pg = rolled_back(base)
    for i in range(1, 5):
        pg.step(DAY0 + 60 * i, 0.02)  # FP8 1 point worse: passes fail_if, would fail the new restore_if
    pg.reload(base.replace("action: rollback", "action: rollback\n        restore_if: candidate - baseline < 0.005"))
    promoted = next(i for i in range(5, 20) if "promote" in kinds(pg.step(DAY0 + 60 * i, 0.011)))
    assert promoted == 9  # 5 windows that meet restore_if
    # a description reworded is no change: the count goes on
    pg2 = rolled_back(base)
    for i in range(1, 5):
        pg2.step(DAY0 + 60 * i, 0.011)
    pg2.reload(base.replace("name: err\n", "name: err\n        description: reworded\n"))
    assert "promote" in kinds(pg2.step(DAY0 + 300, 0.011))


def test_another_policy_that_takes_over_restores_on_its_own_evidence_and_both_incidents_resolve() -> None:
    # before: fp8-default promoted 5 minutes after the strict policy's rollback although its promote.after
    # is 30m (it had never flipped, so "since the rollback" was infinite), and the strict incident stayed
    # open for ever (its policy was gone, the promote closed the default policy's key only)
    default = make_policy(rule_for=1, healthy=3, after="30m", name="default")
    strict = make_policy(rule_for=1, promote="manual", healthy=1, name="strict",
                         routes='["chat/*"]').replace("> 0.02", "> 0.005")
    pg = Pager(merged(default, strict))
    assert [(a.kind, a.policy) for a in pg.step(DAY0, 0.02)] == [("rollback", "strict")]
    for i in range(1, 5):
        pg.step(DAY0 + 60 * i, 0.012)
    pg.reload(default)  # strict deleted 5 minutes after its rollback
    promoted = None
    for i in range(5, 40):
        acts = pg.step(DAY0 + 60 * i, 0.012)
        if "promote" in kinds(acts):
            promoted = i
            break
    assert promoted is not None and promoted >= 30, promoted  # default's own promote.after, from the rollback
    (note,) = [s[3] for s in pg.sent if s[0] == f"{M}/{R}/strict" and s[2] == "alert" and "was removed" in s[3]]
    assert "policy default covers it" in note, note
    pg.step(DAY0 + 60 * (promoted + 1), 0.012)
    assert pg.flag == "fp8" and pg.open_keys() == []
    assert [k for k in pg.sim.engine.states if k[0] == "strict"] == []


def test_a_policy_taking_over_counts_its_healthy_windows_from_the_rollback_only() -> None:
    # before: the lenient policy had counted its healthy windows while the route still served FP8 (through
    # the regression the strict policy rolled back for), so it promoted one window after the strict policy
    # was deleted: no window of FP8 judged after the rollback
    strict = make_policy(rule_for=1, promote="manual", healthy=1, name="strict").replace("> 0.02", "> 0.005")
    lenient = make_policy(rule_for=1, healthy=3, name="lenient").replace("> 0.02", "> 0.2")
    pg = Pager(merged(strict, lenient))
    for i in range(10):
        assert pg.step(DAY0 + 60 * i, 0.012) == []
    assert [(a.kind, a.policy) for a in pg.step(DAY0 + 600, 0.02)] == [("rollback", "strict")]
    pg.reload(lenient)
    promoted = next(i for i in range(11, 20) if "promote" in kinds(pg.step(DAY0 + 60 * i, 0.012)))
    assert promoted == 13  # windows 11, 12 and 13: the three healthy windows on FP16 it asks for
def test_dry_run_switched_on_mid_incident_says_fp8_is_healthy_and_an_operator_restore_resolves() -> None:
    # before: the route stayed on FP16 with nothing said, and `flags set ... fp8` left the incident open
    pg = rolled_back(make_policy(rule_for=1, healthy=3))
    pg.reload(make_policy(rule_for=1, healthy=3, dry_run=True))
    for i in range(1, 8):
        pg.step(DAY0 + 60 * i, 0.01)
    assert pg.flag == "fp16"  # dry run: never flips
    (note,) = [s for s in pg.sent if s[2] == "alert"]
    assert note[1] == "firing" and "dry run" in note[3] and "flags set" in note[3], note
    pg.sim.flags[(M, R)] = "fp8"
    assert kinds(pg.step(DAY0 + 600, 0.01)) == ["resolve"] and pg.open_keys() == []


def test_a_manual_policy_made_dry_run_lets_the_other_policy_promote_and_its_incident_resolves() -> None:
    a = make_policy(rule_for=1, healthy=3, name="p", promote="manual")
    b = make_policy(rule_for=1, healthy=3, name="b").replace("> 0.02", "> 0.2")
    pg = rolled_back(merged(a, b))
    for i in range(1, 4):
        pg.step(DAY0 + 60 * i, 0.01)
    pg.reload(merged(a.replace("dry_run: false", "dry_run: true"), b))
    for i in range(4, 8):
        pg.step(DAY0 + 60 * i, 0.01)
    assert pg.flag == "fp8" and pg.open_keys() == [], pg.sent


def test_the_manual_promote_hint_reaches_on_call_on_the_open_rollback_incident() -> None:
    # before: "fp8 healthy for N windows; promote manually" was suppressed by the incident book (the
    # rollback's incident was open at critical), so the one message a manual policy sends was never sent
    pg = rolled_back(make_policy(rule_for=1, healthy=3, promote="manual"))
    for i in range(1, 8):
        pg.step(DAY0 + 60 * i, 0.01)
    hints = [s for s in pg.sent if s[2] == "alert"]
    assert len(hints) == 1 and "promote manually" in hints[0][3] and hints[0][1] == "firing", pg.sent


def test_two_auto_policies_ready_together_promote_once() -> None:
    # before: both promoted; the second sent a critical "resolved" for an incident it never opened
    a = make_policy(rule_for=1, healthy=3, name="p")
    b = make_policy(rule_for=1, healthy=3, name="b").replace("> 0.02", "> 0.2")
    pg = rolled_back(merged(a, b))
    promotes = []
    for i in range(1, 6):
        promotes += [x for x in pg.step(DAY0 + 60 * i, 0.01) if x.kind == "promote"]
    assert [(x.policy, [o["policy"] for o in x.detail.get("also", [])]) for x in promotes] == [("p", ["b"])]
    assert [s[:2] for s in pg.sent] == [(KEY, "firing"), (KEY, "resolved")]
    assert pg.sim.engine.states[("b", M, R)].flips_today == 0  # only the flip made spends budget


def test_healthy_sources_narrowed_mid_incident_restarts_the_healthy_count() -> None:
    # before: 4 live windows counted, then the edit "3 passing golden replays in a row" (healthy_sources:
    # [golden], healthy_windows: 3) promoted FP8 at the next live window, with no golden replay at all
    pg = rolled_back(make_policy(rule_for=1, healthy=5))
    for i in range(1, 5):
        assert pg.step(DAY0 + 60 * i, 0.01) == []
    pg.reload(make_policy(rule_for=1, healthy=3).replace("after: 0s}", "after: 0s, healthy_sources: [golden]}"))
    for i in range(5, 10):
        pg.step(DAY0 + 60 * i, 0.01)
    assert pg.flag == "fp16"  # live windows do not count any more; no golden replay came


def test_a_renamed_policy_promotes_on_its_own_evidence_and_the_old_names_incident_resolves() -> None:
    """A rename is a removal and an addition: the new name starts afresh (its promote.after counts from
    the first window it sees the route on FP16), the old name's rollback is followed until FP8 is back.
    While retired, the rollback is still ours: a flag Redis lost is re-asserted (``flipped_routes``)."""
    text = make_policy(rule_for=1, healthy=3, after="10m")
    pg = rolled_back(text)
    pg.reload(text.replace("name: p\n", "name: p2\n"))
    assert kinds(pg.step(DAY0 + 60, 0.01)) == ["alert"]
    assert pg.sim.engine.flipped_routes("fp8") == {(M, R): "fp16"}
    promoted = next(i for i in range(2, 30) if "promote" in kinds(pg.step(DAY0 + 60 * i, 0.01)))
    assert promoted == 11  # first seen at window 1, promote.after 10m
    pg.step(DAY0 + 60 * (promoted + 1), 0.01)
    assert pg.flag == "fp8" and pg.open_keys() == [] and list(pg.sim.engine.states) == [("p2", M, R)]
    assert [s[:3] for s in pg.sent if s[0] == KEY] == [(KEY, "firing", "rollback"), (KEY, "firing", "alert"),
                                                         (KEY, "resolved", "resolve")]


def test_an_alert_rule_deleted_mid_incident_resolves_its_incident_saying_so_not_recovered() -> None:
    # before: "recovered: no rule trips any more", while FP8 was as bad as when it fired
    text = make_policy(rule_for=1, action="alert", extra_rules="""\
      - name: tmo
        metric: timeout_rate
        fail_if: candidate > 0.5
""")
    pg = Pager(text)
    assert kinds(pg.step(DAY0, 0.10)) == ["alert"]
    pg.reload(text.replace("""      - name: err
        metric: error_rate
        fail_if: candidate - baseline > 0.02
        min_samples: 100
        for: 1
        severity: critical
        action: alert
""", ""))
    (a,) = pg.step(DAY0 + 60, 0.10)
    assert a.kind == "resolve" and a.reason == "rule err removed from the policy by an edit (not judged recovered)"
    assert pg.open_keys() == []


def test_a_dry_run_policy_says_nothing_about_a_rollback_it_did_not_make() -> None:
    a = make_policy(rule_for=1, healthy=3, name="p", promote="manual")
    b = make_policy(rule_for=1, healthy=3, name="b", dry_run=True).replace("> 0.02", "> 0.2")
    pg = rolled_back(merged(a, b))
    for i in range(1, 8):
        pg.step(DAY0 + 60 * i, 0.01)
    assert [(s[0], s[2]) for s in pg.sent] == [(KEY, "rollback"), (KEY, "alert")]  # p's "promote manually"
