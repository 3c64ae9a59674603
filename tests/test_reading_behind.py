"""``Ingest.reading_behind``: records wait in Kafka for a partition the consumer reads now (the loop then
keeps what is left of its iteration's deadline for reading, not for encoding checkpoints ahead)."""

from __future__ import annotations

from typing import Any

from watchdog.core.metrics import Metrics
from watchdog.ingest.consumer import Ingest, TopicPartition


class _Consumer:
    def __init__(self, highs: dict[int, int | None]) -> None:
        self.highs = highs

    def subscribe(self, topics: list[str], listener: Any = None) -> None:
        pass

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition("t", p) for p in self.highs}

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.highs[tp.partition]

    def pause(self, *tps: TopicPartition) -> None:
        pass

    def resume(self, *tps: TopicPartition) -> None:
        pass


def _ingest(highs: dict[int, int | None]) -> Ingest:
    return Ingest(_Consumer(highs), None, topic="t", dlq_topic="t.dlq", max_event_bytes=1 << 20,  # type: ignore[arg-type]
                  metrics=Metrics(), sink=lambda *a: None)


def test_behind_while_a_read_partition_is_short_of_its_high_watermark() -> None:
    ingest = _ingest({0: 100, 1: 50})
    ingest.next_offset = {("t", 0): 100, ("t", 1): 50}
    assert not ingest.reading_behind()  # both at their high watermark (Tansu: the last batch's start)
    ingest.next_offset[("t", 1)] = 40
    assert ingest.reading_behind()


def test_not_behind_for_what_is_not_read_now() -> None:
    ingest = _ingest({0: 100, 1: None, 2: 100})
    ingest.next_offset = {("t", 0): 100, ("t", 1): 0}  # 1: no fetch yet; 2: not restored (no position)
    assert not ingest.reading_behind()
    ingest.next_offset[("t", 0)] = 10
    ingest.pause(("t", 0))  # its owner stopped it (not restored, fenced)
    assert not ingest.reading_behind()
    ingest.resume(("t", 0))
    assert ingest.reading_behind()
    ingest.hold(True)  # back-pressure: nothing is read, the saves catch up with the whole deadline
    assert not ingest.reading_behind()
    ingest.hold(False)
    assert ingest.reading_behind()
