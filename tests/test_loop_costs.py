"""Mechanics of the daemon loop's per-window work at many routes (issue 19): each cheaper form gives
exactly what the form it replaced gave."""

from __future__ import annotations

import random

from watchdog.core.metrics import worst_judgeability


def test_the_worst_rows_kept_part_by_part_are_those_of_all_rows_at_once() -> None:
    """``Decisions.export_judgeability`` keeps only ``worst_judgeability`` of the rows between its chunks:
    the same rows in the same order as over every row at once, ties (equal MDEs, none) included."""
    rnd = random.Random(7)
    rows = [{"policy": "p", "model": "m", "route": f"r{i}", "rule": "x", "judged": rnd.randint(0, 1),
             "mde": rnd.choice([None, 0.0, 0.5, 1.0, rnd.random()]), "horizon_mde": rnd.choice([None, 2.0])}
            for i in range(3000)]
    for n, part in ((50, 7), (500, 1000), (4, 1)):
        kept: list[dict[str, object]] = []
        for i in range(0, len(rows), part):
            kept = worst_judgeability(kept + rows[i:i + part], n)
        assert [r["route"] for r in kept] == [r["route"] for r in worst_judgeability(rows, n)]
