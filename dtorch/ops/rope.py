"""Rotary position embedding: ``rope`` / ``rope_out`` and the prepared ``RoPE`` with its cos/sin cache.

x [..., T, H, D] (or [T, H, D]) is rotated at integer positions [T] (or [B, T]); the kernel
``llm.rope`` receives the cos/sin rows already gathered for those positions (float32 [..., T, R/2]).
Re-exported by ``dtorch.ops.llm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import FLOAT_DTYPES, INT_DTYPES
from dtorch.core.errors import ArgumentError, DeviceError, DtorchError, ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import KernelParams
from dtorch.dispatch.meta import Call
from dtorch.kernels.torch.llm import rope_tables
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import OperatorInitContext, RuntimeContext
from dtorch.ops.graph_op import Args, R, Shapes, Strategy, declare
from dtorch.ops.prepared import PreparedOperator


def _device(op: str, named: dict[str, torch.Tensor], ctx: RuntimeContext | None) -> Device:
    for name, t in named.items():
        _checks.tensor(op, name, t)
    return _checks.same_device(op, named, ctx.device if ctx is not None else None)


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


def rope_frequencies(head_dim: int, theta: float, rotary_dim: int | None, inv_freq: torch.Tensor | None,
                     device: torch.device) -> tuple[int, torch.Tensor]:
    """(rotary_dim, inv_freq float32 [rotary_dim / 2] on ``device``) of a rope call, checked: ``rotary_dim``
    defaults to the head dim, ``inv_freq`` to the frequencies of ``theta``."""
    op = "llm.rope"
    r = head_dim if rotary_dim is None else rotary_dim
    _check_rotary(op, r, head_dim, theta)
    if inv_freq is None:
        return r, rope_inv_freq(r, theta).to(device)
    _checks.tensor(op, "inv_freq", inv_freq)
    _checks.dtype_in(op, "inv_freq", inv_freq, (torch.float32,))
    if inv_freq.shape != (r // 2,):
        raise ShapeError(f"{op}: 'inv_freq' must have shape ({r // 2},) (rotary_dim / 2), got {tuple(inv_freq.shape)}")
    if inv_freq.device != device:
        raise DeviceError(f"{op}: devices disagree: 'x' is on {device}, 'inv_freq' on {inv_freq.device}")
    return r, inv_freq


def _rope_tables(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int | None,
                 inv_freq: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(rotary_dim, cos, sin) with cos/sin float32 [..., T, rotary_dim / 2] for ``positions``."""
    r, inv_freq = rope_frequencies(x.shape[-1], theta, rotary_dim, inv_freq, x.device)
    return (r, *rope_tables(positions, inv_freq))


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
    if ctx is None:
        run("llm.rope", device, x.dtype, (x, cos, sin), (out,), params)
    else:
        run("llm.rope", device, x.dtype, (x, cos, sin), (out,), params, ctx.stream, ctx.workspace)
    return out


