"""Matrix products ``matmul.mm``, ``matmul.bmm`` and ``matmul.linear``.

Reference kernels are a broadcast-multiply-sum (no BLAS), accumulated in float32 for half types and
in float64 for float64, computed in row blocks so the [rows, K, N] product stays small. BLAS kernels
(torch.mm / bmm / linear with ``out=``; mm and bmm also with their allocating forms for the functional
wrappers) are registered over them as provider "blas".

inputs: mm (a [M, K], b [K, N]); bmm (a [B, M, K], b [B, K, N]); linear (x [..., K], w [N, K], bias [N] or None).
outputs: mm [M, N]; bmm [B, M, N]; linear [..., N].
"""

from __future__ import annotations

import math

import torch

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.registry import FLOATS, INTS, KERNELS

_BLOCK_ELEMENTS = 1 << 22  # elements of one [rows, K, N] product block in the reference kernels
ALLOCATES = KernelMeta(capture_safe=False)  # the reference kernels allocate their temporaries


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _reference_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    # a: [B, M, K], b: [B, K, N], out: [B, M, N]; out[:, i, j] = sum_k a[:, i, k] * b[:, k, j]
    acc = _acc_dtype(a.dtype)
    a, b = a.to(acc), b.to(acc)
    m, k, n = a.shape[1], a.shape[2], b.shape[2]
    rows = max(1, _BLOCK_ELEMENTS // max(1, a.shape[0] * k * n))
    for i in range(0, m, rows):
        block = a[:, i:i + rows, :, None] * b[:, None, :, :]  # [B, rows, K, N]
        out[:, i:i + rows].copy_(block.sum(dim=2))


@KERNELS.kernel("matmul.mm", FLOATS + INTS, meta=ALLOCATES)
def mm_reference(ctx, inputs, outputs):
    a, b = inputs
    _reference_bmm(a[None], b[None], outputs[0][None])


@KERNELS.kernel("matmul.mm", FLOATS + INTS, provider="blas",
                functional=lambda ctx, inputs: (torch.mm(inputs[0], inputs[1]),))
def mm_blas(ctx, inputs, outputs):
    torch.mm(inputs[0], inputs[1], out=outputs[0])


@KERNELS.kernel("matmul.bmm", FLOATS + INTS, meta=ALLOCATES)
def bmm_reference(ctx, inputs, outputs):
    _reference_bmm(inputs[0], inputs[1], outputs[0])


@KERNELS.kernel("matmul.bmm", FLOATS + INTS, provider="blas",
                functional=lambda ctx, inputs: (torch.bmm(inputs[0], inputs[1]),))
def bmm_blas(ctx, inputs, outputs):
    torch.bmm(inputs[0], inputs[1], out=outputs[0])


@KERNELS.kernel("matmul.linear", FLOATS + INTS, meta=ALLOCATES)
def linear_reference(ctx, inputs, outputs):
    x, w, bias = inputs
    out = outputs[0]
    rows, k, n = math.prod(x.shape[:-1]), w.shape[1], w.shape[0]
    y = torch.empty((1, rows, n), dtype=_acc_dtype(x.dtype), device=x.device)
    _reference_bmm(x.reshape(1, rows, k), w.t()[None], y)  # y: [1, rows, N]
    if bias is not None:
        y += bias.to(y.dtype)
    out.copy_(y.reshape(out.shape))


# No allocating form: torch's allocating linear rounds differently from linear.out for bf16 [..., K] inputs
# with a bias, and prepared Linear.forward_out must give exactly the functional wrapper's results.
@KERNELS.kernel("matmul.linear", FLOATS + INTS, provider="blas")
def linear_blas(ctx, inputs, outputs):
    x, out = inputs[0], outputs[0]
    if x.dim() == 1:  # torch's linear.out would resize a [N] out to [1, N]
        x, out = x[None], out[None]
    torch._C._nn.linear(x, inputs[1], inputs[2], out=out)
