"""Where a cold engine's weight load goes: the saved model to the GPU, each way timed in a fresh process.

``fp8-watchdog replay``'s split (docs/gpu_replay_cli_h200.txt) showed the first engine's load at 10-14 s
and the second's at 2-3 s for the same 16 GB of files, the page cache warm for both. Each way here runs
in its own process (as the CLI does), after the CUDA context is made (timed apart):

* ``cpu_then_to``: ``from_pretrained(dtype=...)`` on the CPU, then ``.to("cuda")`` (the engine before);
* ``device_map``: ``from_pretrained(dtype=..., device_map="cuda")`` (the weights go to the GPU as read);
* ``own``: the model built from its config on the GPU, then each shard read to the GPU and loaded into it;
* ``engine``: ``probes.engines.torch_engine.load_model`` (parameters on meta, no initialisation, the files' tensors
  copied by ``weight_files.LOAD_THREADS`` threads and assigned); ``engine1``: the same with one thread; ``shared``: an FP8 engine's
  weights once an FP16 engine of the same files holds them (``load_model(share=True)``: a shallow copy;
  "read s" is the FP16 engine's load, "to device s" the FP8 engine's);
* ``safetensors``: ``safetensors.torch.load_file(device="cuda")`` of every shard (the files alone).

Each way also reports a checksum of a few weights, so a way that loads the wrong values shows.

    python bench/gpu_load.py --shape 8b --repeats 2 --out $OUT/load.txt     # on the GPU
    python bench/gpu_load.py --model-dir /tmp/m8b --ways engine,engine1     # a model saved before
    python bench/gpu_load.py --smoke                                       # tiny, on CPU
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = ("cpu_then_to", "device_map", "own", "engine", "engine1", "shared", "safetensors")


def one(model_dir: str, way: str, device: str) -> dict[str, float]:
    """One load in this process (run as the child)."""
    t0 = time.perf_counter()
    import torch
    import transformers  # noqa: F401

    t1 = time.perf_counter()
    torch.zeros(1, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    if way == "safetensors":
        from safetensors.torch import load_file

        n = sum(t.numel() for f in sorted(Path(model_dir).glob("*.safetensors"))
                for t in load_file(str(f), device=device).values())
        read = time.perf_counter()
    elif way in ("engine", "engine1"):
        from probes.engines import torch_engine, weight_files

        if way == "engine1":
            weight_files.LOAD_THREADS = 1
        model = torch_engine.load_model(model_dir, dtype, device)
        read = time.perf_counter()
        n = sum(p.numel() for p in model.parameters())
    elif way == "shared":
        from probes.engines import torch_engine

        first = torch_engine.load_model(model_dir, dtype, device)
        read = time.perf_counter()
        model = torch_engine.load_model(model_dir, dtype, device, share=True)
        n = sum(p.numel() for p in model.parameters())
        assert model is not first
    elif way == "own":
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
        read = time.perf_counter()
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            model.load_state_dict(load_file(str(f), device=device), strict=False)
        n = sum(p.numel() for p in model.parameters())
    else:
        from transformers import AutoModelForCausalLM

        kw = {"device_map": device} if way == "device_map" else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw)
        read = time.perf_counter()
        model = model.to(device=device, dtype=dtype)
        n = sum(p.numel() for p in model.parameters())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    check = 0.0
    if way != "safetensors":
        sd = model.state_dict()
        check = sum(float(sd[k].float().sum()) for k in sorted(sd) if k.endswith(("lm_head.weight", "norm.weight",
                                                                                 "layers.0.mlp.down_proj.weight")))
    return {"import_s": t1 - t0, "context_s": t2 - t1, "read_s": read - t2, "to_device_s": t3 - read,
            "load_s": t3 - t2, "params": float(n), "check": check}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--model-dir", default=None, help="a model saved before (bench/gpu_replay_cli.py's); "
                    "default: a random one of --shape written to a temporary directory")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--child", nargs=3, metavar=("DIR", "WAY", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one(*args.child)))
        return 0
    import torch

    from bench.gpu_replay_cli import prepare

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    shape = "tiny" if args.smoke else args.shape
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-load-") as tmp:
        model_dir = Path(args.model_dir or Path(tmp) / "model")
        if not (model_dir / "config.json").exists():
            spent = prepare(model_dir, shape, "rag-enterprise", device)
            lines.append(f"prepared {shape} in {spent:.1f} s")
        size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e9
        lines.append(f"{model_dir}: {size:.2f} GB of safetensors (the page cache holds them if just written)")
        lines.append("| way | run | import s | CUDA context s | read s (own: build) | to device s (own: read + load) | "
                     "load s | params | checksum |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for rep in range(args.repeats):
            for way in args.ways.split(","):
                proc = subprocess.run([sys.executable, __file__, "--child", str(model_dir), way, device],
                                      capture_output=True, text=True, cwd=ROOT)
                if proc.returncode != 0:
                    lines.append(f"| {way} | {rep + 1} | failed: {proc.stderr.strip().splitlines()[-1:]} | | | | | | |")
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                lines.append(f"| {way} | {rep + 1} | {r['import_s']:.1f} | {r['context_s']:.1f} | {r['read_s']:.2f} | "
                             f"{r['to_device_s']:.2f} | **{r['load_s']:.2f}** | {r['params']:.0f} | {r['check']:.6g} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
