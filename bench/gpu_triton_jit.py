"""What a first call of each Triton kernel the FP8 engine launches itself costs in a process whose Triton cache
is empty (a new host, or a container without ``--compile-cache``), against a second call: the compile a
one-off ``replay`` pays inside the FP8 engine's first prefill and graph capture. 8B widths, batch 16.

    python bench/gpu_triton_jit.py          # on the GPU; uses a fresh TRITON_CACHE_DIR of its own
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-jit-")  # before Triton reads it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from probes import decode_attention as da  # noqa: E402
from probes import fp8_fused as ff  # noqa: E402


def timed(label: str, fn: Callable[[], object]) -> float:
    out = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    print(f"| {label} | {out[0] * 1e3:.1f} | {out[1] * 1e3:.2f} |", flush=True)
    return out[0]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    dev, h = "cuda", torch.float16
    print(f"# first call vs second ({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print("| kernel | first call ms | second call ms |\n| --- | --- | --- |")
    x = torch.randn(16 * 40, 4096, dtype=h, device=dev)
    w = torch.ones(4096, dtype=h, device=dev)
    sx = torch.tensor(0.05, dtype=h, device=dev)
    g = torch.randn(16 * 40, 14336, dtype=h, device=dev)
    total = timed("rms_quant, 4,096 columns (and Triton's own start)", lambda: ff.rms_quant(x, w, sx, 1e-5))
    total += timed("add_rms_quant, 4,096", lambda: ff.add_rms_quant(x, x, w, sx, 1e-5))
    total += timed("silu_mul_quant, 14,336", lambda: ff.silu_mul_quant(g, g, sx))
    total += timed("quant_rows, 4,096", lambda: ff.quant_rows(x, sx))
    total += timed("rms_quant, another row count", lambda: ff.rms_quant(x[: 16 * 41 - 15], w, sx, 1e-5))
    ks = torch.zeros(8, dtype=torch.float32, device=dev)
    for n in (40, 41, 48):  # the prompt length is an int argument: a multiple of 16 or not
        k = torch.randn(16, 8, n, 128, dtype=h, device=dev)
        kc = torch.zeros(16, 8, 256, 128, dtype=torch.uint8, device=dev)
        total += timed(f"store_prompt_kv, length {n}", lambda k=k, kc=kc: da.store_prompt_kv(k, k, kc, kc.clone(), ks,
                                                                                            ks.clone()))
    q = torch.randn(16, 32, 128, dtype=h, device=dev)
    slot = torch.full((16,), 100, dtype=torch.int64, device=dev)
    pad = torch.zeros(16, dtype=torch.int64, device=dev)
    kc = torch.zeros(16, 8, 384, 128, dtype=torch.uint8, device=dev)
    for live in (128, 256, 384):
        total += timed(f"decode attention, FP8 K/V, live {live}",
                       lambda live=live: da.decode_attention(q, kc, kc, ks, ks, slot, pad, live))
    files = sum(len(f) for _d, _s, f in os.walk(os.environ["TRITON_CACHE_DIR"]))
    print(f"\nfirst calls {total:.2f} s in all; {files} files in the Triton cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