def _check_tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None,
                  ctx: RuntimeContext | None) -> tuple[Device, int]:
    op = "llm.rope"
    device = _device(op, {"x": x, "cos": cos, "sin": sin}, ctx)
    _checks.dtype_in(op, "x", x, FLOAT_DTYPES)
    if x.dim() < 3:
        raise ShapeError(f"{op}: 'x' must be [..., T, H, D] (rank >= 3), got shape {tuple(x.shape)}")
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    _check_rotary(op, r, x.shape[-1], 10000.0)
    want = (*x.shape[:-2], r // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        _checks.dtype_in(op, name, t, (torch.float32,))
        if tuple(t.shape) != want:
            raise ShapeError(f"{op}: {name!r} must be float32 {list(want)} (x's [..., T] and rotary_dim / 2), got "
                             f"{tuple(t.shape)}")
    return device, r


def rope_cached(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None,
                interleaved: bool = False, *, out: torch.Tensor | None = None,
                ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``rope`` with the cos/sin rows of x's positions already gathered (float32 [..., T, rotary_dim / 2], as
    ``RoPE.tables`` gives them): a step gathers them once and every layer rotates with them. ``out`` may be x."""
    device, r = _check_tables(x, cos, sin, rotary_dim, ctx)
    params = _rope_params(r, _bool("llm.rope", "interleaved", interleaved))
    if out is None:
        out = torch.empty_like(x)
    else:
        _checks.out("llm.rope", out, x.shape, x.dtype, x.device)
    if ctx is None:
        run("llm.rope", device, x.dtype, (x, cos, sin), (out,), params)
    else:
        run("llm.rope", device, x.dtype, (x, cos, sin), (out,), params, ctx.stream, ctx.workspace)
    return out


@dataclass(frozen=True, slots=True)
class RoPETables:
    """cos and sin float32 [..., T, R/2] that one ``RoPE`` gathered for ``positions`` ([T] or [B, T]), checked
    once: a decode step gathers them once and every layer's ``apply_`` / ``forward_`` reuses them."""

    rope: RoPE
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class RoPE(PreparedOperator):
    """Prepared ``llm.rope`` with a float32 cos/sin cache [max_positions, rotary_dim / 2] built at prepare.

    ``tables(positions)`` checks positions and gathers their cos/sin rows once (``RoPETables``);
    ``forward_(x, pos)`` rotates in place (x may be a q or k view, or both heads of a fused qkv output)
    and ``apply_(q, k, pos)`` rotates q and k; ``pos`` is a positions tensor or a ``RoPETables``.
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
        self.cos_sin: torch.Tensor | None = None  # [max_positions, 2, R/2]: one lookup gives both

    def call_facts(self, init: OperatorInitContext) -> Call:
        return Call(init.device, init.dtype, self.params.replace(head_dim=self.head_dim), None)

    def prepare(self, init: OperatorInitContext, dispatcher=None) -> RoPE:
        super().prepare(init, dispatcher)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=init.device.torch)
        freqs = pos.unsqueeze(1) * self.inv_freq.to(init.device.torch)  # [P, R/2]
        self.cos_sin = torch.stack([freqs.cos(), freqs.sin()], 1)
        return self

    def tables(self, positions: torch.Tensor, ctx: RuntimeContext | None = None) -> RoPETables:
        """Check ``positions`` (int [T] or [B, T]) and gather their cos/sin rows; on CPU (where reading values
        is free) a position outside 0..max_positions-1 raises, since indexing would wrap a negative one; device
        values are trusted (validated where they are made)."""
        if self.cos_sin is None:
            self._bound()
        op = self.op
        _checks.tensor(op, "positions", positions)
        _checks.dtype_in(op, "positions", positions, INT_DTYPES)
        _checks.rank(op, "positions", positions, 1, 2)
        if ctx is not None:
            _checks.on_device(op, "positions", positions, ctx.device)
        if positions.numel() and _checks.host_readable(positions):  # device values are trusted
            lo, hi = (int(v) for v in torch.aminmax(positions))
            if lo < 0 or hi >= self.max_positions:
                raise ArgumentError(f"{op}: position {lo if lo < 0 else hi} is out of range for a cache of "
                                    f"max_positions={self.max_positions} (expected 0..{self.max_positions - 1})")
        cs = self.cos_sin[positions]  # [..., T, 2, R/2]
        return RoPETables(self, positions, cs.select(-2, 0), cs.select(-2, 1))

    def _check(self, x: torch.Tensor, positions: torch.Tensor, ctx: RuntimeContext | None) -> None:
        self._check_like("x", x)
        _check_rope(x, positions, ctx)
        if x.shape[-1] != self.head_dim:
            raise ShapeError(f"{self.op}: x's head dim must be {self.head_dim}, got shape {tuple(x.shape)}")

    def _tables_of(self, pos: torch.Tensor | RoPETables, ctx: RuntimeContext | None) -> RoPETables:
        if type(pos) is RoPETables:
            if pos.rope is not self:
                raise ArgumentError(f"{self.op}: these RoPETables were gathered by another RoPE operator; "
                                    "pass this operator's own tables(positions) or a positions tensor")
            return pos
        return self.tables(pos, ctx)

    def _rotate_(self, x: torch.Tensor, t: RoPETables, ctx: RuntimeContext | None) -> None:
        """Rotate x in place. The hot path compares x's dtype, head dim and leading dims with the tables';
        anything else gets the full check (which raises the precise error or lets a valid broadcast pass)."""
        if (type(x) is not torch.Tensor or x.dtype is not self._dtype or x.layout is not torch.strided
                or x.device != self._device or x.shape[-1] != self.head_dim or x.shape[:-2] != t.positions.shape):
            self._check(x, t.positions, ctx)
        try:
            self.kernel.fn(self._kctx if ctx is None else self._context(ctx), (x, t.cos, t.sin), (x,))
        except Exception as exc:
            if not isinstance(exc, DtorchError):
                self._check(x, t.positions, ctx)
            self._failed(exc)

    def forward_out(self, x: torch.Tensor, positions: torch.Tensor | RoPETables, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """x [..., T, H, D], positions [T] or [B, T] (or their tables) -> out (may alias x)."""
        self._bound()
        t = self._tables_of(positions, ctx)
        if out is x:
            self._rotate_(x, t, ctx)
            return out
        self._check(x, t.positions, ctx)
        _checks.out(self.op, out, x.shape, x.dtype, x.device)
        self._run((x, t.cos, t.sin), (out,), ctx)
        return out

    def forward(self, x: torch.Tensor, positions: torch.Tensor | RoPETables) -> torch.Tensor:
        self._check_like("x", x)
        return self.forward_out(x, positions, out=torch.empty_like(x))

    def forward_(self, x: torch.Tensor, positions: torch.Tensor | RoPETables,
                 ctx: RuntimeContext | None = None) -> torch.Tensor:
        """Rotate ``x`` in place; returns x."""
        return self.forward_out(x, positions, out=x, ctx=ctx)

    def apply_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | RoPETables,
               ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [..., T, H, D] and k [..., T, Hkv, D] in place at the same positions; returns (q, k)."""
        self._bound()
        t = self._tables_of(positions, ctx)
        self._rotate_(q, t, ctx)
        self._rotate_(k, t, ctx)
        return q, k


# -- in a graph: rope(x, positions, ...) runs the kernel's positions form, which gathers cos/sin itself from an
# inv_freq param; rope_cached(x, cos, sin, ...) its table form ------------------------------------------------

def _graph_params(op: str, a: Args) -> KernelParams:
    inv = a["inv_freq"]  # a constant tensor, not an Operand: its values become the param (R/2 float32 values)
    device = inv.device if isinstance(inv, torch.Tensor) else torch.device("cpu")
    r, inv = rope_frequencies(a["x"].shape[-1], a["theta"], a["rotary_dim"], inv, device)
    return _rope_params(r, _bool(op, "interleaved", a["interleaved"])).replace(inv_freq=tuple(inv.tolist()))


def _graph_cached_params(op: str, a: Args) -> KernelParams:
    r = a["x"].shape[-1] if a["rotary_dim"] is None else a["rotary_dim"]
    _check_rotary("llm.rope", r, a["x"].shape[-1], 10000.0)
    return _rope_params(r, _bool("llm.rope", "interleaved", a["interleaved"]))


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [..., T, H, D] with positions [T] or [B, T] (positions form), or cos, sin [..., T, R/2] (table form, every
    # table input placed alike: they follow x's leading dims and never its heads)
    x, pos = shapes[0], shapes[1]
    k = len(shapes) - 1  # table inputs
    nd, t_dim = len(x), len(x) - 3
    batched = len(pos) == 2 if k == 1 else len(pos) == 3  # a batch dim in front of T
    out = [Strategy((R,) * (k + 1), R), Strategy((Shard(nd - 2),) + (R,) * k, Shard(nd - 2))]  # heads
    out += [Strategy((Shard(d),) + (Shard(0) if batched and d == 0 else R,) * k, Shard(d)) for d in range(t_dim)]
    tokens = Shard(1 if batched else 0)
    out.append(Strategy((Shard(t_dim),) + (tokens,) * k, Shard(t_dim)))  # tokens, with their positions
    return out


declare("llm.rope", rope, ("x", "positions"), params=_graph_params, rule=_rule, inplace=(("out", 0, "x"),),
        meta_args=lambda a: a | {"inv_freq": None})  # inv_freq: checked by _graph_params
declare("llm.rope_cached", rope_cached, ("x", "cos", "sin"), params=_graph_cached_params, rule=_rule,
        inplace=(("out", 0, "x"),), kernel_op=lambda op, a: "llm.rope")  # the kernel's table form

__all__ = ["RoPE", "RoPETables", "rope", "rope_cached", "rope_inv_freq", "rope_out"]
