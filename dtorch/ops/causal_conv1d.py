"""Causal depthwise conv1d wrappers (``llm.causal_conv1d``, ``llm.causal_conv1d_update``) and ``CausalConv1d``.

Conventions follow Dao-AILab's ``causal_conv1d_fn`` / ``causal_conv1d_update``: x is channels-first [B, D, L],
weight [D, W]; ``activation`` is None, "silu" or "swish" (the same function). The update step's conv_state
keeps the last S >= W - 1 inputs (Qwen3-Next allocates S = W) and is shifted in place.

For a serving engine's state pools (vLLM's ``conv_state_indices``): the update step with ``state_indices`` [B]
advances pool rows instead of a [B, D, S] state, and ``causal_conv1d_varlen`` runs sequences packed along T
(token-major x [T, D], ``cu_seqlens``) from and into pool rows. Index and cu_seqlens values are checked on cpu only
(``_checks.host_readable``); device values are trusted, validated where they are made.
"""

from __future__ import annotations

import torch

from dtorch.core.device import Device
from dtorch.core.errors import ArgumentError, ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from dtorch.dispatch.prepared import PreparedKernel
from dtorch.dispatch.registry import Dispatcher
from dtorch.kernels.torch.registry import FLOATS
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.context import OperatorInitContext, RuntimeContext
from dtorch.ops.graph_op import Args, R, Shapes, Strategy, declare, opt, pair_result, same
from dtorch.ops.prepared import PreparedOperator

OP = "llm.causal_conv1d"
OP_UPDATE = "llm.causal_conv1d_update"
OP_VARLEN = "llm.causal_conv1d_varlen"
_INTS = (torch.int32, torch.int64)
_ACTIVATIONS = {None: None, "silu": "silu", "swish": "silu"}
_PARAMS = {a: KernelParams(activation=a) for a in (None, "silu")}


def _params(op: str, activation: str | None) -> KernelParams:
    if not isinstance(activation, (str, type(None))) or activation not in _ACTIVATIONS:
        raise ArgumentError(f"{op}: 'activation' must be None, 'silu' or 'swish', got {activation!r}")
    return _PARAMS[_ACTIVATIONS[activation]]


