"""GPU check of the runtime: every GPU-specific rule checked and timed in one run, printed as one table.

    python bench/device_check.py [--quick] [--dry-run] [--out DIR]

``--dry-run`` runs every row on 2 CPU devices at tiny sizes (the same code short of the CUDA calls; gloo instead of
NCCL), so a broken row fails CI and not the GPU's minutes. ``--out DIR`` also writes the table to
``DIR/device_check.txt``.

Rows (each ok / FAIL / skip, with milliseconds and a note):
- ``runner mlp``: an MLP graph on ``DeviceMesh.cuda(n)`` (n = 1, and 2 when two GPUs are visible: column-
  then row-parallel, an NCCL all-reduce) against torch on one GPU; params and feeds on their own GPUs;
  the output read right after ``run()`` with no extra synchronize; median ms per run against eager torch.
- ``cross-stream``: a compute-stream tensor read on the communicate stream after a device-side delay while
  the compute stream allocates more: the result is wrong if the caching allocator reused the tensor's
  memory too early (no ``record_stream``) or if ``run()`` returned before the device finished.
- ``overhead``: a chain of 200 tiny kernels: µs per kernel through the Runner against eager torch.
- ``nccl <op>``: ``InProcessCommunicator`` over n GPUs, one thread and stream per GPU, against torch; the
  NCCL path for the layouts NCCL takes, the peer-copy path for the others; all-reduce bandwidth.
- ``torchrun nccl``: two processes with the NCCL backend (two GPUs): the rank's own GPU, collectives.
- LLM rows (``device_check_llm.py``): a random Llama written on the spot as GGUF (Q8_0/Q4_0/Q4_1, kept packed) and
  as a Hugging Face directory, decoded on every path (CPU torch and native, the GPU with and without triton, eager,
  captured, tp=2) and compared with a reference.
Exits 0 with a message when there is no CUDA device (and no ``--dry-run``); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from device_check_llm import llm_rows  # noqa: E402

QUICK = False
DEV = "cuda"  # "cpu" in the dry run
Row = tuple[str, str, str, float | None, str]  # (check, devices, result, ms, note)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def mesh_of(n: int):
    from dtorch.graph import DeviceMesh

    return DeviceMesh.cuda(n) if DEV == "cuda" else DeviceMesh.cpu(n)


def device(i: int) -> torch.device:
    """Where the tensors of device ``i`` live (a CPU device of the mesh holds plain CPU tensors)."""
    return torch.device("cuda", i) if DEV == "cuda" else torch.device("cpu")


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-3) -> bool:
    return bool(torch.allclose(a.float().cpu(), b.float().cpu(), rtol=tol, atol=tol))


# -- the Runner ------------------------------------------------------------------------------------------


def check_runner_mlp(n: int) -> list[Row]:
    from dtorch.graph import LogicalGraph, Replicate, Shard
    from dtorch.runtime import Runner

    torch.backends.cuda.matmul.allow_tf32 = False
    d, layers, b = (64, 2, 8) if DEV == "cpu" else (1024, 2, 64) if QUICK else (4096, 6, 256)
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(d, d, generator=gen) / d**0.5 for _ in range(2 * layers)]
    x = torch.randn(b, d, generator=gen)
    g = LogicalGraph(mesh_of(n))
    h = g.input("x", (b, d))
    for i in range(layers):  # column- then row-parallel: one all-reduce per layer when n > 1
        h = g.redistribute((h @ g.param(f"w{2 * i}", ws[2 * i], Shard(1))).relu()
                           @ g.param(f"w{2 * i + 1}", ws[2 * i + 1], Shard(0)), Replicate())
    g.output("y", h)
    wd, xd = [w.to(device(0)) for w in ws], x.to(device(0))

    def eager() -> torch.Tensor:
        t = xd
        for i in range(layers):
            t = (t @ wd[2 * i]).relu() @ wd[2 * i + 1]
        return t

    ref = eager()
    rows = []
    with Runner(g) as r:
        placed = all(blob.tensor.device == device(blob.device.index)
                     for blob in r.blobs.values() if blob.tensor is not None)
        sync()
        y = r.run({"x": x if n == 1 else xd})["y"]  # a feed on the host, or on GPU 0 for the others to copy
        ok = y.device.type == DEV and close(y, ref) and placed  # read at once: no synchronize in between
        ms = median_ms(lambda: r.run({"x": xd}), 5 if QUICK else 20)
        base = median_ms(eager, 5 if QUICK else 20)
        note = f"eager torch {base:.2f} ms; params on their devices: {placed}"
        rows.append((f"runner mlp {layers}x{d}", f"{DEV} x{n}", "ok" if ok else "FAIL", ms, note))
    return rows


def check_cross_stream(n: int) -> list[Row]:
    """A tensor made on compute, read on communicate after a device delay, while compute allocates its size."""
    from dtorch.graph import COMMUNICATE, LogicalGraph
    from dtorch.runtime import Runner

    size = 64 if DEV == "cpu" else 2048
    x, w, w2 = (torch.randn(size, size, generator=torch.Generator().manual_seed(s)) / size**0.5 for s in (1, 2, 3))

    def late_double(t: torch.Tensor) -> torch.Tensor:
        if DEV == "cuda":
            torch.cuda._sleep(20_000_000)  # ~10 ms of device time before t is read
        else:
            time.sleep(0.01)
        return t * 2

    def after_the_release(t: torch.Tensor, w2d: torch.Tensor) -> torch.Tensor:
        time.sleep(0.003)  # the communicate thread has released `a` on the host by now
        return t @ w2d  # a new [size, size] tensor on the compute stream: `a`'s memory, unless recorded

    g = LogicalGraph(mesh_of(n))
    xi = g.input("x", (size, size))
    a = xi @ g.param("w", w)
    g.output("b", g.python(late_double, a, shape=(size, size), dtype=torch.float32, stream=COMMUNICATE))
    g.output("c", g.python(after_the_release, xi, g.param("w2", w2), shape=(size, size), dtype=torch.float32))
    want_b, want_c = (x @ w) * 2, x @ w2
    bad = 0
    runs = 5 if QUICK else 20
    with Runner(g) as r:
        t0 = time.perf_counter()
        for _ in range(runs):
            out = r.run({"x": x})
            bad += not (close(out["b"], want_b) and close(out["c"], want_c))
        ms = (time.perf_counter() - t0) * 1e3 / runs
    return [("cross-stream free + device wait", f"{DEV} x{n}", "ok" if not bad else "FAIL", ms,
             f"{bad} of {runs} runs wrong")]


def check_overhead() -> list[Row]:
    from dtorch.graph import LogicalGraph
    from dtorch.runtime import Runner

    k = 200
    g = LogicalGraph(mesh_of(1))
    h = g.input("x", (8, 8))
    for _ in range(k):
        h = h + 1.0
    g.output("y", h)
    xd = torch.zeros(8, 8, device=device(0))

    def eager() -> torch.Tensor:
        t = xd
        for _ in range(k):
            t = t + 1.0
        return t

    with Runner(g) as r:
        ok = close(r.run({"x": xd})["y"], torch.full((8, 8), float(k)))
        ms = median_ms(lambda: r.run({"x": xd}), 5 if QUICK else 30)
    base = median_ms(eager, 5 if QUICK else 30)
    return [("overhead: 200 tiny kernels", f"{DEV} x1", "ok" if ok else "FAIL", ms,
             f"{ms * 1e3 / k:.1f} µs/kernel vs eager {base * 1e3 / k:.1f}")]


# -- collectives ---------------------------------------------------------------------------------------------


def check_nccl(n: int) -> list[Row]:
    from dtorch.distributed import InProcessCommunicator, inprocess

    used: list[str] = []
    real = dict(inprocess._NCCL)
    for op, fn in real.items():  # count the calls that took the NCCL path
        inprocess._NCCL[op] = lambda calls, *a, _op=op, _fn=fn: (used.append(_op), _fn(calls, *a))[1]
    comm = InProcessCommunicator(range(n), timeout=60)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4 * n, 64, generator=gen) for _ in range(n)]
    uneven = [torch.randn(3 + i, 64, generator=gen) for i in range(n)]
    numel = (1 << 12) if DEV == "cpu" else (16 << 20) // 4  # 64 MiB of float32 per device for the bandwidth row
    streams = [torch.cuda.Stream(device=i) if DEV == "cuda" else None for i in range(n)]
    results: list = [None] * n

    def body(i: int) -> None:
        if DEV == "cuda":
            torch.cuda.set_device(i)
        with torch.cuda.stream(streams[i]) if DEV == "cuda" else contextlib.nullcontext():
            x, dev = xs[i].to(device(i)), device(i)
            out = {"sum": torch.empty_like(x), "gather": torch.empty(4 * n * n, 64, device=dev),
                   "rs": torch.empty(4, 64, device=dev), "bc": torch.empty_like(x),
                   "uneven": torch.empty(sum(u.shape[0] for u in uneven), 64, device=dev)}
            comm.all_reduce(i, x, out["sum"])
            comm.all_gather(i, x, out["gather"])
            comm.reduce_scatter(i, x, out["rs"])
            comm.broadcast(i, x, out["bc"], src=n - 1)
            comm.all_gather(i, uneven[i].to(dev), out["uneven"])  # uneven pieces: peer copies
            big, big_out = torch.ones(numel, device=dev), torch.empty(numel, device=dev)
            comm.all_reduce(i, big, big_out)
            if DEV == "cuda":
                streams[i].synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                comm.all_reduce(i, big, big_out)
            if DEV == "cuda":
                streams[i].synchronize()
            out["ms"] = (time.perf_counter() - t0) * 1e3 / 5
            results[i] = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in out.items()}

    threads = [threading.Thread(target=body, args=(i,), name=f"{DEV}{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    inprocess._NCCL.update(real)
    if any(t.is_alive() for t in threads) or any(r is None for r in results):
        return [("nccl collectives", f"{DEV} x{n}", "FAIL", None, "a device thread failed or hung")]
    total = torch.stack(xs).sum(0)
    ok = all(close(r["sum"], total) and close(r["gather"], torch.cat(xs)) and close(r["bc"], xs[n - 1])
             and close(r["rs"], total.tensor_split(n)[i]) and close(r["uneven"], torch.cat(uneven))
             for i, r in enumerate(results))
    ms = max(r["ms"] for r in results)
    gbps = 2 * (n - 1) / n * numel * 4 / ms / 1e6 if n > 1 else float("nan")
    note = f"NCCL path: {sorted(set(used))}; {numel * 4 >> 20} MiB all-reduce {gbps:.0f} GB/s bus"
    return [("nccl all_reduce/gather/scatter/bcast", f"{DEV} x{n}", "ok" if ok else "FAIL", ms, note)]


def torchrun_worker(rank: int, port: int, dev: str) -> None:
    """One rank of ``check_torchrun``: the NCCL backend, this rank's own GPU, a tensor-parallel MLP (gloo and a CPU
    in the dry run)."""
    from dtorch.distributed import TorchDistCommunicator, init_process_group
    from dtorch.graph import DeviceMesh, LogicalGraph, Replicate, Shard
    from dtorch.runtime import Runner

    try:
        os.environ["LOCAL_RANK"] = str(rank)
        init_process_group(rank, 2, backend="nccl" if dev == "cuda" else "gloo", port=port, timeout=60)
        mesh = DeviceMesh.distributed(dev)
        if dev == "cuda" and not mesh.device(rank).index == rank == torch.cuda.current_device():
            raise RuntimeError(f"rank {rank} is on {mesh.device(rank)}, current {torch.cuda.current_device()}")
        gen = torch.Generator().manual_seed(0)
        w1, w2 = torch.randn(64, 96, generator=gen), torch.randn(96, 64, generator=gen)
        x = torch.randn(8, 64, generator=gen)
        g = LogicalGraph(mesh)
        y = (g.input("x", (8, 64)) @ g.param("w1", w1, Shard(1))).relu() @ g.param("w2", w2, Shard(0))
        g.output("y", g.redistribute(y, Replicate()))
        with Runner(g, TorchDistCommunicator(), timeout=120) as r:
            got = r.run({"x": x})["y"]
        print("RESULT", "ok" if close(got, torch.relu(x @ w1) @ w2) else "wrong", flush=True)
    except Exception:  # noqa: BLE001 - printed for the parent's table; skip NCCL's teardown either way
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    os._exit(0)


def check_torchrun() -> list[Row]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(port), DEV], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=180)[0])
    except subprocess.TimeoutExpired:
        logs.append("timed out after 180 s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ok = len(logs) == 2 and all("RESULT ok" in log for log in logs)
    backend = "nccl" if DEV == "cuda" else "gloo"
    note = f"each rank on its own {DEV}, {backend} all-reduce" if ok else " | ".join(log[-300:] for log in logs)
    return [(f"torchrun {backend} tp=2 mlp", "2 procs", "ok" if ok else "FAIL", (time.perf_counter() - t0) * 1e3,
             note)]


# -- the table ---------------------------------------------------------------------------------------------------


def checks(n: int) -> list[tuple[str, Callable[[], list[Row]]]]:
    """(name, check) in order; a check returns its rows."""
    out: list[tuple[str, Callable[[], list[Row]]]] = [
        ("runner mlp x1", lambda: check_runner_mlp(1)),
        ("cross-stream x1", lambda: check_cross_stream(1)),
        ("overhead", check_overhead),
        (f"nccl x{n}", lambda: check_nccl(n)),
    ]
    if n > 1:
        out += [("runner mlp x2", lambda: check_runner_mlp(2)), ("cross-stream x2", lambda: check_cross_stream(2)),
                ("torchrun", check_torchrun)]
    out.append(("llm", lambda: llm_rows(DEV, n, small=DEV == "cpu")))
    return out


def main(argv: list[str] | None = None) -> int:
    global QUICK, DEV
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    ap.add_argument("--dry-run", action="store_true", help="every row on 2 CPU devices at tiny sizes")
    ap.add_argument("--out", type=Path, help="also write the table to OUT/device_check.txt")
    ap.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "DEVICE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        torchrun_worker(int(args.worker[0]), int(args.worker[1]), args.worker[2])
    QUICK, DEV = args.quick, "cpu" if args.dry_run else "cuda"
    if DEV == "cuda" and not torch.cuda.is_available():
        print("device_check: no CUDA device visible (torch.cuda.is_available() is False); nothing to check here. "
              "Run it on a machine with a GPU, or with --dry-run.")
        return 0
    n = torch.cuda.device_count() if DEV == "cuda" else 2
    what = torch.cuda.get_device_name(0) if DEV == "cuda" else "CPU device (dry run)"
    print(f"device_check: {n} x {what}, torch {torch.__version__}")
    rows: list[Row] = []
    for name, fn in checks(n):
        try:
            rows += fn()
        except Exception as exc:  # noqa: BLE001 - one failing check is a FAIL row, the others still run
            last = traceback.format_exception_only(type(exc), exc)[-1].strip()
            rows.append((name, "", "FAIL", None, last[:200]))
    width = max(len(r[0]) for r in rows)
    lines = [f"device_check: {n} x {what}, torch {torch.__version__}",
             f"{'check':<{width}}  {'devices':<9} {'result':<6} {'ms':>9}  note"]
    for check, devices, result, ms, note in rows:
        shown = f"{ms:9.2f}" if ms is not None else f"{'-':>9}"
        lines.append(f"{check:<{width}}  {devices:<9} {result:<6} {shown}  {note}")
    failed = [r[0] for r in rows if r[2] == "FAIL"]
    lines.append(f"{len(rows) - len(failed)} ok, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    print("\n".join(lines[1:]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_check.txt").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
