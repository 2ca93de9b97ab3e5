"""Streams, events, Python kernels, faults, timeouts, threads, memory release, DistTensor."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import dtorch
from dtorch.core.device import Device
from dtorch.core.memory import MemoryKind, memory
from dtorch.graph import DeviceMesh, LogicalGraph, Partial, Replicate, Shard
from dtorch.runtime import DispatchKernel, DistTensor, KernelStream, Runner, StreamManager, StreamType


def dtorch_threads() -> list[threading.Thread]:
    gc.collect()  # models and runners that earlier tests dropped stop their streams when collected
    return [t for t in threading.enumerate() if t.name.startswith("dtorch-")]


class _Item:
    """A stream item running ``fn``."""

    def __init__(self, fn, label="item"):
        self.fn, self.label = fn, label

    def execute(self, stream, state):
        self.fn()


# -- streams -------------------------------------------------------------------------------------


def test_push_returns_at_once_and_synchronize_waits():
    s = KernelStream(Device("cpu", 0), StreamType.COMPUTE)
    done = []
    t0 = time.perf_counter()
    s.push(_Item(lambda: (time.sleep(0.2), done.append(1))))
    assert time.perf_counter() - t0 < 0.1 and not done
    assert s.synchronize(5.0) and done == [1]
    assert s.close()


@pytest.mark.skipif(not hasattr(__import__("signal"), "pthread_sigmask"), reason="POSIX signal masks")
def test_stream_threads_leave_ctrl_c_and_sigterm_to_the_main_thread():
    """A Ctrl-C the kernel delivered to a stream thread would wait for the main thread's next bytecode (never, in a
    blocking input() or select()): the stream threads block SIGINT and SIGTERM, the main thread does not."""
    import signal

    s = KernelStream(Device("cpu", 0), StreamType.COMPUTE)
    seen = []
    s.push(_Item(lambda: seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))))
    assert s.synchronize(5.0) and s.close()
    assert {signal.SIGINT, signal.SIGTERM} <= seen[0]
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_events_order_work_across_streams_without_blocking_the_host():
    mgr = StreamManager(1)
    comp = mgr.stream(Device("cpu", 0), StreamType.COMPUTE)
    comm = mgr.stream(Device("cpu", 0), StreamType.COMMUNICATE)
    assert mgr.stream(Device("cpu", 0), StreamType.COMPUTE) is comp  # one per (device, type)
    log = []
    comp.push(_Item(lambda: (time.sleep(0.1), log.append("produce"))))
    ev = comp.record()
    comm.wait(ev)
    comm.push(_Item(lambda: log.append("consume")))
    comm.push(_Item(lambda: log.append("consume2")))
    assert log == []  # nothing above blocked the host
    mgr.synchronize(5.0)
    assert log == ["produce", "consume", "consume2"]
    mgr.shutdown()
    assert not dtorch_threads()


@pytest.mark.parametrize("n", [1, 2])
def test_compute_then_communicate_then_compute_order(n):
    # slow compute -> all-reduce on the communicate stream (beside an independent kernel, so that it has something to
    # overlap) -> compute reading the result
    x = torch.randn(4, 3)
    g = LogicalGraph(DeviceMesh.cpu(n))
    xi = g.input("x", (4, 3))
    slow = g.python(lambda t: (time.sleep(0.05), t * 3)[1], xi, placement=Partial())
    assert slow.placement == Partial()
    summed = g.redistribute(slow, Replicate())  # all-reduce waits for the slow kernel via an event
    g.output("z", xi.exp())
    g.output("y", summed + 1.0)
    with Runner(g) as r:
        kinds = [(k.operator.op, k.stream.type) for k in r.kernels]
        assert (("all_reduce", StreamType.COMMUNICATE) in kinds) == (n > 1)  # one device: nothing to reduce
        torch.testing.assert_close(r.run({"x": x})["y"], x * 3 * n + 1)


def test_python_kernel_runs_on_local_pieces():
    x = torch.randn(5, 4)
    g = LogicalGraph(DeviceMesh.cpu(2))
    seen = []
    xs = g.input("x", (5, 4), placement=Shard(0))

    def softmax_rows(t: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return torch.softmax(t, dim=-1)

    y = g.python(softmax_rows, xs)
    assert y.placement == Shard(0) and y.shape == (5, 4)
    g.output("y", y)
    with Runner(g) as r:
        seen.clear()
        torch.testing.assert_close(r.run({"x": x})["y"], torch.softmax(x, -1))
    assert sorted(seen) == [(2, 4), (3, 4)]


def test_kernels_are_bound_once_through_the_dispatcher():
    g = LogicalGraph(DeviceMesh.cpu(2))
    g.output("y", g.input("a", (3, 4)) @ g.param("b", torch.randn(4, 2), Shard(1)))
    with Runner(g) as r:
        mm = [k for k in r.kernels if isinstance(k, DispatchKernel)]
        assert len(mm) == 2 and all(k.prepared.key.op == "matmul.mm" for k in mm)
        choices = [k.prepared.choice for k in mm]
        r.run({"a": torch.randn(3, 4)})
        fns = [k.prepared.fn for k in mm]  # the bare kernels, once the first call checked their ABI
        r.run({"a": torch.randn(3, 4)})
        assert [k.prepared.fn for k in mm] == fns and [k.prepared.choice for k in mm] == choices


# -- faults --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2])
def test_exception_in_kernel_names_op_device_stream_and_runtime_stays_usable(n):
    fail = {"on": True}

    def maybe_fail(t: torch.Tensor) -> torch.Tensor:
        if fail["on"] and t.shape[0] == 2 and not t.is_meta:  # only the last device has 2 rows
            raise ValueError("boom")
        return t + 1

    x = torch.randn(5 if n == 2 else 2, 3)
    g = LogicalGraph(DeviceMesh.cpu(n))
    y = g.python(maybe_fail, g.input("x", tuple(x.shape), placement=Shard(0)), name="maybe_fail")
    g.output("y", g.redistribute(y, Replicate()).relu())  # peers wait in an all-gather: must not hang
    with Runner(g, timeout=30) as r:
        t0 = time.perf_counter()
        with pytest.raises(dtorch.KernelFailure) as info:
            r.run({"x": x})
        assert time.perf_counter() - t0 < 10
        msg = str(info.value)
        assert "python.maybe_fail" in msg and f"cpu:{n - 1}" in msg and "compute" in msg and "boom" in msg
        fail["on"] = False
        torch.testing.assert_close(r.run({"x": x})["y"], (x + 1).relu())


def test_sync_timeout_names_the_stuck_kernel():
    release = threading.Event()
    g = LogicalGraph(DeviceMesh.cpu(2))
    stuck = g.python(lambda t: (release.wait(30), t)[1], g.input("x", (2, 2)), name="stuck", shape=(2, 2),
                     dtype=torch.float32)
    g.output("y", stuck.exp())
    with Runner(g, timeout=0.3) as r:
        t0 = time.perf_counter()
        with pytest.raises(dtorch.SyncTimeout) as info:
            r.run({"x": torch.zeros(2, 2)})
        assert time.perf_counter() - t0 < 5
        assert "python.stuck" in str(info.value) and "cpu:0/compute" in str(info.value)
        release.set()
        r.synchronize(5.0)
        torch.testing.assert_close(r.run({"x": torch.zeros(2, 2)})["y"], torch.ones(2, 2))


def test_no_thread_outlives_shutdown():
    before = set(threading.enumerate())
    g = LogicalGraph(DeviceMesh.cpu(4))
    x = g.input("x", (8, 4), placement=Shard(0))
    g.output("y", g.redistribute(x.relu(), "R"))
    r = Runner(g)
    r.run({"x": torch.randn(8, 4)})
    assert len(dtorch_threads()) == 4  # 4 devices x compute (the all-gather has nothing to overlap: on compute)
    r.shutdown()
    assert not dtorch_threads() and set(threading.enumerate()) <= before


# -- memory --------------------------------------------------------------------------------------


def _chain_peak(release: bool, length: int = 12) -> int:
    g = LogicalGraph(DeviceMesh.cpu(1))
    y = g.input("x", (128, 128))
    for _ in range(length):
        y = y.tanh()
    g.output("y", y)
    with Runner(g, release=release) as r:
        gc.collect()  # no earlier test's activations freed between the base and the peak
        memory.reset_peak()
        base = memory.live_bytes(MemoryKind.ACTIVATION, "cpu:0")
        r.run({"x": torch.randn(128, 128)})
        peak = memory.peak_bytes(MemoryKind.ACTIVATION, "cpu:0") - base
        del r
    return peak


def test_release_lowers_peak_memory_of_a_long_chain():
    one = 128 * 128 * 4
    released, kept = _chain_peak(True), _chain_peak(False)
    assert released <= 3 * one
    assert kept >= 12 * one


# -- distributed tensors -------------------------------------------------------------------------


@pytest.mark.parametrize("placement", [Replicate(), Shard(0), Shard(1), Partial(), Partial("max")])
def test_dist_tensor_round_trips(placement):
    mesh = DeviceMesh.cpu(3)
    t = torch.randn(5, 4)
    d = DistTensor.from_full(t, mesh, placement)
    assert set(d.blobs) == {0, 1, 2}
    torch.testing.assert_close(d.full(), t)
    again = DistTensor.from_local([d.local(i) for i in mesh.ids], mesh, placement)
    torch.testing.assert_close(again.full(), t)
    assert again.shape == (5, 4)


def test_dist_tensor_from_local_checks_pieces():
    mesh = DeviceMesh.cpu(2)
    with pytest.raises(dtorch.ShapeError, match="piece has shape"):
        DistTensor.from_local([torch.zeros(3, 2), torch.zeros(1, 2)], mesh, Shard(0))
    with pytest.raises(dtorch.DeviceError, match="no local piece"):
        DistTensor.from_full(torch.zeros(2), mesh, Replicate(), ids=[0]).local(1)


def test_a_dropped_runner_leaves_no_threads():
    import gc

    g = LogicalGraph(DeviceMesh.cpu(2))
    g.output("y", g.input("x", (2,)).relu())
    r = Runner(g)
    r.run({"x": torch.randn(2)})
    assert dtorch_threads()
    del r
    gc.collect()
    assert not dtorch_threads()


# -- lifecycle after shutdown, a timeout or a failure (issue 14) ------------------------------------------------


def _stuck_graph(n: int, release: threading.Event, name: str = "stuck"):
    g = LogicalGraph(DeviceMesh.cpu(n))
    stuck = g.python(lambda t: (release.wait(10), t)[1], g.input("x", (2, 2)), name=name, shape=(2, 2),
                     dtype=torch.float32)
    g.output("y", stuck.exp())
    return g


def _join_dtorch_threads(timeout: float = 5.0) -> None:
    for t in dtorch_threads():
        t.join(timeout)
    assert not dtorch_threads()


def test_a_shut_down_runner_raises_instead_of_returning_stale_results():
    g = LogicalGraph(DeviceMesh.cpu(1))
    g.output("y", g.input("x", (1,)).exp())
    r = Runner(g, static=True)
    r.run({"x": torch.zeros(1)})
    assert r.shutdown() == []
    with pytest.raises(dtorch.DtorchError, match="shut down.*new Runner"):
        r.run({"x": torch.zeros(1)})
    stream = KernelStream(Device("cpu", 0), StreamType.COMPUTE)
    stream.close()
    with pytest.raises(dtorch.DtorchError, match="cpu:0/compute is shut down"):
        stream.push(_Item(lambda: None))


def test_shutdown_with_a_stuck_kernel_returns_within_its_timeout_and_names_the_thread():
    release = threading.Event()
    r = Runner(_stuck_graph(1, release), timeout=0.2)
    try:
        with pytest.raises(dtorch.SyncTimeout):
            r.run({"x": torch.zeros(2, 2)})
        t0 = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="dtorch-cpu:0/compute.*python.stuck"):
            abandoned = r.shutdown(timeout=0.3)
        assert time.perf_counter() - t0 < 2
        assert len(abandoned) == 1 and "dtorch-cpu:0/compute" in abandoned[0]
    finally:
        release.set()
        _join_dtorch_threads()


def test_a_run_after_a_timeout_waits_for_the_leftover_kernel_or_says_to_rebuild():
    release = threading.Event()
    with Runner(_stuck_graph(1, release), timeout=0.2) as r:
        with pytest.raises(dtorch.SyncTimeout):
            r.run({"x": torch.zeros(2, 2)})
        with pytest.raises(dtorch.SyncTimeout, match="earlier run.*still running.*new one"):
            r.run({"x": torch.zeros(2, 2)}, timeout=0.2)
        timer = threading.Timer(0.3, release.set)  # the stuck kernel ends while the next run waits for it
        timer.start()
        x = torch.full((2, 2), 2.0)
        torch.testing.assert_close(r.run({"x": x}, timeout=5)["y"], x.exp())  # its input was not freed
        timer.join()
    _join_dtorch_threads()


def test_collectives_take_the_runs_timeout():
    def slow_on_last(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == 1:  # device 1 of 2 holds one row
            time.sleep(0.6)
        return t + 1

    g = LogicalGraph(DeviceMesh.cpu(2))
    y = g.python(slow_on_last, g.input("x", (3, 2), placement=Shard(0)), name="slow")
    g.output("y", g.redistribute(y, Replicate()))
    x = torch.zeros(3, 2)
    with Runner(g, timeout=0.2) as r:  # the all-gather would give up after 0.2s
        torch.testing.assert_close(r.run({"x": x}, timeout=5)["y"], x + 1)


@pytest.mark.parametrize("timeout", ["abc", float("inf"), float("nan"), 0, True])
def test_a_bad_timeout_is_an_argument_error_naming_it(timeout):
    g = LogicalGraph(DeviceMesh.cpu(1))
    g.output("y", g.input("x", (1,)).exp())
    with pytest.raises(dtorch.ArgumentError, match="'timeout'"):
        Runner(g, timeout=timeout)
    with Runner(g) as r, pytest.raises(dtorch.ArgumentError, match="Runner.run: 'timeout'"):
        r.run({"x": torch.zeros(1)}, timeout=timeout)


@pytest.mark.parametrize("value", ["abc", "inf", "nan", "0"])
def test_a_bad_sync_timeout_setting_is_a_config_error_naming_it(monkeypatch, value):
    from dtorch.core import env

    monkeypatch.setenv("DTORCH_SYNC_TIMEOUT", value)
    with pytest.raises(dtorch.ConfigError, match="DTORCH_SYNC_TIMEOUT"):
        env.sync_timeout()


def test_a_python_kernel_returning_another_dtype_names_the_op():
    g = LogicalGraph(DeviceMesh.cpu(1))
    y = g.python(lambda t: t.double(), g.input("x", (2,)), name="widen", shape=(2,), dtype=torch.float32)
    g.output("y", y)
    with Runner(g) as r, pytest.raises(dtorch.KernelFailure, match="python.widen.*float64.*declares float32"):
        r.run({"x": torch.zeros(2)})


def test_in_process_collectives_with_mismatched_shapes_name_every_devices_shape():
    from dtorch.distributed import InProcessCommunicator
    from tests.threads import on_devices

    comm = InProcessCommunicator([0, 1], timeout=5)
    xs = [torch.ones(2, 3), torch.ones(3, 3)]
    got = on_devices(2, lambda i: comm.all_reduce(i, xs[i], torch.empty_like(xs[i])))
    for err in got:
        assert isinstance(err, dtorch.CommunicationError)
        assert "device 0: x [2, 3]" in str(err) and "device 1: x [3, 3]" in str(err)
