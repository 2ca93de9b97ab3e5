"""Kernel runtime benchmark: stream overhead, compute/communicate overlap, peak memory with release.

    python bench/runtime.py [--quick] [--smoke] [--trace-png docs/trace.png]

Prints one table: kernels per second through one CPU stream with an empty kernel and the cost per
kernel over a direct call; the overlap fraction 1 - (T_step - T_compute_only) / T_comm_only for
(a) a tensor-parallel MLP step on DeviceMesh.cpu(2) and (b) two gloo processes where one peer is
slower (communication mostly waiting); peak activation memory of a long chain with and without
release. Every time is the median of several runs. Threads: each CPU device's compute stream runs
with cores // devices intra-op threads (torch.get_num_threads()), communicate streams with one.
``--smoke`` (what CI runs): every row once, 1,000 empty kernels instead of 20,000.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dtorch.core.device import Device  # noqa: E402
from dtorch.core.memory import MemoryKind, memory  # noqa: E402
from dtorch.graph import COMMUNICATE, DeviceMesh, LogicalGraph, Partial, Replicate, Shard  # noqa: E402
from dtorch.runtime import Kernel, KernelStream, Runner, RunState, StreamManager, StreamType  # noqa: E402
from dtorch.runtime.tracing import plot_chrome_trace  # noqa: E402


def interleaved(fns: dict, repeats: int, after=None) -> dict:
    """Median seconds of each fn, timed round-robin so that a noisy machine slows every one alike."""
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            if after is not None:
                after()
    return {k: statistics.median(v) for k, v in times.items()}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- 1. stream overhead ------------------------------------------------------------------------


class EmptyKernel(Kernel):
    __slots__ = ()

    def run(self) -> None:
        pass


def stream_overhead(n: int, repeats: int) -> tuple[float, float, float]:
    """(kernels per second through a stream, µs per kernel through it, µs per direct execute)."""
    from dtorch.graph.operand import Operator

    k = EmptyKernel(Operator("empty", "python", "empty", ()), 0, Device("cpu", 0), (), (), None)
    state = RunState(None)
    stream = KernelStream(Device("cpu", 0), StreamType.COMPUTE)

    def through() -> None:
        push = stream.push
        for _ in range(n):
            push(k, state)
        stream.synchronize(60)

    def direct() -> None:
        ex = k.execute
        for _ in range(n):
            ex(None, state)

    through()
    t_stream = median_time(through, repeats)
    t_direct = median_time(direct, repeats)
    stream.close()
    return n / t_stream, t_stream / n * 1e6, t_direct / n * 1e6


# -- 2a. tensor-parallel MLP step on cpu(2) --------------------------------------------------------


def tp_mlp(micro: int, B: int, D: int, H: int, mode: str) -> LogicalGraph:
    """``micro`` independent microbatches x_i [B, D] through w1 [D, H] S(1), relu, w2 [H, D] S(0), all-reduce.

    mode "step": all of it; "compute": without the all-reduces; "comm": only all-reduces of the same sizes.
    """
    gen = torch.Generator().manual_seed(0)
    g = LogicalGraph(DeviceMesh.cpu(2))
    w1 = g.param("w1", torch.randn(D, H, generator=gen) / D**0.5, Shard(1))
    w2 = g.param("w2", torch.randn(H, D, generator=gen) / H**0.5, Shard(0))
    for i in range(micro):
        if mode == "comm":
            g.output(f"y{i}", g.redistribute(g.input(f"x{i}", (B, D), placement=Partial()), Replicate()))
            continue
        y = (g.input(f"x{i}", (B, D)) @ w1).relu() @ w2
        g.output(f"y{i}", y if mode == "compute" else g.redistribute(y, Replicate()))
    return g


def overlap_inprocess(repeats: int, trace_png: str | None) -> dict:
    micro, B, D, H = 4, 64, 384, 1536
    feeds = {f"x{i}": torch.randn(B, D) for i in range(micro)}
    runners = {mode: Runner(tp_mlp(micro, B, D, H, mode)) for mode in ("step", "compute", "comm")}
    for r in runners.values():
        r.run(feeds, return_dist=True)
    times = interleaved({m: (lambda r=r: r.run(feeds, return_dist=True)) for m, r in runners.items()}, repeats)
    for r in runners.values():
        r.shutdown()
    if trace_png:
        with Runner(tp_mlp(micro, B, D, H, "step"), trace=True) as r:
            r.run(feeds)
            r.tracer.clear()
            r.run(feeds)
            path = r.tracer.write(Path(trace_png).with_suffix(".json"))
        plot_chrome_trace(path, trace_png)
        os.remove(path)
    return times


# -- 2b. two gloo processes, one peer slower -----------------------------------------------------


def waiting_graph(mesh: DeviceMesh, mode: str, delay: float, chain: int, size: int) -> LogicalGraph:
    """Rank 1 reaches the all-reduce ``delay`` s late; meanwhile every rank runs a matmul chain."""
    import torch.distributed as dist

    def late(t: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            time.sleep(delay)
        return t

    g = LogicalGraph(mesh)
    if mode in ("step", "comm"):
        grads = g.python(late, g.input("grads", (1 << 16,), placement=Partial()), placement=Partial(),
                         stream=COMMUNICATE, name="late")
        g.output("grads", g.redistribute(grads, Replicate()))
    if mode in ("step", "compute"):
        h = g.input("x", (size, size))
        w = g.param("w", torch.randn(size, size, generator=torch.Generator().manual_seed(0)) / size**0.5)
        for _ in range(chain):
            h = (h @ w).tanh()
        g.output("h", h)
    return g


def gloo_worker(rank: int, port: int, repeats: int) -> None:
    from dtorch.distributed import TorchDistCommunicator, init_process_group

    init_process_group(rank, 2, port=port, timeout=60)
    mesh = DeviceMesh.distributed("cpu")
    comm = TorchDistCommunicator()
    import torch.distributed as dist

    # the peer is 80 ms late; the matmul chain is sized to about twice that, so the waiting can hide behind it
    size, delay = 256, 0.08
    feeds_all = {"x": torch.randn(size, size), "grads": torch.randn(1 << 16)}
    with Runner(waiting_graph(mesh, "compute", 0.0, 24, size), comm) as r:
        for _ in range(3):
            r.run({"x": feeds_all["x"]})
        t24 = median_time(lambda: r.run({"x": feeds_all["x"]}), 5)
    chain_t = torch.tensor([max(24, round(24 * 2 * delay / t24))])
    dist.broadcast(chain_t, src=0)
    chain = int(chain_t)
    runners, feeds = {}, {}
    for mode in ("step", "compute", "comm"):
        g = waiting_graph(mesh, mode, delay, chain, size)
        feeds[mode] = {k: v for k, v in feeds_all.items() if k in g.inputs}
        runners[mode] = Runner(g, comm)
        runners[mode].run(feeds[mode])
    dist.barrier()
    times = interleaved({m: (lambda m=m: runners[m].run(feeds[m])) for m in runners}, repeats, after=dist.barrier)
    for r in runners.values():
        r.shutdown()
    if rank == 0:
        print(json.dumps(times | {"delay": delay}), flush=True)
    os._exit(0)


def overlap_gloo(repeats: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # two processes share this machine's cores: one intra-op thread each
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--gloo-worker", str(r), str(port), str(repeats)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    line = [x for x in outs[0][0].splitlines() if x.startswith("{")]
    if not line:
        raise RuntimeError(f"gloo worker failed: {outs[0][1][-2000:]}")
    return json.loads(line[-1])


# -- 3. peak memory ------------------------------------------------------------------------------


def chain_peak(release: bool, length: int, size: int) -> int:
    g = LogicalGraph(DeviceMesh.cpu(1))
    y = g.input("x", (size, size))
    for _ in range(length):
        y = y.tanh()
    g.output("y", y)
    with Runner(g, release=release) as r:
        memory.reset_peak()
        base = memory.live_bytes(MemoryKind.ACTIVATION, "cpu:0")
        r.run({"x": torch.randn(size, size)})
        return memory.peak_bytes(MemoryKind.ACTIVATION, "cpu:0") - base


def fraction(t: dict) -> float:
    return 1.0 - (t["step"] - t["compute"]) / t["comm"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--smoke", action="store_true", help="one run of each row, fewer kernels (CI)")
    p.add_argument("--trace-png", help="also draw the trace of one tensor-parallel MLP step here")
    p.add_argument("--gloo-worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gloo_worker:
        gloo_worker(int(args.gloo_worker[0]), int(args.gloo_worker[1]), int(args.gloo_worker[2]))
        return
    repeats = 1 if args.smoke else 3 if args.quick else 7
    kps, us_stream, us_direct = stream_overhead(1000 if args.smoke else 20000, repeats)
    a = overlap_inprocess(repeats, args.trace_png)
    b = overlap_gloo(repeats)
    kept, released = chain_peak(False, 32, 256), chain_peak(True, 32, 256)
    threads = StreamManager(2).compute_threads()
    rows = [
        ("empty kernels per second through one CPU stream", f"{kps:,.0f}", ">= 50,000"),
        ("µs per kernel: stream / direct execute / overhead",
         f"{us_stream:.2f} / {us_direct:.2f} / {us_stream - us_direct:.2f}", "overhead <= 20"),
        ("(a) TP MLP step on cpu(2), 4 microbatches: T_step / T_compute / T_comm (ms)",
         f"{a['step'] * 1e3:.2f} / {a['compute'] * 1e3:.2f} / {a['comm'] * 1e3:.2f}", ""),
        ("(a) overlap fraction", f"{fraction(a):.2f}", ""),
        (f"(b) 2 gloo procs, peer {b['delay'] * 1e3:.0f} ms late: T_step / T_compute / T_comm (ms)",
         f"{b['step'] * 1e3:.1f} / {b['compute'] * 1e3:.1f} / {b['comm'] * 1e3:.1f}", ""),
        ("(b) overlap fraction", f"{fraction(b):.2f}", ">= 0.8"),
        ("peak activation memory, 32-op chain of [256, 256]: keep-all / release (KiB)",
         f"{kept / 1024:,.0f} / {released / 1024:,.0f}", f"ratio {kept / max(released, 1):.1f}x"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"{'measure':<{w0}}  {'value':<{w1}}  target")
    for name, value, target in rows:
        print(f"{name:<{w0}}  {value:<{w1}}  {target}")
    print(f"\nmedians of {repeats} runs; {os.cpu_count()} cores; each CPU device's compute stream uses "
          f"{threads} intra-op thread(s) on cpu(2) (cores // devices), communicate streams 1;\n"
          "the two gloo processes of (b) run with OMP_NUM_THREADS=1 each (they share the same cores).")


if __name__ == "__main__":
    main()
