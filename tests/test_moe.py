"""``llm.moe_router`` and ``llm.moe_experts``: against torch math and transformers' Qwen3-MoE modules, every
provider, the expert offset of expert parallelism, no host read in decode, graphs on cpu(2) (tokens, expert
parallel, tensor parallel) and the wrappers' errors. The experts' op-table row is in tests/op_table_llm.py."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
)

import dtorch
from dtorch import ops
from dtorch.dispatch.key import KernelKey
from dtorch.graph import DeviceMesh, LogicalGraph, Partial, Replicate, Shard
from dtorch.kernels.torch import moe as moe_kernels
from dtorch.runtime import Runner

R, P, S = Replicate(), Partial(), Shard
ALL_PROVIDERS = ("reference", "torch", "native")
PROVIDERS = tuple(p for p in ALL_PROVIDERS if p not in dtorch.dispatcher.unavailable("cpu"))
ROUTER_PROVIDERS = ("reference", "torch")  # the router has no native kernel
HALF = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 5e-2), torch.float16: (1e-2, 2e-2)}


def only(provider: str):
    """Every other provider of the MoE ops disabled (with "native", which has only the experts op, the router keeps
    its torch kernel, below native's priority)."""
    keep = {provider, "torch"} if provider == "native" else {provider}
    return dtorch.dispatcher.disabled(*(set(ALL_PROVIDERS) - keep))


def _config(experts=8, top_k=2, norm=True, hidden=16, inter=8) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                          num_experts_per_tok=top_k, norm_topk_prob=norm)


def _block(cfg: Qwen3MoeConfig, dtype=torch.float32) -> Qwen3MoeSparseMoeBlock:
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block.to(dtype)


# -- router ----------------------------------------------------------------------------------------

def _router_math(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.exp(logits.double() - logits.double().logsumexp(-1, keepdim=True))
    top, ids = probs.sort(dim=-1, descending=True, stable=True)
    top, ids = top[:, :k], ids[:, :k]
    return (top / top.sum(-1, keepdim=True) if norm else top).to(logits.dtype), ids


@pytest.mark.parametrize("provider", ROUTER_PROVIDERS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 0])
def test_router_matches_torch_math(provider, norm, dtype, tokens) -> None:
    logits = torch.randn(tokens, 8).to(dtype)
    want_w, want_ids = _router_math(logits, 3, norm)
    with only(provider):
        w, ids = ops.moe_router(logits, 3, norm)
        w2, ids2 = torch.empty_like(w), torch.empty_like(ids)
        assert ops.moe_router_out(logits, 3, norm, weights_out=w2, ids_out=ids2) == (w2, ids2)
    assert ids.dtype == torch.int64 and w.dtype == dtype and torch.equal(ids, want_ids) and torch.equal(ids2, ids)
    torch.testing.assert_close(w, want_w, rtol=HALF.get(dtype, (1e-6, 1e-6))[0], atol=HALF.get(dtype, (1e-6, 1e-6))[1])
    torch.testing.assert_close(w2, w, rtol=0, atol=0)


