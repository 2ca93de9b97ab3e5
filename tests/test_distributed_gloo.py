"""Two processes with gloo on localhost run the same graph (SPMD) and match torch; a lost rank is an error,
before the first collective or killed while its peer waits in one.

The test starts this file as a script in two subprocesses (``python test_distributed_gloo.py RANK ...``),
bounded by a timeout and always killed at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
B, D, H = 4, 8, 6
TIMEOUT = 90


def build(mesh, seed: int = 0):
    """The MLP (column- then row-parallel) and uneven gathers; identical weights in every process."""
    from dtorch.graph import LogicalGraph, Partial, Replicate, Shard

    gen = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(D, H, generator=gen), torch.randn(H, D, generator=gen)
    g = LogicalGraph(mesh)
    x = g.input("x", (B, D))
    y = (x @ g.param("w1", w1, Shard(1))).relu() @ g.param("w2", w2, Shard(0))
    g.output("y", g.redistribute(y, Replicate()))
    s = g.input("s", (5, 3), placement=Shard(0))  # uneven: 3 rows on rank 0, 2 on rank 1
    g.output("gathered", g.redistribute(s.exp(), Replicate()))
    part = g.redistribute(g.input("p", (5, 3)), Partial())
    g.output("scattered_back", g.redistribute(g.reduce_scatter(part, dim=0), Replicate()))
    g.output("max", g.redistribute(g.redistribute(g.input("m", (5, 3), placement=Shard(0)).exp().tanh(),
                                                  Replicate()), Replicate()))
    return g, w1, w2


def feeds(seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, D, generator=gen), "s": torch.randn(5, 3, generator=gen),
            "p": torch.randn(5, 3, generator=gen), "m": torch.randn(5, 3, generator=gen)}


def worker(rank: int, world: int, port: int, mode: str, out_dir: str) -> None:
    from dtorch.core.errors import CommunicationError
    from dtorch.distributed import TorchDistCommunicator, init_process_group
    from dtorch.graph import DeviceMesh
    from dtorch.runtime import Runner

    init_process_group(rank, world, port=port, timeout=4.0 if mode == "lost" else 60.0)
    if mode == "lost" and rank == 1:
        os._exit(0)  # this rank is lost before the first collective
    if mode == "killed":
        killed_mid_collective(rank, out_dir)
    g, _, _ = build(DeviceMesh.distributed("cpu"))
    runner = Runner(g, TorchDistCommunicator(), timeout=30)
    if mode == "match":
        out = runner.run(feeds())
        out2 = runner.run(feeds())  # the Runner runs many times
        comm, p2p = runner.comm, torch.arange(6.0) * (rank + 1)
        if rank == 0:
            comm.send(0, p2p, dst=1)
        else:
            comm.recv(1, p2p, src=0)
        torch.save({"out": out, "again": out2, "p2p": p2p}, os.path.join(out_dir, f"rank{rank}.pt"))
    else:
        t0 = time.monotonic()
        try:
            runner.run(feeds())
            result = "no error"
        except CommunicationError as exc:
            result = f"CommunicationError after {time.monotonic() - t0:.1f}s: {exc}"
        Path(out_dir, f"rank{rank}.txt").write_text(result)
    runner.shutdown()
    os._exit(0)  # skip gloo's teardown, which may wait on the lost peer


def killed_mid_collective(rank: int, out_dir: str) -> None:
    """Rank 1 stalls in a Python kernel until the test kills it; rank 0 waits in the all-reduce after it. The
    group's timeout (60 s) is far above the bound, so only the closed connection can end rank 0's wait in time."""
    from dtorch.core.errors import CommunicationError
    from dtorch.distributed import TorchDistCommunicator
    from dtorch.graph import DeviceMesh, LogicalGraph, Partial, Replicate
    from dtorch.runtime import Runner

    def stall(t: torch.Tensor) -> torch.Tensor:
        if rank == 1:
            Path(out_dir, "rank1.ready").touch()
            time.sleep(120)
        return t * 2

    g = LogicalGraph(DeviceMesh.distributed("cpu"))
    y = g.python(stall, g.input("x", (4, 3)), shape=(4, 3), dtype=torch.float32, placement=Partial())
    g.output("y", g.redistribute(y, Replicate()))  # the all-reduce
    runner = Runner(g, TorchDistCommunicator(), timeout=90)
    try:
        runner.run({"x": torch.ones(4, 3)})
        result = "no error"
    except CommunicationError as exc:
        result = f"CommunicationError at {time.time():.3f}: {exc}"
    Path(out_dir, f"rank{rank}.txt").write_text(result)
    runner.shutdown()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, tmp_path: Path, during: Callable[[list[subprocess.Popen]], None] | None = None) -> list:
    """Run both ranks to the end within TIMEOUT (``during(procs)`` runs meanwhile); [(returncode, output)]."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(port), mode, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    deadline = time.monotonic() + TIMEOUT
    try:
        if during is not None:
            during(procs)
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        pytest.fail(f"gloo processes did not finish within {TIMEOUT}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return logs


def test_two_gloo_processes_run_the_same_graph_and_match(tmp_path):
    logs = _launch("match", tmp_path)
    assert all(rc == 0 for rc, _ in logs), logs
    _, w1, w2 = build(__import__("dtorch").DeviceMesh.cpu(1))
    f = feeds()
    ref = {"y": torch.relu(f["x"] @ w1) @ w2, "gathered": f["s"].exp(), "scattered_back": f["p"],
           "max": f["m"].exp().tanh()}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["p2p"], torch.arange(6.0))  # rank 1 received rank 0's tensor
        for key in ("out", "again"):
            assert set(got[key]) == set(ref)
            for name, want in ref.items():
                torch.testing.assert_close(got[key][name], want, rtol=1e-4, atol=1e-5)


def test_lost_rank_raises_communication_error_within_the_timeout(tmp_path):
    logs = _launch("lost", tmp_path)
    assert all(rc == 0 for rc, _ in logs), logs
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("CommunicationError"), text
    seconds = float(text.split("after ")[1].split("s")[0])
    assert seconds < 15, text


def test_rank_killed_mid_collective_raises_communication_error_on_its_peer(tmp_path):
    killed_at: list[float] = []

    def kill_rank1_once_it_stalls(procs: list[subprocess.Popen]) -> None:
        ready, deadline = tmp_path / "rank1.ready", time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and procs[1].poll() is None, "rank 1 never reached its stall"
            time.sleep(0.05)
        time.sleep(1.0)  # rank 0 is in the all-reduce by now
        procs[1].send_signal(signal.SIGKILL)
        killed_at.append(time.time())

    logs = _launch("killed", tmp_path, during=kill_rank1_once_it_stalls)
    assert logs[0][0] == 0, logs
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("CommunicationError"), text
    assert "all_reduce on rank 0 of 2 failed: rank 1 was lost" in text, text
    seconds = float(text.split("at ")[1].split(":")[0]) - killed_at[0]
    assert seconds < 10, text  # the closed connection, not the group's 60 s timeout


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
