"""The native backend's kernel declarations (provider "native", cpu only): ``kernels.py`` and ``products.py`` add their
kernels to ``KERNELS``, and ``install`` registers them; ``lib()`` is the loaded module whose functions they call, and
``binds`` / ``or_fallback`` make a kernel's bound call (``PreparedKernel.bound``)."""

from __future__ import annotations

import torch

from dtorch.core.errors import DtorchError
from dtorch.dispatch.registration import KernelSet
from dtorch.kernels.native import loader

KERNELS = KernelSet(devices=("cpu",))
ACTIVATIONS = (torch.float32, torch.bfloat16)
NATIVE = {"provider": "native"}


def lib():
    """The native module, loaded on first use."""
    mod = loader._mod
    return mod if mod is not None else loader.load()


# -- bound calls ----------------------------------------------------------------------------------------------
# A kernel's ``bind(ctx, inputs, outputs)`` (PreparedKernel.bound): its call on these very tensors, which a static
# plan makes every step, as a callable of no arguments: the compiled function with its arguments fixed, the Python
# of the kernel (params read, layouts checked) done once here. None: this call takes another path (the kernel runs).

def binds(bind):
    def attach(kernel):
        kernel.bind = bind
        return kernel
    return attach


def bound(fn, *args):
    """``fn(*args)`` (a declared row's module function, rope or cache_store) parsed and checked now, as a callable of
    no arguments that runs the compiled call on what it fixed (csrc/binding.cpp's ``bind``: no parse per step, the
    cold part of a small op after a product); None where the C++ refuses these arguments (the caller's fallback
    then) or the module has no ``bind`` (a stand-in module)."""
    bind = getattr(lib(), "bind", None)
    if bind is None:
        return None
    try:
        return bind(fn, *args)
    except DtorchError:
        return None


def or_fallback(call, fallback, ctx, inputs, outputs):
    """``call()``, or the torch ``fallback`` on these tensors where the compiled code refuses them."""
    def run():
        try:
            call()
        except DtorchError:
            fallback(ctx, inputs, outputs)
    return run
