"""An op's graph declaration, beside its wrapper: how ``LogicalGraph.call`` binds it to its kernel, and where it
may run.

Each ops module declares its ops next to their wrappers (``llm.rope`` in ``dtorch/ops/rope.py``), so an op is one
place plus its kernels: a reference kernel defines the op in the registry, and the op's module holds the wrapper,
the graph binding and the placement rule. ``dtorch.graph`` reads the declarations (``declared``) and keeps only the
machinery: binding a call (``dtorch.graph.bindings``) and choosing a strategy (``dtorch.graph.strategy``)::

    declare("myfamily.scale", scale, ("x", "s"), params=lambda op, a: KernelParams(alpha=a["alpha"]),
            rule=lambda op, shapes, params, n: [Strategy((R, R), R), Strategy((Shard(0), Shard(0)), Shard(0))])

Binding. ``g.call(op, *args, **kwargs)`` takes the wrapper's arguments, with Operands where it takes tensors.
``inputs`` names the wrapper arguments that are the kernel's inputs, in kernel order (or maps the arguments to
them); ``params(op, args)`` derives the owned params with the functions the wrapper itself calls; the output is
inferred by running the wrapper on meta tensors, so a bad call fails at build with the wrapper's message.
``inplace`` rows ``(keyword, output, input)`` mirror the wrappers' ``*_out`` forms (``out=x``): that output is
written into the named input's storage; ``always_inplace`` are aliases every call has.

Placement rule, as DTensor's op strategies: ``rule(kernel_op, shapes, params, n)`` lists every ``Strategy`` the
kernel can run with on ``n`` devices, the replicated one first; shapes are in kernel-input order, None for an
absent optional input. An op declared without a rule runs replicated.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dtorch.core.errors import RegistrationError
from dtorch.core.placement import Partial, Placement, Replicate, Shard, shard_sizes
from dtorch.dispatch.context import NO_PARAMS, KernelParams

R = Replicate()
P = Partial()
Args = dict[str, Any]  # the wrapper's arguments by name, defaults applied; Operands where it takes tensors
Shapes = Sequence["tuple[int, ...] | None"]
LocalParams = Callable[[KernelParams, int, int], KernelParams]


class Strategy(NamedTuple):
    """Wanted placement per kernel input (None for absent inputs) and the output placement(s) it gives.

    ``local_params(params, rank, n)``: that device's params, where devices need different ones (a
    vocabulary-parallel embedding's row offset)."""

    inputs: tuple[Placement | None, ...]
    output: Placement | tuple[Placement, ...]
    local_params: LocalParams | None = None


Rule = Callable[[str, Shapes, KernelParams, int], list[Strategy]]


def no_params(op: str, a: Args) -> KernelParams:
    return NO_PARAMS


@dataclass(frozen=True, slots=True)
class GraphOp:
    """One op's graph declaration (see the module docstring); ``declare`` makes and records it."""

    op: str
    wrapper: Callable[..., Any]
    inputs: tuple[str, ...] | Callable[[Args], tuple[str, ...]]
    params: Callable[[str, Args], KernelParams] = no_params
    rule: Rule | None = None
    outputs: int | Callable[[Args], int] = 1                       # kernel outputs a call asks for
    result: Callable[[Any, Args], Any] | None = None               # wrapper result -> the outputs' metas
    inplace: tuple[tuple[str, int, str], ...] = ()                 # (keyword, output, the input it may name)
    always_inplace: tuple[int | None, ...] = ()                    # aliases every call has
    kernel_op: Callable[[str, Args], str] | None = None            # default: the op itself
    meta_args: Callable[[Args], Args] | None = None                # what inference passes besides the meta inputs
    creates: bool = False  # makes its output from nothing: the graph places it on its mesh (no 'device' argument)


_DECLARED: dict[str, GraphOp] = {}
_lock = threading.Lock()


