"""Attention op wrappers (flash-attn convention) and their prepared operators.

``flash_attention(q, k, v, causal=False, scale=None)``: q [B, T, H, D], k/v [B, S, Hkv, D] -> [B, T, H, D].
``flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale)``:
q [total_q, H, D], k/v [total_k, Hkv, D], cu_seqlens int32 [N+1] -> [total_q, H, D].
H must be a multiple of Hkv (GQA: query head h reads kv head h // (H / Hkv)); ``causal`` is aligned
bottom-right (query i of T sees keys j <= i + S - T); ``scale`` defaults to 1 / sqrt(D).

Conventions every provider follows (the op table checks them): with ``causal`` and T > S, a query row that
sees no key (i < T - S) gives 0, as flash-attn does; a NaN in q, k or v gives NaN in the rows it reaches (a
NaN in q[b, t, h] makes out[b, t, h] NaN), never a silent 0. Attention does not work in place: an ``out``
that overlaps q, k or v is refused with an ``ArgumentError``. cu_seqlens values are checked on cpu only
(``_checks.host_readable``); device values are trusted, validated where they are made (a step's feeds).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import FLOAT_DTYPES
from dtorch.core.errors import ArgumentError, DtorchError, ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import KernelContext, KernelParams
from dtorch.dispatch.meta import Call
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import OperatorInitContext, RuntimeContext
from dtorch.ops.graph_op import Args, R, Shapes, Strategy, declare, head_strategies
from dtorch.ops.prepared import PreparedOperator

DENSE = "llm.flash_attention"
VARLEN = "llm.flash_attention_varlen"


def _flag(op: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ArgumentError(f"{op}: {name!r} must be a bool, got {value!r}")
    return value


def _scale(op: str, scale: object, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5 if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ArgumentError(f"{op}: 'scale' must be a finite number or None (1/sqrt(D)), got {scale!r}")
    return float(scale)


@lru_cache(maxsize=256)
def _params(causal: bool, scale: float, max_q: int | None = None, max_k: int | None = None) -> KernelParams:
    if max_q is None:
        return KernelParams(causal=causal, scale=scale)
    return KernelParams(causal=causal, scale=scale, max_seqlen_q=max_q, max_seqlen_k=max_k)


def dense_params(head_dim: int, causal: object = False, scale: object = None, op: str = DENSE) -> KernelParams:
    """The owned params of a ``flash_attention`` call (or another attention ``op`` without max lengths):
    causal, and scale (default 1 / sqrt(head_dim))."""
    return _params(_flag(op, "causal", causal), _scale(op, scale, head_dim))


def varlen_params(head_dim: int, max_seqlen_q: int, max_seqlen_k: int, causal: object = False,
                  scale: object = None) -> KernelParams:
    """The owned params of a ``flash_attention_varlen`` call (checked max lengths, causal, derived scale)."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _checks.positive_int(VARLEN, name, value, minimum=0)
    return _params(_flag(VARLEN, "causal", causal), _scale(VARLEN, scale, head_dim), max_seqlen_q, max_seqlen_k)


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int,
               ctx: RuntimeContext | None) -> Device:
    """Shared checks: tensors, device, dtype, rank, k/v shapes, head dims and H % Hkv."""
    named = {"q": q, "k": k, "v": v}
    for name, t in named.items():
        _checks.tensor(op, name, t)
    device = _checks.same_device(op, named, ctx.device if ctx is not None else None)
    _checks.dtype_in(op, "q", q, FLOAT_DTYPES)
    _checks.same_dtype(op, named)
    layout = "[B, T, H, D]" if rank == 4 else "[total, H, D]"
    for name, t in named.items():
        if t.dim() != rank:
            raise ShapeError(f"{op}: {name!r} must be {layout} (rank {rank}), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ShapeError(f"{op}: 'k' and 'v' must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ShapeError(f"{op}: head dims disagree: q has D = {q.shape[-1]}, k has D = {k.shape[-1]}")
    h, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or h % hkv:
        raise ShapeError(f"{op}: q's head count H = {h} must be a multiple of k/v's head count Hkv = {hkv} (GQA)")
    return device


def _check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: RuntimeContext | None) -> Device:
    device = _check_qkv(DENSE, q, k, v, 4, ctx)
    if k.shape[0] != q.shape[0]:
        raise ShapeError(f"{DENSE}: batch sizes disagree: q has B = {q.shape[0]}, k/v have B = {k.shape[0]}")
    return device


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ bottom-right causal mask]) v: q [B, T, H, D], k/v [B, S, Hkv, D] -> [B, T, H, D]."""
    device = _check_dense(q, k, v, None)
    params = dense_params(q.shape[-1], causal, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    run(DENSE, device, q.dtype, (q, k, v), (out,), params)
    return out


def flash_attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        scale: float | None = None, *, out: torch.Tensor,
                        ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``flash_attention`` into ``out`` [B, T, H, D]."""
    device = _check_dense(q, k, v, ctx)
    params = dense_params(q.shape[-1], causal, scale)
    _checks.out(DENSE, out, q.shape, q.dtype, q.device)
    _checks.no_alias(DENSE, {"out": out}, {"q": q, "k": k, "v": v})
    run(DENSE, device, q.dtype, (q, k, v), (out,), params, *((ctx.stream, ctx.workspace) if ctx else ()))
    return out