@pytest.mark.parametrize("provider", ROUTER_PROVIDERS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_router_equals_transformers_ties_included(provider, norm, dtype) -> None:
    router = Qwen3MoeTopKRouter(_config(experts=6, top_k=3, norm=norm)).to(dtype)
    x = torch.randn(9, 16).to(dtype)
    with torch.no_grad():
        router.weight.normal_()
        router.weight[4] = router.weight[1]  # experts 1 and 4 tie for every token
        router.weight[5] = router.weight[2]
        logits, want_w, want_ids = router(x)
    with only(provider):
        w, ids = ops.moe_router(logits, 3, norm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=0, atol=0)


# -- experts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 64])  # decode (gathered path), a few and many tokens (grouped)
def test_sparse_block_equals_transformers(provider, dtype, tokens) -> None:
    cfg = _config(experts=8, top_k=2, norm=False)
    block = _block(cfg, dtype)
    x = torch.randn(1, tokens, 16).to(dtype)
    with torch.no_grad():
        want = block(x)[0]
        with only(provider):
            w, ids = ops.moe_router(x[0] @ block.gate.weight.T, 2, False)
            got = ops.moe_experts(x[0], block.experts.gate_up_proj, block.experts.down_proj, w, ids)
    rtol, atol = HALF[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("tokens", [1, 2, 40])
def test_expert_start_pieces_sum_to_the_whole(provider, tokens) -> None:
    # the expert-parallel form: each piece of the experts with its offset; ids elsewhere contribute nothing
    experts = Qwen3MoeExperts(_config(experts=6, top_k=3))
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    wgu, wd = experts.gate_up_proj.detach(), experts.down_proj.detach()
    x, logits = torch.randn(tokens, 16), torch.randn(tokens, 6)
    w, ids = ops.moe_router(logits, 3, True)
    with torch.no_grad():
        want = experts(x, ids, w)
    total = torch.zeros_like(x)
    with only(provider):
        for lo, hi in ((0, 2), (2, 5), (5, 6)):
            part = torch.empty_like(x)
            ops.invoke("llm.moe_experts", [x, wgu[lo:hi], wd[lo:hi], w, ids], [part], {"expert_start": lo})
            total += part
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("start", [0, 2])
def test_decode_reads_nothing_back_from_the_device(monkeypatch, start) -> None:
    """The torch kernel's decode path for accelerators (T * k <= E / 4, off cpu) never calls .tolist() / .item()
    on a tensor. On cpu the kernel takes _experts_host instead, whose host read of the ids is free there; so this
    calls the accelerators' path, _experts_gathered, directly (with cpu tensors) rather than through dispatch."""
    x, wgu, wd = torch.randn(1, 16), torch.randn(8, 16, 16), torch.randn(8, 16, 8)
    w, ids = ops.moe_router(torch.randn(1, 10), 2, True)
    want = torch.empty_like(x)
    with only("reference"):
        ops.invoke("llm.moe_experts", [x, wgu, wd, w, ids], [want], {"expert_start": start})

    def host_read(*a, **k):
        raise AssertionError("host read of a device value in the decode step")

    monkeypatch.setattr(torch.Tensor, "tolist", host_read)
    monkeypatch.setattr(torch.Tensor, "item", host_read)
    assert ids.numel() * moe_kernels.GATHER_EXPERTS_PER_PAIR <= wgu.shape[0]  # the size the kernel sends there
    flat, wf = moe_kernels._local_ids(ids, w, start, wgu.shape[0])
    out = torch.empty_like(x)
    moe_kernels._experts_gathered(x, wgu, wd, flat, wf, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (1, 8, 4), (2, 16, 4), (4, 64, 8), (3, 8, 2)])
def test_cpu_paths_agree(tokens, experts, top_k, dtype) -> None:
    # the torch kernel on cpu (host path for few pairs, grouped beyond) against the accelerators' gathered path
    # and the reference, repeated experts across tokens and an expert-parallel piece included
    torch.manual_seed(1)
    x = torch.randn(tokens, 16, dtype=dtype)
    wgu, wd = torch.randn(experts, 12, 16, dtype=dtype) * 0.25, torch.randn(experts, 16, 6, dtype=dtype) * 0.25
    ids = torch.randint(0, experts + 3, (tokens, top_k))
    ids[:, 0] = ids[0, 0].clamp(3, experts + 2)  # every token on one expert (a group of several tokens)
    w = torch.rand(tokens, top_k, dtype=dtype)
    for start in (0, 3):
        want, got = torch.empty_like(x), torch.empty_like(x)
        with only("reference"):
            ops.invoke("llm.moe_experts", [x, wgu, wd, w, ids], [want], {"expert_start": start})
        with only("torch"):
            ops.invoke("llm.moe_experts", [x, wgu, wd, w, ids], [got], {"expert_start": start})
        flat, wf = moe_kernels._local_ids(ids, w, start, experts)
        gathered = torch.empty_like(x)
        moe_kernels._experts_gathered(x, wgu, wd, flat, wf, gathered)
        rtol, atol = HALF.get(dtype, (1e-5, 1e-5))
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        torch.testing.assert_close(gathered, want, rtol=rtol, atol=atol)


def test_the_faster_kernels_win_on_cpu() -> None:
    native = "native" not in dtorch.dispatcher.unavailable("cpu")
    assert dtorch.dispatcher.explain(KernelKey("llm.moe_router", "cpu", torch.bfloat16)).winner.provider == "torch"
    key = KernelKey("llm.moe_experts", "cpu", torch.bfloat16)
    assert dtorch.dispatcher.explain(key).winner.provider == ("native" if native else "torch")
    with dtorch.dispatcher.disabled("native"):
        assert dtorch.dispatcher.explain(key).winner.provider == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "start"), [(1, 0), (3, 0), (8, 0), (1, 4), (40, 0)])
