"""``KernelMeta`` (what a planner needs to know about a kernel) and ``Call`` (static facts of a call)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dtorch.core.device import Device
from dtorch.dispatch.context import NO_PARAMS, KernelParams


class Call(NamedTuple):
    """The static facts a capability check decides on.

    ``inputs`` holds the call's input tensors (real or ``meta`` tensors) when they are known, else
    None (a prepared operator may know only its params). Checks must accept ``inputs=None``.
    ``capture``: the call will be recorded in a CUDA graph, so only capture-safe kernels may serve it.
    """

    device: Device
    dtype: torch.dtype
    params: KernelParams = NO_PARAMS
    inputs: Sequence[torch.Tensor] | None = None
    capture: bool = False


# check(call) -> None to accept, or a short reason to decline ("head_dim 320 > 256").
Check = Callable[[Call], "str | None"]
WorkspaceFn = Callable[[Sequence[torch.Tensor], KernelParams], int]


@dataclass(frozen=True, slots=True)
class KernelMeta:
    """Facts about a kernel that let a caller plan without running it.

    requires_dense: inputs and outputs must be contiguous.
    inplace: the kernel may write an output that aliases an input.
    broadcast: inputs may have broadcastable (not equal) shapes.
    workspace: bytes of scratch the kernel needs for given inputs and params (None: none).
    capture_safe: the kernel reads no tensor value on the host (no ``.tolist()``, ``.item()``, ``int(t)``,
        ``bool(t)``, nonzero, boolean-mask indexing, ``.cpu()``, ...), so it issues the same device work for the
        same shapes and params and can be recorded in a CUDA graph. Allocating through torch's caching allocator
        is allowed (capture gives it a private pool). Compiled CPU kernels that read values on the CPU they run
        on make no host sync. ``dtorch.core.hostsync.forbid_host_sync()`` checks it: a capture-safe kernel runs
        inside it without a ``SyncError``.
    alignment: byte alignment the kernel expects of data pointers (1: any).
    """

    requires_dense: bool = False
    inplace: bool = False
    broadcast: bool = False
    workspace: WorkspaceFn | None = None
    capture_safe: bool = True
    alignment: int = 1

    def workspace_bytes(self, inputs: Sequence[torch.Tensor], params: KernelParams = NO_PARAMS) -> int:
        return 0 if self.workspace is None else int(self.workspace(inputs, params))

    def describe(self) -> str:
        flags = [name for name in ("requires_dense", "inplace", "broadcast") if getattr(self, name)]
        if not self.capture_safe:
            flags.append("not capture-safe")
        if self.workspace is not None:
            flags.append("workspace")
        if self.alignment > 1:
            flags.append(f"align {self.alignment}")
        return ", ".join(flags) or "-"


DEFAULT_META = KernelMeta()


def describe_value(value: Any) -> str:
    """Short description of a tensor or value for error messages."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"tensor(shape={tuple(value.shape)}, dtype={dtype}, device={value.device})"
    return repr(value)
