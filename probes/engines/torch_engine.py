"""In-process engine (kind ``torch``): a Hugging Face causal LM in fp16/bf16 or real FP8.

FP8 swaps every linear layer for ``probes.fp8.Fp8Linear`` with static activation scales from
``fp8_calibration.json`` (``llm-watchdog calibrate``); ``lm_head`` too where FP8 runs on tensor cores
(``fp8_lm_head``: "auto", true or false). ``fp8_kv_cache`` ("auto": on there, with the fast decoder;
true: on either path) keeps the decode K/V cache in e4m3 with per-head scales (``probes.decode_attention``). docs/DRIFT.md
measured both within noise of FP16 on a trained model (2026-12-06); on CPU "auto" leaves both off, so
the emulated engine there stays what the tests and the demo pin. ``fp8_gemm="triton"`` runs decode's
FP8 products through ``probes.fp8_gemm`` (small-batch kernel) instead of cuBLAS. On CUDA cc >= 8.9 the products run
through ``torch._scaled_mm``; on CPU through an exact emulation of the same numerics.

On CPU the 'fp16' baseline computes in float32 (CPU half-precision matmuls are slow and not what
serving GPUs do); pass ``dtype='float16'`` to force it.

torch and transformers are imported lazily: the CLI imports this module for its ``calibrate``
subcommand without paying for them.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.engines import FALSE_TEXT, TRUE_TEXT, register
from probes.engines.base import Generation, ReferenceScore
from probes.engines.model_path import check_model_path, files_fingerprint
from probes.engines.weight_files import WeightReads, load_direct

if TYPE_CHECKING:
    import torch

    from probes.fp8 import SaturationReport

log = logging.getLogger(__name__)

PRECISIONS = ("fp16", "bf16", "fp32", "fp8")


def use_compile_cache(directory: str | Path, replace: bool = True) -> Path:
    """Persist the compile caches in ``directory``: torch.compile's (inductor's FX graph and kernel caches,
    ``TORCHINDUCTOR_CACHE_DIR``) and, in ``directory/triton`` (``TRITON_CACHE_DIR``), the binaries of the
    Triton kernels the FP8 engine launches itself (fused quantisers, FP8 K/V cache, decode attention),
    whose default home (``~/.triton/cache``) a container loses with each start: a later process loads them
    instead of compiling. Both are read when a kernel compiles; setting them imports nothing. ``replace``
    False keeps a variable the environment already sets."""
    import os

    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (("TORCHINDUCTOR_CACHE_DIR", path), ("TRITON_CACHE_DIR", path / "triton")):
        if replace or not os.environ.get(name):
            os.environ[name] = str(value)
    return path


def _fp8_kv_native(device: str) -> bool:
    """Whether the e4m3 K/V cache runs as kernels here: FP8 tensor cores (its Triton kernels convert
    e4m3 in registers, which needs compute capability 8.9) and Triton."""
    from probes import decode_attention
    from probes.fp8 import scaled_mm_supported

    return scaled_mm_supported(device) and decode_attention.HAVE_TRITON


def _auto_flag(value: Any, auto: bool) -> bool:
    """An engine option that is "auto" (then ``auto``), a bool or boolean text (``_flag``)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return auto
    return _flag(value)


def _flag(value: Any) -> bool:
    """A boolean engine option given as a bool or as text (``-o fp8_lm_head=true`` on the command line)."""
    if isinstance(value, str):
        if value.strip().lower() not in (*TRUE_TEXT, *FALSE_TEXT, ""):
            raise ValueError(f"expected a boolean, not {value!r}")
        return value.strip().lower() in TRUE_TEXT
    return bool(value)


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _device_context(torch: Any, device: str) -> Any:
    """A started thread making the CUDA context of ``device`` (when none exists yet), so that it overlaps
    the transformers import on the caller's thread (0.2 s and ~3 s on the H200, ``bench/gpu_load.py``);
    None on CPU."""
    import threading

    if not device.startswith("cuda") or torch.cuda.is_initialized():
        return None

    def make() -> None:
        try:
            torch.empty(1, device=device)
        except Exception as exc:  # noqa: BLE001 - the engine's own first allocation reports it
            log.debug("torch engine: CUDA context for %s not made ahead (%s)", device, exc)

    thread = threading.Thread(target=make, name="llmwd-cuda-context", daemon=True)
    thread.start()
    return thread


