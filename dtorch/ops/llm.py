"""LLM op wrappers and their prepared operators: embedding, rms_norm (+ fused residual add) and softmax_last_dim, with
their graph declarations. Rope lives in ``dtorch.ops.rope`` (re-exported here), the gated activations in
``dtorch.ops.glu``, attention in ``dtorch.ops.attention``.

Each op has a functional form (allocates) and an ``*_out`` form (``out=`` caller-allocated,
optional ``ctx: RuntimeContext``). Shapes are checked on every device; values (embedding ids)
only on cpu (``_checks.host_readable``): device values are trusted, validated where they are made (a step's feeds,
on the host), so no wrapper syncs with a device; the wrappers also infer shapes on ``meta`` tensors.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import FLOAT_DTYPES, INT_DTYPES
from dtorch.core.errors import ArgumentError, DtorchError, ShapeError
from dtorch.core.placement import Shard, shard_offsets
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.ops import _checks
from dtorch.ops._checks import STRIDED
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, P, R, Shapes, Strategy, declare
from dtorch.ops.prepared import PreparedOperator
from dtorch.ops.rope import RoPE, RoPETables, rope, rope_cached, rope_inv_freq, rope_out


def _device(op: str, named: dict[str, torch.Tensor], ctx: RuntimeContext | None) -> Device:
    for name, t in named.items():
        _checks.tensor(op, name, t)
    return _checks.same_device(op, named, ctx.device if ctx is not None else None)


def _run(op: str, device: Device, dtype: torch.dtype, inputs: tuple, outputs: tuple, params: KernelParams,
         ctx: RuntimeContext | None) -> None:
    if ctx is None:
        run(op, device, dtype, inputs, outputs, params)
    else:
        run(op, device, dtype, inputs, outputs, params, ctx.stream, ctx.workspace)


# -- embedding -----------------------------------------------------------------------------------

def _check_embedding(ids: torch.Tensor, weight: torch.Tensor, ctx: RuntimeContext | None) -> Device:
    op = "llm.embedding"
    device = _device(op, {"ids": ids, "weight": weight}, ctx)
    _checks.dtype_in(op, "ids", ids, INT_DTYPES)
    _checks.dtype_in(op, "weight", weight, FLOAT_DTYPES)
    _checks.rank(op, "weight", weight, 2)
    _checks.allocation(op, "the result", (*ids.shape, weight.shape[1]), weight.dtype, weight.device)
    if ids.numel() and _checks.host_readable(ids):  # device values are trusted
        lo, hi = (int(v) for v in torch.aminmax(ids))
        vocab = weight.shape[0]
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ArgumentError(f"{op}: 'ids' holds id {bad}, out of range for a weight of {vocab} rows "
                                f"(expected 0..{vocab - 1})")
    return device


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` [V, D] picked by ``ids`` (int32/int64, any shape [...]) -> [..., D]."""
    device = _check_embedding(ids, weight, None)
    out = torch.empty((*ids.shape, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    run("llm.embedding", device, weight.dtype, (weight, ids), (out,))
    return out


def embedding_out(ids: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor,
                  ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``embedding`` into ``out`` [..., D]."""
    device = _check_embedding(ids, weight, ctx)
    _checks.out("llm.embedding", out, (*ids.shape, weight.shape[1]), weight.dtype, weight.device)
    _run("llm.embedding", device, weight.dtype, (weight, ids), (out,), NO_PARAMS, ctx)
    return out


# -- rms_norm ------------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _eps_params(eps: float) -> KernelParams:
    return KernelParams(eps=eps)


def _norm_params(op: str, eps: object) -> KernelParams:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
        raise ArgumentError(f"{op}: 'eps' must be a finite number >= 0, got {eps!r}")
    return _eps_params(float(eps))


def _check_norm(op: str, named: dict[str, torch.Tensor], weight: torch.Tensor, ctx: RuntimeContext | None) -> Device:
    device = _device(op, named | {"weight": weight}, ctx)
    _checks.same_dtype(op, named | {"weight": weight})
    first_name, x = next(iter(named.items()))
    _checks.dtype_in(op, first_name, x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ShapeError(f"{op}: argument {first_name!r} must have rank >= 1 ([..., D]), got a scalar")
    for name, t in named.items():
        if t.shape != x.shape:
            raise ShapeError(f"{op}: {name!r} must have the shape of {first_name!r} {tuple(x.shape)}, "
                             f"got {tuple(t.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ShapeError(f"{op}: 'weight' must have shape ({x.shape[-1]},) (the last dim of {first_name!r}), "
                         f"got {tuple(weight.shape)}")
    return device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim as LlamaRMSNorm: x [..., D], weight [D] -> [..., D]."""
    params = _norm_params("llm.rms_norm", eps)
    device = _check_norm("llm.rms_norm", {"x": x}, weight, None)
    out = torch.empty_like(x)
    run("llm.rms_norm", device, x.dtype, (x, weight), (out,), params)
    return out


def rms_norm_out(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: torch.Tensor,
                 ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``rms_norm`` into ``out`` [..., D]; ``out`` may be ``x`` (in place)."""
    params = _norm_params("llm.rms_norm", eps)
    device = _check_norm("llm.rms_norm", {"x": x}, weight, ctx)
    _checks.out("llm.rms_norm", out, x.shape, x.dtype, x.device)
    _run("llm.rms_norm", device, x.dtype, (x, weight), (out,), params, ctx)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: returns (rms_norm(residual + x), residual + x), both [..., D]."""
    params = _norm_params("llm.add_rms_norm", eps)
    device = _check_norm("llm.add_rms_norm", {"x": x, "residual": residual}, weight, None)
    out, res = torch.empty_like(x), torch.empty_like(x)
    run("llm.add_rms_norm", device, x.dtype, (x, residual, weight), (out, res), params)
    return out, res


def add_rms_norm_out(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                     out: torch.Tensor, residual_out: torch.Tensor | None = None,
                     ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out = residual + x; out = rms_norm(residual_out)``; ``residual_out`` defaults to
    ``residual`` itself (the in-place residual stream). Returns (out, residual_out).

    In place: only ``residual_out`` may be ``residual`` (the same tensor). ``out`` must not overlap ``x``,
    ``residual``, ``weight`` or ``residual_out`` (an ``ArgumentError`` otherwise)."""
    op = "llm.add_rms_norm"
    params = _norm_params(op, eps)
    device = _check_norm(op, {"x": x, "residual": residual}, weight, ctx)
    _checks.out(op, out, x.shape, x.dtype, x.device)
    if residual_out is None:
        residual_out = residual
    else:
        _checks.out(op, residual_out, x.shape, x.dtype, x.device)
    _check_add_rms_aliases(x, residual, weight, out, residual_out)
    _run(op, device, x.dtype, (x, residual, weight), (out, residual_out), params, ctx)
    return out, residual_out


def _check_add_rms_aliases(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                           residual_out: torch.Tensor) -> None:
    """``residual_out`` is ``residual`` itself or overlaps no input; ``out`` overlaps nothing."""
    op = "llm.add_rms_norm"
    _checks.no_alias(op, {"out": out, "residual_out": residual_out},
                     {"x": x, "weight": weight} | ({} if residual_out is residual else {"residual": residual}))
    if residual_out is residual:
        _checks.no_alias(op, {"out": out}, {"residual": residual})


def _alike(dtype: torch.dtype, device: torch.device, shape: torch.Size, tensors: tuple) -> bool:
    """Every one of ``tensors`` is a plain strided tensor of ``dtype``, ``device`` and ``shape``: the prepared
    hot paths' whole check."""
    for t in tensors:
        if (type(t) is not torch.Tensor or t.dtype is not dtype or t.layout is not STRIDED or t.device != device
                or t.shape != shape):
            return False
    return True


class _PreparedLLM(PreparedOperator):
    """Hot path of the prepared LLM ops: a few identity and shape comparisons (the ones whose failure torch
    would not report: broadcasting, out= resizing, dtype promotion into out); anything else, and any kernel
    failure, goes through the subclass's ``_validate``, which raises the precise error."""

    def _kernel(self, inputs: tuple, outputs: tuple, ctx: RuntimeContext | None, validate) -> None:
        try:
            self.kernel.fn(self._kctx if ctx is None else self._context(ctx), inputs, outputs)
        except Exception as exc:
            if not isinstance(exc, DtorchError):
                validate()
            self._failed(exc)


class RMSNorm(_PreparedLLM):
    """Prepared ``llm.rms_norm``: ``RMSNorm(eps).prepare(init)``, then ``forward(x, weight)`` every step."""

    op = "llm.rms_norm"

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__(_norm_params(self.op, eps))

    def _validate(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, ctx: RuntimeContext | None) -> None:
        self._check_like("x", x)
        _check_norm(self.op, {"x": x}, weight, ctx)
        _checks.out(self.op, out, x.shape, x.dtype, x.device)

    def forward_out(self, x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """x [..., D], weight [D] -> out [..., D] (may be x)."""
        seen = self._checked
        if not (seen and x is seen[0] and weight is seen[1] and out is seen[2]):  # else: checked last call
            dt, dev = self._dtype, self._device
            if type(x) is not torch.Tensor or not (
                    x.dim() and _alike(dt, dev, x.shape, (x, out)) and _alike(dt, dev, x.shape[-1:], (weight,))):
                self._validate(x, weight, out, ctx)
            self._checked = (x, weight, out)
        self._kernel((x, weight), (out,), ctx, lambda: self._validate(x, weight, out, ctx))
        return out

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self._check_like("x", x)
        return self.forward_out(x, weight, out=torch.empty_like(x))


class AddRMSNorm(_PreparedLLM):
    """Prepared ``llm.add_rms_norm``: ``forward_(x, residual, weight, out=)`` adds x into residual in place."""

    op = "llm.add_rms_norm"

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__(_norm_params(self.op, eps))

    def _validate(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                  residual_out: torch.Tensor, ctx: RuntimeContext | None) -> None:
        self._check_like("x", x)
        _check_norm(self.op, {"x": x, "residual": residual}, weight, ctx)
        _checks.out(self.op, out, x.shape, x.dtype, x.device)
        if residual_out is not residual:
            _checks.out(self.op, residual_out, x.shape, x.dtype, x.device)
        _check_add_rms_aliases(x, residual, weight, out, residual_out)

    def forward_out(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor,
                    residual_out: torch.Tensor | None = None,
                    ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [..., D], weight [D] -> (out, residual_out) [..., D]; residual_out defaults to residual."""
        if residual_out is None:
            residual_out = residual
        dt, dev = self._dtype, self._device
        if type(x) is not torch.Tensor or out is residual_out or out is residual or out is x or not (
                x.dim() and _alike(dt, dev, x.shape, (x, residual, out, residual_out))
                and _alike(dt, dev, x.shape[-1:], (weight,))):
            self._validate(x, residual, weight, out, residual_out, ctx)
        self._kernel((x, residual, weight), (out, residual_out), ctx,
                     lambda: self._validate(x, residual, weight, out, residual_out, ctx))
        return out, residual_out

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_like("x", x)
        return self.forward_out(x, residual, weight, out=torch.empty_like(x), residual_out=torch.empty_like(x))


# -- softmax_last_dim --------------------------------------------------------------------------

def _check_float(op: str, x: torch.Tensor, ctx: RuntimeContext | None) -> Device:
    device = _device(op, {"x": x}, ctx)
    _checks.dtype_in(op, "x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ShapeError(f"{op}: argument 'x' must have rank >= 1, got a scalar")
    return device


def softmax_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of x [..., N] (float32 accumulation for low precision) -> [..., N]."""
    device = _check_float("llm.softmax_last_dim", x, None)
    out = torch.empty_like(x)
    run("llm.softmax_last_dim", device, x.dtype, (x,), (out,))
    return out


def softmax_last_dim_out(x: torch.Tensor, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``softmax_last_dim`` into ``out`` [..., N]; ``out`` may be ``x``."""
    device = _check_float("llm.softmax_last_dim", x, ctx)
    _checks.out("llm.softmax_last_dim", out, x.shape, x.dtype, x.device)
    _run("llm.softmax_last_dim", device, x.dtype, (x,), (out,), NO_PARAMS, ctx)
    return out


class Embedding(PreparedOperator):
    """Prepared ``llm.embedding``: ``forward(ids, weight)`` -> [..., D]."""

    op = "llm.embedding"

    def forward_out(self, ids: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        self._check_like("weight", weight)
        _check_embedding(ids, weight, ctx)
        _checks.out(self.op, out, (*ids.shape, weight.shape[1]), weight.dtype, weight.device)
        self._run((weight, ids), (out,), ctx)
        return out

    def forward(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self._check_like("weight", weight)
        _check_embedding(ids, weight, None)
        out = torch.empty((*ids.shape, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        self._run((weight, ids), (out,), None)
        return out


# -- in a graph -------------------------------------------------------------------------------------------------

def _embedding_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # weight [V, D], ids [...] -> [..., D]
    (vocab, _), ids = shapes

    def vocab_start(p: KernelParams, rank: int, n: int) -> KernelParams:
        return p.replace(vocab_start=shard_offsets(vocab, n)[rank])

    out = [Strategy((R, R), R)] + [Strategy((R, Shard(d)), Shard(d)) for d in range(len(ids))]
    out.append(Strategy((Shard(1), R), Shard(len(ids))))  # each device its columns of every row
    # vocabulary parallel: each device looks up the ids in its rows and gives zeros elsewhere; the sum is whole
    return out + [Strategy((Shard(0), R), P, vocab_start)]


def _last_dim_whole(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    """rms_norm (x, weight), add_rms_norm (x, residual, weight), softmax_last_dim (x): any placement that keeps
    the normalized last dim whole; never Partial (a norm of a sum is not the sum of norms)."""
    nd, k = len(shapes[0]), 2 if op == "llm.add_rms_norm" else 1
    weight = (R,) if op != "llm.softmax_last_dim" else ()
    outs = (lambda p: (p, p)) if op == "llm.add_rms_norm" else (lambda p: p)  # (out, residual_out)
    return [Strategy((p,) * k + weight, outs(p)) for p in [R] + [Shard(d) for d in range(nd - 1)]]


def _eps(op: str, a: Args) -> KernelParams:
    return _norm_params(op, a["eps"])


# the kernel is keyed by the weight's dtype, so the weight comes first
declare("llm.embedding", embedding, ("weight", "ids"), rule=_embedding_rule)
declare("llm.rms_norm", rms_norm, ("x", "weight"), params=_eps, rule=_last_dim_whole, inplace=(("out", 0, "x"),))
declare("llm.add_rms_norm", add_rms_norm, ("x", "residual", "weight"), params=_eps, rule=_last_dim_whole, outputs=2,
        result=lambda r, a: tuple(r), inplace=(("residual_out", 1, "residual"),))
declare("llm.softmax_last_dim", softmax_last_dim, ("x",), rule=_last_dim_whole, inplace=(("out", 0, "x"),))

__all__ = [
    "AddRMSNorm", "Embedding", "RMSNorm", "RoPE", "RoPETables", "add_rms_norm", "add_rms_norm_out", "embedding",
    "embedding_out", "rms_norm", "rms_norm_out", "rope", "rope_cached", "rope_inv_freq", "rope_out",
    "softmax_last_dim", "softmax_last_dim_out",
]
