"""Creation wrappers: they allocate on ``device`` and run the creation kernel keyed by the output dtype.

``zeros(shape)``, ``ones(shape)``, ``full(shape, value)``, ``empty(shape)`` (default dtype float32) and
``arange(start, end=None, step=1)`` (default dtype as torch: int64 when every bound is an int, else
float32); ``*_out`` forms fill a caller's tensor (``empty`` has none: there is nothing to fill).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dtorch.core.device import Device, as_device, device_of
from dtorch.core.dtypes import ALL_DTYPES, INT_DTYPES, as_dtype, dtype_name
from dtorch.core.errors import ArgumentError, DTypeError
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, declare, replicated

__all__ = ["arange", "arange_out", "empty", "full", "full_out", "ones", "ones_out", "zeros", "zeros_out"]

Shape = int | Sequence[int]
DeviceLike = Device | str | torch.device


def _shape(op: str, shape: object) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
    if isinstance(dims, torch.Size):
        return tuple(dims)
    if not isinstance(dims, (tuple, list)) or any(not isinstance(s, int) or isinstance(s, bool) or s < 0
                                                  for s in dims):
        raise ArgumentError(f"{op}: 'shape' must be a non-negative int or a sequence of them, got {shape!r}")
    return tuple(dims)


def _dtype(op: str, dtype: object) -> torch.dtype:
    dt = as_dtype(dtype)
    if dt not in ALL_DTYPES:
        raise DTypeError(f"{op}: dtype {dtype_name(dt)} is not supported; expected one of "
                         f"{', '.join(dtype_name(d) for d in ALL_DTYPES)}")
    return dt


def _number(op: str, name: str, value: object, dtype: torch.dtype) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{op}: {name!r} must be a Python int or float, got {value!r}")
    if dtype in INT_DTYPES and not isinstance(value, int):
        raise ArgumentError(f"{op}: {name!r} must be an int for dtype {dtype_name(dtype)}, got {value!r}")
    return value


def _create(op: str, shape: tuple[int, ...], dtype: torch.dtype, device: DeviceLike,
            params: KernelParams = NO_PARAMS) -> torch.Tensor:
    dev = as_device(device)
    _checks.allocation(op, "the result", shape, dtype, dev.torch)
    out = torch.empty(shape, dtype=dtype, device=dev.torch)
    run(op, dev, dtype, (), (out,), params)
    return out


def _fill(op: str, out: torch.Tensor, ctx: RuntimeContext | None, params: KernelParams = NO_PARAMS) -> torch.Tensor:
    _checks.tensor(op, "out", out)
    _dtype(op, out.dtype)
    if ctx is None:
        run(op, device_of(out), out.dtype, (), (out,), params)
    else:
        run(op, _checks.on_device(op, "out", out, ctx.device), out.dtype, (), (out,), params, ctx.stream,
            ctx.workspace)
    return out


def zeros(shape: Shape, dtype: torch.dtype | str = torch.float32, device: DeviceLike = "cpu") -> torch.Tensor:
    """A new tensor [shape] of zeros."""
    op = "creation.zeros"
    return _create(op, _shape(op, shape), _dtype(op, dtype), device)


def zeros_out(*, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """Fill ``out`` with zeros."""
    return _fill("creation.zeros", out, ctx)


def ones(shape: Shape, dtype: torch.dtype | str = torch.float32, device: DeviceLike = "cpu") -> torch.Tensor:
    """A new tensor [shape] of ones."""
    op = "creation.ones"
    return _create(op, _shape(op, shape), _dtype(op, dtype), device)


def ones_out(*, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """Fill ``out`` with ones."""
    return _fill("creation.ones", out, ctx)


def full(shape: Shape, value: int | float, dtype: torch.dtype | str = torch.float32,
         device: DeviceLike = "cpu") -> torch.Tensor:
    """A new tensor [shape] filled with ``value`` (an int for integer dtypes)."""
    op = "creation.full"
    dt = _dtype(op, dtype)
    return _create(op, _shape(op, shape), dt, device, full_params(value, dt))


def full_params(value: object, dtype: torch.dtype) -> KernelParams:
    """The owned params of ``full``: the fill value, an int for integer dtypes."""
    return KernelParams(value=_number("creation.full", "value", value, dtype))


def full_out(value: int | float, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """Fill ``out`` with ``value``."""
    op = "creation.full"
    _checks.tensor(op, "out", out)
    return _fill(op, out, ctx, full_params(value, out.dtype))


def empty(shape: Shape, dtype: torch.dtype | str = torch.float32, device: DeviceLike = "cpu") -> torch.Tensor:
    """A new tensor [shape] whose values are whatever the allocation holds."""
    op = "creation.empty"
    return _create(op, _shape(op, shape), _dtype(op, dtype), device)


def _arange_params(op: str, start, end, step, dtype) -> tuple[KernelParams, int, torch.dtype]:
    if end is None:
        start, end = 0, start
    if dtype is None:
        whole = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step))
        dtype = torch.int64 if whole else torch.float32
    dt = _dtype(op, dtype)
    start, end, step = (_number(op, n, v, dt) for n, v in (("start", start), ("end", end), ("step", step)))
    for name, value in (("start", start), ("end", end), ("step", step)):
        if not math.isfinite(value):
            raise ArgumentError(f"{op}: {name!r} must be a finite number, got {value!r}")
    if step == 0:
        raise ArgumentError(f"{op}: 'step' must be non-zero")
    if all(isinstance(v, int) for v in (start, end, step)):
        n = -((start - end) // step)  # ceil((end - start) / step) in exact integer arithmetic
    else:
        n = math.ceil((end - start) / step)
    return KernelParams(start=start, step=step), max(0, n), dt


def arange(start: int | float, end: int | float | None = None, step: int | float = 1,
           dtype: torch.dtype | str | None = None, device: DeviceLike = "cpu") -> torch.Tensor:
    """[N] values start, start + step, ... below ``end`` (above it for a negative step), as torch.arange.

    ``arange(5)`` counts from 0. N = ceil((end - start) / step), at least 0.
    """
    op = "creation.arange"
    params, n, dt = _arange_params(op, start, end, step, dtype)
    return _create(op, (n,), dt, device, params)


def arange_out(start: int | float, end: int | float | None = None, step: int | float = 1, *, out: torch.Tensor,
               ctx: RuntimeContext | None = None) -> torch.Tensor:
    """arange into ``out``, which must have shape [N] (see ``arange``)."""
    op = "creation.arange"
    _checks.tensor(op, "out", out)
    params, n, dt = _arange_params(op, start, end, step, out.dtype)
    _checks.out(op, out, (n,), dt, out.device)
    return _fill(op, out, ctx, params)


# -- in a graph: made on every device of the mesh, whole ---------------------------------------------------------

def _graph_full(op: str, a: Args) -> KernelParams:
    return full_params(a["value"], _dtype(op, a["dtype"]))


def _graph_arange(op: str, a: Args) -> KernelParams:
    return _arange_params(op, a["start"], a["end"], a["step"], a["dtype"])[0]


for _fn, _params in ((zeros, None), (ones, None), (empty, None), (full, _graph_full), (arange, _graph_arange)):
    declare(f"creation.{_fn.__name__}", _fn, (), rule=replicated, creates=True,
            **({"params": _params} if _params is not None else {}))
