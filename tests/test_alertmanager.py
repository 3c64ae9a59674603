"""The Alertmanager channel against a real Alertmanager (Debian's prometheus-alertmanager).

The fixture starts Alertmanager on a free loopback port with a temporary config and storage
directory; its one receiver is a local webhook (AlertSink), so the test sees both Alertmanager's
own API (``/api/v2/alerts``) and the notifications it sends after grouping and deduplication.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import missing, wait_until
from watchdog.alerting.alerter import Alerter
from watchdog.core.signals import Action
from watchdog.dev.alertsink import AlertSink
from watchdog.dev.embedded import free_port, wait_for_port

AM_BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
FAST = {"backoff_initial": 0.05, "backoff_max": 0.2}
#: Alertmanager (or the sink) not answering yet: poll again
NOT_YET = (httpx.HTTPError,)


@pytest.fixture
def webhook() -> Iterator[AlertSink]:
    sink = AlertSink()
    sink.start()
    yield sink
    sink.stop()


@pytest.fixture
def alertmanager(tmp_path: Path, webhook: AlertSink) -> Iterator[str]:
    if AM_BINARY is None:
        missing("prometheus-alertmanager missing: scripts/setup.sh installs it",
                "prometheus-alertmanager not installed (apt-get install prometheus-alertmanager)")
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text(
        "route:\n"
        "  receiver: hook\n"
        "  group_by: ['...']\n"       # every alert its own group: one notification per alert
        "  group_wait: 1s\n"
        "  group_interval: 1s\n"
        "  repeat_interval: 1h\n"
        "receivers:\n"
        "  - name: hook\n"
        "    webhook_configs:\n"
        f"      - url: {webhook.url}/am-notify\n"
        "        send_resolved: true\n"
    )
    log = (tmp_path / "alertmanager.log").open("wb")
    proc = subprocess.Popen(
        [AM_BINARY, f"--config.file={config}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_for_port(port, timeout=20, proc=proc)  # type: ignore[arg-type]
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(url + "/-/ready", timeout=1).status_code == 200, 20, ignore=NOT_YET)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def am_alerts(url: str) -> list[dict[str, Any]]:
    resp = httpx.get(url + "/api/v2/alerts", params={"filter": 'alertname=~"LLMWatchdog.*"'}, timeout=2)
    resp.raise_for_status()
    return list(resp.json())


def notifications(sink: AlertSink) -> list[dict[str, Any]]:
    return [r.body for r in sink.received if r.path == "/am-notify"]


def rollback(at: float) -> Action:
    return Action(kind="rollback", policy="fp8-quality", model="llama-3-8b", route="chat",
                  reason="rougeL dropped 4.1% (CI -5.0..-3.2)", severity="critical", precision="fp16", at=at)


def test_fire_dedupe_resolve_in_real_alertmanager(alertmanager: str, webhook: AlertSink) -> None:
    # resend every 0.3 s: Alertmanager receives the same open incident again and again
    alerter = Alerter([{"kind": "alertmanager", "url": alertmanager, "resend_interval_s": 0.3}],
                      status_url="https://watchdog.example/status", **FAST).start()
    try:
        started = time.time()
        alerter.handle(rollback(started))
        alerter.ops_alert("redis", "Redis unreachable: connection refused", "critical")

        # fire: both alerts visible in the API with our labels, annotations and link
        alerts = wait_until(lambda: len(got := am_alerts(alertmanager)) == 2 and got, 10, ignore=NOT_YET)
        by_name = {a["labels"]["alertname"]: a for a in alerts}
        route = by_name["LLMWatchdogIncident"]
        assert route["labels"] == {"alertname": "LLMWatchdogIncident", "severity": "critical",
                                   "model": "llama-3-8b", "route": "chat", "policy": "fp8-quality"}
        assert route["status"]["state"] == "active"
        assert "FP8 rolled back to FP16 on route chat" in route["annotations"]["summary"]
        assert route["generatorURL"] == "https://watchdog.example/status"
        ops = by_name["LLMWatchdogOps"]
        assert ops["labels"]["key"] == "ops/redis" and ops["labels"]["severity"] == "critical"
        assert ops["labels"]["source"] == socket.gethostname()

        # dedupe: after several re-posts of the same incidents, still two alerts and one notification each
        sent_before = alerter.sent
        wait_until(lambda: alerter.sent >= sent_before + 4, 10, ignore=NOT_YET)
        assert len(am_alerts(alertmanager)) == 2
        wait_until(lambda: len(notifications(webhook)) >= 2, 10, ignore=NOT_YET)
        time.sleep(2.5)  # two more group intervals: a repeat would be notified now
        fired = [n for n in notifications(webhook) if n["status"] == "firing"]
        assert len(fired) == 2, [n["groupLabels"] for n in fired]
        assert all(len(n["alerts"]) == 1 for n in fired)

        # the same incident reported again at a lower severity: nothing new is sent
        alerter.ops_alert("redis", "Redis unreachable for 5 minutes", "warning")
        assert alerter.suppressed >= 1

        # resolve: gone from the active list, and Alertmanager notifies the resolve
        alerter.ops_resolve("redis")
        wait_until(lambda: [a["labels"]["alertname"] for a in am_alerts(alertmanager)] == ["LLMWatchdogIncident"],
                   10, ignore=NOT_YET)
        alerter.handle(Action(kind="promote", policy="fp8-quality", model="llama-3-8b", route="chat",
                              reason="rougeL back within 0.5%", severity="info", precision="fp8", at=time.time()))
        wait_until(lambda: am_alerts(alertmanager) == [], 10, ignore=NOT_YET)
        resolved = wait_until(lambda: len(r := [n for n in notifications(webhook) if n["status"] == "resolved"]) == 2
                              and r, 10, ignore=NOT_YET)
        names = sorted(n["alerts"][0]["labels"]["alertname"] for n in resolved)
        assert names == ["LLMWatchdogIncident", "LLMWatchdogOps"]
        for n in resolved:
            ends = n["alerts"][0]["endsAt"]
            assert ends > n["alerts"][0]["startsAt"] and not ends.startswith("0001")
        # a resolved incident is not re-sent: it stays resolved
        time.sleep(1.0)
        assert am_alerts(alertmanager) == []
        assert alerter.failed == 0
    finally:
        alerter.stop(2.0)


def test_severity_escalation_leaves_one_active_alert(alertmanager: str) -> None:
    alerter = Alerter([{"kind": "alertmanager", "url": alertmanager}], **FAST).start()
    try:
        alerter.ops_alert("kafka", "Kafka poll failing", "warning")
        wait_until(lambda: len(am_alerts(alertmanager)) == 1, 10, ignore=NOT_YET)
        alerter.ops_alert("kafka", "Kafka down for 2 minutes", "critical")
        wait_until(lambda: [a["labels"]["severity"] for a in am_alerts(alertmanager)] == ["critical"], 10,
                   ignore=NOT_YET)
        only = am_alerts(alertmanager)[0]
        assert only["annotations"]["summary"] == "Kafka down for 2 minutes"
        # without an external URL the link is a URN naming the incident, which Alertmanager accepts
        assert only["generatorURL"] == "urn:llm-watchdog:incident:ops%2Fkafka"
    finally:
        alerter.stop(2.0)


def test_ops_alerts_of_two_replicas_stay_apart(alertmanager: str) -> None:
    """Each daemon's ops incident is its own: one replica's recovery must not resolve another's."""
    a = Alerter([{"kind": "alertmanager", "url": alertmanager, "source": "wd-a"}], **FAST).start()
    b = Alerter([{"kind": "alertmanager", "url": alertmanager, "source": "wd-b"}], **FAST).start()
    try:
        a.ops_alert("redis", "Redis unreachable", "critical")
        b.ops_alert("redis", "Redis unreachable", "critical")
        wait_until(lambda: len(am_alerts(alertmanager)) == 2, 10, ignore=NOT_YET)
        a.ops_resolve("redis")
        wait_until(lambda: len(am_alerts(alertmanager)) < 2, 10, ignore=NOT_YET)
        time.sleep(0.5)
        left = am_alerts(alertmanager)
        assert [x["labels"].get("source") for x in left] == ["wd-b"], "wd-b's incident was resolved by wd-a"
    finally:
        a.stop(2.0)
        b.stop(2.0)


