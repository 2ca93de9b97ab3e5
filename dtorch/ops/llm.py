"""LLM op wrappers and their prepared operators: embedding, rms_norm (+ fused residual add), rope,
softmax_last_dim and silu_and_mul. Attention lives in ``dtorch.ops.attention``.

Each op has a functional form (allocates) and an ``*_out`` form (``out=`` caller-allocated,
optional ``ctx: RuntimeContext``). Shapes are checked on every device; values (embedding ids)
only on real devices, so the wrappers also infer shapes on ``meta`` tensors.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import FLOAT_DTYPES, INT_DTYPES
from dtorch.core.errors import ArgumentError, ShapeError
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.dispatch.meta import Call
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import OperatorInitContext, RuntimeContext
from dtorch.ops.prepared import PreparedOperator


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
    if ids.device.type != "meta" and ids.numel():
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
    ``residual`` itself (the in-place residual stream). Returns (out, residual_out)."""
    op = "llm.add_rms_norm"
    params = _norm_params(op, eps)
    device = _check_norm(op, {"x": x, "residual": residual}, weight, ctx)
    _checks.out(op, out, x.shape, x.dtype, x.device)
    if residual_out is None:
        residual_out = residual
    else:
        _checks.out(op, residual_out, x.shape, x.dtype, x.device)
    _run(op, device, x.dtype, (x, residual, weight), (out, residual_out), params, ctx)
    return out, residual_out


