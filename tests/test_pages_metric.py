"""``llmwd_pages_total{result}``: every alert message a channel delivers, gives up or drops is counted
once, through the alerter's ``on_page`` hook, as the daemon wires it."""

from __future__ import annotations

from watchdog.alerting.alerter import Alerter
from watchdog.core.metrics import Metrics
from watchdog.core.signals import Action
from watchdog.dev.alertsink import AlertSink

FAST = {"backoff_initial": 0.01, "backoff_max": 0.05}


def _action(route: str) -> Action:
    return Action(kind="alert", policy="p", model="m", route=route, reason="r", severity="warning",
                  at=1_790_000_000.0)


def _pages(metrics: Metrics) -> dict[str, float]:
    return {r: metrics.registry.get_sample_value("llmwd_pages_total", {"result": r}) or 0.0
            for r in ("delivered", "failed", "dropped")}


def test_delivered_and_failed_pages_are_counted_per_channel() -> None:
    metrics = Metrics()
    assert _pages(metrics) == {"delivered": 0.0, "failed": 0.0, "dropped": 0.0}  # series exist at 0
    with AlertSink() as sink:
        alerter = Alerter([{"kind": "webhook", "url": sink.url}, {"kind": "slack", "url": sink.url + "/slack"}],
                          max_attempts=2, on_page=lambda result, n: metrics.pages.labels(result).inc(n),
                          **FAST).start()
        sink.fail_next(1, status=400)  # refused: given up at once on the channel that got it
        alerter.handle(_action("a"))
        sink.wait_for(2, accepted=False)
        alerter.handle(_action("b"))
        sink.wait_for(3)
        assert alerter.stop(2)
    assert _pages(metrics) == {"delivered": 3.0, "failed": 1.0, "dropped": 0.0}
    assert (alerter.sent, alerter.failed) == (3, 1)


def test_dropped_pages_are_counted() -> None:
    metrics = Metrics()
    down = AlertSink()
    url = down.start()
    down.stop()  # nothing listens there any more
    alerter = Alerter([{"kind": "webhook", "url": url, "timeout_s": 0.2}], max_queue=2,
                      on_page=lambda result, n: metrics.pages.labels(result).inc(n), **FAST).start()
    for i in range(20):
        alerter.handle(_action(f"r{i}"))
    assert alerter.stop(0.2) is False
    pages = _pages(metrics)
    assert pages["dropped"] == alerter.dropped >= 17 and pages["delivered"] == 0
    assert pages["failed"] == alerter.failed