def _resolve_dtype(precision: str, device: str, dtype: str | None) -> torch.dtype:
    import torch

    if dtype:
        return getattr(torch, dtype)
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp32" or device.startswith("cpu"):
        return torch.float32
    return torch.float16


def _is_byte_tokenizer(model_path: Path) -> bool:
    cfg = model_path / "tokenizer_config.json"
    if cfg.exists():
        try:
            return json.loads(cfg.read_text()).get("tokenizer_class") == "ByT5Tokenizer"
        except (OSError, ValueError):
            return False
    return (model_path / "tiny_model.json").exists()


#: unquantised models this process loaded, by their files, dtype and device (``_files_key``): an FP8
#: engine over the same files quantises a shallow copy of one (``shared_copy``) instead of reading the
#: weights again. Weak: an entry lives as long as the engine holding the model.
_LOADED: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()


def _files_key(model_path: str | Path, dtype: Any, device: str) -> tuple[Any, ...] | None:
    """What identifies a loaded model: its directory, the name, size and mtime of each file there (a
    replaced or re-saved model is another key), the dtype and the device. None when unreadable."""
    path = Path(model_path).resolve()
    try:
        files = tuple(files_fingerprint(path))
    except OSError:
        return None
    return (str(path), files, str(dtype), str(device))


def shared_copy(model: Any) -> Any:
    """A copy of ``model``'s modules holding the very same parameter and buffer tensors: quantising the
    copy (``quantize_model`` swaps its linear modules and reads their weights) leaves ``model`` as it
    was, and the weights it does not quantise (embeddings, norms, an FP16 head) are held once."""
    import copy

    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def load_model(model_path: str | Path, dtype: Any, device: str, *, share: bool = False,
               split: dict[str, float] | None = None, reads: WeightReads | None = None) -> Any:
    """The saved Hugging Face model at ``model_path`` on ``device``.

    ``share``: the caller will change the model's modules (FP8 quantisation), so a model of the same
    files this process already holds comes back as a ``shared_copy`` (no read of the weights); else
    the model loaded here is kept, weakly, for such a later caller.

    On CUDA first the direct way (``weight_files.load_direct``): the safetensors shards' tensors copied
    onto the device by threads (``reads``, when the engine started them before its imports), the model
    built empty from its config, the copies taken as its parameters. ``from_pretrained`` on the CPU then
    ``.to(device)`` spent ~6 s per 8B engine building the model, not reading it (9.6-9.8 s against
    3.4-3.7 s for the files alone, ``bench/gpu_load.py`` on the H200). Anything that does not fit that
    way - no safetensors, keys the files do not hold (or hold beyond the model's), shapes that differ, a
    transformers that refuses it - takes ``from_pretrained``, which renames and converts what it knows.
    On the CPU ``from_pretrained`` is the faster way: it maps the files' tensors in, where the direct way
    faults in fresh memory to copy into (a 1.2B model: 1.9 s against 4.0 s, ``bench/gpu_load.py --shape
    1b`` without a GPU).

    ``split`` (a dict) receives where the time went: ``shared_s``, or the direct way's ``build_s``,
    ``read_s`` and ``reads_s`` (``load_direct``)."""
    split = {} if split is None else split
    key = _files_key(model_path, dtype, device)
    held = _LOADED.get(key) if key is not None else None
    if held is not None and share:
        if reads is not None:
            reads.cancel()
        started = time.perf_counter()
        try:
            copied = shared_copy(held)
        except Exception as exc:  # noqa: BLE001 - a model that will not copy is read from its files
            log.debug("torch engine: %s not shared (%s); read from its files", model_path, exc)
        else:
            split["shared_s"] = time.perf_counter() - started
            return copied
    try:
        model = load_direct(Path(model_path), dtype, device, split, reads) if device.startswith("cuda") else None
    except Exception as exc:  # noqa: BLE001 - the library's own loader is the answer to anything unexpected
        log.debug("torch engine: direct load of %s failed (%s); from_pretrained", model_path, exc)
        model = None
    if model is None:
        from transformers import AutoModelForCausalLM

        if reads is not None:
            reads.cancel()
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(device=device, dtype=dtype)
    if key is not None and not share:
        _LOADED[key] = model
    return model


