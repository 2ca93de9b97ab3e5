"""LogicalGraph on DeviceMesh.cpu(1/2/4) against plain torch on one device; placements; build-time errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dtorch
from dtorch.graph import DeviceMesh, LogicalGraph, Partial, Replicate, Shard, shard_sizes
from dtorch.runtime import Runner

MESHES = (1, 2, 4)


def run_graph(g: LogicalGraph, feeds: dict, **kw) -> dict:
    with Runner(g) as r:
        return r.run(feeds, **kw)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# -- mesh and placements -------------------------------------------------------------------------


def test_placements_are_frozen_with_short_forms():
    assert (str(Replicate()), str(Shard(1)), str(Partial()), str(Partial("max"))) == ("R", "S(1)", "P", "P(max)")
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and hash(Shard(2)) == hash(Shard(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shard(0).dim = 1  # type: ignore[misc]
    with pytest.raises(dtorch.ArgumentError, match="Partial"):
        Partial("mean")
    with pytest.raises(dtorch.ArgumentError, match="Shard"):
        Shard(-1)


def test_uneven_shard_sizes_match_tensor_split():
    for size in (0, 1, 5, 9, 16):
        for n in (1, 2, 3, 4):
            assert shard_sizes(size, n) == [t.shape[0] for t in torch.tensor_split(torch.empty(size), n)]


def test_mesh_axes_and_submeshes():
    mesh = DeviceMesh.cpu(4, shape=(2, 2), axis_names=("dp", "tp"))
    assert mesh.size == 4 and mesh.ndim == 2 and mesh.axis_size("tp") == 2
    assert mesh.coordinate(3) == (1, 1)
    assert mesh.submesh("tp", 2).ids == (2, 3) and mesh.submesh("dp", 1).ids == (1, 3)
    assert str(mesh.device(3)) == "cpu:3"
    with pytest.raises(dtorch.ArgumentError):
        DeviceMesh.cpu(4, shape=(3, 2))
    with pytest.raises(dtorch.ArgumentError, match="axis"):
        mesh.axis_size("pp")


# -- graphs against torch ------------------------------------------------------------------------


@pytest.mark.parametrize("n", MESHES)
def test_mlp_column_then_row_parallel(n):
    # x: [B, D] replicated; w1: [D, H] column-parallel S(1); w2: [H, D] row-parallel S(0); H uneven over n
    B, D, H = 6, 16, 18
    x, w1, w2 = torch.randn(B, D), torch.randn(D, H), torch.randn(H, D)
    g = LogicalGraph(DeviceMesh.cpu(n))
    xi = g.input("x", (B, D))
    h = (xi @ g.param("w1", w1, Shard(1))).relu()
    y = h @ g.param("w2", w2, Shard(0))
    assert h.placement == Shard(1) and y.placement == Partial()
    g.output("y", g.redistribute(y, Replicate()))
    assert [op.op for op in g.operators].count("all_reduce") == (n > 1)  # one device: a relabel, no collective
    close(run_graph(g, {"x": x})["y"], torch.relu(x @ w1) @ w2)


@pytest.mark.parametrize("n", MESHES)
def test_mlp_with_linear_and_bias(n):
    # the Megatron layout on torch's linear weights: w1 [H, D] S(0) with bias S(0), then w2 [D, H] S(1), no bias
    B, D, H = 5, 12, 10
    x, w1, b1, w2 = torch.randn(B, D), torch.randn(H, D), torch.randn(H), torch.randn(D, H)
    g = LogicalGraph(DeviceMesh.cpu(n))
    h = g.call("matmul.linear", g.input("x", (B, D)), g.param("w1", w1, "S(0)"), g.param("b1", b1, "S(0)"))
    y = g.call("matmul.linear", h.gelu(), g.param("w2", w2, "S(1)"))
    g.output("y", y.redistribute("R"))
    ref = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2)
    close(run_graph(g, {"x": x})["y"], ref)


@pytest.mark.parametrize("n", MESHES)
def test_elementwise_chain_on_uneven_shards(n):
    x, y = torch.randn(7, 5), torch.randn(7, 5)
    b = torch.randn(5)
    g = LogicalGraph(DeviceMesh.cpu(n))
    xs, ys = g.input("x", (7, 5), placement=Shard(0)), g.input("y", (7, 5), placement=Shard(0))
    z = ((xs + ys) * 0.5 - g.param("b", b)).tanh().exp() / (ys.exp() + 1.0)
    assert z.placement == Shard(0)
    g.output("z", z)  # returned gathered from the shards
    ref = ((x + y) * 0.5 - b).tanh().exp() / (y.exp() + 1.0)
    close(run_graph(g, {"x": x, "y": y})["z"], ref)


@pytest.mark.parametrize("n", MESHES)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("dim", [0, 1])
def test_reductions_over_sharded_and_whole_dims(n, op, dim):
    x = torch.randn(9, 6)
    g = LogicalGraph(DeviceMesh.cpu(n))
    xs = g.input("x", (9, 6), placement=Shard(0))
    r = g.call(f"reduce.{op}", xs, dim=dim, keepdim=False)
    g.output("r", r.redistribute("R"))
    ref = {"sum": x.sum(dim), "mean": x.mean(dim), "max": x.amax(dim)}[op]
    close(run_graph(g, {"x": x})["r"], ref)


@pytest.mark.parametrize("n", MESHES)
def test_every_placement_change(n):
    x = torch.randn(6, 10)
    g = LogicalGraph(DeviceMesh.cpu(n))
    r = g.input("x", (6, 10))
    s0 = g.redistribute(r, Shard(0))          # R -> S: a local slice
    p = g.call("reduce.sum", g.redistribute(r, Shard(1)).exp(), dim=1, keepdim=True)   # S(1) summed: P
    g.output("s0_to_r", g.redistribute(s0, "R"))       # S -> R: all-gather
    g.output("s0_to_s1", g.redistribute(s0, Shard(1)))  # S -> S: all-gather + slice
    g.output("p_to_r", g.redistribute(p, "R"))          # P -> R: all-reduce
    g.output("p_to_s0", g.redistribute(p, Shard(0)))    # P -> S: reduce-scatter
    g.output("r_to_p", g.redistribute(r, Partial()))    # R -> P
    ops = {op.op for op in g.operators}
    if n > 1:
        assert {"shard", "all_gather", "all_reduce", "reduce_scatter", "to_partial"} <= ops
    else:  # one device holds the whole value under every placement: each move is a relabel
        assert ops == {"reduce.sum", "unary.exp", "view"}
    out = run_graph(g, {"x": x})
    ref_sum = x.exp().sum(1, keepdim=True)
    close(out["s0_to_r"], x)
    close(out["s0_to_s1"], x)
    close(out["p_to_r"], ref_sum)
    close(out["p_to_s0"], ref_sum)
    close(out["r_to_p"], x)


def test_explicit_collectives_and_return_dist():
    n = 3
    x = torch.randn(7, 4)
    mesh = DeviceMesh.cpu(n)
    g = LogicalGraph(mesh)
    xs = g.input("x", (7, 4), placement=Shard(0))
    full = g.all_gather(xs)
    part = g.redistribute(full, Partial())
    g.output("rs", g.reduce_scatter(part, dim=0))
    g.output("ar", g.all_reduce(part))
    g.output("bc", g.broadcast(g.python(lambda t: t * 2, full), src=2))
    with pytest.raises(dtorch.GraphError, match="needs a Partial"):
        g.all_reduce(xs)
    out = run_graph(g, {"x": x}, return_dist=True)
    assert isinstance(out["rs"], dtorch.runtime.DistTensor) and out["rs"].placement == Shard(0)
    assert [out["rs"].local(i).shape[0] for i in mesh.ids] == shard_sizes(7, n)
    close(out["rs"].full(), x)
    close(out["ar"].full(), x)
    close(out["bc"].full(), x * 2)


def test_operators_and_metadata_are_inferred():
    g = LogicalGraph(DeviceMesh.cpu(2))
    a = g.input("a", (4, 3, 5), dtype=torch.float64, placement=Shard(1))
    b = g.input("b", (4, 5, 2), dtype=torch.float64)
    c = a @ b
    assert c.shape == (4, 3, 2) and c.dtype == torch.float64 and c.placement == Shard(1)
    assert c.local_shapes == {0: (4, 2, 2), 1: (4, 1, 2)}
    m = g.call("reduce.argmax", c, dim=2)
    assert m.dtype == torch.int64 and m.shape == (4, 3)


# -- build-time errors ---------------------------------------------------------------------------


def test_bad_graph_fails_at_build_naming_the_operator():
    g = LogicalGraph(DeviceMesh.cpu(2))
    x = g.input("x", (4, 8))
    w = g.param("w", torch.randn(5, 3))
    before = len(g.operators)
    with pytest.raises(dtorch.ShapeError, match=r"graph operator matmul\.mm#\d+"):
        g.call("matmul.mm", x, w)
    with pytest.raises(dtorch.DTypeError, match="binary.add"):
        g.call("binary.add", x, g.input("i", (4, 8), dtype=torch.float64))
    assert len(g.operators) == before  # nothing half-built stays behind
    with pytest.raises(dtorch.GraphError, match="no op wrapper"):
        g.call("nosuch.op", x)
    with pytest.raises(dtorch.GraphError, match="cannot shard dim 2"):
        g.input("y", (4, 8), placement=Shard(2))
    with pytest.raises(dtorch.GraphError, match="another graph"):
        g.call("binary.add", x, LogicalGraph(DeviceMesh.cpu(2)).input("z", (4, 8)))
    with pytest.raises(dtorch.ArgumentError, match="placement"):
        g.input("q", (2,), placement="X")


def test_bad_feeds_are_rejected():
    g = LogicalGraph(DeviceMesh.cpu(2))
    g.output("y", g.input("x", (4, 2)).relu())
    with Runner(g) as r:
        with pytest.raises(dtorch.ArgumentError, match="missing"):
            r.run({})
        with pytest.raises(dtorch.ShapeError, match="feed 'x'"):
            r.run({"x": torch.randn(3, 2)})
        with pytest.raises(dtorch.DTypeError, match="float32"):
            r.run({"x": torch.randn(4, 2, dtype=torch.float64)})
