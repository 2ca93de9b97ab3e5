"""``PreparedKernel``: a kernel chosen once for a key and the static facts of its calls.

It remembers the winner and why the others lost. Its ``fn`` is what a caller runs every step, with
no lookup and no check after the first call of each binding (which checks the kernel ABI: see ``abi``;
verify mode checks every call): the dispatcher re-binds every live prepared kernel when a registration
changes, a provider is disabled for an A/B block, or verify mode flips, so ``fn`` is always current.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from dtorch.core.errors import DtorchError
from dtorch.dispatch import abi, verification as _verify
from dtorch.dispatch.context import KernelContext
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.dispatch.registry import Candidate, Choice, Dispatcher, Explanation, KernelFn


class PreparedKernel:
    __slots__ = ("key", "call", "dispatcher", "choice", "fn", "__weakref__")

    def __init__(self, dispatcher: Dispatcher, key: KernelKey, call: Call | None = None) -> None:
        self.dispatcher = dispatcher
        self.key = key
        self.call = call
        self.choice: Choice = dispatcher.choose(key, call)  # raises KernelNotFound now, at prepare time
        self.fn: KernelFn = self._runner()
        dispatcher.watch(self)

    def rebind(self) -> None:
        """Choose again (called by the dispatcher on every change)."""
        try:
            self.choice = self.dispatcher.choose(self.key, self.call)
        except DtorchError as exc:  # e.g. every candidate disabled: fail when run, not when registering
            error = exc

            def unavailable(ctx, inputs, outputs):
                raise error
            self.fn = unavailable
            return
        self.fn = self._runner()

    def _runner(self) -> KernelFn:
        winner = self.choice.winner
        if not _verify.ACTIVE[0]:
            return self._first_call(winner)
        reference = self.dispatcher.reference(self.key)
        key = self.key

        def verified(ctx, inputs, outputs):
            _verify.run_verified(key, winner, reference, ctx, inputs, outputs)
        return verified

    def _first_call(self, winner: Candidate) -> KernelFn:
        """``winner.fn`` with the ABI checked once: the first call checks, then puts the bare kernel in its place."""
        where = str(self.key)

        def first(ctx, inputs, outputs):
            facts = abi.snapshot(outputs)
            abi.check(winner.name, where, facts, outputs, winner.fn(ctx, inputs, outputs))
            if self.fn is first:  # not re-bound meanwhile
                self.fn = winner.fn
        return first

    @property
    def candidate(self) -> Candidate:
        return self.choice.winner

    @property
    def provider(self) -> str:
        return self.choice.winner.provider

    @property
    def meta(self) -> KernelMeta:
        return self.choice.winner.meta

    def explain(self) -> Explanation:
        return self.dispatcher.explain(self.key, self.call)

    def __call__(self, ctx: KernelContext, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        self.fn(ctx, inputs, outputs)

    def bound(self, ctx: KernelContext, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
              ) -> Callable[[], object]:
        """This call on these very tensors as a callable of no arguments, for a caller that makes the same call every
        step (a static plan's bare loop): the kernel's own ``bind(ctx, inputs, outputs)`` where it has one and takes
        these tensors (the native kernels: the compiled function with its arguments fixed, no per-call checks in
        Python), else ``fn`` with the arguments fixed. Valid while the dispatcher's ``generation`` stays what it was
        (a re-bind makes a new ``fn``); made after the first call of each binding, or it keeps the ABI check."""
        fn = self.fn
        bind = getattr(fn, "bind", None)
        made = bind(ctx, inputs, outputs) if bind is not None else None
        return made if made is not None else functools.partial(fn, ctx, inputs, outputs)

    def __repr__(self) -> str:
        return f"PreparedKernel({self.key}, provider={self.provider!r})"
