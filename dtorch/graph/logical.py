"""``LogicalGraph``: operands and operators on a ``DeviceMesh``, metadata only.

Every call infers its output's shape and dtype by running the op wrapper on ``meta`` tensors (so a
bad graph fails here, naming the operator), picks the cheapest placement strategy for the op, and
inserts the communication that strategy needs: Partial->Replicate is an all-reduce, Shard->Replicate
an all-gather, Partial->Shard a reduce-scatter, Replicate->Shard a local slice::

    g = LogicalGraph(DeviceMesh.cpu(2))
    x = g.input("x", shape=(8, 64), placement=Shard(0))       # x: [8, 64], rows split over 2 devices
    w = g.param("w", weight)                                  # w: [64, 32], replicated
    g.output("y", g.redistribute(x @ w, Replicate()))         # y: [8, 32]
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import ArgumentError, DeviceError, GraphError
from dtorch.core.placement import Partial, Placement, Replicate, Shard, as_placement, local_shape
from dtorch.dispatch.context import KernelParams
from dtorch.graph.bindings import bind
from dtorch.graph.infer import as_tuple, infer_outputs, meta_tensor
from dtorch.graph.mesh import DeviceMesh
from dtorch.graph.moves import GraphMoves
from dtorch.graph.operand import COMMUNICATE, COMPUTE, Operand, Operator
from dtorch.graph.strategy import choose
from dtorch.graph.views import split_placements, view_placement, view_shape

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


class LogicalGraph(GraphMoves):
    """A graph of ``Operand`` s and ``Operator`` s over ``mesh``; build it, then run it with ``Runner``."""

    def __init__(self, mesh: DeviceMesh) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise ArgumentError(f"LogicalGraph: mesh must be a DeviceMesh, got {type(mesh).__name__}")
        self.mesh = mesh
        self.operands: list[Operand] = []
        self.operators: list[Operator] = []
        self.inputs: dict[str, Operand] = {}
        self.params: dict[str, tuple[Operand, Any]] = {}  # name -> (operand, torch.Tensor or placed DistTensor)
        self.outputs: dict[str, Operand] = {}
        self._seq = itertools.count()
        self._moves: dict[tuple[int, Placement], Operand] = {}  # each move is made once per operand
        self.states: dict[str, tuple[Operand, Any]] = {}
        self._consumed: dict[int, str] = {}  # operand index -> the operator that updated it in place

    # -- leaves --------------------------------------------------------------------------------

    def input(self, name: str, shape: Sequence[int], dtype: torch.dtype | str = torch.float32,
              placement: Placement | str = Replicate()) -> Operand:
        """A tensor fed at run time (``Runner.run({name: full_tensor})``); ``shape`` is the global shape."""
        self._new_name(name)
        shape = tuple(shape)
        if any(not isinstance(s, int) or s < 0 for s in shape):
            raise ArgumentError(f"LogicalGraph.input {name!r}: shape must be non-negative ints, got {shape}")
        x = self._operand(name, shape, as_dtype(dtype), self._placement(placement, shape, name), None)
        self.inputs[name] = x
        return x

    def param(self, name: str, value: Any, placement: Placement | str | None = None) -> Operand:
        """A constant tensor (a weight): a whole ``torch.Tensor`` split by ``placement`` (default Replicate) once
        when a Runner is built, or a ``DistTensor`` already placed on this mesh, whose pieces every Runner of
        every graph that names it shares (weights loaded once, graphs built per step shape)."""
        x = self._leaf("param", name, value, placement)
        self.params[name] = (x, value)
        return x

    def state(self, name: str, value: Any, placement: Placement | str | None = None) -> Operand:
        """A persistent tensor that ops update in place across runs (a KV cache shard per device): a placed
        ``DistTensor`` (shared by every graph that names it) or a whole ``torch.Tensor`` (split once per Runner).
        An op that writes it returns its new version; later calls must use that version."""
        x = self._leaf("state", name, value, placement)
        self.states[name] = (x, value)
        return x

    def _leaf(self, what: str, name: str, value: Any, placement: Placement | str | None) -> Operand:
        self._new_name(name)
        if isinstance(value, torch.Tensor):
            pl = Replicate() if placement is None else placement
        elif all(hasattr(value, a) for a in ("mesh", "placement", "shape", "dtype", "local")):
            if value.mesh != self.mesh:
                raise GraphError(f"LogicalGraph.{what} {name!r}: the DistTensor is placed on {value.mesh}, "
                                 f"the graph on {self.mesh}")
            if placement is not None and as_placement(placement) != value.placement:
                raise GraphError(f"LogicalGraph.{what} {name!r}: placement {placement} given for a DistTensor "
                                 f"placed as {value.placement}")
            pl = value.placement
        else:
            raise ArgumentError(f"LogicalGraph.{what} {name!r}: value must be a torch.Tensor or a DistTensor, "
                                f"got {type(value).__name__}")
        shape = tuple(value.shape)
        layout = getattr(value, "layout", "strided")
        if not isinstance(layout, str):  # a torch.Tensor's torch.layout
            if layout is not torch.strided:
                raise ArgumentError(f"LogicalGraph.{what} {name!r}: a {layout} tensor has no kernels; pass a "
                                    "dense (strided) tensor")
            if value.is_meta:
                raise DeviceError(f"LogicalGraph.{what} {name!r}: a meta tensor holds no values; pass a tensor on "
                                  "a real device (cpu, cuda)")
            layout = "strided"
        return self._operand(name, shape, value.dtype, self._placement(pl, shape, name), None, layout)

    def output(self, name: str, x: Operand) -> Operand:
        """Mark ``x`` as the result ``name`` of a run."""
        self._own(x, f"output {name!r}")
        if name in self.outputs:
            raise GraphError(f"LogicalGraph.output: output {name!r} is already defined")
        self.outputs[name] = x
        return x

    # -- computation ---------------------------------------------------------------------------

    def call(self, op: str, *args: Any, **kwargs: Any) -> Operand | tuple[Operand, ...]:
        """Call op ``op`` (``"matmul.mm"``, ``"binary.add"``, ``"reduce.sum"`` with ``dim=``...) as ``dtorch.ops``
        would; returns its output Operand, or a tuple of them for an op with several outputs."""
        b = bind(op, args, kwargs)
        for i, o in enumerate(b.inputs):
            if o is not None:
                self._own(o, f"{op} argument {i}")
        name = f"{b.kernel_op}#{next(self._seq)}"
        nout = b.num_outputs
        aliases = b.aliases or (None,) * nout
        glob = as_tuple(name, infer_outputs(name, b.infer, [meta_tensor(o.shape, o.dtype) if o is not None else None
                                                         for o in b.inputs], nout), nout)
        shapes = [o.shape if o is not None else None for o in b.inputs]
        current = [o.placement if o is not None else None for o in b.inputs]
        # to a rule a blocked or unit shard is a shard of its dim (``move_cost`` 0): it stays as it is
        st = choose(b.kernel_op, shapes, current, b.params, n=self.mesh.size, num_outputs=nout,
                    pinned=[a for a in aliases if a is not None], rule=b.rule)
        want = tuple(c if isinstance(c, Shard) and not c.plain and w == _plain(c) else w
                     for c, w in zip(current, st.inputs, strict=False))
        outs = st.output if isinstance(st.output, tuple) else (st.output,)
        if len(outs) != nout:
            raise GraphError(f"graph operator {name}: its placement rule gives {len(outs)} output placements for "
                             f"{nout} outputs")
        # a blocked or unit shard carries over to an output dim of the same extent (blocks and units are per extent)
        shaped = {(c.blocks, c.unit, o.shape[c.dim]) for c, o, w in zip(current, b.inputs, want, strict=False)
                  if isinstance(c, Shard) and not c.plain and w == c}
        if shaped:
            outs = tuple(_carry(p, g.shape, shaped) for p, g in zip(outs, glob, strict=True))
        local_params = st.local_params
        with self._rollback():
            moved = tuple(self._move(o, w) if o is not None else None for o, w in zip(b.inputs, want, strict=False))
            local: list[dict[int, tuple[int, ...]]] = [{} for _ in range(nout)]
            for i in self.mesh.ids:
                metas = [meta_tensor(o.local_shapes[i], o.dtype) if o is not None else None for o in moved]
                for j, t in enumerate(as_tuple(name, infer_outputs(name, b.infer, metas, nout), nout)):
                    local[j][i] = tuple(t.shape)
            per_device = None
            if local_params is not None:
                n = self.mesh.size
                per_device = {i: local_params(b.params, r, n) for r, i in enumerate(self.mesh.ids)}
            for a in aliases:
                if a is not None:
                    self._consume(moved[a], name)
            layout = next((o.layout for o in moved if o is not None and o.layout != "strided"), "strided")
            node = Operator(name, "kernel", b.kernel_op, moved, params=b.params, devices=self.mesh.ids,
                            aliases=aliases, local_params=per_device, layout=layout)
            res = tuple(self._result(node, tuple(g.shape), g.dtype, p, loc)
                        for g, p, loc in zip(glob, outs, local, strict=True))
            return res[0] if nout == 1 else res

    def python(self, fn: Callable[..., torch.Tensor], *inputs: Operand, shape: Sequence[int] | None = None,
               dtype: torch.dtype | None = None, placement: Placement | str | None = None,
               stream: str = COMPUTE, name: str | None = None) -> Operand:
        """A Python kernel: ``fn(*local_tensors) -> tensor`` runs on each device on its local pieces.

        The output's global ``shape``/``dtype`` are inferred by calling ``fn`` on meta tensors unless given.
        ``placement`` (default: the inputs' common placement, else Replicate) is the output's; Partial
        inputs are all-reduced first unless the output is that same Partial.
        """
        if not callable(fn):
            raise ArgumentError(f"LogicalGraph.python: fn must be callable, got {type(fn).__name__}")
        if stream not in (COMPUTE, COMMUNICATE):
            raise ArgumentError(f"LogicalGraph.python: stream must be {COMPUTE!r} or {COMMUNICATE!r}, got {stream!r}")
        for i, o in enumerate(inputs):
            self._own(o, f"python kernel argument {i}")
        label = f"python.{name or getattr(fn, '__name__', 'fn')}#{next(self._seq)}"
        if shape is None or dtype is None:
            out = infer_outputs(label, lambda t: fn(*t), [meta_tensor(o.shape, o.dtype) for o in inputs])
            shape = out.shape if shape is None else shape
            dtype = out.dtype if dtype is None else dtype
        shape = tuple(shape)
        common = {o.placement for o in inputs}
        if placement is None:
            one = next(iter(common)) if len(common) == 1 else Replicate()
            placement = Replicate() if isinstance(one, Partial) else one
        out_pl = self._placement(placement, shape, label)
        with self._rollback():
            # a Partial input reaches fn as it is only when the output is that same Partial; else it is reduced
            moved = tuple(self._move(o, Replicate()) if isinstance(o.placement, Partial) and o.placement != out_pl
                          else o for o in inputs)
            node = Operator(label, "python", label.partition("#")[0], moved, devices=self.mesh.ids, stream=stream,
                            fn=fn)
            local = {i: local_shape(shape, out_pl, r, self.mesh.size) for r, i in enumerate(self.mesh.ids)}
            return self._result(node, shape, as_dtype(dtype), out_pl, local)

    # -- views -------------------------------------------------------------------------------------

    def view(self, x: Operand, shape: Sequence[int]) -> Operand:
        """``x`` reshaped to ``shape`` (global; one -1 allowed) without a copy; each device views its piece."""
        self._own(x, "view")
        self._strided(x, "view")
        name = f"view#{next(self._seq)}"
        new = view_shape(name, x.shape, shape)
        pl = view_placement(name, x.shape, new, x.placement)
        n = self.mesh.size
        local = {i: local_shape(new, pl, r, n) for r, i in enumerate(self.mesh.ids)}
        for i in self.mesh.ids:
            if math.prod(local[i]) != math.prod(x.local_shapes[i]):
                raise GraphError(f"graph view {name}: device {i} holds {list(x.local_shapes[i])} of {x.name} "
                                 f"({x.placement}), which cannot be viewed as its piece {list(local[i])} of "
                                 f"{list(new)} ({pl})")
        with self._rollback():
            node = Operator(name, "view", "view", (x,), params=KernelParams(shape=new), devices=self.mesh.ids)
            return self._result(node, new, x.dtype, pl, None)

    def split(self, x: Operand, sizes: Sequence[int], dim: int = -1) -> tuple[Operand, ...]:
        """``x.split(sizes, dim)`` without copies. Splitting a sharded dim needs ``Shard(dim, blocks=sizes)``."""
        self._own(x, "split")
        self._strided(x, "split")
        name = f"split#{next(self._seq)}"
        sizes = tuple(int(s) for s in sizes)
        dim = dim % x.ndim if -x.ndim <= dim < x.ndim else dim
        if not 0 <= dim < x.ndim or sum(sizes) != x.shape[dim] or min(sizes, default=0) < 0:
            raise GraphError(f"graph split {name}: sizes {list(sizes)} must be non-negative and add up to dim {dim} "
                             f"of {x.name} {list(x.shape)}")
        pls = split_placements(name, x.shape, sizes, dim, x.placement)
        with self._rollback():
            node = Operator(name, "view", "split", (x,), params=KernelParams(sizes=sizes, dim=dim),
                            devices=self.mesh.ids)
            return tuple(self._result(node, x.shape[:dim] + (s,) + x.shape[dim + 1:], x.dtype, pl, None)
                         for s, pl in zip(sizes, pls, strict=True))

    @staticmethod
    def _strided(x: Operand, what: str) -> None:
        if x.layout != "strided":
            raise GraphError(f"graph {what} of {x.name}: a {x.layout} weight holds packed bytes; only kernels of "
                             "its layout (matmul.linear, llm.embedding) read it")

    # -- helpers -------------------------------------------------------------------------------

    def _result(self, node: Operator, shape: tuple[int, ...], dtype: torch.dtype, placement: Placement,
                local: dict[int, tuple[int, ...]] | None) -> Operand:
        out = self._operand(node.name, shape, dtype, placement, node)
        if local is not None:
            for i, got in local.items():
                if got != out.local_shapes[i]:
                    raise GraphError(f"graph operator {node.name}: device {i} would compute shape {list(got)}, but "
                                     f"placement {placement} of {list(shape)} gives it {list(out.local_shapes[i])}")
        node.outputs.append(out)
        if not self.operators or self.operators[-1] is not node:
            self.operators.append(node)
        return out

    def _operand(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, placement: Placement,
                 producer: Operator | None, layout: str = "strided") -> Operand:
        n = self.mesh.size
        local = {i: local_shape(shape, placement, r, n) for r, i in enumerate(self.mesh.ids)}
        x = Operand(self, len(self.operands), name, shape, dtype, placement, producer, local, layout)
        self.operands.append(x)
        return x

    @contextlib.contextmanager
    def _rollback(self) -> Iterator[None]:
        """Undo every operand and operator added inside the block when it raises (no half-built calls)."""
        sizes = (len(self.operands), len(self.operators))
        try:
            yield
        except BaseException:
            del self.operands[sizes[0]:]
            del self.operators[sizes[1]:]
            raise

    def _placement(self, p: object, shape: tuple[int, ...], what: str) -> Placement:
        pl = as_placement(p, f"{what}: placement")
        if isinstance(pl, Shard) and pl.dim >= len(shape):
            raise GraphError(f"{what}: cannot shard dim {pl.dim} of a rank-{len(shape)} tensor {list(shape)}")
        why = pl.check(shape[pl.dim]) if isinstance(pl, Shard) else None
        if why is not None:
            raise GraphError(f"{what}: {pl} cannot split dim {pl.dim} of {list(shape)}: {why}")
        return pl

    def _expect(self, x: Operand, kind: type, op: str) -> None:
        self._own(x, op)
        if not isinstance(x.placement, kind):
            raise GraphError(f"{op} of {x.name}: needs a {kind.__name__} operand, it is {x.placement} "
                             f"(use redistribute to let the graph choose the collective)")

    def _own(self, x: object, what: str) -> None:
        if not isinstance(x, Operand):
            raise ArgumentError(f"{what}: expected an Operand of this graph, got {type(x).__name__}")
        if x.graph is not self:
            raise GraphError(f"{what}: operand {x.name} belongs to another graph")
        if x.index in self._consumed:
            raise GraphError(f"{what}: operand {x.name} was updated in place by {self._consumed[x.index]}; "
                             "use that operator's output (the new version) instead")

    def _consume(self, x: Operand, by: str) -> None:
        """``x`` is written in place by operator ``by``: later calls must use its new version."""
        if x.producer is None and x.name not in self.states:
            raise GraphError(f"graph operator {by}: it writes {x.name} in place, which is a "
                             f"{'param' if x.name in self.params else 'fed input'}; only states "
                             "(LogicalGraph.state) and computed tensors can be updated")
        self._consumed[x.index] = by

    def _new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"LogicalGraph: names must be non-empty strings, got {name!r}")
        if name in self.inputs or name in self.params or name in self.states:
            raise GraphError(f"LogicalGraph: {name!r} is already an input, param or state")

    def __repr__(self) -> str:
        lines = [f"LogicalGraph on {self.mesh}: {len(self.inputs)} inputs, {len(self.params)} params, "
                 f"{len(self.states)} states, {len(self.operators)} ops, {len(self.outputs)} outputs"]
        lines += [f"  input {x}" for x in self.inputs.values()]
        lines += [f"  param {x}" for x, _ in self.params.values()]
        lines += [f"  state {x}" for x, _ in self.states.values()]
        lines += [f"  {node.name}: {node.op}({', '.join(o.name if o else '-' for o in node.inputs)}) -> "
                  f"{', '.join(map(str, node.outputs))} [{node.stream}]" for node in self.operators]
        lines += [f"  output {k} = {v.name}" for k, v in self.outputs.items()]
        return "\n".join(lines)


def _plain(p: Placement | None) -> Placement | None:
    return Shard(p.dim) if isinstance(p, Shard) and not p.plain else p


def _carry(p: Placement, shape: torch.Size, shaped: set) -> Placement:
    if not isinstance(p, Shard) or not p.plain:
        return p
    same = [(bl, u) for bl, u, extent in shaped if extent == shape[p.dim]]
    return Shard(p.dim, *same[0]) if len(same) == 1 else p


__all__ = ["COLLECTIVES", "LogicalGraph"]
