"""The gates of Gated DeltaNet's delta rule (``llm.gdn_gates``), as transformers' Qwen3NextGatedDeltaNet makes them.

From the per-token projections a, b [T, H] and the per-head parameters A_log, dt_bias [H]:
``g = -exp(A_log) * softplus(a + dt_bias)`` (log-space decay, float32) and ``beta = sigmoid(b)`` (b's dtype),
the g and beta inputs of ``llm.gated_delta_net``.
"""

from __future__ import annotations

import torch

from dtorch.core.device import Device
from dtorch.core.errors import ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import KernelParams
from dtorch.kernels.torch.registry import FLOATS
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import R, Shapes, Strategy, declare

OP = "llm.gdn_gates"


def _shape(name: str, t: torch.Tensor, want: tuple[int, ...], letters: str) -> None:
    if tuple(t.shape) != want:
        raise ShapeError(f"{OP}: argument {name!r} must have shape [{letters}] = {list(want)}, got {list(t.shape)}")


def _validate(a, b, a_log, dt_bias, device: Device | None) -> Device:
    named = {"a": a, "b": b, "A_log": a_log, "dt_bias": dt_bias}
    for name, t in named.items():
        _checks.tensor(OP, name, t)
    _checks.rank(OP, "a", a, 2)
    _shape("b", b, tuple(a.shape), "T, H")
    for name in ("A_log", "dt_bias"):
        _shape(name, named[name], (a.shape[1],), "H")
        _checks.dtype_in(OP, name, named[name], FLOATS)
    _checks.dtype_in(OP, "a", a, FLOATS)
    _checks.same_dtype(OP, {"a": a, "b": b})
    return _checks.same_device(OP, named, device)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,  # noqa: N803 (transformers' name)
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, H] (one float dtype); A_log, dt_bias [H] (any float dtype).

    Returns (g [T, H] float32 = -exp(A_log) * softplus(a + dt_bias), beta [T, H] = sigmoid(b) in b's dtype).
    """
    _checks.tensor(OP, "a", a)
    _checks.tensor(OP, "b", b)
    return gdn_gates_out(a, b, A_log, dt_bias, g_out=torch.empty(a.shape, dtype=torch.float32, device=a.device),
                         beta_out=torch.empty(b.shape, dtype=b.dtype, device=b.device))


def gdn_gates_out(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,  # noqa: N803
                  *, g_out: torch.Tensor, beta_out: torch.Tensor,
                  ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdn_gates`` into ``g_out`` [T, H] float32 and ``beta_out`` [T, H] (b's dtype)."""
    device = _validate(a, b, A_log, dt_bias, ctx.device if ctx is not None else None)
    _checks.out(OP, g_out, a.shape, torch.float32, a.device, "g_out")
    _checks.out(OP, beta_out, b.shape, b.dtype, b.device, "beta_out")
    run(OP, device, a.dtype, (a, b, A_log, dt_bias), (g_out, beta_out), stream=ctx.stream if ctx is not None else None,
        workspace=ctx.workspace if ctx is not None else None)
    return g_out, beta_out


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # a, b [T, H], A_log [H], dt_bias [H] -> (g [T, H], beta [T, H]): per token and head
    return [Strategy((R,) * 4, (R, R)), Strategy((Shard(0), Shard(0), R, R), (Shard(0), Shard(0))),
            Strategy((Shard(1), Shard(1), Shard(0), Shard(0)), (Shard(1), Shard(1)))]


declare(OP, gdn_gates, ("a", "b", "A_log", "dt_bias"), rule=_rule, outputs=2, result=lambda r, a: tuple(r))

__all__ = ["gdn_gates", "gdn_gates_out"]