def test_every_experts_kernel_matches_the_reference(dtype, tokens, start) -> None:
    """Each cpu provider (native: few tokens through our GEMV, many handed to torch's grouped kernel; torch;
    reference) on one device's piece of the experts (``expert_start``: ids outside it add nothing)."""
    from dtorch.core.device import Device
    from dtorch.dispatch.context import KernelContext, KernelParams

    torch.manual_seed(tokens + start)
    e, h, inter, k = 8, 48, 24, 2
    x = torch.randn(tokens, h).to(dtype)
    wgu, wd = (torch.randn(e, 2 * inter, h) * 0.2).to(dtype), (torch.randn(e, h, inter) * 0.2).to(dtype)
    ids = torch.stack([torch.randperm(e + start)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k).to(dtype)
    key = KernelKey("llm.moe_experts", "cpu", dtype)
    ctx = KernelContext(Device("cpu"), None, None, KernelParams(expert_start=start))
    want = torch.empty(tokens, h, dtype=dtype)
    ref = next(c for c, _ in dtorch.dispatcher.explain(key).rows if c.provider == "reference")
    ref.fn(ctx, (x, wgu, wd, w, ids), (want,))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    for cand, _ in dtorch.dispatcher.explain(key).rows:
        got = torch.empty_like(want)
        cand.fn(ctx, (x, wgu, wd, w, ids), (got,))
        torch.testing.assert_close(got, want, **tol, msg=f"{cand.provider}")


# -- graphs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "layout"), [(1, "replicated"), (2, "replicated"), (2, "tokens"), (2, "experts"),
                                           (2, "features")])
def test_moe_layer_as_a_graph(n, layout) -> None:
    """router -> experts on a mesh: the expert-parallel and tensor-parallel layouts give partial sums that the graph
    reduces; every layout equals the single-device ops."""
    torch.manual_seed(0)
    x, wr, wgu, wd = torch.randn(10, 16), torch.randn(5, 16), torch.randn(5, 12, 16), torch.randn(5, 16, 6)
    w_want, ids_want = ops.moe_router(ops.linear(x, wr), 2, True)
    want = ops.moe_experts(x, wgu, wd, w_want, ids_want)
    act, gu, dn, out_pl = {"replicated": (R, R, R, R), "tokens": (S(0), R, R, S(0)),
                           "experts": (R, S(0), S(0), P), "features": (R, S(1, (6, 6)), S(2), P)}[layout]
    g = LogicalGraph(DeviceMesh.cpu(n))
    xi = g.input("x", x.shape, placement=act)
    logits = g.call("matmul.linear", xi, g.param("wr", wr))
    w, ids = g.call("llm.moe_router", logits, 2, True)
    y = g.call("llm.moe_experts", xi, g.param("wgu", wgu, gu), g.param("wd", wd, dn), w, ids)
    assert y.placement == out_pl
    for k, v in {"y": y, "w": w, "ids": ids}.items():
        g.output(k, v)
    with Runner(g) as r:
        got = r.run({"x": x})
    assert torch.equal(got["ids"], ids_want)
    torch.testing.assert_close(got["w"], w_want, rtol=0, atol=0)
    torch.testing.assert_close(got["y"], want, rtol=1e-5, atol=1e-5)


# -- errors ----------------------------------------------------------------------------------------

