"""The texts of a golden replay's regressed items, for the evidence of a decision (docs/EVIDENCE.md).

``regressed_outputs(report)`` lists the items of a ``probes.drift.DriftReport`` that regressed (the
report's ranking on its primary metric first, then other items whose candidate answer differs from
the baseline's), worst first, with the reference and both answers cut to ``OUTPUT_CHARS``. The
replay's candidate signal carries them (``detail['outputs']``), so the evidence page can show FP8,
FP16 and the reference side by side. Golden sets are curated prompts, not customer traffic.
"""

from __future__ import annotations

import math
from typing import Any

#: regressed items whose texts the candidate signal carries, and the length of each text
OUTPUT_ITEMS = 12
OUTPUT_CHARS = 600


def _cut(text: str | None, chars: int) -> str:
    text = text or ""
    return text if len(text) <= chars else text[:chars] + "…"


def _answer(side: Any, chars: int) -> str:
    return _cut(side.output if side.error is None else f"[error] {side.error}", chars)


def regressed_outputs(report: Any, limit: int = OUTPUT_ITEMS, chars: int = OUTPUT_CHARS) -> list[dict[str, Any]]:
    """``[{"id", "reference", "candidate", "baseline", "metric", "diff"}]``, worst first."""
    metric = report.primary_metric
    by_id = {i.id: i for i in report.items}
    order = [i for i in report.regressions if i in by_id]
    ranked = set(order)

    def harm(item: Any) -> float:
        d = item.diff(metric)
        return d if d is not None else -math.inf

    rest = sorted((i for i in report.items if i.id not in ranked
                   and (i.failed or i.candidate.output != i.baseline.output)), key=harm)
    order += [i.id for i in rest]
    out = []
    for item_id in order[:limit]:
        item = by_id[item_id]
        d = item.diff(metric)
        out.append({"id": item.id, "reference": _cut(item.reference, chars), "candidate": _answer(item.candidate, chars),
                    "baseline": _answer(item.baseline, chars), "metric": metric,
                    "diff": d if d is not None and math.isfinite(d) else None})
    return out
