"""Matrix product wrappers ``mm``, ``bmm``, ``linear`` (+ ``*_out``) and the prepared ``MatMul`` / ``Linear``.

dtorch does no implicit promotion: all operands share one dtype and one device. None of these ops works in
place: an ``out`` that overlaps an input is refused with an ``ArgumentError`` (as torch's own ``out=``, a
product cannot overwrite what it still reads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dtorch.core.device import device_of
from dtorch.core.errors import ArgumentError, DtorchError, ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.dispatch.registry import Dispatcher
from dtorch.ops import _checks
from dtorch.ops._checks import STRIDED
from dtorch.ops._invoke import call, run
from dtorch.ops.context import OperatorInitContext, RuntimeContext
from dtorch.ops.graph_op import P, R, Shapes, Strategy, declare, opt
from dtorch.ops.prepared import PreparedOperator

__all__ = ["Linear", "MatMul", "bmm", "bmm_out", "linear", "linear_out", "mm", "mm_out"]


def _operands(op: str, named: dict[str, torch.Tensor | None], ctx: RuntimeContext | None):
    """Tensors (None entries skipped) share a dtype and a device (ctx's device type when given)."""
    present = {}
    for name, t in named.items():
        if t is not None:
            present[name] = _checks.tensor(op, name, t)
    dtype = _checks.same_dtype(op, present)
    device = _checks.same_device(op, present, ctx.device if ctx is not None else None)
    return dtype, device


def _mm_shape(op: str, a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    _checks.rank(op, "a", a, 2)
    _checks.rank(op, "b", b, 2)
    if a.shape[1] != b.shape[0]:
        raise ShapeError(f"{op}: inner dims must match: 'a' is [M, K] = {tuple(a.shape)}, "
                         f"'b' is [K, N] = {tuple(b.shape)}")
    return (a.shape[0], b.shape[1])


def _bmm_shape(op: str, a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    _checks.rank(op, "a", a, 3)
    _checks.rank(op, "b", b, 3)
    if a.shape[0] != b.shape[0]:
        raise ShapeError(f"{op}: batch sizes must match: 'a' is [B, M, K] = {tuple(a.shape)}, "
                         f"'b' is [B, K, N] = {tuple(b.shape)}")
    if a.shape[2] != b.shape[1]:
        raise ShapeError(f"{op}: inner dims must match: 'a' is [B, M, K] = {tuple(a.shape)}, "
                         f"'b' is [B, K, N] = {tuple(b.shape)}")
    return (a.shape[0], a.shape[1], b.shape[2])


def _linear_shape(op: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    if x.dim() < 1:
        raise ShapeError(f"{op}: argument 'x' must have rank >= 1 ([..., K]), got a 0-d tensor")
    _checks.rank(op, "w", w, 2)
    if x.shape[-1] != w.shape[1]:
        raise ShapeError(f"{op}: 'x' is [..., K] = {tuple(x.shape)} and 'w' is [N, K] = {tuple(w.shape)}: "
                         f"K must match ({x.shape[-1]} vs {w.shape[1]})")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ShapeError(f"{op}: 'bias' must have shape [N] = ({w.shape[0]},), got {tuple(bias.shape)}")
    return (*x.shape[:-1], w.shape[0])


def _launch(op, inputs, shape, dtype, device, out, ctx, params=NO_PARAMS, names=("a", "b")) -> torch.Tensor:
    """Allocate (or check) the output [shape] and run ``op`` on it; a given ``out`` must not overlap an input."""
    if out is None:
        if ctx is None:  # the winner's allocating form when it has one
            return call(op, device, dtype, inputs, params,
                        lambda: (torch.empty(shape, dtype=dtype, device=inputs[0].device),))[0]
        out = torch.empty(shape, dtype=dtype, device=inputs[0].device)
    else:
        _checks.out(op, out, shape, dtype, inputs[0].device)
        _checks.no_alias(op, {"out": out}, dict(zip(names, inputs, strict=True)))
    run(op, device, dtype, inputs, (out,), params, stream=ctx.stream if ctx is not None else None,
        workspace=ctx.workspace if ctx is not None else None)
    return out


def _mm(a, b, out=None, ctx=None) -> torch.Tensor:
    op = "matmul.mm"
    dtype, device = _operands(op, {"a": a, "b": b}, ctx)
    return _launch(op, (a, b), _mm_shape(op, a, b), dtype, device, out, ctx)


def _bmm(a, b, out=None, ctx=None) -> torch.Tensor:
    op = "matmul.bmm"
    dtype, device = _operands(op, {"a": a, "b": b}, ctx)
    return _launch(op, (a, b), _bmm_shape(op, a, b), dtype, device, out, ctx)


_LINEAR = "matmul.linear"
_COARSE = KernelParams(coarse=True)


def linear_params(coarse: bool) -> KernelParams:
    """``coarse=True``: a kernel may trade each row's precision for speed (a prompt's rows, a batch of decodes: the
    native GGUF kernels then round x to 8 bits per 32 values from 4 rows; see dtorch/kernels/native). False: each
    row's result must be what a lone decode makes of it (the rows a speculative step verifies)."""
    if not isinstance(coarse, bool):
        raise ArgumentError(f"{_LINEAR}: 'coarse' must be a bool, got {coarse!r}")
    return _COARSE if coarse else NO_PARAMS


def _linear(x, w, bias, out=None, ctx=None, coarse: bool = False) -> torch.Tensor:
    op = _LINEAR
    dtype, device = _operands(op, {"x": x, "w": w, "bias": bias}, ctx)
    return _launch(op, (x, w, bias), _linear_shape(op, x, w, bias), dtype, device, out, ctx,
                   names=("x", "w", "bias"), params=linear_params(coarse))


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``matmul.mm``: a [M, K] @ b [K, N] -> [M, N]."""
    return _mm(a, b)


def mm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``matmul.mm`` into ``out`` [M, N] (a's dtype and device)."""
    return _mm(a, b, out, ctx)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``matmul.bmm``: a [B, M, K] @ b [B, K, N] -> [B, M, N]."""
    return _bmm(a, b)


def bmm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``matmul.bmm`` into ``out`` [B, M, N]."""
    return _bmm(a, b, out, ctx)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, coarse: bool = False) -> torch.Tensor:
    """``matmul.linear``: x [..., K], w [N, K], bias [N] or None -> x @ w.T + bias, [..., N]. ``coarse``: each row's
    precision may be traded for speed (``linear_params``)."""
    # The hot path: plain strided tensors of one dtype and device with matching shapes (identity checks and
    # a few comparisons); anything else takes the full validation, which raises the precise error.
    if type(x) is Tensor and type(w) is Tensor:
        dt, dev, xs, ws = x.dtype, x.device, x.shape, w.shape
        if (w.dtype is dt and x.layout is STRIDED and w.layout is STRIDED and w.device == dev and len(ws) == 2
                and xs and xs[-1] == ws[1]
                and (bias is None or (type(bias) is Tensor and bias.dtype is dt and bias.layout is STRIDED
                                      and bias.device == dev and bias.shape == ws[:1]))):
            return call(_LINEAR, device_of(x), dt, (x, w, bias), linear_params(coarse),
                        lambda: (torch.empty((*xs[:-1], ws[0]), dtype=dt, device=dev),))[0]
    return _linear(x, w, bias, coarse=coarse)


def linear_out(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, out: torch.Tensor,
               ctx: RuntimeContext | None = None, coarse: bool = False) -> torch.Tensor:
    """``matmul.linear`` into ``out`` [..., N]."""
    return _linear(x, w, bias, out, ctx, coarse)


class _PreparedProduct(PreparedOperator):
    """Shared hot path: identity checks on dtype, then the bound kernel; anything unusual goes the slow way."""

    def _check_named(self, named: dict[str, torch.Tensor | None], out: torch.Tensor, shape) -> None:
        """The slow path's full validation (raises the precise error)."""
        self._bound()
        for name, t in named.items():
            if t is not None:
                self._check_like(name, t)
        _checks.out(self.op, out, shape, self.init.dtype, next(iter(named.values())).device)
        _checks.no_alias(self.op, {"out": out}, named)


class MatMul(_PreparedProduct):
    """Prepared ``matmul.mm`` (or ``matmul.bmm`` when ``batched``): bind once, then ``forward_out`` every step.

    forward(a [M, K], b [K, N]) -> [M, N]; batched: forward(a [B, M, K], b [B, K, N]) -> [B, M, N].
    """

    op = "matmul.mm"

    def __init__(self, batched: bool = False) -> None:
        super().__init__()
        if not isinstance(batched, bool):
            raise ArgumentError(f"MatMul: 'batched' must be a bool, got {batched!r}")
        self.batched = batched
        self.op = "matmul.bmm" if batched else "matmul.mm"

    def prepare(self, init: OperatorInitContext, dispatcher: Dispatcher | None = None) -> MatMul:
        super().prepare(init, dispatcher)
        return self

    def _shape(self, a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
        return _bmm_shape(self.op, a, b) if self.batched else _mm_shape(self.op, a, b)

    def forward_out(self, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """a @ b into ``out``.

        The hot path checks that a, b and out are plain strided tensors of the prepared dtype and device
        (identity checks, one device comparison each) and compares out's shape, which torch's ``out=`` would
        silently resize; mismatched inner dims make the kernel fail, and only then (or when a check fails) is
        everything validated for a precise error.
        """
        kernel, dt, dev = self.kernel, self._dtype, self._device
        plain = (type(a) is Tensor and type(b) is Tensor and type(out) is Tensor
                 and a.dtype is dt and b.dtype is dt and out.dtype is dt
                 and a.layout is STRIDED and b.layout is STRIDED and out.layout is STRIDED
                 and a.device == dev and b.device == dev and out.device == dev)
        if plain:
            o, bs = out.shape, b.shape
            plain = o[:-1] == a.shape[:-1] and o and bs and o[-1] == bs[-1] and out is not a and out is not b
        if not plain:
            self._check_named({"a": a, "b": b}, out, self._shape(a, b))
        try:
            kernel.fn(self._kctx if ctx is None else self._context(ctx), (a, b), (out,))
        except Exception as exc:
            if not isinstance(exc, DtorchError):
                self._check_named({"a": a, "b": b}, out, self._shape(a, b))
            self._failed(exc)
        return out

    def forward(self, a: torch.Tensor, b: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
        """a @ b as a new tensor (full shape validation)."""
        self._bound()
        self._check_like("a", a)
        self._check_like("b", b)
        out = torch.empty(self._shape(a, b), dtype=a.dtype, device=a.device)
        return self.forward_out(a, b, out=out, ctx=ctx)


class Linear(_PreparedProduct):
    """Prepared ``matmul.linear``: x [..., K], w [N, K], bias [N] (exactly when ``has_bias``) -> [..., N]."""

    op = "matmul.linear"

    def __init__(self, has_bias: bool) -> None:
        super().__init__()
        if not isinstance(has_bias, bool):
            raise ArgumentError(f"Linear: 'has_bias' must be a bool, got {has_bias!r}")
        self.has_bias = has_bias

    def prepare(self, init: OperatorInitContext, dispatcher: Dispatcher | None = None) -> Linear:
        super().prepare(init, dispatcher)
        return self

    def _validate(self, x, w, bias, out) -> None:
        self._bound()
        if (bias is not None) != self.has_bias:
            want = "a bias [N]" if self.has_bias else "no bias"
            raise ArgumentError(f"{self.op}: this Linear was built with has_bias={self.has_bias} and takes {want}; "
                                f"got bias={'None' if bias is None else 'a tensor'}")
        shape = _linear_shape(self.op, x, w, bias)
        self._check_named({"x": x, "w": w, "bias": bias}, out, shape)

    def forward_out(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                    out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
        """x @ w.T (+ bias) into ``out`` [..., N].

        The hot path checks that x, w, bias and out are plain strided tensors of the prepared dtype and device
        (identity checks, one device comparison each), the bias against ``has_bias`` and the shapes that torch
        would broadcast (bias) or silently resize (out); a mismatched K makes the kernel fail, and only then
        (or when a check fails) is everything validated for a precise error.
        """
        kernel, seen = self.kernel, self._checked
        if seen and x is seen[0] and w is seen[1] and out is seen[2] and bias is seen[3]:
            pass  # the previous call's tensors, checked then
        else:
            dt, dev = self._dtype, self._device
            plain = (type(x) is Tensor and type(w) is Tensor and type(out) is Tensor
                     and x.dtype is dt and w.dtype is dt and out.dtype is dt
                     and x.layout is STRIDED and w.layout is STRIDED and out.layout is STRIDED
                     and x.device == dev and w.device == dev and out.device == dev
                     and (bias is None) is not self.has_bias and (bias is None or self._plain_bias(bias, w)))
            if plain:
                o, ws = out.shape, w.shape
                plain = len(ws) == 2 and o[:-1] == x.shape[:-1] and o and o[-1] == ws[0]
            if not plain:
                self._validate(x, w, bias, out)
            _checks.no_alias(self.op, {"out": out}, {"x": x, "w": w, "bias": bias})  # once per new set of tensors
            self._checked = (x, w, out, bias)
        try:
            kernel.fn(self._kctx if ctx is None else self._context(ctx), (x, w, bias), (out,))
        except Exception as exc:
            if not isinstance(exc, DtorchError):
                self._validate(x, w, bias, out)  # names the bad argument when there is one
            self._failed(exc)
        return out

    def _plain_bias(self, bias: torch.Tensor, w: torch.Tensor) -> bool:
        return (type(bias) is Tensor and bias.dtype is self._dtype and bias.layout is STRIDED
                and bias.device == self._device and bias.shape == w.shape[:1])

    def forward(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                ctx: RuntimeContext | None = None) -> torch.Tensor:
        """x @ w.T (+ bias) as a new tensor [..., N] (full validation)."""
        self._bound()
        self._check_like("x", x)
        self._check_like("w", w)
        out = torch.empty(_linear_shape(self.op, x, w, bias), dtype=x.dtype, device=x.device)
        self._validate(x, w, bias, out)
        return self.forward_out(x, w, bias, out=out, ctx=ctx)


# -- in a graph -------------------------------------------------------------------------------------------------

def _mm_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # a [M, K] @ b [K, N]
    return [Strategy((R, R), R), Strategy((Shard(0), R), Shard(0)), Strategy((R, Shard(1)), Shard(1)),
            Strategy((Shard(1), Shard(0)), P)]


def _bmm_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # a [B, M, K] @ b [B, K, N]
    return [Strategy((R, R), R), Strategy((Shard(0), Shard(0)), Shard(0)), Strategy((Shard(1), R), Shard(1)),
            Strategy((R, Shard(2)), Shard(2)), Strategy((Shard(2), Shard(1)), P)]


def _linear_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [..., K], w [N, K], bias [N] or None -> [..., N]
    nd, bias = len(shapes[0]), shapes[2]
    out = [Strategy((R, R, opt(bias, R)), R)]
    out += [Strategy((Shard(d), R, opt(bias, R)), Shard(d)) for d in range(nd - 1)]
    out.append(Strategy((R, Shard(0), opt(bias, Shard(0))), Shard(nd - 1)))  # column parallel
    if bias is None:
        out.append(Strategy((Shard(nd - 1), Shard(1), None), P))  # row parallel: partial sums
    return out


declare("matmul.mm", mm, ("a", "b"), rule=_mm_rule)
declare("matmul.bmm", bmm, ("a", "b"), rule=_bmm_rule)
declare("matmul.linear", linear, ("x", "w", "bias"), params=lambda op, a: linear_params(a["coarse"]),
        rule=_linear_rule)
