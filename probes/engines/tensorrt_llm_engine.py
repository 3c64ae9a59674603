"""TensorRT-LLM engine (kind ``tensorrt_llm``) through its LLM API.

Written against the documented API (``from tensorrt_llm import LLM, SamplingParams``;
``tensorrt_llm.llmapi.QuantConfig/QuantAlgo/KvCacheConfig``). FP8 comes either from a pre-quantised
checkpoint (ModelOpt's ``hf_quant_config.json``: nothing to pass) or from
``QuantConfig(quant_algo=QuantAlgo.FP8)``. Greedy decoding is ``temperature=0, top_k=1``. Scoring
uses ``prompt_logprobs`` with KV-cache block reuse off (reused blocks return no prompt logprobs).

TensorRT-LLM was NOT installed or executed while this was written: the option mapping and the
output parsing are unit-tested against stand-in objects shaped like ``RequestOutput`` /
``CompletionOutput``; running it needs a machine with TensorRT-LLM.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probes.engines import register
from probes.engines.base import Generation, ReferenceScore
from probes.engines.model_path import check_model_path

log = logging.getLogger(__name__)

PRECISIONS = ("fp16", "bf16", "fp8")


class TensorRTLLMUnavailable(RuntimeError):
    pass


@dataclass(slots=True)
class LLMSpec:
    """What to build, as plain data (testable without tensorrt_llm)."""

    llm_kwargs: dict[str, Any]
    quant_fp8: bool
    kv_cache: dict[str, Any] = field(default_factory=dict)


def build_spec(model_path: str, precision: str = "fp16", *, tensor_parallel_size: int = 1,
               max_batch_size: int | None = None, max_num_tokens: int | None = None,
               kv_cache_free_gpu_memory_fraction: float | None = None, fp8_kv_cache: bool = False,
               for_scoring: bool = False) -> LLMSpec:
    """Map engine options to LLM(...) keyword arguments."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    kwargs: dict[str, Any] = {"model": str(model_path), "tensor_parallel_size": int(tensor_parallel_size)}
    if precision in ("fp16", "bf16"):
        kwargs["dtype"] = "float16" if precision == "fp16" else "bfloat16"
    if max_batch_size:
        kwargs["max_batch_size"] = int(max_batch_size)
    if max_num_tokens:
        kwargs["max_num_tokens"] = int(max_num_tokens)
    kv: dict[str, Any] = {}
    if kv_cache_free_gpu_memory_fraction is not None:
        kv["free_gpu_memory_fraction"] = float(kv_cache_free_gpu_memory_fraction)
    if for_scoring:
        kv["enable_block_reuse"] = False
    if fp8_kv_cache:
        kv["dtype"] = "fp8"
    # a ModelOpt FP8 checkpoint carries its own quantisation; only quantise on load otherwise
    pre_quantised = precision == "fp8" and (Path(model_path) / "hf_quant_config.json").exists()
    return LLMSpec(llm_kwargs=kwargs, quant_fp8=precision == "fp8" and not pre_quantised, kv_cache=kv)


def sampling_kwargs(max_tokens: int, *, logprobs: bool = True, prompt_logprobs: bool = False) -> dict[str, Any]:
    """SamplingParams(...) keyword arguments for greedy decoding (and prompt scoring)."""
    kw: dict[str, Any] = {"max_tokens": int(max_tokens), "temperature": 0.0, "top_k": 1}
    if logprobs:
        kw["logprobs"] = 1
    if prompt_logprobs:
        kw["prompt_logprobs"] = 1
    return kw


def _logprob_value(entry: Any, token_id: int | None) -> float | None:
    """One position of TensorRT-LLM logprobs: a float, or {token_id: Logprob(logprob=, rank=)}."""
    if entry is None:
        return None
    if isinstance(entry, int | float):
        return float(entry)
    if isinstance(entry, dict):
        if not entry:
            return None
        item = entry.get(token_id) if token_id is not None and token_id in entry else None
        if item is None:  # the chosen token is the rank-1 one under greedy decoding
            item = min(entry.values(), key=lambda v: getattr(v, "rank", 0) or 0)
        value = getattr(item, "logprob", item)
        return float(value)
    return float(getattr(entry, "logprob", entry))


def parse_generation(output: Any, latency_ms: float) -> Generation:
    """RequestOutput -> Generation (first completion)."""
    comp = output.outputs[0]
    ids = list(getattr(comp, "token_ids", None) or [])
    raw = getattr(comp, "logprobs", None)
    lps: list[float] | None = None
    if raw:
        values = [_logprob_value(e, ids[i] if i < len(ids) else None) for i, e in enumerate(raw)]
        lps = [v for v in values if v is not None]
    return Generation(text=str(comp.text or ""), token_logprobs=lps, latency_ms=latency_ms)


