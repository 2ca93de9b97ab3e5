"""Copies: ``copy.copy`` (inputs[0] -> outputs[0], casting to the output's dtype; the key dtype is the
SOURCE dtype, so one kernel serves every destination dtype) and ``copy.contiguous`` (a dense copy of
a strided tensor, same dtype). Casts follow torch: float -> int truncates toward zero.
"""

from __future__ import annotations

from dtorch.kernels.torch.registry import KERNELS, NUMERIC


@KERNELS.kernel("copy.copy", NUMERIC)
def copy(ctx, inputs, outputs):
    outputs[0].copy_(inputs[0])


@KERNELS.kernel("copy.contiguous", NUMERIC)
def contiguous(ctx, inputs, outputs):
    outputs[0].copy_(inputs[0])
