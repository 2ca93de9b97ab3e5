"""Creation kernels: no inputs; they fill ``outputs[0]``, whose dtype is the key's dtype.

``creation.zeros``, ``creation.ones``, ``creation.full`` (params.value), ``creation.arange`` (params start,
step: out[i] = start + i * step, computed in float64 for floats and int64 for ints, then cast) and
``creation.empty`` (no-op: the wrapper already allocated the output).
"""

from __future__ import annotations

import torch

from dtorch.kernels.torch.registry import FLOATS, INTS, KERNELS, NUMERIC


@KERNELS.kernel("creation.zeros", NUMERIC)
def zeros(ctx, inputs, outputs):
    outputs[0].zero_()


@KERNELS.kernel("creation.ones", NUMERIC)
def ones(ctx, inputs, outputs):
    outputs[0].fill_(1)


@KERNELS.kernel("creation.full", NUMERIC)
def full(ctx, inputs, outputs):
    outputs[0].fill_(ctx.params.value)


def _arange(ctx, inputs, outputs):
    out = outputs[0]  # [N]
    wide = torch.float64 if out.dtype.is_floating_point else torch.int64
    idx = torch.arange(out.shape[0], dtype=wide, device=out.device)
    out.copy_(idx * ctx.params.step + ctx.params.start)


KERNELS.add("creation.arange", _arange, FLOATS + INTS)


@KERNELS.kernel("creation.empty", NUMERIC)
def empty(ctx, inputs, outputs):
    """Nothing to do: empty memory is whatever the wrapper's allocation holds."""