def declare(op: str, wrapper: Callable[..., Any], inputs: tuple[str, ...] | Callable[[Args], tuple[str, ...]],
            **fields: Any) -> GraphOp:
    """Declare ``op`` ("family.name") for graphs: ``wrapper`` (the ``dtorch.ops`` function a call's arguments are
    those of), the wrapper arguments that are kernel ``inputs``, and ``GraphOp``'s other fields by keyword
    (``params``, ``rule``, ``outputs``, ...). Declaring an op again replaces its declaration only with
    ``replace=True``; returns the declaration."""
    replace = fields.pop("replace", False)
    unknown = sorted(set(fields) - set(GraphOp.__slots__))
    if unknown:
        raise RegistrationError(f"declare {op!r}: unknown field(s) {', '.join(unknown)}; a GraphOp has "
                                f"{', '.join(GraphOp.__slots__[3:])}")
    if not isinstance(op, str) or op.count(".") != 1 or op.startswith(".") or op.endswith("."):
        raise RegistrationError(f"declare: an op name looks like 'family.name', got {op!r}")
    if not callable(wrapper):
        raise RegistrationError(f"declare {op!r}: the wrapper must be callable, got {type(wrapper).__name__}")
    if not isinstance(inputs, tuple) and not callable(inputs):
        raise RegistrationError(f"declare {op!r}: 'inputs' must be a tuple of argument names or a function of the "
                                f"arguments, got {inputs!r}")
    params = inspect.signature(wrapper).parameters
    missing = [n for n in inputs if n not in params] if isinstance(inputs, tuple) else []
    if missing:
        raise RegistrationError(f"declare {op!r}: input(s) {', '.join(map(repr, missing))} are not arguments of "
                                f"{getattr(wrapper, '__name__', 'the wrapper')}{inspect.signature(wrapper)}")
    for name in ("params", "rule", "result", "kernel_op", "meta_args"):
        if fields.get(name) is not None and not callable(fields[name]):
            raise RegistrationError(f"declare {op!r}: {name!r} must be callable, got {type(fields[name]).__name__}")
    decl = GraphOp(op, wrapper, inputs, **fields)
    with _lock:
        old = _DECLARED.get(op)
        if old is not None and old != decl and not replace:
            raise RegistrationError(f"declare {op!r}: already declared with the wrapper {old.wrapper.__module__}."
                                    f"{old.wrapper.__qualname__}; pass replace=True to replace it")
        _DECLARED[op] = decl
    return decl


def declared(op: str) -> GraphOp | None:
    """The declaration of ``op``, or None."""
    return _DECLARED.get(op)


def declared_ops() -> list[str]:
    """Every declared op, sorted."""
    return sorted(_DECLARED)


def undeclare(op: str) -> None:
    """Forget the declaration of ``op`` (a test's own op, say); an op never declared is a ``RegistrationError``."""
    with _lock:
        if _DECLARED.pop(op, None) is None:
            raise RegistrationError(f"undeclare: {op!r} is not declared")


def rule_of(op: str) -> Rule | None:
    """The placement rule declared for ``op`` (None: none, and the op runs replicated)."""
    decl = _DECLARED.get(op)
    return decl.rule if decl is not None else None


def pair_result(res: tuple, a: Args) -> Any:
    """A wrapper's (first, optional second) result -> the outputs a call asks for (``GraphOp.result``)."""
    return res[0] if res[1] is None else tuple(res)


# -- helpers the rules share ------------------------------------------------------------------------------------

def opt(shape: tuple[int, ...] | None, p: Placement) -> Placement | None:
    """``p`` for an optional input that is present, None for an absent one."""
    return None if shape is None else p


def same(shapes: Shapes, p: Placement) -> tuple[Placement | None, ...]:
    return tuple(opt(s, p) for s in shapes)


def replicated(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    """Every input whole on every device."""
    return [Strategy(same(shapes, R), R)]


def elementwise(ndim: int, partial_ok: bool, k: int = 1) -> list[Strategy]:
    """``k`` inputs of ``ndim`` dims placed alike, the output as they are; Partial only for a linear op."""
    out = [Strategy((R,) * k, R)] + [Strategy((Shard(d),) * k, Shard(d)) for d in range(ndim)]
    return out + ([Strategy((P,) * k, P)] if partial_ok else [])


def heads_split(h: int, hkv: int, n: int) -> bool:
    """Splitting H query heads and Hkv kv heads over n devices keeps GQA groups whole: every device holds
    H / Hkv query heads per kv head it holds (so its local head h reads its local kv head h // (H / Hkv))."""
    if hkv == 0 or h % hkv:
        return False
    g = h // hkv
    return all(a == g * b for a, b in zip(shard_sizes(h, n), shard_sizes(hkv, n), strict=True))


def groups_split(h: int, hkv: int, n: int) -> bool:
    """Whether the heads can split over n devices in whole GQA groups (``Shard(dim, unit=G)`` on q) where a plain
    split of the heads would cut a group: every device then holds at least one kv head and its G query heads."""
    return hkv > 1 and h % hkv == 0 and h > hkv and hkv >= n > 1 and not heads_split(h, hkv, n)


def head_strategies(h: int, hkv: int, n: int, q_dim: int, kv_dim: int, rest: tuple) -> list[Strategy]:
    """Attention's head splits (q's heads on ``q_dim``, k and v's on ``kv_dim``, ``rest`` the other inputs'
    placements): whole GQA groups per device, uneven groups in units of G, or one kv head kept whole."""
    out = []
    if heads_split(h, hkv, n):
        out.append(Strategy((Shard(q_dim), Shard(kv_dim), Shard(kv_dim)) + rest, Shard(q_dim)))
    if groups_split(h, hkv, n):
        grouped = Shard(q_dim, None, h // hkv)
        out.append(Strategy((grouped, Shard(kv_dim), Shard(kv_dim)) + rest, grouped))
    if hkv == 1:  # one kv head serves every query head: keep it whole
        out.append(Strategy((Shard(q_dim), R, R) + rest, Shard(q_dim)))
    return out


__all__ = ["GraphOp", "Rule", "Strategy", "declare", "declared", "declared_ops", "rule_of", "undeclare"]
