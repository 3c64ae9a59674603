"""Golden replay and drift report, driven by a deterministic table-lookup engine (a test double)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from rouge_score import rouge_scorer

from probes.drift import DriftReport, paired_bootstrap_ci
from probes.engines.base import Engine, Generation, ReferenceScore
from probes.golden import GoldenItem, GoldenSet, load_golden_set
from probes.golden_replay import add_replay_command, apply_stop, finite_scores, replay
from probes.metrics import MAX_LOG_PERPLEXITY, PERPLEXITY_CAP

REPO_SETS = Path(__file__).resolve().parents[1] / "golden_sets"


class TableEngine:
    """Answers each prompt from a table (default: the reference, i.e. a perfect model).

    ``perturb`` maps prompt -> answer override, ``fail`` holds prompts that return an error,
    ``raise_on`` prompts that make the whole ``generate`` call raise; ``nll`` is the negative
    log-likelihood per reference token reported by ``score`` (None: cannot score)."""

    def __init__(
        self,
        precision: str,
        answers: dict[str, str],
        *,
        perturb: dict[str, str] | None = None,
        fail: set[str] = frozenset(),
        raise_on: set[str] = frozenset(),
        nll: float | None = 0.5,
    ) -> None:
        self.name = f"table-{precision}"
        self.precision = precision
        self.answers = answers
        self.perturb = perturb or {}
        self.fail, self.raise_on, self.nll = fail, raise_on, nll
        self.batches: list[int] = []
        self.nan_on: set[str] = set()
        self.closed = False

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[Generation]:
        self.batches.append(len(prompts))
        if any(p in self.raise_on for p in prompts):
            raise RuntimeError("CUDA error: device-side assert")
        out = []
        for p in prompts:
            if p in self.fail:
                out.append(Generation("", None, 5.0, error="timeout after 30s"))
            else:
                # a leading space and trailing junk after the stop sequence, as real engines emit
                out.append(
                    Generation(" " + self.perturb.get(p, self.answers[p]) + "\nQuestion: next", None, 5.0)
                )
        return out

    def score(self, prompts: list[str], references: list[str]) -> list[ReferenceScore] | None:
        if self.nll is None:
            return None
        return [
            ReferenceScore(
                math.nan if p in self.nan_on else -self.nll * len(r.split()),
                len(r.split()),
                len(r.encode()),
                None,
            )
            for p, r in zip(prompts, references, strict=True)
        ]

    def close(self) -> None:
        self.closed = True


def answers_for(gs: GoldenSet) -> dict[str, str]:
    return {gs.render(i): i.reference for i in gs.items}


def drop_last_words(text: str, k: int) -> str:
    if " " not in text:  # Chinese: drop characters
        return text[: -2 * k - 1]
    words = text.split()
    return " ".join(words[: max(1, len(words) - k)])


@pytest.fixture(scope="module")
def rag() -> GoldenSet:
    return load_golden_set(REPO_SETS / "rag-enterprise")


def test_engine_double_satisfies_protocol(rag: GoldenSet) -> None:
    assert isinstance(TableEngine("fp8", answers_for(rag)), Engine)


def test_identical_engines_show_no_drift(rag: GoldenSet) -> None:
    table = answers_for(rag)
    cand, base = TableEngine("fp8", table), TableEngine("fp16", table)
    report = replay(rag, cand, base, batch_size=16, progress=False)
    assert cand.batches == [16, 16, 16, 6] and base.batches == cand.batches
    assert report.n_items == report.measured == len(rag.items)
    for m in report.metrics:
        if m.metric == "agreement_rougeL":
            assert m.candidate == 1.0
        else:
            assert m.diff_mean == 0.0 and m.ci_low == 0.0 and m.ci_high == 0.0, m.metric
    assert report.summary("rougeL").candidate == 1.0
    assert report.summary("exact_match").candidate == 1.0
    assert report.summary("bleu").candidate == pytest.approx(100.0)
    assert report.regressions == []
    # Chinese items score 1.0 too (CJK tokenisation)
    zh = [i for i in report.items if "zh" in i.tags]
    assert len(zh) >= 10 and all(i.candidate.scores["rougeL"] == 1.0 for i in zh)


def test_perturbed_candidate_regresses_with_ranked_items(rag: GoldenSet) -> None:
    table = answers_for(rag)
    victims = rag.items[::5]
    perturb = {rag.render(i): drop_last_words(i.reference, 1 + n % 3) for n, i in enumerate(victims)}
    report = replay(
        rag, TableEngine("fp8", table, perturb=perturb), TableEngine("fp16", table), progress=False
    )
    rl = report.summary("rougeL")
    # independent per-item ROUGE-L (rouge-score's own scorer) for English items; Chinese: sign only
    direct = rouge_scorer.RougeScorer(["rougeL"])
    got = {i.id: i.diff("rougeL") for i in report.items}
    for item in rag.items:
        p = rag.render(item)
        if p not in perturb:
            assert got[item.id] == 0.0
        elif "zh" in item.tags:
            assert got[item.id] < 0
        else:
            assert got[item.id] == pytest.approx(
                direct.score(item.reference, perturb[p])["rougeL"].fmeasure - 1.0
            )
    assert rl.diff_mean == pytest.approx(np.mean(list(got.values())))
    assert rl.ci_high < 0 < rl.baseline - rl.candidate
    # ranked worst first, only perturbed items, both outputs kept side by side
    assert set(report.regressions) <= {i.id for i in victims}
    ranked = [got[r] for r in report.regressions]
    assert ranked == sorted(ranked) and all(d < 0 for d in ranked)
    worst = next(i for i in report.items if i.id == report.regressions[0])
    assert worst.candidate.output != worst.baseline.output == worst.reference
    assert report.summary("agreement_rougeL").candidate < 1.0
    assert "items that regressed most on rougeL" in report.render_text()


def test_engine_errors_are_counted_and_excluded(rag: GoldenSet) -> None:
    table = answers_for(rag)
    prompts = [rag.render(i) for i in rag.items]
    # 3 items time out; one batch of 16 raises entirely (items 16..31)
    cand = TableEngine("fp8", table, fail={prompts[0], prompts[1], prompts[40]}, raise_on={prompts[20]})
    report = replay(rag, cand, TableEngine("fp16", table), batch_size=16, progress=False)
    assert report.errors == {"candidate": 19, "baseline": 0, "excluded": 19}
    assert report.measured == len(rag.items) - 19
    failed = [i for i in report.items if i.failed]
    assert failed[0].candidate.error == "timeout after 30s"
    assert any("RuntimeError: CUDA error" in (i.candidate.error or "") for i in failed)
    assert all(i.candidate.scores == {} and i.diff("rougeL") is None for i in failed)
    cand_sig, base_sig = report.to_signals("llama-3-8b", "rag/hr")
    assert cand_sig.values["error_rate"] == pytest.approx(19 / len(rag.items))
    assert base_sig.values["error_rate"] == 0.0
    assert cand_sig.samples == report.measured and len(cand_sig.paired["rougeL"]) == report.measured
    assert cand_sig.error is None


def test_non_finite_likelihood_is_the_worst_measurement_not_an_error(rag: GoldenSet) -> None:
    """NaN/-inf log-likelihoods (NaN or overflowing logits) are a broken engine: the item is
    measured with the worst perplexity, never dropped as an engine error (issue 17, item 8)."""
    small = rag.head(6)
    cand = TableEngine("fp8", answers_for(small))
    cand.nan_on = {small.render(small.items[2])}
    report = replay(small, cand, TableEngine("fp16", answers_for(small)), progress=False)
    assert report.errors == {"candidate": 0, "baseline": 0, "excluded": 0}
    assert report.items[2].candidate.scores["ppl"] == PERPLEXITY_CAP
    assert report.summary("ppl").candidate == PERPLEXITY_CAP  # pooled: one destroyed item is the worst
    cand_sig, _ = report.to_signals("m", "rag")
    assert cand_sig.error is None and cand_sig.paired["ppl"][2] == pytest.approx(PERPLEXITY_CAP)
    json.loads(report.to_json())  # strict JSON: no NaN or inf leaks into the report


def test_non_finite_scores_count_as_the_worst_value() -> None:
    scores = finite_scores({"rougeL": math.nan, "bleu": math.inf, "ppl": math.nan, "bits_per_byte": math.inf,
                            "chrf": 55.0, "custom_thing": math.nan})
    assert scores == {"rougeL": 0.0, "bleu": 0.0, "ppl": PERPLEXITY_CAP,
                      "bits_per_byte": pytest.approx(MAX_LOG_PERPLEXITY / math.log(2)), "chrf": 55.0}


def test_all_items_failing_is_an_error_signal(rag: GoldenSet) -> None:
    small = rag.head(4)
    cand = TableEngine("fp8", answers_for(small), fail={small.render(i) for i in small.items})
    report = replay(small, cand, TableEngine("fp16", answers_for(small)), progress=False)
    assert report.measured == 0
    for sig in report.to_signals("m", "rag"):
        assert sig.samples == 0 and sig.error and "timeout after 30s" in sig.error
        assert "rougeL" not in sig.values  # unmeasured: absent, never 0


def test_perplexity_pooled_and_absent_when_unscorable(rag: GoldenSet) -> None:
    small = rag.head(10)
    table = answers_for(small)
    report = replay(
        small, TableEngine("fp8", table, nll=0.7), TableEngine("fp16", table, nll=0.5), progress=False
    )
    assert report.summary("ppl").candidate == pytest.approx(math.exp(0.7))
    assert report.summary("ppl").baseline == pytest.approx(math.exp(0.5))
    assert report.summary("ppl").ci_low > 0  # worse for every item
    n_words = sum(len(i.reference.split()) for i in small.items)
    n_bytes = sum(len(i.reference.encode()) for i in small.items)
    assert report.summary("byte_perplexity").baseline == pytest.approx(math.exp(0.5 * n_words / n_bytes))
    assert report.summary("bits_per_byte").baseline == pytest.approx(0.5 * n_words / n_bytes / math.log(2))
    none = replay(small, TableEngine("fp8", table, nll=None), TableEngine("fp16", table), progress=False)
    cand_sig, base_sig = none.to_signals("m", "rag")
    assert "ppl" not in cand_sig.values and "ppl" in base_sig.values
    assert "ppl" not in cand_sig.paired and none.summary("ppl").candidate is None


def test_report_json_round_trip_and_save(rag: GoldenSet, tmp_path: Path) -> None:
    small = rag.head(12)
    table = answers_for(small)
    perturb = {small.render(small.items[3]): "I do not know."}
    report = replay(
        small, TableEngine("fp8", table, perturb=perturb), TableEngine("fp16", table), progress=False
    )
    data = json.loads(report.to_json())
    assert data["schema"] == 1 and data["golden_set"] == "rag-enterprise"
    again = DriftReport.from_json(report.to_json())
    assert again.to_dict() == report.to_dict()
    assert again.regressions == [small.items[3].id]
    data["schema"] = 2
    with pytest.raises(ValueError, match="schema"):
        DriftReport.from_json(json.dumps(data))
    path = report.save(tmp_path / "out")
    assert json.loads(path.read_text())["n_items"] == 12
    assert (tmp_path / "out" / "latest.json").read_text() == path.read_text()
    assert "golden replay rag-enterprise" in (tmp_path / "out" / "summary.txt").read_text()


def test_signals_for_policy_engine(rag: GoldenSet) -> None:
    small = rag.head(8)
    table = answers_for(small)
    perturb = {small.render(small.items[0]): "Nothing."}
    report = replay(
        small, TableEngine("fp8", table, perturb=perturb), TableEngine("fp16", table), progress=False
    )
    cand, base = report.to_signals("llama", "rag/hr")
    assert (cand.source, cand.precision, base.precision) == ("golden", "fp8", "fp16")
    assert cand.model == "llama" and cand.route == "rag/hr" and cand.samples == 8
    assert {
        "rougeL",
        "bleu",
        "chrf",
        "exact_match",
        "ppl",
        "agreement_rougeL",
        "error_rate",
    } <= cand.values.keys()
    assert "agreement_rougeL" not in base.values and base.paired is None
    assert cand.paired["rougeL"][0] < 0 and cand.paired["rougeL"][1:] == [0.0] * 7
    assert cand.values["rougeL"] == pytest.approx(np.mean([1.0 + d for d in cand.paired["rougeL"]]))
    assert cand.detail["golden_set"] == "rag-enterprise" and "rougeL" in cand.detail["ci"]


def test_paired_bootstrap_ci() -> None:
    rng = np.random.default_rng(1)
    d = rng.normal(-0.05, 0.1, size=400)
    mean, lo, hi = paired_bootstrap_ci(d)
    assert mean == pytest.approx(d.mean())
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert lo == pytest.approx(mean - half, abs=0.003) and hi == pytest.approx(mean + half, abs=0.003)
    assert paired_bootstrap_ci(d) == (mean, lo, hi)  # seeded
    assert paired_bootstrap_ci([0.2, 0.2]) == (0.2, pytest.approx(0.2), pytest.approx(0.2))
    assert paired_bootstrap_ci([]) is None


def test_apply_stop() -> None:
    assert apply_stop(" answer\nQuestion: x", ("\n",)) == "answer"
    assert apply_stop("a\n\n\nb", ("\n\n\n", "\nTask:")) == "a"
    assert apply_stop("no stop", ()) == "no stop"


def test_custom_item_set_without_context(tmp_path: Path) -> None:
    from probes.golden import Manifest

    manifest = Manifest.model_validate(
        {
            "name": "mini",
            "domain": "d",
            "description": "d",
            "languages": ["en"],
            "routes": ["*"],
            "generation": {"max_new_tokens": 8, "stop": ["\n"]},
            "metrics": ["exact_match"],
        }
    )
    gs = GoldenSet(tmp_path, manifest, (GoldenItem("a", "2+2?", "4"), GoldenItem("b", "3+3?", "6")))
    report = replay(
        gs,
        TableEngine("fp8", {"2+2?": "4", "3+3?": "7"}),
        TableEngine("fp16", {"2+2?": "4", "3+3?": "6"}),
        progress=False,
    )
    assert [m.metric for m in report.metrics] == ["exact_match"] and report.primary_metric == "exact_match"
    assert report.summary("exact_match").candidate == 0.5 and report.regressions == ["b"]


def test_replay_cli_through_engine_registry(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from probes.engines import register

    gs = load_golden_set(REPO_SETS / "code")

    @register("h5-table-test")
    class RegisteredTable(TableEngine):
        def __init__(self, precision: str, wrong: int = 0) -> None:
            table = answers_for(gs)
            perturb = {gs.render(i): "pass" for i in gs.items[:wrong]}
            super().__init__(precision, table, perturb=perturb)

    parser = argparse.ArgumentParser()
    add_replay_command(parser.add_subparsers())
    args = parser.parse_args(
        [
            "replay",
            "--set",
            "code",
            "--root",
            str(REPO_SETS),
            "--engine",
            "h5-table-test",
            "--candidate-option",
            "wrong=2",
            "--max-items",
            "10",
            "--json",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["n_items"] == 10 and data["candidate"]["precision"] == "fp8"
    assert data["regressions"][:2] == [gs.items[0].id, gs.items[1].id] or set(data["regressions"]) == {
        gs.items[0].id,
        gs.items[1].id,
    }
    assert (tmp_path / "latest.json").is_file()
    bad = parser.parse_args(
        ["replay", "--set", "no-such-set", "--root", str(REPO_SETS), "--engine", "h5-table-test"]
    )
    assert bad.func(bad) == 2
    unknown = parser.parse_args(["replay", "--set", "code", "--root", str(REPO_SETS), "--engine", "h5-nope"])
    assert unknown.func(unknown) == 2  # a usage error (was 1)


@pytest.mark.skipif(importlib.util.find_spec("evaluate") is None, reason="evaluate not installed")
def test_custom_evaluate_metric_in_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    d = tmp_path / "mini"
    (d / "metrics").mkdir(parents=True)
    (d / "metrics" / "char_len_ratio.py").write_text((Path(__file__).parent / "data" / "char_len_ratio.py").read_text())
    (d / "manifest.yaml").write_text(
        "schema: 1\nname: mini\ndomain: d\ndescription: d\nlanguages: [en]\nroutes: ['*']\n"
        "generation: {max_new_tokens: 8, stop: [Question]}\n"
        "metrics: [exact_match, 'evaluate:metrics/char_len_ratio.py']\n"
    )
    (d / "items.jsonl").write_text(
        '{"id": "a", "prompt": "q1", "reference": "abcd"}\n{"id": "b", "prompt": "q2", "reference": "xy"}\n'
    )
    gs = load_golden_set(d)
    report = replay(
        gs,
        TableEngine("fp8", {"q1": "ab", "q2": "xy"}),
        TableEngine("fp16", {"q1": "abcd", "q2": "xy"}),
        progress=False,
    )
    assert report.summary("char_len_ratio").candidate == pytest.approx(0.75)
    assert report.summary("char_len_ratio").baseline == pytest.approx(1.0)
    assert report.to_signals("m", "r")[0].paired["char_len_ratio"] == [pytest.approx(-0.5), 0.0]


def _replay_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_replay_command(parser.add_subparsers())
    args = parser.parse_args(["replay", *argv])
    return int(args.func(args))


def test_replay_cli_bad_input_is_one_line_naming_the_cause(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    from probes.engines import register

    gs = load_golden_set(REPO_SETS / "code")

    @register("h31-table-test")
    class Table(TableEngine):
        def __init__(self, precision: str, fail_all: bool = False) -> None:
            super().__init__(precision, answers_for(gs), fail={gs.render(i) for i in gs.items} if fail_all else set())

    common = ["--root", str(REPO_SETS), "--engine", "h31-table-test", "--max-items", "3", "--no-progress"]
    # a mistyped engine option was "__init__() got an unexpected keyword argument"
    assert _replay_cli(["--set", "code", *common, "-o", "fail-al=1"]) == 2  # a usage error, as a set's (was 1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "engine 'h31-table-test' has no option 'fail_al'" in err[0], err
    assert "did you mean 'fail_all'?" in err[0] and "options: precision, fail_all" in err[0], err
    # a set that does not exist: where it looked and what is there
    assert _replay_cli(["--set", "no-such-set", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"no golden set 'no-such-set' under {REPO_SETS} (there: code, legal-clauses, rag-enterprise)"]
    assert _replay_cli(["--set", "code", "--root", str(tmp_path / "nope"), "--engine", "h31-table-test"]) == 2
    assert capsys.readouterr().err.strip() == f"no golden set 'code' under {tmp_path / 'nope'} (no such directory)"
    # every item failed (a dead server): the tables say 0 measured, one line says why
    assert _replay_cli(["--set", "code", *common, "--candidate-option", "fail_all=true"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"no item measured; first error (candidate, item {gs.items[0].id}): ")


def test_one_off_replay_compiles_the_torch_decode_step_only_when_it_pays(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """A replay of a golden set this size runs the torch engines uncompiled (faster end to end), also with a
    kept compile cache; a large set compiles the decode step (from fewer steps with a cache), and the user's
    ``-o compile=...`` decides over both."""
    import probes.engines as engines
    from probes.golden_replay import CLI_COMPILE_MIN_STEPS, CLI_COMPILE_MIN_STEPS_CACHED, cli_compile

    assert cli_compile(4 * 64, cache=False) is False
    assert cli_compile(CLI_COMPILE_MIN_STEPS, cache=False) == "decode"
    # with a cache: a 54-item set (256 steps) ran 39.6 s compiled against ~5 s less uncompiled (H100, warm cache)
    assert cli_compile(4 * 64, cache=True) is False
    assert cli_compile(CLI_COMPILE_MIN_STEPS_CACHED, cache=True) == "decode"
    seen: list[dict] = []

    def fake_engine(kind: str, **opts):
        seen.append({"kind": kind, **opts})
        raise RuntimeError("stop here")

    monkeypatch.setattr(engines, "get_engine", fake_engine)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))  # restored after the test
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "before-triton"))
    parser = argparse.ArgumentParser()
    add_replay_command(parser.add_subparsers())
    for extra, want in (([], False), (["--compile-cache", str(tmp_path / "cache")], False),
                        (["-o", "compile=true"], True)):
        seen.clear()
        args = parser.parse_args(["replay", "--set", "code", "--root", str(REPO_SETS), "--engine", "torch",
                                  "--no-progress", *extra])
        assert args.func(args) == 1
        assert seen and seen[0]["compile"] == want
    # the engine's own Triton kernels (fused quantisers, FP8 K/V cache) are kept beside inductor's
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "triton")


def test_a_daemon_compile_cache_keeps_what_the_environment_sets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from probes.engines.torch_engine import use_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_compile_cache(tmp_path / "cfg", replace=False) == tmp_path / "cfg"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cfg" / "triton")


@pytest.mark.parametrize(("option", "says"), [
    ("max_batch_tokens=x", "engine 'torch' option 'max_batch_tokens' must be an integer, not 'x'"),
    ("cpu_threads=abc", "engine 'torch' option 'cpu_threads' must be an integer, not 'abc'"),
    ("scale_multiplier=big", "engine 'torch' option 'scale_multiplier' must be a number, not 'big'"),
    # a typo in a boolean option was taken as true (track_saturation) or failed after the model loaded
    ("fp8_lm_head=ture", "engine 'torch' option 'fp8_lm_head' must be auto, true or false, not 'ture'"),
    ("track_saturation='false'", "engine 'torch' option 'track_saturation' must be true or false, not 'false'"),
])
def test_an_engine_option_of_the_wrong_type_is_named_before_any_work(
        option: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    # max_batch_tokens=x was taken and failed only once a batch had two items; cpu_threads=abc said
    # "invalid literal for int() with base 10: 'abc'"
    argv = ["--set", "code", "--root", str(REPO_SETS), "--engine", "torch", "-o", "model_path=/x/y", "-o", option,
            "--max-items", "3", "--no-progress"]
    assert _replay_cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
