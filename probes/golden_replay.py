"""Golden replay: run a golden set through a candidate (FP8) and a baseline (FP16) engine.

Both engines generate greedily for every item (in batches); each output is scored against the
reference, the reference's perplexity is scored by teacher forcing where the engine can, and the
two outputs are compared with each other. An engine error on an item is recorded on the item,
counted, and keeps the item out of every mean: it never passes silently.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from probes.drift import DriftReport, EngineInfo, ItemResult, SideResult, summarise
from probes.engines.base import Engine, Generation, ReferenceScore
from probes.golden import CUSTOM_PREFIX, GoldenSet, GoldenSetError, find_golden_set, load_golden_set
from probes.metrics import (
    PERPLEXITY_METRICS,
    TEXT_METRICS,
    CustomMetric,
    Likelihood,
    Scorer,
    count_words,
    perplexity,
    worst_value,
)

log = logging.getLogger(__name__)

#: the metric used to rank regressed items, first one present wins
PRIMARY_ORDER = ("rougeL", "exact_match", "chrf", "bleu", "rouge1", "ppl")


def apply_stop(text: str, stop: tuple[str, ...]) -> str:
    """Cut at the first stop sequence, then strip surrounding whitespace."""
    cut = len(text)
    for s in stop:
        at = text.find(s)
        if at != -1:
            cut = min(cut, at)
    return text[:cut].strip()


def _accepts_stop(engine: Engine) -> bool:
    try:
        return "stop" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


def _generate(engine: Engine, prompts: list[str], max_new_tokens: int,
              stop: tuple[str, ...] = ()) -> list[Generation]:
    """``engine.generate`` with the contract enforced: an exception or a wrong-length answer
    becomes an error on every item of the batch. Engines whose ``generate`` takes ``stop`` get the
    set's stop strings (they may end a row early); the output is cut at them here either way."""
    try:
        if stop and _accepts_stop(engine):
            gens = engine.generate(prompts, max_new_tokens, stop=stop)  # type: ignore[call-arg]
        else:
            gens = engine.generate(prompts, max_new_tokens)
    except Exception as exc:  # noqa: BLE001 - engine failures are data, not crashes
        log.warning("engine %s raised in generate: %s", engine.name, exc)
        return [Generation("", None, 0.0, error=f"{type(exc).__name__}: {exc}")] * len(prompts)
    if len(gens) != len(prompts):
        msg = f"engine returned {len(gens)} generations for {len(prompts)} prompts"
        return [Generation("", None, 0.0, error=msg)] * len(prompts)
    return gens


def _score(engine: Engine, prompts: list[str], references: list[str]) -> list[ReferenceScore] | None:
    try:
        scores = engine.score(prompts, references)
    except Exception as exc:  # noqa: BLE001
        log.warning("engine %s raised in score: %s", engine.name, exc)
        return [ReferenceScore(0.0, 0, 0, error=f"{type(exc).__name__}: {exc}")] * len(prompts)
    if scores is not None and len(scores) != len(prompts):
        msg = f"engine returned {len(scores)} scores for {len(prompts)} prompts"
        return [ReferenceScore(0.0, 0, 0, error=msg)] * len(prompts)
    return scores


def finite_scores(scores: dict[str, float], where: str = "") -> dict[str, float]:
    """``scores`` with every NaN or infinite value replaced by the metric's worst value
    (``probes.metrics.worst_value``): a broken output is the worst item, never a dropped one. A
    metric without a worst value (a custom metric) is left out instead (absent, never a guess)."""
    out: dict[str, float] = {}
    for m, v in scores.items():
        if math.isfinite(v):
            out[m] = v
            continue
        worst = worst_value(m)
        if worst is None:
            log.warning("golden replay: %s: metric %s is %s; left out", where, m, v)
        else:
            out[m] = worst
    return out


def _likelihood(score: ReferenceScore, reference: str) -> Likelihood:
    return Likelihood(score.logprob_sum, score.n_tokens, score.n_bytes, count_words(reference))


