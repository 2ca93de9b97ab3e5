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

from collections import defaultdict

import torch

from dtorch.core.device import Device
from dtorch.core.memory import MemoryKind, allocate
from dtorch.graph.logical import LogicalGraph
from dtorch.graph.operand import COMPUTE

Key = tuple[tuple[int, ...], torch.dtype]


class BufferPlan:
    """Which operands share storage (``root``), when each storage is last read, and which are never recycled."""

    def __init__(self, graph: LogicalGraph) -> None:
        self.root: dict[int, int] = {}  # operand index -> the operand that owns its storage
        last: dict[int, int] = {}  # storage root -> index of the last operator that reads any tensor sharing it
        self.dedicated: set[int] = set()  # roots never returned to the pool
        for x in graph.operands:
            self.root[x.index] = x.index
        for k, node in enumerate(graph.operators):
            for x in node.inputs:
                if x is not None:
                    r = self.root[x.index]
                    last[r] = k
                    if node.stream != COMPUTE:
                        self.dedicated.add(r)
            for j, y in enumerate(node.outputs):
                src = None
                if node.kind == "view":
                    src = node.inputs[0]
                elif node.aliases and node.aliases[j] is not None:
                    src = node.inputs[node.aliases[j]]
                if src is not None:
                    self.root[y.index] = self.root[src.index]
                else:
                    last[y.index] = k  # a result nobody reads is free right after it is made
                    if node.stream != COMPUTE or node.kind == "collective":
                        self.dedicated.add(y.index)
        keep = [x for x, _ in graph.params.values()] + [x for x, _ in graph.states.values()]
        keep += list(graph.inputs.values()) + list(graph.outputs.values())
        for x in keep:
            self.dedicated.add(self.root[x.index])
        self.frees: dict[int, list[int]] = defaultdict(list)  # operator index -> roots free after it
        for r, k in last.items():
            if r not in self.dedicated:
                self.frees[k].append(r)


class Pool:
    """Free buffers of one device by exact (shape, dtype)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.free: dict[Key, list[torch.Tensor]] = defaultdict(list)
        self.nbytes = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self.free.get((shape, dtype))
        if free:
            return free.pop()
        t = allocate(shape, dtype, self.device, MemoryKind.WORKSPACE)
        self.nbytes += t.numel() * t.element_size()
        return t

    def give(self, t: torch.Tensor) -> None:
        self.free[(tuple(t.shape), t.dtype)].append(t)
