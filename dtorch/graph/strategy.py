"""Choosing a placement strategy: ``choose`` picks, of the strategies an op's placement rule lists, the one
cheapest to reach from its inputs' current placements (the graph inserts the moves).

The rules stand beside their ops (``dtorch.ops.graph_op``: ``GraphOp.rule``, as DTensor's op-strategy tables);
shapes and placements are in kernel-input order (``Bound.inputs``), an absent optional input has shape and
placement None, and a multi-output op gives one output placement per output. An op without a rule runs replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

from dtorch.core.errors import GraphError
from dtorch.core.placement import Partial, Placement, Shard
from dtorch.dispatch.context import KernelParams
from dtorch.ops.graph_op import Rule, Shapes, Strategy, replicated, rule_of

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


def candidates(op: str, shapes: Shapes, params: KernelParams, n: int = 1, rule: Rule | None = None) -> list[Strategy]:
    """Every strategy ``op`` can run with on ``n`` devices by ``rule`` (default: the one declared for ``op``);
    the replicated one first."""
    return (rule or rule_of(op) or replicated)(op, shapes, params, n)


def choose(op: str, shapes: Shapes, current: Sequence[Placement | None], params: KernelParams, *, n: int = 1,
           pinned: Sequence[int] = (), num_outputs: int | None = None, rule: Rule | None = None) -> Strategy:
    """The strategy cheapest to reach from the inputs' ``current`` placements (earlier wins ties).

    ``n``: the mesh size (head splits depend on it). ``pinned``: inputs that cannot move (an input an output
    writes in place: moving it would write a copy); a strategy must take them as they are, else GraphError.
    ``num_outputs``: how many of a multi-output op's outputs the call asks for (the first ones). ``rule``: the
    placement rule (default: the one declared for ``op``).
    """
    pinned = tuple(pinned)
    best, best_cost = None, float("inf")
    ways = candidates(op, shapes, params, n, rule)
    for s in ways:
        if any(move_cost(current[i], s.inputs[i]) for i in pinned):
            continue
        cost = sum(move_cost(c, w) for c, w in zip(current, s.inputs, strict=True) if c is not None and w is not None)
        if cost < best_cost:
            best, best_cost = s, cost
    if best is None:
        held = ", ".join(f"input {i} {current[i]}" for i in pinned)
        text = "; ".join(f"({', '.join(str(p) for p in s.inputs)})" for s in ways)
        raise GraphError(f"{op}: cannot run with {held} on {n} devices: that input is written in place, so it cannot "
                         f"be moved, and no placement rule takes it as it is; the rule's input placements are {text}")
    if num_outputs is not None and isinstance(best.output, tuple):
        out = best.output[0] if num_outputs == 1 else best.output[:num_outputs]
        best = best._replace(output=out)
    return best


__all__ = ["Strategy", "candidates", "choose", "move_cost", "rule_of"]
