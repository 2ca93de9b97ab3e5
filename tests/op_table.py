"""The op table: one ``Row`` per op (or per op configuration), each checked against plain torch.

A row says how to make the kernel's inputs for a dtype and a case, the torch reference for them, the
kernel params, the dtypes, the tolerance per dtype and the cases. ``tests/test_op_table.py`` runs every
(row, dtype, case) through the functional wrapper, ``dtorch.ops.invoke`` on the kernel key, ``invoke`` once
per candidate of the key with every other provider disabled (so every registered kernel is checked), and
the op's prepared operator where it has one (``PREPARED`` there). References compute in float64 (int64
for integers) and cast back.

Cases name input shapes and layouts: "contig", "strided" (non-contiguous views), "size1" (a dim of 1),
"empty" (a dim of 0), "0d", and per family "broadcast", "empty_k", "empty_dim", "down", ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dtorch import ops
from dtorch.core.dtypes import dtype_name, tolerance as default_tolerance

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)
NUMERIC = FLOATS + INTS
HALF_TOL = {torch.bfloat16: (3e-2, 5e-2), torch.float16: (1e-2, 2e-2)}  # products and sums of many terms


@dataclass(frozen=True)
class Row:
    """One op (configuration) of the table.

    make_inputs(dtype, case) -> the kernel's inputs, in kernel order (None for an absent optional input).
    reference(inputs, params) -> the expected output, computed with plain torch.
    params: the kernel params given to ``invoke``, or a function (dtype, case) -> them. Extra keys that
        only ``call`` and ``reference`` read (a shape, a target dtype) may ride along; kernels ignore them.
    call(inputs, params) -> the functional wrapper's result; default ``dtorch.ops.<name>(*inputs, **params)``.
    tol: (rtol, atol) per dtype, overriding ``dtorch.core.dtypes.tolerance``.
    values: False compares only shape and dtype (``creation.empty``).
    """

    op: str
    make_inputs: Callable[[torch.dtype, str], list]
    reference: Callable[[list, dict], torch.Tensor]
    params: dict | Callable[[torch.dtype, str], dict] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = FLOATS
    tol: dict[torch.dtype, tuple[float, float]] = field(default_factory=dict)
    cases: tuple[str, ...] = ("contig",)
    call: Callable[[list, dict], torch.Tensor] | None = None
    name: str = ""
    values: bool = True

    @property
    def id(self) -> str:
        return f"{self.op}[{self.name}]" if self.name else self.op

    def params_for(self, dtype: torch.dtype, case: str) -> dict:
        return dict(self.params(dtype, case) if callable(self.params) else self.params)

    def tolerance(self, dtype: torch.dtype) -> tuple[float, float]:
        return self.tol.get(dtype, default_tolerance(dtype))

    def run_functional(self, inputs: list, params: dict) -> torch.Tensor:
        if self.call is not None:
            return self.call(inputs, params)
        return getattr(ops, self.op.split(".", 1)[1])(*inputs, **params)


# -- inputs --------------------------------------------------------------------------------------

def rand(shape: tuple[int, ...], dtype: torch.dtype, strided: bool = False, low: float = -2.0, high: float = 2.0,
         signed_away_from_zero: bool = False) -> torch.Tensor:
    """Random values in [low, high] (ints: integers in it), never all zeros; ``strided`` gives a
    non-contiguous view (every other element of a twice-as-wide tensor)."""
    full = (*shape[:-1], 2 * shape[-1]) if strided and shape else shape
    if dtype.is_floating_point:
        t = torch.rand(full, dtype=torch.float64) * (high - low) + low
        if signed_away_from_zero:  # magnitudes in [low, high], random sign
            t = t * (torch.randint(0, 2, full) * 2 - 1)
    else:
        t = torch.randint(int(low), int(high) + 1, full, dtype=torch.int64)
        if signed_away_from_zero:
            t = torch.where(t == 0, torch.ones_like(t), t)
    if t.numel() and not t.any():
        t.view(-1)[0] = 1
    t = t.to(dtype)
    return t[..., ::2] if strided and shape else t


ELEMENTWISE = {"contig": (3, 5), "strided": (3, 5), "size1": (1, 5), "empty": (0, 5), "0d": ()}


def _ew_inputs(n: int, **domain) -> Callable[[torch.dtype, str], list]:
    def make(dtype: torch.dtype, case: str) -> list:
        return [rand(ELEMENTWISE[case], dtype, case == "strided", **domain) for _ in range(n)]
    return make


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.dtype.is_floating_point else t.long()


def _via_wide(fn: Callable) -> Callable[[list, dict], torch.Tensor]:
    """Reference: ``fn`` on float64 / int64 copies of the inputs, cast back to the first input's dtype."""
    def reference(inputs: list, params: dict) -> torch.Tensor:
        return fn(*[_wide(t) for t in inputs], **params).to(inputs[0].dtype)
    return reference


