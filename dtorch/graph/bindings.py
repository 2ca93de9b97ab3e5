"""How a graph call becomes a kernel call, through the op wrapper's own validation and derivation.

``LogicalGraph.call(op, *args, **kwargs)`` takes the arguments of the op wrapper ``dtorch.ops.<name>``, with
Operands where the wrapper takes tensors: ``g.call("llm.rope", x, positions, rotary_dim=64)``,
``g.call("llm.embedding", ids, weight)``, ``g.call("creation.zeros", (4, 8))``. ``bind`` gives a ``Bound``:
the kernel op, the kernel's inputs in kernel order, the owned params derived by the same functions the
wrapper calls (attention's scale, rope's rotary_dim and frequencies, norm eps, conv tuples ...), and an
``infer`` that runs the wrapper itself on meta tensors, so a bad call fails at build time with the
wrapper's message. Each op's mapping is one ``Spec`` row of ``SPECS``.

In place: ``out=x`` (rms_norm, softmax_last_dim, rope), ``residual_out=residual`` (add_rms_norm) and
``final_state_out=initial_state`` (gated_delta_net) mirror the wrappers' ``*_out`` forms: that output is
written into the named input's storage (``Bound.aliases``); causal_conv1d_update (and _varlen) always advance
their conv state (pool) in place and return (out, conv state). Where the wrapper transforms inputs before the kernel
(rope gathers cos/sin from positions, silu_and_mul splits [gate | up]), the kernel has a form that takes
what the graph has (rope: positions and an ``inv_freq`` param; silu_and_mul: the fused x and None).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dtorch import ops
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import ArgumentError, DTypeError, GraphError, ShapeError
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.graph.operand import Operand

# the wrappers' modules (``dtorch.ops.rope`` etc. are shadowed by functions of those names in ``dtorch.ops``)
_attention, _binary, _conv1d, _conv, _creation, _gdn, _kv, _llm, _moe, _reduce, _rope, _unary = (
    importlib.import_module(f"dtorch.ops.{m}") for m in ("attention", "binary", "causal_conv1d", "conv", "creation",
                                                         "gated_delta_net", "kv_cache", "llm", "moe", "reduce", "rope",
                                                         "unary"))

Infer = Callable[[Sequence["torch.Tensor | None"]], "torch.Tensor | tuple[torch.Tensor, ...]"]
Args = dict[str, Any]  # the wrapper's arguments by name, defaults applied; Operands where it takes tensors


@dataclass(frozen=True, slots=True)
class Bound:
    """``inputs`` are the kernel's inputs in kernel order (None for an absent optional one); ``infer`` maps meta
    tensors of them to the output (or a tuple, one per kernel output); ``aliases[j]`` is the input that output
    ``j`` is written into in place (None: a fresh tensor; empty: all fresh)."""

    kernel_op: str
    inputs: tuple[Operand | None, ...]
    params: KernelParams
    infer: Infer
    num_outputs: int = 1
    aliases: tuple[int | None, ...] = ()


def _no_params(op: str, a: Args) -> KernelParams:
    return NO_PARAMS


def _one(a: Args) -> int:
    return 1


@dataclass(frozen=True, slots=True)
class Spec:
    """How one op's wrapper call maps to its kernel call."""

    inputs: tuple[str, ...] | Callable[[Args], tuple[str, ...]]  # wrapper arguments that are kernel inputs
    params: Callable[[str, Args], KernelParams] = _no_params      # (op, args) -> owned params, as the wrapper
    outputs: Callable[[Args], int] = _one                          # kernel outputs this call asks for
    result: Callable[[Any, Args], Any] | None = None               # wrapper result -> the outputs' metas
    inplace: tuple[tuple[str, int, str], ...] = ()                 # (keyword, output, the input it may name)
    always_inplace: tuple[int | None, ...] = ()                    # aliases every call has
    kernel_op: Callable[[str, Args], str] | None = None
    meta_args: Callable[[Args], Args] | None = None                # what infer passes besides the meta inputs


def _meta_of(x: Operand) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


def _pair(res: tuple, a: Args) -> Any:
    """A wrapper's (first, optional second) result -> the outputs asked for."""
    return res[0] if res[1] is None else tuple(res)


# -- params, derived by the wrappers' own functions ------------------------------------------------

def _gelu(op: str, a: Args) -> KernelParams:
    return _unary._gelu_params(a["approximate"])


def _reduce_params(op: str, a: Args) -> KernelParams:
    _, d = _reduce.reduced_shape(op, _meta_of(a["x"]), a["dim"], a["keepdim"])
    return _reduce._params(d, a["keepdim"])


def _conv_params(op: str, a: Args) -> KernelParams:
    return _conv.conv_params(int(op[-2]), a["stride"], a["padding"], a["dilation"], a["groups"])


def _arange(op: str, a: Args) -> KernelParams:
    return _creation._arange_params(op, a["start"], a["end"], a["step"], a["dtype"])[0]


