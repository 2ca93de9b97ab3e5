"""``KernelSet``: kernels declared next to their definitions, installed into a Dispatcher once.

A kernel file reads like its registration table::

    from dtorch.kernels.torch.registry import KERNELS, FLOATS

    @KERNELS.kernel("llm.rms_norm", FLOATS, meta=KernelMeta(requires_dense=True))
    def rms_norm(ctx, inputs, outputs): ...

Nothing touches a Dispatcher at import time; ``install(dispatcher, device_type)`` registers every
entry declared for that device type. A reference kernel defines its op: ``install`` declares the op of
every reference entry before registering the rest, so an accelerated kernel for an op that has no
reference is refused like any other unknown op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dtorch.core.errors import RegistrationError
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Check, KernelMeta
from dtorch.dispatch.registry import Dispatcher, FunctionalFn, KernelFn, check_priority


@dataclass(frozen=True, slots=True)
class Entry:
    op: str
    fn: KernelFn
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]
    provider: str
    priority: int | None
    meta: KernelMeta | None
    check: Check | None
    layout: str
    functional: FunctionalFn | None
    varies: str | None


class KernelSet:
    """An append-only list of kernel declarations."""

    def __init__(self, devices: tuple[str, ...] = ("cpu",)) -> None:
        self.default_devices = devices
        self.entries: list[Entry] = []
        self._lock = threading.Lock()

    def add(self, op: str, fn: KernelFn, dtypes: Iterable[torch.dtype], *, devices: tuple[str, ...] | None = None,
            provider: str = "reference", priority: int | None = None, meta: KernelMeta | None = None,
            check: Check | None = None, layout: str = "strided", functional: FunctionalFn | None = None,
            varies: str | None = None) -> KernelFn:
        """Declare ``fn`` for ``op`` on each of ``dtypes`` (and ``devices``); ``functional`` is its optional
        allocating form ``(ctx, inputs) -> tuple of outputs``; ``varies`` says how its path depends on the call."""
        KernelKey.of(op, "cpu", torch.float32, layout)  # validates the name and layout early
        dts = tuple(dtypes)
        if priority is not None:
            priority = check_priority(op, priority)
        if not dts:
            raise RegistrationError(f"{op}: a kernel must be declared for at least one dtype")
        with self._lock:
            self.entries.append(Entry(op, fn, dts, devices or self.default_devices, provider, priority, meta,
                                      check, layout, functional, varies))
        return fn

    def kernel(self, op: str, dtypes: Iterable[torch.dtype], **kw) -> Callable[[KernelFn], KernelFn]:
        """Decorator form of ``add``."""
        def wrap(fn: KernelFn) -> KernelFn:
            return self.add(op, fn, dtypes, **kw)
        return wrap

    def install(self, dispatcher: Dispatcher, device_type: str) -> int:
        """Register every entry declared for ``device_type``; returns how many keys were registered."""
        entries = [e for e in list(self.entries) if device_type in e.devices]
        for e in entries:
            if e.provider == "reference":
                dispatcher.define(e.op)
        n = 0
        for e in entries:
            for dt in e.dtypes:
                dispatcher.register(KernelKey(e.op, device_type, dt, e.layout), e.fn, provider=e.provider,
                                    priority=e.priority, meta=e.meta, check=e.check, functional=e.functional,
                                    varies=e.varies)
                n += 1
        return n
