"""Convolution wrappers ``conv1d`` / ``conv2d`` (+ ``*_out``), torch's argument order and semantics.

x: [B, C_in, L] or [B, C_in, H, W]; w: [C_out, C_in / groups, k] or [C_out, C_in / groups, kh, kw];
bias: [C_out] or None. stride, padding (>= 0) and dilation take an int or one int per spatial dim.
"""

from __future__ import annotations

import torch

from dtorch.core.errors import ArgumentError, ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import KernelParams
from dtorch.ops import _checks
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, P, R, Shapes, Strategy, declare, opt
from dtorch.ops.matmul import _launch, _operands

__all__ = ["conv1d", "conv1d_out", "conv2d", "conv2d_out"]

IntOrPair = int | tuple[int, ...]


def _ints(op: str, name: str, value: object, n: int, minimum: int) -> tuple[int, ...]:
    """An int or a sequence of ``n`` ints, each >= ``minimum``, as an n-tuple."""
    items = (value,) * n if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)) or len(items) != n or any(
            not isinstance(v, int) or isinstance(v, bool) or v < minimum for v in items):
        raise ArgumentError(f"{op}: {name!r} must be an int >= {minimum} or {n} such ints, got {value!r}")
    return tuple(items)


def _conv_shape(op: str, nd: int, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                p: KernelParams) -> tuple[int, ...]:
    spatial = "L" if nd == 1 else "H, W"
    kernel = "k" if nd == 1 else "kh, kw"
    if x.dim() != nd + 2:
        raise ShapeError(f"{op}: 'x' must be [B, C_in, {spatial}] (rank {nd + 2}), got shape {tuple(x.shape)}")
    if w.dim() != nd + 2:
        raise ShapeError(f"{op}: 'w' must be [C_out, C_in / groups, {kernel}] (rank {nd + 2}), "
                         f"got shape {tuple(w.shape)}")
    groups, c_in, c_out = p.groups, x.shape[1], w.shape[0]
    if c_in % groups or c_out % groups:
        raise ShapeError(f"{op}: groups={groups} must divide C_in={c_in} and C_out={c_out}")
    if w.shape[1] != c_in // groups:
        raise ShapeError(f"{op}: 'w' has {w.shape[1]} input channels per group; with C_in={c_in} and "
                         f"groups={groups} it must have {c_in // groups} (w shape {tuple(w.shape)})")
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise ShapeError(f"{op}: 'bias' must have shape [C_out] = ({c_out},), got {tuple(bias.shape)}")
    sizes = []
    for i in range(nd):
        n, k = x.shape[2 + i], w.shape[2 + i]
        padded, span = n + 2 * p.padding[i], p.dilation[i] * (k - 1) + 1
        if padded < span:
            raise ShapeError(f"{op}: spatial dim {i} of 'x' is {n} (+ padding {p.padding[i]} on each side), smaller "
                             f"than the dilated kernel size {span}")
        sizes.append((padded - span) // p.stride[i] + 1)
    return (x.shape[0], c_out, *sizes)


def conv_params(nd: int, stride: object = 1, padding: object = 0, dilation: object = 1,
                groups: object = 1) -> KernelParams:
    """The owned params of a ``conv{nd}d`` call: stride, padding, dilation as nd-tuples, and groups."""
    op = f"conv.conv{nd}d"
    return KernelParams(stride=_ints(op, "stride", stride, nd, 1), padding=_ints(op, "padding", padding, nd, 0),
                        dilation=_ints(op, "dilation", dilation, nd, 1),
                        groups=_checks.positive_int(op, "groups", groups))


def _conv(nd: int, x, w, bias, stride, padding, dilation, groups, out=None, ctx=None) -> torch.Tensor:
    op = f"conv.conv{nd}d"
    dtype, device = _operands(op, {"x": x, "w": w, "bias": bias}, ctx)
    params = conv_params(nd, stride, padding, dilation, groups)
    shape = _conv_shape(op, nd, x, w, bias, params)
    return _launch(op, (x, w, bias), shape, dtype, device, out, ctx, params, ("x", "w", "bias"))


def conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, stride: IntOrPair = 1,
           padding: IntOrPair = 0, dilation: IntOrPair = 1, groups: int = 1) -> torch.Tensor:
    """``conv.conv1d``: x [B, C_in, L], w [C_out, C_in / groups, k], bias [C_out] -> [B, C_out, L_out]."""
    return _conv(1, x, w, bias, stride, padding, dilation, groups)


def conv1d_out(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, stride: IntOrPair = 1,
               padding: IntOrPair = 0, dilation: IntOrPair = 1, groups: int = 1, *, out: torch.Tensor,
               ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``conv.conv1d`` into ``out`` [B, C_out, L_out]."""
    return _conv(1, x, w, bias, stride, padding, dilation, groups, out, ctx)


def conv2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, stride: IntOrPair = 1,
           padding: IntOrPair = 0, dilation: IntOrPair = 1, groups: int = 1) -> torch.Tensor:
    """``conv.conv2d``: x [B, C_in, H, W], w [C_out, C_in / groups, kh, kw], bias [C_out] -> [B, C_out, H', W']."""
    return _conv(2, x, w, bias, stride, padding, dilation, groups)


def conv2d_out(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, stride: IntOrPair = 1,
               padding: IntOrPair = 0, dilation: IntOrPair = 1, groups: int = 1, *, out: torch.Tensor,
               ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``conv.conv2d`` into ``out`` [B, C_out, H_out, W_out]."""
    return _conv(2, x, w, bias, stride, padding, dilation, groups, out, ctx)


# -- in a graph -------------------------------------------------------------------------------------------------

def _graph_params(op: str, a: Args) -> KernelParams:
    return conv_params(int(op[-2]), a["stride"], a["padding"], a["dilation"], a["groups"])


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [B, C_in, *spatial], w [C_out, C_in / groups, *k], bias [C_out] or None -> [B, C_out, *spatial']
    bias = shapes[2]
    out = [Strategy((R, R, opt(bias, R)), R), Strategy((Shard(0), R, opt(bias, R)), Shard(0))]
    if params.groups == 1:  # with groups, a channel split would have to follow the group boundaries
        out.append(Strategy((R, Shard(0), opt(bias, Shard(0))), Shard(1)))  # output channels
        if bias is None:
            out.append(Strategy((Shard(1), Shard(1), None), P))  # input channels: partial sums
    return out


declare("conv.conv1d", conv1d, ("x", "w", "bias"), params=_graph_params, rule=_rule)
declare("conv.conv2d", conv2d, ("x", "w", "bias"), params=_graph_params, rule=_rule)
