"""Placement rules: for each kernel op, the input placements it can run on and the output placements it gives.

``candidates(op, shapes, params, n)`` lists ``Strategy(inputs, output, local_params)``; ``choose`` picks the
one cheapest to reach from the inputs' current placements (the graph inserts the moves). Shapes and
placements are in kernel-input order (``Bound.inputs``); an absent optional input has shape and placement
None. A multi-output op gives one output placement per output. One rule per family, as DTensor's
op-strategy tables: ``RULES`` maps each op to its rule, and every registered op has one. A kernel op
registered by a user without a rule runs replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from dtorch.core.errors import GraphError
from dtorch.core.placement import Partial, Placement, Replicate, Shard, shard_offsets, shard_sizes
from dtorch.dispatch.context import KernelParams

R = Replicate()
P = Partial()
Shapes = Sequence["tuple[int, ...] | None"]
LocalParams = Callable[[KernelParams, int, int], KernelParams]


class Strategy(NamedTuple):
    """Wanted placement per kernel input (None for absent inputs) and the output placement(s) it gives.

    ``local_params(params, rank, n)``: that device's params, where devices need different ones (a
    vocabulary-parallel embedding's row offset)."""

    inputs: tuple[Placement | None, ...]
    output: Placement | tuple[Placement, ...]
    local_params: LocalParams | None = None


Rule = Callable[[str, Shapes, KernelParams, int], list[Strategy]]

# The cost of moving a tensor from one placement to another: a local slice is almost free, a gather
# or all-reduce moves the whole tensor, a reduce-scatter about half of it.
_COST = {("R", "S"): 0.1, ("R", "P"): 0.1, ("S", "R"): 1.0, ("P", "R"): 1.0, ("P", "S"): 0.6, ("S", "S"): 1.1,
         ("S", "P"): 1.1}


def move_cost(src: Placement, dst: Placement) -> float:
    if src == dst:
        return 0.0
    if isinstance(src, Shard) and isinstance(dst, Shard) and src.dim == dst.dim and dst.plain:
        return 0.0  # a blocked shard is a shard of its dim to a rule that does not ask for blocks
    if isinstance(src, Partial) and isinstance(dst, Partial):
        return 2.0
    return _COST[(str(src)[0], str(dst)[0])]


def _opt(shape: tuple[int, ...] | None, p: Placement) -> Placement | None:
    """``p`` for an optional input that is present, None for an absent one."""
    return None if shape is None else p


def _same(shapes: Shapes, p: Placement) -> tuple[Placement | None, ...]:
    return tuple(_opt(s, p) for s in shapes)