# -- varlen ----------------------------------------------------------------------------------------

def _check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int, ctx: RuntimeContext | None) -> Device:
    op = VARLEN
    device = _check_qkv(op, q, k, v, 3, ctx)
    cus = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    for name, cu in cus.items():
        _checks.tensor(op, name, cu)
        _checks.dtype_in(op, name, cu, (torch.int32,))
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ShapeError(f"{op}: {name!r} must be [N + 1] (rank 1, at least one entry), got {tuple(cu.shape)}")
    _checks.same_device(op, {"q": q} | cus)
    if cu_q.shape != cu_k.shape:
        raise ShapeError(f"{op}: 'cu_seqlens_q' and 'cu_seqlens_k' must have the same length N + 1, got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    for name, value, t in (("max_seqlen_q", max_q, q), ("max_seqlen_k", max_k, k)):
        _checks.positive_int(op, name, value, minimum=0)
        # a loose bound is fine, but a padded kernel allocates [N, max_seqlen, heads, D]: refuse one past memory
        _checks.allocation(op, f"{name!r} {value} (the padded batch [N, {name}, heads, D])",
                           (cu_q.shape[0] - 1, value, *t.shape[1:]), t.dtype, t.device)
    if _checks.host_readable(cu_q):  # device values are trusted (validated where made)
        _check_cu_values(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)
    return device


def _check_cu_values(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, max_q: int,
                     max_k: int) -> None:
    """Starts at 0, non-decreasing, ends at the total, no segment longer than max_seqlen (one host read; cpu only)."""
    parts = [cu_q[:1], cu_q[-1:], cu_k[:1], cu_k[-1:]]
    if cu_q.shape[0] > 1:
        dq, dk = cu_q.diff(), cu_k.diff()
        parts += [dq.min().view(1), dq.max().view(1), dk.min().view(1), dk.max().view(1)]
    stats = torch.cat(parts).tolist()
    for i, (name, total, max_len, what) in enumerate((("cu_seqlens_q", total_q, max_q, "q"),
                                                     ("cu_seqlens_k", total_k, max_k, "k"))):
        first, last = stats[2 * i], stats[2 * i + 1]
        if first != 0:
            raise ArgumentError(f"{VARLEN}: {name!r} must start at 0, got {first}")
        if last != total:
            raise ArgumentError(f"{VARLEN}: {name!r} must end at {total} ({what}.shape[0]), got {last}")
        if len(stats) > 4:
            shortest, longest = stats[4 + 2 * i], stats[5 + 2 * i]
            if shortest < 0:
                raise ArgumentError(f"{VARLEN}: {name!r} must be non-decreasing, but it has a segment of length "
                                    f"{shortest}")
            if longest > max_len:
                raise ArgumentError(f"{VARLEN}: 'max_seqlen_{what}' {max_len} is less than the longest segment "
                                    f"({longest})")


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                           scale: float | None = None) -> torch.Tensor:
    """Attention over N packed segments: segment i has queries cu_seqlens_q[i]:cu_seqlens_q[i+1] of
    q [total_q, H, D] and keys/values cu_seqlens_k[i]:cu_seqlens_k[i+1] of k/v [total_k, Hkv, D].
    Returns [total_q, H, D]. A segment may have fewer queries than keys (chunked prefill, decode)."""
    device = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None)
    params = varlen_params(q.shape[-1], max_seqlen_q, max_seqlen_k, causal, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    run(VARLEN, device, q.dtype, (q, k, v, cu_seqlens_q, cu_seqlens_k), (out,), params)
    return out


def flash_attention_varlen_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               causal: bool = False, scale: float | None = None, *, out: torch.Tensor,
                               ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``flash_attention_varlen`` into ``out`` [total_q, H, D]."""
    device = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ctx)
    params = varlen_params(q.shape[-1], max_seqlen_q, max_seqlen_k, causal, scale)
    _checks.out(VARLEN, out, q.shape, q.dtype, q.device)
    _checks.no_alias(VARLEN, {"out": out}, {"q": q, "k": k, "v": v})
    run(VARLEN, device, q.dtype, (q, k, v, cu_seqlens_q, cu_seqlens_k), (out,), params,
        *((ctx.stream, ctx.workspace) if ctx else ()))
    return out


# -- prepared ----------------------------------------------------------------------------------------

class _AttentionBase(PreparedOperator):
    """Static facts shared by both attention operators: causal, scale and the head layout."""

    def __init__(self, causal: bool, scale: float | None, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        op = self.op
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            _checks.positive_int(op, name, value)
        if num_heads % num_kv_heads:
            raise ArgumentError(f"{op}: 'num_heads' {num_heads} must be a multiple of 'num_kv_heads' {num_kv_heads}")
        self.causal = _flag(op, "causal", causal)
        self.scale = _scale(op, scale, head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self._q_heads, self._kv_heads = (num_heads, head_dim), (num_kv_heads, head_dim)
        super().__init__(_params(self.causal, self.scale))

    def call_facts(self, init: OperatorInitContext) -> Call:
        facts = self.params.replace(head_dim=self.head_dim, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                    gqa_ratio=self.num_heads // self.num_kv_heads)
        return Call(init.device, init.dtype, facts, None)

    def _check_heads(self, q: torch.Tensor, k: torch.Tensor) -> None:
        if q.shape[-2:] != (self.num_heads, self.head_dim) or k.shape[-2:] != (self.num_kv_heads, self.head_dim):
            raise ShapeError(f"{self.op}: prepared for q [..., {self.num_heads}, {self.head_dim}] and k/v "
                             f"[..., {self.num_kv_heads}, {self.head_dim}], got q {tuple(q.shape)} and "
                             f"k {tuple(k.shape)}")


class Attention(_AttentionBase):
    """Prepared ``llm.flash_attention``: ``forward(q, k, v)`` with q [B, T, H, D], k/v [B, S, Hkv, D]."""

    op = DENSE

    def _validate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  ctx: RuntimeContext | None) -> None:
        self._check_like("q", q)
        _check_dense(q, k, v, ctx)
        self._check_heads(q, k)
        _checks.out(self.op, out, q.shape, q.dtype, q.device)
        _checks.no_alias(self.op, {"out": out}, {"q": q, "k": k, "v": v})

    def forward_out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        """q [B, T, H, D], k/v [B, S, Hkv, D] -> out [B, T, H, D].

        The hot path compares dtypes, ranks, head layouts, batch sizes and out's shape (what sdpa would
        broadcast or out's copy would take silently); anything else, or a kernel failure, is fully validated.
        """
        dt, dev, strided, plain = self._dtype, self._device, torch.strided, torch.Tensor
        try:
            ks = k.shape
            fast = (type(q) is plain and type(k) is plain and type(v) is plain and type(out) is plain
                    and q.dtype is dt and k.dtype is dt and v.dtype is dt and out.dtype is dt
                    and q.layout is strided and k.layout is strided and v.layout is strided and out.layout is strided
                    and q.device == dev and k.device == dev and v.device == dev and out.device == dev
                    and q.dim() == 4 and len(ks) == 4 and q.shape[2:] == self._q_heads and ks[2:] == self._kv_heads
                    and v.shape == ks and ks[0] == q.shape[0] and out.shape == q.shape
                    and out is not q and out is not k and out is not v)
        except AttributeError:  # not tensors
            fast = False
        if not fast:
            self._validate(q, k, v, out, ctx)
        try:
            self.kernel.fn(self._kctx if ctx is None else self._context(ctx), (q, k, v), (out,))
        except Exception as exc:
            if not isinstance(exc, DtorchError):
                self._validate(q, k, v, out, ctx)
            self._failed(exc)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._check_like("q", q)
        return self.forward_out(q, k, v, out=torch.empty_like(q, memory_format=torch.contiguous_format))


class AttentionVarlen(_AttentionBase):
    """Prepared ``llm.flash_attention_varlen``: ``forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)`` with q [total_q, H, D], k/v [total_k, Hkv, D]."""

    op = VARLEN

    def forward_out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, out: torch.Tensor,
                    ctx: RuntimeContext | None = None) -> torch.Tensor:
        self._check_like("q", q)
        _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ctx)
        self._check_heads(q, k)
        _checks.out(self.op, out, q.shape, q.dtype, q.device)
        _checks.no_alias(self.op, {"out": out}, {"q": q, "k": k, "v": v})
        kernel = self._bound()
        params = _params(self.causal, self.scale, max_seqlen_q, max_seqlen_k)  # per-call lengths
        base = self._context(ctx)
        kctx = KernelContext(base.device, base.stream, base.workspace, params)
        try:
            kernel(kctx, (q, k, v, cu_seqlens_q, cu_seqlens_k), (out,))
        except Exception as exc:
            self._failed(exc)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        return self.forward_out(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out=out)


# -- in a graph -------------------------------------------------------------------------------------------------

def _graph_dense(op: str, a: Args) -> KernelParams:
    return dense_params(a["q"].shape[-1], a["causal"], a["scale"], op)


def _graph_varlen(op: str, a: Args) -> KernelParams:
    return varlen_params(a["q"].shape[-1], a["max_seqlen_q"], a["max_seqlen_k"], a["causal"], a["scale"])


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # dense q [B, T, H, D], k/v [B, S, Hkv, D]; varlen q [total_q, H, D], k/v [total_k, Hkv, D], cu_q, cu_k
    q, k = shapes[0], shapes[1]
    dense = op == DENSE
    hd = 2 if dense else 1
    cus = () if dense else (R, R)
    out = [Strategy((R, R, R) + cus, R)] + head_strategies(q[hd], k[hd], n, hd, hd, cus)
    if dense:
        out.append(Strategy((Shard(0),) * 3, Shard(0)))  # batch
        if not params.causal:  # a bottom-right causal mask depends on T, so only full attention splits queries
            out.append(Strategy((Shard(1), R, R), Shard(1)))
    return out


declare(DENSE, flash_attention, ("q", "k", "v"), params=_graph_dense, rule=_rule)
declare(VARLEN, flash_attention_varlen, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), params=_graph_varlen,
        rule=_rule)

__all__ = ["Attention", "AttentionVarlen", "flash_attention", "flash_attention_out", "flash_attention_varlen",
           "flash_attention_varlen_out"]
