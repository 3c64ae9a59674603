"""The gateway part of the embedded demo: real clients, the gateway, two real OpenAI servers.

A tiny Llama (trained offline in seconds) is served twice by ``probes.openai_server``: FP8 through
the in-process engine's real FP8 numerics, and FP16. Client threads send chat requests (half of
them streamed) through ``llm-watchdog gateway``, which mirrors each one to FP16 (``shadow``) and logs
events to the demo's broker. Then a checkpoint with stale FP8 scales is rolled out to the FP8
replica: answers drift from their FP16 shadows, the daemon flips the route, and the gateway's
``X-LLMWD-Precision`` header switches to fp16 on the next request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

log = logging.getLogger(__name__)

STALE_MULTIPLIER = 0.05
CLIENTS = 2

POLICY = """\
# Written by the demo: live FP8/FP16-shadow agreement on the gateway's route, sized for the ~10
# requests/s a tiny model on CPU serves (the shipped default needs 50+ events per window).
policies:
  - name: gateway-demo
    description: FP8 answers served through the gateway agree with their FP16 shadows (ROUGE-L) below 0.8.
    scope: {{models: ["{model}"], routes: ["{route}"]}}
    candidate: fp8
    baseline: fp16
    cooldown: 10m
    promote: {{mode: manual}}
    actions: {{notify: [slack]}}
    rules:
      - name: gateway-shadow-agreement
        source: live
        metric: shadow_rougeL
        fail_if: value < 0.80
        min_samples: 8
        for: 2
        severity: critical
        action: rollback
"""


class GatewayDemo:
    def __init__(self, model: str, route: str, workdir: Path) -> None:
        self.model = model
        self.route = route
        self.workdir = workdir
        self.servers: dict[str, Any] = {}
        self.stale_engine: Any = None
        self.gateway: Any = None
        self.served: list[tuple[float, str, int]] = []  # (time, served precision, HTTP status)
        self.first_switch: tuple[float, str] | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._prompts: list[str] = []

    def policy_file(self) -> Path:
        path = self.workdir / "gateway-demo-policy.yaml"
        path.write_text(POLICY.format(model=self.model, route=self.route))
        return path

    def prepare(self, console: Console) -> None:
        import torch

        from probes.engines.torch_engine import TorchEngine, calibrate_model
        from probes.openai_server import OpenAIServer
        from probes.tiny_model import DEFAULT_PAIRS, ensure_tiny_model

        # tiny matrices: one thread is fastest, and more thrash on a loaded 2-core machine
        torch.set_num_threads(1)
        t0 = time.monotonic()
        # trained until every reference token leads by 4 nats in plain and emulated-FP8 passes
        # (probes.tiny_model): healthy FP8 agrees with its FP16 shadow on any CPU, by construction
        model_dir = ensure_tiny_model(self.workdir / "models-gateway", train_seconds=600.0, max_steps=2000,
                                      fp8_margin=4.0)
        if not (model_dir / "fp8_calibration.json").exists():
            calibrate_model(model_dir, [p + r for p, r in DEFAULT_PAIRS])
        self._prompts = [p for p, _ in DEFAULT_PAIRS]
        for precision in ("fp8", "fp16"):
            engine = TorchEngine(model_dir, precision)
            self.servers[precision] = OpenAIServer(engine, model_name=f"tiny-{precision}").start()
        self.stale_engine = TorchEngine(model_dir, "fp8", scale_multiplier=STALE_MULTIPLIER)
        console.print(f"   two OpenAI-compatible servers over a tiny Llama ({time.monotonic() - t0:.0f} s): "
                      f"FP8 {self.servers['fp8'].base_url}, FP16 {self.servers['fp16'].base_url}")

    def start_gateway(self, console: Console, redis_url: str, prefix: str, kafka: str, topic: str) -> None:
        from watchdog.gateway.config import load_gateway_config
        from watchdog.gateway.server import GatewayServer, build_gateway

        cfg = load_gateway_config(None, redis_url=redis_url, redis_prefix=prefix, port=0,
                                  model_routes={self.model: self.route},
                                  events={"bootstrap_servers": kafka, "topic": topic},
                                  pools=[{"model": self.model,
                                          "candidate": {"url": self.servers["fp8"].base_url, "timeout_s": 10},
                                          "baseline": {"url": self.servers["fp16"].base_url, "timeout_s": 10},
                                          "shadow_sample": 1.0, "log_completions": True}])
        app = build_gateway(cfg)
        app.flags.wait_ready(5)
        self.gateway = GatewayServer(app).start()
        console.print(f"   llm-watchdog gateway on {self.gateway.base_url}: route {self.route} -> FP8 or FP16 "
                      "per the Redis flag, every request mirrored to the other precision")

    # -- client traffic ---------------------------------------------------------------------------

    def start_clients(self) -> None:
        for i in range(CLIENTS):
            t = threading.Thread(target=self._client, args=(i,), name=f"demo-client-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _client(self, idx: int) -> None:
        url = f"{self.gateway.base_url}/chat/completions"
        n = idx
        with httpx.Client(timeout=15) as http:
            while not self._stop.is_set():
                n += CLIENTS
                body = {"model": self.model, "max_tokens": 12, "stream": n % 2 == 0,
                        "messages": [{"role": "user", "content": self._prompts[n % len(self._prompts)]}]}
                try:
                    with http.stream("POST", url, json=body) as resp:
                        resp.read()
                        precision = resp.headers.get("x-llmwd-precision", "?")
                        status = resp.status_code
                except httpx.HTTPError as exc:
                    log.warning("demo client: %s", exc)
                    precision, status = "?", 0
                now = time.monotonic()
                self.served.append((now, precision, status))
                if self.first_switch is None and precision == "fp16":
                    self.first_switch = (now, precision)
                self._stop.wait(0.01)

    def counts(self, since: float = 0.0) -> Counter[str]:
        return Counter(p for t, p, s in self.served if t >= since and s == 200)

    def inject_stale_fp8(self) -> None:
        """Roll a checkpoint with stale FP8 activation scales out to the FP8 replica."""
        self.servers["fp8"].backend.engine = self.stale_engine

    def sample_answer(self) -> tuple[str, str]:
        """(served precision, answer) of one request, for the story."""
        assert self.gateway is not None
        resp = httpx.post(f"{self.gateway.base_url}/chat/completions", timeout=15,
                          json={"model": self.model, "max_tokens": 12,
                                "messages": [{"role": "user", "content": self._prompts[0]}]})
        text = resp.json()["choices"][0]["message"]["content"] if resp.status_code == 200 else f"HTTP {resp.status_code}"
        return resp.headers.get("x-llmwd-precision", "?"), text

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=20)
        if self.gateway is not None:
            self.gateway.stop()
        for s in self.servers.values():
            s.stop()
