"""The worst FP8 failure is the surest rollback (issue 17, item 8).

A catastrophically broken FP8 engine - NaN or overflowing logits, empty or random outputs, activation
scales off by 1000x either way, weights off by 1000x - must reach a FAIL verdict and a rollback
through the shipped golden policy path (``probes.golden_replay.replay`` -> ``DriftReport.to_signals``
-> ``PolicyEngine.observe`` with policies/default.yaml and the strict policy), never a traceback or
an error signal that pages ops and decides nothing. The broken engines are the real in-process
engine (``probes/engines/torch_engine.py``) on the tiny trained Llama, broken the way a bad
checkpoint, a stale calibration or an overflow breaks it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402

from probes.drift import DriftReport  # noqa: E402
from probes.engines.torch_engine import TorchEngine  # noqa: E402
from probes.golden import GoldenItem, GoldenSet, Manifest  # noqa: E402
from probes.golden_replay import replay  # noqa: E402
from probes.metrics import PERPLEXITY_CAP  # noqa: E402
from probes.tiny_model import DEFAULT_PAIRS  # noqa: E402
from watchdog.policy import PolicyEngine, load_policy_files  # noqa: E402

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
T0 = 1_800_000_000.0
METRICS = ["rougeL", "exact_match", "chrf", "ppl", "word_perplexity", "byte_perplexity", "bits_per_byte",
           "agreement_rougeL"]


def tiny_set(root: Path) -> GoldenSet:
    """32 items (the default policy judges from 30): the tiny model's 8 trained pairs, 4 times."""
    manifest = Manifest.model_validate({
        "name": "tiny", "domain": "qa", "description": "what the tiny model was trained on",
        "languages": ["en", "zh"], "routes": ["*"], "template": "{prompt}",
        "generation": {"max_new_tokens": 16}, "metrics": METRICS})
    items = tuple(GoldenItem(f"t{k}-{i}", p, r) for k in range(4) for i, (p, r) in enumerate(DEFAULT_PAIRS))
    return GoldenSet(root, manifest, items)


def _lm_head_hook(engine: TorchEngine, fn: Callable[[torch.Tensor], torch.Tensor]) -> TorchEngine:
    engine.model.lm_head.register_forward_hook(lambda _m, _i, out: fn(out))
    return engine


def _nan_logits(path: Path) -> TorchEngine:
    return _lm_head_hook(TorchEngine(path, "fp8"), lambda out: out * math.nan)


def _overflowing_logits(path: Path) -> TorchEngine:
    # float32 overflow: the largest logits become +-inf, log-softmax gives NaN
    return _lm_head_hook(TorchEngine(path, "fp8"), lambda out: out * 1e38)


def _empty_outputs(path: Path) -> TorchEngine:
    # EOS first, every time: every answer is empty and the reference gets ~1e4 nats per token,
    # far past math.exp's range (the OverflowError of issue 17)
    def fn(out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., 1] += 1e4
        return out

    return _lm_head_hook(TorchEngine(path, "fp8"), fn)


def _random_tokens(path: Path) -> TorchEngine:
    gen = torch.Generator().manual_seed(0)
    return _lm_head_hook(TorchEngine(path, "fp8"),
                         lambda out: torch.randn(out.shape, generator=gen, dtype=out.dtype) * 10)


def _weights_x1000(path: Path) -> TorchEngine:
    # a checkpoint whose weights are off by 1000x, served with the FP8 calibration of the real one
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.mul_(1000.0)
    return TorchEngine(path, "fp8", model=model)


BROKEN: dict[str, Callable[[Path], TorchEngine]] = {
    "NaN logits": _nan_logits,
    "overflowing logits": _overflowing_logits,
    "empty outputs": _empty_outputs,
    "random tokens": _random_tokens,
    # every activation saturates at +-448
    "activation scales x0.001": lambda p: TorchEngine(p, "fp8", scale_multiplier=0.001),
    # every activation flushes to zero (amax lands below e4m3's smallest subnormal, 2^-9)
    "activation scales x1e6": lambda p: TorchEngine(p, "fp8", scale_multiplier=1e6),
    "weights x1000": _weights_x1000,
}


