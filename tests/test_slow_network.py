"""A slow link to Redis, not a dead one (tests/slowlink.py: an asyncio proxy adding latency and
jitter per direction): the main loop must not wait a round trip per iteration.

Measured on a 2-core box, 5 routes, Redis 0.2 s away each way (+ up to 0.05 s jitter; ~0.45 s round
trip), the default 2 s socket timeout, 20 s: before, the loop made 21 iterations (12 over 1 s) because
each one pumped the outbox (one XRANGE, four round trips per record) and each judging pass read the
maintenance annotations (one MGET) on the loop thread; judging fell behind, reading from Kafka was held
52 % of the time and the rollback landed 8.8 s after the regression (2.8 s on a fast link). After (pager
and maintenance reads on their own threads): 134 iterations (5 over 1 s: evidence records, still written
on the loop), never held, rollback in 3.7 s."""

from __future__ import annotations

import re
import time

import httpx

from tests.daemon_harness import MODEL, make_config, running_daemon, traffic, write_policy
from tests.helpers import wait_until
from tests.slowlink import SlowLink, round_trip


def _busy(metrics_text: str) -> tuple[float, float]:
    """(loop iterations, those over 0.25 s of work) from ``llmwd_loop_busy_seconds``."""
    b = {le: float(v) for le, v in re.findall(r'llmwd_loop_busy_seconds_bucket\{le="([^"]+)"\} (\S+)', metrics_text)}
    return b["+Inf"], b["+Inf"] - b["0.25"]


def test_a_slow_redis_link_does_not_stall_the_loop(kafka_service, own_redis, topic, tmp_path, sink) -> None:
    _s, url = sink
    link = SlowLink(own_redis.port)
    cfg = make_config(kafka_service.address, link.port, topic, write_policy(tmp_path / "p.yaml"), url,
                      redis={"url": f"redis://127.0.0.1:{link.port}/0", "socket_timeout_s": 2.0})
    try:
        with running_daemon(cfg) as (daemon, server), \
                traffic(kafka_service.address, topic, ["legal/contracts", "a", "b", "c"],
                        daemon.flags.precision_for) as gen:
            wait_until(lambda: daemon.stats.windows_closed >= 4, 40, what="windows closing on a fast link")
            link.set(delay_s=0.2, jitter_s=0.05)
            rtt = round_trip(link.port, 3)
            n0, slow0 = _busy(httpx.get(f"{server.url}/metrics").text)
            started = time.monotonic()
            held = 0
            flipped_after = None
            while time.monotonic() - started < 16:
                if flipped_after is None and time.monotonic() - started > 3:
                    if gen.routes[0].regression is None:
                        gen.inject(MODEL, "legal/contracts", "quality")
                        regressed = time.monotonic()
                    elif daemon.flags.precision_for(MODEL, "legal/contracts") == "fp16":
                        flipped_after = time.monotonic() - regressed
                held += int(daemon.metrics.reading_held._value.get())
                time.sleep(0.1)
            text = httpx.get(f"{server.url}/metrics").text
            n1, slow1 = _busy(text)
            shown = float(re.search(r"^llmwd_redis_round_trip_seconds (\S+)$", text, re.M).group(1))
            status_rtt = httpx.get(f"{server.url}/status", timeout=10).json()["redis_round_trip_s"]
            n, slow = n1 - n0, slow1 - slow0
            print(f"round trip {rtt:.2f} s: {n:.0f} iterations, {slow:.0f} over 0.25 s, reading held "
                  f"{held} of 160 looks, rollback after {flipped_after} s")
            assert rtt >= 0.35
            assert held == 0, "reading from Kafka was held: the loop fell behind on a slow Redis link"
            assert n >= 40 and slow <= 0.25 * n, f"{slow:.0f} of {n:.0f} iterations over 0.25 s"
            assert flipped_after is not None, "no rollback within 13 s of the regression"
            # the slow link is shown, not only felt: the gauge and /status carry the round trip
            assert shown >= 0.3 and status_rtt is not None and status_rtt >= 0.3, (shown, status_rtt)
    finally:
        link.close()
