"""Unary op wrappers: ``dtorch.ops.exp(x)`` and ``dtorch.ops.exp_out(x, out=...)`` for every unary op."""

from __future__ import annotations

import torch

from dtorch.core.device import device_of
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.ops import _checks
from dtorch.ops._checks import STRIDED
from dtorch.ops._invoke import call, run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, Shapes, Strategy, declare, elementwise

UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu")


def _unary_out(name: str, x: torch.Tensor, out: torch.Tensor, params: KernelParams = NO_PARAMS,
               ctx: RuntimeContext | None = None) -> torch.Tensor:
    op = f"unary.{name}"
    _checks.tensor(op, "x", x)
    _checks.out(op, out, x.shape, x.dtype, x.device)
    if ctx is None:
        run(op, device_of(x), x.dtype, (x,), (out,), params)
    else:
        run(op, _checks.on_device(op, "x", x, ctx.device), x.dtype, (x,), (out,), params, ctx.stream, ctx.workspace)
    return out


def _unary(name: str, x: torch.Tensor, params: KernelParams = NO_PARAMS) -> torch.Tensor:
    op = f"unary.{name}"
    if type(x) is not torch.Tensor or x.layout is not STRIDED:
        _checks.tensor(op, "x", x)
    return call(op, device_of(x), x.dtype, (x,), params, lambda: (torch.empty_like(x),))[0]


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    return elementwise(len(shapes[0]), partial_ok=op == "unary.neg")  # only negation is linear


def _define(name: str) -> tuple:
    def functional(x: torch.Tensor) -> torch.Tensor:
        return _unary(name, x)

    def out_form(x: torch.Tensor, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
        return _unary_out(name, x, out, NO_PARAMS, ctx)

    functional.__name__ = functional.__qualname__ = name
    out_form.__name__ = out_form.__qualname__ = f"{name}_out"
    functional.__doc__ = f"``unary.{name}`` elementwise: returns a new tensor shaped like x."
    out_form.__doc__ = f"``unary.{name}`` elementwise into ``out`` (same shape, dtype and device as x)."
    declare(f"unary.{name}", functional, ("x",), rule=_rule)
    return functional, out_form


neg, neg_out = _define("neg")
abs, abs_out = _define("abs")  # noqa: A001 - torch's name
exp, exp_out = _define("exp")
log, log_out = _define("log")
sqrt, sqrt_out = _define("sqrt")
rsqrt, rsqrt_out = _define("rsqrt")
sin, sin_out = _define("sin")
cos, cos_out = _define("cos")
tanh, tanh_out = _define("tanh")
sigmoid, sigmoid_out = _define("sigmoid")
relu, relu_out = _define("relu")
silu, silu_out = _define("silu")


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact (``approximate="none"``) or the tanh form, as ``torch.nn.functional.gelu``."""
    return _unary("gelu", x, _gelu_params(approximate))


def gelu_out(x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor,
             ctx: RuntimeContext | None = None) -> torch.Tensor:
    return _unary_out("gelu", x, out, _gelu_params(approximate), ctx)


_GELU = {a: KernelParams(approximate=a) for a in ("none", "tanh")}


def _gelu_params(approximate: str) -> KernelParams:
    from dtorch.core.errors import ArgumentError
    if approximate not in _GELU:
        raise ArgumentError(f"unary.gelu: 'approximate' must be 'none' or 'tanh', got {approximate!r}")
    return _GELU[approximate]


def _graph_gelu_params(op: str, a: Args) -> KernelParams:
    return _gelu_params(a["approximate"])


declare("unary.gelu", gelu, ("x",), params=_graph_gelu_params, rule=_rule)

__all__ = [n for op in UNARY_OPS for n in (op, f"{op}_out")]
