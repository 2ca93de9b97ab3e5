"""Gated delta rule wrappers (``llm.gated_delta_net``) and the prepared ``GatedDeltaNet``.

Layout and conventions follow flash-linear-attention's ``chunk_gated_delta_rule``: q, k [B, T, Hk, K],
v [B, T, H, V] (H a multiple of Hk), g (log-space decay) and beta [B, T, H], state [N, H, K, V]. The final
state is float32 (float64 for float64 inputs) whatever the input dtype. ``mode="chunked"`` (default) runs the
chunked provider, ``mode="recurrent"`` the per-step reference; both give the same result.

State pools (a serving engine's cache slots, vLLM's ``ssm_state_indices``): with ``state_indices`` [N],
``initial_state`` is a pool [S, H, K, V] of the state dtype, sequence n starts from row state_indices[n] and its
final state goes back to that row; other rows are untouched. ``gated_delta_net_out(..., final_state_out=pool)``
advances the pool in place; ``gated_delta_net`` returns an updated copy of it. Padding sequences may share one
scratch row (which of them lands there is unspecified). Index and cu_seqlens values are checked on cpu only
(``_checks.host_readable``); device values are trusted, validated where they are made.
"""

from __future__ import annotations

import math

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import dtype_name
from dtorch.core.errors import ArgumentError, DTypeError, ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import KernelParams
from dtorch.kernels.torch.registry import FLOATS
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, R, Shapes, Strategy, declare, heads_split, opt, pair_result, same
from dtorch.ops.prepared import PreparedOperator

OP = "llm.gated_delta_net"
MODES = ("recurrent", "chunked")
_SEQLEN_DTYPES = (torch.int32, torch.int64)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the recurrent state for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _params(scale: float | None, use_qk_l2norm: bool, mode: str, chunk_size: int) -> KernelParams:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ArgumentError(f"{OP}: 'scale' must be None or a finite number, got {scale!r}")
    if not isinstance(use_qk_l2norm, bool):
        raise ArgumentError(f"{OP}: 'use_qk_l2norm' must be a bool, got {use_qk_l2norm!r}")
    if mode not in MODES:
        raise ArgumentError(f"{OP}: 'mode' must be one of {MODES}, got {mode!r}")
    _checks.positive_int(OP, "chunk_size", chunk_size)
    return KernelParams(scale=None if scale is None else float(scale), use_qk_l2norm=use_qk_l2norm, mode=mode,
                        chunk_size=chunk_size)


def _shape(name: str, t: torch.Tensor, want: tuple[int, ...], letters: str) -> None:
    if tuple(t.shape) != want:
        raise ShapeError(f"{OP}: argument {name!r} must have shape [{letters}] = {list(want)}, got {list(t.shape)}")


def _check_cu_seqlens(cu: torch.Tensor, b: int, t: int) -> int:
    """Validates cu_seqlens [N + 1] (values only on real devices); returns N."""
    _checks.tensor(OP, "cu_seqlens", cu)
    _checks.rank(OP, "cu_seqlens", cu, 1)
    if cu.dtype not in _SEQLEN_DTYPES:
        raise DTypeError(f"{OP}: 'cu_seqlens' must be int32 or int64, got {dtype_name(cu.dtype)}")
    if cu.shape[0] < 2:
        raise ShapeError(f"{OP}: 'cu_seqlens' must hold N + 1 >= 2 offsets, got shape {list(cu.shape)}")
    if b != 1:
        raise ShapeError(f"{OP}: with 'cu_seqlens' the sequences are packed along T, so B must be 1, got B={b}")
    if _checks.host_readable(cu):  # device values are trusted (validated where made)
        vals = cu.tolist()
        if vals[0] != 0 or vals[-1] != t or any(a > c for a, c in zip(vals[:-1], vals[1:], strict=True)):
            shown = vals if len(vals) <= 12 else vals[:6] + ["..."] + vals[-3:]
            raise ArgumentError(f"{OP}: 'cu_seqlens' must start at 0, never decrease and end at T={t}, "
                                f"got {shown}")
    return cu.shape[0] - 1