# -- unary ---------------------------------------------------------------------------------------

EW_CASES = tuple(ELEMENTWISE)
POSITIVE = {"low": 0.1, "high": 3.0}
UNARY_REF = {  # name -> (torch reference, dtypes, input domain)
    "neg": (torch.neg, NUMERIC, {}), "abs": (torch.abs, NUMERIC, {}), "exp": (torch.exp, FLOATS, {}),
    "log": (torch.log, FLOATS, POSITIVE), "sqrt": (torch.sqrt, FLOATS, POSITIVE),
    "rsqrt": (torch.rsqrt, FLOATS, POSITIVE), "sin": (torch.sin, FLOATS, {}), "cos": (torch.cos, FLOATS, {}),
    "tanh": (torch.tanh, FLOATS, {}), "sigmoid": (torch.sigmoid, FLOATS, {}), "relu": (torch.relu, NUMERIC, {}),
    "silu": (F.silu, FLOATS, {}),
}

UNARY_ROWS = [Row(f"unary.{n}", _ew_inputs(1, **dom), _via_wide(fn), dtypes=dts, cases=EW_CASES)
              for n, (fn, dts, dom) in UNARY_REF.items()]
UNARY_ROWS += [Row("unary.gelu", _ew_inputs(1), _via_wide(F.gelu), {"approximate": a}, cases=EW_CASES, name=a)
               for a in ("none", "tanh")]

# -- binary --------------------------------------------------------------------------------------

BROADCAST = {"broadcast": ((3, 1, 5), (4, 1)), "broadcast_strided": ((2, 5), (3, 1, 5)),
             "broadcast_empty": ((0, 1), (1, 4))}
BINARY_CASES = EW_CASES + tuple(BROADCAST)


def _pair_domain(name: str, dtype: torch.dtype) -> tuple[dict, dict]:
    if name == "div":
        return {}, {"low": 0.5, "high": 2.0, "signed_away_from_zero": True}
    if name == "pow":  # a positive base for floats; small non-negative integer exponents for ints
        return (POSITIVE, {}) if dtype.is_floating_point else ({"low": -3, "high": 3}, {"low": 0, "high": 3})
    return {}, {}


def _binary_inputs(name: str) -> Callable[[torch.dtype, str], list]:
    def make(dtype: torch.dtype, case: str) -> list:
        da, db = _pair_domain(name, dtype)
        if case in BROADCAST:
            sa, sb = BROADCAST[case]
            strided = case == "broadcast_strided"
            return [rand(sa, dtype, strided, **da), rand(sb, dtype, strided, **db)]
        shape = ELEMENTWISE[case]
        return [rand(shape, dtype, case == "strided", **da), rand(shape, dtype, case == "strided", **db)]
    return make