def _early_reads(model_path: str | Path | None, dtype: Any, device: str, *, share: bool) -> WeightReads | None:
    """The weight files' copies onto a CUDA device started before the engine imports transformers and
    builds the model (``load_model`` takes them); None on the CPU (``from_pretrained`` maps the files),
    without a path, or where ``load_model`` will share a model this process holds."""
    if model_path is None or not device.startswith("cuda"):
        return None
    key = _files_key(model_path, dtype, device)
    if share and key is not None and _LOADED.get(key) is not None:
        return None
    try:
        return WeightReads(model_path, dtype, device)
    except Exception as exc:  # noqa: BLE001 - load_model reads the files its own way and reports what fails
        log.debug("torch engine: weights of %s not read ahead (%s)", model_path, exc)
        return None


def load_tokenizer(model_path: str | Path):
    path = Path(model_path)
    if _is_byte_tokenizer(path):
        from probes.tiny_model import byte_tokenizer

        return byte_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _cpu_threads(torch: Any, threads: Any) -> None:
    """A CPU engine's intra-op threads, for the whole process: ``threads`` (``-o cpu_threads=N``), else
    ``OMP_NUM_THREADS`` where set, else one. Torch's default, a thread per core, spins at every op's
    barrier while other work holds a core: the shipped 3M model's replay took 82 s instead of 8 s with
    one of two cores busy (README). A sidecar takes one core unless told otherwise."""
    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return
    n = 1 if threads is None else int(threads)
    if n < 1:
        raise ValueError(f"cpu_threads must be at least 1, not {threads!r}")
    torch.set_num_threads(n)


