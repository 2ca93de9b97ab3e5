"""Static buffer plan: every tensor of a graph bound to one buffer per device at build, reused every run.

A graph built once per step shape runs thousands of times; planning its memory once removes every
allocation from the run (and gives CUDA-graph capture the fixed addresses it needs). Per device, in
graph order: fed inputs get their own buffers, views and in-place outputs share their input's buffer,
and a compute kernel's fresh output takes a free buffer of its exact shape and dtype from a pool (or a
new one). A buffer goes back to the pool right after the last reader of every tensor that shares it,
which keeps the plan's footprint near the live working set. Buffers that a communicate stream reads or
writes are never recycled: compute and communicate streams run concurrently, and only the compute
stream's own order makes reuse safe.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import DtorchError
from dtorch.core.memory import MemoryKind, allocate
from dtorch.graph.logical import LogicalGraph
from dtorch.graph.operand import COMPUTE

Key = tuple[tuple[int, ...], torch.dtype]


class BufferPlan:
    """Which operands share storage (``root``), after which operator each storage is free again (``frees``),
    which are never recycled (``dedicated``), and which are written by a communicate stream (``comm``).

    Compute-stream order makes reuse safe among compute kernels. A storage that a communicate kernel c
    reads is free only at the first compute kernel that waits for c (reads one of c's outputs): from there
    on c has finished. A storage that a communicate kernel writes comes from a pool of its own and goes
    back after its last compute reader f; a later communicate kernel k may take it when it waits for a
    compute kernel at or after f (``ready``), so the readers finished before k writes.
    """

    def __init__(self, graph: LogicalGraph) -> None:
        ops = graph.operators
        self.root: dict[int, int] = {x.index: x.index for x in graph.operands}
        last: dict[int, int] = {}  # root -> the last operator reading any tensor that shares it
        comm_readers: dict[int, int] = {}  # root -> the last communicate operator reading it
        producer: dict[int, int] = {}  # operand index -> operator index
        self.dedicated: set[int] = set()
        self.comm: set[int] = set()  # roots written by communicate-stream operators
        self.ready: dict[int, int] = {}  # communicate operator -> the latest compute operator it waits for
        for k, node in enumerate(ops):
            on_compute = node.stream == COMPUTE and node.kind != "collective"
            for x in node.inputs:
                if x is None:
                    continue
                r = self.root[x.index]
                last[r] = max(last.get(r, k), k)
                if not on_compute:
                    comm_readers[r] = k
                    p = producer.get(x.index)
                    if p is not None and ops[p].stream == COMPUTE and ops[p].kind != "collective":
                        self.ready[k] = max(self.ready.get(k, -1), p)
            for j, y in enumerate(node.outputs):
                producer[y.index] = k
                src = node.inputs[0] if node.kind == "view" else \
                    node.inputs[node.aliases[j]] if node.aliases and node.aliases[j] is not None else None
                if src is not None:
                    self.root[y.index] = self.root[src.index]
                    if not on_compute:  # a collective never aliases; a Python kernel on communicate might
                        self.dedicated.add(self.root[src.index])
                    continue
                last[y.index] = k  # a result nobody reads is free right after it is made
                if not on_compute:
                    self.comm.add(y.index)
        waits = {}  # communicate operator -> the first compute operator reading one of its outputs
        for k, node in enumerate(ops):
            if node.stream == COMPUTE and node.kind != "collective":
                for x in node.inputs:
                    p = producer.get(x.index) if x is not None else None
                    if p is not None and (ops[p].stream != COMPUTE or ops[p].kind == "collective"):
                        waits.setdefault(p, k)
        for r, c in comm_readers.items():
            w = waits.get(c)
            if w is None:
                self.dedicated.add(r)
            else:
                last[r] = max(last[r], w)
        keep = [x for x, _ in graph.params.values()] + [x for x, _ in graph.states.values()]
        keep += list(graph.inputs.values()) + list(graph.outputs.values())
        self.dedicated |= {self.root[x.index] for x in keep}
        self.frees: dict[int, list[int]] = defaultdict(list)  # operator index -> roots free after it
        for r, k in last.items():
            if r not in self.dedicated and self.root[r] == r:
                self.frees[k].append(r)


class Pool:
    """Free buffers of one device by exact (shape, dtype), each tagged with the operator after which it became
    free; ``take(..., before=k)`` only hands out a buffer freed at or before operator k."""

    def __init__(self, device: Device, carver: Carver | None = None) -> None:
        self.device = device
        self.free: dict[Key, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self.nbytes = 0
        self.carver = carver  # new buffers carved from storage shared with other Runners, else allocated

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, what: str, before: int | None = None) -> torch.Tensor:
        free = self.free.get((shape, dtype))
        if free:
            for j in range(len(free) - 1, -1, -1):
                if before is None or free[j][0] <= before:
                    return free.pop(j)[1]
        return self.new(shape, dtype, what)

    def new(self, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        """A new buffer for ``what`` (the operand, named in the error when the device cannot hold it)."""
        try:
            t = self.carver.take(shape, dtype) if self.carver is not None else \
                allocate(shape, dtype, self.device, MemoryKind.WORKSPACE)
        except RuntimeError as exc:  # the allocator's "can't allocate memory", torch.OutOfMemoryError
            raise DtorchError(f"static plan: the buffer of {what} ({list(shape)} {dtype_name(dtype)}, "
                              f"{math.prod(shape) * dtype.itemsize} bytes) does not fit on {self.device} "
                              f"({str(exc).splitlines()[0][:200]})") from None
        self.nbytes += t.numel() * t.element_size()
        return t

    def give(self, t: torch.Tensor, at: int = -1) -> None:
        self.free[(tuple(t.shape), t.dtype)].append((at, t))


class SharedBuffers:
    """Storage that the static Runners of one device share, when no two of them ever run at once (an Executor's
    step graphs, one per shape bucket: its steps run one after another, and every Runner copies its outputs out).

    Each Runner carves its buffers from the start of the same slabs (``carver()``), so the device holds what its
    largest Runner needs, not the sum over every bucket. A Runner that needs more than the slabs hold adds one slab
    (at least as large as all before it, so a few suffice); the earlier Runners keep theirs where they are.
    """

    ALIGN = 256  # bytes: every carved buffer starts on this boundary (SIMD loads, CUDA's allocator granularity)

    def __init__(self, device: Device) -> None:
        self.device = device
        self.slabs: list[torch.Tensor] = []  # uint8, WORKSPACE memory
        # output name -> the latest copies a Runner handed out (Runner._copy_out writes the next one into one of them
        # once its caller has let go of it)
        self.outputs: dict[str, list[torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slabs)

    def carver(self) -> Carver:
        """A fresh cursor at the start of the slabs, for one Runner's buffers on this device."""
        return Carver(self)

    def _add(self, nbytes: int) -> torch.Tensor:
        slab = allocate((max(nbytes, self.nbytes),), torch.uint8, self.device, MemoryKind.WORKSPACE)
        self.slabs.append(slab)
        return slab


class Carver:
    """One Runner's cursor over ``SharedBuffers``: ``take`` hands out the next free bytes of the slabs as a tensor."""

    def __init__(self, shared: SharedBuffers) -> None:
        self.shared = shared
        self.slab = 0
        self.offset = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=self.shared.device.torch)
        slabs, align = self.shared.slabs, SharedBuffers.ALIGN
        while self.slab < len(slabs):
            start = -(-self.offset // align) * align
            if start + nbytes <= slabs[self.slab].numel():
                self.offset = start + nbytes
                return slabs[self.slab][start:start + nbytes].view(dtype).view(shape)
            self.slab, self.offset = self.slab + 1, 0
        self.offset = nbytes
        return self.shared._add(nbytes)[:nbytes].view(dtype).view(shape)
