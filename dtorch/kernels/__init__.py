"""Kernels, one file per op family; each file declares its kernels next to their definitions.

The dispatcher calls ``install_cpu`` / ``install_cuda`` once, on the first lookup that misses on
that device type (``Dispatcher.ensure_backend``).
"""

from __future__ import annotations

import importlib

from dtorch.dispatch.registry import Dispatcher
from dtorch.kernels.registry import KERNELS

FAMILIES = ("unary", "binary", "matmul", "conv", "reduce", "creation", "copy", "llm", "attention", "gated_delta_net",
            "causal_conv1d", "kv_cache")


def _import_families() -> None:
    for name in FAMILIES:
        importlib.import_module(f"dtorch.kernels.cpu.{name}")


def install_cpu(dispatcher: Dispatcher) -> None:
    _import_families()
    KERNELS.install(dispatcher, "cpu")


def install_cuda(dispatcher: Dispatcher) -> None:
    _import_families()
    try:
        importlib.import_module("dtorch.kernels.cuda")  # Triton kernels, when triton is installed
    except ImportError:
        pass
    KERNELS.install(dispatcher, "cuda")


def _shape_only(ctx, inputs, outputs) -> None:
    """Meta tensors carry no data: the wrapper already validated and allocated the outputs."""


def install_meta(dispatcher: Dispatcher) -> None:
    """Shape-only kernels for every (op, dtype) the CPU backend has, so the op wrappers infer metadata."""
    from dtorch.dispatch.key import KernelKey

    dispatcher.ensure_backend("cpu")
    for key in dispatcher.keys():
        cands = dispatcher.candidates(key)
        if key.device == "cpu" and cands:
            meta = cands[0].meta
            dispatcher.register(KernelKey(key.op, "meta", key.dtype, key.layout), _shape_only, provider="reference",
                                meta=meta)