class RMSNorm(PreparedOperator):
    """Prepared ``llm.rms_norm``: ``RMSNorm(eps).prepare(init)``, then ``forward(x, weight)`` every step."""

    op = "llm.rms_norm"

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__(_norm_params(self.op, eps))

    def forward_out(self, x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        self._check_like("x", x)
        _check_norm(self.op, {"x": x}, weight, ctx)
        _checks.out(self.op, out, x.shape, x.dtype, x.device)
        self._run((x, weight), (out,), ctx)
        return out

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.forward_out(x, weight, out=torch.empty_like(x))


class AddRMSNorm(PreparedOperator):
    """Prepared ``llm.add_rms_norm``: ``forward_(x, residual, weight, out=)`` adds x into residual in place."""

    op = "llm.add_rms_norm"

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__(_norm_params(self.op, eps))

    def forward_out(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor,
                    residual_out: torch.Tensor | None = None,
                    ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_like("x", x)
        _check_norm(self.op, {"x": x, "residual": residual}, weight, ctx)
        _checks.out(self.op, out, x.shape, x.dtype, x.device)
        if residual_out is None:
            residual_out = residual
        else:
            _checks.out(self.op, residual_out, x.shape, x.dtype, x.device)
        self._run((x, residual, weight), (out, residual_out), ctx)
        return out, residual_out

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_out(x, residual, weight, out=torch.empty_like(x), residual_out=torch.empty_like(x))


# -- rope ----------------------------------------------------------------------------------------

def rope_inv_freq(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """float32 [rotary_dim / 2]: ``1 / theta ** (2i / rotary_dim)``, as LlamaRotaryEmbedding's default."""
    _check_rotary("llm.rope", rotary_dim, rotary_dim, theta)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta ** exponents)


def _check_rotary(op: str, rotary_dim: object, head_dim: int, theta: object) -> None:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ArgumentError(f"{op}: 'rotary_dim' must be an even int >= 2, got {rotary_dim!r}")
    if rotary_dim > head_dim:
        raise ArgumentError(f"{op}: 'rotary_dim' {rotary_dim} exceeds the head dim {head_dim}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0 or math.isinf(theta):
        raise ArgumentError(f"{op}: 'theta' must be a finite number > 0, got {theta!r}")


@lru_cache(maxsize=64)
def _rope_params(rotary_dim: int, interleaved: bool) -> KernelParams:
    return KernelParams(rotary_dim=rotary_dim, interleaved=interleaved)


def _check_rope(x: torch.Tensor, positions: torch.Tensor, ctx: RuntimeContext | None) -> Device:
    """x [..., T, H, D] (rank >= 3); positions int [T], or [B, T] when x is [B, T, H, D]."""
    op = "llm.rope"
    device = _device(op, {"x": x, "positions": positions}, ctx)
    _checks.dtype_in(op, "x", x, FLOAT_DTYPES)
    _checks.dtype_in(op, "positions", positions, INT_DTYPES)
    if x.dim() < 3:
        raise ShapeError(f"{op}: 'x' must be [..., T, H, D] (rank >= 3), got shape {tuple(x.shape)}")
    _checks.rank(op, "positions", positions, 1, 2)
    t = x.shape[-3]
    if positions.dim() == 1 and positions.shape[0] != t:
        raise ShapeError(f"{op}: 'positions' [T] must have T = {t} (x's dim -3), got {tuple(positions.shape)}")
    if positions.dim() == 2 and (x.dim() != 4 or positions.shape != x.shape[:2]):
        raise ShapeError(f"{op}: 'positions' [B, T] needs x [B, T, H, D] with the same B and T; got positions "
                         f"{tuple(positions.shape)} and x {tuple(x.shape)}")
    return device


def _bool(op: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{op}: {name!r} must be a bool, got {value!r}")
    return value


def _rope_tables(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None,
                 inv_freq: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(rotary_dim, cos, sin) with cos/sin float32 [..., T, rotary_dim / 2] for ``positions``."""
    op = "llm.rope"
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    _check_rotary(op, r, x.shape[-1], theta)
    if inv_freq is None:
        inv_freq = rope_inv_freq(r, theta).to(x.device)
    else:
        _checks.tensor(op, "inv_freq", inv_freq)
        _checks.dtype_in(op, "inv_freq", inv_freq, (torch.float32,))
        if inv_freq.shape != (r // 2,):
            raise ShapeError(f"{op}: 'inv_freq' must have shape ({r // 2},) (rotary_dim / 2), "
                             f"got {tuple(inv_freq.shape)}")
        _checks.same_device(op, {"x": x, "inv_freq": inv_freq})
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [..., T, R/2]
    return r, freqs.cos(), freqs.sin()


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, rotary_dim: int | None = None,
         interleaved: bool = False, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding of x [..., T, H, D] at integer ``positions`` [T] (or [B, T]).

    Rotates the first ``rotary_dim`` (default D) dims, passing the rest through; half rotation
    (NeoX / Llama) unless ``interleaved`` (GPT-J pairs). ``inv_freq`` float32 [rotary_dim / 2]
    replaces the frequencies derived from ``theta`` (e.g. Llama-3 scaled ones). Returns [..., T, H, D].
    """
    device = _check_rope(x, positions, None)
    r, cos, sin = _rope_tables(x, positions, theta, rotary_dim, inv_freq)
    out = torch.empty_like(x)
    run("llm.rope", device, x.dtype, (x, cos, sin), (out,), _rope_params(r, _bool("llm.rope", "interleaved",
                                                                                  interleaved)))
    return out


def rope_out(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0, rotary_dim: int | None = None,
             interleaved: bool = False, inv_freq: torch.Tensor | None = None, *, out: torch.Tensor,
             ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``rope`` into ``out`` (like x); ``out`` may be ``x`` itself (in place)."""
    device = _check_rope(x, positions, ctx)
    _checks.out("llm.rope", out, x.shape, x.dtype, x.device)
    r, cos, sin = _rope_tables(x, positions, theta, rotary_dim, inv_freq)
    params = _rope_params(r, _bool("llm.rope", "interleaved", interleaved))
    _run("llm.rope", device, x.dtype, (x, cos, sin), (out,), params, ctx)
    return out


class RoPE(PreparedOperator):
    """Prepared ``llm.rope`` with a float32 cos/sin cache [max_positions, rotary_dim / 2] built at prepare.

    Every step indexes the cache by ``positions``; ``forward_(x, positions)`` rotates in place (x may be
    a q or k view) and ``apply_(q, k, positions)`` rotates both with one cache lookup.
    """

    op = "llm.rope"

    def __init__(self, head_dim: int, rotary_dim: int | None = None, theta: float = 10000.0,
                 interleaved: bool = False, max_positions: int = 8192, inv_freq: torch.Tensor | None = None) -> None:
        _checks.positive_int(self.op, "head_dim", head_dim)
        _checks.positive_int(self.op, "max_positions", max_positions)
        r = head_dim if rotary_dim is None else rotary_dim
        _check_rotary(self.op, r, head_dim, theta)
        if inv_freq is None:
            inv_freq = rope_inv_freq(r, theta)
        elif not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != (r // 2,):
            raise ShapeError(f"{self.op}: 'inv_freq' must be a tensor of shape ({r // 2},), got "
                             f"{getattr(inv_freq, 'shape', type(inv_freq).__name__)}")
        super().__init__(_rope_params(r, _bool(self.op, "interleaved", interleaved)))
        self.head_dim, self.rotary_dim, self.max_positions = head_dim, r, max_positions
        self.inv_freq = inv_freq.detach().to(torch.float32)
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def call_facts(self, init: OperatorInitContext) -> Call:
        return Call(init.device, init.dtype, self.params.replace(head_dim=self.head_dim), None)

    def prepare(self, init: OperatorInitContext, dispatcher=None) -> RoPE:
        super().prepare(init, dispatcher)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=init.device.torch)
        freqs = pos.unsqueeze(1) * self.inv_freq.to(init.device.torch)  # [P, R/2]
        self.cos, self.sin = freqs.cos(), freqs.sin()
        return self

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None:
            self._bound()
        try:
            return self.cos[positions], self.sin[positions]
        except IndexError:
            hi = int(positions.max())
            raise ArgumentError(f"{self.op}: position {hi} is out of range for a cache of max_positions="
                                f"{self.max_positions} (expected 0..{self.max_positions - 1})") from None

    def _check(self, x: torch.Tensor, positions: torch.Tensor, ctx: RuntimeContext | None) -> None:
        self._check_like("x", x)
        _check_rope(x, positions, ctx)
        if x.shape[-1] != self.head_dim:
            raise ShapeError(f"{self.op}: x's head dim must be {self.head_dim}, got shape {tuple(x.shape)}")

    def forward_out(self, x: torch.Tensor, positions: torch.Tensor, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """x [..., T, H, D], positions [T] or [B, T] -> out (may alias x)."""
        self._check(x, positions, ctx)
        _checks.out(self.op, out, x.shape, x.dtype, x.device)
        cos, sin = self._tables(positions)
        self._run((x, cos, sin), (out,), ctx)
        return out

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward_out(x, positions, out=torch.empty_like(x))

    def forward_(self, x: torch.Tensor, positions: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
        """Rotate ``x`` in place; returns x."""
        return self.forward_out(x, positions, out=x, ctx=ctx)

    def apply_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [..., T, H, D] and k [..., T, Hkv, D] in place at the same positions; returns (q, k)."""
        self._check(q, positions, ctx)
        self._check(k, positions, ctx)
        cos, sin = self._tables(positions)
        self._run((q, cos, sin), (q,), ctx)
        self._run((k, cos, sin), (k,), ctx)
        return q, k


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


def _split_gate_up(x: torch.Tensor, up: torch.Tensor | None,
                   ctx: RuntimeContext | None) -> tuple[Device, torch.Tensor, torch.Tensor]:
    op = "llm.silu_and_mul"
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


class SiluAndMul(PreparedOperator):
    """Prepared ``llm.silu_and_mul``: ``forward(x)`` with x [..., 2I], or ``forward(gate, up)``."""

    op = "llm.silu_and_mul"

    def forward_out(self, x: torch.Tensor, up: torch.Tensor | None = None, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        self._check_like("x", x)
        _, gate, up = _split_gate_up(x, up, ctx)
        _checks.out(self.op, out, gate.shape, x.dtype, x.device)
        self._run((gate, up), (out,), ctx)
        return out

    def forward(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        shape = (*x.shape[:-1], x.shape[-1] // 2) if up is None else x.shape
        return self.forward_out(x, up, out=torch.empty(shape, dtype=x.dtype, device=x.device))


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
    "AddRMSNorm", "Embedding", "RMSNorm", "RoPE", "SiluAndMul", "add_rms_norm", "add_rms_norm_out", "embedding",
    "embedding_out", "rms_norm", "rms_norm_out", "rope", "rope_inv_freq", "rope_out", "silu_and_mul",
    "silu_and_mul_out", "softmax_last_dim", "softmax_last_dim_out",
]
