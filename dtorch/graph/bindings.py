"""How a graph call maps to a kernel: ``bind("binary.add", (x, 2.0), {})`` gives the kernel op
(``binary.add_scalar``), its tensor inputs, its owned ``KernelParams`` and the op wrapper that infers
the output's metadata on ``meta`` tensors (so validation errors surface at build time).

Families with non-tensor arguments have a binder; any other op ``family.name`` binds its operands as
kernel inputs, its keyword arguments as params, and infers through ``dtorch.ops.<name>``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtorch import ops
from dtorch.core.errors import ArgumentError, GraphError
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.graph.operand import Operand

Infer = Callable[[Sequence["torch.Tensor | None"]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Bound:
    """``inputs`` are the kernel's tensor inputs in order (None for an absent optional one)."""

    kernel_op: str
    inputs: tuple[Operand | None, ...]
    params: KernelParams
    infer: Infer  # meta (or local meta) input tensors, in ``inputs`` order -> the output tensor


def _wrapper(op: str, name: str) -> Callable[..., Any]:
    fn = getattr(ops, name, None)
    if fn is None:
        raise GraphError(f"graph call {op!r}: no op wrapper dtorch.ops.{name} to infer its output "
                         f"(use LogicalGraph.python(fn, ...) for a custom computation)")
    return fn


def _unary(op: str, name: str, args: tuple, kwargs: dict) -> Bound:
    fn = _wrapper(op, name)
    params = KernelParams(approximate=kwargs.get("approximate", "none")) if name == "gelu" else NO_PARAMS
    return Bound(op, (args[0],), params, lambda t: fn(t[0], *args[1:], **kwargs))


def _binary(op: str, name: str, args: tuple, kwargs: dict) -> Bound:
    fn = _wrapper(op, name)
    if len(args) != 2 or kwargs:
        raise ArgumentError(f"graph call {op!r}: takes two arguments (a, b), got {len(args)} and {sorted(kwargs)}")
    a, b = args
    if isinstance(b, Operand):
        return Bound(op, (a, b), NO_PARAMS, lambda t: fn(t[0], t[1]))
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise ArgumentError(f"graph call {op!r}: 'b' must be an Operand or a Python number, got {type(b).__name__}")
    return Bound(f"{op}_scalar", (a,), KernelParams(value=b), lambda t: fn(t[0], b))


def _reduce(op: str, name: str, args: tuple, kwargs: dict) -> Bound:
    fn = _wrapper(op, name)
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.ndim <= dim < max(x.ndim, 1):
        raise ArgumentError(f"graph call {op!r}: 'dim' must be an int in [{-x.ndim}, {x.ndim}), got {dim!r}")
    dim %= max(x.ndim, 1)
    return Bound(op, (x,), KernelParams(dim=dim, keepdim=keepdim), lambda t: fn(t[0], dim, keepdim=keepdim))


def _linear(op: str, name: str, args: tuple, kwargs: dict) -> Bound:
    fn = _wrapper(op, name)
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return Bound(op, (x, w, bias), NO_PARAMS, lambda t: fn(t[0], t[1], t[2]))


def _generic(op: str, name: str, args: tuple, kwargs: dict) -> Bound:
    fn = _wrapper(op, name)
    extra = [a for a in args if not isinstance(a, Operand)]
    if extra:
        raise ArgumentError(f"graph call {op!r}: pass non-tensor arguments by keyword, got positional {extra!r}")
    return Bound(op, tuple(args), KernelParams(**kwargs), lambda t: fn(*t, **kwargs))


BINDERS: dict[str, Callable[[str, str, tuple, dict], Bound]] = {
    "unary": _unary, "binary": _binary, "reduce": _reduce, "matmul.linear": _linear,
}


def bind(op: str, args: tuple, kwargs: dict) -> Bound:
    """The kernel call behind ``LogicalGraph.call(op, *args, **kwargs)``."""
    if not isinstance(op, str) or "." not in op:
        raise ArgumentError(f"graph call: op must be a name like 'matmul.mm', got {op!r}")
    family, _, name = op.partition(".")
    if not args or not isinstance(args[0], Operand):
        raise ArgumentError(f"graph call {op!r}: the first argument must be an Operand, got "
                            f"{type(args[0]).__name__ if args else 'nothing'}")
    binder = BINDERS.get(op) or BINDERS.get(family) or _generic
    return binder(op, name, args, kwargs)
