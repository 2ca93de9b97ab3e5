"""LLM op wrappers and their prepared operators: embedding, rms_norm (+ fused residual add), rope,
softmax_last_dim, silu_and_mul and gelu_tanh_and_mul (rope itself lives in ``dtorch.ops.rope``, re-exported here).
Attention lives in ``dtorch.ops.attention``.

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
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.ops import _checks
from dtorch.ops._checks import STRIDED
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
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


# -- softmax_last_dim, silu_and_mul --------------------------------------------------------------

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


def _split_gate_up(x: torch.Tensor, up: torch.Tensor | None, ctx: RuntimeContext | None,
                   op: str = "llm.silu_and_mul") -> tuple[Device, torch.Tensor, torch.Tensor]:
    device = _check_float(op, x, ctx)
    if up is None:
        if x.shape[-1] % 2:
            raise ShapeError(f"{op}: 'x' [..., 2I] must have an even last dim, got shape {tuple(x.shape)}")
        half = x.shape[-1] // 2
        return device, x[..., :half], x[..., half:]
    _device(op, {"x": x, "up": up}, ctx)
    _checks.same_dtype(op, {"x": x, "up": up})
    if up.shape != x.shape:
        raise ShapeError(f"{op}: 'up' must have the shape of 'x' (the gate) {tuple(x.shape)}, got {tuple(up.shape)}")
    return device, x, up


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation: x [..., 2I] -> silu(x[..., :I]) * x[..., I:] [..., I].

    Two-input form: ``silu_and_mul(gate, up)`` with gate and up both [..., I] -> silu(gate) * up.
    """
    device, gate, up = _split_gate_up(x, up, None)
    out = torch.empty(gate.shape, dtype=x.dtype, device=x.device)
    run("llm.silu_and_mul", device, x.dtype, (gate, up), (out,))
    return out


def silu_and_mul_out(x: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor,
                     ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``silu_and_mul`` into ``out`` [..., I]."""
    device, gate, up = _split_gate_up(x, up, ctx)
    _checks.out("llm.silu_and_mul", out, gate.shape, x.dtype, x.device)
    _run("llm.silu_and_mul", device, x.dtype, (gate, up), (out,), NO_PARAMS, ctx)
    return out


GELU_TANH = "llm.gelu_tanh_and_mul"


def gelu_tanh_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU activation (Gemma's MLP): x [..., 2I] -> gelu_tanh(x[..., :I]) * x[..., I:] [..., I], where gelu_tanh is
    GELU with the tanh approximation (``F.gelu(approximate="tanh")``), rounded to x's dtype before the product.

    Two-input form: ``gelu_tanh_and_mul(gate, up)`` with gate and up both [..., I].
    """
    device, gate, up = _split_gate_up(x, up, None, GELU_TANH)
    out = torch.empty(gate.shape, dtype=x.dtype, device=x.device)
    run(GELU_TANH, device, x.dtype, (gate, up), (out,))
    return out


def gelu_tanh_and_mul_out(x: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor,
                          ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``gelu_tanh_and_mul`` into ``out`` [..., I]."""
    device, gate, up = _split_gate_up(x, up, ctx, GELU_TANH)
    _checks.out(GELU_TANH, out, gate.shape, x.dtype, x.device)
    _run(GELU_TANH, device, x.dtype, (gate, up), (out,), NO_PARAMS, ctx)
    return out


class SiluAndMul(_PreparedLLM):
    """Prepared ``llm.silu_and_mul``: ``forward(x)`` with x [..., 2I], or ``forward(gate, up)``."""

    op = "llm.silu_and_mul"

    def _validate(self, x: torch.Tensor, up: torch.Tensor | None, out: torch.Tensor,
                  ctx: RuntimeContext | None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_like("x", x)
        _, gate, up = _split_gate_up(x, up, ctx, self.op)
        _checks.out(self.op, out, gate.shape, x.dtype, x.device)
        return gate, up

    def forward_out(self, x: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """x [..., 2I] (or gate and up [..., I]) -> out [..., I]."""
        dt, dev = self._dtype, self._device
        if (up is None and type(x) is torch.Tensor and x.dim() and x.dtype is dt and x.layout is STRIDED
                and x.device == dev and not x.shape[-1] % 2
                and _alike(dt, dev, (*x.shape[:-1], x.shape[-1] // 2), (out,))):
            half = out.shape[-1]
            pair = x[..., :half], x[..., half:]
        else:
            pair = self._validate(x, up, out, ctx)
        self._kernel(pair, (out,), ctx, lambda: self._validate(x, up, out, ctx))
        return out

    def forward(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        self._check_like("x", x)
        _, gate, _ = _split_gate_up(x, up, None, self.op)
        return self.forward_out(x, up, out=torch.empty(gate.shape, dtype=x.dtype, device=x.device))


class GeluTanhAndMul(SiluAndMul):
    """Prepared ``llm.gelu_tanh_and_mul`` (GeGLU): ``forward(x)`` with x [..., 2I], or ``forward(gate, up)``."""

    op = GELU_TANH


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


__all__ = [
    "AddRMSNorm", "Embedding", "GeluTanhAndMul", "RMSNorm", "RoPE", "RoPETables", "SiluAndMul", "add_rms_norm",
    "add_rms_norm_out", "embedding", "embedding_out", "gelu_tanh_and_mul", "gelu_tanh_and_mul_out", "rms_norm",
    "rms_norm_out", "rope", "rope_cached", "rope_inv_freq", "rope_out", "silu_and_mul", "silu_and_mul_out",
    "softmax_last_dim", "softmax_last_dim_out",
]
