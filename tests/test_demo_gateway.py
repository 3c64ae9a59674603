"""The demo's gateway phase on its own: real clients → gateway → tiny-model FP8/FP16 servers →
events → daemon (the demo's policy) → flag → the gateway serves FP16. A stale FP8 calibration is
caught through live agreement with the FP16 shadows (real FP8 numerics, real completions)."""

from __future__ import annotations

import io
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from rich.console import Console  # noqa: E402

from tests.daemon_harness import make_config, running_daemon  # noqa: E402
from watchdog.dev.gateway_demo import GatewayDemo  # noqa: E402

pytestmark = [pytest.mark.services, pytest.mark.torch, pytest.mark.slow]
MODEL, ROUTE = "llama-demo", "support/chat"


def test_a_stale_fp8_rollout_behind_the_gateway_is_rolled_back(tmp_path: Path, redis_service: Any,
                                                                 kafka_service: Any, topic: str) -> None:
    console = Console(file=io.StringIO())
    gw = GatewayDemo(MODEL, ROUTE, tmp_path)
    prefix = f"t{uuid.uuid4().hex[:8]}"
    url = f"redis://{redis_service.address}/0"
    cfg = make_config(kafka_service.address, redis_service.port, topic, gw.policy_file(), None,
                      redis={"url": url, "prefix": prefix}, windows={"length_s": 2.0, "grace_s": 0.5})
    try:
        gw.prepare(console)
        with running_daemon(cfg) as (daemon, _):
            gw.start_gateway(console, url, prefix, kafka_service.address, topic)
            gw.start_clients()
            deadline = time.monotonic() + 60  # group join + first windows on a loaded machine
            while daemon.stats.windows_closed < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert daemon.stats.windows_closed >= 3 and daemon.flags.precision_for(MODEL, ROUTE) == "fp8"
            assert gw.sample_answer() == ("fp8", " Paris.")
            t0 = time.monotonic()
            gw.inject_stale_fp8()
            assert gw.sample_answer()[1] != " Paris."  # the stale FP8 answers garbage
            while gw.first_switch is None and time.monotonic() < t0 + 60:
                time.sleep(0.2)
            assert gw.first_switch is not None, "the gateway never served FP16"
            flag = daemon.store.get(MODEL, ROUTE)
            assert flag is not None and flag.precision == "fp16" and flag.policy == "gateway-demo"
            assert "shadow_rougeL" in flag.reason
            assert gw.sample_answer() == ("fp16", " Paris.")
            assert gw.counts(t0)["fp16"] >= 1
    finally:
        gw.stop()
