"""Realistic synthetic inference traffic for the demo, the tests and the benchmarks.

Each request is routed like a gateway would: a steady baseline slice always runs at FP16 (so the
watchdog can compare), the rest runs at whatever precision the route's flag says. FP8 is faster
(about 1.6x, as measured on an H200), latencies are log-normal with a heavy tail, and a fraction of
requests are mirrored to the other precision (``shadow``). Regressions can be injected per route.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from watchdog.core.events import partition_key

log = logging.getLogger(__name__)

Regression = Literal["errors", "quality", "slow", "timeouts"]

_ANSWERS = [
    "The notice period is thirty days from written notice by either party.",
    "Liability is capped at the fees paid in the twelve months before the claim.",
    "This agreement is governed by the laws of the State of New York.",
    "Reset the VPN token from the self-service portal, then restart the client.",
    "Employees accrue one and a half days of paid leave per month of service.",
    "Patients with chest pain and shortness of breath are triaged as urgent.",
    "The function returns the sorted list without modifying the input.",
    "Escalate severity one incidents to the on-call manager within fifteen minutes.",
]
_WRONG = [
    "The notice period is ninety days and cannot be waived by either party.",
    "There is no cap on liability under this agreement.",
    "Restart the server twice and delete the cache directory.",
    "Patients are triaged by arrival time only.",
]


@dataclass
class Route:
    model: str
    route: str
    #: requests per second on this route
    rate: float = 20.0
    #: fraction of requests pinned to the baseline precision for comparison
    baseline_share: float = 0.15
    #: fraction of requests mirrored to the other precision
    shadow_share: float = 0.3
    regression: Regression | None = None


@dataclass
class TrafficGenerator:
    """Builds events; ``run`` sends them to Kafka in real time from a thread."""

    routes: list[Route]
    precision_of: Callable[[str, str], str] = lambda model, route: "fp8"
    candidate: str = "fp8"
    baseline: str = "fp16"
    seed: int = 7
    rng: random.Random = field(init=False)
    sent: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def inject(self, model: str, route: str, regression: Regression | None) -> None:
        for r in self.routes:
            if r.model == model and r.route == route:
                r.regression = regression
                log.info("traffic: %s on %s/%s", regression or "healthy", model, route)

    def event(self, r: Route, now: float | None = None) -> dict[str, Any]:
        rng = self.rng
        served = self.precision_of(r.model, r.route)
        precision = self.baseline if rng.random() < r.baseline_share else served
        is_cand = precision == self.candidate
        broken = is_cand and r.regression is not None
        answer = rng.choice(_ANSWERS)
        latency = self._latency(rng, is_cand and r.regression != "slow")
        status = "ok"
        if rng.random() < (0.12 if broken and r.regression == "errors" else 0.004):
            status = "error"
        elif rng.random() < (0.10 if broken and r.regression == "timeouts" else 0.002):
            status = "timeout"
            latency = 30_000.0
        completion = answer
        logprobs = self._logprobs(rng, answer, degraded=False)
        if broken and r.regression == "quality" and rng.random() < 0.7:
            completion = rng.choice(_WRONG)
            logprobs = self._logprobs(rng, completion, degraded=True)
        ev: dict[str, Any] = {
            "schema": 1,
            "request_id": uuid.UUID(int=rng.getrandbits(128)).hex,
            "ts": now if now is not None else time.time(),
            "model": r.model,
            "route": r.route,
            "precision": precision,
            "engine": f"trtllm-{precision}",
            "status": status,
            "latency_ms": round(latency, 2),
            "ttft_ms": round(latency * 0.12, 2),
            "prompt_tokens": rng.randint(80, 900),
            "completion_tokens": len(completion.split()) + 2 if status == "ok" else 0,
            "completion": completion if status == "ok" else "",
            "completion_logprobs": logprobs if status == "ok" else [],
        }
        if status == "ok" and rng.random() < r.shadow_share:
            other = self.baseline if is_cand else self.candidate
            shadow_text = answer
            if other == self.candidate and r.regression == "quality" and rng.random() < 0.7:
                shadow_text = rng.choice(_WRONG)
            ev["shadow"] = {
                "precision": other,
                "completion": shadow_text,
                "completion_logprobs": self._logprobs(rng, shadow_text, degraded=shadow_text != answer),
                "latency_ms": round(self._latency(rng, other == self.candidate), 2),
            }
        return ev

    @staticmethod
    def _latency(rng: random.Random, fast: bool) -> float:
        base = 420.0 if fast else 680.0  # FP8 about 1.6x faster than FP16
        return base * math.exp(rng.gauss(0.0, 0.35))

    @staticmethod
    def _logprobs(rng: random.Random, text: str, degraded: bool) -> list[float]:
        mean = -1.4 if degraded else -0.25
        return [round(min(0.0, rng.gauss(mean, 0.2)), 4) for _ in range(len(text.split()) + 2)]

    def encoded(self, r: Route, now: float | None = None) -> tuple[bytes, bytes]:
        ev = self.event(r, now)
        return partition_key(r.model, r.route), orjson.dumps(ev)

    # -- real-time sending -------------------------------------------------------------
    def run(self, producer: Any, topic: str, duration_s: float | None = None) -> None:
        """Send events at each route's rate until stopped (or ``duration_s`` passes)."""
        start = time.monotonic()
        due = {id(r): start for r in self.routes}
        while not self._stop.is_set():
            now = time.monotonic()
            if duration_s is not None and now - start >= duration_s:
                break
            for r in self.routes:
                while due[id(r)] <= now:
                    key, value = self.encoded(r)
                    producer.send(topic, key=key, value=value)
                    self.sent += 1
                    due[id(r)] += self.rng.expovariate(r.rate)
            self._stop.wait(0.02)
        producer.flush()

    def start(self, producer: Any, topic: str) -> TrafficGenerator:
        self._thread = threading.Thread(target=self.run, args=(producer, topic), name="llmwd-traffic",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
