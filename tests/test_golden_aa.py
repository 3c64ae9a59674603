"""Golden nulls from the baseline itself (issue 17 item 4): an A/A pass (the baseline answering
twice) gives the broken-items test a measured null; nothing is learned from FP8-vs-FP16
differences that could already be damage. Drives ``probes.golden_replay.replay`` with the table
engine and the shipped policies through ``PolicyEngine.observe`` on the decision benchmark's
golden simulator."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.decisions import GOLDEN_MODELS, T0, GoldenSim
from probes.golden import load_golden_set
from probes.golden_replay import replay
from tests.test_replay import REPO_SETS, TableEngine, answers_for
from watchdog.policy.engine import PolicyEngine
from watchdog.policy.evaluate import MAX_AA_NULL
from watchdog.policy.loader import load_policy_files

POLICY = Path(__file__).resolve().parents[1] / "policies" / "default.yaml"


def test_replay_with_a_repeated_baseline_carries_the_aa_differences() -> None:
    golden = load_golden_set(REPO_SETS / "legal-clauses").head(20)
    table = answers_for(golden)
    first = golden.render(golden.items[0])

    class Sampling(TableEngine):
        """The baseline answers item 0 differently on its second call (a sampled answer)."""

        calls = 0

        def generate(self, prompts, max_new_tokens):  # type: ignore[no-untyped-def]
            out = super().generate(prompts, max_new_tokens)
            if first in prompts:
                self.calls += 1
                if self.calls == 2:
                    i = prompts.index(first)
                    out[i] = dataclasses.replace(out[i], text="something else entirely")
            return out

    report = replay(golden, TableEngine("fp8", table), Sampling("fp16", table), progress=False, repeat_baseline=True)
    cand = next(s for s in report.to_signals("m", "legal/x") if s.precision == "fp8")
    aa = cand.detail["aa"]["rougeL"]
    assert len(aa) == len(cand.paired["rougeL"]) == 20
    assert aa[0] < -0.5 and all(d == 0.0 for d in aa[1:])
    # the A/A pass survives the report's JSON round trip; without it the signal carries none
    again = type(report).from_json(report.to_json())
    assert again.items[0].repeat is not None and again.items[0].repeat.output == "something else entirely"
    plain = replay(golden, TableEngine("fp8", table), TableEngine("fp16", table), progress=False)
    assert "aa" not in next(s for s in plain.to_signals("m", "x") if s.precision == "fp8").detail


def _run(model_index: int, replays: int, *, damage: str | None = None, aa: bool = True, routes: int = 20,
         seed: int = 3) -> tuple[int, PolicyEngine, list[str]]:
    g = GOLDEN_MODELS[model_index]
    sim = GoldenSim(g, routes, seed, "chat")
    sim.damage, sim.onset = damage, 0
    engine = PolicyEngine(load_policy_files([str(POLICY)]))
    flags = {("m", r): "fp8" for r in sim.names}
    rolled: set[str] = set()
    for t in range(replays):
        sigs = sim.signals(t)
        if not aa:
            for s in sigs:
                s.detail.pop("aa", None)
        for a in engine.observe(sigs, T0 + t * 3600.0 + 121, flags):
            if a.kind == "rollback":
                rolled.add(a.route)
    return len(rolled), engine, sim.names


def test_sampled_serving_holds_with_the_aa_null_and_fails_without_it() -> None:
    """Sampled answers (~12 % of items move by > 0.2 between two runs of one engine): with the A/A
    pass no healthy route rolls back; with the stated 1.5 % share alone most do - the old null
    that learned only from passing replays locked into failing the same way."""
    assert GOLDEN_MODELS[4].sampled > 0
    with_aa, engine, _ = _run(4, 12)
    without, _, _ = _run(4, 12, aa=False)
    assert with_aa == 0
    assert without >= 10, without
    # the null holds A/A counts (bounded), never FP8-vs-FP16 counts of failing replays
    st = next(iter(engine.states.values())).rules["golden-rougeL"]
    aa = [x for x in st.null if "aa" in x]
    assert 0 < len(aa) <= MAX_AA_NULL and all(x["n"] == 200 for x in aa)


def test_damage_present_from_the_first_replay_is_caught_on_a_large_set() -> None:
    """6 % of 500 items broken by 0.5 from the very first replay (nothing healthy to learn
    from): the absolute broken-items test against the A/A null catches every route within two
    replays, and healthy routes of the same set stay at FP8."""
    caught, _, names = _run(2, 2, damage="concentrated", routes=15)
    assert caught == len(names)
    healthy, _, _ = _run(2, 6, routes=15)
    assert healthy == 0


def test_sampled_serving_runs_the_mean_test_at_the_sampled_alpha() -> None:
    """Where the A/A pass shows the baseline's answers moving (sampled serving), every replay is a
    fresh draw: the mean test runs at ``judge.sampled_alpha`` (harmful tail 1e-4 per replay)."""
    from watchdog.policy.pooling import judge_pool

    rule = next(r for p in load_policy_files([str(POLICY)]).policies for r in p.rules if r.name == "golden-rougeL")
    assert rule.judge is not None
    looks = {}
    for index in (1, 4):  # deterministic 200 items, sampled 200 items
        sig = GoldenSim(GOLDEN_MODELS[index], 1, 5, "chat").signals(0)[0]
        out = judge_pool(rule, sig, None, [], sig.paired["rougeL"], None)
        assert not isinstance(out, str)
        looks[index] = (out.detail["aa_moving"], sum(x["alpha"] for x in out.detail["looks"].values())
                        if "looks" in out.detail else out.detail["alpha"])
    assert looks[1][0] < 0.1 and looks[1][1] == pytest.approx(rule.judge.mean_alpha)
    assert looks[4][0] > 0.15 and looks[4][1] == pytest.approx(rule.judge.sampled_alpha)


def test_a_pool_with_one_sampled_replay_is_judged_as_fresh_draws() -> None:
    """The sampled-serving call is the pool's: a replay whose own A/A share happens to fall under
    the line (9 %) after one that showed sampling (20 %) still runs the mean test at
    ``sampled_alpha`` - one replay's share is noisy near the line, and the pooled look judges
    both replays."""
    from watchdog.policy.pooling import SAMPLED_SHARE, judge_pool

    rule = next(r for p in load_policy_files([str(POLICY)]).policies for r in p.rules if r.name == "golden-rougeL")
    assert rule.judge is not None
    sim = GoldenSim(GOLDEN_MODELS[1], 1, 5, "chat")
    sigs = [sim.signals(t)[0] for t in range(2)]
    for sig, share in zip(sigs, (0.2, 0.09), strict=True):
        n = len(sig.paired["rougeL"])
        sig.detail["aa"]["rougeL"] = [0.5 if i < round(share * n) else 0.0 for i in range(n)]
    pool: list = []
    first = judge_pool(rule, sigs[0], None, pool, sigs[0].paired["rougeL"], None)
    second = judge_pool(rule, sigs[1], None, pool, sigs[1].paired["rougeL"], None)
    assert not isinstance(first, str) and not isinstance(second, str)
    assert first.detail["aa_moving"] >= SAMPLED_SHARE > second.detail["aa_moving"]
    assert second.detail["aa_moving_pool"] == first.detail["aa_moving"]
    alphas = [x["alpha"] for x in second.detail["looks"].values()]
    assert sum(alphas) == pytest.approx(rule.judge.sampled_alpha)
    # without the sampled replay in the pool the same replay keeps the rule's own alpha
    alone = judge_pool(rule, sigs[1], None, [], sigs[1].paired["rougeL"], None)
    assert not isinstance(alone, str) and alone.detail["alpha"] == pytest.approx(rule.judge.mean_alpha)


def _shuffled(sig, rng):  # type: ignore[no-untyped-def]
    """The same replay with its items in another order (ids, per-item values and A/A values together)."""
    import copy

    out = copy.deepcopy(sig)
    order = rng.permutation(len(out.detail["item_ids"]))
    out.detail["item_ids"] = [out.detail["item_ids"][k] for k in order]
    for name, vals in out.paired.items():
        out.paired[name] = [vals[k] for k in order]
    for name, vals in out.detail["aa"].items():
        out.detail["aa"][name] = [vals[k] for k in order]
    return out


def test_replays_of_the_same_items_in_another_order_are_one_item_each() -> None:
    """A golden set whose items come back in another order each replay (or with a few items
    replaced) is the same items: the pooled look pairs them by id, and gives what the same replays
    in one order give. Before, an order-sensitive comparison of the ids judged them as rotated sets,
    2 n independent items, and counted every persistent FP8-sensitive item twice (outside check 3:
    101 false rollbacks in 8,000 shuffled replays, 0 in order)."""
    import numpy as np

    from watchdog.policy.pooling import judge_pool, line_up

    rule = next(r for p in load_policy_files([str(POLICY)]).policies for r in p.rules if r.name == "golden-rougeL")
    sim = GoldenSim(GOLDEN_MODELS[1], 1, 11, "chat")
    rng = np.random.default_rng(5)
    plain: list = []
    mixed: list = []
    for t in range(4):
        sig = sim.signals(t)[0]
        a = judge_pool(rule, sig, None, plain, sig.paired["rougeL"], None)
        shuffled = _shuffled(sig, rng)
        b = judge_pool(rule, shuffled, None, mixed, shuffled.paired["rougeL"], None)
        assert not isinstance(a, str) and not isinstance(b, str)
        if t:
            assert "rotated2" not in b.detail["looks"], b.detail["looks"]
            assert b.detail["looks"]["pooled2"]["n"] == 200
        assert b.estimate == pytest.approx(a.estimate) and b.ci_low == pytest.approx(a.ci_low)
    # a set edited between two replays (10 of 200 items replaced) is still the same set, paired by id
    ids = [str(i) for i in range(200)]
    edited = ids[10:] + [f"new{i}" for i in range(10)]
    prev = [float(i) for i in range(200)]
    values, _, rotated = line_up(ids, prev, edited)
    assert not rotated and values[:190] == prev[10:] and all(np.isnan(values[190:]))
    # a set sampled from a larger pool (mostly other items): the earlier items the latest did not ask
    other = ids[150:] + [f"x{i}" for i in range(150)]
    values, kept, rotated = line_up(ids, prev, other)
    assert rotated and kept == ids[:150] and values == prev[:150]
