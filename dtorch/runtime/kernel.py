"""``Kernel``: one operator on one device, the unit a stream runs.

``run()`` takes the tensors of its input Blobs, computes, and writes its output Blob:
``DispatchKernel`` calls the kernel bound once through the Dispatcher at build time,
``PythonKernel`` a user's function, ``CollectiveKernel`` the communicator, ``LocalKernel`` a
slice (Replicate -> Shard) or the Partial view of a replicated tensor. ``execute()`` (what a stream
calls) skips the kernel when its run already failed, records a failure, and releases the inputs
whose last reader it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import (
    CommunicationError,
    DeviceError,
    DtorchError,
    DTypeError,
    KernelFailure,
    LayoutError,
    ShapeError,
)
from dtorch.core.memory import MemoryKind, allocate, default_workspace
from dtorch.dispatch.context import KernelContext
from dtorch.dispatch.prepared import PreparedKernel
from dtorch.graph.operand import Operator
from dtorch.runtime.blob import Blob, local_piece
from dtorch.runtime.comm import Communicator


class RunState:
    """One run's shared fate: the first failure, and whether the rest of the run is skipped."""

    __slots__ = ("error", "aborted", "comm", "_lock")

    def __init__(self, comm: Communicator | None) -> None:
        self.error: DtorchError | KeyboardInterrupt | None = None
        self.aborted = False
        self.comm = comm
        self._lock = threading.Lock()

    def fail(self, kernel: Kernel, stream: Any, exc: BaseException) -> None:
        with self._lock:
            first = self.error is None
            if first and isinstance(exc, KeyboardInterrupt):  # Ctrl-C in a kernel run on the caller's thread
                self.error = exc
            elif first:
                cls = CommunicationError if isinstance(exc, CommunicationError) else KernelFailure
                self.error = cls(f"kernel {kernel.operator.name} (op {kernel.operator.op}) failed on device "
                                 f"{kernel.device} (global id {kernel.device_id}), stream {stream.name}: "
                                 f"{type(exc).__name__}: {exc}")
                self.error.__cause__ = exc
        self.abort()

    def abort(self) -> None:
        """Skip every kernel not yet started and wake collectives blocked on peers."""
        if not self.aborted:
            self.aborted = True
            if self.comm is not None:
                self.comm.abort()


class Kernel:
    """One operator on one device: its input and output Blobs and its stream."""

    __slots__ = ("operator", "device_id", "device", "inputs", "outputs", "stream", "label", "release", "seq",
                 "record", "deps", "fixed_out")

    def __init__(self, operator: Operator, device_id: int, device: Device, inputs: Sequence[Blob | None],
                 outputs: Sequence[Blob], stream: Any) -> None:
        self.operator = operator
        self.device_id = device_id
        self.device = device
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.stream = stream
        self.label = f"{operator.name} on {device}"
        self.release = True
        self.seq = 0  # position in the runner's push order
        self.record = False  # a kernel on another stream reads this one's output
        self.deps: tuple[Kernel, ...] = ()  # producers on other streams this kernel must wait for
        self.fixed_out: torch.Tensor | None = None  # the output buffer a static plan gave this kernel

    def execute(self, stream: Any, state: RunState | None) -> None:
        if state is not None and state.aborted:
            return
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001 - every failure is reported at the next synchronization
            if state is None:
                raise
            state.fail(self, stream, exc)
            return
        if self.release:
            for b in self.inputs:
                if b is not None:
                    b.read_done()

    def run(self) -> None:
        raise NotImplementedError

    def _tensors(self) -> list[torch.Tensor | None]:
        return [b.tensor if b is not None else None for b in self.inputs]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label} on {getattr(self.stream, 'name', self.stream)})"