def _full(op: str, a: Args) -> KernelParams:
    return _creation.full_params(a["value"], _creation._dtype(op, a["dtype"]))


def _eps(op: str, a: Args) -> KernelParams:
    return _llm._norm_params(op, a["eps"])


def _rope_params(op: str, a: Args) -> KernelParams:
    # the kernel's positions form gathers cos/sin itself from these frequencies (R/2 float32 values)
    inv = a["inv_freq"]
    device = inv.device if isinstance(inv, torch.Tensor) else torch.device("cpu")
    r, inv = _rope.rope_frequencies(a["x"].shape[-1], a["theta"], a["rotary_dim"], inv, device)
    return _rope._rope_params(r, _rope._bool(op, "interleaved", a["interleaved"])).replace(
        inv_freq=tuple(inv.tolist()))


def _rope_cached_params(op: str, a: Args) -> KernelParams:
    r = a["x"].shape[-1] if a["rotary_dim"] is None else a["rotary_dim"]
    _rope._check_rotary("llm.rope", r, a["x"].shape[-1], 10000.0)
    return _rope._rope_params(r, _rope._bool("llm.rope", "interleaved", a["interleaved"]))


def _dense(op: str, a: Args) -> KernelParams:
    return _attention.dense_params(a["q"].shape[-1], a["causal"], a["scale"], op)


def _kvcache(op: str, a: Args) -> KernelParams:
    return _kv.kvcache_params(a["q"].shape[-1], a["causal"], a["scale"], a["window"])


def _varlen(op: str, a: Args) -> KernelParams:
    return _attention.varlen_params(a["q"].shape[-1], a["max_seqlen_q"], a["max_seqlen_k"], a["causal"], a["scale"])


def _gdn_params(op: str, a: Args) -> KernelParams:
    return _gdn._params(a["scale"], a["use_qk_l2norm"], a["mode"], a["chunk_size"])


def _activation(op: str, a: Args) -> KernelParams:
    return _conv1d._params(op, a["activation"])


def _router(op: str, a: Args) -> KernelParams:
    return _moe.router_params(a["logits"], a["top_k"], a["norm_topk_prob"])


def _scalar_params(op: str, a: Args) -> KernelParams:
    return NO_PARAMS if isinstance(a["b"], Operand) else _binary._scalar_params(f"{op}_scalar", a["b"])


_CREATE = Spec((), meta_args=lambda a: a | {"device": "meta"})
_MM = Spec(("a", "b"))

SPECS: dict[str, Spec] = {
    # families: any op of the family not named below
    "unary": Spec(("x",)),
    "binary": Spec(lambda a: ("a", "b") if isinstance(a["b"], Operand) else ("a",), _scalar_params,
                   kernel_op=lambda op, a: op if isinstance(a["b"], Operand) else f"{op}_scalar"),
    "reduce": Spec(("x",), _reduce_params),
    "conv": Spec(("x", "w", "bias"), _conv_params),
    "creation": _CREATE,
    "copy": Spec(("x",)),
    # ops
    "unary.gelu": Spec(("x",), _gelu),
    "matmul.mm": _MM, "matmul.bmm": _MM, "matmul.linear": Spec(("x", "w", "bias")),
    "creation.full": Spec((), _full, meta_args=_CREATE.meta_args),
    "creation.arange": Spec((), _arange, meta_args=_CREATE.meta_args),
    "llm.embedding": Spec(("weight", "ids")),  # the kernel is keyed by the weight's dtype, so it comes first
    "llm.rms_norm": Spec(("x", "weight"), _eps, inplace=(("out", 0, "x"),)),
    "llm.add_rms_norm": Spec(("x", "residual", "weight"), _eps, lambda a: 2, result=lambda r, a: tuple(r),
                             inplace=(("residual_out", 1, "residual"),)),
    "llm.softmax_last_dim": Spec(("x",), inplace=(("out", 0, "x"),)),
    "llm.silu_and_mul": Spec(("x", "up")),  # up None: the kernel splits the fused x [..., 2I] itself
    "llm.gelu_tanh_and_mul": Spec(("x", "up")),  # as silu_and_mul
    "llm.rope": Spec(("x", "positions"), _rope_params, inplace=(("out", 0, "x"),),
                     meta_args=lambda a: a | {"inv_freq": None}),  # inv_freq: checked by _rope_params
    "llm.rope_cached": Spec(("x", "cos", "sin"), _rope_cached_params, inplace=(("out", 0, "x"),),
                            kernel_op=lambda op, a: "llm.rope"),  # the kernel's table form
    "llm.flash_attention": Spec(("q", "k", "v"), _dense),
    "llm.flash_attention_varlen": Spec(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), _varlen),
    "llm.reshape_and_cache": Spec(("key", "value", "key_cache", "value_cache", "slot_mapping"), outputs=lambda a: 2,
                                  result=lambda r, a: tuple(r), always_inplace=(2, 3)),
    "llm.flash_attention_with_kvcache": Spec(("q", "key_cache", "value_cache", "cu_seqlens_q", "seqlens_k",
                                              "block_table"), _kvcache),
    "llm.gated_delta_net": Spec(("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "state_indices"),
                                _gdn_params,
                                lambda a: 2 if a["output_final_state"] else 1, _pair,
                                inplace=(("final_state_out", 1, "initial_state"),)),
    "llm.causal_conv1d": Spec(("x", "weight", "bias", "initial_states"), _activation,
                              lambda a: 2 if a["return_final_states"] else 1, _pair),
    # the kernel reads conv_state as outputs[1]; naming it as a 4th input lets the graph see it read
    "llm.causal_conv1d_update": Spec(("x", "weight", "bias", "conv_state", "state_indices"), _activation, lambda a: 2,
                                     lambda r, a: (r, a["conv_state"]), always_inplace=(None, 3)),
    "llm.causal_conv1d_varlen": Spec(("x", "weight", "bias", "conv_states", "cu_seqlens", "state_indices"),
                                     _activation, lambda a: 2, lambda r, a: (r, a["conv_states"]),
                                     always_inplace=(None, 3)),
    "llm.gdn_gates": Spec(("a", "b", "A_log", "dt_bias"), outputs=lambda a: 2, result=lambda r, a: tuple(r)),
    "llm.moe_router": Spec(("logits",), _router, lambda a: 2, result=lambda r, a: tuple(r)),  # (weights, ids)
    "llm.moe_experts": Spec(("x", "w_gate_up", "w_down", "weights", "ids")),
}