def _weights(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Checks weight [D, W] and bias [D] against x [B, D, ...]; returns W."""
    _checks.tensor(op, "weight", weight)
    _checks.rank(op, "weight", weight, 2)
    _checks.dim_eq(op, f"weight.shape[0] (channels of x {tuple(x.shape)})", weight.shape[0], x.shape[1])
    if weight.shape[1] < 1:
        raise ShapeError(f"{op}: weight width must be >= 1, got weight shape {tuple(weight.shape)}")
    named = {"x": x, "weight": weight}
    if bias is not None:
        _checks.tensor(op, "bias", bias)
        _checks.rank(op, "bias", bias, 1)
        _checks.dim_eq(op, "bias.shape[0]", bias.shape[0], x.shape[1])
        named["bias"] = bias
    _checks.dtype_in(op, "x", x, FLOATS)
    _checks.same_dtype(op, named)
    return weight.shape[1]


def _validate(x, weight, bias, initial_states, device: Device | None) -> Device:
    _checks.tensor(OP, "x", x)
    _checks.rank(OP, "x", x, 3)
    width = _weights(OP, x, weight, bias)
    named = {"x": x, "weight": weight} | ({"bias": bias} if bias is not None else {})
    if initial_states is not None:
        _checks.tensor(OP, "initial_states", initial_states)
        want = (x.shape[0], x.shape[1], width - 1)
        if tuple(initial_states.shape) != want:
            raise ShapeError(f"{OP}: 'initial_states' must have shape [B, D, W-1] = {want}, "
                             f"got {tuple(initial_states.shape)}")
        named["initial_states"] = initial_states
        _checks.same_dtype(OP, named)
    return _checks.same_device(OP, named, device)


def _check_indices(op: str, indices: object, n: int, rows: int) -> None:
    """state_indices [n] int32/int64, each in [0, rows) (values checked on cpu only; device values are trusted)."""
    _checks.tensor(op, "state_indices", indices)
    _checks.rank(op, "state_indices", indices, 1)
    _checks.dtype_in(op, "state_indices", indices, _INTS)
    if indices.shape[0] != n:
        raise ShapeError(f"{op}: 'state_indices' must have shape [{n}] (one per sequence), got {list(indices.shape)}")
    if n and _checks.host_readable(indices):
        lo, hi = indices.aminmax()
        if lo < 0 or hi >= rows:
            raise ArgumentError(f"{op}: 'state_indices' must lie in [0, {rows}) (the pool's rows), got values "
                                f"{int(lo)}..{int(hi)}")


def _check_pool(op: str, name: str, pool: object, d: int, width: int, batch: int | None) -> None:
    """A state [batch, D, S >= W - 1], or (batch None) a pool [P >= 1, D, S >= W - 1]."""
    _checks.tensor(op, name, pool)
    _checks.rank(op, name, pool, 3)
    lead = pool.shape[0] == batch if batch is not None else pool.shape[0] >= 1
    if not lead or pool.shape[1] != d or pool.shape[2] < width - 1:
        rows = f"B = {batch}" if batch is not None else "P >= 1 pool rows"
        raise ShapeError(f"{op}: {name!r} must have shape [{'B' if batch is not None else 'P'}, D, S] with {rows}, "
                         f"D = {d}, S >= W - 1 = {width - 1}, got {tuple(pool.shape)}")


def _validate_update(x, conv_state, weight, bias, device: Device | None, state_indices=None) -> Device:
    _checks.tensor(OP_UPDATE, "x", x)
    _checks.rank(OP_UPDATE, "x", x, 2, 3)
    width = _weights(OP_UPDATE, x, weight, bias)
    _check_pool(OP_UPDATE, "conv_state", conv_state, x.shape[1], width, None if state_indices is not None
                else x.shape[0])
    named = {"x": x, "conv_state": conv_state, "weight": weight} | ({"bias": bias} if bias is not None else {})
    _checks.same_dtype(OP_UPDATE, named)
    if state_indices is not None:
        _check_indices(OP_UPDATE, state_indices, x.shape[0], conv_state.shape[0])
        named["state_indices"] = state_indices
    return _checks.same_device(OP_UPDATE, named, device)


def _validate_varlen(x, weight, bias, conv_states, cu_seqlens, state_indices, device: Device | None) -> Device:
    _checks.tensor(OP_VARLEN, "x", x)
    _checks.rank(OP_VARLEN, "x", x, 2)
    width = _weights(OP_VARLEN, x, weight, bias)  # x [T, D]: channels are dim 1, as in [B, D, L]
    _check_pool(OP_VARLEN, "conv_states", conv_states, x.shape[1], width, None)
    _checks.tensor(OP_VARLEN, "cu_seqlens", cu_seqlens)
    _checks.rank(OP_VARLEN, "cu_seqlens", cu_seqlens, 1)
    _checks.dtype_in(OP_VARLEN, "cu_seqlens", cu_seqlens, _INTS)
    if cu_seqlens.shape[0] < 2:
        raise ShapeError(f"{OP_VARLEN}: 'cu_seqlens' must hold N + 1 >= 2 offsets, got shape "
                         f"{list(cu_seqlens.shape)}")
    if _checks.host_readable(cu_seqlens):  # device values are trusted (validated where made)
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != x.shape[0] or any(a > b for a, b in zip(cu[:-1], cu[1:], strict=True)):
            raise ArgumentError(f"{OP_VARLEN}: 'cu_seqlens' must start at 0, never decrease and end at "
                                f"T={x.shape[0]}, got {cu if len(cu) <= 12 else cu[:6] + ['...'] + cu[-3:]}")
    _check_indices(OP_VARLEN, state_indices, cu_seqlens.shape[0] - 1, conv_states.shape[0])
    named = {"x": x, "weight": weight, "conv_states": conv_states} | ({"bias": bias} if bias is not None else {})
    _checks.same_dtype(OP_VARLEN, named)
    named |= {"cu_seqlens": cu_seqlens, "state_indices": state_indices}
    return _checks.same_device(OP_VARLEN, named, device)


def _final_out(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.empty(x.shape[0], x.shape[1], width - 1, dtype=x.dtype, device=x.device)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  initial_states: torch.Tensor | None = None, return_final_states: bool = False,
                  activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv: x [B, D, L], weight [D, W], bias [D], initial_states [B, D, W-1] (default zeros).

    Returns (out [B, D, L], final_states [B, D, W-1] — the last W-1 inputs — or None unless requested).
    """
    params = _params(OP, activation)
    device = _validate(x, weight, bias, initial_states, None)
    out = torch.empty_like(x)
    final = _final_out(x, weight.shape[1]) if return_final_states else None
    run(OP, device, x.dtype, (x, weight, bias, initial_states), (out,) if final is None else (out, final), params)
    return out, final


def causal_conv1d_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      initial_states: torch.Tensor | None = None, activation: str | None = None, *,
                      out: torch.Tensor, final_states_out: torch.Tensor | None = None,
                      ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``causal_conv1d`` into ``out`` [B, D, L] (and ``final_states_out`` [B, D, W-1] when given)."""
    params = _params(OP, activation)
    device = _validate(x, weight, bias, initial_states, ctx.device if ctx is not None else None)
    outs = _outs(OP, x, weight.shape[1], out, final_states_out)
    run(OP, device, x.dtype, (x, weight, bias, initial_states), outs, params,
        ctx.stream if ctx is not None else None, ctx.workspace if ctx is not None else None)
    return out, final_states_out


def _outs(op: str, x: torch.Tensor, width: int, out: torch.Tensor, final: torch.Tensor | None) -> tuple:
    _checks.out(op, out, x.shape, x.dtype, x.device)
    if final is None:
        return (out,)
    _checks.out(op, final, (x.shape[0], x.shape[1], width - 1), x.dtype, x.device, "final_states_out")
    return (out, final)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None,
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step: x [B, D] or [B, D, L]; conv_state [B, D, S >= W-1] is shifted in place (with
    ``state_indices`` [B]: a pool [P, D, S] whose row state_indices[b] batch row b reads and advances).

    Returns out shaped like x: the conv of (conv_state's last W-1 inputs, then x).
    """
    _checks.tensor(OP_UPDATE, "x", x)
    return causal_conv1d_update_out(x, conv_state, weight, bias, activation, state_indices, out=torch.empty_like(x))


def causal_conv1d_update_out(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, activation: str | None = None,
                             state_indices: torch.Tensor | None = None, *, out: torch.Tensor,
                             ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``causal_conv1d_update`` into ``out`` (shaped like x); conv_state (or its named pool rows) is updated in
    place."""
    params = _params(OP_UPDATE, activation)
    device = _validate_update(x, conv_state, weight, bias, ctx.device if ctx is not None else None, state_indices)
    _checks.out(OP_UPDATE, out, x.shape, x.dtype, x.device)
    x3, out3 = (x.unsqueeze(-1), out.unsqueeze(-1)) if x.dim() == 2 else (x, out)
    run(OP_UPDATE, device, x.dtype, (x3, weight, bias, conv_state, state_indices), (out3, conv_state), params,
        ctx.stream if ctx is not None else None, ctx.workspace if ctx is not None else None)
    return out


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                         state_indices: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None) -> torch.Tensor:
    """Causal conv over sequences packed along T, each starting from and advancing a row of a state pool.

    x [T, D] token-major (a column view of a wider tensor is fine); weight [D, W]; conv_states [P, D, S >= W-1],
    x's dtype, updated in place; cu_seqlens int [N + 1] (segment n is tokens cu[n]:cu[n+1]); state_indices int
    [N]: segment n is preceded by the last W-1 columns of pool row state_indices[n], which then holds the last S
    inputs (an empty segment leaves it untouched); bias [D] or None. Returns out [T, D] in x's dtype.
    """
    _checks.tensor(OP_VARLEN, "x", x)
    return causal_conv1d_varlen_out(x, weight, conv_states, cu_seqlens, state_indices, bias, activation,
                                    out=torch.empty(x.shape, dtype=x.dtype, device=x.device))


def causal_conv1d_varlen_out(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                             cu_seqlens: torch.Tensor, state_indices: torch.Tensor, bias: torch.Tensor | None = None,
                             activation: str | None = None, *, out: torch.Tensor,
                             ctx: RuntimeContext | None = None) -> torch.Tensor:
    """``causal_conv1d_varlen`` into ``out`` [T, D]; conv_states is updated in place."""
    params = _params(OP_VARLEN, activation)
    device = _validate_varlen(x, weight, bias, conv_states, cu_seqlens, state_indices,
                              ctx.device if ctx is not None else None)
    _checks.out(OP_VARLEN, out, x.shape, x.dtype, x.device)
    run(OP_VARLEN, device, x.dtype, (x, weight, bias, conv_states, cu_seqlens, state_indices), (out, conv_states),
        params, ctx.stream if ctx is not None else None, ctx.workspace if ctx is not None else None)
    return out


class CausalConv1d(PreparedOperator):
    """Prepared ``llm.causal_conv1d`` for one activation, with the decode step ``update`` bound beside it.

    ``op = CausalConv1d(activation="silu").prepare(OperatorInitContext("cpu", torch.bfloat16))``;
    ``out, final = op.forward(x, weight, bias, initial_states, return_final_states=True)``; then per token
    ``op.update(x_t, conv_state, weight, bias)``.
    """

    op = OP

    def __init__(self, activation: str | None = None) -> None:
        super().__init__(_params(f"{OP} (CausalConv1d)", activation))
        self.update_kernel: PreparedKernel | None = None

    def prepare(self, init: OperatorInitContext, dispatcher: Dispatcher | None = None) -> CausalConv1d:
        super().prepare(init, dispatcher)
        key = KernelKey(OP_UPDATE, init.device.type, init.dtype, init.layout)
        self.update_kernel = PreparedKernel(self.kernel.dispatcher, key, Call(init.device, init.dtype, self.params))
        return self

    def forward_out(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    initial_states: torch.Tensor | None = None, *, out: torch.Tensor,
                    final_states_out: torch.Tensor | None = None,
                    ctx: RuntimeContext | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_like("x", x)
        _validate(x, weight, bias, initial_states, ctx.device if ctx is not None else None)
        outs = _outs(OP, x, weight.shape[1], out, final_states_out)
        self._run((x, weight, bias, initial_states), outs, ctx)
        return out, final_states_out

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                initial_states: torch.Tensor | None = None,
                return_final_states: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, D, L] -> (out [B, D, L], final_states [B, D, W-1] or None)."""
        self._check_like("x", x)
        _validate(x, weight, bias, initial_states, None)
        out = torch.empty_like(x)
        outs = (out, _final_out(x, weight.shape[1])) if return_final_states else (out,)
        self._run((x, weight, bias, initial_states), outs, None)
        return out, outs[1] if return_final_states else None

    def update_out(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None, state_indices: torch.Tensor | None = None, *,
                   out: torch.Tensor, ctx: RuntimeContext | None = None) -> torch.Tensor:
        """The decode step into ``out`` (shaped like x [B, D] or [B, D, L]); conv_state (with ``state_indices``
        [B]: its named pool rows) is shifted in place."""
        self._check_like("x", x)
        _validate_update(x, conv_state, weight, bias, ctx.device if ctx is not None else None, state_indices)
        _checks.out(OP_UPDATE, out, x.shape, x.dtype, x.device)
        x3, out3 = (x.unsqueeze(-1), out.unsqueeze(-1)) if x.dim() == 2 else (x, out)
        kernel = self.update_kernel
        try:
            kernel(self._context(ctx), (x3, weight, bias, conv_state, state_indices), (out3, conv_state))
        except Exception as exc:
            self._failed(exc, kernel)
        return out

    def update(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None, state_indices: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step: x [B, D] or [B, D, L] -> out shaped like x; conv_state (or its pool rows named by
        ``state_indices``) is shifted in place."""
        self._check_like("x", x)  # before empty_like, so a non-tensor x is a DtorchError
        return self.update_out(x, conv_state, weight, bias, state_indices, out=torch.empty_like(x))


# -- in a graph: the update and varlen forms advance their conv state (pool) in place and return (out, the state);
# naming the state as an input lets the graph see it read ---------------------------------------------------------

def _graph_params(op: str, a: Args) -> KernelParams:
    return _params(op, a["activation"])


def _rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [B, D, L], weight [D, W], bias [D]?, initial_states [B, D, W-1]? -> (out [B, D, L], final [B, D, W-1])
    # update: x [B, D(, L)], weight, bias?, conv_state [B, D, S] (a pool [P, D, S] with state_indices [B]),
    #   state_indices? -> (out like x, conv_state written in place)
    # varlen: x [T, D], weight, bias?, conv_states [P, D, S], cu_seqlens [N + 1], state_indices [N]
    #   -> (out [T, D], conv_states written in place)
    bias, states, ints = shapes[2], shapes[3], tuple(opt(s, R) for s in shapes[4:])
    out = [Strategy(same(shapes, R), (R, R)),
           Strategy((Shard(1), Shard(0), opt(bias, Shard(0)), opt(states, Shard(1))) + ints, (Shard(1), Shard(1)))]
    if not any(ints):  # batch (a pool's rows, or packed tokens, are not the batch)
        out.append(Strategy((Shard(0), R, opt(bias, R), opt(states, Shard(0))) + ints, (Shard(0), Shard(0))))
    return out


declare(OP, causal_conv1d, ("x", "weight", "bias", "initial_states"), params=_graph_params, rule=_rule,
        outputs=lambda a: 2 if a["return_final_states"] else 1, result=pair_result)
declare(OP_UPDATE, causal_conv1d_update, ("x", "weight", "bias", "conv_state", "state_indices"), params=_graph_params,
        rule=_rule, outputs=2, result=lambda r, a: (r, a["conv_state"]), always_inplace=(None, 3))
declare(OP_VARLEN, causal_conv1d_varlen, ("x", "weight", "bias", "conv_states", "cu_seqlens", "state_indices"),
        params=_graph_params, rule=_rule, outputs=2, result=lambda r, a: (r, a["conv_states"]),
        always_inplace=(None, 3))

__all__ = ["CausalConv1d", "causal_conv1d", "causal_conv1d_out", "causal_conv1d_update", "causal_conv1d_update_out",
           "causal_conv1d_varlen", "causal_conv1d_varlen_out"]
