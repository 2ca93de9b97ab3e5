"""Reductions over one dim: ``reduce.sum``, ``reduce.mean``, ``reduce.max``, ``reduce.min``, ``reduce.argmax``.

input: x [...]; params: dim (a non-negative int < rank, or 0 for a 0-d tensor), keepdim (bool).
output: x's shape without ``dim`` (or with it as 1 when keepdim).

Integer semantics (dtorch's choice, unlike torch's promotion of integer sums to int64): every reduction
keeps the input dtype, except argmax, whose output is int64. Integer sums accumulate in int64 and are
cast back, so they wrap exactly like the same sum computed in the input dtype. ``mean`` is float only
(the mean of integers is not an integer); max, min and argmax are exact on integers.
Float sums and means of half types accumulate in float32.
"""

from __future__ import annotations

import torch

from dtorch.kernels.torch.registry import FLOATS, INTS, KERNELS

# Capture-safe (the default meta): no kernel here reads a value on the host; the widened copies that sum and
# mean reduce come from torch's caching allocator, which capture allows.


def _wide(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    if x.dtype in INTS:
        return x.long()
    return x


@KERNELS.kernel("reduce.sum", FLOATS + INTS)
def sum_reference(ctx, inputs, outputs):
    p = ctx.params
    outputs[0].copy_(torch.sum(_wide(inputs[0]), p.dim, keepdim=p.keepdim))


@KERNELS.kernel("reduce.mean", FLOATS)
def mean_reference(ctx, inputs, outputs):
    p = ctx.params
    outputs[0].copy_(torch.mean(_wide(inputs[0]), p.dim, keepdim=p.keepdim))


@KERNELS.kernel("reduce.max", FLOATS + INTS)
def max_reference(ctx, inputs, outputs):
    p = ctx.params
    torch.amax(inputs[0], p.dim, keepdim=p.keepdim, out=outputs[0])


@KERNELS.kernel("reduce.min", FLOATS + INTS)
def min_reference(ctx, inputs, outputs):
    p = ctx.params
    torch.amin(inputs[0], p.dim, keepdim=p.keepdim, out=outputs[0])


@KERNELS.kernel("reduce.argmax", FLOATS + INTS)
def argmax_reference(ctx, inputs, outputs):
    p = ctx.params
    torch.argmax(inputs[0], p.dim, keepdim=p.keepdim, out=outputs[0])  # first index among equal maxima