def _check_pool(pool: torch.Tensor | None, indices: torch.Tensor, n: int, h: int, kd: int, vd: int,
                q: torch.Tensor) -> tuple[int, ...]:
    """initial_state is a pool [S, H, K, V] of the state dtype; state_indices [N] int names rows of it."""
    if pool is None:
        raise ArgumentError(f"{OP}: 'state_indices' needs 'initial_state', the pool [S, H, K, V] its rows index")
    _checks.tensor(OP, "initial_state", pool)
    _checks.tensor(OP, "state_indices", indices)
    _checks.rank(OP, "state_indices", indices, 1)
    if indices.dtype not in _SEQLEN_DTYPES:
        raise DTypeError(f"{OP}: 'state_indices' must be int32 or int64, got {dtype_name(indices.dtype)}")
    _shape("state_indices", indices, (n,), "N")
    _checks.rank(OP, "initial_state", pool, 4)
    if pool.shape[0] < 1 or tuple(pool.shape[1:]) != (h, kd, vd):
        raise ShapeError(f"{OP}: with 'state_indices', 'initial_state' must be a pool [S, H, K, V] = "
                         f"[S >= 1, {h}, {kd}, {vd}], got {list(pool.shape)}")
    if pool.dtype != state_dtype(q.dtype):
        raise DTypeError(f"{OP}: with 'state_indices', 'initial_state' (the pool, written back) must have the state "
                         f"dtype {dtype_name(state_dtype(q.dtype))}, got {dtype_name(pool.dtype)}")
    if n and _checks.host_readable(indices):
        lo, hi = indices.aminmax()
        if lo < 0 or hi >= pool.shape[0]:
            raise ArgumentError(f"{OP}: 'state_indices' must lie in [0, S={pool.shape[0]}), got values "
                                f"{int(lo)}..{int(hi)}")
    return tuple(pool.shape)


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, device: Device | None,
              state_indices=None) -> tuple[Device, tuple]:
    """Checks every argument; returns the device and the final state's shape: (N, H, K, V), or the pool's."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _checks.tensor(OP, name, t)
    _checks.rank(OP, "q", q, 4)
    b, t, hk, kd = q.shape
    _shape("k", k, (b, t, hk, kd), "B, T, Hk, K")
    _checks.rank(OP, "v", v, 4)
    h, vd = v.shape[2], v.shape[3]
    _shape("v", v, (b, t, h, vd), "B, T, H, V")
    if hk == 0 or h % hk:
        raise ShapeError(f"{OP}: value heads H={h} must be a multiple of q/k heads Hk={hk}")
    _shape("g", g, (b, t, h), "B, T, H")
    _shape("beta", beta, (b, t, h), "B, T, H")
    _checks.dtype_in(OP, "q", q, FLOATS)
    _checks.same_dtype(OP, {"q": q, "k": k, "v": v})
    _checks.dtype_in(OP, "g", g, FLOATS)
    _checks.dtype_in(OP, "beta", beta, FLOATS)
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    n = b if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, b, t)
    if cu_seqlens is not None:
        named["cu_seqlens"] = cu_seqlens
    if state_indices is not None:
        state_shape = _check_pool(initial_state, state_indices, n, h, kd, vd, q)
        named |= {"initial_state": initial_state, "state_indices": state_indices}
        return _checks.same_device(OP, named, device), state_shape
    if initial_state is not None:
        _checks.tensor(OP, "initial_state", initial_state)
        _shape("initial_state", initial_state, (n, h, kd, vd), "N, H, K, V" if cu_seqlens is not None else "B, H, K, V")
        _checks.dtype_in(OP, "initial_state", initial_state, FLOATS)
        named["initial_state"] = initial_state
    return _checks.same_device(OP, named, device), (n, h, kd, vd)


def _state_out(final: object, shape: tuple, q: torch.Tensor) -> torch.Tensor | None:
    """``final_state_out`` must be None or a [N, H, K, V] tensor of the state dtype on q's device."""
    if final is None:
        return None
    return _checks.out(OP, final, shape, state_dtype(q.dtype), q.device, "final_state_out")


def gated_delta_net(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    scale: float | None = None, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = True, use_qk_l2norm: bool = False,
                    cu_seqlens: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                    mode: str = "chunked", chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a sequence (or packed sequences with ``cu_seqlens``).

    q, k [B, T, Hk, K]; v [B, T, H, V]; g, beta [B, T, H]; initial_state [N, H, K, V] (N = B, or the number
    of segments); cu_seqlens int [N + 1] with B == 1; state_indices int [N]: initial_state is then a pool
    [S, H, K, V] (see the module doc). Returns (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] float32 —
    float64 for float64 inputs — or, with state_indices, a new pool [S, H, K, V] with the named rows advanced;
    None when ``output_final_state`` is False).
    """
    params = _params(scale, use_qk_l2norm, mode, chunk_size)
    device, state_shape = _validate(q, k, v, g, beta, initial_state, cu_seqlens, None, state_indices)
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    final = torch.empty(state_shape, dtype=state_dtype(q.dtype), device=q.device) if output_final_state else None
    run(OP, device, q.dtype, (q, k, v, g, beta, initial_state, cu_seqlens, state_indices),
        (o,) if final is None else (o, final), params)
    return o, final


def gated_delta_net_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float | None = None, initial_state: torch.Tensor | None = None,
                        use_qk_l2norm: bool = False, cu_seqlens: torch.Tensor | None = None,
                        state_indices: torch.Tensor | None = None, mode: str = "chunked", chunk_size: int = 64, *,
                        out: torch.Tensor, final_state_out: torch.Tensor | None = None,
                        ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gated_delta_net`` into ``out`` [B, T, H, V] and, when given, ``final_state_out`` [N, H, K, V] (with
    ``state_indices``: the pool's shape [S, H, K, V]).

    ``final_state_out`` may be ``initial_state`` itself: the state (or the pool's named rows) is then advanced
    in place.
    """
    params = _params(scale, use_qk_l2norm, mode, chunk_size)
    device = ctx.device if ctx is not None else None
    device, state_shape = _validate(q, k, v, g, beta, initial_state, cu_seqlens, device, state_indices)
    _checks.out(OP, out, v.shape, q.dtype, q.device)
    final = _state_out(final_state_out, state_shape, q)
    run(OP, device, q.dtype, (q, k, v, g, beta, initial_state, cu_seqlens, state_indices),
        (out,) if final is None else (out, final), params, ctx.stream if ctx is not None else None,
        ctx.workspace if ctx is not None else None)
    return out, final


