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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import ArgumentError, DtorchError, GraphError
from dtorch.dispatch.context import KernelParams
from dtorch.graph.bindings import bind
from dtorch.graph.mesh import DeviceMesh
from dtorch.graph.operand import COMMUNICATE, COMPUTE, Operand, Operator
from dtorch.graph.placement import Partial, Placement, Replicate, Shard, as_placement, local_shape
from dtorch.graph.strategy import choose

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


class LogicalGraph:
    """A graph of ``Operand`` s and ``Operator`` s over ``mesh``; build it, then run it with ``Runner``."""

    def __init__(self, mesh: DeviceMesh) -> None:
        if not isinstance(mesh, DeviceMesh):
            raise ArgumentError(f"LogicalGraph: mesh must be a DeviceMesh, got {type(mesh).__name__}")
        self.mesh = mesh
        self.operands: list[Operand] = []
        self.operators: list[Operator] = []
        self.inputs: dict[str, Operand] = {}
        self.params: dict[str, tuple[Operand, torch.Tensor]] = {}
        self.outputs: dict[str, Operand] = {}
        self._seq = itertools.count()
        self._moves: dict[tuple[int, Placement], Operand] = {}  # each move is made once per operand

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

    def param(self, name: str, value: torch.Tensor, placement: Placement | str = Replicate()) -> Operand:
        """A constant tensor (a weight), split over the mesh by ``placement`` once when a Runner is built."""
        self._new_name(name)
        if not isinstance(value, torch.Tensor):
            raise ArgumentError(f"LogicalGraph.param {name!r}: value must be a torch.Tensor, "
                                f"got {type(value).__name__}")
        shape = tuple(value.shape)
        x = self._operand(name, shape, value.dtype, self._placement(placement, shape, name), None)
        self.params[name] = (x, value)
        return x

    def output(self, name: str, x: Operand) -> Operand:
        """Mark ``x`` as the result ``name`` of a run."""
        self._own(x, f"output {name!r}")
        if name in self.outputs:
            raise GraphError(f"LogicalGraph.output: output {name!r} is already defined")
        self.outputs[name] = x
        return x

    # -- computation ---------------------------------------------------------------------------

    def call(self, op: str, *args: Any, **kwargs: Any) -> Operand:
        """Call kernel op ``op`` (``"matmul.mm"``, ``"binary.add"``, ``"reduce.sum"`` with ``dim=``...)."""
        b = bind(op, args, kwargs)
        for i, o in enumerate(b.inputs):
            if o is not None:
                self._own(o, f"{op} argument {i}")
        name = f"{b.kernel_op}#{next(self._seq)}"
        glob = self._infer(name, b.infer, [_meta(o.shape, o.dtype) if o is not None else None for o in b.inputs])
        shapes = [o.shape if o is not None else None for o in b.inputs]
        want, out_pl = choose(b.kernel_op, shapes, [o.placement if o is not None else None for o in b.inputs],
                              b.params)
        with self._rollback():
            moved = tuple(self._move(o, w) if o is not None else None for o, w in zip(b.inputs, want, strict=False))
            local = {}
            for i in self.mesh.ids:
                metas = [_meta(o.local_shapes[i], o.dtype) if o is not None else None for o in moved]
                local[i] = tuple(self._infer(name, b.infer, metas).shape)
            node = Operator(name, "kernel", b.kernel_op, moved, params=b.params, devices=self.mesh.ids)
            return self._result(node, tuple(glob.shape), glob.dtype, out_pl, local)

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
            out = self._infer(label, lambda t: fn(*t), [_meta(o.shape, o.dtype) for o in inputs])
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

    # -- communication -------------------------------------------------------------------------

    def redistribute(self, x: Operand, placement: Placement | str) -> Operand:
        """``x`` with another placement; inserts the collective (or local slice) that moves it."""
        self._own(x, "redistribute")
        dst = self._placement(placement, x.shape, f"redistribute of {x.name}")
        with self._rollback():
            return self._move(x, dst)

    def all_reduce(self, x: Operand, op: str | None = None) -> Operand:
        """Partial -> Replicate, explicitly."""
        self._expect(x, Partial, "all_reduce")
        if op is not None and op != x.placement.op:
            raise GraphError(f"all_reduce of {x.name}: it is Partial({x.placement.op!r}), not {op!r}")
        return self._collective("all_reduce", x, Replicate(), op=x.placement.op)

    def all_gather(self, x: Operand) -> Operand:
        """Shard -> Replicate, explicitly."""
        self._expect(x, Shard, "all_gather")
        return self._collective("all_gather", x, Replicate(), dim=x.placement.dim)

    def reduce_scatter(self, x: Operand, dim: int = 0) -> Operand:
        """Partial("sum") -> Shard(dim), explicitly."""
        self._expect(x, Partial, "reduce_scatter")
        dst = self._placement(Shard(dim), x.shape, "reduce_scatter")
        return self._collective("reduce_scatter", x, dst, dim=dim, op=x.placement.op)

    def broadcast(self, x: Operand, src: int = 0) -> Operand:
        """Replicate -> Replicate, taking the values held by global device ``src``."""
        self._expect(x, Replicate, "broadcast")
        self.mesh.rank(src)
        return self._collective("broadcast", x, Replicate(), src=src)

    def _move(self, x: Operand, dst: Placement) -> Operand:
        if x.placement == dst:
            return x
        done = self._moves.get((x.index, dst))
        if done is not None and done.index < len(self.operands) and self.operands[done.index] is done:
            return done
        moved = self._move_once(x, dst)
        self._moves[(x.index, dst)] = moved
        return moved

    def _move_once(self, x: Operand, dst: Placement) -> Operand:
        src = x.placement
        if isinstance(src, Replicate):
            if isinstance(dst, Shard):
                return self._local(x, "shard", dst, dim=dst.dim)
            return self._local(x, "to_partial", dst, reduce=dst.op)
        if isinstance(src, Shard):
            return self._move(self._collective("all_gather", x, Replicate(), dim=src.dim), dst)
        if isinstance(dst, Shard) and src.op == "sum":
            return self._collective("reduce_scatter", x, dst, dim=dst.dim, op="sum")
        return self._move(self._collective("all_reduce", x, Replicate(), op=src.op), dst)

    def _collective(self, op: str, x: Operand, dst: Placement, /, **params: Any) -> Operand:
        node = Operator(f"{op}#{next(self._seq)}", "collective", op, (x,), params=KernelParams(**params),
                        stream=COMMUNICATE, devices=self.mesh.ids)
        return self._result(node, x.shape, x.dtype, dst, None)

    def _local(self, x: Operand, op: str, dst: Placement, /, **params: Any) -> Operand:
        node = Operator(f"{op}#{next(self._seq)}", "local", op, (x,), params=KernelParams(**params),
                        devices=self.mesh.ids)
        return self._result(node, x.shape, x.dtype, dst, None)

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
        self.operators.append(node)
        return out

    def _operand(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, placement: Placement,
                 producer: Operator | None) -> Operand:
        n = self.mesh.size
        local = {i: local_shape(shape, placement, r, n) for r, i in enumerate(self.mesh.ids)}
        x = Operand(self, len(self.operands), name, shape, dtype, placement, producer, local)
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

    def _infer(self, name: str, infer: Callable, metas: list) -> torch.Tensor:
        try:
            out = infer(metas)
        except DtorchError as exc:
            raise type(exc)(f"graph operator {name}: {exc}") from exc
        except Exception as exc:
            raise GraphError(f"graph operator {name}: inferring its output on meta tensors failed: "
                             f"{type(exc).__name__}: {exc} (give shape= and dtype= for a Python kernel)") from exc
        if not isinstance(out, torch.Tensor):
            raise GraphError(f"graph operator {name}: must produce one tensor, got {type(out).__name__}")
        return out

    def _placement(self, p: object, shape: tuple[int, ...], what: str) -> Placement:
        pl = as_placement(p, f"{what}: placement")
        if isinstance(pl, Shard) and pl.dim >= len(shape):
            raise GraphError(f"{what}: cannot shard dim {pl.dim} of a rank-{len(shape)} tensor {list(shape)}")
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

    def _new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"LogicalGraph: names must be non-empty strings, got {name!r}")
        if name in self.inputs or name in self.params:
            raise GraphError(f"LogicalGraph: {name!r} is already an input or param")

    def __repr__(self) -> str:
        lines = [f"LogicalGraph on {self.mesh}"]
        lines += [f"  input {x}" for x in self.inputs.values()]
        lines += [f"  param {x}" for x, _ in self.params.values()]
        lines += [f"  {node.name}: {node.op}({', '.join(o.name if o else '-' for o in node.inputs)}) -> "
                  f"{node.outputs[0]} [{node.stream}]" for node in self.operators]
        lines += [f"  output {k} = {v.name}" for k, v in self.outputs.items()]
        return "\n".join(lines)


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


__all__ = ["COLLECTIVES", "LogicalGraph"]
