"""Reference kernels for weights kept in GGUF block formats (layouts "gguf.q4_1", ...).

A quantized weight [N, K] is a uint8 tensor [N, row bytes] (``dtorch.kernels.layouts``); these kernels
dequantize it (bit-identical to the ``gguf`` package) and compute in float32. They are what ``verify()``
compares a faster kernel with, and what runs when no native backend serves the layout.

- ``matmul.linear``: inputs x [..., K] (the key's dtype), w packed [N, row bytes], bias [N] or None;
  outputs out [..., N]. Dequantizes the whole weight per call: correct everywhere, fast nowhere.
- ``llm.embedding``: inputs w packed [V, row bytes], ids [...]; outputs out [..., E]; params as the float
  kernel (``vocab_start`` for a vocabulary-parallel piece). Dequantizes only the rows it gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.core.dtypes import GGUF_LAYOUTS, GGUF_X16_LAYOUTS
from dtorch.kernels import layouts
from dtorch.kernels.torch.registry import KERNELS

ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)


def _linear(layout: str):
    def linear_dequantized(ctx, inputs, outputs):
        x, w, bias = inputs
        out = outputs[0]
        weight = layouts.dequantize(w, layout, x.shape[-1])  # float32 [N, K]
        y = F.linear(x.float(), weight, None if bias is None else bias.float())
        out.copy_(y)
    linear_dequantized.__qualname__ = f"linear_dequantized[{layout}]"
    return linear_dequantized


def _embedding(layout: str):
    def embedding_dequantized(ctx, inputs, outputs):
        w, ids = inputs
        out = outputs[0]
        flat = ids.reshape(-1)
        start = ctx.params.get("vocab_start")
        outside = None
        if start is not None:
            flat = flat - start
            outside = (flat < 0) | (flat >= w.shape[0])       # [T]: ids another device's rows hold
            flat = flat.masked_fill(outside, 0)
        rows = layouts.dequantize(torch.index_select(w, 0, flat), layout, out.shape[-1])  # float32 [T, E]
        if outside is not None:
            rows.masked_fill_(outside.unsqueeze(-1), 0)
        out.copy_(rows.view(out.shape))
    embedding_dequantized.__qualname__ = f"embedding_dequantized[{layout}]"
    return embedding_dequantized


for _layout in GGUF_LAYOUTS:
    KERNELS.add("matmul.linear", _linear(_layout), ACTIVATIONS, layout=_layout, devices=("cpu", "cuda"))
    KERNELS.add("llm.embedding", _embedding(_layout), ACTIVATIONS, layout=_layout, devices=("cpu", "cuda"))
for _layout in GGUF_X16_LAYOUTS:  # the interleaved projections: the whole weight dequantized (layouts.dequantize)
    KERNELS.add("matmul.linear", _linear(_layout), ACTIVATIONS, layout=_layout, devices=("cpu", "cuda"))
