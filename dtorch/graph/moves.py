"""The communication half of ``LogicalGraph`` (its base class): changing an operand's placement, by the collective
(or the local slice) that moves it, explicit collectives, and the point-to-point ``send`` / ``recv`` between the meshes
of two pipeline stages. Every method adds operators to the graph through ``LogicalGraph``'s own bookkeeping
(``_result``, ``_own``, ``_placement``, ``_rollback``), so this class is not used alone."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import GraphError
from dtorch.core.placement import Partial, Placement, Replicate, Shard
from dtorch.dispatch.context import KernelParams
from dtorch.graph.operand import COMMUNICATE, Operand, Operator

if TYPE_CHECKING:
    from dtorch.graph.mesh import DeviceMesh


class GraphMoves:
    """Placement changes and communication operators of a ``LogicalGraph``."""

    # LogicalGraph's: its mesh, operator name counter and the moves already made (each once per operand)
    mesh: DeviceMesh
    _seq: Iterator[int]
    _moves: dict[tuple[int, Placement], Operand]

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

    # -- point to point (pipeline stages) -------------------------------------------------------

    def send(self, x: Operand, peers: Sequence[int]) -> Operand:
        """Send each device's piece of ``x`` to ``peers[r]`` (r: the device's position in the mesh), devices of
        another graph's mesh (the next pipeline stage) whose ``recv`` takes them, on the communicate streams.
        Returns a token [0] that nothing needs to read (the send runs wherever it is in the graph)."""
        self._own(x, "send")
        self._strided(x, "send")
        pairs = self._pairs(peers, "send")
        with self._rollback():
            node = Operator(f"send#{next(self._seq)}", "collective", "send", (x,), params=KernelParams(peers=pairs),
                            stream=COMMUNICATE, devices=self.mesh.ids)
            return self._result(node, (0,), x.dtype, Replicate(), None)

    def recv(self, name: str, shape: Sequence[int], dtype: torch.dtype | str, peers: Sequence[int],
             placement: Placement | str = Replicate()) -> Operand:
        """A tensor ``name`` [shape] that each device receives from ``peers[r]`` (what their graph's ``send``
        gave), on the communicate streams; the operators that read it wait for it."""
        shape = tuple(shape)
        pl = self._placement(placement, shape, f"recv {name!r}")
        pairs = self._pairs(peers, "recv")
        with self._rollback():
            node = Operator(f"recv.{name}#{next(self._seq)}", "collective", "recv", (),
                            params=KernelParams(peers=pairs), stream=COMMUNICATE, devices=self.mesh.ids)
            return self._result(node, shape, as_dtype(dtype), pl, None)

    def _pairs(self, peers: Sequence[int], what: str) -> tuple[tuple[int, int], ...]:
        peers = tuple(int(p) for p in peers)
        if len(peers) != self.mesh.size or set(peers) & set(self.mesh.ids):
            raise GraphError(f"{what}: peers must be {self.mesh.size} devices outside the graph's mesh "
                             f"{list(self.mesh.ids)} (one per device), got {list(peers)}")
        return tuple(zip(self.mesh.ids, peers, strict=True))

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
        if x.layout != "strided":
            raise GraphError(f"{x.name} is a {x.layout} weight placed {src}; it cannot move to {dst} (its bytes are "
                             "packed per device): place it as the operator that reads it expects")
        if self.mesh.size == 1:  # one device holds the whole value under every placement: relabel, move nothing
            node = Operator(f"view#{next(self._seq)}", "view", "view", (x,), params=KernelParams(shape=x.shape),
                            devices=self.mesh.ids)
            return self._result(node, x.shape, x.dtype, dst, None)
        if isinstance(src, Replicate):
            if isinstance(dst, Shard):
                return self._local(x, "shard", dst, dim=dst.dim, shard=dst)
            return self._local(x, "to_partial", dst, reduce=dst.op)
        if isinstance(src, Shard):
            if src.blocks is not None:
                raise GraphError(f"redistribute of {x.name}: a blocked shard {src} cannot be gathered as it is; "
                                 "split it into its blocks first (LogicalGraph.split)")
            return self._move(self._collective("all_gather", x, Replicate(), dim=src.dim), dst)
        if isinstance(dst, Shard) and src.op == "sum" and dst.blocks is None:
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
