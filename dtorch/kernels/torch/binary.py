"""Elementwise binary kernels with broadcasting (``binary.<name>``: inputs a, b) and their scalar
forms (``binary.<name>_scalar``: input a, params.value), written into ``outputs[0]``."""

from __future__ import annotations

import torch

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.torch.registry import FLOATS, INTS, KERNELS

BROADCAST = KernelMeta(broadcast=True, inplace=True)
SCALAR = KernelMeta(inplace=True)


def _tensor_kernel(fn, name):
    """The out-form kernel and its allocating form, from a torch function taking an optional out=."""
    def kernel(ctx, inputs, outputs):
        fn(inputs[0], inputs[1], out=outputs[0])

    def functional(ctx, inputs):
        return (fn(inputs[0], inputs[1]),)
    kernel.__name__ = kernel.__qualname__ = f"binary_{name}"
    return kernel, functional


def _scalar_kernel(fn, name):
    def kernel(ctx, inputs, outputs):
        fn(inputs[0], ctx.params.value, out=outputs[0])

    def functional(ctx, inputs):
        return (fn(inputs[0], ctx.params.value),)
    kernel.__name__ = kernel.__qualname__ = f"binary_{name}_scalar"
    return kernel, functional


def _div(a, b, out=None):
    return torch.div(a, b, out=out)


# op -> (torch function with an out= form, dtypes). div on integers is floor-free true division, which
# does not stay integral, so it is float-only; pow on integers is exact and kept.
BINARY = {
    "add": (torch.add, FLOATS + INTS),
    "sub": (torch.sub, FLOATS + INTS),
    "mul": (torch.mul, FLOATS + INTS),
    "div": (_div, FLOATS),
    "maximum": (torch.maximum, FLOATS + INTS),
    "minimum": (torch.minimum, FLOATS + INTS),
    "pow": (torch.pow, FLOATS + INTS),
}

# torch.maximum / minimum take no Python scalar; clamp does the same thing for one.
SCALAR_FN = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": _div, "pow": torch.pow,
    "maximum": lambda a, v, out=None: torch.clamp_min(a, v, out=out),
    "minimum": lambda a, v, out=None: torch.clamp_max(a, v, out=out),
}

for _name, (_fn, _dtypes) in BINARY.items():
    _kernel, _functional = _tensor_kernel(_fn, _name)
    KERNELS.add(f"binary.{_name}", _kernel, _dtypes, meta=BROADCAST, functional=_functional)
    _kernel, _functional = _scalar_kernel(SCALAR_FN[_name], _name)
    KERNELS.add(f"binary.{_name}_scalar", _kernel, _dtypes, meta=SCALAR, functional=_functional)

# the fallback of the native row of binary.mul_scalar (native csrc/ops/elementwise.def)
binary_mul_scalar = _scalar_kernel(torch.mul, "mul")[0]
