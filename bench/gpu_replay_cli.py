"""``fp8-watchdog replay`` timed as a user runs it: end to end through the CLI, cold and warm, with
the engine split; and the golden scheduler's resident engines (a second scheduled replay).

1. Prepare (once): a random-weight Llama saved as a Hugging Face directory (``--shape 8b``: hidden
   4096, 32 layers, intermediate 14336, 32/8 heads, vocabulary 128,256 whose rows past the byte
   tokenizer's 384 are zero, so the lm_head does the full vocabulary's work), with its FP8
   calibration over the set's prompt+reference texts.
2. The CLI, each run a fresh process (``python -m watchdog.cli.main replay`` = ``fp8-watchdog
   replay``): ``cold`` with an empty compile cache (``--compile-cache``), then ``warm`` runs with
   the cache the cold run filled. Wall time of the process, and its ``--timings`` split: load
   (weights to the GPU), FP8 quantisation, compile + CUDA-graph capture, generate, score, metrics.
3. Resident: in one process, the scheduler's engine cache (``watchdog.sources.engine_cache``) and
   two scheduled replays: the first loads and compiles, the second finds both engines resident.

    python bench/gpu_replay_cli.py --shape 8b --out $OUT/replay_cli.txt     # on the GPU
    python bench/gpu_replay_cli.py --smoke                                   # tiny, on CPU

The OS page cache holds the model files after step 1 (they were just written), so "cold" means a
cold compile cache and a fresh process, not a cold disk. Plain runs each get an empty Triton cache
(``--triton-cache fresh``), as on a new host or container; ``home`` shares ~/.triton/cache between them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def prepare(model_dir: Path, shape_name: str, set_name: str, device: str) -> float:
    """Write a random Llama of ``shape_name`` and its calibration to ``model_dir``; seconds spent."""
    import torch

    from bench.gpu_replay import Shape, random_llama
    from probes.engines.torch_engine import TorchEngine, calibrate_engine, load_set_texts
    from probes.fp8 import save_calibration
    from probes.tiny_model import BYTE_TOKENIZER, byte_tokenizer

    shapes = {"8b": Shape(4096, 14336, 32, 32, 8, 128256), "1b": Shape(2048, 8192, 20, 32, 8, 384),
              "tiny": Shape(64, 128, 2, 4, 2, 512)}
    t0 = time.perf_counter()
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    model = random_llama(shapes[shape_name], device, dtype)
    engine = TorchEngine(precision="fp16", model=model, tokenizer=byte_tokenizer(), device=device, fast="off",
                         batch_size=16)
    amax = calibrate_engine(engine, load_set_texts(set_name, ROOT / "golden_sets"))
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    (model_dir / "tiny_model.json").write_text(json.dumps({"tokenizer": BYTE_TOKENIZER, "shape": shape_name}))
    save_calibration(model_dir / "fp8_calibration.json", amax, {"set": set_name, "bench": "gpu_replay_cli"})
    engine.close()
    del model, engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def cli_run(model_dir: Path, set_name: str, cache: Path | None, batch: int, extra: list[str],
            profile: Path | None = None, code: Path = ROOT, triton: Path | None = None) -> dict[str, Any]:
    """One ``replay`` process: wall seconds, the --timings split, items measured, return code. With
    ``profile``, the process runs under cProfile and writes its statistics there; ``code``: the tree
    whose CLI runs (another checkout, for a before/after in one call); ``triton``: an empty Triton cache
    for this process (``TRITON_CACHE_DIR``; without a ``--compile-cache`` the kernels the engine launches
    itself otherwise compile into ~/.triton/cache, which the process before filled)."""
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    cmd = [sys.executable, *prof, "-m", "watchdog.cli.main", "replay", "--set", set_name, "--engine", "torch",
           "-o", f"model_path={model_dir}", "--batch-size", str(batch), "-o", f"batch_size={batch}",
           *(["--compile-cache", str(cache)] if cache else []), "--timings", "--no-progress", "--json", *extra]
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if triton is not None:
        env["TRITON_CACHE_DIR"] = str(triton)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code)
    wall = time.perf_counter() - t0
    timings: dict[str, Any] = {}
    for line in proc.stderr.splitlines():
        if line.startswith("timings "):
            timings = json.loads(line[len("timings "):])
    measured = None
    try:
        doc = json.loads(proc.stdout)
        measured = doc["n_items"] - doc["errors"]["excluded"]
    except (ValueError, KeyError, TypeError):
        pass
    if proc.returncode != 0 or not timings:
        say(f"replay rc={proc.returncode}; stderr tail:\n" + "\n".join(proc.stderr.splitlines()[-15:]))
    return {"wall_s": wall, "rc": proc.returncode, "timings": timings, "measured": measured,
            "cmd": " ".join(cmd)}


SPLIT_HEAD = ("| run | wall s | import s | load s FP8 / FP16 | FP8 quantise s | compile + graph capture s FP8 / FP16 | "
              "generate s FP8 / FP16 | score s FP8 / FP16 | metrics s |")
LOAD_HEAD = ("| run | FP16 engine: import s | load s | of it tokenizer s | build s | wait for the reads s | "
             "reads' own wall s | place s | engines ready s |")


def split_row(label: str, run: dict[str, Any]) -> str:
    t = run["timings"]
    c, b = t.get("candidate", {}), t.get("baseline", {})

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}"

    return (f"| {label} | {f(run['wall_s'])} | {f(max(c.get('import_s', 0.0), b.get('import_s', 0.0)))} | {f(c.get('load_s'))} / {f(b.get('load_s'))} | "
            f"{f(c.get('quantize_s'))} | {f(c.get('compile_capture_s'))} / {f(b.get('compile_capture_s'))} | "
            f"{f(t.get('generate_candidate_s'))} / {f(t.get('generate_baseline_s'))} | "
            f"{f(t.get('score_candidate_s'))} / {f(t.get('score_baseline_s'))} | {f(t.get('metrics_s'))} |")


def load_row(label: str, run: dict[str, Any]) -> str:
    """The baseline (FP16) engine's build, split: the engine that reads the weights in a replay."""
    b = run["timings"].get("baseline", {})

    def f(key: str) -> str:
        return "-" if key not in b else f"{b[key]:.2f}"

    ready = run["timings"].get("build_s")
    return (f"| {label} | {f('import_s')} | {f('load_s')} | {f('tokenizer_s')} | {f('build_s')} | {f('read_s')} | "
            f"{f('reads_s')} | {f('place_s')} | {'-' if ready is None else f'{ready:.2f}'} |")