class GatedDeltaNet(PreparedOperator):
    """Prepared ``llm.gated_delta_net``: options fixed at construction, the provider chosen once at prepare.

    ``op = GatedDeltaNet(use_qk_l2norm=True).prepare(OperatorInitContext("cpu", torch.bfloat16))``;
    ``o, state = op.forward(q, k, v, g, beta, initial_state)`` (shapes as ``gated_delta_net``).
    """

    op = OP

    def __init__(self, scale: float | None = None, use_qk_l2norm: bool = False, mode: str = "chunked",
                 chunk_size: int = 64, output_final_state: bool = True) -> None:
        if not isinstance(output_final_state, bool):
            raise ArgumentError(f"{OP}: 'output_final_state' must be a bool, got {output_final_state!r}")
        super().__init__(_params(scale, use_qk_l2norm, mode, chunk_size))
        self.output_final_state = output_final_state

    def forward_out(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                    state_indices: torch.Tensor | None = None, *, out: torch.Tensor,
                    final_state_out: torch.Tensor | None = None,
                    ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Into ``out`` [B, T, H, V] and ``final_state_out`` [N, H, K, V] (may be ``initial_state``; with
        ``state_indices`` the pool [S, H, K, V] itself, advanced in place)."""
        self._check_like("q", q)
        device = ctx.device if ctx is not None else None
        _, state_shape = _validate(q, k, v, g, beta, initial_state, cu_seqlens, device, state_indices)
        _checks.out(OP, out, v.shape, q.dtype, q.device)
        final = _state_out(final_state_out, state_shape, q)
        self._run((q, k, v, g, beta, initial_state, cu_seqlens, state_indices),
                  (out,) if final is None else (out, final), ctx)
        return out, final

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                state_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (o [B, T, H, V], final_state [N, H, K, V] — with ``state_indices`` an updated copy of the pool —
        or None when built with output_final_state=False)."""
        self._check_like("q", q)
        _, state_shape = _validate(q, k, v, g, beta, initial_state, cu_seqlens, None, state_indices)
        o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
        final = (torch.empty(state_shape, dtype=state_dtype(q.dtype), device=q.device)
                 if self.output_final_state else None)
        self._run((q, k, v, g, beta, initial_state, cu_seqlens, state_indices),
                  (o,) if final is None else (o, final), None)
        return o, final


# -- in a graph -------------------------------------------------------------------------------------------------

def _graph_params(op: str, a: Args) -> KernelParams:
    return _params(a["scale"], a["use_qk_l2norm"], a["mode"], a["chunk_size"])


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # q, k [B, T, Hk, K]; v [B, T, H, V]; g, beta [B, T, H]; state [N, H, K, V]? (with state_indices [N]: a pool
    # [S, H, K, V]); cu_seqlens [N + 1]? -> (o [B, T, H, V], final state [N or S, H, K, V])
    q, v, state, cu, idx = shapes[0], shapes[2], shapes[5], shapes[6], shapes[7] if len(shapes) > 7 else None
    ints = (opt(cu, R),) + ((opt(idx, R),) if len(shapes) > 7 else ())
    out = [Strategy(same(shapes, R), (R, R))]
    if heads_split(v[2], q[2], n):
        out.append(Strategy((Shard(2),) * 5 + (opt(state, Shard(1)),) + ints, (Shard(2), Shard(1))))
    if cu is None and idx is None:  # packed sequences (cu_seqlens) have B == 1; a pool's rows are not the batch
        out.append(Strategy((Shard(0),) * 5 + (opt(state, Shard(0)),) + (None,) * len(ints), (Shard(0), Shard(0))))
    return out


declare(OP, gated_delta_net, ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "state_indices"),
        params=_graph_params, rule=_rule, outputs=lambda a: 2 if a["output_final_state"] else 1, result=pair_result,
        inplace=(("final_state_out", 1, "initial_state"),))

__all__ = ["GatedDeltaNet", "gated_delta_net", "gated_delta_net_out"]
