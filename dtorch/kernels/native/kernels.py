"""The native kernels as dispatcher kernels (provider "native", cpu only), each next to its registration.

Every kernel has the ABI of the torch backend's kernel for the same key (inputs, outputs, params, in-place
behaviour). Inputs the compiled code does not take (strides it cannot walk, a dtype mismatch) go to the torch
backend's kernel for that key, called directly, so a call never fails here that would pass there.
"""

from __future__ import annotations

import torch

from dtorch.core.dtypes import GGUF_LAYOUTS
from dtorch.core.errors import DtorchError
from dtorch.dispatch.registration import KernelSet
from dtorch.kernels import layouts
from dtorch.kernels.native import loader
from dtorch.kernels.torch import llm as torch_llm

KERNELS = KernelSet(devices=("cpu",))
ACTIVATIONS = (torch.float32, torch.bfloat16)
NATIVE = {"provider": "native"}


def _lib():
    mod = loader._mod
    return mod if mod is not None else loader.load()


# -- matmul.linear on GGUF weights -------------------------------------------------------------------------
# inputs: x [..., K] (float32 / bfloat16: the key's dtype), w uint8 [N, row_bytes(layout, K)], bias [N] or None;
# outputs: out [..., N]. x is quantized to int8 per 32 values inside (see ops.qlinear); the reference (torch
# backend) dequantizes w with layouts.dequantize and runs F.linear.

def _linear_kernel(layout: str):
    code = layouts.format_code(layout)

    def kernel(ctx, inputs, outputs):
        x, w, bias = inputs
        out = outputs[0]
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if out.is_contiguous():
            _lib().qlinear(x, w, code, bias, out)
        else:
            out.copy_(_qlinear(x, w, code, bias))

    kernel.__name__ = kernel.__qualname__ = f"linear_{layout[5:]}"
    return kernel


def _qlinear(x: torch.Tensor, w: torch.Tensor, code: int, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.new_empty(*x.shape[:-1], w.shape[0])
    _lib().qlinear(x, w, code, bias, y)
    return y


for _layout in GGUF_LAYOUTS:
    KERNELS.add("matmul.linear", _linear_kernel(_layout), ACTIVATIONS, layout=_layout, **NATIVE,
                varies="int8 activations per 32 values; rows split over torch's intra-op threads")


# -- llm.rms_norm / llm.add_rms_norm -------------------------------------------------------------------------
# (x, weight) -> (out,) with out possibly x; (x, residual, weight) -> (out, residual_out) with residual_out
# possibly residual; params eps. One pass per row; contiguous tensors of one dtype, else the torch kernel.

@KERNELS.kernel("llm.rms_norm", ACTIVATIONS, meta=torch_llm.INPLACE, **NATIVE)
def rms_norm(ctx, inputs, outputs):
    x, weight = inputs
    try:
        _lib().rms_norm(x, None, None, weight, outputs[0], ctx.params.eps)
    except DtorchError:
        torch_llm.rms_norm_torch(ctx, inputs, outputs)


@KERNELS.kernel("llm.add_rms_norm", ACTIVATIONS, meta=torch_llm.INPLACE, **NATIVE)
def add_rms_norm(ctx, inputs, outputs):
    x, residual, weight = inputs
    try:
        _lib().rms_norm(x, residual, outputs[1], weight, outputs[0], ctx.params.eps)
    except DtorchError:
        torch_llm.add_rms_norm_torch(ctx, inputs, outputs)


# -- llm.silu_and_mul ------------------------------------------------------------------------------------------
# (gate, up) -> (out,), or (x [..., 2I], None) fused; gate/up may be row-strided views (a gate_up output's halves).

@KERNELS.kernel("llm.silu_and_mul", ACTIVATIONS, **NATIVE)
def silu_and_mul(ctx, inputs, outputs):
    try:
        _lib().silu_and_mul(inputs[0], inputs[1], outputs[0])
    except DtorchError:
        torch_llm.silu_and_mul_torch(ctx, inputs, outputs)


# -- llm.rope (the table form that rope_cached runs) -------------------------------------------------------------
# (x [..., T, H, D], cos, sin [..., T, R/2] float32) -> (out,) possibly x; params rotary_dim, interleaved. x, out,
# cos and sin may be row-strided views (q/k heads of a fused qkv output). The positions form goes to torch.

@KERNELS.kernel("llm.rope", ACTIVATIONS, meta=torch_llm.INPLACE, **NATIVE)
def rope(ctx, inputs, outputs):
    if len(inputs) == 3:
        try:
            p = ctx.params
            _lib().rope(inputs[0], inputs[1], inputs[2], outputs[0], p.rotary_dim, p.interleaved)
            return
        except DtorchError:
            pass
    torch_llm.rope_reference(ctx, inputs, outputs)
