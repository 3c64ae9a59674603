"""GPU health through the daemon: no NVML never rolls back; an XID 79 on a replayed H200 does."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import MODEL, make_config, running_daemon, traffic
from tests.helpers import wait_until
from tests.test_gpu_read import ReplayNvml, recorded

pytestmark = pytest.mark.services

GPU_POLICY = """\
policies:
  - name: gpu-guard
    cooldown: 0s
    rules:
      - name: gpu-xid
        source: gpu
        metric: xid_critical
        fail_if: value > 0
        severity: critical
        action: rollback
      - name: errors
        source: live
        metric: error_rate
        fail_if: candidate > 0.5
        min_samples: 5
        action: rollback
"""


def _cfg(kafka_service, redis_service, topic: str, tmp_path: Path, gpu_key: str):
    policy = tmp_path / "gpu.yaml"
    policy.write_text(GPU_POLICY)
    return make_config(kafka_service.address, redis_service.port, topic, policy, None,
                       gpu={"enabled": True, "interval_s": 0.2, "routes": {gpu_key: [f"{MODEL}/legal/contracts"]}})


def test_without_nvml_gpu_rules_stay_inconclusive_and_nothing_flips(kafka_service, redis_service, redis_client,
                                                                    topic, tmp_path):
    pytest.importorskip("pynvml")
    import pynvml

    try:  # this test is about machines without a GPU driver, like CI
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML is present on this machine")
    except pynvml.NVMLError:
        pass
    cfg = _cfg(kafka_service, redis_service, topic, tmp_path, "*")
    with running_daemon(cfg) as (daemon, server), \
            traffic(kafka_service.address, topic, ["legal/contracts"], daemon.flags.precision_for):
        wait_until(lambda: daemon.stats.windows_closed >= 6, 30)
        status = httpx.get(f"{server.url}/status").json()
        assert httpx.get(f"{server.url}/readyz").status_code == 200
    scope = next(v for v in status["verdicts"]["scopes"]
                 if v["policy"] == "gpu-guard" and v["route"] == "legal/contracts")
    last = scope["rules"]["gpu-xid"]["last"]
    assert last["status"] == "inconclusive", last
    assert status["gpu"] == [] or all(not g.get("critical") for g in status["gpu"])
    assert redis_client.xlen("llmwd:audit") == 0


def test_xid_79_on_a_replayed_h200_rolls_the_mapped_route_back(kafka_service, redis_service, redis_client, topic,
                                                               tmp_path):
    rec = recorded()
    uuid = rec["gpus"][0]["fields"]["uuid"]
    nv = ReplayNvml(rec)
    cfg = _cfg(kafka_service, redis_service, topic, tmp_path, uuid)
    with running_daemon(cfg, gpu_nvml=nv) as (daemon, server):
        wait_until(lambda: daemon.gpu.samples >= 3, 10)
        time.sleep(0.5)
        assert daemon.flags.precision_for(MODEL, "legal/contracts") == "fp8"  # healthy H200: no action
        nv.emit(0, 79)  # "GPU has fallen off the bus", through the same event path NVML uses
        wait_until(lambda: daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16", 10)
        metrics = httpx.get(f"{server.url}/metrics").text
    audit = redis_client.xrange("llmwd:audit")
    assert len(audit) == 1 and "gpu-xid" in audit[0][1]["reason"]
    assert "DCGM_FI_DEV_GPU_TEMP" in metrics
