"""Tracing: every kernel's start and end on its stream, as Chrome trace JSON (opens in Perfetto),
and ``plot_chrome_trace(json, png)`` drawing one timeline row per stream (``python -m dtorch trace``).
"""

from __future__ import annotations

import json
import math
import os
import stat
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

    def add_stage(self, device: Any, label: str, t0: int, t1: int) -> None:
        """A pipeline stage's run of one step ("stage 1 step 7"), on a "pipeline" row of the stage's first device:
        beside its kernels it shows which micro-batch each stage ran when."""
        self.events.append((str(device), "pipeline", label, t0, t1))

    def clear(self) -> None:
        self.events.clear()
        self.origin = time.perf_counter_ns()

    def __repr__(self) -> str:
        streams = {(device, stype) for device, stype, *_ in list(self.events)}
        return f"Tracer({len(self.events)} kernels on {len(streams)} streams)"

    def chrome(self) -> dict:
        """The Chrome trace format: one "X" event per kernel; pid is the device, tid the stream type."""
        pids: dict[str, int] = {}
        tids = {"compute": 0, "communicate": 1, "pipeline": 2}
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


MAX_TRACE_BYTES = 1 << 28  # a trace file larger than this is refused before reading
MAX_TRACE_ROWS = 512  # timeline rows (device, stream) drawn at most


def _read_events(path: str) -> list[dict]:
    """The events of the Chrome trace JSON file at ``path``; ``ArgumentError`` naming it and what is wrong."""
    from dtorch.core.errors import ArgumentError

    try:  # O_NONBLOCK: a FIFO opens at once (and is then refused) instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ArgumentError(f"trace: cannot read Chrome trace {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArgumentError(f"trace: {path} is not a regular file; give the JSON file Tracer.write made")
        if st.st_size > MAX_TRACE_BYTES:
            raise ArgumentError(f"trace: {path} has {st.st_size} bytes, more than the {MAX_TRACE_BYTES} read at most")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_TRACE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        what = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise ArgumentError(f"trace: cannot read Chrome trace {path}: not valid JSON ({what})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ArgumentError(f"trace: {path}: the events must be a list (a JSON list, or a dict whose 'traceEvents' "
                            f"is one), got {type(events).__name__}")
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise ArgumentError(f"trace: {path}: event {i} must be a JSON object, got {type(e).__name__}")
        if e.get("ph") == "X":
            _check_span(path, i, e)
    return events


def _check_span(path: str, i: int, e: dict) -> None:
    from dtorch.core.errors import ArgumentError

    for key in ("pid", "tid"):
        if isinstance(e.get(key), bool) or not isinstance(e.get(key), (int, str)):
            raise ArgumentError(f"trace: {path}: event {i} ('X') needs '{key}' as an int or a str, got "
                                f"{e.get(key)!r:.80}")
    for key in ("ts", "dur"):
        v = e.get(key, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (key == "dur" and v < 0):
            need = "a finite number >= 0" if key == "dur" else "a finite number"
            raise ArgumentError(f"trace: {path}: event {i} ('X') needs '{key}' as {need} (microseconds), got "
                                f"{e.get(key, '<missing>')!r:.80}")
    if "ts" not in e:
        raise ArgumentError(f"trace: {path}: event {i} ('X') has no 'ts' (its start, in microseconds)")


def _name(e: dict) -> str | None:
    args = e.get("args")
    name = args.get("name") if isinstance(args, dict) else None
    return name if isinstance(name, str) else None


def plot_chrome_trace(json_path: str | os.PathLike, png_path: str | os.PathLike) -> str:
    """Draw a Chrome trace (as written by ``Tracer.write``) as one timeline row per (device, stream).

    A file that is not a regular file of Chrome trace JSON, an event missing its fields, or an output path that is
    a directory or cannot be written: ``ArgumentError`` naming the path and what is wrong.
    """
    from dtorch.core.errors import ArgumentError

    path, out = os.fspath(json_path), os.fspath(png_path)
    if os.path.isdir(out):
        raise ArgumentError(f"trace: the output {out} is a directory; give a .png file path")
    events = _read_events(path)
    names: dict[tuple[Any, Any], str] = {}
    procs: dict[Any, str] = {}
    for e in events:
        if e.get("ph") == "M" and _name(e) is not None:
            if e.get("name") == "process_name":
                procs[_key(e.get("pid"))] = _name(e)
            if e.get("name") == "thread_name":
                names[(_key(e.get("pid")), _key(e.get("tid")))] = _name(e)
    by_row: dict[tuple[Any, Any], list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_row[(e["pid"], e["tid"])].append(e)
    if not by_row:
        raise ArgumentError(f"trace: {path} has no complete ('X') events to draw")
    if len(by_row) > MAX_TRACE_ROWS:
        raise ArgumentError(f"trace: {path} has {len(by_row)} (pid, tid) rows, more than the {MAX_TRACE_ROWS} drawn")
    rows = sorted(by_row, key=lambda r: (isinstance(r[0], str), r[0], isinstance(r[1], str), r[1]))
    t0 = min(e["ts"] for mine in by_row.values() for e in mine)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"compute": "tab:blue", "communicate": "tab:orange", "pipeline": "tab:green"}
    # 0.45 in a row, plus room for the title and the time axis (with less, one row is squeezed to nothing)
    fig, ax = plt.subplots(figsize=(10, 1.3 + 0.45 * len(rows)))
    try:
        for y, row in enumerate(rows):
            mine = by_row[row]
            bars = [((e["ts"] - t0) / 1e3, max(e.get("dur", 0) / 1e3, 1e-3)) for e in mine]
            color = [colors.get(e.get("cat"), "tab:gray") if isinstance(e.get("cat"), str) else "tab:gray"
                     for e in mine]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=color, edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{procs.get(p, p)} {names.get((p, t), t)}" for p, t in rows])
        ax.invert_yaxis()
        ax.set_xlabel("time (ms)")
        ax.set_title("kernels per stream (blue: compute, orange: communicate; green: a pipeline stage's step)")
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as exc:
        raise ArgumentError(f"trace: cannot write the picture {out}: {exc}") from None
    finally:
        plt.close(fig)
    return out


def _key(value: Any) -> Any:
    """A pid or tid as a dict key (a malformed metadata event may carry a list)."""
    return value if isinstance(value, (int, str)) else repr(value)