def replay(
    golden_set: GoldenSet,
    candidate: Engine,
    baseline: Engine,
    *,
    batch_size: int = 16,
    progress: bool = True,
    scorer: Scorer | None = None,
    baseline_first: bool = False,
    repeat_baseline: bool = False,
    timings: dict[str, float] | None = None,
) -> DriftReport:
    """Replay ``golden_set`` through both engines and build the drift report.

    ``baseline_first`` runs the baseline's batches before the candidate's (benchmarks alternate it).
    ``repeat_baseline`` generates the baseline's answers a second time (an A/A replay: FP16 against
    FP16) and scores them into each item's ``repeat``: the judge's null for how much answers move
    by themselves (sampling, batch-dependent kernels), measured instead of assumed.
    ``timings`` (a dict) receives the seconds spent: ``generate_<side>_s``, ``score_<side>_s``
    (engine time, a first call's compile included) and ``metrics_s`` (scoring the answers)."""
    started = time.time()
    spent = timings if timings is not None else {}
    manifest = golden_set.manifest
    items = list(golden_set.items)
    metrics = [m for m in manifest.metrics if not m.startswith(CUSTOM_PREFIX)]
    want_ppl = any(m in PERPLEXITY_METRICS for m in metrics)
    prompts = [golden_set.render(i) for i in items]
    refs = [i.reference for i in items]
    stop = manifest.generation.stop
    engines = {"candidate": candidate, "baseline": baseline}
    run_order = ["baseline", "candidate"] if baseline_first else ["candidate", "baseline"]
    if repeat_baseline:
        engines["repeat"] = baseline
        run_order.append("repeat")
    gens: dict[str, list[Generation]] = {k: [] for k in engines}
    ref_scores: dict[str, list[ReferenceScore | None]] = {k: [] for k in engines}
    batches = [range(s, min(s + batch_size, len(items))) for s in range(0, len(items), max(1, batch_size))]

    with _progress(progress, f"replay {golden_set.name}", len(run_order) * len(items)) as advance:
        for side in run_order:
            engine = engines[side]
            for batch in batches:
                bp = [prompts[i] for i in batch]
                t0 = time.perf_counter()
                gens[side].extend(_generate(engine, bp, manifest.generation.max_new_tokens, stop))
                t1 = time.perf_counter()
                spent[f"generate_{side}_s"] = spent.get(f"generate_{side}_s", 0.0) + t1 - t0
                if want_ppl and side != "repeat":
                    scores = _score(engine, bp, [refs[i] for i in batch])
                    ref_scores[side].extend(scores if scores is not None else [None] * len(batch))
                    spent[f"score_{side}_s"] = spent.get(f"score_{side}_s", 0.0) + time.perf_counter() - t1
                advance(len(batch))

    metrics_started = time.perf_counter()
    scorer = scorer or Scorer()
    custom = [CustomMetric(p) for p in golden_set.custom_metric_paths()]
    results: list[ItemResult] = []
    for n, item in enumerate(items):
        sides: dict[str, SideResult] = {}
        for side in engines:
            g = gens[side][n]
            sides[side] = SideResult(
                output=apply_stop(g.text, stop) if g.error is None else "",
                error=g.error,
                latency_ms=g.latency_ms,
            )
            rs = ref_scores[side][n] if want_ppl and side != "repeat" else None
            if rs is not None and sides[side].error is None and rs.error is not None:
                sides[side].error = f"score: {rs.error}"
            # a NaN or -inf log-likelihood (NaN/overflowing logits) is not an engine error: it is a
            # measurement, the worst one - its perplexity is capped at PERPLEXITY_CAP (probes.metrics)
        results.append(
            ItemResult(item.id, item.reference, sides["candidate"], sides["baseline"], list(item.tags),
                       repeat=sides.get("repeat"), version=golden_set.version(item))
        )

    # score the items both engines answered: per item, and corpus level from the same statistics
    ok = [n for n, r in enumerate(results) if not r.failed]
    corpus: dict[str, dict[str, float]] = {}
    for side in engines:
        outs = [getattr(results[n], side).output for n in ok]
        scored = scorer.batch([items[n].reference for n in ok], outs)
        likelihoods = []
        for n, item_scores in zip(ok, scored.items, strict=True):
            sr = getattr(results[n], side)
            sr.scores = {m: v for m, v in item_scores.items() if m in metrics}
            for cm in custom:
                sr.scores.update(cm.compute([items[n].reference], [sr.output]))
            rs = ref_scores[side][n] if want_ppl and side != "repeat" else None
            if rs is not None:
                lk = _likelihood(rs, items[n].reference)
                likelihoods.append(lk)
                sr.scores.update({m: v for m, v in perplexity([lk]).items() if m in metrics})
            sr.scores = finite_scores(sr.scores, f"{side} item {items[n].id!r}")
        values = finite_scores({**scorer.corpus_from(scored), **perplexity(likelihoods)}, f"{side} set")
        corpus[side] = {
            m: v for m, v in values.items() if m in ("bleu", "chrf", "length_ratio", *PERPLEXITY_METRICS)
        }
    corpus.pop("repeat", None)  # the A/A pass has per-item scores only
    if "agreement_rougeL" in metrics:
        for n in ok:
            results[n].agreement = scorer.agreement(results[n].candidate.output, results[n].baseline.output)
    measured = [results[n] for n in ok]
    custom_names = sorted(
        {
            k
            for r in measured
            for k in r.candidate.scores
            if k not in TEXT_METRICS and k not in PERPLEXITY_METRICS
        }
    )
    all_metrics = metrics + custom_names
    primary = next((m for m in PRIMARY_ORDER if m in all_metrics), all_metrics[0])
    summaries, regressions = summarise(results, all_metrics, corpus, primary)
    errors = {
        "candidate": sum(r.candidate.error is not None for r in results),
        "baseline": sum(r.baseline.error is not None for r in results),
        "excluded": sum(r.failed for r in results),
    }
    spent["metrics_s"] = time.perf_counter() - metrics_started
    report = DriftReport(
        golden_set=golden_set.name,
        candidate=EngineInfo(candidate.name, candidate.precision),
        baseline=EngineInfo(baseline.name, baseline.precision),
        started_at=started,
        finished_at=time.time(),
        n_items=len(items),
        primary_metric=primary,
        metrics=summaries,
        items=results,
        errors=errors,
        regressions=regressions,
    )
    log.info(
        "golden replay %s: %d/%d items measured, %d excluded by engine errors",
        golden_set.name,
        len(measured),
        len(items),
        errors["excluded"],
    )
    return report


