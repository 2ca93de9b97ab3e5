"""Every op of the op table (tests/op_table.py + tests/op_table_llm.py) as a graph operator on DeviceMesh.cpu(1)
and cpu(2), against the functional ops: inputs replicated, and on cpu(2) also placed the way the op's sharded rule
wants (attention and rope on heads, embedding on the vocabulary, ...), checking the output placement the graph
chose. Then the ops the table leaves out (several outputs, in-place state), the fused silu_and_mul, the rules'
coverage, and placements the graph must refuse."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import dtorch
from dtorch import ops
from dtorch.core.dtypes import as_dtype
from dtorch.graph import DeviceMesh, LogicalGraph, Partial, Replicate, Shard
from dtorch.graph.strategy import candidates, choose
from dtorch.ops.attention import dense_params
from dtorch.ops.graph_op import declared
from dtorch.runtime import DistTensor, Runner
from tests.op_table import ROWS, Row
from tests.op_table_llm import LLM_NOT_IN_TABLE, LLM_ROWS

R, P, S = Replicate(), Partial(), Shard
ALL_ROWS = ROWS + LLM_ROWS
F32 = torch.float32

# Ops of the registry the table runs not at all, each tested below instead (none is left out of graphs).
GRAPH_TESTED_BELOW = {**LLM_NOT_IN_TABLE,
                      "llm.reshape_and_cache": "writes the caches in place: test_kv_cache_ops_sharded_on_heads",
                      "llm.flash_attention_with_kvcache": "reads the paged cache: test_kv_cache_ops_sharded_on_heads"}


@dataclass
class GraphCall:
    """``g.call(op, *operands(tensors), *extra, **kwargs)``, with ``tensors`` fed as graph inputs."""

    op: str
    tensors: list
    extra: tuple = ()
    kwargs: dict = field(default_factory=dict)


def graph_call(row: Row, inputs: list, params: dict) -> GraphCall:
    """The graph form of ``row.run_functional(inputs, params)``: the wrapper's arguments, Operands for tensors."""
    op, family = row.op, row.op.partition(".")[0]
    if family == "binary" and op.endswith("_scalar"):
        return GraphCall(op.removesuffix("_scalar"), inputs, (params["value"],))
    if op == "creation.arange":
        return GraphCall(op, [], (params["start"], params["end"], params["step"]), {"dtype": params["dtype"]})
    if family == "creation":
        value = (params["value"],) if "value" in params else ()
        return GraphCall(op, [], (params["shape"], *value), {"dtype": params["dtype"]})
    if op == "copy.copy":  # the row's name says the target dtype: to_same, to_float32, ...
        return GraphCall(op, inputs, (), {"dtype": None if row.name == "to_same" else as_dtype(row.name[3:])})
    if op == "llm.embedding":  # kernel order (weight, ids); the wrapper's (ids, weight)
        return GraphCall(op, [inputs[1], inputs[0]])
    if op == "llm.rope":  # the kernel's cos/sin are gathered from positions, which the graph call takes
        positions = torch.tensor(params["positions"], dtype=torch.long)
        return GraphCall(op, [inputs[0], positions], (), {"rotary_dim": params["rotary_dim"],
                                                          "interleaved": params["interleaved"]})
    return GraphCall(op, list(inputs), (), dict(params))


