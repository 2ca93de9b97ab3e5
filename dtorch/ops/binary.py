"""Binary op wrappers with broadcasting: ``dtorch.ops.add(a, b)``, ``add_out(a, b, out=...)``.

When ``b`` is a Python number the scalar form (``binary.add_scalar``) runs; its value travels as
an owned param. Both tensors must share dtype and device (dtorch does no implicit promotion).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dtorch.core.device import device_of
from dtorch.core.errors import ArgumentError, DTypeError
from dtorch.core.placement import Placement, Shard
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.ops import _checks
from dtorch.ops._checks import STRIDED
from dtorch.ops._invoke import call, run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, P, R, Shapes, Strategy, declare, elementwise
from dtorch.ops.prepared import PreparedOperator

BINARY_OPS = ("add", "sub", "mul", "div", "maximum", "minimum", "pow")
Scalar = int | float


def _scalar_params(op: str, b: object) -> KernelParams:
    if isinstance(b, bool) or not isinstance(b, (int, float)):
        raise ArgumentError(f"{op}: 'b' must be a tensor or a Python int/float, got {type(b).__name__}")
    return KernelParams(value=b)


def _check_pair(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Size:
    if type(a) is not torch.Tensor or a.layout is not STRIDED:
        _checks.tensor(op, "a", a)
    if type(b) is not torch.Tensor or b.layout is not STRIDED:
        _checks.tensor(op, "b", b)
    if a.dtype != b.dtype:
        raise DTypeError(f"{op}: dtypes disagree: 'a' is {a.dtype}, 'b' is {b.dtype} (cast one with dtorch.ops.copy)")
    if a.device != b.device:
        _checks.same_device(op, {"a": a, "b": b})
    return _checks.broadcast(op, a, b) if a.shape != b.shape else a.shape


def _binary(name: str, a: torch.Tensor, b: torch.Tensor | Scalar) -> torch.Tensor:
    if isinstance(b, torch.Tensor):
        op = f"binary.{name}"
        shape = _check_pair(op, a, b)
        return call(op, device_of(a), a.dtype, (a, b), NO_PARAMS,
                    lambda: (torch.empty(shape, dtype=a.dtype, device=a.device),))[0]
    op = f"binary.{name}_scalar"
    _checks.tensor(op, "a", a)
    return call(op, device_of(a), a.dtype, (a,), _scalar_params(op, b), lambda: (torch.empty_like(a),))[0]


def _binary_out(name: str, a: torch.Tensor, b: torch.Tensor | Scalar, out: torch.Tensor,
                ctx: RuntimeContext | None) -> torch.Tensor:
    if ctx is None:
        ctx_device = stream = workspace = None
    else:
        ctx_device, stream, workspace = ctx.device, ctx.stream, ctx.workspace
    if isinstance(b, torch.Tensor):
        op = f"binary.{name}"
        shape = _check_pair(op, a, b)
        _checks.out(op, out, shape, a.dtype, a.device)
        device = _checks.on_device(op, "a", a, ctx_device)
        run(op, device, a.dtype, (a, b), (out,), NO_PARAMS, stream, workspace)
        return out
    op = f"binary.{name}_scalar"
    _checks.tensor(op, "a", a)
    _checks.out(op, out, a.shape, a.dtype, a.device)
    device = _checks.on_device(op, "a", a, ctx_device)
    run(op, device, a.dtype, (a,), (out,), _scalar_params(op, b), stream, workspace)
    return out


def _define(name: str) -> tuple:
    def functional(a: torch.Tensor, b: torch.Tensor | Scalar) -> torch.Tensor:
        return _binary(name, a, b)

    def out_form(a: torch.Tensor, b: torch.Tensor | Scalar, *, out: torch.Tensor,
                 ctx: RuntimeContext | None = None) -> torch.Tensor:
        return _binary_out(name, a, b, out, ctx)

    functional.__name__ = functional.__qualname__ = name
    out_form.__name__ = out_form.__qualname__ = f"{name}_out"
    functional.__doc__ = (f"``binary.{name}``: a [broadcast with] b -> new tensor of the broadcast shape; "
                          f"b may be a Python number (``binary.{name}_scalar``).")
    out_form.__doc__ = f"``binary.{name}`` into ``out``, which must have the broadcast shape and a's dtype."
    declare(f"binary.{name}", functional, _graph_inputs, params=_graph_params, kernel_op=_graph_kernel_op, rule=_rule)
    return functional, out_form


# -- in a graph: b is an Operand, or a Python number (the scalar form) ------------------------------------------

def _graph_inputs(a: Args) -> tuple[str, ...]:
    return ("a",) if isinstance(a["b"], (int, float)) else ("a", "b")


def _graph_params(op: str, a: Args) -> KernelParams:
    return _scalar_params(f"{op}_scalar", a["b"]) if isinstance(a["b"], (int, float)) else NO_PARAMS


def _graph_kernel_op(op: str, a: Args) -> str:
    return f"{op}_scalar" if isinstance(a["b"], (int, float)) else op


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    if op.endswith("_scalar"):  # (a1 + a2) * c = a1*c + a2*c, but (a1 + a2) + c != (a1 + c) + (a2 + c)
        return elementwise(len(shapes[0]), partial_ok=op in ("binary.mul_scalar", "binary.div_scalar"))
    a, b = shapes
    nd = max(len(a), len(b))
    out = [Strategy((R, R), R)]
    for d in range(nd):
        pa, pb = _aligned(a, d, nd), _aligned(b, d, nd)
        if pa != R or pb != R:  # both inputs whole on d: nothing to split
            out.append(Strategy((pa, pb), Shard(d)))
    if op in ("binary.add", "binary.sub"):
        out.append(Strategy((P, P), P))
    if op == "binary.mul":
        out += [Strategy((P, R), P), Strategy((R, P), P)]
    if op == "binary.div":
        out.append(Strategy((P, R), P))
    return out


def _aligned(shape: tuple[int, ...], d: int, nd: int) -> Placement:
    """The placement an input of ``shape`` needs for an output sharded on ``d`` (broadcast dims stay whole)."""
    da = d - (nd - len(shape))
    return R if da < 0 or shape[da] == 1 else Shard(da)


add, add_out = _define("add")
sub, sub_out = _define("sub")
mul, mul_out = _define("mul")
div, div_out = _define("div")
maximum, maximum_out = _define("maximum")
minimum, minimum_out = _define("minimum")
pow, pow_out = _define("pow")  # noqa: A001 - torch's name



class Binary(PreparedOperator):
    """A prepared binary op (``Binary("add")``): the kernel is bound once at ``prepare``.

    ``forward_out(a, b, out=...)`` checks dtypes and shapes with a few comparisons when a, b and out
    have equal shapes (the decode-step case) and runs the full broadcast validation otherwise.
    """

    def __init__(self, name: str) -> None:
        if name not in BINARY_OPS:
            raise ArgumentError(f"Binary: op must be one of {BINARY_OPS}, got {name!r}")
        super().__init__()
        self.op = f"binary.{name}"  # type: ignore[misc]  # per-instance op name

    def forward_out(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """a (op) b into ``out``. The hot path: a, b and out are plain strided tensors of the prepared dtype
        and device (identity checks and one device comparison each; nothing when they are the previous call's
        tensors) with one shape; anything else gets the full validation, which raises the precise error
        or accepts a valid broadcast."""
        seen = self._checked
        if not (seen and a is seen[0] and b is seen[1] and out is seen[2]):
            dt, dev = self._dtype, self._device
            if (type(a) is not Tensor or type(b) is not Tensor or type(out) is not Tensor
                    or a.dtype is not dt or b.dtype is not dt or out.dtype is not dt
                    or a.layout is not STRIDED or b.layout is not STRIDED or out.layout is not STRIDED
                    or a.device != dev or b.device != dev or out.device != dev):
                self._slow_checks(a, b, out)
            shape = a.shape
            if shape != b.shape or shape != out.shape:
                self._slow_checks(a, b, out)
            self._checked = (a, b, out)
        try:
            self.kernel.fn(self._kctx if ctx is None else self._context(ctx), (a, b), (out,))
        except Exception as exc:
            self._failed(exc)
        return out

    def forward(self, a: torch.Tensor, b: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
        shape = _check_pair(self.op, a, b)
        return self.forward_out(a, b, out=torch.empty(shape, dtype=a.dtype, device=a.device), ctx=ctx)

    def _slow_checks(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        self._bound()
        self._check_like("a", a)
        self._check_like("b", b)
        shape = _check_pair(self.op, a, b)
        _checks.out(self.op, out, shape, a.dtype, a.device)


__all__ = [n for op in BINARY_OPS for n in (op, f"{op}_out")] + ["Binary"]