def resident(model_dir: Path, set_name: str, batch: int, cache_dir: Path, rounds: int) -> list[dict[str, float]]:
    """Scheduled replays through the daemon's engine cache: the first loads, the rest hit."""
    from probes.engines.torch_engine import use_compile_cache
    from probes.golden import find_golden_set, load_golden_set
    from probes.golden_replay import replay
    from watchdog.sources.engine_cache import EngineCache

    use_compile_cache(cache_dir)
    golden = load_golden_set(find_golden_set(set_name, ROOT / "golden_sets"))
    base = {"kind": "torch", "model_path": str(model_dir), "batch_size": batch}
    cache = EngineCache(max_engines=2, idle_s=None)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        loads = cache.loads
        spent: dict[str, float] = {}
        with cache.lease("bench", [{**base, "precision": "fp8"}, {**base, "precision": "fp16"}]) as (cand, basel):
            t1 = time.perf_counter()
            replay(golden, cand, basel, batch_size=batch, progress=False, timings=spent)
        out.append({"wall_s": time.perf_counter() - t0, "build_s": t1 - t0, "loads": cache.loads - loads,
                    "generate_fp8_s": spent.get("generate_candidate_s", 0.0),
                    "generate_fp16_s": spent.get("generate_baseline_s", 0.0),
                    "score_fp8_s": spent.get("score_candidate_s", 0.0),
                    "score_fp16_s": spent.get("score_baseline_s", 0.0),
                    "graphed": sum(e.fast_decoder.stats.get("pass_replays", 0.0) for e in (cand, basel)
                                   if getattr(e, "fast_decoder", None) is not None)})
    cache.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", choices=["8b", "1b", "tiny"])
    ap.add_argument("--set", default="rag-enterprise")
    ap.add_argument("--batch", type=int, default=16, help="replay batch (the CLI default is 16)")
    ap.add_argument("--model-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--plain-runs", type=int, default=1,
                    help="first, runs as a user types it: no --compile-cache, no -o compile (the CLI chooses)")
    ap.add_argument("--warm-runs", type=int, default=2, help="-1: no cold run either")
    ap.add_argument("--triton-cache", choices=("fresh", "home"), default="fresh",
                    help="plain runs: each with an empty Triton cache, as on a new host or container (fresh), or "
                         "all in ~/.triton/cache (home: the first run fills it for the rest)")
    ap.add_argument("--resident-rounds", type=int, default=2, help="0: skip the resident-engine part")
    ap.add_argument("--also", action="append", default=[], metavar="K=V[,K=V...]",
                    help="another series with these engine options (each passed as -o): a cold and a warm run, "
                         "with a compile cache of its own; repeatable")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="run every CLI process under cProfile, its statistics in DIR/<n>.prof (slower runs)")
    ap.add_argument("--code", default=None, metavar="DIR",
                    help="another tree (e.g. `git archive REV` unpacked): each plain run also runs from it, "
                         "interleaved, labelled 'before'")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU: exercises every step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.code and not (Path(args.code) / "watchdog").is_dir():
        ap.error(f"--code {args.code}: not a tree of this project (no watchdog/ there)")
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = "tiny" if args.smoke else args.shape
    work = Path(tempfile.mkdtemp(prefix="replay-cli-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / f"llama-{shape}"
    extra = ["-o", "device=cpu"] if device == "cpu" else []
    say(f"# fp8-watchdog replay through the CLI ({device}: "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'no GPU'}; torch {torch.__version__})")
    if not (model_dir / "config.json").exists():
        say(f"prepared {shape} model + calibration in {prepare(model_dir, shape, args.set, device):.1f} s "
            f"({sum(f.stat().st_size for f in model_dir.iterdir()) / 1e9:.2f} GB on disk)")
    cache = work / "compile-cache"
    profiles = Path(args.profile) if args.profile else None
    if profiles:
        profiles.mkdir(parents=True, exist_ok=True)

    def run(label: str, cache: Path | None, more: list[str], code: Path = ROOT) -> None:
        prof = profiles / f"{len(runs)}.prof" if profiles else None
        triton = work / f"triton-{len(runs)}" if cache is None and args.triton_cache == "fresh" else None
        runs.append((label, cli_run(model_dir, args.set, cache, args.batch, extra + more, prof, code, triton)))
        if prof:
            say(f"profile of {label!r}: {prof}")

    runs: list[tuple[str, dict[str, Any]]] = []
    for i in range(args.plain_runs):
        if args.code:
            run(f"before: plain {i + 1}", None, [], Path(args.code).resolve())
        run(f"plain {i + 1} (no --compile-cache: the CLI's choice)", None, [])
    plain = len(runs)
    if args.warm_runs >= 0:
        run("cold (empty compile cache)", cache, [])
    for i in range(args.warm_runs):
        if args.code:
            run(f"before: warm {i + 1}", cache, [], Path(args.code).resolve())
        run(f"warm {i + 1} (cache of the cold run)", cache, [])
    series = len(runs)
    for n, opts in enumerate(args.also):
        more = [x for kv in opts.split(",") for x in ("-o", kv)]
        for label in ("cold", "warm"):
            run(f"{opts}: {label}", work / f"compile-cache-{n + 1}", more)
    if runs:
        say(f"command: {runs[0][1]['cmd']}")
        say(f"set {args.set}, batch {args.batch}; items measured: {[r['measured'] for _l, r in runs]}; "
            f"compile cache {sum(f.stat().st_size for f in cache.rglob('*') if f.is_file()) / 1e6 if cache.exists() else 0:.0f} MB")
        for head, row in ((SPLIT_HEAD, split_row), (LOAD_HEAD, load_row)):
            say("")
            say(head)
            say("|" + " --- |" * (head.count("|") - 1))
            for label, done in runs:
                say(row(label, done))
        for label, done in runs:
            say(f"timings of {label!r}: {json.dumps(done['timings'], sort_keys=True)}")
    warm = [r["wall_s"] for label, r in runs[plain + 1:series] if label.startswith("warm")]
    if warm and plain < series:
        cold = runs[plain][1]["wall_s"]
        say(f"\ncold {cold:.1f} s, warm median {statistics.median(warm):.1f} s ({cold / statistics.median(warm):.2f}x)")
    if args.resident_rounds > 0:
        res = resident(model_dir, args.set, args.batch, cache, args.resident_rounds)
        say("\n## resident engines (watchdog.sources.engine_cache, in one process)")
        say("| scheduled replay | wall s | engines loaded | build s | generate s FP8 / FP16 | score s FP8 / FP16 "
            "| passes replayed as graphs (running total) |")
        say("| --- | --- | --- | --- | --- | --- | --- |")
        for i, r in enumerate(res):
            say(f"| {i + 1} | {r['wall_s']:.1f} | {r['loads']} | {r['build_s']:.1f} | "
                f"{r['generate_fp8_s']:.2f} / {r['generate_fp16_s']:.2f} | "
                f"{r['score_fp8_s']:.2f} / {r['score_fp16_s']:.2f} | {r['graphed']:.0f} |")
    if args.out:
        Path(args.out).write_text("\n".join(LINES) + "\n")
    if not args.model_dir:
        shutil.rmtree(work, ignore_errors=True)
    bad = [r for _l, r in runs if r["rc"] != 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
