"""``llm.gdn_gates``: the decay and write strength of Gated DeltaNet, as transformers' Qwen3NextGatedDeltaNet.

inputs:  a, b [T, H] (one float dtype); A_log [H], dt_bias [H] (any float dtype)
outputs: g [T, H] float32 = -exp(A_log.float()) * softplus(a.float() + dt_bias); beta [T, H] = sigmoid(b) in
         b's dtype

The reference is transformers' expression; "torch" writes the same values through fewer temporaries (A_log's
exp is H values; the [T, H] work is one add, softplus, one multiply into g, and sigmoid straight into beta).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.kernels.torch.registry import FLOATS, KERNELS


@KERNELS.kernel("llm.gdn_gates", FLOATS)
def gdn_gates_reference(ctx, inputs, outputs) -> None:
    a, b, a_log, dt_bias = inputs
    g, beta = outputs
    beta.copy_(b.sigmoid())
    g.copy_(-a_log.float().exp() * F.softplus(a.float() + dt_bias))


@KERNELS.kernel("llm.gdn_gates", FLOATS, provider="torch")
def gdn_gates_torch(ctx, inputs, outputs) -> None:
    a, b, a_log, dt_bias = inputs
    g, beta = outputs
    torch.sigmoid(b, out=beta)
    torch.mul(F.softplus(torch.add(a.float(), dt_bias)), a_log.float().exp().neg_(), out=g)
