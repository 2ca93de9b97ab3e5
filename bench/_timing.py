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


def paired_us(base: Callable[[], object], other: Callable[[], object], number: int = 2000,
              repeat: int = 15) -> tuple[float, float, float]:
    """Median µs per call of ``base`` and ``other`` and the median of their per-round difference.

    The two are timed in alternating rounds, so drift in the machine's speed hits both alike.
    """
    for _ in range(max(10, number // 20)):
        base()
        other()
    a, b, d = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            base()
        t1 = time.perf_counter()
        for _ in range(number):
            other()
        t2 = time.perf_counter()
        a.append((t1 - t0) / number * 1e6)
        b.append((t2 - t1) / number * 1e6)
        d.append(b[-1] - a[-1])
    return statistics.median(a), statistics.median(b), statistics.median(d)


def table(head: list[str], rows: list[list[object]]) -> str:
    cells = [head] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds per call of ``fn``: the median of ``repeat`` timed calls after one warm-up."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)
