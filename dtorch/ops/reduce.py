"""Reductions over one dim: ``sum``, ``mean``, ``max``, ``min`` (values), ``argmax`` (+ ``*_out``).

x: [...] -> x's shape without ``dim`` (kept as 1 when ``keepdim``). Outputs keep x's dtype (integer sums
wrap, they are not promoted to int64 as in torch), except argmax, which returns int64 indices. mean is
defined for float dtypes only; max, min and argmax refuse an empty ``dim``.
"""

from __future__ import annotations

import torch

from dtorch.core.device import device_of
from dtorch.core.errors import ArgumentError, ShapeError
from dtorch.core.placement import Partial, Shard
from dtorch.dispatch.context import KernelParams
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, P, R, Shapes, Strategy, declare

__all__ = ["argmax", "argmax_out", "max", "max_out", "mean", "mean_out", "min", "min_out", "sum", "sum_out"]

_NEEDS_ELEMENTS = ("max", "min", "argmax")  # no identity element: an empty dim has no answer
_PARAMS: dict[tuple[int, bool], KernelParams] = {}


def _params(dim: int, keepdim: bool) -> KernelParams:
    p = _PARAMS.get((dim, keepdim))
    if p is None:
        p = _PARAMS[(dim, keepdim)] = KernelParams(dim=dim, keepdim=keepdim)
    return p


def reduced_shape(op: str, x: torch.Tensor, dim: int, keepdim: bool) -> tuple[tuple[int, ...], int]:
    """(output shape, normalised dim) of reducing x over ``dim``; raises on a bad dim or an empty one."""
    if not isinstance(keepdim, bool):
        raise ArgumentError(f"{op}: 'keepdim' must be a bool, got {keepdim!r}")
    d = _checks.dim_index(op, dim, x.dim())
    if x.dim() == 0:
        return (), 0
    if x.shape[d] == 0 and op.removeprefix("reduce.") in _NEEDS_ELEMENTS:
        raise ShapeError(f"{op}: cannot reduce over dim {dim} of size 0 (x shape {tuple(x.shape)}): "
                         "there is no maximum or minimum of nothing")
    shape = list(x.shape)
    if keepdim:
        shape[d] = 1
    else:
        del shape[d]
    return tuple(shape), d


def _reduce(name: str, x: torch.Tensor, dim: int, keepdim: bool, out: torch.Tensor | None = None,
            ctx: RuntimeContext | None = None) -> torch.Tensor:
    op = f"reduce.{name}"
    _checks.tensor(op, "x", x)
    shape, d = reduced_shape(op, x, dim, keepdim)
    dtype = torch.int64 if name == "argmax" else x.dtype
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=x.device)
    else:
        _checks.out(op, out, shape, dtype, x.device)
    if ctx is None:
        run(op, device_of(x), x.dtype, (x,), (out,), _params(d, keepdim))
    else:
        device = _checks.on_device(op, "x", x, ctx.device)
        run(op, device, x.dtype, (x,), (out,), _params(d, keepdim), ctx.stream, ctx.workspace)
    return out


def sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:  # noqa: A001 - torch's name
    """``reduce.sum`` of x [...] over ``dim``, in x's dtype."""
    return _reduce("sum", x, dim, keepdim)


def sum_out(x: torch.Tensor, dim: int, keepdim: bool = False, *, out: torch.Tensor,
            ctx: RuntimeContext | None = None) -> torch.Tensor:
    return _reduce("sum", x, dim, keepdim, out, ctx)


def mean(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``reduce.mean`` of a float x [...] over ``dim`` (NaN over an empty dim, as torch)."""
    return _reduce("mean", x, dim, keepdim)


def mean_out(x: torch.Tensor, dim: int, keepdim: bool = False, *, out: torch.Tensor,
             ctx: RuntimeContext | None = None) -> torch.Tensor:
    return _reduce("mean", x, dim, keepdim, out, ctx)


def max(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:  # noqa: A001 - torch's name
    """``reduce.max``: the largest values of x [...] over ``dim`` (values only, like torch.amax)."""
    return _reduce("max", x, dim, keepdim)


def max_out(x: torch.Tensor, dim: int, keepdim: bool = False, *, out: torch.Tensor,
            ctx: RuntimeContext | None = None) -> torch.Tensor:
    return _reduce("max", x, dim, keepdim, out, ctx)


def min(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:  # noqa: A001 - torch's name
    """``reduce.min``: the smallest values of x [...] over ``dim`` (values only, like torch.amin)."""
    return _reduce("min", x, dim, keepdim)


def min_out(x: torch.Tensor, dim: int, keepdim: bool = False, *, out: torch.Tensor,
            ctx: RuntimeContext | None = None) -> torch.Tensor:
    return _reduce("min", x, dim, keepdim, out, ctx)


def argmax(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``reduce.argmax``: int64 index of the first maximum of x [...] over ``dim``."""
    return _reduce("argmax", x, dim, keepdim)


def argmax_out(x: torch.Tensor, dim: int, keepdim: bool = False, *, out: torch.Tensor,
               ctx: RuntimeContext | None = None) -> torch.Tensor:
    return _reduce("argmax", x, dim, keepdim, out, ctx)


# -- in a graph -------------------------------------------------------------------------------------------------

def _graph_params(op: str, a: Args) -> KernelParams:
    x = a["x"]
    _, d = reduced_shape(op, torch.empty(x.shape, dtype=x.dtype, device="meta"), a["dim"], a["keepdim"])
    return _params(d, a["keepdim"])


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    nd, dim, keepdim = len(shapes[0]), params.dim, params.keepdim
    out = [Strategy((R,), R)]
    out += [Strategy((Shard(e),), Shard(e if keepdim or e < dim else e - 1)) for e in range(nd) if e != dim]
    if op == "reduce.sum":
        out += [Strategy((Shard(dim),), P), Strategy((P,), P)]
    if op == "reduce.max":
        out.append(Strategy((Shard(dim),), Partial("max")))
    return out


for _fn in (sum, mean, max, min, argmax):
    declare(f"reduce.{_fn.__name__}", _fn, ("x",), params=_graph_params, rule=_rule)
