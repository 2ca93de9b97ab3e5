"""Triton GPU kernels (provider "triton"), registered for cuda over the torch backend's kernels.

As a dispatcher backend: ``unavailable("cuda")`` is None when triton imports and a CUDA device is there, else the
reason (no triton: ``pip install 'dtorch[triton]'``); ``install(dispatcher, "cuda")`` registers the kernels that
the modules in ``MODULES`` declare on ``registry.KERNELS``. The kernels are plain ``fn(ctx, inputs, outputs)``
functions: under ``TRITON_INTERPRET=1`` (set before this package's modules are imported) they run on CPU tensors,
which is how CI tests them against the reference kernels.
"""

from __future__ import annotations

from importlib import import_module

from dtorch.dispatch.registry import Dispatcher

MODULES = ("elementwise", "attention", "gated_delta_net", "causal_conv1d", "fla")  # each adds to registry.KERNELS

__all__ = ["MODULES", "install", "unavailable"]


def unavailable(device_type: str) -> str | None:
    """None when the triton kernels can serve ``device_type`` here, else the reason."""
    if device_type != "cuda":
        return f"the triton kernels run on cuda, not {device_type}"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc}); install it with: pip install 'dtorch[triton]'"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def install(dispatcher: Dispatcher, device_type: str) -> None:
    from dtorch.kernels.triton.registry import KERNELS

    for name in MODULES:
        import_module(f"dtorch.kernels.triton.{name}")
    KERNELS.install(dispatcher, device_type)