@register("torch")
class TorchEngine:
    """Greedy batched decoding with a KV cache (left padding), logprobs and teacher-forced scoring."""

    def __init__(self, model_path: str | Path | None = None, precision: str = "fp16", *, device: str = "auto",
                 dtype: str | None = None, batch_size: int = 16,
                 calibration: str | Path | Mapping[str, float] | None = None,
                 fp8_weight_scale: str = "tensor", fp8_activation: str = "static",
                 scale_multiplier: float = 1.0, max_batch_tokens: int | None = None, name: str | None = None,
                 model: Any = None, tokenizer: Any = None, track_saturation: bool = True,
                 fast: str | bool = "auto", compile: bool | str | None = None, cuda_graphs: bool | None = None,
                 compile_cache_dir: str | Path | None = None, fp8_lm_head: bool | str = "auto",
                 fp8_kv_cache: bool | str = "auto", fp8_gemm: str = "cublas", cpu_threads: int | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        if fp8_gemm not in ("cublas", "triton"):
            raise ValueError(f"fp8_gemm must be cublas or triton, not {fp8_gemm!r}")
        if model is None and model_path is None:
            raise ValueError("torch engine needs model_path (an HF directory) or a model object")
        if model_path is not None and (model is None or tokenizer is None):
            check_model_path(model_path)  # before torch is imported: a typo is one line in our words
        if compile_cache_dir:
            use_compile_cache(compile_cache_dir)
        started = time.perf_counter()
        import torch

        self.device = _resolve_device(device)
        context = _device_context(torch, self.device)
        self.dtype = _resolve_dtype(precision, self.device, dtype)
        reads = _early_reads(model_path, self.dtype, self.device, share=precision == "fp8") if model is None else None
        import transformers  # noqa: F401 - imported here so its import time is reported apart

        if context is not None:
            context.join()
        imported = time.perf_counter() - started

        self.precision = precision
        self.name = name or f"torch:{Path(model_path).name if model_path else 'model'}:{precision}"
        if self.device == "cpu":
            _cpu_threads(torch, cpu_threads)
        self.batch_size = max(1, int(batch_size))
        self.max_batch_tokens = max_batch_tokens
        self.byte_tokenizer = bool(model_path) and _is_byte_tokenizer(Path(model_path))
        mark = time.perf_counter()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)  # type: ignore[arg-type]
        loaded: dict[str, float] = {"tokenizer_s": time.perf_counter() - mark}
        if tokenizer is not None:
            self.byte_tokenizer = type(tokenizer).__name__ == "ByT5Tokenizer"
        self.tokenizer.padding_side = "left"
        if model is None:
            # an FP8 engine over files an unquantised engine of this process holds quantises its weights
            mark = time.perf_counter()
            model = load_model(model_path, self.dtype, self.device, share=precision == "fp8", split=loaded, reads=reads)
            loaded["model_s"] = time.perf_counter() - mark
        mark = time.perf_counter()
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self._sync()
        loaded["place_s"] = time.perf_counter() - mark
        #: where building this engine spent its time (s): import (torch, transformers: 0 when already
        #: imported), load (tokenizer, weights to the device; of it tokenizer_s, model_s = ``load_model`` with
        #: transformers' deferred imports and its own split: build_s and read_s, or shared_s; place_s = the
        #: move to the device and dtype and a sync), quantize (FP8 layers), fast_setup (decoder set-up; compile
        #: happens on first use)
        self.timings: dict[str, float] = {"import_s": imported, "load_s": time.perf_counter() - started - imported,
                                          **loaded}
        started = time.perf_counter()
        self.fp8_layers: list[str] = []
        self.fp8_lm_head = False
        if precision == "fp8":
            from probes.fp8 import calibration_path, load_calibration, quantize_model, scaled_mm_supported

            amax = None
            if fp8_activation == "static" and isinstance(calibration, Mapping):
                amax = {str(k): float(v) for k, v in calibration.items()}
            elif fp8_activation == "static":
                cal = Path(calibration) if calibration else (calibration_path(model_path) if model_path else None)
                if cal is None or not cal.exists():
                    raise FileNotFoundError(f"fp8 with static scales needs a calibration file ({cal}); "
                                            "run `llm-watchdog calibrate --model DIR --set NAME`")
                amax = load_calibration(cal)
            # "auto": FP8 where it runs on tensor cores and the calibration has the head's input scale
            # (one written before the head was calibrated keeps it in high precision)
            head_auto = scaled_mm_supported(self.device) and (amax is None or "lm_head" in amax)
            self.fp8_lm_head = _auto_flag(fp8_lm_head, head_auto)
            self.fp8_layers = quantize_model(self.model, amax, fp8_activation, weight_mode=fp8_weight_scale,
                                             scale_multiplier=scale_multiplier, track_saturation=track_saturation,
                                             skip=() if self.fp8_lm_head else ("lm_head",))
        eos = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        self.eos_ids = sorted(e for e in eos if e is not None)
        self._torch = torch
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._sync()
        self.timings["quantize_s"] = time.perf_counter() - started
        started = time.perf_counter()
        self.fast_decoder: Any = None
        self.fast_reason = self._setup_fast(fast, compile, cuda_graphs)
        kv8 = _auto_flag(fp8_kv_cache, self.fast_decoder is not None and _fp8_kv_native(self.device))
        if self.fp8_lm_head:
            self.fast_reason += ", FP8 lm_head"
        #: the decode K/V cache in e4m3 with per-head scales (probes.decode_attention), on either path
        self.fp8_kv_cache = kv8 and precision == "fp8"
        if self.fp8_kv_cache:
            if self.fast_decoder is not None:
                self.fast_decoder.set_options(kv_cache="fp8")
            self.fast_reason += ", FP8 K/V cache"
        if precision == "fp8" and self.fast_decoder is not None:
            # decode's FP8 products: cuBLAS (_scaled_mm) or the small-batch Triton kernel (probes.fp8_gemm)
            self.fast_decoder.set_options(gemm=str(fp8_gemm))
            if fp8_gemm == "triton":
                self.fast_reason += ", Triton FP8 decode GEMMs"
        self.timings["fast_setup_s"] = time.perf_counter() - started

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def memory_bytes(self) -> int:
        """Bytes of the model's parameters and buffers plus the fast decoder's static caches (what
        keeping this engine resident holds on its device)."""
        if self.model is None:
            return 0
        total = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        if self.fast_decoder is not None:
            total += self.fast_decoder.cache_bytes()
        return int(total)

    def _setup_fast(self, fast: str | bool, compile: bool | str | None, cuda_graphs: bool | None) -> str:
        """Build the static-cache decoder (probes.engines.fast_decode); returns why it is (not) used.

        ``fast``: "auto" (on CUDA when the model is supported), "on"/True (also on CPU, eagerly; an
        unsupported model is an error), "off"/False (the eager transformers loop)."""
        mode = {True: "on", False: "off"}.get(fast, fast) if isinstance(fast, bool) else str(fast).lower()
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"fast must be auto, on or off, not {fast!r}")
        if mode == "off" or (mode == "auto" and not self.device.startswith("cuda")):
            return f"fast decode {mode} on {self.device}: eager loop"
        from probes.engines.fast_decode import FastDecoder, unsupported_reason

        reason = unsupported_reason(self.model)
        if reason is not None:
            if mode == "on":
                raise ValueError(f"fast decode not supported: {reason}")
            log.info("torch engine %s: eager decode loop (%s)", self.name, reason)
            return f"eager loop: {reason}"
        self.fast_decoder = FastDecoder(self.model, compile=compile, cuda_graphs=cuda_graphs,
                                        max_batch=self.batch_size)
        self.fast_decoder.cache_arg = self._cache_arg
        compiled = "decode only" if self.fast_decoder.compile and not self.fast_decoder.compile_passes else (
            self.fast_decoder.compile)
        return (f"fast decode (static cache, compile {compiled}, "
                f"CUDA graphs {self.fast_decoder.cuda_graphs})")

    # -- tokenisation -------------------------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        # the byte tokenizer's special tokens would append EOS; HF tokenizers add BOS, which we want
        return list(self.tokenizer(text, add_special_tokens=not self.byte_tokenizer)["input_ids"])

    def encode_continuation(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _batches(self, lengths: Sequence[int], extra: int) -> Iterator[list[int]]:
        """Indices grouped longest-first, by batch_size and (optionally) max_batch_tokens."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batch: list[int] = []
        for i in order:
            width = max([lengths[j] for j in batch] + [lengths[i]]) + extra
            too_many = self.max_batch_tokens is not None and batch and width * (len(batch) + 1) > self.max_batch_tokens
            if len(batch) >= self.batch_size or too_many:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch

    def _pad_left(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        torch = self._torch
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
                mask[i, width - len(r):] = 1
        return ids.to(self.device), mask.to(self.device)

    # -- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: list[str], max_new_tokens: int,
                 stop: Sequence[str] | None = None) -> list[Generation]:
        """Greedy completions; with ``stop`` each row ends at (and includes) its first stop string."""
        results: list[Generation | None] = [None] * len(prompts)
        encoded: list[list[int]] = []
        for i, p in enumerate(prompts):
            try:
                encoded.append(self.encode_prompt(p))
            except Exception as exc:  # a tokenizer failure is one bad item, not a crash
                encoded.append([])
                results[i] = Generation("", None, 0.0, error=f"tokenizer: {type(exc).__name__}: {exc}")
            if not encoded[i] and results[i] is None:
                results[i] = Generation("", None, 0.0, error="empty prompt after tokenization")
        todo = [i for i in range(len(prompts)) if results[i] is None]
        for batch_pos in self._batches([len(encoded[i]) for i in todo], max_new_tokens):
            batch = [todo[j] for j in batch_pos]
            start = time.perf_counter()
            try:
                outs = self._generate_batch([encoded[i] for i in batch], max_new_tokens, tuple(stop or ()))
                ms = (time.perf_counter() - start) * 1000.0
                for i, (ids, lps) in zip(batch, outs, strict=True):
                    results[i] = Generation(text=self.decode(ids), token_logprobs=lps, latency_ms=ms)
            except Exception as exc:  # errors are data: every prompt of the failed batch gets one
                ms = (time.perf_counter() - start) * 1000.0
                log.warning("torch engine %s: batch of %d failed: %s", self.name, len(batch), exc)
                for i in batch:
                    results[i] = Generation(text="", token_logprobs=None, latency_ms=ms,
                                            error=f"{type(exc).__name__}: {exc}")
        return [r for r in results if r is not None]

    def _cut_at_stop(self, toks: list[int], lps: list[float],
                     stop: tuple[str, ...]) -> tuple[list[int], list[float]]:
        """Tokens up to the one that completes the first stop string (all of them when none occurs)."""
        if not stop or not any(s in self.decode(toks) for s in stop):
            return toks, lps
        for k in range(1, len(toks) + 1):
            if any(s in self.decode(toks[:k]) for s in stop):
                return toks[:k], lps[:k]
        return toks, lps

    def _generate_batch(self, rows: list[list[int]], max_new_tokens: int,
                        stop: tuple[str, ...] = ()) -> list[tuple[list[int], list[float]]]:
        if self.fast_decoder is not None and self.fast_decoder.model is self.model:
            ids, mask = self._pad_left(rows)
            check = (lambda _r, toks: any(s in self.decode(toks) for s in stop)) if stop else None
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            outs = self.fast_decoder.generate(ids, mask, max_new_tokens, self.eos_ids, check, pad_id=pad)
        else:
            outs = self._generate_eager(rows, max_new_tokens)
        return [self._cut_at_stop(t, lp, stop) for t, lp in outs]

    def _generate_eager(self, rows: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        torch = self._torch
        from transformers import DynamicCache

        ids, mask = self._pad_left(rows)
        n = len(rows)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        if max_new_tokens <= 0:
            return list(zip(tokens, logprobs, strict=True))
        eos = torch.tensor(self.eos_ids or [-1], device=self.device)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = e4m3_cache() if self.fp8_kv_cache else DynamicCache()
        # transformers >= 5.2x renamed past_key_values to cache (the old name warns); the H200 image has 5.17
        cache_kw = {self._cache_arg: cache}
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **cache_kw)
            chosen, chosen_lp = [], []
            for _step in range(max_new_tokens):
                lp = torch.log_softmax(out.logits[:, -1, :].float(), dim=-1)
                nxt = lp.argmax(dim=-1)
                chosen.append(nxt)
                chosen_lp.append(lp.gather(1, nxt[:, None])[:, 0])
                done = done | torch.isin(nxt, eos)
                if bool(done.all()):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
                pos = pos[:, -1:] + 1
                out = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, use_cache=True,
                                 **cache_kw)
        toks = torch.stack(chosen, dim=1).tolist()
        lps = torch.stack(chosen_lp, dim=1).tolist()
        eos_set = set(self.eos_ids)
        for b in range(n):
            for t, lpv in zip(toks[b], lps[b], strict=True):
                if t in eos_set:
                    break
                tokens[b].append(t)
                logprobs[b].append(lpv)
        return list(zip(tokens, logprobs, strict=True))

    # -- scoring ------------------------------------------------------------------------------------
    def score(self, prompts: list[str], references: list[str]) -> list[ReferenceScore] | None:
        if len(prompts) != len(references):
            raise ValueError("prompts and references must have the same length")
        results: list[ReferenceScore | None] = [None] * len(prompts)
        pairs: list[tuple[list[int], list[int]]] = []
        for i, (p, r) in enumerate(zip(prompts, references, strict=True)):
            p_ids, r_ids = self.encode_prompt(p), self.encode_continuation(r)
            pairs.append((p_ids, r_ids))
            if not r_ids:
                results[i] = ReferenceScore(0.0, 0, len(r.encode()), error="empty reference")
            elif not p_ids:
                results[i] = ReferenceScore(0.0, len(r_ids), len(r.encode()), error="empty prompt")
        todo = [i for i in range(len(prompts)) if results[i] is None]
        lengths = [len(pairs[i][0]) + len(pairs[i][1]) for i in todo]
        for batch_pos in self._batches(lengths, 0):
            batch = [todo[j] for j in batch_pos]
            try:
                sums = self._score_batch([pairs[i] for i in batch])
                for i, s in zip(batch, sums, strict=True):
                    results[i] = ReferenceScore(s, len(pairs[i][1]), len(references[i].encode()))
            except Exception as exc:
                log.warning("torch engine %s: scoring batch failed: %s", self.name, exc)
                for i in batch:
                    results[i] = ReferenceScore(0.0, len(pairs[i][1]), len(references[i].encode()),
                                                error=f"{type(exc).__name__}: {exc}")
        return [r for r in results if r is not None]

    def _token_logprobs(self, rows: list[list[int]], last: int | None = None) -> list[list[float]]:
        """For each row, the logprob of token t given tokens < t (t >= 1); with ``last``, only the
        last ``last`` tokens' (the lm_head and log-softmax then run over those positions alone)."""
        torch = self._torch
        ids, mask = self._pad_left(rows)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        width = ids.shape[1]
        keep = width if last is None else min(width, last + 1)
        fast = self.fast_decoder
        with torch.inference_mode():
            if fast is not None and fast.model is self.model and fast.own_forward:
                picked = fast.token_logprobs(ids, mask, keep).tolist()
            else:
                from probes.engines.fast_layers import picked_logprobs

                kw = {"logits_to_keep": keep} if self._keep_kw else {}
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                                    **kw).logits
                if logits.shape[1] != keep:
                    logits = logits[:, -keep:]
                targets = ids[:, width - keep + 1:]
                picked_t = torch.empty(targets.shape, dtype=torch.float32, device=ids.device)
                for s in range(0, ids.shape[0], 16):  # float log-softmax in row chunks: bounded memory
                    picked_t[s:s + 16] = picked_logprobs(logits[s:s + 16, :-1, :], targets[s:s + 16])
                picked = picked_t.tolist()
        if self.precision == "fp8":
            from probes.fp8 import QUANT_MEMO

            QUANT_MEMO.clear()
        return [picked[b][max(0, keep - 1 - (len(r) - 1)):] if last is None else picked[b]
                for b, r in enumerate(rows)]

    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        per_token = self._token_logprobs([p + r for p, r in pairs], last=max(len(r) for _p, r in pairs))
        return [float(sum(lps[-len(r):])) for lps, (_p, r) in zip(per_token, pairs, strict=True)]

    def prompt_logprobs(self, text: str) -> tuple[list[int], list[float | None]]:
        """Token ids of ``text`` and each token's logprob given the ones before (None for the first)."""
        ids = self.encode_prompt(text)
        if not ids:
            return [], []
        if len(ids) == 1:
            return ids, [None]
        rest = self._token_logprobs([ids])[0]
        return ids, [None, *rest]

    # -- fp8 bookkeeping ----------------------------------------------------------------------------
    def saturation(self) -> SaturationReport | None:
        if self.precision != "fp8":
            return None
        from probes.fp8 import saturation_report

        return saturation_report(self.model)

    def reset_saturation(self) -> None:
        if self.precision == "fp8":
            from probes.fp8 import reset_saturation

            reset_saturation(self.model)

    def close(self) -> None:
        self.fast_decoder = None
        self.model = None
        if self.device.startswith("cuda"):
            self._torch.cuda.empty_cache()


