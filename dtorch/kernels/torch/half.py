"""Reference kernels for 16-bit weights beside wider activations (layouts "f16" and "bf16", ``dtorch.kernels.half``).

A weight [N, K] stored as float16 / bfloat16 is a plain tensor of that dtype; the key's dtype is the activations'.

- ``matmul.linear``: inputs x [..., K] (the key's dtype), w [N, K] 16-bit, bias [N] or None; outputs out [..., N].
  Converts W to x's dtype one panel of rows at a time (about ``PANEL_BYTES`` each), so a call never holds a
  converted copy of the whole weight: x @ w.to(x.dtype).T, panel by panel of output columns (float32 x on a CPU:
  in oneDNN's GEMM where torch has it, ``matmul.linear_onednn``'s reason).
- ``llm.embedding``: inputs w [V, E] 16-bit, ids [...]; outputs out [..., E]; params as the float kernel
  (``vocab_start`` for a vocabulary-parallel piece). Converts only the rows it gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.kernels.half import HALF_LAYOUTS
from dtorch.kernels.torch.matmul import onednn_linear, onednn_linear_op
from dtorch.kernels.torch.registry import KERNELS

ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
PANEL_BYTES = 1 << 20  # converted rows of W per product: cache-sized, and no whole float copy


def linear_half(ctx, inputs, outputs):
    x, w, bias = inputs
    out = outputs[0]
    n, k = w.shape
    x2, o2 = x.reshape(-1, k), out.view(-1, n)
    rows = max(1, PANEL_BYTES // (k * x.element_size()))
    onednn = x.dtype == torch.float32 and x.device.type == "cpu" and onednn_linear_op() is not None and (
        bias is None or bias.dtype == x.dtype)
    if onednn:
        x2 = x2.contiguous()
    for r0 in range(0, n, rows):
        panel = w[r0:r0 + rows].to(x.dtype)  # [rows, K] in the activations' dtype
        b = None if bias is None else bias[r0:r0 + rows]
        y = onednn_linear(x2, panel.contiguous(), b) if onednn else F.linear(x2, panel, b)
        if rows >= n:
            o2.copy_(y)
        else:
            o2[:, r0:r0 + rows] = y


def embedding_half(ctx, inputs, outputs):
    w, ids = inputs
    out = outputs[0]
    flat = ids.reshape(-1)
    start = ctx.params.get("vocab_start")
    outside = None
    if start is not None:
        flat = flat - start
        outside = (flat < 0) | (flat >= w.shape[0])       # [T]: ids another device's rows hold
        flat = flat.masked_fill(outside, 0)
    rows = torch.index_select(w, 0, flat).to(out.dtype)  # [T, E]
    if outside is not None:
        rows.masked_fill_(outside.unsqueeze(-1), 0)
    out.copy_(rows.view(out.shape))


for _layout in HALF_LAYOUTS:
    KERNELS.add("matmul.linear", linear_half, ACTIVATIONS, layout=_layout, devices=("cpu", "cuda"))
    KERNELS.add("llm.embedding", embedding_half, ACTIVATIONS, layout=_layout, devices=("cpu", "cuda"))
