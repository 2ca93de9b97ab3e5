"""``Runner``: builds the Kernels of a ``LogicalGraph`` once, then runs the graph many times.

Build: one Blob per (operand, local device), params split once, one Kernel per (operator, local
device) with its kernel bound through the Dispatcher, its stream chosen, and the events it needs
(a kernel waits, on its own stream, for producers on other streams). Run: feeds are split, every
kernel is pushed in graph order (pushing never blocks), all streams are synchronized once, and the
first failure is raised naming its op, device and stream.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from dtorch.core import env
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import ArgumentError, DtorchError, DTypeError, ShapeError, SyncTimeout
from dtorch.core.memory import MemoryKind
from dtorch.dispatch import dispatcher as _global_dispatcher
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.dispatch.prepared import PreparedKernel
from dtorch.dispatch.registry import Dispatcher
from dtorch.graph.logical import LogicalGraph
from dtorch.graph.operand import COMMUNICATE, Operand, Operator
from dtorch.runtime.blob import Blob, DistTensor, local_piece
from dtorch.runtime.comm import Communicator, default_communicator
from dtorch.runtime.kernel import CollectiveKernel, DispatchKernel, Kernel, LocalKernel, PythonKernel, RunState
from dtorch.runtime.stream import StreamManager, StreamType
from dtorch.runtime.tracing import Tracer


class Runner:
    """Runs ``graph`` on its mesh: ``Runner(g).run({"x": x_full}) -> {"y": full tensor}``.

    ``communicator``: default the in-process one for this process's devices; ``release=False`` keeps
    every Blob (for comparison); ``trace=True`` (or DTORCH_TRACE) records each kernel's start and end;
    ``timeout`` bounds each synchronization (default DTORCH_SYNC_TIMEOUT).
    """

    def __init__(self, graph: LogicalGraph, communicator: Communicator | None = None, *, release: bool = True,
                 trace: bool | None = None, timeout: float | None = None,
                 dispatcher: Dispatcher | None = None) -> None:
        if not isinstance(graph, LogicalGraph):
            raise ArgumentError(f"Runner: expected a LogicalGraph, got {type(graph).__name__}")
        if not graph.outputs:
            raise ArgumentError("Runner: the graph has no outputs (mark results with graph.output(name, x))")
        self.graph = graph
        self.mesh = graph.mesh
        self.timeout = env.sync_timeout() if timeout is None else float(timeout)
        self.comm = communicator if communicator is not None else default_communicator(self.mesh.ids, self.timeout)
        self.local_ids = self.mesh.local_ids(self.comm.process)
        self.manager = StreamManager(len(self.local_ids))
        self._finalizer = weakref.finalize(self, self.manager.shutdown)  # a dropped Runner leaves no threads
        self.tracer = Tracer() if (env.trace() if trace is None else trace) else None
        self.manager.set_tracer(self.tracer)
        self._dispatcher = dispatcher or _global_dispatcher
        self._lock = threading.Lock()
        self._dirty = False
        self.blobs: dict[tuple[int, int], Blob] = {}  # (operand index, global id) -> Blob
        self.kernels: list[Kernel] = []
        self._build(release)

    # -- build ---------------------------------------------------------------------------------

    def _build(self, release: bool) -> None:
        g, n = self.graph, self.mesh.size
        pinned = {x.index for x in g.outputs.values()} | {x.index for x, _ in g.params.values()}
        for x in g.operands:
            for i in self.local_ids:
                kind = MemoryKind.PERSISTENT if x.index in pinned and x.producer is None else MemoryKind.ACTIVATION
                self.blobs[(x.index, i)] = Blob(self.mesh.device(i), kind, pinned=x.index in pinned or not release)
        for x, value in g.params.values():
            for i in self.local_ids:
                self.blobs[(x.index, i)].tensor = local_piece(value, x.placement, self.mesh.rank(i), n)
        by_output: dict[tuple[int, int], Kernel] = {}
        for node in g.operators:
            for i in self.local_ids:
                k = self._kernel(node, i)
                k.release = release
                k.seq = len(self.kernels)
                deps = []
                for x in node.inputs:
                    if x is None:
                        continue
                    self.blobs[(x.index, i)].readers += 1
                    producer = by_output.get((x.index, i))
                    if producer is not None and producer.stream is not k.stream and producer not in deps:
                        producer.record = True
                        deps.append(producer)
                k.deps = tuple(deps)
                by_output[(node.outputs[0].index, i)] = k
                self.kernels.append(k)

    def _kernel(self, node: Operator, i: int) -> Kernel:
        device = self.mesh.device(i)
        stype = StreamType.COMMUNICATE if node.stream == COMMUNICATE else StreamType.COMPUTE
        stream = self.manager.stream(device, stype)
        ins = [self.blobs[(x.index, i)] if x is not None else None for x in node.inputs]
        out_x = node.outputs[0]
        outs = [self.blobs[(out_x.index, i)]]
        shape = out_x.local_shapes[i]
        if node.kind == "kernel":
            return DispatchKernel(node, i, device, ins, outs, stream, self._bind(node, i), shape, out_x.dtype)
        if node.kind == "python":
            return PythonKernel(node, i, device, ins, outs, stream, node.fn, shape)
        if node.kind == "collective":
            return CollectiveKernel(node, i, device, ins, outs, stream, self.comm, shape, out_x.dtype)
        return LocalKernel(node, i, device, ins, outs, stream, self.mesh.rank(i), self.mesh.size)

    def _bind(self, node: Operator, i: int) -> PreparedKernel:
        """The kernel for (op, device type, dtype of the first input), chosen once with the call's static facts."""
        device = self.mesh.device(i)
        first = next(x for x in node.inputs if x is not None)
        metas = [torch.empty(x.local_shapes[i], dtype=x.dtype, device="meta") if x is not None else None
                 for x in node.inputs]
        try:
            return PreparedKernel(self._dispatcher, KernelKey(node.op, device.type, first.dtype),
                                  Call(device, first.dtype, node.params, metas))
        except DtorchError as exc:
            raise type(exc)(f"graph operator {node.name}: {exc}") from exc

    # -- run -----------------------------------------------------------------------------------

    def run(self, feeds: Mapping[str, torch.Tensor] | None = None, return_dist: bool = False,
            timeout: float | None = None) -> dict[str, Any]:
        """Run once; returns {output name: full tensor} (or ``DistTensor`` with ``return_dist=True``)."""
        feeds = dict(feeds or {})
        self._check_feeds(feeds)
        with self._lock:
            if self._dirty:
                self.comm.reset()
                self._dirty = False
            state = RunState(self.comm)
            for b in self.blobs.values():
                b.reset()
            n = self.mesh.size
            for name, x in self.graph.inputs.items():
                for i in self.local_ids:
                    self.blobs[(x.index, i)].tensor = local_piece(feeds[name], x.placement, self.mesh.rank(i), n)
            self._push_all(state)
            try:
                self.manager.synchronize(self.timeout if timeout is None else timeout)
            except SyncTimeout:
                state.abort()
                self._dirty = True
                raise
            if state.error is not None:
                self._dirty = True
                raise state.error
            return {name: self._result(x, return_dist) for name, x in self.graph.outputs.items()}

    def _push_all(self, state: RunState) -> None:
        events: dict[int, Any] = {}
        waited: dict[tuple[Any, Any], int] = {}  # (consumer stream, producer stream) -> last seq waited for
        for k in self.kernels:
            s = k.stream
            for p in k.deps:
                key = (s, p.stream)
                if waited.get(key, -1) < p.seq:
                    s.wait(events[p.seq], state)
                    waited[key] = p.seq
            s.push(k, state)
            if k.record:
                events[k.seq] = s.record(state)

    def _result(self, x: Operand, return_dist: bool) -> Any:
        blobs = {i: Blob(self.mesh.device(i), tensor=self.blobs[(x.index, i)].tensor) for i in self.local_ids}
        dt = DistTensor(self.mesh, x.placement, x.shape, x.dtype, blobs)
        return dt if return_dist else dt.full()

    def _check_feeds(self, feeds: dict[str, torch.Tensor]) -> None:
        want = self.graph.inputs
        missing, extra = sorted(set(want) - set(feeds)), sorted(set(feeds) - set(want))
        if missing or extra:
            raise ArgumentError(f"Runner.run: feeds must be exactly {sorted(want)}; missing {missing}, unknown {extra}")
        for name, t in feeds.items():
            x = want[name]
            if not isinstance(t, torch.Tensor):
                raise DTypeError(f"Runner.run: feed {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != x.shape:
                raise ShapeError(f"Runner.run: feed {name!r} must have shape {list(x.shape)}, got {list(t.shape)}")
            if t.dtype != x.dtype:
                raise DTypeError(f"Runner.run: feed {name!r} must have dtype {dtype_name(x.dtype)}, "
                                 f"got {dtype_name(t.dtype)}")

    # -- lifetime ------------------------------------------------------------------------------

    def synchronize(self, timeout: float | None = None) -> None:
        self.manager.synchronize(self.timeout if timeout is None else timeout)

    def shutdown(self) -> None:
        """Join every stream thread; the Runner cannot run afterwards."""
        self._finalizer()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Runner({len(self.kernels)} kernels on {len(self.manager.streams)} streams, {self.mesh})"
