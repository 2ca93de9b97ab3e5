"""Tracing: every kernel's start and end on its stream, as Chrome trace JSON (opens in Perfetto),
and ``plot_chrome_trace(json, png)`` drawing one timeline row per stream (``python -m dtorch trace``).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from typing import Any


class Tracer:
    """Collects (stream, label, start ns, end ns); ``list.append`` is atomic, so streams add without a lock."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, int, int]] = []
        self.origin = time.perf_counter_ns()

    def add(self, stream: Any, label: str, t0: int, t1: int) -> None:
        self.events.append((str(stream.device), stream.type.value, label, t0, t1))

    def clear(self) -> None:
        self.events.clear()
        self.origin = time.perf_counter_ns()

    def __repr__(self) -> str:
        streams = {(device, stype) for device, stype, *_ in list(self.events)}
        return f"Tracer({len(self.events)} kernels on {len(streams)} streams)"

    def chrome(self) -> dict:
        """The Chrome trace format: one "X" event per kernel; pid is the device, tid the stream type."""
        pids: dict[str, int] = {}
        tids = {"compute": 0, "communicate": 1}
        out: list[dict] = []
        for device, stype, label, t0, t1 in list(self.events):
            if device not in pids:
                pids[device] = len(pids)
                out.append({"ph": "M", "name": "process_name", "pid": pids[device], "args": {"name": device}})
                for name, tid in tids.items():
                    out.append({"ph": "M", "name": "thread_name", "pid": pids[device], "tid": tid,
                                "args": {"name": name}})
            out.append({"ph": "X", "name": label.split(" on ")[0], "cat": stype, "pid": pids[device],
                        "tid": tids[stype], "ts": (t0 - self.origin) / 1e3, "dur": (t1 - t0) / 1e3})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> str:
        """Write the Chrome trace JSON to ``path``; returns it."""
        with open(path, "w") as f:
            json.dump(self.chrome(), f)
        return str(path)

    def intervals(self) -> dict[tuple[str, str], list[tuple[str, float, float]]]:
        """{(device, stream type): [(label, start s, end s)]}, relative to the tracer's origin."""
        rows: dict[tuple[str, str], list[tuple[str, float, float]]] = defaultdict(list)
        for device, stype, label, t0, t1 in list(self.events):
            rows[(device, stype)].append((label, (t0 - self.origin) / 1e9, (t1 - self.origin) / 1e9))
        return dict(rows)


def plot_chrome_trace(json_path: str | os.PathLike, png_path: str | os.PathLike) -> str:
    """Draw a Chrome trace (as written by ``Tracer.write``) as one timeline row per (device, stream)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dtorch.core.errors import ArgumentError

    try:
        with open(json_path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ArgumentError(f"trace: cannot read Chrome trace {json_path}: {exc}") from exc
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    names: dict[tuple[Any, Any], str] = {}
    procs: dict[Any, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ArgumentError(f"trace: {json_path} has no complete ('X') events to draw")
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    t0 = min(e["ts"] for e in spans)
    colors = {"compute": "tab:blue", "communicate": "tab:orange"}
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * len(rows)))
    for y, row in enumerate(rows):
        mine = [e for e in spans if (e["pid"], e["tid"]) == row]
        bars = [((e["ts"] - t0) / 1e3, max(e.get("dur", 0) / 1e3, 1e-3)) for e in mine]
        color = [colors.get(e.get("cat"), "tab:gray") for e in mine]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{procs.get(p, p)} {names.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title("kernels per stream (blue: compute, orange: communicate)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return str(png_path)
