"""16-bit weights beside wider activations: the layouts "f16" and "bf16".

A float16 (bfloat16) weight [N, K] of a model that computes in float32 stays 16-bit: it is a plain torch tensor
[N, K] of that dtype, and kernels keyed ``KernelKey(op, device, activation dtype, "f16")`` read it as it is,
converting what they read (``dtorch.kernels.torch.half``). Rows and columns slice like any tensor, so tensor
parallelism splits it as it splits float weights. Where the activations have the weight's own dtype, the weight is
an ordinary strided tensor instead.
"""

from __future__ import annotations

import torch

HALF_LAYOUTS: dict[str, torch.dtype] = {"f16": torch.float16, "bf16": torch.bfloat16}


def half_layout(dtype: torch.dtype) -> str | None:
    """The layout of a weight stored as ``dtype`` ("f16" for float16), or None when ``dtype`` is not 16-bit float."""
    return next((name for name, dt in HALF_LAYOUTS.items() if dt == dtype), None)