class DispatchKernel(Kernel):
    """Runs the kernel bound at build time (``PreparedKernel``). Its outputs are either planned buffers fixed at
    build (``fixed``: the same tensors every run) or allocated per run; an output listed in ``aliases`` is its
    input's own tensor, written in place."""

    __slots__ = ("prepared", "ctx", "out_shapes", "dtypes", "aliases", "fixed", "dense")

    def __init__(self, operator: Operator, device_id: int, device: Device, inputs: Sequence[Blob | None],
                 outputs: Sequence[Blob], stream: Any, prepared: PreparedKernel, out_shapes: Sequence[tuple[int, ...]],
                 dtypes: Sequence[torch.dtype], params: Any = None) -> None:
        super().__init__(operator, device_id, device, inputs, outputs, stream)
        self.prepared = prepared
        params = operator.params if params is None else params
        self.ctx = KernelContext(device, getattr(stream, "cuda_stream", None), default_workspace(device), params)
        self.out_shapes = tuple(out_shapes)
        self.dtypes = tuple(dtypes)
        self.aliases = operator.aliases or (None,) * len(self.out_shapes)
        self.fixed: tuple[tuple, tuple] | None = None  # (inputs, outputs) bound once by a static plan
        self.dense = prepared.meta.requires_dense

    def run(self) -> None:
        fixed = self.fixed
        if fixed is not None:
            self.prepared.fn(self.ctx, fixed[0], fixed[1])
            return
        ins = self._tensors()
        outs = tuple(ins[a] if a is not None else allocate(shape, dt, self.device, MemoryKind.ACTIVATION)
                     for a, shape, dt in zip(self.aliases, self.out_shapes, self.dtypes, strict=True))
        if self.dense:
            check_dense(self.operator, ins, outs)
        self.prepared.fn(self.ctx, ins, outs)
        for b, t in zip(self.outputs, outs, strict=True):
            b.tensor = t


def check_dense(operator: Operator, ins: Sequence[torch.Tensor | None], outs: Sequence[torch.Tensor]) -> None:
    """The bound kernel declares ``requires_dense``: every input and output must be contiguous."""
    for what, ts in (("input", ins), ("output", outs)):
        for j, t in enumerate(ts):
            if t is not None and not t.is_contiguous():
                raise LayoutError(f"graph operator {operator.name}: its kernel requires dense tensors, but {what} {j} "
                                  f"has shape {list(t.shape)} and strides {list(t.stride())}")


