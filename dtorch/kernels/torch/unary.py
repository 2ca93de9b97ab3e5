"""Elementwise unary kernels ``unary.<name>``: ``outputs[0] = f(inputs[0])``.

Reference kernels are one torch primitive each, or for silu and gelu the formula itself; torch's
fused silu and gelu are registered over them as provider "torch".
"""

from __future__ import annotations

import math

import torch

from dtorch.kernels.torch.registry import FLOATS, INTS, KERNELS


def _make(fn, name: str):
    """The out-form kernel and its allocating form, from a torch function taking an optional out=."""
    def kernel(ctx, inputs, outputs):
        fn(inputs[0], out=outputs[0])

    def functional(ctx, inputs):
        return (fn(inputs[0]),)
    kernel.__name__ = kernel.__qualname__ = f"unary_{name}"
    return kernel, functional


def _relu(x, out=None):
    return torch.clamp_min(x, 0, out=out)


# op -> (torch function with an out= form, dtypes). Integer forms only where the op is exact on integers.
UNARY = {
    "neg": (torch.neg, FLOATS + INTS),
    "abs": (torch.abs, FLOATS + INTS),
    "exp": (torch.exp, FLOATS),
    "log": (torch.log, FLOATS),
    "sqrt": (torch.sqrt, FLOATS),
    "rsqrt": (torch.rsqrt, FLOATS),
    "sin": (torch.sin, FLOATS),
    "cos": (torch.cos, FLOATS),
    "tanh": (torch.tanh, FLOATS),
    "sigmoid": (torch.sigmoid, FLOATS),
    "relu": (_relu, FLOATS + INTS),
}

for _name, (_fn, _dtypes) in UNARY.items():
    _kernel, _functional = _make(_fn, _name)
    KERNELS.add(f"unary.{_name}", _kernel, _dtypes, functional=_functional)


@KERNELS.kernel("unary.silu", FLOATS)
def silu_reference(ctx, inputs, outputs):
    x = inputs[0]
    torch.mul(x, torch.sigmoid(x), out=outputs[0])


@KERNELS.kernel("unary.silu", FLOATS, provider="torch",
                functional=lambda ctx, inputs: (torch._C._nn.silu(inputs[0]),))
def silu_fused(ctx, inputs, outputs):
    torch._C._nn.silu(inputs[0], out=outputs[0])


# params: approximate = "none" (erf form) or "tanh"
@KERNELS.kernel("unary.gelu", FLOATS)
def gelu_reference(ctx, inputs, outputs):
    x = inputs[0].float()
    if ctx.params.get("approximate", "none") == "tanh":
        y = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    else:
        y = 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    outputs[0].copy_(y)


@KERNELS.kernel("unary.gelu", FLOATS, provider="torch", functional=lambda ctx, inputs: (
    torch._C._nn.gelu(inputs[0], approximate=ctx.params.get("approximate", "none")),))
def gelu_fused(ctx, inputs, outputs):
    torch._C._nn.gelu(inputs[0], approximate=ctx.params.get("approximate", "none"), out=outputs[0])
