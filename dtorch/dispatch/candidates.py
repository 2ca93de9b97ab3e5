"""What the ``Dispatcher`` keeps and answers: the kernel signatures, a key's ``Candidate``s, the ``Choice`` for one
call, the ``Explanation`` of a key and the rows of its ``table``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dtorch.dispatch.context import KernelContext
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import DEFAULT_META, Check, KernelMeta

KernelFn = Callable[[KernelContext, Sequence[torch.Tensor], Sequence[torch.Tensor]], None]
FunctionalFn = Callable[[KernelContext, Sequence[torch.Tensor]], tuple]


def _origin(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One registered implementation of a key."""

    fn: KernelFn
    provider: str
    priority: int
    meta: KernelMeta
    check: Check | None
    seq: int  # registration order, newer wins ties
    # Optional allocating form of the same kernel, ``functional(ctx, inputs) -> tuple of outputs``, used by
    # the functional op wrappers: torch's allocating calls skip the out= checks and cost ~1 us less.
    functional: FunctionalFn | None = None
    # How the kernel's path depends on facts of the call that a key does not fix, in a few words
    # ("torch's bf16 mm below 16 rows"); shown by explain and table next to the provider.
    varies: str | None = None

    @property
    def name(self) -> str:
        return f"{self.provider}:{_origin(self.fn)}"


@dataclass(frozen=True, slots=True)
class Choice:
    """The result of choosing for one call: the winner and why each other candidate lost."""

    key: KernelKey
    winner: Candidate
    passed_over: tuple[tuple[Candidate, str], ...]


@dataclass(frozen=True, slots=True)
class Explanation:
    """Every candidate of a key, in order, with the winner marked and a reason for each other."""

    key: KernelKey
    rows: tuple[tuple[Candidate, str], ...]  # (candidate, "active" or why it was passed over)
    winner: Candidate | None
    unavailable: tuple[tuple[str, str], ...] = ()  # (backend, why it did not load) on this device type

    def __str__(self) -> str:
        lines = [f"{self.key}: {len(self.rows)} candidate(s)"]
        for cand, status in self.rows:
            mark = "*" if cand is self.winner else " "
            varies = f"; varies: {cand.varies}" if cand.varies else ""
            lines.append(f" {mark} {cand.provider:<10} priority {cand.priority:<4} {_origin(cand.fn)}  "
                         f"[{status}{varies}]  meta: {cand.meta.describe()}")
        if self.winner is None:
            lines.append("   no candidate accepts this call")
        for backend, reason in self.unavailable:
            lines.append(f"   backend {backend!r} unavailable on {self.key.device}: {reason}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class TableRow:
    key: KernelKey
    provider: str
    priority: int
    active: bool
    origin: str
    meta: KernelMeta = field(default=DEFAULT_META)
    varies: str | None = None
