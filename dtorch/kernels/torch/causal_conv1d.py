"""Depthwise causal 1-d convolution, the short conv in front of Mamba / Gated DeltaNet mixers.

``llm.causal_conv1d``: out[b, d, t] = act(bias[d] + sum_w weight[d, w] * xp[b, d, t + w]), where xp is x with
the W - 1 previous inputs (initial_states, or zeros) in front.
    inputs:  x [B, D, L]; weight [D, W]; bias [D] or None; initial_states [B, D, W-1] or None
    outputs: out [B, D, L]; optionally final_states [B, D, W-1] (the last W - 1 columns of xp)
``llm.causal_conv1d_update``: the decode step, Dao-AILab's ``causal_conv1d_update`` convention: the state
holds the last S >= W - 1 inputs (Qwen3-Next keeps S = W) and is shifted in place.
    inputs:  x [B, D, L] (L small, often 1) or [B, D] (L = 1); weight [D, W]; bias [D] or None; optionally
             conv_state itself as a 4th input (a graph names every tensor an op reads; it is outputs[1])
    outputs: out like x; conv_state [B, D, S], read and written (its old contents precede x)
params: activation None or "silu". Low precision computes in float32 (float64 stays float64).

The reference kernels sum the W taps by hand; torch's grouped ``conv1d`` is registered over the full form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.torch.registry import FLOATS, KERNELS


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _taps(xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, length: int) -> torch.Tensor:
    """xp [B, D, W - 1 + length] -> [B, D, length]: sum over w of weight[:, w] * xp[..., w : w + length]."""
    width = weight.shape[1]
    out = xp[..., :length] * weight[:, 0, None]
    for w in range(1, width):
        out.addcmul_(xp[..., w:w + length], weight[:, w, None])
    if bias is not None:
        out += bias[:, None]
    return out


def _finish(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(out) if activation == "silu" else out


def _padded(inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """xp [B, D, W - 1 + L] in the compute dtype, with weight and bias in it too."""
    x, weight, bias, initial = inputs
    cd = _compute_dtype(x.dtype)
    head = (x.new_zeros(x.shape[0], x.shape[1], weight.shape[1] - 1, dtype=cd) if initial is None
            else initial.to(cd))
    return torch.cat([head, x.to(cd)], dim=-1), weight.to(cd), None if bias is None else bias.to(cd)


def _write(xp: torch.Tensor, out: torch.Tensor, width: int, outputs) -> None:
    outputs[0].copy_(out)
    if len(outputs) > 1:
        outputs[1].copy_(xp[..., xp.shape[-1] - (width - 1):])


@KERNELS.kernel("llm.causal_conv1d", FLOATS)
def causal_conv1d_reference(ctx, inputs, outputs) -> None:
    xp, weight, bias = _padded(inputs)
    out = _taps(xp, weight, bias, inputs[0].shape[-1])
    _write(xp, _finish(out, ctx.params.get("activation")), weight.shape[1], outputs)


@KERNELS.kernel("llm.causal_conv1d", FLOATS, provider="torch")
def causal_conv1d_torch(ctx, inputs, outputs) -> None:
    xp, weight, bias = _padded(inputs)
    if inputs[0].shape[-1] == 0:  # conv1d refuses an input shorter than its kernel
        out = xp[..., :0]
    else:
        out = F.conv1d(xp, weight.unsqueeze(1), bias, groups=weight.shape[0])
    _write(xp, _finish(out, ctx.params.get("activation")), weight.shape[1], outputs)


@KERNELS.kernel("llm.causal_conv1d_update", FLOATS, meta=KernelMeta(inplace=True))
def causal_conv1d_update_reference(ctx, inputs, outputs) -> None:
    x, weight, bias = inputs[:3]
    out, state = outputs
    if x.dim() == 2:  # [B, D]: one step
        x, out = x.unsqueeze(-1), out.unsqueeze(-1)
    cd = _compute_dtype(x.dtype)
    width, keep, length = weight.shape[1], state.shape[-1], x.shape[-1]
    xs = torch.cat([state.to(cd), x.to(cd)], dim=-1)                     # [B, D, S + L], a new tensor
    y = _taps(xs[..., keep - (width - 1):], weight.to(cd), None if bias is None else bias.to(cd), length)
    state.copy_(xs[..., length:])
    out.copy_(_finish(y, ctx.params.get("activation")))
