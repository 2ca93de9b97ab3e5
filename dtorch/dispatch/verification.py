"""Verify mode: run the reference kernel beside the active one and compare their outputs.

Turn it on with ``DTORCH_VERIFY=1``, ``dtorch.verify_mode(True)`` or ``with dtorch.verify():``.
A disagreement beyond the dtype's tolerance raises ``VerifyError`` naming the op, the two
providers and the largest difference.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence

import torch

from dtorch.core import env
from dtorch.core.dtypes import tolerance
from dtorch.core.errors import VerifyError
from dtorch.dispatch import abi

_lock = threading.Lock()
_depth = 0
ACTIVE = [env.verify()]  # read on the hot path: ACTIVE[0]
_listeners: list[weakref.WeakMethod] = []  # dispatchers re-bind their prepared kernels when the mode flips


def add_listener(method) -> None:
    _listeners.append(weakref.WeakMethod(method))


def _set(on: bool) -> None:
    if ACTIVE[0] == on:
        return
    ACTIVE[0] = on
    for ref in list(_listeners):
        fn = ref()
        if fn is None:
            _listeners.remove(ref)
        else:
            fn()


def verify_mode(on: bool) -> None:
    """Switch verify mode on or off for the whole process."""
    _set(bool(on) or _depth > 0)


@contextlib.contextmanager
def verify() -> Iterator[None]:
    """Verify every kernel call inside the block."""
    global _depth
    with _lock:
        _depth += 1
        _set(True)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            _set(_depth > 0 or env.verify())


def run_verified(key, active, reference, ctx, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Run ``active`` into ``outputs`` and ``reference`` into scratch copies; raise if they differ, or if ``active``
    broke the kernel ABI: returned a value, changed an output's shape, dtype or storage, or wrote into an input
    that is not an output."""
    where = f"verify {key}"
    ref_inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]
    facts = abi.snapshot(outputs)
    if reference is None or reference is active:
        abi.check(active.name, where, facts, outputs, active.fn(ctx, inputs, outputs))
        abi.inputs_unchanged(active.name, where, inputs, ref_inputs, outputs)
        return
    ref_outputs = [t.clone() for t in outputs]  # in-place kernels read their outputs too
    abi.check(active.name, where, facts, outputs, active.fn(ctx, inputs, outputs))
    abi.inputs_unchanged(active.name, where, inputs, ref_inputs, outputs)
    reference.fn(ctx, ref_inputs, ref_outputs)
    for i, (got, want) in enumerate(zip(outputs, ref_outputs, strict=True)):
        rtol, atol = tolerance(want.dtype)
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=rtol * 10, atol=atol * 10,
                                                         equal_nan=True):
            raise VerifyError(f"verify {key}: output {i} of {active.provider} ({active.name}) differs from "
                              f"reference ({reference.name}) {_difference(got, want)} "
                              f"(rtol {rtol * 10}, atol {atol * 10})")


def _difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """How two outputs differ: shapes, NaN where the other has a number (a NaN hidden or invented), or the gap."""
    if got.shape != want.shape:
        return f"in shape: {list(got.shape)} vs {list(want.shape)}"
    g, w = got.float(), want.float()
    nan_mismatch = int((g.isnan() != w.isnan()).sum())
    if nan_mismatch:
        return (f"in NaN: {int((g.isnan() & ~w.isnan()).sum())} NaN where the reference has a number, "
                f"{int((w.isnan() & ~g.isnan()).sum())} numbers where the reference has NaN")
    both = ~g.isnan()
    return f"by up to {(g[both] - w[both]).abs().max().item():.3g}"
