"""Running a kernel for one call: key -> winning candidate -> KernelFn(ctx, inputs, outputs).

This is the hot path of every functional op, so it avoids building objects it can reuse: the
dispatcher's per-generation cache is read with a plain tuple (equal to the ``KernelKey``), and
contexts without params or stream are shared per device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dtorch.core.device import Device, device_of
from dtorch.core.errors import ArgumentError, DtorchError, KernelFailure
from dtorch.core.memory import default_workspace
from dtorch.dispatch import abi, dispatcher as _dispatcher, verification as _verify
from dtorch.dispatch.context import NO_PARAMS, KernelContext, KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.dispatch.registry import Candidate
from dtorch.ops import _checks
from dtorch.ops.context import RuntimeContext

_state = _dispatcher.__dict__  # the dispatcher replaces its "_fast" dict on every change; read it through here
_plain_ctx: dict[Device, KernelContext] = {}
# the candidates whose first call here checked the kernel ABI, by id (held: an id is not reused while it is here)
_abi_checked: dict[int, Candidate] = {}


def select(op: str, device: Device, dtype: torch.dtype, inputs: Sequence, params: KernelParams) -> Candidate:
    """The winning candidate for this call (capability checks see the inputs and params)."""
    cand = _state["_fast"].get((op, device.type, dtype, "strided"))
    if cand is None:
        key = KernelKey(op, device.type, dtype)
        call = Call(device, dtype, params, inputs) if _dispatcher.needs_call(key) else None
        cand = _dispatcher.select(key, call)
    return cand


def _context(device: Device, params: KernelParams, stream, workspace) -> KernelContext:
    """A kernel context; without a caller's workspace, kernels get the thread's default arena."""
    if params is NO_PARAMS and stream is None and workspace is None:
        kctx = _plain_ctx.get(device)
        if kctx is None:
            kctx = _plain_ctx[device] = KernelContext(device, None, default_workspace(device))
        return kctx
    return KernelContext(device, stream, workspace if workspace is not None else default_workspace(device), params)


def _fail(op: str, cand: Candidate, device: Device, exc: Exception) -> KernelFailure:
    return KernelFailure(f"{op}: kernel {cand.name} failed on {device}: {type(exc).__name__}: {exc}")


def _dense(op: str, inputs: Sequence, outputs: Sequence) -> None:
    _checks.dense(op, {f"input {i}": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
                  | {f"output {i}": t for i, t in enumerate(outputs)})


def run(op: str, device: Device, dtype: torch.dtype, inputs: Sequence, outputs: Sequence[torch.Tensor],
        params: KernelParams = NO_PARAMS, stream=None, workspace=None) -> None:
    """Choose the kernel for (op, device type, dtype) and run it into ``outputs``."""
    cand = select(op, device, dtype, inputs, params)
    if cand.meta.requires_dense:
        _dense(op, inputs, outputs)
    kctx = _context(device, params, stream, workspace)
    try:
        if _verify.ACTIVE[0]:
            _run_verified(op, device, dtype, cand, kctx, inputs, outputs)
        elif _abi_checked.get(id(cand)) is not cand:  # a candidate's first call: the whole ABI (abi.check)
            abi.check(cand.name, op, abi.snapshot(outputs), outputs, cand.fn(kctx, inputs, outputs))
            _abi_checked[id(cand)] = cand
        else:  # every call after: only the return value, one compare
            returned = cand.fn(kctx, inputs, outputs)
            if returned is not None and not abi.returns_outputs(returned, outputs):
                abi.check(cand.name, op, abi.snapshot(outputs), outputs, returned)  # raises: names the kernel
    except DtorchError:
        raise
    except Exception as exc:
        raise _fail(op, cand, device, exc) from exc


def call(op: str, device: Device, dtype: torch.dtype, inputs: Sequence, params: KernelParams,
         make_outputs: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The functional path: run the winner's allocating form when it has one, else allocate and run."""
    cand = select(op, device, dtype, inputs, params)
    functional = cand.functional
    if functional is None or _verify.ACTIVE[0] or cand.meta.requires_dense:
        outputs = make_outputs()
        run(op, device, dtype, inputs, outputs, params)
        return outputs
    try:
        return functional(_context(device, params, None, None), inputs)
    except DtorchError:
        raise
    except Exception as exc:
        raise _fail(op, cand, device, exc) from exc


def _run_verified(op, device, dtype, cand, kctx, inputs, outputs) -> None:
    key = KernelKey(op, device.type, dtype)
    _verify.run_verified(key, cand, _dispatcher.reference(key), kctx, inputs, outputs)


def invoke(op_name: str, inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
           params: KernelParams | dict | None = None, ctx: RuntimeContext | None = None,
           dtype: torch.dtype | None = None) -> Sequence[torch.Tensor]:
    """Run ``op_name`` on caller-allocated ``outputs``; returns ``outputs``.

    The kernel key takes the device of ``ctx`` (or of the first tensor) and ``dtype`` (default: the
    first input's dtype, or the first output's for creation ops). Every tensor must be strided and on
    that device; no op-specific validation is done here: the named wrappers (``dtorch.ops.add`` ...) do that.
    """
    if not isinstance(op_name, str):
        raise ArgumentError(f"invoke: op_name must be a str like 'binary.add', got {type(op_name).__name__}")
    tensors = [t for t in list(inputs) + list(outputs) if isinstance(t, torch.Tensor)]
    if not tensors and ctx is None:
        raise ArgumentError(f"invoke {op_name}: no tensors and no ctx, so the device is unknown")
    device = ctx.device if ctx is not None else device_of(tensors[0])
    named = {f"inputs[{i}]": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
    named |= {f"outputs[{i}]": t for i, t in enumerate(outputs)}
    for name, t in named.items():
        _checks.tensor(op_name, name, t)
        _checks.on_device(op_name, name, t, device)
    if dtype is None:
        first = next((t for t in inputs if isinstance(t, torch.Tensor)), None)
        dtype = (first if first is not None else outputs[0]).dtype
    if isinstance(params, dict):
        params = KernelParams(**params)
    KernelKey.of(op_name, device, dtype)  # a clear error for a malformed name
    run(op_name, device, dtype, list(inputs), list(outputs), params or NO_PARAMS,
        ctx.stream if ctx is not None else None, ctx.workspace if ctx is not None else None)
    return outputs
