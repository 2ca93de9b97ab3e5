"""InProcessCommunicator called directly from one thread per device, against torch on the full tensors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dtorch
from dtorch.distributed import InProcessCommunicator
from dtorch.graph import shard_sizes
from tests.threads import every_collective, on_devices


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_match_torch(n):
    comm = InProcessCommunicator(range(n), timeout=10)
    xs = [torch.randn(5, 4) for _ in range(n)]
    total, biggest = torch.stack(xs).sum(0), torch.stack(xs).amax(0)
    rows = shard_sizes(5, n)

    results = on_devices(n, lambda i: every_collective(comm, i, xs[i], 5 * n, rows[i], n - 1))
    for i, r in enumerate(results):
        assert isinstance(r, dict), r
        torch.testing.assert_close(r["sum"], total)
        torch.testing.assert_close(r["max"], biggest)
        torch.testing.assert_close(r["gather"], torch.cat(xs))
        torch.testing.assert_close(r["rs"], torch.tensor_split(total, n)[i])
        torch.testing.assert_close(r["bc"], xs[n - 1])


def test_uneven_all_gather_along_dim_1():
    comm = InProcessCommunicator([0, 1], timeout=10)
    pieces = [torch.randn(3, 4), torch.randn(3, 3)]
    results = on_devices(2, lambda i: (comm.all_gather(i, pieces[i], out := torch.empty(3, 7), dim=1), out)[1])
    for r in results:
        torch.testing.assert_close(r, torch.cat(pieces, dim=1))


def test_send_recv():
    comm = InProcessCommunicator([0, 1], timeout=10)
    x = torch.randn(6)

    def step(i: int):
        if i == 0:
            comm.send(0, x, dst=1)
            return None
        out = torch.empty(6)
        comm.recv(1, out, src=0)
        return out

    torch.testing.assert_close(on_devices(2, step)[1], x)


def test_mismatched_collectives_are_an_error_not_a_hang():
    comm = InProcessCommunicator([0, 1], timeout=10)

    def step(i: int):
        out = torch.empty(2)
        if i == 0:
            comm.all_reduce(0, torch.ones(2), out)
        else:
            comm.broadcast(1, torch.ones(2), out, src=0)

    results = on_devices(2, step)
    assert all(isinstance(r, dtorch.CommunicationError) for r in results)
    assert "different collectives" in str(results[0])


def test_missing_peer_times_out_and_abort_wakes_waiters():
    comm = InProcessCommunicator([0, 1], timeout=0.2)
    t0 = time.perf_counter()
    with pytest.raises(dtorch.CommunicationError, match="did not arrive"):
        comm.all_reduce(0, torch.ones(2), torch.empty(2))
    assert time.perf_counter() - t0 < 2
    comm.reset()
    slow = InProcessCommunicator([0, 1], timeout=30)
    threading.Timer(0.1, slow.abort).start()
    with pytest.raises(dtorch.CommunicationError, match="aborted"):
        slow.all_reduce(0, torch.ones(2), torch.empty(2))
    slow.reset()
    results = on_devices(2, lambda i: (slow.all_reduce(i, torch.ones(2), o := torch.empty(2)), o)[1])
    torch.testing.assert_close(results[0], torch.full((2,), 2.0))


def test_bad_arguments():
    comm = InProcessCommunicator([0, 1])
    with pytest.raises(dtorch.DeviceError, match="device 5"):
        comm.all_reduce(5, torch.ones(1), torch.empty(1))
    with pytest.raises(dtorch.ArgumentError, match="reduction"):
        comm.all_reduce(0, torch.ones(1), torch.empty(1), op="prod")
