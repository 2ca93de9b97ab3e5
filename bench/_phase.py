"""Whether a bench run had the machine it asked for (issue #39): on this shared 2-vCPU VM a run at 2 threads is
slowed, for both engines alike, when a neighbour's process takes a CPU or the host runs a vCPU on a busy core, and a
row measured in such a phase says little about the code. Two measures, both cheap:

- around each engine's run, the phase probe (``machine_limits.PhaseProbe``): one thread pinned per CPU, a fixed
  chain of multiply-adds and a read of 64 MiB, all at once; a CPU whose spin takes longer than the fastest spin of
  the bench is slow at that moment;
- inside each worker, over its decode runs, its threads' run-queue wait (``/proc/self/task/*/schedstat``: time
  runnable but not running, as a share of the wall time): a thread that waits is one its team waits for at every
  product's end (and dtorch's rows per thread, ``loader.row_counts``: a thread that ran slower claimed fewer rows).
"""

from __future__ import annotations

import os
import sys

SLOW_SPIN = 1.15  # a CPU's spin this much over the bench's fastest: slow at that moment
SLOW_WAIT = 0.03  # a worker thread runnable but not running for this share of the decode: the CPU was taken


def sched() -> dict[str, tuple[int, int]]:
    """This process's threads -> (run ns, run-queue wait ns) so far. Imports nothing of dtorch's: llama.cpp's worker
    (another venv) uses it too."""
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                run, wait = f.read().split()[:2]
            out[t] = (int(run), int(wait))
        except OSError:  # the thread ended, or no schedstat (not Linux, no CONFIG_SCHEDSTATS)
            pass
    return out


def waited(before: dict, after: dict, wall: float) -> float:
    """The largest run-queue wait among the threads that ran at least a fifth of ``wall`` s, as a share of it."""
    d = [((after[t][0] - before[t][0]) / 1e9, (after[t][1] - before[t][1]) / 1e9) for t in after if t in before]
    return max((w for r, w in d if r > 0.2 * wall), default=0.0) / wall


def probe(fn) -> list[dict] | None:
    """``fn()`` (a ``PhaseProbe``), or None when there is none or it failed."""
    if fn is None:
        return None
    try:
        return fn()
    except (OSError, ValueError, RuntimeError) as e:  # a failed probe costs its figures, never the bench's
        print(f"  (phase probe failed: {e})", file=sys.stderr)
        return None


def flags(probes: list[list[dict] | None], wait: float | None, fastest: float, threads: int) -> list[str]:
    """Why a run at ``threads`` threads had a slow phase: in ``probes`` (before and after it), the ``threads``-th
    fastest CPU's spin over SLOW_SPIN x ``fastest`` ms (a run of t threads needs t whole CPUs: at one thread, one slow
    CPU of two is not its problem), and a run-queue wait over SLOW_WAIT; [] when neither."""
    out = []
    for when, got in zip(("before", "after"), probes, strict=True):
        spins = sorted(got or (), key=lambda c: c["spin_ms"])
        if len(spins) >= threads and spins[threads - 1]["spin_ms"] > SLOW_SPIN * fastest:
            out += [f"cpu{c['cpu']} {c['spin_ms'] / fastest:.1f}x {when}" for c in spins[threads - 1:]
                    if c["spin_ms"] > SLOW_SPIN * fastest]
    if wait is not None and wait > SLOW_WAIT:
        out.append(f"waited {100 * wait:.0f}%")
    return out


def cells(got: list[dict] | None) -> str:
    """"spin ms / read GB/s" per CPU: "22/31 22/30"."""
    return " ".join(f"{c['spin_ms']:.0f}/{c['read_gbs']:.0f}" for c in got) if got else "-"