BINARY_REF = {"add": (torch.add, NUMERIC), "sub": (torch.sub, NUMERIC), "mul": (torch.mul, NUMERIC),
              "div": (torch.div, FLOATS), "maximum": (torch.maximum, NUMERIC),
              "minimum": (torch.minimum, NUMERIC), "pow": (torch.pow, NUMERIC)}
SCALAR_VALUE = {torch.int32: 3, torch.int64: -2}  # floats use 1.5 (pow: 2 for ints, 1.5 for floats)


def _scalar_params(name: str) -> Callable[[torch.dtype, str], dict]:
    def params(dtype: torch.dtype, case: str) -> dict:
        if name == "pow":
            return {"value": 1.5 if dtype.is_floating_point else 2}
        return {"value": SCALAR_VALUE.get(dtype, 1.5)}
    return params


def _scalar_inputs(name: str) -> Callable[[torch.dtype, str], list]:
    def make(dtype: torch.dtype, case: str) -> list:
        return [rand(ELEMENTWISE[case], dtype, case == "strided", **_pair_domain(name, dtype)[0])]
    return make


def _scalar_call(name: str):
    return lambda inputs, params: getattr(ops, name)(inputs[0], params["value"])


def _scalar_ref(fn):
    def reference(inputs: list, params: dict) -> torch.Tensor:
        x = _wide(inputs[0])
        return fn(x, torch.tensor(params["value"], dtype=x.dtype)).to(inputs[0].dtype)
    return reference


BINARY_ROWS = [Row(f"binary.{n}", _binary_inputs(n), _via_wide(fn), dtypes=dts, cases=BINARY_CASES)
               for n, (fn, dts) in BINARY_REF.items()]
BINARY_ROWS += [Row(f"binary.{n}_scalar", _scalar_inputs(n), _scalar_ref(fn), _scalar_params(n), dts,
                    cases=EW_CASES, call=_scalar_call(n)) for n, (fn, dts) in BINARY_REF.items()]

# -- matmul --------------------------------------------------------------------------------------

MM_SHAPES = {"contig": ((3, 4), (4, 5)), "strided": ((3, 4), (4, 5)), "size1": ((1, 4), (4, 1)),
             "empty": ((0, 4), (4, 5)), "empty_k": ((3, 0), (0, 5)),
             "tall": ((40, 6), (6, 5))}  # enough rows for bf16 mm's "upcast" provider (where it is active)
BMM_SHAPES = {k: ((2, *a), (2, *b)) for k, (a, b) in MM_SHAPES.items()}
LINEAR_SHAPES = {"contig": (2, 3, 4), "strided": (3, 4), "size1": (1, 4), "empty": (0, 4), "1d": (4,)}
MATMUL_INT = {"low": -3, "high": 3}


def _mm_inputs(shapes: dict) -> Callable[[torch.dtype, str], list]:
    def make(dtype: torch.dtype, case: str) -> list:
        sa, sb = shapes[case]
        return [rand(sa, dtype, case == "strided", **MATMUL_INT), rand(sb, dtype, case == "strided", **MATMUL_INT)]
    return make


def _linear_inputs(has_bias: bool) -> Callable[[torch.dtype, str], list]:
    def make(dtype: torch.dtype, case: str) -> list:
        x = rand(LINEAR_SHAPES[case], dtype, case == "strided", **MATMUL_INT)
        w = rand((6, 4), dtype, case == "strided", **MATMUL_INT)
        return [x, w, rand((6,), dtype, **MATMUL_INT) if has_bias else None]
    return make


def _linear_ref(inputs: list, params: dict) -> torch.Tensor:
    x, w, b = inputs
    return F.linear(_wide(x), _wide(w), None if b is None else _wide(b)).to(x.dtype)


