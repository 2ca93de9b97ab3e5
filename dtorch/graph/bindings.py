"""How a graph call becomes a kernel call, through the op wrapper's own validation and derivation.

``LogicalGraph.call(op, *args, **kwargs)`` takes the arguments of the op's wrapper, with Operands where the wrapper
takes tensors: ``g.call("llm.rope", x, positions, rotary_dim=64)``, ``g.call("llm.embedding", ids, weight)``,
``g.call("creation.zeros", (4, 8))``. Each op declares how (``dtorch.ops.graph_op.GraphOp``, beside its wrapper);
``bind`` reads that declaration and gives a ``Bound``: the kernel op, the kernel's inputs in kernel order, the
owned params derived by the same functions the wrapper calls, an ``infer`` that runs the wrapper itself on meta
tensors (so a bad call fails at build time with the wrapper's message), and the op's placement rule.

In place: ``out=x`` (rms_norm, softmax_last_dim, rope), ``residual_out=residual`` (add_rms_norm) and
``final_state_out=initial_state`` (gated_delta_net) mirror the wrappers' ``*_out`` forms: that output is
written into the named input's storage (``Bound.aliases``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtorch import ops
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import ArgumentError, DTypeError, GraphError, ShapeError
from dtorch.dispatch.context import KernelParams
from dtorch.dispatch.key import did_you_mean
from dtorch.graph.operand import Operand
from dtorch.ops.graph_op import Args, GraphOp, Rule, declared, declared_ops, replicated

Infer = Callable[[Sequence["torch.Tensor | None"]], "torch.Tensor | tuple[torch.Tensor, ...]"]


@dataclass(frozen=True, slots=True)
class Bound:
    """``inputs`` are the kernel's inputs in kernel order (None for an absent optional one); ``infer`` maps meta
    tensors of them to the output (or a tuple, one per kernel output); ``aliases[j]`` is the input that output
    ``j`` is written into in place (None: a fresh tensor; empty: all fresh); ``rule`` the op's placement rule."""

    kernel_op: str
    inputs: tuple[Operand | None, ...]
    params: KernelParams
    infer: Infer
    num_outputs: int = 1
    aliases: tuple[int | None, ...] = ()
    rule: Rule = replicated


def _name(fn: Callable[..., Any]) -> str:
    """``dtorch.ops.rms_norm`` for a wrapper that ``dtorch.ops`` exports, else the wrapper's module and name."""
    name = getattr(fn, "__name__", "")
    if getattr(ops, name, None) is fn:
        return f"dtorch.ops.{name}"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', name)}"


