"""TensorRT-LLM engine: option mapping and output parsing (TensorRT-LLM itself is not installed here).

The stand-in classes mimic the documented shapes of tensorrt_llm's RequestOutput / CompletionOutput /
Logprob for the OUTPUT PARSING only; nothing here pretends to run TensorRT-LLM.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from probes.engines import get_engine
from probes.engines.tensorrt_llm_engine import (
    TensorRTLLMUnavailable,
    build_spec,
    describe,
    parse_generation,
    parse_reference_score,
    sampling_kwargs,
)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Any = None
    prompt_logprobs: Any = None


@dataclass
class RequestOutput:
    prompt: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


def test_spec_maps_precisions_and_scoring(tmp_path: Path) -> None:
    spec = build_spec("/m", "fp16", max_batch_size=64, kv_cache_free_gpu_memory_fraction=0.4)
    assert spec.llm_kwargs == {"model": "/m", "tensor_parallel_size": 1, "dtype": "float16", "max_batch_size": 64}
    assert spec.kv_cache == {"free_gpu_memory_fraction": 0.4} and not spec.quant_fp8
    fp8 = build_spec(str(tmp_path), "fp8", for_scoring=True, fp8_kv_cache=True)
    assert fp8.quant_fp8 and "dtype" not in fp8.llm_kwargs
    assert fp8.kv_cache == {"enable_block_reuse": False, "dtype": "fp8"}
    assert "QuantConfig(quant_algo=QuantAlgo.FP8)" in describe(fp8)
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    assert not build_spec(str(tmp_path), "fp8").quant_fp8  # a ModelOpt checkpoint is already FP8
    assert build_spec("/m", "bf16").llm_kwargs["dtype"] == "bfloat16"
    with pytest.raises(ValueError):
        build_spec("/m", "int4")


def test_sampling_is_greedy() -> None:
    assert sampling_kwargs(32) == {"max_tokens": 32, "temperature": 0.0, "top_k": 1, "logprobs": 1}
    assert sampling_kwargs(1, logprobs=False, prompt_logprobs=True) == {
        "max_tokens": 1, "temperature": 0.0, "top_k": 1, "prompt_logprobs": 1}


def test_parse_generation_both_logprob_shapes() -> None:
    dict_form = RequestOutput("p", [1, 2], [CompletionOutput(text=" Paris.", token_ids=[7, 8], logprobs=[
        {7: Logprob(-0.1, 1), 3: Logprob(-2.0, 2)}, {8: Logprob(-0.2, 1)}])])
    g = parse_generation(dict_form, 12.5)
    assert g.text == " Paris." and g.token_logprobs == [-0.1, -0.2] and g.latency_ms == 12.5 and g.error is None
    float_form = RequestOutput("p", [1], [CompletionOutput(text="x", token_ids=[5], logprobs=[-0.7])])
    assert parse_generation(float_form, 1.0).token_logprobs == [-0.7]
    none_form = RequestOutput("p", [1], [CompletionOutput(text="x", token_ids=[5], logprobs=None)])
    assert parse_generation(none_form, 1.0).token_logprobs is None


def test_parse_reference_score_sums_reference_tokens_only() -> None:
    # prompt has 3 tokens, reference 2; prompt_logprobs has one entry per token after the first
    out = RequestOutput("pr", [10, 11, 12, 13, 14], [CompletionOutput(prompt_logprobs=[
        {11: Logprob(-1.0)}, {12: Logprob(-1.0)}, {13: Logprob(-0.25)}, {14: Logprob(-0.5)}])])
    s = parse_reference_score(out, 3, "ab")
    assert (s.logprob_sum, s.n_tokens, s.n_bytes, s.error) == (-0.75, 2, 2, None)
    missing = RequestOutput("pr", [10, 11], [CompletionOutput(prompt_logprobs=None)])
    assert parse_reference_score(missing, 1, "b").error == "no prompt logprobs returned"
    assert parse_reference_score(out, 5, "").error == "reference added no tokens"


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="TensorRT-LLM is installed")
def test_missing_tensorrt_llm_is_a_clear_error(tmp_path: Path) -> None:
    # a model directory: a missing one is named first, before the (heavy) import (tests/test_model_path.py)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TensorRTLLMUnavailable, match="pip install tensorrt-llm"):
        get_engine("tensorrt_llm", model_path=str(tmp_path), precision="fp8")
