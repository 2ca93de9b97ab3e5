"""Copies: ``copy(x, dtype=None)`` / ``copy_out(x, out=)`` (with a dtype cast) and ``contiguous(x)``.

The kernel key of ``copy.copy`` is the SOURCE dtype: one kernel per source serves every destination.
"""

from __future__ import annotations

import torch

from dtorch.core.device import device_of
from dtorch.core.dtypes import ALL_DTYPES, as_dtype, dtype_name
from dtorch.core.errors import DTypeError, LayoutError
from dtorch.dispatch.context import KernelParams
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Shapes, Strategy, declare, elementwise

__all__ = ["contiguous", "contiguous_out", "copy", "copy_out"]


def _target(op: str, dtype: torch.dtype | str) -> torch.dtype:
    dt = as_dtype(dtype)
    if dt not in ALL_DTYPES:
        raise DTypeError(f"{op}: cannot copy to {dtype_name(dt)}; supported: "
                         f"{', '.join(dtype_name(d) for d in ALL_DTYPES)}")
    return dt


def _run(op: str, x: torch.Tensor, out: torch.Tensor, ctx: RuntimeContext | None) -> torch.Tensor:
    if ctx is None:
        run(op, device_of(x), x.dtype, (x,), (out,))
    else:
        run(op, _checks.on_device(op, "x", x, ctx.device), x.dtype, (x,), (out,), stream=ctx.stream,
            workspace=ctx.workspace)
    return out


def copy(x: torch.Tensor, dtype: torch.dtype | str | None = None) -> torch.Tensor:
    """A new dense tensor with x's values [...], cast to ``dtype`` (default: x's dtype)."""
    op = "copy.copy"
    _checks.tensor(op, "x", x)
    dt = x.dtype if dtype is None else _target(op, dtype)
    return _run(op, x, torch.empty(x.shape, dtype=dt, device=x.device), None)


def copy_out(x: torch.Tensor, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """Copy x [...] into ``out`` (same shape and device; any supported dtype: values are cast)."""
    op = "copy.copy"
    _checks.tensor(op, "x", x)
    _checks.tensor(op, "out", out)
    _target(op, out.dtype)
    _checks.out(op, out, x.shape, out.dtype, x.device)
    return _run(op, x, out, ctx)


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when it is already contiguous, else a dense copy [...] of the same dtype."""
    _checks.tensor("copy.contiguous", "x", x)
    if x.is_contiguous():
        return x
    return _run("copy.contiguous", x, torch.empty(x.shape, dtype=x.dtype, device=x.device), None)


def contiguous_out(x: torch.Tensor, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """A dense copy of x into ``out``, which must be contiguous with x's shape, dtype and device."""
    op = "copy.contiguous"
    _checks.tensor(op, "x", x)
    _checks.out(op, out, x.shape, x.dtype, x.device)
    if not out.is_contiguous():
        raise LayoutError(f"{op}: 'out' must be contiguous, got strides {out.stride()} for shape {tuple(out.shape)}")
    return _run(op, x, out, ctx)


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    return elementwise(len(shapes[0]), partial_ok=False)  # a cast of a partial sum is not the sum of casts


declare("copy.copy", copy, ("x",), rule=_rule)
declare("copy.contiguous", contiguous, ("x",), rule=_rule)