MATMUL_ROWS = [
    Row("matmul.mm", _mm_inputs(MM_SHAPES), _via_wide(torch.mm), dtypes=NUMERIC, tol=HALF_TOL, cases=tuple(MM_SHAPES)),
    Row("matmul.bmm", _mm_inputs(BMM_SHAPES), _via_wide(torch.bmm), dtypes=NUMERIC, tol=HALF_TOL,
        cases=tuple(BMM_SHAPES)),
    Row("matmul.linear", _linear_inputs(True), _linear_ref, dtypes=NUMERIC, tol=HALF_TOL,
        cases=tuple(LINEAR_SHAPES), name="bias"),
    Row("matmul.linear", _linear_inputs(False), _linear_ref, dtypes=NUMERIC, tol=HALF_TOL,
        cases=tuple(LINEAR_SHAPES), name="no_bias"),
]

# -- conv ----------------------------------------------------------------------------------------

CONV_BATCH = {"contig": 2, "strided": 2, "size1": 1, "empty": 0}


def _conv_row(nd: int, name: str, spatial: tuple[int, ...], kernel: tuple[int, ...], c_in: int, c_out: int,
              bias: bool, **conv) -> Row:
    params = {"stride": conv.get("stride", (1,) * nd), "padding": conv.get("padding", (0,) * nd),
              "dilation": conv.get("dilation", (1,) * nd), "groups": conv.get("groups", 1)}
    torch_conv = F.conv1d if nd == 1 else F.conv2d

    def make(dtype: torch.dtype, case: str) -> list:
        x = rand((CONV_BATCH[case], c_in, *spatial), dtype, case == "strided")
        w = rand((c_out, c_in // params["groups"], *kernel), dtype, case == "strided")
        return [x, w, rand((c_out,), dtype) if bias else None]

    def reference(inputs: list, p: dict) -> torch.Tensor:
        x, w, b = inputs
        return torch_conv(x.double(), w.double(), None if b is None else b.double(), **p).to(x.dtype)

    return Row(f"conv.conv{nd}d", make, reference, params, FLOATS, HALF_TOL, tuple(CONV_BATCH), name=name)


CONV_ROWS = [
    _conv_row(1, "plain", (7,), (3,), 3, 4, True),
    _conv_row(1, "strided_grouped", (9,), (3,), 4, 6, False, stride=(2,), padding=(1,), dilation=(2,), groups=2),
    _conv_row(2, "plain", (5, 6), (3, 2), 3, 4, True),
    _conv_row(2, "strided_grouped", (7, 6), (3, 2), 4, 2, True, stride=(2, 1), padding=(1, 0), dilation=(1, 2),
              groups=2),
]

# -- reduce --------------------------------------------------------------------------------------

REDUCE_SHAPES = {"contig": (2, 3, 4), "strided": (2, 3, 4), "size1": (1, 3, 1), "empty": (2, 0, 4), "0d": ()}
REDUCE_REF = {"sum": (torch.sum, NUMERIC), "mean": (torch.mean, FLOATS), "max": (torch.amax, NUMERIC),
              "min": (torch.amin, NUMERIC), "argmax": (torch.argmax, NUMERIC)}


def _reduce_row(name: str, dim: int, keepdim: bool) -> Row:
    fn, dtypes = REDUCE_REF[name]
    cases = tuple(REDUCE_SHAPES) + (("empty_dim",) if name in ("sum", "mean") else ())

    def make(dtype: torch.dtype, case: str) -> list:
        if case == "empty_dim":  # the reduced dim itself has size 0
            shape = [2, 3, 4]
            shape[dim] = 0
            return [rand(tuple(shape), dtype)]
        return [rand(REDUCE_SHAPES[case], dtype, case == "strided")]

    def reference(inputs: list, params: dict) -> torch.Tensor:
        x = inputs[0]
        d = params["dim"] if x.dim() else 0
        y = fn(_wide(x), d, keepdim=params["keepdim"])
        return y if name == "argmax" else y.to(x.dtype)  # dtorch keeps the dtype (int sums wrap)

    def params(dtype: torch.dtype, case: str) -> dict:
        return {"dim": dim if case != "0d" else 0, "keepdim": keepdim}

    return Row(f"reduce.{name}", make, reference, params, dtypes, HALF_TOL, cases, name=f"dim{dim}_keep{keepdim}")


REDUCE_ROWS = [_reduce_row(n, dim, keep) for n in REDUCE_REF for dim, keep in ((0, False), (-1, True))]

# -- creation ------------------------------------------------------------------------------------

CREATION_SHAPES = {"contig": (3, 5), "size1": (1, 5), "empty": (0, 5), "0d": ()}


def _creation_row(name: str, torch_fn: Callable, value: bool = False) -> Row:
    def params(dtype: torch.dtype, case: str) -> dict:
        p = {"shape": CREATION_SHAPES[case], "dtype": dtype}
        if value:
            p["value"] = -3 if not dtype.is_floating_point else 2.5
        return p

    def reference(inputs: list, p: dict) -> torch.Tensor:
        args = (p["value"],) if value else ()
        return torch_fn(p["shape"], *args, dtype=p["dtype"])

    def call(inputs: list, p: dict) -> torch.Tensor:
        args = (p["value"],) if value else ()
        return getattr(ops, name)(p["shape"], *args, dtype=p["dtype"])

    return Row(f"creation.{name}", lambda dtype, case: [], reference, params, NUMERIC, cases=tuple(CREATION_SHAPES),
               call=call, values=name != "empty")


ARANGE = {  # case -> (start, end, step) for ints; floats use them / 4
    "up": (-3, 8, 2), "down": (7, -6, -3), "empty": (2, 2, 1), "one": (5, 6, 4)}


def _arange_params(dtype: torch.dtype, case: str) -> dict:
    start, end, step = ARANGE[case]
    if dtype.is_floating_point:
        start, end, step = start / 4, end / 4, step / 4
    return {"start": start, "end": end, "step": step, "dtype": dtype}


CREATION_ROWS = [_creation_row("zeros", torch.zeros), _creation_row("ones", torch.ones),
                 _creation_row("full", torch.full, value=True), _creation_row("empty", torch.empty)]
CREATION_ROWS.append(Row(
    "creation.arange", lambda dtype, case: [],
    lambda inputs, p: torch.arange(p["start"], p["end"], p["step"], dtype=p["dtype"]), _arange_params, NUMERIC,
    cases=tuple(ARANGE), call=lambda inputs, p: ops.arange(p["start"], p["end"], p["step"], dtype=p["dtype"])))

# -- copy ----------------------------------------------------------------------------------------

COPY_SHAPES = {"contig": (3, 5), "strided": (3, 5), "empty": (0, 5), "0d": ()}


def _copy_inputs(dtype: torch.dtype, case: str) -> list:
    return [rand(COPY_SHAPES[case], dtype, case == "strided", low=-3.0, high=3.0)]


def _copy_row(to: torch.dtype | None) -> Row:
    def reference(inputs: list, p: dict) -> torch.Tensor:
        return inputs[0].to(to or inputs[0].dtype, memory_format=torch.contiguous_format)

    return Row("copy.copy", _copy_inputs, reference, {}, NUMERIC, cases=tuple(COPY_SHAPES),
               call=lambda inputs, p: ops.copy(inputs[0], dtype=to), name=f"to_{dtype_name(to) if to else 'same'}")


COPY_ROWS = [_copy_row(to) for to in (None, torch.float32, torch.bfloat16, torch.int64, torch.int32)]
COPY_ROWS.append(Row("copy.contiguous", _copy_inputs, lambda inputs, p: inputs[0].contiguous(), {}, NUMERIC,
                     cases=tuple(COPY_SHAPES), call=lambda inputs, p: ops.contiguous(inputs[0])))

ROWS: list[Row] = UNARY_ROWS + BINARY_ROWS + MATMUL_ROWS + CONV_ROWS + REDUCE_ROWS + CREATION_ROWS + COPY_ROWS