def test_a_truncated_alert_is_accepted_and_resolved_by_its_labels(alertmanager: str) -> None:
    """200k characters of CJK and emoji, a 2,000-character ops key: Alertmanager takes the cut alert
    (label values at most 1,024, annotations 16 KiB, the marker at the end) and the resolve ends it."""
    huge = ("漢字かな" * 20_000 + "😀🚀" * 60_000)[:200_000]
    key = "cache-" + "鍵" * 2_000
    alerter = Alerter([{"kind": "alertmanager", "url": alertmanager}], **FAST).start()
    try:
        alerter.ops_alert(key, huge, "critical", {"detail": "👨‍👩‍👧" * 100})
        (got,) = wait_until(lambda: am_alerts(alertmanager), 10, ignore=NOT_YET)
        assert len(got["labels"]["key"]) <= 1024 and got["labels"]["key"].startswith("ops/cache-鍵")
        summary = got["annotations"]["summary"]
        assert summary.endswith("… (truncated, 200000 chars)") and len(summary.encode()) <= 16 * 1024
        assert got["generatorURL"].startswith("urn:llm-watchdog:incident:")
        alerter.ops_resolve(key)
        wait_until(lambda: am_alerts(alertmanager) == [], 10, ignore=NOT_YET)
        assert alerter.failed == 0
    finally:
        alerter.stop(2.0)