def _experts_args(**change) -> dict:
    a = {"x": torch.randn(3, 8), "w_gate_up": torch.randn(4, 12, 8), "w_down": torch.randn(4, 8, 6),
         "weights": torch.rand(3, 2), "ids": torch.tensor([[0, 1], [2, 3], [3, 0]])}
    return a | change


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"x": torch.randn(3, 8).int()}, dtorch.DTypeError, "'x'"),
    ({"weights": torch.rand(3, 2).double()}, dtorch.DTypeError, "'weights'"),
    ({"ids": torch.tensor([[0, 1], [2, 3], [3, 0]], dtype=torch.int32)}, dtorch.DTypeError, "'ids' must be int64"),
    ({"x": torch.randn(3, 1, 8)}, dtorch.ShapeError, "'x' must have rank 2"),
    ({"w_gate_up": torch.randn(4, 11, 8)}, dtorch.ShapeError, r"'w_gate_up' must have shape \[E, 2I, H\]"),
    ({"w_gate_up": torch.randn(4, 12, 7)}, dtorch.ShapeError, "'w_gate_up'"),
    ({"w_down": torch.randn(3, 8, 6)}, dtorch.ShapeError, r"'w_down' must have shape \[E, H, I\] = \(4, 8, 6\)"),
    ({"weights": torch.rand(2, 2)}, dtorch.ShapeError, "'weights' must have shape"),
    ({"ids": torch.tensor([[0, 1], [2, 3]])}, dtorch.ShapeError, "'ids' must have the shape of 'weights'"),
    ({"ids": torch.tensor([[0, 1], [2, 4], [3, 0]])}, dtorch.ArgumentError, "'ids' holds expert 4"),
    ({"ids": torch.tensor([[0, -1], [2, 3], [3, 0]])}, dtorch.ArgumentError, "'ids' holds expert -1"),
], ids=lambda v: None)
def test_experts_errors_name_the_argument(change, error, match) -> None:
    with pytest.raises(error, match=match):
        ops.moe_experts(**_experts_args(**change))
    with pytest.raises(error, match=match):
        ops.moe_experts_out(**_experts_args(**change), out=torch.empty(3, 8))


@pytest.mark.parametrize(("logits", "top_k", "norm", "error", "match"), [
    (torch.randn(3, 4), 0, True, dtorch.ArgumentError, r"'top_k' must be an int in 1\.\.4"),
    (torch.randn(3, 4), 5, True, dtorch.ArgumentError, "'top_k'"),
    (torch.randn(3, 4), 2.0, True, dtorch.ArgumentError, "'top_k'"),
    (torch.randn(3, 4), True, True, dtorch.ArgumentError, "'top_k'"),
    (torch.randn(3, 4), 2, 1, dtorch.ArgumentError, "'norm_topk_prob' must be a bool"),
    (torch.randn(3, 4).long(), 2, True, dtorch.DTypeError, "'logits'"),
    (torch.randn(2, 3, 4), 2, True, dtorch.ShapeError, "'logits' must have rank 2"),
], ids=lambda v: None)
def test_router_errors_name_the_argument(logits, top_k, norm, error, match) -> None:
    with pytest.raises(error, match=match):
        ops.moe_router(logits, top_k, norm)


def test_out_forms_check_their_outputs() -> None:
    logits = torch.randn(3, 4)
    with pytest.raises(dtorch.DTypeError, match="'ids_out' must have dtype int64"):
        ops.moe_router_out(logits, 2, weights_out=torch.empty(3, 2), ids_out=torch.empty(3, 2))
    with pytest.raises(dtorch.ShapeError, match="'weights_out' must have shape"):
        ops.moe_router_out(logits, 2, weights_out=torch.empty(3, 3), ids_out=torch.empty(3, 2, dtype=torch.int64))
    with pytest.raises(dtorch.ShapeError, match="'out' must have shape"):
        ops.moe_experts_out(**_experts_args(), out=torch.empty(3, 9))


def test_bad_graph_call_fails_at_build_time() -> None:
    g = LogicalGraph(DeviceMesh.cpu(1))
    with pytest.raises(dtorch.ArgumentError, match=r"llm\.moe_router.*'top_k'"):
        g.call("llm.moe_router", g.input("logits", (2, 4)), 9, True)
