"""LLM building blocks: ``llm.embedding``, ``llm.rms_norm``, ``llm.add_rms_norm``, ``llm.rope``,
``llm.softmax_last_dim``, ``llm.silu_and_mul`` and ``llm.gelu_tanh_and_mul``.

Reference kernels are written from torch primitives and follow the Hugging Face Llama modules'
numerics (statistics in float32 for low-precision inputs, then cast); where torch has a fused op
that gives the same result it is registered over the reference as provider "torch".
The wrappers in ``dtorch.ops.llm`` validate shapes and dtypes before any kernel runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.torch.registry import FLOATS, KERNELS

INPLACE = KernelMeta(inplace=True)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- embedding -----------------------------------------------------------------------------------
# inputs: weight [V, D], ids [...] int32/int64; outputs: out [..., D]. The weight comes first because a
# kernel is keyed by its first input's dtype (the wrapper ``embedding(ids, weight)`` keeps torch's order).
# params: vocab_start (optional): weight holds rows vocab_start .. vocab_start + V - 1 of a larger table (one
# device's piece of a vocabulary-parallel embedding); ids outside that range give zero rows, so the pieces'
# outputs sum to the whole lookup. Without it every id must be in 0..V-1 (the wrapper checks).

@KERNELS.kernel("llm.embedding", FLOATS)
def embedding_reference(ctx, inputs, outputs):
    weight, ids = inputs
    out = outputs[0]
    flat = ids.reshape(-1)
    start = ctx.params.get("vocab_start")
    if start is not None:
        flat = flat - start
        outside = (flat < 0) | (flat >= weight.shape[0])       # [N]: ids another device's rows hold
        rows = torch.index_select(weight, 0, flat.masked_fill(outside, 0))
        out.copy_(rows.masked_fill_(outside.unsqueeze(-1), 0).view(out.shape))
    elif out.is_contiguous():
        torch.index_select(weight, 0, flat, out=out.view(-1, weight.shape[1]))
    else:
        out.copy_(torch.index_select(weight, 0, flat).view(out.shape))


# -- rms_norm ------------------------------------------------------------------------------------
# inputs: x [..., D], weight [D]; outputs: out [..., D] (may alias x); params: eps.
# out = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), as LlamaRMSNorm.

def _normalize_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(_compute_dtype(x.dtype))
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype)


@KERNELS.kernel("llm.rms_norm", FLOATS, meta=INPLACE)
def rms_norm_reference(ctx, inputs, outputs):
    x, weight = inputs
    torch.mul(weight, _normalize_reference(x, ctx.params.eps), out=outputs[0])


def _normalize_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm without a weight rounds once, exactly like the reference; with a weight it would
    # multiply in float32 before rounding, which differs from LlamaRMSNorm in low precision.
    return F.rms_norm(x, (x.shape[-1],), None, eps)


def _norm_into(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """out = weight * rms_norm(x) for x [..., D] (out may be x), rounded as LlamaRMSNorm.

    On CPU (float32, bfloat16, float16): the float32 sum of squares from one fused reduction
    (``vector_norm``), the scale from it in place (no host read, so capture-safe), fewer torch calls than
    F.rms_norm's seven or more. ``x * scale`` computes in float32 and rounds once to x's dtype, then the
    weight multiplies in x's dtype, as the reference.
    """
    d = x.shape[-1]
    if x.dtype is torch.float64 or x.device.type != "cpu" or not d:
        torch.mul(weight, _normalize_torch(x, eps), out=out)
        return
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # [..., 1]
    torch.mul(x, n.square_().div_(d).add_(eps).rsqrt_(), out=out)
    out.mul_(weight)


@KERNELS.kernel("llm.rms_norm", FLOATS, provider="torch", meta=INPLACE)
def rms_norm_torch(ctx, inputs, outputs):
    x, weight = inputs
    _norm_into(x, weight, ctx.params.eps, outputs[0])


# -- add_rms_norm --------------------------------------------------------------------------------
# inputs: x [..., D], residual [..., D], weight [D]; outputs: out [..., D], residual_out [..., D]
# (residual_out may alias residual: the in-place residual stream of a decoder layer).
# residual_out = residual + x (in x's dtype); out = rms_norm(residual_out).

@KERNELS.kernel("llm.add_rms_norm", FLOATS, meta=INPLACE)
def add_rms_norm_reference(ctx, inputs, outputs):
    x, residual, weight = inputs
    out, residual_out = outputs
    torch.add(residual, x, out=residual_out)
    torch.mul(weight, _normalize_reference(residual_out, ctx.params.eps), out=out)


@KERNELS.kernel("llm.add_rms_norm", FLOATS, provider="torch", meta=INPLACE)
def add_rms_norm_torch(ctx, inputs, outputs):
    x, residual, weight = inputs
    out, residual_out = outputs
    torch.add(residual, x, out=residual_out)
    _norm_into(residual_out, weight, ctx.params.eps, out)


# -- rope ----------------------------------------------------------------------------------------
# inputs: x [..., T, H, D], cos [T, R/2] or [B, T, R/2], sin (same; float32, already gathered for the
# call's positions); outputs: out like x (may alias x); params: rotary_dim R, interleaved.
# Positions form (what a graph has): inputs x, positions int [T] or [B, T]; params also inv_freq, R/2 floats;
# the kernel gathers cos/sin itself with ``rope_tables``, the same function the wrapper uses.
# Half rotation (NeoX / Llama) pairs dim i with i + R/2; interleaved (GPT-J) pairs 2i with 2i+1.
# Dims R.. pass through. Computed in float32 (float64 for float64) and cast once.

def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin float32 [..., T, R/2] of the angles positions [..., T] * inv_freq [R/2]."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def _rope_inputs(ctx, inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if len(inputs) == 3:
        return inputs
    x, positions = inputs
    inv_freq = torch.tensor(ctx.params.inv_freq, dtype=torch.float32, device=x.device)
    return (x, *rope_tables(positions, inv_freq))

def _pairs(t: torch.Tensor, r: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (first, second) of each rotated pair of t [..., D]: [..., R/2] each."""
    if interleaved:
        pairs = t[..., :r].unflatten(-1, (r // 2, 2))
        return pairs[..., 0], pairs[..., 1]
    return t[..., : r // 2], t[..., r // 2:r]


@KERNELS.kernel("llm.rope", FLOATS, meta=INPLACE)
def rope_reference(ctx, inputs, outputs):
    x, cos, sin = _rope_inputs(ctx, inputs)
    out = outputs[0]
    r, interleaved = ctx.params.rotary_dim, ctx.params.interleaved
    x1, x2 = _pairs(x, r, interleaved)
    o1, o2 = _pairs(out, r, interleaved)
    cdt = _compute_dtype(x.dtype)
    c, s = cos.unsqueeze(-2).to(cdt), sin.unsqueeze(-2).to(cdt)  # [..., T, 1, R/2]: broadcast over heads
    if x.dtype == cdt:  # float32/64: five ops, safe when out is x (o2 is written before o1, x1 read last)
        y1 = x1 * c
        y1.addcmul_(x2, s, value=-1.0)
        torch.mul(x2, c, out=o2)
        o2.addcmul_(x1, s)
        o1.copy_(y1)
    else:  # low precision: both halves computed in float32 on copies, each rounded once
        x1f, x2f = x1.to(cdt), x2.to(cdt)
        y1 = x1f * c
        y1.addcmul_(x2f, s, value=-1.0)
        x2f.mul_(c).addcmul_(x1f, s)
        o1.copy_(y1)
        o2.copy_(x2f)
    if r < x.shape[-1] and out.data_ptr() != x.data_ptr():
        out[..., r:].copy_(x[..., r:])


# -- softmax_last_dim ----------------------------------------------------------------------------
# inputs: x [..., N]; outputs: out [..., N] (may alias x). Float32 accumulation for low precision.

@KERNELS.kernel("llm.softmax_last_dim", FLOATS, meta=INPLACE)
def softmax_reference(ctx, inputs, outputs):
    x = inputs[0].to(_compute_dtype(inputs[0].dtype))
    e = (x - x.amax(-1, keepdim=True)).exp()
    outputs[0].copy_(e / e.sum(-1, keepdim=True))


@KERNELS.kernel("llm.softmax_last_dim", FLOATS, provider="torch", meta=INPLACE)
def softmax_torch(ctx, inputs, outputs):
    x, out = inputs[0], outputs[0]
    if x.dtype in (torch.float32, torch.float64):
        torch.softmax(x, -1, out=out)
    else:
        out.copy_(torch.softmax(x, -1, dtype=torch.float32))


# -- silu_and_mul --------------------------------------------------------------------------------
# inputs: gate [..., I], up [..., I] (the wrapper splits a fused [..., 2I] tensor into two views), or
# x [..., 2I], None (the fused form a graph has: the kernel takes the two halves as views);
# outputs: out [..., I] = silu(gate) * up, in the input dtype as the HF MLP does.

def _gate_up(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = inputs
    if up is None:
        half = gate.shape[-1] // 2
        return gate[..., :half], gate[..., half:]
    return gate, up


@KERNELS.kernel("llm.silu_and_mul", FLOATS)
def silu_and_mul_reference(ctx, inputs, outputs):
    gate, up = _gate_up(inputs)
    torch.mul(gate * torch.sigmoid(gate), up, out=outputs[0])


@KERNELS.kernel("llm.silu_and_mul", FLOATS, provider="torch")
def silu_and_mul_torch(ctx, inputs, outputs):
    gate, up = _gate_up(inputs)
    torch.mul(F.silu(gate), up, out=outputs[0])


# -- gelu_tanh_and_mul (GeGLU) -------------------------------------------------------------------
# inputs and outputs as silu_and_mul; out = gelu_tanh(gate) * up, the gelu in the input dtype (F.gelu with
# approximate="tanh", as Gemma's MLP computes it), then the product.

@KERNELS.kernel("llm.gelu_tanh_and_mul", FLOATS)
def gelu_tanh_and_mul_reference(ctx, inputs, outputs):
    gate, up = _gate_up(inputs)
    torch.mul(F.gelu(gate, approximate="tanh"), up, out=outputs[0])
