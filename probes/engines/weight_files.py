"""A saved model's safetensors onto the device, read on threads while the model's classes import.

A fresh process building an 8B engine on an H100 host spent ~3-4 s importing transformers' modeling
code and ~2.5 s copying 16 GB of weights onto the GPU, one after the other (``--timings``: 6.3 s of a 9.4 s
load was neither). ``WeightReads`` starts the copies as soon as torch is imported (each ``.to(device)``
releases the GIL); ``load_direct`` then builds the model with its parameters on the meta device (no
memory, no initialisation) and takes the copied tensors as its parameters, so the weights are held once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: threads copying the weight files' tensors onto the device: the copies from the page cache (or disk)
#: overlap, each releasing the GIL
LOAD_THREADS = 8

# ``params_on_meta`` swaps a method of every nn.Module for the duration of one build: one build at a time
_BUILD = threading.Lock()


class WeightReads:
    """Every tensor of the safetensors shards in ``path``, copied onto ``device`` by ``LOAD_THREADS``
    threads from the moment this is made (floating tensors in ``dtype``). ``result()`` waits for them;
    ``cancel()`` drops what is read and what is not started yet. No shards: nothing to read
    (``shards`` empty)."""

    def __init__(self, path: str | Path, dtype: Any, device: str) -> None:
        from safetensors import safe_open

        self.shards = sorted(Path(path).glob("*.safetensors"))
        self.started = time.perf_counter()
        #: the wall time from the start to the last copy's end (s), once ``result()`` returned
        self.seconds: float | None = None
        self._futures: list[Future[tuple[str, Any]]] = []
        if not self.shards:
            return
        for shard in self.shards:
            read_ahead(shard)  # from a cold disk the kernel reads ahead of the copies
        jobs: list[tuple[int, Path, str]] = []
        for shard in self.shards:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - a safe_open handle has keys(), not iteration
                    jobs.append((math.prod(f.get_slice(name).get_shape()), shard, name))
        jobs.sort(key=lambda j: -j[0])  # the largest first, so the threads end together
        local = threading.local()

        def read(shard: Path, name: str) -> tuple[str, Any]:
            handles = local.__dict__.setdefault("handles", {})
            if shard not in handles:
                handles[shard] = safe_open(str(shard), framework="pt", device="cpu")
            tensor = handles[shard].get_tensor(name)
            # copy=True: on the CPU too the parameter must not be a view of the mapped file
            return name, tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None, copy=True)

        pool = ThreadPoolExecutor(max_workers=max(1, min(LOAD_THREADS, len(jobs))), thread_name_prefix="llmwd-weights")
        self._futures = [pool.submit(read, shard, name) for _size, shard, name in jobs]
        pool.shutdown(wait=False)

    def result(self) -> dict[str, Any]:
        """Name -> tensor on the device, once every copy is done (a failed read raises here); once."""
        try:
            out = dict(f.result() for f in self._futures)
        except BaseException:
            self.cancel()
            raise
        self._futures = []  # the caller holds the tensors now, and drops them when it does not take them
        self.seconds = time.perf_counter() - self.started
        return out

    def cancel(self) -> None:
        """Stop what has not started, wait for the copies under way, and let go of every tensor."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                with contextlib.suppress(Exception):
                    f.result()
        self._futures = []


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device (each made where it would be,
    then moved), their buffers where they are made: a model's rotary frequencies and other buffers it
    computes stay real, its weights take no memory until assigned."""
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module: Any, name: str, param: Any) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with _BUILD:
        torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_direct(path: Path, dtype: Any, device: str, split: dict[str, float] | None = None,
                reads: WeightReads | None = None) -> Any:
    """The model saved at ``path`` built empty (parameters on meta, no initialisation) with the shards'
    tensors (``reads``, started here when not given) as its parameters; None when the files are not one
    it can take whole: no safetensors, a key the model lacks, a shape that differs, a parameter the
    files leave out that is not a tied copy of one they hold. ``split`` receives ``build_s`` (the empty
    model, transformers' modeling imports included), ``read_s`` (the wait for the copies after it) and
    ``reads_s`` (the copies' own wall time, mostly under the build)."""
    reads = reads if reads is not None else WeightReads(path, dtype, device)
    try:
        return _build_with(path, dtype, device, split, reads) if reads.shards else None
    finally:
        reads.cancel()  # what was read and not taken is let go before any other way loads the model


def _build_with(path: Path, dtype: Any, device: str, split: dict[str, float] | None, reads: WeightReads) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    started = time.perf_counter()
    with no_init_weights(), torch.device(device), params_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    built = time.perf_counter()
    tensors = reads.result()
    targets = model.state_dict(keep_vars=True)
    for name, tensor in tensors.items():
        want = targets.get(name)
        if want is None or tuple(tensor.shape) != tuple(want.shape):
            log.debug("torch engine: %s in %s does not fit the model built from its config", name, path)
            return None
        if tensor.dtype != want.dtype:  # a module the model keeps in another dtype
            tensors[name] = tensor.to(want.dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    held = {params[k].data_ptr() for k in tensors if k in params}
    # a key the files lack is fine only as another's tied copy (lm_head = embed_tokens)
    if any(k not in params or params[k].is_meta or params[k].data_ptr() not in held for k in set(targets) - set(tensors)):
        return None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    if split is not None:
        split.update(build_s=built - started, read_s=time.perf_counter() - built, reads_s=reads.seconds or 0.0)
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def read_ahead(path: Path) -> None:
    """Ask the kernel to start reading ``path`` into the page cache (returns at once; a no-op where
    ``posix_fadvise`` does not exist)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
