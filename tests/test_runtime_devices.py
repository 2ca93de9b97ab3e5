"""The runtime's GPU rules, checked on CPU through fakes: placement of every piece on its device, waits on
device work, cross-stream frees, NCCL collectives, the local GPU of a torchrun rank, lost-peer messages.

Each fake stands where only a GPU would differ (a device whose tensors are "meta", a stream whose events
complete later, a recording ``record_stream``, a CPU NCCL); the real CUDA path runs in ``bench/device_check.py``.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

import dtorch
from dtorch.core.device import Device
from dtorch.distributed import inprocess
from dtorch.graph import DeviceMesh, LogicalGraph, Partial, Replicate, Shard
from dtorch.runtime import DistTensor, Event, KernelStream, Runner, StreamManager, StreamType, blob, stream
from tests.threads import every_collective, on_devices


def kind_of(t: torch.Tensor) -> str:
    return t.device.type


@pytest.fixture
def cpu1_is_meta(monkeypatch):
    """Device cpu:1 keeps its tensors on "meta": a piece not moved there stays a CPU tensor and shows."""
    real = Device.torch

    def torch_device(d: Device) -> torch.device:
        return torch.device("meta") if (d.type, d.index) == ("cpu", 1) else real.fget(d)

    monkeypatch.setattr(Device, "torch", property(torch_device))


# -- 1. every piece on its device ------------------------------------------------------------------


def test_params_feeds_and_replicate_aliases_are_placed_on_each_device(cpu1_is_meta):
    w_full, b_full, x_full = torch.randn(3, 3), torch.randn(4, 3), torch.randn(4, 3)
    g = LogicalGraph(DeviceMesh.cpu(2))
    x = g.input("x", (4, 3), placement=Shard(0))
    p = g.input("p", (4, 3), placement=Partial())
    w = g.param("w", w_full, Replicate())
    b = g.param("b", b_full, Shard(0))
    y = g.python(lambda x, w, b: x @ w + b, x, w, b, placement=Shard(0))
    z = g.python(lambda p: p * 2, p, placement=Partial())
    g.output("y", y)
    g.output("z", z)
    with Runner(g, release=False) as r:
        assert r.blobs[(w.index, 0)].tensor is w_full  # the Replicate piece on the value's own device aliases it
        assert kind_of(r.blobs[(w.index, 1)].tensor) == "meta"  # and is copied to the other device once
        assert [kind_of(r.blobs[(b.index, i)].tensor) for i in (0, 1)] == ["cpu", "meta"]
        out = r.run({"x": x_full, "p": x_full}, return_dist=True)
        for operand in (x, p):
            assert [kind_of(r.blobs[(operand.index, i)].tensor) for i in (0, 1)] == ["cpu", "meta"]
    assert [kind_of(out["y"].local(i)) for i in (0, 1)] == ["cpu", "meta"]
    torch.testing.assert_close(out["y"].local(0), x_full[:2] @ w_full + b_full[:2])
    torch.testing.assert_close(out["z"].local(0), x_full * 2)  # Partial "sum": the full tensor on rank 0


def test_dist_tensor_pieces_live_on_their_devices(cpu1_is_meta):
    mesh = DeviceMesh.cpu(2)
    t = torch.randn(4, 2)
    for placement in (Replicate(), Shard(0), Partial()):
        dt = DistTensor.from_full(t, mesh, placement)
        assert [kind_of(dt.local(i)) for i in (0, 1)] == ["cpu", "meta"], placement
    dt = DistTensor.from_local([t[:2], t[2:]], mesh, Shard(0))
    assert [kind_of(dt.local(i)) for i in (0, 1)] == ["cpu", "meta"]


# -- 2. synchronization waits for the device ------------------------------------------------------------


class FakeDeviceEvent:
    """A device event that completes on its ``ready_after``-th query (never, for None)."""

    def __init__(self, ready_after: int | None, name: str = "") -> None:
        self.ready_after, self.polls, self.name = ready_after, 0, name

    def query(self) -> bool:
        self.polls += 1
        return self.ready_after is not None and self.polls >= self.ready_after


class FakeDeviceStream(KernelStream):
    """A CPU stream with the device hooks of a GPU stream: its events finish on the device later."""

    ready_after: int | None = 3
    log: list = []  # (stream name, what) in the order the stream threads saw it

    def _record_device(self, event: Event) -> None:
        event.device_event = FakeDeviceEvent(self.ready_after, "sync point")
        FakeDeviceStream.log.append((self.name, "record", event.device_event))

    def _wait_device(self, event: Event) -> None:
        FakeDeviceStream.log.append((self.name, "wait", event.device_event.name))

    def caller_event(self) -> Event | None:
        ev = Event()
        ev.device_event = FakeDeviceEvent(1, "caller")
        ev.flag.set()
        return ev


@pytest.fixture
def fake_device_streams(monkeypatch):
    monkeypatch.setitem(stream.STREAM_CLASSES, "cpu", FakeDeviceStream)
    monkeypatch.setattr(FakeDeviceStream, "log", [])
    return FakeDeviceStream


def test_synchronize_polls_the_device_event_until_done(fake_device_streams):
    mgr = StreamManager(1)
    try:
        streams = [mgr.stream(Device("cpu", 0), t) for t in StreamType]
        mgr.synchronize(5.0)
        events = [ev for _, what, ev in fake_device_streams.log if what == "record"]
        assert len(events) == len(streams) and all(ev.polls == 3 for ev in events)
        assert streams[0].synchronize(5.0)  # one stream alone waits for its device as well
        assert fake_device_streams.log[-1][2].polls == 3
    finally:
        mgr.shutdown()


def test_device_work_past_the_timeout_is_a_sync_timeout(fake_device_streams, monkeypatch):
    monkeypatch.setattr(FakeDeviceStream, "ready_after", None)
    mgr = StreamManager(1)
    try:
        s = mgr.stream(Device("cpu", 0), StreamType.COMPUTE)
        t0 = time.monotonic()
        with pytest.raises(dtorch.SyncTimeout, match="device still running enqueued kernels on cpu:0/compute"):
            mgr.synchronize(0.3)
        assert time.monotonic() - t0 < 3
        assert not s.synchronize(0.2)
    finally:
        mgr.shutdown()


def test_run_waits_for_the_callers_copies_first_and_for_the_device_last(fake_device_streams):
    g = LogicalGraph(DeviceMesh.cpu(2))
    log = fake_device_streams.log

    def kernel(t: torch.Tensor) -> torch.Tensor:
        log.append((threading.current_thread().name.removeprefix("dtorch-"), "kernel", None))
        return t + 1

    y = g.python(kernel, g.input("x", (2, 2)), shape=(2, 2), dtype=torch.float32, placement=Partial())
    g.output("y", g.redistribute(y, Replicate()))
    with Runner(g) as r:
        log.clear()
        torch.testing.assert_close(r.run({"x": torch.zeros(2, 2)})["y"], torch.full((2, 2), 2.0))
        for i in (0, 1):
            mine = [(what, ev) for name, what, ev in log if name == f"cpu:{i}/compute"]
            first_kernel = mine.index(("kernel", None))
            assert ("wait", "caller") in mine[:first_kernel], mine  # the feed copies come first
        for s in r.manager.streams:  # each stream's last event is the final synchronize's
            last = [ev for name, what, ev in log if name == s.name and what == "record"][-1]
            assert last.polls == 3, s.name  # run() returned after the device finished


# -- 3. cross-stream frees -------------------------------------------------------------------------------


def test_blobs_read_on_another_stream_record_the_readers_stream(monkeypatch):
    recorded: list[tuple[str, tuple[int, ...]]] = []
    monkeypatch.setattr(blob, "_on_gpu", lambda t: True)
    monkeypatch.setattr(blob, "_current_stream", lambda t: threading.current_thread().name.rpartition("/")[2])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((s, tuple(t.shape))))
    ws = [torch.randn(8, 6), torch.randn(6, 5), torch.randn(5, 2)]
    x = torch.randn(4, 8)
    g = LogicalGraph(DeviceMesh.cpu(2))
    h = (g.input("x", (4, 8)) @ g.param("w1", ws[0], Shard(1))).relu()  # [4, 3] per device, on compute
    s = g.redistribute(h @ g.param("w2", ws[1], Shard(0)), Replicate())  # [4, 5]: all-reduce on communicate
    g.output("u", g.input("u", (2, 2)).exp())  # an independent kernel beside it: the all-reduce has one to overlap
    g.output("y", s @ g.param("w3", ws[2], Replicate()))
    with Runner(g) as r:
        got = r.run({"x": x, "u": torch.ones(2, 2)})["y"]
    torch.testing.assert_close(got, torch.relu(x @ ws[0]) @ ws[1] @ ws[2], rtol=1e-4, atol=1e-5)
    seen = set(recorded)
    assert ("communicate", (4, 5)) in seen  # the partial sums, written on compute, read by the all-reduce
    assert ("compute", (4, 5)) in seen  # the all-reduce's result, read back on compute
    assert ("compute", (4, 8)) in seen  # the feed, written by the caller
    assert ("MainThread", (4, 2)) in seen  # the result handed to the caller
    assert not any(shape == (4, 3) for _, shape in seen)  # read on the stream that wrote it: nothing to record


# -- 4. in-process collectives through NCCL ---------------------------------------------------------------


class FakeNccl:
    """torch.cuda.nccl's semantics on CPU tensors; records which collectives ran on which streams."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []

    def is_available(self, tensors: list[torch.Tensor]) -> bool:
        return all(t.is_contiguous() for t in tensors)

    @staticmethod
    def _reduce(ts: list[torch.Tensor], op: int) -> torch.Tensor:
        stacked = torch.stack(ts)
        return {0: stacked.sum(0), 2: stacked.amax(0)}[op]

    def all_reduce(self, inputs, outputs, op, streams):
        self.calls.append((f"all_reduce/{op}", streams))
        red = self._reduce(inputs, op)
        for o in outputs:
            o.copy_(red)

    def all_gather(self, inputs, outputs, streams):
        self.calls.append(("all_gather", streams))
        flat = torch.cat([t.reshape(-1) for t in inputs])
        for o in outputs:
            o.view(-1).copy_(flat)

    def reduce_scatter(self, inputs, outputs, op, streams):
        self.calls.append((f"reduce_scatter/{op}", streams))
        for o, piece in zip(outputs, self._reduce(inputs, op).reshape(-1).chunk(len(outputs)), strict=True):
            o.view(-1).copy_(piece)

    def broadcast(self, inputs, root, streams):
        self.calls.append((f"broadcast/{root}", streams))
        for t in inputs:
            t.copy_(inputs[root])


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_go_through_nccl_on_each_devices_stream(monkeypatch, n):
    fake = FakeNccl()
    monkeypatch.setattr(inprocess, "nccl", fake)
    monkeypatch.setattr(inprocess, "NCCL_BUILT", True)
    monkeypatch.setattr(inprocess, "_stream_of", lambda t: threading.current_thread().name)
    comm = inprocess.InProcessCommunicator(range(n), timeout=10)
    xs = [torch.randn(2 * n, 3) for _ in range(n)]
    total = torch.stack(xs).sum(0)

    for i, res in enumerate(on_devices(n, lambda i: every_collective(comm, i, xs[i], 2 * n * n, 2, n - 1))):
        assert isinstance(res, dict), res
        torch.testing.assert_close(res["sum"], total)
        torch.testing.assert_close(res["max"], torch.stack(xs).amax(0))
        torch.testing.assert_close(res["gather"], torch.cat(xs))
        torch.testing.assert_close(res["rs"], total.tensor_split(n)[i])
        torch.testing.assert_close(res["bc"], xs[n - 1])
    streams = [f"dev{i}" for i in range(n)]
    assert fake.calls == [(what, streams) for what in ("all_reduce/0", "all_reduce/2", "all_gather",
                                                       "reduce_scatter/0", f"broadcast/{n - 1}")]


