"""Bounded start-up, SIGTERM within 10 s in every state, and readiness that names what is wrong."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.daemon_harness import daemon_cfg, start_daemon_process, write_policy
from tests.helpers import wait_until

pytestmark = pytest.mark.services

SASL = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_plain_username": "u",
        "sasl_plain_password": "p"}


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("bootstrap, security, cause", [
    (None, SASL, "TLS/SASL mismatch"),                      # plaintext broker, SASL configured: bootstrap hangs
    ("no-such-host.invalid:9092", {}, "DNS lookup failed"),
])
def test_start_up_is_bounded_names_the_cause_and_sigterm_exits_within_10_s(
        kafka_service, redis_service, topic, tmp_path, bootstrap, security, cause):
    cfg = daemon_cfg(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    cfg["kafka"].update(bootstrap_servers=bootstrap or kafka_service.address, security=security,
                        startup_timeout_s=2.0)
    base = f"http://127.0.0.1:{cfg['server']['port']}"
    d = start_daemon_process(cfg, tmp_path)
    try:
        wait_until(lambda: (r := _get(f"{base}/readyz")) is not None and cause in r.text, 20,
                   detail=lambda: (tmp_path / "daemon.log").read_text()[-2000:])
        ready = _get(f"{base}/readyz")
        assert ready is not None and ready.status_code == 503 and "kafka-startup" in ready.text
        live = _get(f"{base}/livez")
        assert live is not None and live.status_code == 200  # up, retrying: liveness must not restart it
        metrics = _get(f"{base}/metrics")
        assert metrics is not None
        assert 'llmwd_not_ready{reason="kafka-startup"} 1.0' in metrics.text and "llmwd_ready 0.0" in metrics.text
        t0 = time.monotonic()
        d.send_signal(signal.SIGTERM)
        assert d.wait(10) == 0
        assert time.monotonic() - t0 < 10
    finally:
        if d.poll() is None:
            d.kill()
            d.wait(5)
    log = (tmp_path / "daemon.log").read_text()
    lines = [ln for ln in log.splitlines() if "kafka start-up" in ln]
    assert lines and all(cause in ln for ln in lines)
    assert "Traceback" not in log


def _ready_daemon(kafka_service, redis_service, topic, tmp_path):  # type: ignore[no-untyped-def]
    """A daemon process on the shipped-style config, once its /readyz answers 200; (process, base URL)."""
    cfg = daemon_cfg(kafka_service.address, redis_service.port, topic, write_policy(tmp_path / "p.yaml"), None)
    base = f"http://127.0.0.1:{cfg['server']['port']}"
    d = start_daemon_process(cfg, tmp_path)

    def why() -> str:  # what readiness said at the deadline (the reasons), then the log's tail
        r = _get(f"{base}/readyz")
        said = "no answer" if r is None else f"{r.status_code} {r.text[:600]}"
        return f"/readyz: {said}\n" + (tmp_path / "daemon.log").read_text()[-2000:]

    try:
        wait_until(lambda: (r := _get(f"{base}/readyz")) is not None and r.status_code == 200, 30, detail=why)
    except BaseException:
        d.kill()
        d.wait(5)
        raise
    return d, base


def test_ready_daemon_exports_the_metric_contract_and_sigterm_exits_fast(kafka_service, redis_service, topic,
                                                                         tmp_path):
    d, base = _ready_daemon(kafka_service, redis_service, topic, tmp_path)
    try:
        text = _get(f"{base}/metrics").text  # type: ignore[union-attr]
        for name in ("llmwd_ready 1.0", 'llmwd_not_ready{reason="redis"} 0.0', "llmwd_loop_last_timestamp_seconds",
                     "llmwd_flip_budget_exhausted_total", "llmwd_ops_alerts_total", "llmwd_redis_up 1.0",
                     "llmwd_kafka_up 1.0", "llmwd_pending_decisions", "llmwd_checkpoints_total"):
            assert name in text, name
        loop_ts = float(next(ln.split()[1] for ln in text.splitlines()
                             if ln.startswith("llmwd_loop_last_timestamp_seconds ")))
        assert abs(loop_ts - time.time()) < 5
        assert _get(f"{base}/livez").status_code == 200  # type: ignore[union-attr]
        t0 = time.monotonic()
        d.send_signal(signal.SIGTERM)
        assert d.wait(10) == 0 and time.monotonic() - t0 < 10
    finally:
        if d.poll() is None:
            d.kill()
            d.wait(5)


def test_a_burst_of_sigints_stops_a_ready_daemon_once(kafka_service, redis_service, topic, tmp_path):
    """``timeout -s INT`` sends two SIGINTs, an impatient operator more: the second used to land inside
    the first handler's ``Event.set`` and the daemon hung there for good (one run in three of this)."""
    import os

    d, base = _ready_daemon(kafka_service, redis_service, topic, tmp_path)
    try:
        t0 = time.monotonic()
        for i in range(300):
            if d.poll() is not None:
                break
            os.kill(d.pid, signal.SIGINT)
            time.sleep(0.0001 * (i % 7))
        assert d.wait(10) == 0 and time.monotonic() - t0 < 10
    finally:
        if d.poll() is None:
            d.kill()
            d.wait(5)
    log = (tmp_path / "daemon.log").read_text()
    assert log.count("signal SIGINT: checkpointing and stopping") == 1 and "llm-watchdog stopped" in log
    assert "Traceback" not in log