def e4m3_cache() -> Any:
    """A transformers ``DynamicCache`` with the fast decoder's FP8 K/V numerics, for the eager loop: each
    layer's prompt K/V set its per-head scales (``decode_attention.kv_scales``, over the batch) and are kept
    rounded to e4m3; the prompt's own attention reads them unrounded (as the fast path's prefill does),
    every later step the whole cache rounded (as the fast path's decode attention reads its e4m3 cache)."""
    return _e4m3_cache_class()()


@functools.cache
def _e4m3_cache_class() -> Any:
    """``e4m3_cache``'s class, built once (transformers is imported lazily)."""
    from transformers import DynamicCache

    from probes.decode_attention import dequant_kv, kv_scales, quant_kv

    def rounded(t: Any, scale: Any) -> Any:
        return dequant_kv(quant_kv(t, scale), scale).to(t.dtype)

    class E4m3Cache(DynamicCache):
        def __init__(self) -> None:
            super().__init__()
            self.kv_scales: dict[int, tuple[Any, Any]] = {}

        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            first = layer_idx not in self.kv_scales
            if first:
                self.kv_scales[layer_idx] = (kv_scales(key_states), kv_scales(value_states))
            ks, vs = self.kv_scales[layer_idx]
            out = super().update(rounded(key_states, ks), rounded(value_states, vs), layer_idx, *args, **kwargs)
            return (key_states, value_states) if first else out

    return E4m3Cache


