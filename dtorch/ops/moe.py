"""Sparse mixture-of-experts wrappers: ``llm.moe_router`` (softmax top-k routing) and ``llm.moe_experts``
(the routed SwiGLU experts), as transformers' Qwen3-MoE / Qwen3-Next sparse MoE block.

A MoE layer is ``weights, ids = moe_router(x @ w_router.T, top_k, norm_topk_prob)`` then
``moe_experts(x, w_gate_up, w_down, weights, ids)``. Shapes and dtypes are checked on every device; the
expert ids' values only on cpu (``_checks.host_readable``), where reading them costs no device synchronization;
device values are trusted, validated where they are made (an id outside 0..E-1 contributes nothing).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import FLOAT_DTYPES
from dtorch.core.errors import ArgumentError, DTypeError, ShapeError
from dtorch.core.placement import Shard, shard_offsets
from dtorch.dispatch.context import NO_PARAMS, KernelParams
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, P, R, Shapes, Strategy, declare

ROUTER = "llm.moe_router"
EXPERTS = "llm.moe_experts"


def _stream(ctx: RuntimeContext | None) -> tuple:
    return () if ctx is None else (ctx.stream, ctx.workspace)


# -- moe_router ----------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _router_params(top_k: int, norm_topk_prob: bool) -> KernelParams:
    return KernelParams(top_k=top_k, norm_topk_prob=norm_topk_prob)


def router_params(logits: torch.Tensor, top_k: object, norm_topk_prob: object) -> KernelParams:
    """The router's params, after checking ``top_k`` (an int in 1..E) and ``norm_topk_prob`` (a bool)."""
    experts = logits.shape[-1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ArgumentError(f"{ROUTER}: 'top_k' must be an int in 1..{experts} (the experts of 'logits' "
                            f"{tuple(logits.shape)}), got {top_k!r}")
    if not isinstance(norm_topk_prob, bool):
        raise ArgumentError(f"{ROUTER}: 'norm_topk_prob' must be a bool, got {norm_topk_prob!r}")
    return _router_params(top_k, norm_topk_prob)


def _check_router(logits: torch.Tensor, top_k: object, norm_topk_prob: object,
                  ctx: RuntimeContext | None) -> tuple[Device, KernelParams]:
    _checks.tensor(ROUTER, "logits", logits)
    device = _checks.same_device(ROUTER, {"logits": logits}, ctx.device if ctx is not None else None)
    _checks.dtype_in(ROUTER, "logits", logits, FLOAT_DTYPES)
    _checks.rank(ROUTER, "logits", logits, 2)
    return device, router_params(logits, top_k, norm_topk_prob)


def _router_outs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (logits.shape[0], top_k)
    return (torch.empty(shape, dtype=logits.dtype, device=logits.device),
            torch.empty(shape, dtype=torch.int64, device=logits.device))


def moe_router(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: logits [T, E] -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64).

    probs = softmax(logits) in float32; the ``top_k`` largest per token (torch.topk's order, largest first);
    with ``norm_topk_prob`` the k weights are divided by their sum. As ``Qwen3MoeTopKRouter``.
    """
    device, params = _check_router(logits, top_k, norm_topk_prob, None)
    outs = _router_outs(logits, top_k)
    run(ROUTER, device, logits.dtype, (logits,), outs, params)
    return outs


def moe_router_out(logits: torch.Tensor, top_k: int, norm_topk_prob: bool = True, *, weights_out: torch.Tensor,
                   ids_out: torch.Tensor, ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_router`` into ``weights_out`` [T, top_k] (logits' dtype) and ``ids_out`` [T, top_k] int64."""
    device, params = _check_router(logits, top_k, norm_topk_prob, ctx)
    shape = (logits.shape[0], top_k)
    _checks.out(ROUTER, weights_out, shape, logits.dtype, logits.device, "weights_out")
    _checks.out(ROUTER, ids_out, shape, torch.int64, logits.device, "ids_out")
    run(ROUTER, device, logits.dtype, (logits,), (weights_out, ids_out), params, *_stream(ctx))
    return weights_out, ids_out


# -- moe_experts ---------------------------------------------------------------------------------

def _check_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, ctx: RuntimeContext | None) -> Device:
    op = EXPERTS
    named = {"x": x, "w_gate_up": w_gate_up, "w_down": w_down, "weights": weights, "ids": ids}
    for name, t in named.items():
        _checks.tensor(op, name, t)
    device = _checks.same_device(op, named, ctx.device if ctx is not None else None)
    _checks.dtype_in(op, "x", x, FLOAT_DTYPES)
    _checks.same_dtype(op, {"x": x, "w_gate_up": w_gate_up, "w_down": w_down, "weights": weights})
    if ids.dtype != torch.int64:
        raise DTypeError(f"{op}: argument 'ids' must be int64 (as moe_router returns them), got {ids.dtype}")
    _checks.rank(op, "x", x, 2)
    _checks.rank(op, "w_gate_up", w_gate_up, 3)
    _checks.rank(op, "w_down", w_down, 3)
    _checks.rank(op, "weights", weights, 2)
    t, h = x.shape
    e, i2 = w_gate_up.shape[0], w_gate_up.shape[1]
    if i2 % 2 or w_gate_up.shape[2] != h:
        raise ShapeError(f"{op}: 'w_gate_up' must have shape [E, 2I, H] with H = {h} (the last dim of 'x'), "
                         f"got {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (e, h, i2 // 2):
        raise ShapeError(f"{op}: 'w_down' must have shape [E, H, I] = {(e, h, i2 // 2)} (from 'w_gate_up' "
                         f"{tuple(w_gate_up.shape)} and 'x' {tuple(x.shape)}), got {tuple(w_down.shape)}")
    if weights.shape[0] != t:
        raise ShapeError(f"{op}: 'weights' must have shape [T, k] with T = {t} (the tokens of 'x'), "
                         f"got {tuple(weights.shape)}")
    if ids.shape != weights.shape:
        raise ShapeError(f"{op}: 'ids' must have the shape of 'weights' {tuple(weights.shape)}, got "
                         f"{tuple(ids.shape)}")
    if ids.numel() and _checks.host_readable(ids):  # device values are trusted
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= e:
            raise ArgumentError(f"{op}: 'ids' holds expert {lo if lo < 0 else hi}, out of range for "
                                f"{e} experts (expected 0..{e - 1})")
    return device


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights [T, k] (x's dtype),
    ids [T, k] int64 -> out [T, H].

    out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) with e = ids[t, j],
    gate_e = x @ w_gate_up[e, :I].T, up_e = x @ w_gate_up[e, I:].T, down_e = h @ w_down[e].T: the layout of
    transformers' ``Qwen3MoeExperts`` (``gate_up_proj``, ``down_proj``).
    """
    device = _check_experts(x, w_gate_up, w_down, weights, ids, None)
    out = torch.empty_like(x)
    run(EXPERTS, device, x.dtype, (x, w_gate_up, w_down, weights, ids), (out,), NO_PARAMS)
    return out


def moe_experts_out(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, *, out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``moe_experts`` into ``out`` [T, H]."""
    device = _check_experts(x, w_gate_up, w_down, weights, ids, ctx)
    _checks.out(EXPERTS, out, x.shape, x.dtype, x.device)
    run(EXPERTS, device, x.dtype, (x, w_gate_up, w_down, weights, ids), (out,), NO_PARAMS, *_stream(ctx))
    return out


# -- in a graph -------------------------------------------------------------------------------------------------

def _graph_router_params(op: str, a: Args) -> KernelParams:
    return router_params(a["logits"], a["top_k"], a["norm_topk_prob"])


def _router_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # logits [T, E] -> (weights [T, k], ids [T, k]): every token routed alone
    return [Strategy((R,), (R, R)), Strategy((Shard(0),), (Shard(0), Shard(0)))]


def _experts_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], weights [T, k], ids [T, k] -> [T, H]
    experts, i2 = shapes[1][0], shapes[1][1]

    def expert_start(p: KernelParams, rank: int, n: int) -> KernelParams:
        return p.replace(expert_start=shard_offsets(experts, n)[rank])

    return [Strategy((R,) * 5, R),
            Strategy((Shard(0), R, R, Shard(0), Shard(0)), Shard(0)),  # tokens
            # expert parallel: each device runs the pairs routed to its experts; the sum over devices is whole
            Strategy((R, Shard(0), Shard(0), R, R), P, expert_start),
            # tensor parallel: each device its features of every expert, [gate_r | up_r] (blocked, as the fused
            # silu_and_mul) and the matching columns of down: partial sums
            Strategy((R, Shard(1, (i2 // 2, i2 // 2)), Shard(2), R, R), P)]


declare(ROUTER, moe_router, ("logits",), params=_graph_router_params, rule=_router_rule, outputs=2,
        result=lambda r, a: tuple(r))  # (weights, ids)
declare(EXPERTS, moe_experts, ("x", "w_gate_up", "w_down", "weights", "ids"), rule=_experts_rule)

__all__ = ["moe_experts", "moe_experts_out", "moe_router", "moe_router_out"]