def _wrapper(op: str, name: str) -> Callable[..., Any]:
    fn = getattr(ops, name, None)
    if fn is None:
        raise GraphError(f"graph call {op!r}: no op wrapper dtorch.ops.{name} to infer its output "
                         f"(use LogicalGraph.python(fn, ...) for a custom computation)")
    return fn


def _arguments(op: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Args:
    sig = inspect.signature(fn)
    try:
        ba = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise ArgumentError(f"graph call {op!r}: {exc}; it takes the arguments of dtorch.ops.{fn.__name__}{sig} "
                            "with Operands for tensors") from None
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


def _aliases(op: str, spec: Spec, a: Args, given: dict[str, Any], inputs: tuple[str, ...],
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


def _infer(op: str, fn: Callable[..., Any], spec: Spec, a: Args, inputs: tuple[str, ...],
           aliases: tuple[int | None, ...]) -> Infer:
    base = spec.meta_args(a) if spec.meta_args is not None else a

    def infer(metas: Sequence[torch.Tensor | None]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        call = base | dict(zip(inputs, metas, strict=True))
        res = fn(**call)
        res = spec.result(res, call) if spec.result is not None else res
        for j, i in enumerate(aliases):
            if i is not None:
                _check_alias(op, res if isinstance(res, torch.Tensor) else res[j], metas[i], j)
        return res

    return infer


def _generic(op: str, name: str, args: tuple, kwargs: dict) -> Bound:
    """An op without a Spec (registered outside dtorch): operands are its inputs, keywords its params."""
    fn = _wrapper(op, name)
    extra = [a for a in args if not isinstance(a, Operand)]
    if extra:
        raise ArgumentError(f"graph call {op!r}: pass non-tensor arguments by keyword, got positional {extra!r}")
    return Bound(op, tuple(args), KernelParams(**kwargs), lambda t: fn(*t, **kwargs))


def bind(op: str, args: tuple, kwargs: dict) -> Bound:
    """The kernel call behind ``LogicalGraph.call(op, *args, **kwargs)``."""
    if not isinstance(op, str) or "." not in op:
        raise ArgumentError(f"graph call: op must be a name like 'matmul.mm', got {op!r}")
    family, _, name = op.partition(".")
    spec = SPECS.get(op) or SPECS.get(family)
    if spec is None:
        return _generic(op, name, args, kwargs)
    fn = _wrapper(op, name)
    if family == "creation" and "device" in kwargs:
        raise ArgumentError(f"graph call {op!r}: the graph places what it creates on its mesh; do not pass 'device'")
    kwargs = dict(kwargs)
    given = {kw: kwargs.pop(kw) for kw, _, _ in spec.inplace if kw in kwargs}
    a = _arguments(op, fn, args, kwargs)
    inputs = spec.inputs(a) if callable(spec.inputs) else spec.inputs
    _check_kinds(op, fn, a, inputs)
    params = spec.params(op, a)
    nout = spec.outputs(a)
    aliases = _aliases(op, spec, a, given, inputs, nout)
    kernel_op = spec.kernel_op(op, a) if spec.kernel_op is not None else op
    return Bound(kernel_op, tuple(a[n] for n in inputs), params, _infer(op, fn, spec, a, inputs, aliases), nout,
                 aliases)


__all__ = ["SPECS", "Bound", "Spec", "bind"]