def test_layouts_nccl_cannot_take_use_peer_copies(monkeypatch):
    fake = FakeNccl()
    monkeypatch.setattr(inprocess, "nccl", fake)
    monkeypatch.setattr(inprocess, "NCCL_BUILT", True)
    monkeypatch.setattr(inprocess, "_stream_of", lambda t: threading.current_thread().name)
    comm = inprocess.InProcessCommunicator([0, 1], timeout=10)
    pieces = [torch.randn(3, 4), torch.randn(2, 4)]
    xs = [torch.randn(5, 3), torch.randn(5, 3)]

    def step(i: int) -> tuple:
        uneven, along1, rs = torch.empty(5, 4), torch.empty(5, 6), torch.empty(3 - i, 3)
        comm.all_gather(i, pieces[i], uneven, dim=0)
        comm.all_gather(i, xs[i], along1, dim=-1)
        comm.reduce_scatter(i, xs[i], rs, dim=0)  # 5 rows over 2 devices
        return uneven, along1, rs

    results = on_devices(2, step)
    assert fake.calls == []
    for i, (uneven, along1, rs) in enumerate(results):
        torch.testing.assert_close(uneven, torch.cat(pieces))
        torch.testing.assert_close(along1, torch.cat(xs, dim=1))
        torch.testing.assert_close(rs, (xs[0] + xs[1]).tensor_split(2)[i])