def parse_reference_score(output: Any, n_prompt_tokens: int, reference: str) -> ReferenceScore:
    """Sum the prompt logprobs of the reference tokens (the last len(full) - n_prompt_tokens)."""
    ids = list(getattr(output, "prompt_token_ids", None) or [])
    raw = getattr(output.outputs[0], "prompt_logprobs", None) or getattr(output, "prompt_logprobs", None)
    n_bytes = len(reference.encode())
    if not raw or not ids:
        return ReferenceScore(0.0, 0, n_bytes, error="no prompt logprobs returned")
    # prompt_logprobs has len(ids) - 1 entries (the first token has none) or len(ids) with a None first
    offset = len(ids) - len(raw)
    n_ref = len(ids) - n_prompt_tokens
    if n_ref <= 0:
        return ReferenceScore(0.0, 0, n_bytes, error="reference added no tokens")
    total = 0.0
    for pos in range(n_prompt_tokens, len(ids)):
        value = _logprob_value(raw[pos - offset], ids[pos]) if pos - offset >= 0 else None
        if value is None or math.isnan(value):
            return ReferenceScore(0.0, n_ref, n_bytes, error=f"missing logprob at token {pos}")
        total += value
    return ReferenceScore(total, n_ref, n_bytes)


def _import_trtllm() -> Any:
    try:
        import tensorrt_llm  # noqa: F401
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig, QuantAlgo, QuantConfig
    except ImportError as exc:
        raise TensorRTLLMUnavailable(
            "the tensorrt_llm engine needs TensorRT-LLM (pip install tensorrt-llm on a CUDA machine); "
            f"import failed: {exc}") from exc
    return LLM, SamplingParams, KvCacheConfig, QuantAlgo, QuantConfig


@register("tensorrt_llm")
class TensorRTLLMEngine:
    def __init__(self, model_path: str, precision: str = "fp16", *, name: str | None = None,
                 tensor_parallel_size: int = 1, max_batch_size: int | None = None, max_num_tokens: int | None = None,
                 kv_cache_free_gpu_memory_fraction: float | None = 0.5, fp8_kv_cache: bool = False,
                 enable_scoring: bool = True) -> None:
        check_model_path(model_path)  # before tensorrt_llm is imported
        LLM, SamplingParams, KvCacheConfig, QuantAlgo, QuantConfig = _import_trtllm()
        self.precision = precision
        self.name = name or f"tensorrt_llm:{Path(model_path).name}:{precision}"
        self.enable_scoring = enable_scoring
        spec = build_spec(model_path, precision, tensor_parallel_size=tensor_parallel_size,
                          max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                          kv_cache_free_gpu_memory_fraction=kv_cache_free_gpu_memory_fraction,
                          fp8_kv_cache=fp8_kv_cache, for_scoring=enable_scoring)
        kwargs = dict(spec.llm_kwargs)
        if spec.kv_cache:
            kwargs["kv_cache_config"] = KvCacheConfig(**spec.kv_cache)
        if spec.quant_fp8:
            kwargs["quant_config"] = QuantConfig(quant_algo=QuantAlgo.FP8)
        self._SamplingParams = SamplingParams
        self.llm = LLM(**kwargs)
        self.tokenizer = getattr(self.llm, "tokenizer", None)

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[Generation]:
        start = time.perf_counter()
        try:
            params = self._SamplingParams(**sampling_kwargs(max_new_tokens))
            outputs = self.llm.generate(prompts, params)
        except Exception as exc:  # errors are data
            ms = (time.perf_counter() - start) * 1000.0
            return [Generation("", None, ms, error=f"{type(exc).__name__}: {exc}") for _ in prompts]
        ms = (time.perf_counter() - start) * 1000.0
        return [parse_generation(o, ms) for o in outputs]

    def score(self, prompts: list[str], references: list[str]) -> list[ReferenceScore] | None:
        if not self.enable_scoring or self.tokenizer is None:
            return None
        try:
            n_prompt = [len(self.tokenizer.encode(p)) for p in prompts]
            params = self._SamplingParams(**sampling_kwargs(1, logprobs=False, prompt_logprobs=True))
            outputs = self.llm.generate([p + r for p, r in zip(prompts, references, strict=True)], params)
        except Exception as exc:
            return [ReferenceScore(0.0, 0, len(r.encode()), error=f"{type(exc).__name__}: {exc}") for r in references]
        return [parse_reference_score(o, n, r) for o, n, r in zip(outputs, n_prompt, references, strict=True)]

    def close(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None)
        if callable(shutdown):
            shutdown()


def describe(spec: LLMSpec) -> Sequence[str]:
    """Human-readable lines for docs and `--dry-run` style logging."""
    lines = [f"LLM({', '.join(f'{k}={v!r}' for k, v in spec.llm_kwargs.items())})"]
    if spec.kv_cache:
        lines.append(f"KvCacheConfig({', '.join(f'{k}={v!r}' for k, v in spec.kv_cache.items())})")
    if spec.quant_fp8:
        lines.append("QuantConfig(quant_algo=QuantAlgo.FP8)")
    return lines
