"""Running a kernel for one call: key -> winning candidate -> KernelFn(ctx, inputs, outputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtorch.core.device import Device, as_device, device_of
from dtorch.core.errors import ArgumentError, DtorchError, KernelFailure
from dtorch.dispatch import dispatcher as _dispatcher
from dtorch.dispatch import verification as _verify
from dtorch.dispatch.context import NO_PARAMS, KernelContext, KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.ops import _checks
from dtorch.ops.context import RuntimeContext

_fast = _dispatcher.__dict__  # the dispatcher replaces its "_fast" dict on every change; read it through here


def run(op: str, device: Device, dtype: torch.dtype, inputs: Sequence, outputs: Sequence[torch.Tensor],
        params: KernelParams = NO_PARAMS, stream=None, workspace=None) -> None:
    """Choose the kernel for (op, device type, dtype) and run it; the wrappers' common last step."""
    key = KernelKey(op, device.type, dtype)
    cand = _fast["_fast"].get(key)
    if cand is None:
        call = Call(device, dtype, params, inputs) if _dispatcher.needs_call(key) else None
        cand = _dispatcher.select(key, call)
    if cand.meta.requires_dense:
        _checks.dense(op, {f"input {i}": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
                      | {f"output {i}": t for i, t in enumerate(outputs)})
    kctx = KernelContext(device, stream, workspace, params)
    try:
        if _verify.ACTIVE[0]:
            refs = [c for c in _dispatcher.candidates(key) if c.provider == "reference"]
            _verify.run_verified(key, cand, refs[0] if refs else None, kctx, inputs, outputs)
        else:
            cand.fn(kctx, inputs, outputs)
    except DtorchError:
        raise
    except Exception as exc:
        raise KernelFailure(f"{key}: kernel {cand.name} failed on {device}: {type(exc).__name__}: {exc}") from exc


def invoke(op_name: str, inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
           params: KernelParams | dict | None = None, ctx: RuntimeContext | None = None,
           dtype: torch.dtype | None = None) -> Sequence[torch.Tensor]:
    """Run ``op_name`` on caller-allocated ``outputs``; returns ``outputs``.

    The kernel key takes the device of ``ctx`` (or of the first tensor) and ``dtype`` (default: the
    first input's dtype, or the first output's for creation ops). No op-specific validation is done
    here: the named wrappers (``dtorch.ops.add`` ...) do that.
    """
    if not isinstance(op_name, str):
        raise ArgumentError(f"invoke: op_name must be a str like 'binary.add', got {type(op_name).__name__}")
    tensors = [t for t in list(inputs) + list(outputs) if isinstance(t, torch.Tensor)]
    if not tensors and ctx is None:
        raise ArgumentError(f"invoke {op_name}: no tensors and no ctx, so the device is unknown")
    for i, t in enumerate(outputs):
        _checks.tensor(op_name, f"outputs[{i}]", t)
    device = ctx.device if ctx is not None else device_of(tensors[0])
    if dtype is None:
        first = next((t for t in inputs if isinstance(t, torch.Tensor)), None) or outputs[0]
        dtype = first.dtype
    if isinstance(params, dict):
        params = KernelParams(**params)
    KernelKey.of(op_name, device, dtype)  # a clear error for a malformed name
    run(op_name, device, dtype, list(inputs), list(outputs), params or NO_PARAMS,
        ctx.stream if ctx is not None else None, ctx.workspace if ctx is not None else None)
    return outputs


def ctx_device(ctx: RuntimeContext | None, t: torch.Tensor) -> Device:
    return as_device(ctx.device) if ctx is not None else device_of(t)
