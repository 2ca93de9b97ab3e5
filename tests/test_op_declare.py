"""A new op in one place: its kernel and one ``dtorch.ops.declare`` (wrapper, graph binding, placement rule) make
it a graph operator on DeviceMesh.cpu(2) that runs where its rule lets it, with no collective, against torch."""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, KernelKey, LogicalGraph, Runner
from dtorch.graph import Partial, Replicate, Shard
from dtorch.ops import Strategy, declare, declared, undeclare

OP = "mine.scale_rows"
R, P = Replicate(), Partial()


# -- the op, in one place: its kernel, its wrapper, and the declaration ---------------------------------------

def scale_rows_kernel(ctx, inputs, outputs):
    x, s = inputs  # x [N, D], s [N] -> x * s[:, None] * alpha
    torch.mul(x, s.unsqueeze(-1) * ctx.params.alpha, out=outputs[0])


def scale_rows(x: torch.Tensor, s: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Row i of x [N, D] times s[i] and alpha -> [N, D]."""
    if x.dim() != 2 or tuple(s.shape) != tuple(x.shape[:1]):
        raise dtorch.ShapeError(f"{OP}: 's' must be [N] for x [N, D] {tuple(x.shape)}, got {tuple(s.shape)}")
    return dtorch.ops.invoke(OP, (x, s), (torch.empty_like(x),), {"alpha": float(alpha)})[0]


def scale_rows_rule(op, shapes, params, n):
    # rows split with their scales; columns split with every scale; linear in x, so a partial x stays partial
    return [Strategy((R, R), R), Strategy((Shard(0), Shard(0)), Shard(0)), Strategy((Shard(1), R), Shard(1)),
            Strategy((P, R), P)]


def _declare(rule=scale_rows_rule, replace=False):
    return declare(OP, scale_rows, ("x", "s"), params=lambda op, a: dtorch.KernelParams(alpha=float(a["alpha"])),
                   rule=rule, replace=replace)


@pytest.fixture
def op():
    key = KernelKey(dtorch.dispatcher.define(OP), "cpu", torch.float32)
    dtorch.dispatcher.register(key, scale_rows_kernel, provider="user")
    _declare()
    yield
    undeclare(OP)
    dtorch.dispatcher.unregister(key, "user")


def _run(x_pl, s_pl, alpha=1.5):
    x, s = torch.randn(6, 4), torch.randn(6)
    g = LogicalGraph(DeviceMesh.cpu(2))
    y = g.call(OP, g.input("x", (6, 4), placement=x_pl), g.input("s", (6,), placement=s_pl), alpha=alpha)
    g.output("y", g.redistribute(y, R))
    kinds = [o.kind for o in g.operators]
    with Runner(g) as r:
        got = r.run({"x": x, "s": s})["y"]
    return y.placement, kinds, got, x * s[:, None] * alpha  # a Partial feed: its pieces sum to x


@pytest.mark.parametrize(("x_pl", "s_pl", "out_pl"), [(Shard(0), Shard(0), Shard(0)), (Shard(1), R, Shard(1)),
                                                      (P, R, P)], ids=str)
def test_a_declared_op_runs_where_its_rule_lets_it(op, x_pl, s_pl, out_pl):
    pl, kinds, got, want = _run(x_pl, s_pl)
    assert pl == out_pl
    assert kinds.count("kernel") == 1 and kinds.count("collective") == 1  # only the final gather or all-reduce
    torch.testing.assert_close(got, want)


def test_without_a_rule_the_op_runs_replicated(op):
    _declare(rule=None, replace=True)
    pl, kinds, got, want = _run(Shard(0), Shard(0))
    assert pl == R and kinds.count("collective") == 2  # x and s gathered before it
    torch.testing.assert_close(got, want)


def test_the_declaration_checks_the_call_and_itself(op):
    assert declared(OP).wrapper is scale_rows
    g = LogicalGraph(DeviceMesh.cpu(2))
    x = g.input("x", (6, 4), placement=Shard(0))
    with pytest.raises(dtorch.ShapeError, match=r"graph operator mine\.scale_rows#\d+.*'s' must be \[N\]"):
        g.call(OP, x, g.input("s", (5,)))  # the wrapper itself, on meta tensors
    with pytest.raises(dtorch.ArgumentError, match="must be an Operand"):
        g.call(OP, x, torch.ones(6))
    with pytest.raises(dtorch.GraphError, match=r"no op wrapper is declared.*did you mean 'mine\.scale_rows'"):
        g.call("mine.scale_row", x)
    with pytest.raises(dtorch.RegistrationError, match="already declared"):
        declare(OP, scale_rows, ("x",))
    with pytest.raises(dtorch.RegistrationError, match=r"'t' are not arguments of scale_rows"):
        declare("mine.other", scale_rows, ("x", "t"))
    with pytest.raises(dtorch.RegistrationError, match="unknown field"):
        declare("mine.other", scale_rows, ("x", "s"), rules=scale_rows_rule)
    assert declared("mine.other") is None