def _arguments(op: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Args:
    sig = inspect.signature(fn)
    try:
        ba = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise ArgumentError(f"graph call {op!r}: {exc}; it takes the arguments of {_name(fn)}{sig} with Operands for "
                            "tensors") from None
    ba.apply_defaults()
    return dict(ba.arguments)


def _check_kinds(op: str, fn: Callable[..., Any], a: Args, inputs: tuple[str, ...]) -> None:
    """Kernel inputs are Operands (None only where the wrapper's default is None); nothing else is."""
    required = {k for k, p in inspect.signature(fn).parameters.items() if p.default is inspect.Parameter.empty}
    for name, v in a.items():
        if name in inputs:
            if v is None and name in required:
                raise ArgumentError(f"graph call {op!r}: argument {name!r} is a required tensor, got None")
            if v is not None and not isinstance(v, Operand):
                raise ArgumentError(f"graph call {op!r}: argument {name!r} must be an Operand of the graph (from "
                                    f"input, param, state or a call), got {type(v).__name__}")
        elif isinstance(v, Operand):
            raise ArgumentError(f"graph call {op!r}: argument {name!r} is not a tensor input of the kernel, got "
                                f"Operand {v.name}")


def _aliases(op: str, spec: GraphOp, a: Args, given: dict[str, Any], inputs: tuple[str, ...],
             nout: int) -> tuple[int | None, ...]:
    aliases = list(spec.always_inplace or (None,) * nout)
    for kw, j, name in spec.inplace:
        v = given.get(kw)
        if v is None:
            continue
        if v is not a[name]:
            got = v.name if isinstance(v, Operand) else type(v).__name__
            raise ArgumentError(f"graph call {op!r}: {kw!r} may only be {name!r} itself (output {j} is then written "
                                f"into it in place), got {got}")
        if j >= nout:
            raise ArgumentError(f"graph call {op!r}: {kw!r} names output {j}, but the call asks for {nout} output(s)")
        aliases[j] = inputs.index(name)
    return tuple(aliases) if any(x is not None for x in aliases) else ()


def _check_alias(op: str, out: torch.Tensor, x: torch.Tensor | None, j: int) -> None:
    """An output written into an input must have that input's shape and dtype."""
    if x is None:
        raise ArgumentError(f"{op}: output {j} is written in place into an input that was not given")
    if out.shape != x.shape:
        raise ShapeError(f"{op}: output {j} {list(out.shape)} is written in place into an input of shape "
                         f"{list(x.shape)}")
    if out.dtype != x.dtype:
        raise DTypeError(f"{op}: output {j} ({dtype_name(out.dtype)}) is written in place into an input of dtype "
                         f"{dtype_name(x.dtype)}")


def _infer(op: str, fn: Callable[..., Any], spec: GraphOp, a: Args, inputs: tuple[str, ...],
           aliases: tuple[int | None, ...]) -> Infer:
    base = spec.meta_args(a) if spec.meta_args is not None else a
    if spec.creates:
        base = base | {"device": "meta"}

    def infer(metas: Sequence[torch.Tensor | None]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        call = base | dict(zip(inputs, metas, strict=True))
        res = fn(**call)
        res = spec.result(res, call) if spec.result is not None else res
        for j, i in enumerate(aliases):
            if i is not None:
                _check_alias(op, res if isinstance(res, torch.Tensor) else res[j], metas[i], j)
        return res

    return infer


def _undeclared(op: str) -> GraphError:
    hint = did_you_mean(op, declared_ops())
    return GraphError(f"graph call {op!r}: no op wrapper is declared for it" + (f" ({hint})" if hint else "")
                      + "; an op declares its wrapper, kernel inputs and placement rule with dtorch.ops.declare, "
                      "beside its kernel (or use LogicalGraph.python(fn, ...) for a custom computation)")


def bind(op: str, args: tuple, kwargs: dict) -> Bound:
    """The kernel call behind ``LogicalGraph.call(op, *args, **kwargs)``."""
    if not isinstance(op, str) or "." not in op:
        raise ArgumentError(f"graph call: op must be a name like 'matmul.mm', got {op!r}")
    spec = declared(op)
    if spec is None:
        raise _undeclared(op)
    fn = spec.wrapper
    if spec.creates and "device" in kwargs:
        raise ArgumentError(f"graph call {op!r}: the graph places what it creates on its mesh; do not pass 'device'")
    kwargs = dict(kwargs)
    given = {kw: kwargs.pop(kw) for kw, _, _ in spec.inplace if kw in kwargs}
    a = _arguments(op, fn, args, kwargs)
    inputs = spec.inputs(a) if callable(spec.inputs) else spec.inputs
    _check_kinds(op, fn, a, inputs)
    params = spec.params(op, a)
    nout = spec.outputs(a) if callable(spec.outputs) else spec.outputs
    aliases = _aliases(op, spec, a, given, inputs, nout)
    kernel_op = spec.kernel_op(op, a) if spec.kernel_op is not None else op
    return Bound(kernel_op, tuple(a[n] for n in inputs), params, _infer(op, fn, spec, a, inputs, aliases), nout,
                 aliases, spec.rule or replicated)


__all__ = ["Bound", "bind"]