class _progress:
    """A rich progress bar (or nothing) whose context value advances it by n."""

    def __init__(self, enabled: bool, label: str, total: int) -> None:
        self.enabled, self.label, self.total = enabled, label, total
        self._bar: Any = None

    def __enter__(self) -> Callable[[int], None]:
        if not self.enabled:
            return lambda n: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
            console=_stderr_console(),
        )
        self._bar.start()
        task = self._bar.add_task(self.label, total=self.total)
        return lambda n: self._bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


# --- CLI ------------------------------------------------------------------------------------------


def _parse_options(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` strings; values are parsed as YAML scalars (numbers, booleans, strings) by the
    bounded loader (``watchdog.core.safe_yaml``)."""
    import yaml

    from watchdog.core import safe_yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"engine option {pair!r} is not key=value")
        try:
            out[key.replace("-", "_")] = safe_yaml.load(value) if value else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"engine option {pair!r}: {getattr(exc, 'problem', None) or exc}") from None
    return out


def _no_loading_bars() -> None:
    """``--no-progress`` covers the model loaders' bars too (transformers' "Loading weights")."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is first imported
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


#: decode steps per engine from which a one-off ``replay`` compiles the decode step. On the H200 (8B shape, batch 16,
#: docs/BENCHMARKS.md) the compiled step saves ~4.3 ms per step of the two engines, and compiling costs ~3.6 s with
#: a warm compile cache and ~19 s with a cold one: even at 2,000 steps (~500 items) a cold compile does not pay
CLI_COMPILE_MIN_STEPS = 2000
#: the same with a compile cache kept (``--compile-cache``): the warm compile and graph capture cost 3.6 s (H200,
#: 2026-12-05) to 5.9 s (H100, 2026-12-07) more than the uncompiled step, paid back from ~840-1,370 steps; under
#: it a warm cache still spares the first compile of the FP8 engine's own Triton kernels (its ``triton`` folder)
CLI_COMPILE_MIN_STEPS_CACHED = 1000


def cli_compile(steps: int, cache: bool) -> bool | str:
    """The torch engine's ``compile`` for a one-off replay of ``steps`` decode steps per engine: the decode
    step alone once the set is large enough for the compile to pay (``CLI_COMPILE_MIN_STEPS``, or
    ``CLI_COMPILE_MIN_STEPS_CACHED`` when a compile cache is kept), else nothing. The prefill and scoring
    passes are never compiled here: for a 54-item set their dynamic-shape trace made the two engines'
    prefill 7.5 s with a warm compile cache (21 s cold) against 2.0 s eager. The scheduler's resident
    engines compile everything, once."""
    return "decode" if steps >= (CLI_COMPILE_MIN_STEPS_CACHED if cache else CLI_COMPILE_MIN_STEPS) else False


def _cmd_replay(args: argparse.Namespace) -> int:
    try:
        golden = load_golden_set(find_golden_set(args.set, args.root))
    except GoldenSetError as exc:
        for e in exc.errors:
            print(e, file=sys.stderr)
        return 2
    if args.max_items is not None:
        golden = golden.head(args.max_items)
    if args.no_progress:
        _no_loading_bars()
    from probes.engines import check_engine, get_engine

    if args.compile_cache:
        from probes.engines.torch_engine import use_compile_cache

        use_compile_cache(args.compile_cache)
    built = time.perf_counter()
    try:
        shared = _parse_options(args.option)
        cand_opts = {**shared, "precision": args.candidate, **_parse_options(args.candidate_option)}
        base_opts = {**shared, "precision": args.baseline, **_parse_options(args.baseline_option)}
        steps = -(-len(golden.items) // args.batch_size) * golden.manifest.generation.max_new_tokens
        for kind, opts in ((args.engine, cand_opts), (args.baseline_engine or args.engine, base_opts)):
            if kind == "torch" and "compile" not in opts:
                opts["compile"] = cli_compile(steps, bool(args.compile_cache))
        check_engine(args.engine, **cand_opts)
    except ValueError as exc:  # a kind, option or library the user can fix: a usage error, as a set's is
        print(f"cannot build candidate engine {args.engine!r}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - report, do not trace back
        print(f"cannot build candidate engine {args.engine!r}: {exc}{_extra_hint(exc)}", file=sys.stderr)
        return 1
    try:
        check_engine(args.baseline_engine or args.engine, **base_opts)
    except ValueError as exc:
        print(f"cannot build baseline engine: {exc}", file=sys.stderr)
        return 2
    # the baseline first: an FP8 candidate over the same model files then quantises the weights the
    # baseline loaded instead of reading them again (probes.engines.torch_engine.load_model)
    try:
        baseline = get_engine(args.baseline_engine or args.engine, **base_opts)
    except Exception as exc:  # noqa: BLE001
        print(f"cannot build baseline engine: {exc}{_extra_hint(exc)}", file=sys.stderr)
        return 1
    try:
        candidate = get_engine(args.engine, **cand_opts)
    except Exception as exc:  # noqa: BLE001
        baseline.close()
        print(f"cannot build candidate engine {args.engine!r}: {exc}{_extra_hint(exc)}", file=sys.stderr)
        return 1
    build_s = time.perf_counter() - built
    spent: dict[str, float] = {}
    try:
        report = replay(
            golden, candidate, baseline, batch_size=args.batch_size, progress=not args.no_progress,
            repeat_baseline=args.repeat_baseline, timings=spent,
        )
        if args.timings:
            print("timings " + json.dumps(engine_timings(candidate, baseline, build_s, spent)), file=sys.stderr)
    finally:
        candidate.close()
        baseline.close()
    if args.out:
        path = report.save(args.out)
        print(f"report written to {path}", file=sys.stderr)
    if args.json:
        print(report.to_json())
    else:
        from rich.console import Console

        console = Console()
        for table in report.tables():
            console.print(table)
    if report.measured == 0:  # the tables say 0 measured; say why in one line
        first = next(((side, item.id, res.error) for item in report.items
                      for side, res in (("candidate", item.candidate), ("baseline", item.baseline))
                      if res.error is not None), None)
        why = f"; first error ({first[0]}, item {first[1]}): {first[2]}" if first else ""
        print(f"no item measured{why}", file=sys.stderr)
        return 1
    return 0


def engine_timings(candidate: Engine, baseline: Engine, build_s: float, spent: dict[str, float]) -> dict[str, Any]:
    """Where a replay's time went: building the engines (load, FP8 quantisation), the fast
    decoder's compile + CUDA-graph capture, generation, reference scoring and metric scoring."""
    out: dict[str, Any] = {"build_s": round(build_s, 3), **{k: round(v, 3) for k, v in spent.items()}}
    for side, engine in (("candidate", candidate), ("baseline", baseline)):
        parts = dict(getattr(engine, "timings", {}) or {})
        fast = getattr(engine, "fast_decoder", None)
        if fast is not None:
            parts["compile_capture_s"] = fast.warmup_seconds
            parts.update({k: v for k, v in fast.stats.items() if k.endswith("_s")})
        out[side] = {k: round(float(v), 3) for k, v in parts.items()}
        if getattr(engine, "fast_reason", None):
            out.setdefault("paths", {})[side] = engine.fast_reason  # which decode path and compile ran
    return out


def add_replay_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``replay --set NAME [--candidate fp8 --baseline fp16 --engine KIND ...]``; sets ``func``."""
    from watchdog.core.argtypes import output_dir, positive_int

    p = subparsers.add_parser(
        "replay", help="replay a golden set through candidate and baseline engines",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  replay --set code --engine torch -o model_path=/models/llama-8b\n"
               "  replay --set rag-enterprise --engine openai -o model=llama-8b \\\n"
               "      --candidate-option base_url=http://fp8:8000/v1 --baseline-option base_url=http://fp16:8000/v1\n"
               "  replay --set legal-clauses --engine tensorrt_llm -o model_path=/models/llama-8b")
    p.add_argument("--set", required=True, help="golden set name or directory")
    p.add_argument("--root", default=None, help="directory of golden sets (default: golden_sets)")
    p.add_argument(
        "--engine", default="torch", help="engine kind from the registry (torch, openai, tensorrt_llm)"
    )
    p.add_argument("--baseline-engine", default=None, help="engine kind of the baseline (default: --engine)")
    p.add_argument("--candidate", default="fp8", help="candidate precision (default fp8)")
    p.add_argument("--baseline", default="fp16", help="baseline precision (default fp16)")
    p.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine option for both engines (repeatable): torch and tensorrt_llm take "
             "model_path=DIR; openai takes base_url=URL and model=NAME",
    )
    p.add_argument("--candidate-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--baseline-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--repeat-baseline", action="store_true",
                   help="answer every item with the baseline twice (an A/A pass: how much answers move by themselves)")
    p.add_argument("--max-items", type=positive_int, default=None, help="replay only the first N items")
    p.add_argument("--out", default=None, type=output_dir,
                   help="directory to save report-*.json, latest.json, summary.txt")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--compile-cache", default=None, metavar="DIR", type=output_dir,
                   help="keep the compiled kernels here (torch.compile's and the FP8 engine's own Triton kernels: "
                        "TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR=DIR/triton): a later replay loads them instead of "
                        "compiling (torch engine). The decode step is compiled from 1,000 decode steps per engine "
                        "with it (~250 items at batch 16), from 2,000 without; -o compile=true|false|decode decides "
                        "instead")
    p.add_argument("--timings", action="store_true",
                   help="print where the time went (load, quantise, compile, generate, score) to stderr")
    p.set_defaults(func=_cmd_replay)
    return p


#: the extra that brings each engine's missing module
_EXTRAS = {"torch": "torch", "transformers": "torch", "safetensors": "torch", "tensorrt_llm": "tensorrt"}


def _extra_hint(exc: BaseException) -> str:
    """' (install ...)' when the engine failed for want of an optional dependency."""
    name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    extra = _EXTRAS.get((name or "").split(".")[0])
    return f" (install it with: pip install 'fp8-watchdog[{extra}]')" if extra else ""
