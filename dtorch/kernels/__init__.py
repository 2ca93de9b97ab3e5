"""Kernel backends, one folder each; every backend registers itself.

| backend | folder | devices | provides |
|---|---|---|---|
| torch | ``kernels/torch/`` | cpu, cuda | every op: reference kernels from torch primitives, and torch's fast paths |
|       |                    |           | (providers reference, torch, blas, sdpa, upcast, chunked) |
| native | ``kernels/native/`` | cpu | C++ SIMD kernels (provider native): GGUF quantized linear, decode ops |
| triton | ``kernels/triton/`` | cuda | Triton kernels (provider triton): norms, rope, silu_and_mul, paged decode |
|        |                     |      | attention, gated delta rule, causal conv1d; flash-linear-attention's gated |
|        |                     |      | delta rule when installed (provider fla) |

A backend package has ``unavailable(device_type) -> str | None`` (why it cannot serve that device type:
no compiler, no triton, a CPU without the instructions) and ``install(dispatcher, device_type)``. The
dispatcher calls ``install`` below once per device type, before the first registration or lookup on it;
a backend that cannot load registers nothing and is recorded with its reason, which ``explain`` and
``python -m dtorch kernels`` show. Nothing is swallowed silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from dtorch.dispatch.registry import Dispatcher

__all__ = ["BACKENDS", "Backend", "install"]


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    package: str
    devices: tuple[str, ...]


BACKENDS = (
    Backend("torch", "dtorch.kernels.torch", ("cpu", "cuda")),
    Backend("native", "dtorch.kernels.native", ("cpu",)),
    Backend("triton", "dtorch.kernels.triton", ("cuda",)),
)


def install(dispatcher: Dispatcher, device_type: str) -> None:
    """Register every backend that serves ``device_type``; record why any other could not load."""
    for backend in BACKENDS:
        if device_type not in backend.devices:
            continue
        try:
            package = import_module(backend.package)
        except ImportError as exc:
            dispatcher.mark_unavailable(device_type, backend.name, f"cannot import {backend.package}: {exc}")
            continue
        reason = package.unavailable(device_type)
        if reason is not None:
            dispatcher.mark_unavailable(device_type, backend.name, reason)
            continue
        package.install(dispatcher, device_type)
