"""``Operand`` and ``Operator``: the metadata of a logical graph (no data).

An ``Operand`` knows its global shape, dtype and placement, and which operator produced it; its
Python operators build graph calls, so ``(x @ w).relu().sum(1)`` reads like torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dtorch.core.dtypes import dtype_name
from dtorch.core.placement import Placement
from dtorch.dispatch.context import NO_PARAMS, KernelParams

if TYPE_CHECKING:
    from dtorch.graph.logical import LogicalGraph

COMPUTE = "compute"
COMMUNICATE = "communicate"


class Operand:
    """A tensor of the graph: ``shape`` [global], ``dtype``, ``placement`` over the graph's mesh.

    ``layout`` is "strided" for ordinary tensors. A weight kept in a block format ("gguf.q4_1") presents its
    logical shape [N, K] and the activations' dtype to inference and placement rules, while each device holds
    the packed bytes; only kernels registered for that layout read it, and it never moves between devices.
    """

    __slots__ = ("graph", "index", "name", "shape", "dtype", "placement", "producer", "local_shapes", "layout")

    def __init__(self, graph: LogicalGraph, index: int, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 placement: Placement, producer: Operator | None, local_shapes: dict[int, tuple[int, ...]],
                 layout: str = "strided") -> None:
        self.graph = graph
        self.index = index
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.placement = placement
        self.producer = producer
        self.local_shapes = local_shapes  # global device id -> the shape that device holds
        self.layout = layout

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        layout = "" if self.layout == "strided" else f" {self.layout}"
        return f"Operand({self.name}: {list(self.shape)} {dtype_name(self.dtype)}{layout} {self.placement})"

    # -- torch-like operators: each one is a graph call ------------------------------------------

    def _binary(self, name: str, other: Any) -> Operand:
        return self.graph.call(f"binary.{name}", self, other)

    def __add__(self, other: Any) -> Operand:
        return self._binary("add", other)

    def __radd__(self, other: Any) -> Operand:
        return self._binary("add", other)  # addition commutes

    def __sub__(self, other: Any) -> Operand:
        return self._binary("sub", other)

    def __rsub__(self, other: Any) -> Operand:
        return self.graph.call("binary.add", self.graph.call("unary.neg", self), other)

    def __mul__(self, other: Any) -> Operand:
        return self._binary("mul", other)

    def __rmul__(self, other: Any) -> Operand:
        return self._binary("mul", other)

    def __truediv__(self, other: Any) -> Operand:
        return self._binary("div", other)

    def __neg__(self) -> Operand:
        return self.graph.call("unary.neg", self)

    def __matmul__(self, other: Operand) -> Operand:
        return self.graph.call("matmul.bmm" if self.ndim == 3 else "matmul.mm", self, other)

    def sum(self, dim: int, keepdim: bool = False) -> Operand:
        return self.graph.call("reduce.sum", self, dim=dim, keepdim=keepdim)

    def mean(self, dim: int, keepdim: bool = False) -> Operand:
        return self.graph.call("reduce.mean", self, dim=dim, keepdim=keepdim)

    def amax(self, dim: int, keepdim: bool = False) -> Operand:
        return self.graph.call("reduce.max", self, dim=dim, keepdim=keepdim)

    def relu(self) -> Operand:
        return self.graph.call("unary.relu", self)

    def gelu(self, approximate: str = "none") -> Operand:
        return self.graph.call("unary.gelu", self, approximate=approximate)

    def silu(self) -> Operand:
        return self.graph.call("unary.silu", self)

    def exp(self) -> Operand:
        return self.graph.call("unary.exp", self)

    def tanh(self) -> Operand:
        return self.graph.call("unary.tanh", self)

    def redistribute(self, placement: Placement | str) -> Operand:
        return self.graph.redistribute(self, placement)


@dataclass(eq=False)
class Operator:
    """One node: ``kind`` is "kernel" (a dispatched op), "python", "collective" or "local" (a slice).

    ``op`` is the kernel op name ("matmul.mm") or the collective ("all_reduce"); ``params`` its
    owned parameters; ``stream`` "compute" or "communicate"; ``devices`` the global ids it runs on.
    """

    name: str
    kind: str
    op: str
    inputs: tuple[Operand | None, ...]
    outputs: list[Operand] = field(default_factory=list)
    params: KernelParams = NO_PARAMS
    stream: str = COMPUTE
    devices: tuple[int, ...] = ()
    fn: Callable[..., Any] | None = None  # a Python kernel's function
    aliases: tuple[int | None, ...] = ()  # per output: the input it writes in place (None: a fresh tensor)
    local_params: dict[int, KernelParams] | None = None  # global id -> that device's params, where they differ
    layout: str = "strided"  # the layout of its kernel key: that of its block-format input, if any

    def __repr__(self) -> str:
        ins = ", ".join(o.name if o is not None else "None" for o in self.inputs)
        outs = ", ".join(o.name for o in self.outputs)
        return f"Operator({self.name}: {self.op}({ins}) -> {outs} on {self.stream})"