# -- calibration ------------------------------------------------------------------------------------
def calibrate_model(model_path: str | Path, prompts: Sequence[str], out: str | Path | None = None, *,
                    device: str = "auto", dtype: str | None = None, batch_size: int = 16,
                    meta: dict[str, Any] | None = None) -> Path:
    """Record each linear layer's activation absmax over ``prompts``; write fp8_calibration.json.

    Pass the texts the FP8 engine will see (prompts, ideally with their references appended, so the
    decode-time activations are covered too). Returns the path written.
    """
    from probes.fp8 import calibration_path, save_calibration

    texts = [t for t in prompts if t]
    if not texts:
        raise ValueError("calibration needs at least one non-empty prompt")
    engine = TorchEngine(model_path, "fp16", device=device, dtype=dtype, batch_size=batch_size)
    amax = calibrate_engine(engine, texts)
    target = Path(out) if out else calibration_path(model_path)
    info = {"model": str(model_path), "n_texts": len(texts), "dtype": str(engine.dtype),
            "device": engine.device, "created": time.time(), **(meta or {})}
    engine.close()
    return save_calibration(target, amax, info)


def calibrate_engine(engine: TorchEngine, texts: Sequence[str]) -> dict[str, float]:
    """Activation absmax per linear layer of a (high-precision) engine's model over ``texts``."""
    from probes.fp8 import calibrate

    encoded = [e for e in (engine.encode_prompt(t) for t in texts) if e]
    if not encoded:
        raise ValueError("calibration needs at least one non-empty text")

    def batches():
        for batch in engine._batches([len(e) for e in encoded], 0):
            ids, mask = engine._pad_left([encoded[i] for i in batch])
            yield {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
                   "use_cache": False}

    with engine._torch.inference_mode():
        return calibrate(engine.model, batches())


