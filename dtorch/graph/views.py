"""Placement rules of the graph's views: ``view`` (reshape without a copy) and ``split`` along a dim.

Views run as no kernel at all where the Runner plans static buffers (the view is taken once at build),
and as a cheap local view per run otherwise. A shard survives a view when its dim is not torn apart: a
dim split into (outer, inner...) keeps the shard on the outer dim, dims merged with the sharded one in
front keep it on the merged dim (blocks scale with the inner extent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dtorch.core.errors import GraphError
from dtorch.core.placement import Placement, Replicate, Shard


def view_shape(name: str, shape: tuple[int, ...], new: Sequence[int]) -> tuple[int, ...]:
    """``new`` with one -1 resolved; its element count must equal ``shape``'s."""
    new = [int(s) for s in new]
    total = math.prod(shape)
    if new.count(-1) > 1 or any(s < -1 for s in new):
        raise GraphError(f"graph view {name}: at most one -1 and no other negative size, got {new}")
    if -1 in new:
        rest = math.prod(s for s in new if s != -1)
        if rest == 0 or total % rest:
            raise GraphError(f"graph view {name}: cannot view {list(shape)} as {new}")
        new[new.index(-1)] = total // rest
    if math.prod(new) != total:
        raise GraphError(f"graph view {name}: cannot view {list(shape)} ({total} elements) as {new}")
    return tuple(new)


def view_placement(name: str, shape: tuple[int, ...], new: tuple[int, ...], p: Placement) -> Placement:
    """The placement of ``x.view(new)`` for ``x`` of global ``shape`` placed as ``p``."""
    if not isinstance(p, Shard):
        return p
    d = p.dim
    before = math.prod(shape[:d])
    e, acc = 0, 1
    while e < len(new) and acc < before:
        acc *= new[e]
        e += 1
    while e < len(new) - 1 and new[e] == 1 and shape[d] != 1:  # skip new unit dims in front of the shard
        e += 1
    if acc != before or e >= len(new):
        raise GraphError(f"graph view {name}: viewing {list(shape)} as {list(new)} tears apart sharded dim {d} "
                         f"({p}); shard another dim or replicate first")
    if new[e] == shape[d]:  # the dim keeps its extent
        return Shard(e, p.blocks, p.unit)
    units = p.unit if isinstance(p.unit, tuple) else (p.unit,)
    if shape[d] % new[e] == 0 and math.prod(new[e:]) % math.prod(shape[d:]) == 0:  # split: keep the outer part
        inner = shape[d] // new[e]
        if any(u % inner for u in units) or (p.blocks is not None and any(b % inner for b in p.blocks)):
            raise GraphError(f"graph view {name}: viewing {list(shape)} as {list(new)} would cut the pieces of "
                             f"{p} (an inner extent of {inner}); shard in whole units of it")
        return _scaled(p, e, inner, divide=True)
    # merge: dim d and the dims after it (up to the extent of new[e]) become one
    f, acc = d, 1
    while f < len(shape) and acc < new[e]:
        acc *= shape[f]
        f += 1
    if acc != new[e]:
        raise GraphError(f"graph view {name}: viewing {list(shape)} as {list(new)} tears apart sharded dim {d} "
                         f"({p}); shard another dim or replicate first")
    return _scaled(p, e, math.prod(shape[d + 1:f]), divide=False)


def _scaled(p: Shard, dim: int, k: int, divide: bool) -> Shard:
    """``p`` moved to ``dim`` with its blocks and units divided (or multiplied) by ``k``."""
    def f(v: int) -> int:
        return v // k if divide else v * k
    units = tuple(f(u) for u in p.unit) if isinstance(p.unit, tuple) else f(p.unit)
    return Shard(dim, None if p.blocks is None else tuple(f(b) for b in p.blocks), units)


def split_placements(name: str, shape: tuple[int, ...], sizes: Sequence[int], dim: int,
                     p: Placement) -> tuple[Placement, ...]:
    """Placements of the pieces of ``x.split(sizes, dim)``: a shard of another dim stays; a shard of ``dim`` must be
    blocked so that each part takes whole blocks (each device then holds its piece of every part): a part of one
    block is a plain (or unit) shard, a part of several stays blocked."""
    if isinstance(p, Shard) and p.dim == dim:
        runs, out = p.runs(shape[dim]), []
        for size in sizes:  # each part takes whole blocks: one (a plain or unit shard) or several (still blocked)
            take, total = [], 0
            while runs and total < size:
                take.append(runs.pop(0))
                total += take[-1][0]
            if total != size or p.blocks is None:
                raise GraphError(f"graph split {name}: splitting dim {dim} into {list(sizes)} needs the operand "
                                 f"sharded in blocks that the parts can take whole (Shard({dim}, blocks=...)), it is "
                                 f"{p}")
            units = tuple(u for _, u in take)
            out.append(Shard(dim, None, units[0]) if len(take) == 1 else Shard(dim, tuple(b for b, _ in take), units))
        return tuple(out)
    if isinstance(p, Shard) and not p.plain:
        raise GraphError(f"graph split {name}: cannot split a {p} operand on dim {dim}")
    return tuple(p for _ in sizes)


__all__ = ["Replicate", "split_placements", "view_placement", "view_shape"]
