"""Placement rules: for each op, the input placements it can run on and the output placement it gives.

``candidates(op, inputs, params)`` lists (input placements, output placement) pairs; the graph picks
the pair that is cheapest to reach from the inputs' current placements and inserts the moves. Ops
without a rule run replicated. One rule per family, as DTensor's op-strategy tables do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dtorch.dispatch.context import KernelParams
from dtorch.graph.placement import Partial, Placement, Replicate, Shard

R = Replicate()
P = Partial()
Strategy = tuple[tuple[Placement | None, ...], Placement]
Shapes = Sequence["tuple[int, ...] | None"]

# The cost of moving a tensor from one placement to another: a local slice is almost free, a gather
# or all-reduce moves the whole tensor, a reduce-scatter about half of it.
_COST = {("R", "S"): 0.1, ("R", "P"): 0.1, ("S", "R"): 1.0, ("P", "R"): 1.0, ("P", "S"): 0.6, ("S", "S"): 1.1,
         ("S", "P"): 1.1}


def move_cost(src: Placement, dst: Placement) -> float:
    if src == dst:
        return 0.0
    if isinstance(src, Partial) and isinstance(dst, Partial):
        return 2.0
    return _COST[(str(src)[0], str(dst)[0])]


def _elementwise(ndim: int, partial_ok: bool) -> list[Strategy]:
    out: list[Strategy] = [((R,), R)] + [((Shard(d),), Shard(d)) for d in range(ndim)]
    return out + ([((P,), P)] if partial_ok else [])


def _unary(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    return _elementwise(len(shapes[0]), partial_ok=op == "unary.neg")  # only negation is linear


def _scalar(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    # (a1 + a2) * c = a1*c + a2*c, but (a1 + a2) + c != (a1 + c) + (a2 + c)
    return _elementwise(len(shapes[0]), partial_ok=op in ("binary.mul_scalar", "binary.div_scalar"))


def _binary(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    a, b = shapes
    n = max(len(a), len(b))
    out: list[Strategy] = [((R, R), R)]
    for d in range(n):
        pa = _aligned(a, d, n)
        pb = _aligned(b, d, n)
        if pa != R or pb != R:  # both inputs whole on d: nothing to split
            out.append(((pa, pb), Shard(d)))
    if op in ("binary.add", "binary.sub"):
        out.append(((P, P), P))
    if op == "binary.mul":
        out += [((P, R), P), ((R, P), P)]
    if op == "binary.div":
        out.append(((P, R), P))
    return out


def _aligned(shape: tuple[int, ...], d: int, n: int) -> Placement:
    """The placement an input of ``shape`` needs for an output sharded on ``d`` (broadcast dims stay whole)."""
    da = d - (n - len(shape))
    return R if da < 0 or shape[da] == 1 else Shard(da)


def _mm(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    # a [M, K] @ b [K, N]
    return [((R, R), R), ((Shard(0), R), Shard(0)), ((R, Shard(1)), Shard(1)), ((Shard(1), Shard(0)), P)]


def _bmm(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    # a [B, M, K] @ b [B, K, N]
    return [((R, R), R), ((Shard(0), Shard(0)), Shard(0)), ((Shard(1), R), Shard(1)), ((R, Shard(2)), Shard(2)),
            ((Shard(2), Shard(1)), P)]


def _linear(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    # x [..., K], w [N, K], bias [N] or None -> [..., N]
    n = len(shapes[0])
    has_bias = shapes[2] is not None
    b_r = R if has_bias else None
    out: list[Strategy] = [((R, R, b_r), R)]
    out += [((Shard(d), R, b_r), Shard(d)) for d in range(n - 1)]
    out.append(((R, Shard(0), Shard(0) if has_bias else None), Shard(n - 1)))  # column parallel
    if not has_bias:
        out.append(((Shard(n - 1), Shard(1), None), P))  # row parallel: partial sums
    return out


def _reduce(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    n = len(shapes[0])
    dim, keepdim = params.dim, params.keepdim
    out: list[Strategy] = [((R,), R)]
    for e in range(n):
        if e != dim:
            out.append(((Shard(e),), Shard(e if keepdim or e < dim else e - 1)))
    if op == "reduce.sum":
        out += [((Shard(dim),), P), ((P,), P)]
    if op == "reduce.max":
        out.append(((Shard(dim),), Partial("max")))
    return out


RULES: dict[str, Callable[[str, Shapes, KernelParams], list[Strategy]]] = {
    "matmul.mm": _mm, "matmul.bmm": _bmm, "matmul.linear": _linear,
    "reduce.sum": _reduce, "reduce.mean": _reduce, "reduce.max": _reduce, "reduce.min": _reduce,
    "reduce.argmax": _reduce,
}


def candidates(op: str, shapes: Shapes, params: KernelParams) -> list[Strategy]:
    """Every (input placements, output placement) ``op`` can run with; replicated first."""
    rule = RULES.get(op)
    if rule is None:
        family = op.partition(".")[0]
        if family == "unary":
            rule = _unary
        elif family == "binary":
            rule = _scalar if op.endswith("_scalar") else _binary
    if rule is None:
        return [(tuple(R if s is not None else None for s in shapes), R)]
    return rule(op, shapes, params)


def choose(op: str, shapes: Shapes, current: Sequence[Placement | None], params: KernelParams) -> Strategy:
    """The cheapest strategy to reach from the inputs' ``current`` placements (earlier wins ties)."""
    best, best_cost = None, float("inf")
    for want, out in candidates(op, shapes, params):
        cost = sum(move_cost(c, w) for c, w in zip(current, want, strict=False) if c is not None and w is not None)
        if cost < best_cost:
            best, best_cost = (want, out), cost
    assert best is not None
    return best