class ViewKernel(Kernel):
    """``view`` / ``split``: this device's piece viewed without a copy (run per run only without a static plan)."""

    __slots__ = ("shapes",)

    def __init__(self, operator: Operator, device_id: int, device: Device, inputs: Sequence[Blob | None],
                 outputs: Sequence[Blob], stream: Any, shapes: Sequence[tuple[int, ...]]) -> None:
        super().__init__(operator, device_id, device, inputs, outputs, stream)
        self.shapes = tuple(shapes)

    def views(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.operator.op == "view":
            return (x.view(self.shapes[0]),)
        dim = self.operator.params.dim
        return tuple(x.split([s[dim] for s in self.shapes], dim))

    def run(self) -> None:
        for b, t in zip(self.outputs, self.views(self.inputs[0].tensor), strict=True):
            b.tensor = t


class Segment:
    """Kernels of one stream pushed as one item: one queue hand-off for a run of kernels with no waits between."""

    __slots__ = ("kernels", "label")
    traced = False  # the segment traces each of its kernels itself

    def __init__(self, kernels: Sequence[Kernel]) -> None:
        self.kernels = tuple(kernels)
        first, last = self.kernels[0].label, self.kernels[-1].label
        self.label = first if len(self.kernels) == 1 else f"{first} .. {last} ({len(self.kernels)} kernels)"

    def execute(self, stream: Any, state: RunState | None) -> None:
        tracer = stream.tracer
        if tracer is None:
            for k in self.kernels:
                k.execute(stream, state)
            return
        clock = time.perf_counter_ns
        for k in self.kernels:
            t0 = clock()
            k.execute(stream, state)
            tracer.add(stream, k.label, t0, clock())


class PythonKernel(Kernel):
    """Calls ``fn(*local_tensors)``; the result must have this device's output shape and the graph's dtype."""

    __slots__ = ("fn", "out_shape", "dtype")

    def __init__(self, operator: Operator, device_id: int, device: Device, inputs: Sequence[Blob | None],
                 outputs: Sequence[Blob], stream: Any, fn: Callable[..., torch.Tensor],
                 out_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__(operator, device_id, device, inputs, outputs, stream)
        self.fn = fn
        self.out_shape = out_shape
        self.dtype = dtype

    def run(self) -> None:
        out = self.fn(*self._tensors())
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != self.out_shape:
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ShapeError(f"{self.operator.name}: the Python kernel returned {got}, expected a tensor of shape "
                             f"{list(self.out_shape)}")
        if out.dtype != self.dtype:
            raise DTypeError(f"{self.operator.name}: the Python kernel returned dtype {dtype_name(out.dtype)}, but "
                             f"the graph declares {dtype_name(self.dtype)} (cast inside fn, or declare dtype=)")
        if out.device.type != self.device.torch.type:  # the device's own torch device (a test may map one to meta)
            raise DeviceError(f"{self.operator.name}: the Python kernel returned a tensor on {out.device.type}, but it "
                              f"runs on {self.device} (a meta tensor holds no values); return one on that device")
        if self.fixed_out is not None:
            self.fixed_out.copy_(out)
        else:
            self.outputs[0].tensor = out


class CollectiveKernel(Kernel):
    """Calls the communicator's collective ``operator.op`` for this device; "send" / "recv" (pipeline stages) go to
    or come from this device's peer (``operator.params.peers``: (device, peer) pairs)."""

    __slots__ = ("comm", "out_shape", "dtype", "call")

    def __init__(self, operator: Operator, device_id: int, device: Device, inputs: Sequence[Blob | None],
                 outputs: Sequence[Blob], stream: Any, comm: Communicator, out_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        super().__init__(operator, device_id, device, inputs, outputs, stream)
        self.comm = comm
        self.out_shape = out_shape
        self.dtype = dtype
        self.call = getattr(comm, operator.op)

    def run(self) -> None:
        out = self.fixed_out
        if out is None:
            out = self.outputs[0].tensor = allocate(self.out_shape, self.dtype, self.device, MemoryKind.ACTIVATION)
        op = self.operator
        if op.op == "send":
            self.call(self.device_id, self.inputs[0].tensor, dict(op.params.peers)[self.device_id])
        elif op.op == "recv":
            self.call(self.device_id, out, dict(op.params.peers)[self.device_id])
        else:
            self.call(self.device_id, self.inputs[0].tensor, out, **dict(op.params.items()))


class LocalKernel(Kernel):
    """Replicate -> Shard (copy this device's slice) or Replicate -> Partial (keep or zero)."""

    __slots__ = ("rank", "n")

    def __init__(self, operator: Operator, device_id: int, device: Device, inputs: Sequence[Blob | None],
                 outputs: Sequence[Blob], stream: Any, rank: int, n: int) -> None:
        super().__init__(operator, device_id, device, inputs, outputs, stream)
        self.rank = rank
        self.n = n

    def run(self) -> None:
        x = self.inputs[0].tensor
        params = self.operator.params
        out = self.fixed_out
        if self.operator.op == "shard":
            piece = local_piece(x, params.shard, self.rank, self.n)
            if out is None:
                out = allocate(piece.shape, x.dtype, self.device, MemoryKind.ACTIVATION)
            out.copy_(piece)
        elif params.reduce == "sum" and self.rank != 0:
            if out is None:
                out = allocate(x.shape, x.dtype, self.device, MemoryKind.ACTIVATION, zero=True)
            else:
                out.zero_()
        elif out is None:
            out = x
        else:
            out.copy_(x)
        self.outputs[0].tensor = out