def _replicated(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    return [Strategy(_same(shapes, R), R)]


def _heads_split(h: int, hkv: int, n: int) -> bool:
    """Splitting H query heads and Hkv kv heads over n devices keeps GQA groups whole: every device holds
    H / Hkv query heads per kv head it holds (so its local head h reads its local kv head h // (H / Hkv))."""
    if hkv == 0 or h % hkv:
        return False
    g = h // hkv
    return all(a == g * b for a, b in zip(shard_sizes(h, n), shard_sizes(hkv, n), strict=True))


def _groups_split(h: int, hkv: int, n: int) -> bool:
    """Whether the heads can split over n devices in whole GQA groups (``Shard(dim, unit=G)`` on q) where a plain
    split of the heads would cut a group: every device then holds at least one kv head and its G query heads."""
    return hkv > 1 and h % hkv == 0 and h > hkv and hkv >= n > 1 and not _heads_split(h, hkv, n)


# -- elementwise, matmul, reduce -------------------------------------------------------------------

def _elementwise(ndim: int, partial_ok: bool, k: int = 1) -> list[Strategy]:
    out = [Strategy((R,) * k, R)] + [Strategy((Shard(d),) * k, Shard(d)) for d in range(ndim)]
    return out + ([Strategy((P,) * k, P)] if partial_ok else [])


def _unary(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    return _elementwise(len(shapes[0]), partial_ok=op == "unary.neg")  # only negation is linear


def _scalar(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # (a1 + a2) * c = a1*c + a2*c, but (a1 + a2) + c != (a1 + c) + (a2 + c)
    return _elementwise(len(shapes[0]), partial_ok=op in ("binary.mul_scalar", "binary.div_scalar"))


def _binary(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    a, b = shapes
    nd = max(len(a), len(b))
    out = [Strategy((R, R), R)]
    for d in range(nd):
        pa, pb = _aligned(a, d, nd), _aligned(b, d, nd)
        if pa != R or pb != R:  # both inputs whole on d: nothing to split
            out.append(Strategy((pa, pb), Shard(d)))
    if op in ("binary.add", "binary.sub"):
        out.append(Strategy((P, P), P))
    if op == "binary.mul":
        out += [Strategy((P, R), P), Strategy((R, P), P)]
    if op == "binary.div":
        out.append(Strategy((P, R), P))
    return out


def _aligned(shape: tuple[int, ...], d: int, nd: int) -> Placement:
    """The placement an input of ``shape`` needs for an output sharded on ``d`` (broadcast dims stay whole)."""
    da = d - (nd - len(shape))
    return R if da < 0 or shape[da] == 1 else Shard(da)


def _mm(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # a [M, K] @ b [K, N]
    return [Strategy((R, R), R), Strategy((Shard(0), R), Shard(0)), Strategy((R, Shard(1)), Shard(1)),
            Strategy((Shard(1), Shard(0)), P)]


def _bmm(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # a [B, M, K] @ b [B, K, N]
    return [Strategy((R, R), R), Strategy((Shard(0), Shard(0)), Shard(0)), Strategy((Shard(1), R), Shard(1)),
            Strategy((R, Shard(2)), Shard(2)), Strategy((Shard(2), Shard(1)), P)]


def _linear(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [..., K], w [N, K], bias [N] or None -> [..., N]
    nd, bias = len(shapes[0]), shapes[2]
    out = [Strategy((R, R, _opt(bias, R)), R)]
    out += [Strategy((Shard(d), R, _opt(bias, R)), Shard(d)) for d in range(nd - 1)]
    out.append(Strategy((R, Shard(0), _opt(bias, Shard(0))), Shard(nd - 1)))  # column parallel
    if bias is None:
        out.append(Strategy((Shard(nd - 1), Shard(1), None), P))  # row parallel: partial sums
    return out


def _reduce(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    nd, dim, keepdim = len(shapes[0]), params.dim, params.keepdim
    out = [Strategy((R,), R)]
    out += [Strategy((Shard(e),), Shard(e if keepdim or e < dim else e - 1)) for e in range(nd) if e != dim]
    if op == "reduce.sum":
        out += [Strategy((Shard(dim),), P), Strategy((P,), P)]
    if op == "reduce.max":
        out.append(Strategy((Shard(dim),), Partial("max")))
    return out


def _conv(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [B, C_in, *spatial], w [C_out, C_in / groups, *k], bias [C_out] or None -> [B, C_out, *spatial']
    bias = shapes[2]
    out = [Strategy((R, R, _opt(bias, R)), R), Strategy((Shard(0), R, _opt(bias, R)), Shard(0))]
    if params.groups == 1:  # with groups, a channel split would have to follow the group boundaries
        out.append(Strategy((R, Shard(0), _opt(bias, Shard(0))), Shard(1)))  # output channels
        if bias is None:
            out.append(Strategy((Shard(1), Shard(1), None), P))  # input channels: partial sums
    return out


def _copy(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    return _elementwise(len(shapes[0]), partial_ok=False)  # a cast of a partial sum is not the sum of casts


# -- llm ------------------------------------------------------------------------------------------

def _last_dim_whole(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    """rms_norm (x, weight), add_rms_norm (x, residual, weight), softmax_last_dim (x): any placement that keeps
    the normalized last dim whole; never Partial (a norm of a sum is not the sum of norms)."""
    nd, k = len(shapes[0]), 2 if op == "llm.add_rms_norm" else 1
    weight = (R,) if op != "llm.softmax_last_dim" else ()
    outs = (lambda p: (p, p)) if op == "llm.add_rms_norm" else (lambda p: p)  # (out, residual_out)
    return [Strategy((p,) * k + weight, outs(p)) for p in [R] + [Shard(d) for d in range(nd - 1)]]


def _silu_and_mul(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    x, up = shapes
    nd = len(x)
    if up is not None:  # gate [..., I], up [..., I]: elementwise, the feature dim included
        return _elementwise(nd, partial_ok=False, k=2)
    # fused x [..., 2I] = [gate | up]: a plain split of the last dim would pair gate with gate; the blocked
    # split S(last)[I, I] gives each device [gate_r | up_r], its own features of both halves
    half = x[-1] // 2
    out = [Strategy((Shard(d), None), Shard(d)) for d in range(nd - 1)]
    return [Strategy((R, None), R)] + out + [Strategy((Shard(nd - 1, (half, half)), None), Shard(nd - 1))]


def _rope(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
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


def _attention(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # dense q [B, T, H, D], k/v [B, S, Hkv, D]; varlen q [total_q, H, D], k/v [total_k, Hkv, D], cu_q, cu_k
    q, k = shapes[0], shapes[1]
    dense = op == "llm.flash_attention"
    hd = 2 if dense else 1
    cus = () if dense else (R, R)
    out = [Strategy((R, R, R) + cus, R)]
    h, hkv = q[hd], k[hd]
    if _heads_split(h, hkv, n):
        out.append(Strategy((Shard(hd),) * 3 + cus, Shard(hd)))
    if _groups_split(h, hkv, n):  # uneven: q split in whole groups of G heads, each beside its kv head
        out.append(Strategy((Shard(hd, None, h // hkv), Shard(hd), Shard(hd)) + cus, Shard(hd, None, h // hkv)))
    if hkv == 1:  # one kv head serves every query head: keep it whole
        out.append(Strategy((Shard(hd), R, R) + cus, Shard(hd)))
    if dense:
        out.append(Strategy((Shard(0),) * 3, Shard(0)))  # batch
        if not params.causal:  # a bottom-right causal mask depends on T, so only full attention splits queries
            out.append(Strategy((Shard(1), R, R), Shard(1)))
    return out


def _kv_cache(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # reshape_and_cache: key, value [T, Hkv, D], caches [blocks, block_size, Hkv, D], slots [T]
    #   -> (key_cache, value_cache), written in place
    # flash_attention_with_kvcache: q [total_q, H, D], caches, cu_seqlens_q, seqlens_k, block_table -> [total_q, H, D]
    ints = (R,) * (len(shapes) - 3)
    if op == "llm.reshape_and_cache":
        return [Strategy((R,) * 5, (R, R)), Strategy((Shard(1), Shard(1), Shard(2), Shard(2), R), (Shard(2), Shard(2)))]
    h, hkv = shapes[0][1], shapes[1][2]
    out = [Strategy((R, R, R) + ints, R)]
    if _heads_split(h, hkv, n):
        out.append(Strategy((Shard(1), Shard(2), Shard(2)) + ints, Shard(1)))
    if _groups_split(h, hkv, n):
        out.append(Strategy((Shard(1, None, h // hkv), Shard(2), Shard(2)) + ints, Shard(1, None, h // hkv)))
    if hkv == 1:
        out.append(Strategy((Shard(1), R, R) + ints, Shard(1)))
    return out


def _gated_delta_net(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # q, k [B, T, Hk, K]; v [B, T, H, V]; g, beta [B, T, H]; state [N, H, K, V]? (with state_indices [N]: a pool
    # [S, H, K, V]); cu_seqlens [N + 1]? -> (o [B, T, H, V], final state [N or S, H, K, V])
    q, v, state, cu, idx = shapes[0], shapes[2], shapes[5], shapes[6], shapes[7] if len(shapes) > 7 else None
    ints = (_opt(cu, R),) + ((_opt(idx, R),) if len(shapes) > 7 else ())
    out = [Strategy(_same(shapes, R), (R, R))]
    if _heads_split(v[2], q[2], n):
        out.append(Strategy((Shard(2),) * 5 + (_opt(state, Shard(1)),) + ints, (Shard(2), Shard(1))))
    if cu is None and idx is None:  # packed sequences (cu_seqlens) have B == 1; a pool's rows are not the batch
        out.append(Strategy((Shard(0),) * 5 + (_opt(state, Shard(0)),) + (None,) * len(ints), (Shard(0), Shard(0))))
    return out


def _causal_conv1d(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # x [B, D, L], weight [D, W], bias [D]?, initial_states [B, D, W-1]? -> (out [B, D, L], final [B, D, W-1])
    # update: x [B, D(, L)], weight, bias?, conv_state [B, D, S] (a pool [P, D, S] with state_indices [B]),
    #   state_indices? -> (out like x, conv_state written in place)
    # varlen: x [T, D], weight, bias?, conv_states [P, D, S], cu_seqlens [N + 1], state_indices [N]
    #   -> (out [T, D], conv_states written in place)
    bias, states, ints = shapes[2], shapes[3], tuple(_opt(s, R) for s in shapes[4:])
    out = [Strategy(_same(shapes, R), (R, R)),
           Strategy((Shard(1), Shard(0), _opt(bias, Shard(0)), _opt(states, Shard(1))) + ints, (Shard(1), Shard(1)))]
    if not any(ints):  # batch (a pool's rows, or packed tokens, are not the batch)
        out.append(Strategy((Shard(0), R, _opt(bias, R), _opt(states, Shard(0))) + ints, (Shard(0), Shard(0))))
    return out


def _gdn_gates(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # a, b [T, H], A_log [H], dt_bias [H] -> (g [T, H], beta [T, H]): per token and head
    return [Strategy((R,) * 4, (R, R)), Strategy((Shard(0), Shard(0), R, R), (Shard(0), Shard(0))),
            Strategy((Shard(1), Shard(1), Shard(0), Shard(0)), (Shard(1), Shard(1)))]


def _embedding(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # weight [V, D], ids [...] -> [..., D]
    (vocab, _), ids = shapes

    def vocab_start(p: KernelParams, rank: int, n: int) -> KernelParams:
        return p.replace(vocab_start=shard_offsets(vocab, n)[rank])

    out = [Strategy((R, R), R)] + [Strategy((R, Shard(d)), Shard(d)) for d in range(len(ids))]
    out.append(Strategy((Shard(1), R), Shard(len(ids))))  # each device its columns of every row
    # vocabulary parallel: each device looks up the ids in its rows and gives zeros elsewhere; the sum is whole
    return out + [Strategy((Shard(0), R), P, vocab_start)]


def _moe_router(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # logits [T, E] -> (weights [T, k], ids [T, k]): every token routed alone
    return [Strategy((R,), (R, R)), Strategy((Shard(0),), (Shard(0), Shard(0)))]


def _moe_experts(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
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


# -- the table --------------------------------------------------------------------------------------

_FAMILY_RULES: dict[str, Rule] = {"unary": _unary, "binary": _binary, "reduce": _reduce, "conv": _conv,
                                  "creation": _replicated, "copy": _copy}
RULES: dict[str, Rule] = {
    "matmul.mm": _mm, "matmul.bmm": _bmm, "matmul.linear": _linear,
    "llm.rms_norm": _last_dim_whole, "llm.add_rms_norm": _last_dim_whole, "llm.softmax_last_dim": _last_dim_whole,
    "llm.silu_and_mul": _silu_and_mul, "llm.gelu_tanh_and_mul": _silu_and_mul, "llm.rope": _rope,
    "llm.embedding": _embedding,
    "llm.flash_attention": _attention, "llm.flash_attention_varlen": _attention,
    "llm.reshape_and_cache": _kv_cache, "llm.flash_attention_with_kvcache": _kv_cache,
    "llm.gated_delta_net": _gated_delta_net,
    "llm.causal_conv1d": _causal_conv1d, "llm.causal_conv1d_update": _causal_conv1d,
    "llm.causal_conv1d_varlen": _causal_conv1d, "llm.gdn_gates": _gdn_gates,
    "llm.moe_router": _moe_router, "llm.moe_experts": _moe_experts,
}


def rule_of(op: str) -> Rule | None:
    """The placement rule of kernel op ``op`` (None: it has none and runs replicated)."""
    rule = RULES.get(op)
    if rule is not None:
        return rule
    family = op.partition(".")[0]
    if family == "binary" and op.endswith("_scalar"):
        return _scalar
    return _FAMILY_RULES.get(family)


def candidates(op: str, shapes: Shapes, params: KernelParams, n: int = 1) -> list[Strategy]:
    """Every strategy ``op`` can run with on ``n`` devices; the replicated one first."""
    return (rule_of(op) or _replicated)(op, shapes, params, n)


def choose(op: str, shapes: Shapes, current: Sequence[Placement | None], params: KernelParams, *, n: int = 1,
           pinned: Sequence[int] = (), num_outputs: int | None = None) -> Strategy:
    """The strategy cheapest to reach from the inputs' ``current`` placements (earlier wins ties).

    ``n``: the mesh size (head splits depend on it). ``pinned``: inputs that cannot move (an input an output
    writes in place: moving it would write a copy); a strategy must take them as they are, else GraphError.
    ``num_outputs``: how many of a multi-output op's outputs the call asks for (the first ones).
    """
    pinned = tuple(pinned)
    best, best_cost = None, float("inf")
    for s in candidates(op, shapes, params, n):
        if any(move_cost(current[i], s.inputs[i]) for i in pinned):
            continue
        cost = sum(move_cost(c, w) for c, w in zip(current, s.inputs, strict=True) if c is not None and w is not None)
        if cost < best_cost:
            best, best_cost = s, cost
    if best is None:
        held = ", ".join(f"input {i} {current[i]}" for i in pinned)
        ways = "; ".join(f"({', '.join(str(p) for p in s.inputs)})" for s in candidates(op, shapes, params, n))
        raise GraphError(f"{op}: cannot run with {held} on {n} devices: that input is written in place, so it cannot "
                         f"be moved, and no placement rule takes it as it is; the rule's input placements are {ways}")
    if num_outputs is not None and isinstance(best.output, tuple):
        out = best.output[0] if num_outputs == 1 else best.output[:num_outputs]
        best = best._replace(output=out)
    return best


__all__ = ["RULES", "Strategy", "candidates", "choose", "move_cost", "rule_of"]
