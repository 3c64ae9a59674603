"""The engine contract: what golden replay asks of any inference engine.

An engine generates greedy completions for a batch of prompts and, where it can, scores a reference
continuation by teacher forcing (the log-likelihood used for perplexity). Failures are data: a
``Generation`` with ``error`` set, never an exception out of ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(slots=True)
class Generation:
    text: str
    #: natural-log probability of each generated token; None when the engine cannot report them
    token_logprobs: list[float] | None
    latency_ms: float
    error: str | None = None


@dataclass(slots=True)
class ReferenceScore:
    """Teacher-forced log-likelihood of a reference continuation given its prompt."""

    logprob_sum: float
    n_tokens: int
    n_bytes: int
    error: str | None = None


@runtime_checkable
class Engine(Protocol):
    name: str
    precision: str

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[Generation]: ...

    def score(self, prompts: list[str], references: list[str]) -> list[ReferenceScore] | None:
        """Per-pair scores, or None when this engine cannot score references at all."""
        ...

    def close(self) -> None: ...