def sharded(c: GraphCall) -> tuple[list, object] | None:
    """Placements of the call's tensors that the op's sharded rule runs as they are, and the output placement it
    gives; None where the inputs have no dim to split (0-d, creation)."""
    shapes = [None if t is None else tuple(t.shape) for t in c.tensors]
    op, family = c.op, c.op.partition(".")[0]
    if not shapes or not shapes[0]:
        return None
    nd = len(shapes[0])
    if family in ("unary", "copy") or op in ("llm.rms_norm", "llm.softmax_last_dim") or (
            family == "binary" and len(shapes) == 1):
        return [S(0)] + [R] * (len(shapes) - 1), S(0)
    if family == "binary":  # both on their last dim, a broadcast (size 1) dim whole
        out = max(len(s) for s in shapes) - 1
        return [R if s[-1] == 1 else S(len(s) - 1) for s in shapes], S(out)
    if family == "reduce":  # a dim other than the reduced one
        dim = c.kwargs["dim"] % nd
        return ([S(0)], S(0)) if dim else ([S(nd - 1)], S(nd - 1 - (not c.kwargs["keepdim"])))
    table = {
        "matmul.mm": ([S(1), S(0)], P),  # row parallel: partial sums
        "matmul.bmm": ([S(0), S(0)], S(0)),
        "llm.embedding": ([R, S(0)], P),  # vocabulary parallel: each device its rows, zeros elsewhere
        "llm.silu_and_mul": ([S(nd - 1)] * 2, S(nd - 1)),  # the two-input form splits the feature dim
        "llm.gelu_tanh_and_mul": ([S(nd - 1)] * 2, S(nd - 1)),
        "llm.rope": ([S(2), R], S(2)),  # heads
        "llm.flash_attention": ([S(2)] * 3, S(2)),  # q heads and kv heads together
        "llm.flash_attention_varlen": ([S(1)] * 3 + [R, R], S(1)),
        "llm.moe_experts": ([R, S(0), S(0), R, R], P),  # expert parallel: each device its experts, partial sums
    }
    if op == "matmul.linear":
        if shapes[2] is not None:
            return [R, S(0), S(0)], S(nd - 1)  # column parallel
        return [S(nd - 1), S(1), None], P  # row parallel
    if family == "conv":
        if c.kwargs["groups"] == 1:
            return [R, S(0), None if shapes[2] is None else S(0)], S(1)  # output channels
        return [S(0), R, None if shapes[2] is None else R], S(0)  # batch
    if op not in table:  # a new op of the registry: say how the test should split it
        raise AssertionError(f"{op}: no sharded placement in tests/test_graph_ops.py's sharded(); add {op!r}: "
                             "([input placements], output placement) to its table, as its placement rule should run")
    return table[op]


def run_call(c: GraphCall, n: int, placements: list | None) -> tuple[torch.Tensor, object]:
    g = LogicalGraph(DeviceMesh.cpu(n))
    operands = [None if t is None else g.input(f"in{i}", t.shape, t.dtype, R if placements is None else placements[i])
                for i, t in enumerate(c.tensors)]
    y = g.call(c.op, *operands, *c.extra, **c.kwargs)
    g.output("y", y)
    feeds = {f"in{i}": t for i, t in enumerate(c.tensors) if t is not None}
    with Runner(g) as r:
        return r.run(feeds)["y"], y.placement


CASES = [pytest.param(row, case, id=f"{row.id}-{case}") for row in ALL_ROWS if F32 in row.dtypes for case in row.cases]


@pytest.mark.parametrize(("row", "case"), CASES)
def test_op_table_through_graphs(row: Row, case: str) -> None:
    torch.manual_seed(0)
    inputs = row.make_inputs(F32, case)
    params = row.params_for(F32, case)
    want = row.run_functional(inputs, params)
    c = graph_call(row, inputs, params)
    rtol, atol = row.tolerance(F32)
    runs = [(1, None, R), (2, None, R)]
    split = sharded(c)
    if split is not None:
        runs.append((2, *split))
    for n, placements, out_pl in runs:
        got, pl = run_call(c, n, placements)
        where = f"{row.id} {case} on cpu({n}) with inputs {placements or 'replicated'}"
        assert pl == out_pl, f"{where}: output placement {pl}, expected {out_pl}"
        assert got.shape == want.shape and got.dtype == want.dtype, f"{where}: {got.shape} {got.dtype}"
        if row.values:
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m, w=where: f"{w}: {m}")


def test_every_registered_op_has_a_rule_a_binding_and_a_graph_test() -> None:
    registered = {r.key.op for r in dtorch.dispatcher.table("cpu")}
    in_table = {row.op for row in ALL_ROWS}
    for op in sorted(registered):
        decl = declared(op) or declared(op.removesuffix("_scalar"))  # binary.add declares add_scalar's graph form
        assert decl is not None, f"{op} has no graph declaration (dtorch.ops.declare)"
        assert decl.rule is not None, f"{op} has no placement rule"
        assert op in in_table or op in GRAPH_TESTED_BELOW, f"{op} is neither in the op table nor tested below"


