"""The torch backend: kernels built from torch primitives, registered for cpu and cuda alike.

Each op family is one file declaring its kernels next to their definitions (``KERNELS``); the reference
kernel of each op defines the op. Accelerated candidates here are torch's own fast paths (BLAS, sdpa).
"""

from __future__ import annotations

from importlib import import_module

from dtorch.dispatch.registry import Dispatcher
from dtorch.kernels.torch.registry import KERNELS

FAMILIES = ("unary", "binary", "matmul", "conv", "reduce", "creation", "copy", "llm", "attention", "gated_delta_net",
            "gdn_gates", "causal_conv1d", "kv_cache", "quantized", "half", "moe")


def unavailable(device_type: str) -> str | None:
    """torch runs everywhere torch does."""
    return None


def install(dispatcher: Dispatcher, device_type: str) -> None:
    for name in FAMILIES:
        import_module(f"{__name__}.{name}")
    KERNELS.install(dispatcher, device_type)
