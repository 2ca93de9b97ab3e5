"""``PreparedKernel``: a kernel chosen once for a key and the static facts of its calls.

It remembers the winner and why the others lost, and runs the winner on every call. If the
dispatcher changes (a registration, a provider disabled for an A/B block) it chooses again on
its next call, so a prepared model follows ``dispatcher.disabled(...)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dtorch.dispatch import verification as _verify
from dtorch.dispatch.context import KernelContext
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.dispatch.registry import Candidate, Choice, Dispatcher, Explanation


class PreparedKernel:
    __slots__ = ("key", "call", "dispatcher", "choice", "fn", "generation", "_reference")

    def __init__(self, dispatcher: Dispatcher, key: KernelKey, call: Call | None = None) -> None:
        self.dispatcher = dispatcher
        self.key = key
        self.call = call
        self._bind()

    def _bind(self) -> None:
        self.generation = self.dispatcher.generation
        self.choice: Choice = self.dispatcher.choose(self.key, self.call)
        self.fn = self.choice.winner.fn
        self._reference: Candidate | None = None

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
        if self.generation != self.dispatcher.generation:
            self._bind()
        if _verify.ACTIVE[0]:
            self._run_verified(ctx, inputs, outputs)
        else:
            self.fn(ctx, inputs, outputs)

    def _run_verified(self, ctx, inputs, outputs) -> None:
        if self._reference is None:
            refs = [c for c in self.dispatcher.candidates(self.key) if c.provider == "reference"]
            self._reference = refs[0] if refs else self.choice.winner
        _verify.run_verified(self.key, self.choice.winner, self._reference, ctx, inputs, outputs)

    def __repr__(self) -> str:
        return f"PreparedKernel({self.key}, provider={self.provider!r})"
