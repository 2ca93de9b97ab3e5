"""Small timing helpers shared by the benchmarks: medians of repeated runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def per_call_us(fn: Callable[[], object], number: int = 2000, repeat: int = 15) -> float:
    """Median over ``repeat`` runs of the mean time of one call, in microseconds."""
    for _ in range(max(10, number // 20)):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number * 1e6)
    return statistics.median(samples)


def table(head: list[str], rows: list[list[object]]) -> str:
    cells = [head] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
