"""Convolutions ``conv.conv1d`` and ``conv.conv2d`` (cross-correlation, as torch), float dtypes only.

inputs: x [B, C_in, L] or [B, C_in, H, W]; w [C_out, C_in / groups, k] or [C_out, C_in / groups, kh, kw];
bias [C_out] or None. params: stride, padding, dilation (tuples of 1 or 2 ints), groups (int).
outputs: [B, C_out, L_out] or [B, C_out, H_out, W_out].

The reference kernels are im2col + a grouped matmul (accumulated in float32 for half types); torch's
F.conv1d / F.conv2d are registered over them as provider "torch" (torch has no out= form: the out
kernel copies; the allocating form serves the functional wrappers).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dtorch.kernels.torch.registry import FLOATS, KERNELS

# Capture-safe (the default meta): no kernel here reads a value on the host; im2col columns and torch's conv
# result come from torch's caching allocator, which capture allows.


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _grouped_matmul(cols: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """cols: [B, C_in * taps, P] (channel-major), w: [C_out, C_in / groups, *kernel] -> [B, C_out, P]."""
    acc = _acc_dtype(cols.dtype)
    bsz, _, positions = cols.shape
    c_out = w.shape[0]
    per_group = math.prod(w.shape[1:])  # C_in/G * taps
    cols = cols.to(acc).reshape(bsz, groups, per_group, positions)  # [B, G, C_in/G * taps, P]
    wg = w.to(acc).reshape(groups, c_out // groups, per_group)  # [G, C_out/G, C_in/G * taps]
    y = torch.einsum("gok,bgkp->bgop", wg, cols).reshape(bsz, c_out, positions)
    if bias is not None:
        y = y + bias.to(acc)[None, :, None]
    return y


@KERNELS.kernel("conv.conv1d", FLOATS)
def conv1d_reference(ctx, inputs, outputs):
    x, w, bias = inputs
    p = ctx.params
    (stride,), (padding,), (dilation,) = p.stride, p.padding, p.dilation
    k = w.shape[-1]
    span = dilation * (k - 1) + 1
    xp = F.pad(x, (padding, padding))  # [B, C, L + 2p]
    windows = xp.unfold(2, span, stride)[..., ::dilation]  # [B, C, L_out, k]
    cols = windows.permute(0, 1, 3, 2).reshape(x.shape[0], x.shape[1] * k, windows.shape[2])  # [B, C * k, L_out]
    outputs[0].copy_(_grouped_matmul(cols, w, bias, p.groups))


def _conv1d_torch(ctx, inputs):
    p = ctx.params
    return (F.conv1d(inputs[0], inputs[1], inputs[2], p.stride, p.padding, p.dilation, p.groups),)


@KERNELS.kernel("conv.conv1d", FLOATS, provider="torch", functional=_conv1d_torch)
def conv1d_torch(ctx, inputs, outputs):
    outputs[0].copy_(_conv1d_torch(ctx, inputs)[0])


@KERNELS.kernel("conv.conv2d", FLOATS)
def conv2d_reference(ctx, inputs, outputs):
    x, w, bias = inputs
    p = ctx.params
    out = outputs[0]
    cols = F.unfold(x, w.shape[-2:], dilation=p.dilation, padding=p.padding, stride=p.stride)  # [B, C*kh*kw, P]
    out.copy_(_grouped_matmul(cols, w, bias, p.groups).reshape(out.shape))


def _conv2d_torch(ctx, inputs):
    p = ctx.params
    return (F.conv2d(inputs[0], inputs[1], inputs[2], p.stride, p.padding, p.dilation, p.groups),)


@KERNELS.kernel("conv.conv2d", FLOATS, provider="torch", functional=_conv2d_torch)
def conv2d_torch(ctx, inputs, outputs):
    outputs[0].copy_(_conv2d_torch(ctx, inputs)[0])