@pytest.fixture(scope="module")
def baseline_engine(tiny_model_dir: Path) -> TorchEngine:
    return TorchEngine(tiny_model_dir, "fp16")


def _verdicts(report: DriftReport, policy: str, route: str) -> tuple[list[Any], dict[str, Any]]:
    engine = PolicyEngine(load_policy_files([REPO / "policies" / policy]))
    actions = engine.observe(report.to_signals(MODEL, route), T0, {})
    (state,) = [st for (p, m, r), st in engine.states.items() if (m, r) == (MODEL, route)]
    return actions, {name: rs.last for name, rs in state.rules.items() if rs.last is not None}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_catastrophically_broken_fp8_engine_is_a_rollback(case: str, tiny_model_dir: Path, tmp_path: Path,
                                                           baseline_engine: TorchEngine) -> None:
    golden = tiny_set(tmp_path)
    candidate = BROKEN[case](tiny_model_dir)
    report = replay(golden, candidate, baseline_engine, batch_size=16, progress=False)
    # a measurement, not a failed source: every item measured, the report is strict JSON
    assert report.measured == len(golden.items) and report.errors["candidate"] == 0, report.errors
    json.loads(report.to_json())
    rouge = report.summary("rougeL")
    assert rouge is not None and rouge.baseline is not None and rouge.candidate is not None
    assert rouge.baseline > 0.9 and rouge.candidate < rouge.baseline - 0.5, (case, rouge)
    ppl = report.summary("ppl")
    assert ppl is not None and ppl.candidate is not None and math.isfinite(ppl.candidate)
    # worse on the set (paired interval above 0), capped at most - never an OverflowError
    assert ppl.ci_low is not None and ppl.ci_low > 0 and ppl.candidate <= PERPLEXITY_CAP, (case, ppl)

    # the shipped default policy: the golden ROUGE-L rule fails and the route rolls back
    actions, last = _verdicts(report, "default.yaml", "code/assist")
    assert last["golden-rougeL"].status == "fail", (case, last["golden-rougeL"].reason)
    assert [(a.kind, a.detail.get("rule"), a.precision) for a in actions] == [("rollback", "golden-rougeL", "fp16")], case
    assert not [v for v in last.values() if v.status == "error"]
    # the strict policy of legal and medical routes too (both its golden rules)
    actions, last = _verdicts(report, "strict-legal-medical.yaml", "legal/contracts")
    assert [a.kind for a in actions] == ["rollback"], case
    assert last["golden-rougeL"].status == "fail" and last["golden-exact-match"].status == "fail", case


def test_scales_1000x_too_large_lose_only_small_activations_and_are_not_rolled_back(
        tiny_model_dir: Path, tmp_path: Path, baseline_engine: TorchEngine) -> None:
    """The other side of the coin: activation scales 1000x too large map the calibrated amax to
    0.448, so e4m3's 18 binades still hold everything above amax / 30 exactly as before; only tiny
    activations lose precision. On this model FP8 answers stay FP16's answers, and the judge says
    so - a measured pass, not an error and not a rollback."""
    golden = tiny_set(tmp_path)
    report = replay(golden, TorchEngine(tiny_model_dir, "fp8", scale_multiplier=1000.0), baseline_engine,
                    progress=False)
    assert report.measured == len(golden.items)
    rouge = report.summary("rougeL")
    assert rouge is not None and rouge.diff_mean is not None and rouge.diff_mean > -0.05
    actions, last = _verdicts(report, "default.yaml", "code/assist")
    assert actions == [] and last["golden-rougeL"].status == "pass", last["golden-rougeL"].reason
