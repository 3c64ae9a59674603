"""Compressed producers as gateways run them: confluent-kafka (librdkafka) and aiokafka, each event
counted by its delivery report."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import orjson

from tests.drills.harness import Traffic, WindowKey


def produce_compressed(address: str, topic: str, traffic: Traffic, client: str, codec: str, n: int,
                       rate: float = 100.0) -> tuple[Counter[WindowKey], int]:
    """Send ``n`` events built by ``traffic``'s generator at ``rate``/s; (acked per window, failed)."""
    events = []
    for i in range(n):
        ev = traffic.event(i % len(traffic.gen.routes), time.time() + i / rate)
        events.append(ev)
    if client == "confluent-kafka":
        return _confluent(address, topic, traffic, codec, events, rate)
    return asyncio.run(_aiokafka(address, topic, traffic, codec, events, rate))


def _key(traffic: Traffic, ev: dict[str, Any]) -> WindowKey:
    return (ev["route"], ev["precision"], traffic.window_of(float(ev["ts"])))


def _confluent(address: str, topic: str, traffic: Traffic, codec: str, events: list[dict[str, Any]],
               rate: float) -> tuple[Counter[WindowKey], int]:
    from confluent_kafka import Producer

    acked: Counter[WindowKey] = Counter()
    failed = [0]
    p = Producer({"bootstrap.servers": address, "compression.type": codec, "acks": "all",
                  "linger.ms": 20, "enable.idempotence": False})
    for ev in events:
        ev["ts"] = time.time()
        k = _key(traffic, ev)

        def report(err: Any, _msg: Any, k: WindowKey = k) -> None:
            if err is None:
                acked[k] += 1
            else:
                failed[0] += 1

        p.produce(topic, key=f"{ev['model']}/{ev['route']}".encode(), value=orjson.dumps(ev), on_delivery=report)
        p.poll(0)
        time.sleep(1.0 / rate)
    left = p.flush(30)
    failed[0] += left
    return acked, failed[0]


async def _aiokafka(address: str, topic: str, traffic: Traffic, codec: str, events: list[dict[str, Any]],
                    rate: float) -> tuple[Counter[WindowKey], int]:
    from aiokafka import AIOKafkaProducer

    acked: Counter[WindowKey] = Counter()
    failed = 0
    p = AIOKafkaProducer(bootstrap_servers=address, compression_type=codec, acks="all", linger_ms=20)
    await p.start()
    try:
        futures = []
        for ev in events:
            ev["ts"] = time.time()
            futures.append((_key(traffic, ev), await p.send(topic, key=f"{ev['model']}/{ev['route']}".encode(),
                                                             value=orjson.dumps(ev))))
            await asyncio.sleep(1.0 / rate)
        for k, fut in futures:
            try:
                await asyncio.wait_for(fut, 30)
                acked[k] += 1
            except Exception:  # noqa: BLE001 - not delivered: not counted as produced
                failed += 1
    finally:
        await p.stop()
    return acked, failed
