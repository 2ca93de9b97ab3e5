"""``PreparedOperator``: bind a kernel once at load time, validate and run it every step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import ArgumentError, DeviceError, DtorchError, DTypeError, KernelFailure
from dtorch.core.memory import default_workspace
from dtorch.dispatch import dispatcher as _global_dispatcher
from dtorch.dispatch.context import NO_PARAMS, KernelContext, KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.dispatch.prepared import PreparedKernel
from dtorch.dispatch.registry import Dispatcher, Explanation
from dtorch.ops import _checks
from dtorch.ops._checks import STRIDED
from dtorch.ops.context import OperatorInitContext, RuntimeContext


class PreparedOperator:
    """Base of prepared operators.

    A subclass sets ``op`` and its ``params`` (an immutable ``KernelParams`` it owns), implements
    ``forward_out(..., out=, ctx=None)`` (validate, then ``self._run``) and ``forward`` (allocate,
    then ``forward_out``). ``prepare(init_ctx)`` chooses the kernel once, keeping the explanation.
    """

    op: ClassVar[str]

    def __init__(self, params: KernelParams = NO_PARAMS) -> None:
        self.params = params
        self.kernel: PreparedKernel | None = None
        self.init: OperatorInitContext | None = None
        # The prepared dtype and torch device, for the hot paths' identity and equality checks.
        self._dtype: torch.dtype | None = None
        self._device: torch.device | None = None
        self._kctx: KernelContext | None = None
        self._last_rt: tuple[RuntimeContext | None, KernelContext | None] = (None, None)
        # The tensors of the last call, once checked: a call with the same objects (a decode loop passes the same
        # buffers every step) is not checked again. A tensor changed in place in between (resize_, set_, .data =)
        # is not noticed: pass a new tensor instead. Held until the next call.
        self._checked: tuple = ()

    # -- prepare ------------------------------------------------------------------------------

    def call_facts(self, init: OperatorInitContext) -> Call:
        """The static facts capability checks see; subclasses add what they know (shapes as meta tensors)."""
        return Call(init.device, init.dtype, self.params, None)

    def prepare(self, init: OperatorInitContext, dispatcher: Dispatcher | None = None) -> PreparedOperator:
        """Bind the kernel for ``init``'s (device, dtype, layout); returns self."""
        if not isinstance(init, OperatorInitContext):
            raise ArgumentError(f"{type(self).__name__}.prepare: expected an OperatorInitContext, "
                                f"got {type(init).__name__}")
        key = KernelKey(self.op, init.device.type, init.dtype, init.layout)
        facts = self.call_facts(init)
        if init.capture:  # only capture-safe kernels; explain names the others as passed over for it
            facts = facts._replace(capture=True)
        self.kernel = PreparedKernel(dispatcher or _global_dispatcher, key, facts)
        self.init = init
        self._dtype, self._device = init.dtype, init.device.torch
        self._kctx = KernelContext(init.device, None, default_workspace(init.device), self.params)
        self._last_rt = (None, None)
        return self

    @property
    def prepared(self) -> bool:
        return self.kernel is not None

    @property
    def provider(self) -> str:
        return self._bound().provider

    def explain(self) -> Explanation:
        """Which candidate this operator is bound to and why the others were passed over."""
        return self._bound().explain()

    def _bound(self) -> PreparedKernel:
        if self.kernel is None:
            raise ArgumentError(f"{type(self).__name__} ({self.op}) is not prepared; "
                                "call prepare(OperatorInitContext(...)) first")
        return self.kernel

    # -- run ----------------------------------------------------------------------------------

    def _check_like(self, name: str, t: torch.Tensor) -> None:
        """``t`` is a strided tensor of the prepared dtype on the prepared device (type and index; every
        ``cpu:N`` holds torch's ``cpu`` tensors)."""
        init = self.init
        if init is None:
            self._bound()
        _checks.tensor(self.op, name, t)
        if t.dtype != init.dtype:
            raise DTypeError(f"{self.op}: argument {name!r} has dtype {dtype_name(t.dtype)}, but the operator was "
                             f"prepared for {dtype_name(init.dtype)}")
        if t.device != self._device:
            raise DeviceError(f"{self.op}: argument {name!r} is on {t.device}, but the operator was prepared for "
                              f"{init.device} (torch device {self._device}; type and index must match)")

    def _plain(self, *tensors: torch.Tensor) -> bool:
        """Whether every one of ``tensors`` is a plain strided tensor of the prepared dtype and device: the
        per-tensor part of the hot paths' check (they inline it where a call would cost too much)."""
        dt, dev = self._dtype, self._device
        for t in tensors:
            if type(t) is not torch.Tensor or t.dtype is not dt or t.layout is not STRIDED or t.device != dev:
                return False
        return True

    def _context(self, ctx: RuntimeContext | None) -> KernelContext:
        if ctx is None:
            return self._kctx
        last_rt, last_k = self._last_rt
        if ctx is last_rt and last_k is not None and last_k.stream is ctx.stream and (
                ctx.workspace is None or last_k.workspace is ctx.workspace) and last_k.device == ctx.device:
            return last_k
        self._bound()
        if ctx.device.torch != self._device:
            raise DeviceError(f"{self.op}: the runtime context is on {ctx.device}, but the operator was prepared for "
                              f"{self.init.device} (torch device {self._device})")
        workspace = ctx.workspace if ctx.workspace is not None else default_workspace(ctx.device)
        kctx = KernelContext(ctx.device, ctx.stream, workspace, self.params)
        self._last_rt = (ctx, kctx)
        return kctx

    def _run(self, inputs: Sequence, outputs: Sequence[torch.Tensor], ctx: RuntimeContext | None) -> None:
        """Run the bound kernel: the whole per-step cost beyond the kernel is this call."""
        try:
            self.kernel.fn(self._kctx if ctx is None else self._context(ctx), inputs, outputs)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception, kernel: PreparedKernel | None = None) -> None:
        """Re-raise a kernel's exception as a ``DtorchError`` naming the op and the kernel (default: the bound one)."""
        if isinstance(exc, DtorchError):
            raise exc
        kernel = kernel or self._bound()
        raise KernelFailure(f"{kernel.key}: prepared kernel {kernel.candidate.name} failed: "
                            f"{type(exc).__name__}: {exc}") from exc

    def __repr__(self) -> str:
        state = f"bound to {self.kernel.provider}" if self.kernel else "not prepared"
        return f"{type(self).__name__}({self.op}, {self.params}, {state})"