# -- silu_and_mul, fused: [gate | up] ----------------------------------------------------------------

@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("placement", [R, S(0), S(1, (6, 6)), S(1)], ids=str)
def test_fused_silu_and_mul_keeps_gate_and_up_together(placement, op) -> None:
    # x [4, 2I] = [gate | up] with I = 6; a blocked split gives each device [gate_r | up_r]; a plain S(1) would
    # pair gate with gate, so the graph must gather it first rather than run it as it is
    x = torch.randn(4, 12)
    g = LogicalGraph(DeviceMesh.cpu(2))
    y = g.call(f"llm.{op}", g.input("x", (4, 12), placement=placement))
    g.output("y", y)
    with Runner(g) as r:
        torch.testing.assert_close(r.run({"x": x})["y"], getattr(ops, op)(x), rtol=0, atol=0)
    want = {R: R, S(0): S(0), S(1): R}.get(placement, S(1))
    assert y.placement == want


# -- several outputs, in place -----------------------------------------------------------------------

def _run(g: LogicalGraph, feeds: dict) -> dict:
    with Runner(g) as r:
        return r.run(feeds)


def _state(t: torch.Tensor, mesh: DeviceMesh, placement) -> DistTensor:
    """A placed state with its own storage per device (a replicated piece of ``from_full`` aliases ``t`` on every
    CPU device, so two devices would each update one tensor)."""
    if isinstance(placement, Replicate):
        return DistTensor.from_local([t.clone() for _ in mesh.ids], mesh, placement)
    return DistTensor.from_full(t.clone(), mesh, placement)


@pytest.mark.parametrize(("n", "pl"), [(1, R), (2, R), (2, S(0))], ids=str)
def test_add_rms_norm_two_outputs_and_in_place_residual(n, pl) -> None:
    x, res, w = torch.randn(4, 3, 8), torch.randn(4, 3, 8), torch.randn(8)
    want = ops.add_rms_norm(x, res, w, 1e-5)
    g = LogicalGraph(DeviceMesh.cpu(n))
    xi, wi = g.input("x", x.shape, placement=pl), g.param("w", w)
    out, new = g.call("llm.add_rms_norm", xi, g.input("res", res.shape, placement=pl), wi, eps=1e-5)
    assert (out.placement, new.placement) == (pl, pl)
    state = g.state("stream", _state(res, g.mesh, pl))
    out2, new2 = g.call("llm.add_rms_norm", xi, state, wi, eps=1e-5, residual_out=state)  # in place
    for k, v in {"out": out, "res": new, "out2": out2, "res2": new2}.items():
        g.output(k, v)
    got = _run(g, {"x": x, "res": res})
    for k, j in (("out", 0), ("res", 1), ("out2", 0), ("res2", 1)):
        torch.testing.assert_close(got[k], want[j], rtol=0, atol=0)
    torch.testing.assert_close(g.states["stream"][1].full(), want[1], rtol=0, atol=0)  # the state itself moved on


def _gdn_inputs(b=2, t=5, hk=2, h=4, kd=8, vd=8) -> dict:
    return {"q": torch.randn(b, t, hk, kd), "k": torch.randn(b, t, hk, kd), "v": torch.randn(b, t, h, vd),
            "g": -torch.rand(b, t, h), "beta": torch.rand(b, t, h), "state": torch.randn(b, h, kd, vd)}