def load_set_texts(name_or_path: str, golden_dir: str | Path | None = None,
                   include_references: bool = True) -> list[str]:
    """Calibration texts from a golden set (rendered prompts, plus their references by default)."""
    from probes.golden import find_golden_set, load_golden_set

    gs = load_golden_set(find_golden_set(name_or_path, golden_dir))
    return [gs.render(item) + (item.reference if include_references else "") for item in gs.items]


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from probes.golden import GoldenSetError

    try:
        texts = load_set_texts(args.set, args.golden_dir, include_references=not args.prompts_only)
        path = calibrate_model(args.model, texts, args.out, device=args.device, dtype=args.dtype,
                               meta={"set": args.set})
    except (OSError, ValueError, KeyError, GoldenSetError) as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a wheel without the torch extra: was a ModuleNotFoundError traceback
        if (exc.name or "").split(".")[0] not in ("torch", "transformers", "safetensors"):
            raise
        print(f"calibrate: {exc} (install it with: pip install 'fp8-watchdog[torch]')", file=sys.stderr)
        return 2
    print(f"wrote {path} ({len(texts)} texts)")
    return 0


def add_calibrate_command(subparsers: Any) -> None:
    from watchdog.core.argtypes import output_file

    p = subparsers.add_parser("calibrate", help="record FP8 activation scales for a model over a golden set")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--set", required=True, help="golden set name (in --golden-dir) or file path")
    p.add_argument("--golden-dir", default=None, help="root of the golden sets (default: golden_sets/)")
    # checked before the model is loaded and calibrated (a missing directory failed only at the end)
    p.add_argument("--out", default=None, type=output_file, help="default: MODEL/fp8_calibration.json")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None, help="compute dtype for the pass (default: fp16 on GPU, fp32 on CPU)")
    p.add_argument("--prompts-only", action="store_true", help="do not append references to the prompts")
    p.set_defaults(func=_cmd_calibrate)