# -- 5. a torchrun rank's own GPU -------------------------------------------------------------------------


@pytest.fixture
def fake_world(monkeypatch):
    """A torch.distributed world of 8 ranks, this one rank 5, on machines with 4 GPUs each."""
    import torch.distributed as dist

    chosen: list[int] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 5)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return chosen


def test_distributed_cuda_mesh_maps_a_rank_to_its_local_gpu(fake_world, monkeypatch):
    mesh = DeviceMesh.distributed("cuda")
    assert mesh.device(5) == Device("cuda", 1) and fake_world == [1]  # rank % GPUs without torchrun
    assert mesh.submesh(0, 5).device(5) == Device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert DeviceMesh.distributed("cuda").device(5) == Device("cuda", 3) and fake_world == [1, 3]
    monkeypatch.setenv("LOCAL_RANK", "7")
    with pytest.raises(dtorch.DeviceError, match="LOCAL_RANK='7'.*4 GPU"):
        DeviceMesh.distributed("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(dtorch.DeviceError, match="sees no GPU"):
        DeviceMesh.distributed("cuda")
    assert DeviceMesh.distributed("cpu").device(5) == Device("cpu", 0) and fake_world == [1, 3]


# -- 6. torch.distributed: the group's timeout and lost peers -------------------------------------------------


def test_communicator_keeps_the_groups_timeout_and_reads_torchruns_variables(monkeypatch):
    import torch.distributed as dist

    from dtorch.distributed import TorchDistCommunicator, init_process_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    init_process_group(port=port, timeout=7)
    try:
        comm = TorchDistCommunicator()
        assert comm.timeout == 7 and comm.ids == (0,)
        out = torch.empty(3)
        comm.all_reduce(0, torch.ones(3), out)
        torch.testing.assert_close(out, torch.ones(3))
    finally:
        dist.destroy_process_group()
    with pytest.raises(dtorch.ArgumentError, match="timeout must be > 0"):
        init_process_group(port=port, timeout=0)


@pytest.mark.parametrize(("raised", "peer", "expected"), [
    ("[pair.cc:553] Connection closed by peer [127.0.0.1]:49363", None,
     "all_reduce on rank 0 of 2 failed: rank 1 was lost: its connection closed"),
    ("Timed out waiting 4000ms for recv operation to complete", None,
     "all_reduce on rank 0 of 2 failed: rank 1 did not answer within 4s"),
    ("Connection reset by peer", 1, "recv on rank 0 of 2 failed: rank 1 was lost"),
])
def test_gloo_failures_name_the_op_and_the_peer(raised, peer, expected):
    from dtorch.distributed import TorchDistCommunicator

    comm = TorchDistCommunicator.__new__(TorchDistCommunicator)  # the fields a process group would give
    comm.process, comm.ids, comm.timeout, comm.pg = 0, (0, 1), 4.0, None

    def fail() -> None:
        raise RuntimeError(raised)

    with pytest.raises(dtorch.CommunicationError) as info:
        comm._do("recv" if peer is not None else "all_reduce", fail, peer=peer)
    assert expected in str(info.value) and raised in str(info.value)