@pytest.mark.parametrize(("n", "heads"), [(1, False), (2, False), (2, True)], ids=["cpu1", "cpu2-R", "cpu2-heads"])
def test_gated_delta_net_with_and_without_final_state(n, heads) -> None:
    t = _gdn_inputs()
    o_want, s_want = ops.gated_delta_net(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["state"],
                                         use_qk_l2norm=True)
    g = LogicalGraph(DeviceMesh.cpu(n))
    hp = {"q": S(2), "k": S(2), "v": S(2), "g": S(2), "beta": S(2), "state": S(1)} if heads else {}
    op = {k: g.input(k, v.shape, placement=hp.get(k, R)) for k, v in t.items() if k != "state"}
    state = g.state("state", _state(t["state"], g.mesh, hp.get("state", R)))
    args = (op["q"], op["k"], op["v"], op["g"], op["beta"])
    o, final = g.call("llm.gated_delta_net", *args, initial_state=state, use_qk_l2norm=True)
    only_o = g.call("llm.gated_delta_net", *args, initial_state=state, use_qk_l2norm=True, output_final_state=False)
    o2, new_state = g.call("llm.gated_delta_net", *args, initial_state=state, use_qk_l2norm=True,
                           final_state_out=state)  # the decode step's state advanced in place
    assert (o.placement, final.placement) == ((S(2), S(1)) if heads else (R, R))
    for k, v in {"o": o, "final": final, "only_o": only_o, "o2": o2, "new": new_state}.items():
        g.output(k, v)
    got = _run(g, {k: v for k, v in t.items() if k != "state"})
    for k, want in (("o", o_want), ("only_o", o_want), ("o2", o_want), ("final", s_want), ("new", s_want)):
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.states["state"][1].full(), s_want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "pl"), [(1, None), (2, None), (2, "channels"), (2, "batch")])
def test_causal_conv1d_and_its_in_place_update(n, pl) -> None:
    x, w, b, init = torch.randn(2, 6, 5), torch.randn(6, 4), torch.randn(6), torch.randn(2, 6, 3)
    xt, state0 = torch.randn(2, 6), torch.randn(2, 6, 4)  # one decode step, conv_state S = W = 4
    out_want, final_want = ops.causal_conv1d(x, w, b, init, return_final_states=True, activation="silu")
    state_want = state0.clone()
    step_want = ops.causal_conv1d_update(xt, state_want, w, b, "silu")
    act, wgt = {None: (R, R), "channels": (S(1), S(0)), "batch": (S(0), R)}[pl]
    g = LogicalGraph(DeviceMesh.cpu(n))
    xi, wi, bi = g.input("x", x.shape, placement=act), g.param("w", w, wgt), g.param("b", b, wgt)
    out, final = g.call("llm.causal_conv1d", xi, wi, bi, g.input("init", init.shape, placement=act),
                        return_final_states=True, activation="silu")
    only_out = g.call("llm.causal_conv1d", xi, wi, bi, activation="silu")
    state = g.state("conv_state", _state(state0, g.mesh, act))
    step, new_state = g.call("llm.causal_conv1d_update", g.input("xt", xt.shape, placement=act), state, wi, bi,
                             activation="silu")
    assert (out.placement, final.placement, step.placement, new_state.placement) == (act,) * 4
    for k, v in {"out": out, "final": final, "only": only_out, "step": step, "state": new_state}.items():
        g.output(k, v)
    got = _run(g, {"x": x, "init": init, "xt": xt})
    zero_init = ops.causal_conv1d(x, w, b, activation="silu")[0]
    for k, want in (("out", out_want), ("final", final_want), ("only", zero_init), ("step", step_want),
                    ("state", state_want)):
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(g.states["conv_state"][1].full(), state_want, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2])
def test_kv_cache_ops_sharded_on_heads(n) -> None:
    # 2 sequences, 3 new tokens each into a cache of 4 blocks of 4 rows; q [6, H=4, D=8], Hkv = 2
    kc0, vc0 = torch.randn(4, 4, 2, 8), torch.randn(4, 4, 2, 8)
    key, value, q = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 4, 8)
    slots = torch.tensor([4, 5, 6, 8, 9, 10])
    cu_q, lens, table = (torch.tensor(v, dtype=torch.int32) for v in ([0, 3, 6], [3, 3], [[1, 0], [2, 3]]))
    kc_want, vc_want = ops.reshape_and_cache(key, value, kc0.clone(), vc0.clone(), slots)
    want = ops.flash_attention_with_kvcache(q, kc_want, vc_want, cu_q, lens, table)
    hp = S(1) if n > 1 else R
    g = LogicalGraph(DeviceMesh.cpu(n))
    kc = g.state("kc", _state(kc0, g.mesh, S(2) if n > 1 else R))
    vc = g.state("vc", _state(vc0, g.mesh, S(2) if n > 1 else R))
    ints = [g.input(k, t.shape, t.dtype) for k, t in (("slots", slots), ("cu", cu_q), ("lens", lens), ("table", table))]
    kc2, vc2 = g.call("llm.reshape_and_cache", g.input("key", key.shape, placement=hp),
                      g.input("value", value.shape, placement=hp), kc, vc, ints[0])
    y = g.call("llm.flash_attention_with_kvcache", g.input("q", q.shape, placement=hp), kc2, vc2, *ints[1:])
    assert y.placement == hp
    g.output("y", y)
    got = _run(g, {"slots": slots, "cu": cu_q, "lens": lens, "table": table, "key": key, "value": value, "q": q})
    torch.testing.assert_close(got["y"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g.states["kc"][1].full(), kc_want, rtol=0, atol=0)


# -- derived params and placements the graph refuses --------------------------------------------------

def test_derived_params_match_the_wrappers() -> None:
    g = LogicalGraph(DeviceMesh.cpu(1))
    q = g.input("q", (1, 2, 4, 16))
    att = g.call("llm.flash_attention", q, q, q)
    assert att.producer.params.scale == 16 ** -0.5 and att.producer.params.causal is False
    rope = g.call("llm.rope", q, g.input("p", (2,), torch.int64), rotary_dim=8, theta=500.0)
    inv = ops.rope_inv_freq(8, 500.0)
    assert rope.producer.params.rotary_dim == 8 and torch.equal(torch.tensor(rope.producer.params.inv_freq), inv)
    conv = g.call("conv.conv1d", g.input("x", (1, 2, 9)), g.param("w", torch.randn(3, 2, 3)), stride=2)
    assert conv.producer.params.stride == (2,) and conv.producer.params.padding == (0,)
    assert g.call("llm.rms_norm", q, g.param("w2", torch.ones(16))).producer.params.eps == 1e-6


def test_heads_that_do_not_split_evenly_split_in_whole_groups() -> None:
    # H = 6 query heads over Hkv = 3 kv heads on 2 devices: a plain split gives 3 + 3 query heads but 2 + 1 kv
    # heads, which cuts a group; the rule splits q in whole groups of G = 2 heads instead (4 + 2)
    shapes = [(1, 2, 6, 8), (1, 2, 3, 8), (1, 2, 3, 8)]
    params = dense_params(8)
    assert all(s.inputs[0] != S(2) for s in candidates("llm.flash_attention", shapes, params, 2))
    assert choose("llm.flash_attention", shapes, [S(2)] * 3, params, n=2).output == Shard(2, None, 2)
    assert choose("llm.flash_attention", [(1, 2, 6, 8), (1, 2, 2, 8), (1, 2, 2, 8)], [S(2)] * 3, params,
                  n=2).output == S(2)
    g = LogicalGraph(DeviceMesh.cpu(2))
    q, k, v = (torch.randn(s) for s in shapes)
    named = zip("qkv", (q, k, v), strict=True)
    out = g.call("llm.flash_attention", *(g.input(n, t.shape, placement=S(2)) for n, t in named))
    assert out.placement == Shard(2, None, 2) and out.local_shapes == {0: (1, 2, 4, 8), 1: (1, 2, 2, 8)}
    g.output("o", out)
    with Runner(g) as r:
        torch.testing.assert_close(r.run({"q": q, "k": k, "v": v})["o"], ops.flash_attention(q, k, v))


def test_a_written_input_that_cannot_run_as_placed_is_refused_naming_the_op() -> None:
    g = LogicalGraph(DeviceMesh.cpu(2))
    w = g.param("w", torch.randn(6, 4))
    bad = g.state("s", _state(torch.randn(2, 6, 4), g.mesh, S(2)))  # conv_state split on time
    with pytest.raises(dtorch.GraphError, match=r"llm\.causal_conv1d_update.*S\(2\)"):
        g.call("llm.causal_conv1d_update", g.input("x", (2, 6)), bad, w)
    h = g.state("h", _state(torch.randn(3, 8), g.mesh, S(1)))  # the normalized dim split
    with pytest.raises(dtorch.GraphError, match=r"llm\.rms_norm.*S\(1\)"):
        g.call("llm.rms_norm", h, g.param("nw", torch.ones(8)), out=h)


def test_bad_graph_calls_name_the_op_and_argument() -> None:
    g = LogicalGraph(DeviceMesh.cpu(1))
    x = g.input("x", (2, 8))
    with pytest.raises(dtorch.ArgumentError, match=r"llm\.rms_norm.*'weight'"):
        g.call("llm.rms_norm", x, torch.ones(8))
    with pytest.raises(dtorch.ArgumentError, match=r"llm\.rms_norm.*'out' may only be 'x'"):
        g.call("llm.rms_norm", x, g.param("w", torch.ones(8)), out=g.input("y", (2, 8)))
    with pytest.raises(dtorch.ArgumentError, match=r"llm\.rope.*'x' is a required tensor"):
        g.call("llm.rope", None, g.input("p", (2,), torch.int64))
    with pytest.raises(dtorch.ArgumentError, match=r"reduce\.sum"):
        g.call("reduce.sum", x, 0, 1, 2)
    with pytest.raises(dtorch.ArgumentError, match="'scale'"):
        g.call("llm.flash_attention", *[g.input(k, (1, 2, 2, 8)) for k in "qkv"], scale="big")
    with pytest.raises(dtorch.ShapeError, match=r"graph operator llm\.silu_and_mul#\d+.*even"):
        g.call("llm.silu_and_mul", g.input("odd", (2, 7)))
    with pytest.raises(dtorch.ArgumentError, match="device"):
        g.call("creation.zeros", (2, 3), device="cpu")
    assert g.call("creation.arange", 5).shape == (5,) and g.call("creation.full", (2, 2), 3).dtype == F32


def test_rope_positions_may_follow_a_batch_or_token_split() -> None:
    x, pos = torch.randn(2, 3, 4, 8), torch.tensor([[0, 5, 9], [1, 2, 3]])
    want = ops.rope(x, pos)
    for xp, pp in ((S(0), S(0)), (S(1), S(1))):
        g = LogicalGraph(DeviceMesh.cpu(2))
        y = g.call("llm.rope", g.input("x", x.shape, placement=xp), g.input("p", pos.shape, torch.int64, pp))
        assert y.placement == xp
        g.output("y", y)
        # a device's piece of a token split is a strided view: a kernel may take another code path for it than
        # for the whole (the native rope runs contiguous rows itself), so equal up to float32 rounding
        torch.testing.assert_close(_run(g, {"x": x, "p": pos})["y"], want, rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("placement", [Replicate(), Shard(1)])
def test_rope_with_gathered_tables_equals_rope_at_positions(placement) -> None:
    # a step gathers cos/sin once (RoPE.tables) and every layer rotates with them: the same as rope(x, positions)
    torch.manual_seed(0)
    x, pos = torch.randn(5, 4, 16), torch.tensor([0, 3, 7, 2, 9])
    rope = ops.RoPE(16, max_positions=16).prepare(ops.OperatorInitContext("cpu", torch.float32))
    t = rope.tables(pos)
    want = ops.rope(x, pos)
    torch.testing.assert_close(ops.rope_cached(x, t.cos, t.sin), want)
    g = LogicalGraph(DeviceMesh.cpu(2))
    out = g.call("llm.rope_cached", g.input("x", x.shape, placement=placement), g.input("cos", t.cos.shape),
                 g.input("sin", t.sin.shape))
    assert out.placement == placement and out.producer.op == "llm.rope"
    g.output("y", g.redistribute(out, Replicate()))
    with Runner(g) as r:
        torch.testing.assert_close(r.run({"x": x, "cos": t.cos, "sin": t.sin})["y"], want)
    with pytest.raises(dtorch.ShapeError, match="'cos' must be float32"):
        ops.rope_cached(x, t.cos[:3], t.sin)
