"""Gloo ranks of one host talk through shared memory (``dtorch.distributed.shm``): each collective equals torch's
result over every rank's tensor, the same bits on every rank, in one group of 4 ranks and its sub-groups of 2 and 3,
sizes past a buffer and a send ring included; ranks on two (faked) hosts keep gloo between the hosts and shared memory
within each; with ``DTORCH_SHM_COMM=0`` gloo carries it and agrees; no segment is left in /dev/shm; a killed peer is
a ``CommunicationError`` naming it within a second or so.

The test starts this file as a script in each rank's process (``python test_distributed_shm.py RANK ...``), bounded
by a timeout and always killed at the end.
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 90
# the sub-groups each mode's 4 ranks make: "match" one host; "hosts" two (ranks 0, 1 on one and 2, 3 on the other)
GROUPS = {"match": {"pair": (1, 3), "three": (0, 1, 2)}, "hosts": {"first": (0, 1), "second": (2, 3)}}
BIG = (1 << 18) + 77  # floats: ~1 MiB + a tail, past one buffer (several rounds) and past a send ring
pytestmark = pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                                reason="shared-memory collectives are Linux on x86-64 only (gloo elsewhere)")


def tensors(rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` contributes (any rank can make any rank's: the test's reference needs all of them)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return {"small": torch.randn(3, 7, generator=gen), "big": torch.randn(BIG, generator=gen),
            "piece": torch.randn(5 + (rank < 2), 4, generator=gen),  # uneven pieces along dim 0 (11 rows over 2)
            "wide": torch.randn(2, (BIG // 2) // 3 + rank, generator=gen)}  # gathered along dim 1, past a buffer


def run_rank(rank: int, world: int, port: int, mode: str, out_dir: str) -> None:
    from dtorch.core.errors import CommunicationError
    from dtorch.distributed import TorchDistCommunicator, init_process_group

    if mode == "hosts":
        socket.gethostname = lambda: f"host{rank // 2}"
    init_process_group(rank, world, port=port, timeout=60.0)
    comm = TorchDistCommunicator()
    if mode == "killed":
        Path(out_dir, f"ready{rank}").touch()
        if rank == 1:
            time.sleep(120)  # killed by the test meanwhile
        t0 = time.monotonic()
        try:
            comm.all_reduce(rank, torch.ones(4), torch.empty(4))
            text = "no error"
        except CommunicationError as exc:
            text = f"CommunicationError after {time.monotonic() - t0:.2f}s: {exc}"
        Path(out_dir, "rank0.txt").write_text(text)
        os._exit(0)
    results = {"shm": comm.shm is not None and comm.shm.whole}
    wanted = {"world": tuple(range(world))} | (GROUPS[mode] if world == 4 else {})
    # every rank asks for each sub-group, in the same order (a rank outside one gets the world's communicator)
    groups = {name: comm.group(ids) for name, ids in wanted.items()}
    for name, g in groups.items():
        if rank not in wanted[name]:
            continue
        results[f"shm.{name}"] = g.shm is not None and g.shm.whole
        pos, n = g.ids.index(rank), len(g.ids)
        mine = tensors(rank)
        r = {}
        for key in ("small", "big"):
            out = torch.empty_like(mine[key])
            g.all_reduce(rank, mine[key], out)
            r[f"sum.{key}"] = out
        out = torch.empty_like(mine["small"])
        g.all_reduce(rank, mine["small"], out, op="max")
        r["max"] = out
        rows = sum(tensors(i)["piece"].shape[0] for i in g.ids)
        sizes = [rows // n + (j < rows % n) for j in range(n)]
        piece = torch.randn(sizes[pos], 4, generator=torch.Generator().manual_seed(7 + rank))
        out = torch.empty(rows, 4)
        g.all_gather(rank, piece, out, dim=0)
        r["gather0"] = out
        wide = tensors(rank)["wide"][:, : (BIG // 2) // 3]  # equal pieces along dim 1, each past a buffer's half
        out = torch.empty(2, wide.shape[1] * n)
        g.all_gather(rank, wide.contiguous(), out, dim=1)
        r["gather1"] = out
        out = torch.empty_like(mine["big"])
        g.broadcast(rank, mine["big"], out, src=g.ids[-1])
        r["broadcast"] = out
        out = torch.empty(7 // n + (pos < 7 % n), 5)
        g.reduce_scatter(rank, torch.full((7, 5), float(rank + 1)), out, dim=0)
        r["scatter"] = out
        results[name] = r
    # sends: rank r to r + 1 (a message past the ring), even ranks send first so that nothing waits in a circle
    msg = torch.arange(BIG, dtype=torch.float32) * (rank + 1)
    got = torch.empty(BIG)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    for step in (0, 1) if rank % 2 == 0 else (1, 0):
        comm.send(rank, msg, nxt) if step == 0 else comm.recv(rank, got, prev)
    results["recv"] = got
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, mode: str, tmp_path: Path, shm: bool = True, kill: bool = False) -> list:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DTORCH_SHM_COMM="1" if shm else "0")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port), mode, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline, logs = time.monotonic() + TIMEOUT, []
    try:
        if kill:
            while not all((tmp_path / f"ready{r}").exists() for r in range(world)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ranks never got ready"
                time.sleep(0.05)
            time.sleep(0.5)  # rank 0 waits in the all-reduce by now
            procs[1].kill()
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks did not finish within {TIMEOUT}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not [f for p in procs for f in glob.glob(f"/dev/shm/dtorch-comm-{p.pid}-*")], "a segment was left behind"
    return logs


def _reference(ids: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """torch over every rank's tensor of the group ``ids``; sums in rank order (as every rank takes them)."""
    ts = [tensors(i) for i in ids]
    n = len(ids)
    total = {key: ts[0][key].clone() for key in ("small", "big")}
    for t in ts[1:]:
        for key in total:
            total[key] = total[key] + t[key]
    rows = sum(tensors(i)["piece"].shape[0] for i in ids)
    sizes = [rows // n + (j < rows % n) for j in range(n)]
    gather0 = torch.cat([torch.randn(sizes[j], 4, generator=torch.Generator().manual_seed(7 + i))
                         for j, i in enumerate(ids)])
    gather1 = torch.cat([t["wide"][:, : (BIG // 2) // 3] for t in ts], dim=1)
    return {"sum.small": total["small"], "sum.big": total["big"], "gather0": gather0, "gather1": gather1,
            "max": torch.stack([t["small"] for t in ts]).amax(0), "broadcast": ts[-1]["big"],
            "scatter": torch.full((7, 5), float(sum(i + 1 for i in ids)))}


def _check(world: int, tmp_path: Path, exact: bool, mode: str = "match") -> list[dict]:
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    groups = {"world": tuple(range(world))} | (GROUPS[mode] if world == 4 else {})
    for name, ids in groups.items():
        exact_here = exact and (all(got[r][f"shm.{name}"] for r in ids) or len(ids) == 2)
        want = _reference(ids)
        n = len(ids)
        for pos, r in enumerate(ids):
            for key, value in want.items():
                if key == "scatter":
                    value = value.tensor_split(n)[pos]
                if exact_here:  # shared memory: sums in rank order, the same bits as torch's in that order (2 ranks
                    # through gloo too: a + b is b + a)
                    assert torch.equal(got[r][name][key], value), (name, key, r)
                else:
                    torch.testing.assert_close(got[r][name][key], value, rtol=1e-5, atol=1e-5)
            for key in set(want) - {"scatter"}:  # (a scatter's pieces differ by design)
                assert torch.equal(got[r][name][key], got[ids[0]][name][key]), (name, key)  # bit-equal on every rank
    for r in range(world):  # rank r got rank r - 1's message
        torch.testing.assert_close(got[r]["recv"], torch.arange(BIG, dtype=torch.float32) * ((r - 1) % world + 1))
    return got


def test_collectives_in_shared_memory_equal_torch_in_a_group_of_four_and_its_sub_groups(tmp_path):
    logs = _launch(4, "match", tmp_path)
    assert all(rc == 0 for rc, _ in logs), logs
    got = _check(4, tmp_path, exact=True)
    assert all(g["shm"] for g in got)


def test_ranks_on_two_hosts_keep_gloo_between_them_and_shared_memory_within_each(tmp_path):
    logs = _launch(4, "hosts", tmp_path)  # each rank's hostname is faked: host0 for ranks 0, 1, host1 for 2, 3
    assert all(rc == 0 for rc, _ in logs), logs
    got = _check(4, tmp_path, exact=True, mode="hosts")  # sends 0 -> 1 and 2 -> 3 in shared memory, the others gloo
    assert not any(g["shm"] for g in got)  # the world spans both hosts: gloo
    assert got[0]["shm.first"] and got[1]["shm.first"] and got[2]["shm.second"] and got[3]["shm.second"]


def test_with_shared_memory_off_gloo_carries_the_same_collectives(tmp_path):
    logs = _launch(2, "match", tmp_path, shm=False)
    assert all(rc == 0 for rc, _ in logs), logs
    got = _check(2, tmp_path, exact=True)  # two ranks: a + b is b + a, so gloo's sums are the same bits too
    assert not any(g["shm"] for g in got)


def test_a_killed_peer_ends_a_wait_in_shared_memory_at_once(tmp_path):
    logs = _launch(2, "killed", tmp_path, kill=True)
    assert logs[0][0] == 0, logs
    text = (tmp_path / "rank0.txt").read_text()
    assert text.startswith("CommunicationError"), text
    assert "all_reduce on rank 0 of 2 failed: rank 1 was lost: its connection closed" in text, text
    assert float(text.split("after ")[1].split("s")[0]) < 5, text  # not the group's 60 s timeout


def test_the_flag_turns_it_off_and_a_bad_value_is_named(monkeypatch):
    from dtorch.core.errors import ConfigError
    from dtorch.distributed import shm

    monkeypatch.setenv("DTORCH_SHM_COMM", "0")
    assert shm.unsupported() == "DTORCH_SHM_COMM is off"
    monkeypatch.setenv("DTORCH_SHM_COMM", "sometimes")
    with pytest.raises(ConfigError, match="DTORCH_SHM_COMM='sometimes' is not a flag"):
        shm.unsupported()


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
