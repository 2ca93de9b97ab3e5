"""Sparse mixture of experts: ``llm.moe_router`` and ``llm.moe_experts``, as transformers' Qwen3-MoE /
Qwen3-Next sparse MoE block computes them (``Qwen3MoeTopKRouter`` and ``Qwen3MoeExperts``).

The reference kernels define the ops; the "torch" kernels registered over them give the same results
with fewer passes, and the experts one, off cpu, without reading any device value on the host for small
batches (decode); on cpu, where reading the ids is free, it runs the selected experts on views of their
own matrices instead. The wrappers in ``dtorch.ops.moe`` validate shapes, dtypes and ``top_k`` before any kernel runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.kernels.torch.registry import FLOATS, KERNELS

# -- moe_router ----------------------------------------------------------------------------------
# inputs: logits [T, E]; outputs: weights [T, k] (logits' dtype), ids [T, k] int64; params: top_k,
# norm_topk_prob. probs = softmax(logits) in float32 (float64 logits too, as transformers); the k largest by
# torch.topk (its order, ties included); with norm_topk_prob they are divided by their sum; then cast.


@KERNELS.kernel("llm.moe_router", FLOATS)
def moe_router_reference(ctx, inputs, outputs):
    logits = inputs[0]
    weights, ids = outputs
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    top, idx = torch.topk(probs, ctx.params.top_k, dim=-1)
    if ctx.params.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    weights.copy_(top)
    ids.copy_(idx)


@KERNELS.kernel("llm.moe_router", FLOATS, provider="torch")
def moe_router_torch(ctx, inputs, outputs):
    # the same math written into the outputs: topk straight into them when they are float32
    logits = inputs[0]
    weights, ids = outputs
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    top = weights if weights.dtype is torch.float32 else torch.empty(weights.shape, dtype=torch.float32,
                                                                    device=weights.device)
    torch.topk(probs, ctx.params.top_k, dim=-1, out=(top, ids))
    if ctx.params.norm_topk_prob:
        top.div_(top.sum(-1, keepdim=True))
    if top is not weights:
        weights.copy_(top)


# -- moe_experts ---------------------------------------------------------------------------------
# inputs: x [T, H], w_gate_up [E, 2I, H] (rows 0..I-1 the gate, I..2I-1 the up projection, as
# Qwen3MoeExperts.gate_up_proj), w_down [E, H, I], weights [T, k] (x's dtype), ids [T, k] int64;
# outputs: out [T, H] = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j].
# params: expert_start (optional): the weights hold experts expert_start .. expert_start + E - 1 of a larger
# set (one device's piece under expert parallelism); ids outside that range contribute nothing, so the
# pieces' outputs sum to the whole layer. Matmuls and the weighting in x's dtype, as transformers.


def _expert_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [N, H] through one expert: w_gate_up [2I, H], w_down [H, I] -> [N, H]."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


# Not capture-safe: the reference finds each expert's pairs with torch.where(local == e) (a nonzero); the torch
# kernel reads the ids or the group sizes on the host (cpu, and prefill everywhere).
READS_IDS = KernelMeta(capture_safe=False)


@KERNELS.kernel("llm.moe_experts", FLOATS, meta=READS_IDS)
def moe_experts_reference(ctx, inputs, outputs):
    x, w_gate_up, w_down, weights, ids = inputs
    out = outputs[0]
    local = ids - (ctx.params.get("expert_start") or 0)
    acc = torch.zeros_like(out)
    for e in range(w_gate_up.shape[0]):
        tok, slot = torch.where(local == e)  # the (token, slot) pairs routed to expert e
        y = _expert_mlp(x[tok], w_gate_up[e], w_down[e]) * weights[tok, slot, None]
        acc.index_add_(0, tok, y)
    out.copy_(acc)


# With at most one (token, slot) pair per GATHER_EXPERTS_PER_PAIR experts (decode: T = 1, or a few tokens), the
# torch kernel gathers each pair's expert matrices and runs one batched matmul: no host read of the ids at all,
# and it reads about the k experts' weights a grouped loop would (the copy is the price; measured on cpu, it wins
# or ties up to N <= E / 4 and loses beyond). Above it, it sorts the pairs by expert and runs one matmul per expert
# that has tokens, which needs the group sizes on the host: one read per call, in prefill only. Under expert
# parallelism E is the device's own experts, so the gathered path needs proportionally fewer tokens.
# On cpu a host read costs nothing, so small batches take _experts_host instead (no weight copies): with at most
# one pair per HOST_EXPERTS_PER_PAIR experts. Measured (H=576, I=256, float32, 1 and 2 threads, E/k = 8/2,
# 32/4, 64/8): it beats the grouped path by 15-30% at T = 1, ties it at N = E / 2 and loses from N = E on; the
# gathered path loses to both on cpu at every N (1.4-3x at T = 1, 5-20x at N = E).
GATHER_EXPERTS_PER_PAIR = 4
HOST_EXPERTS_PER_PAIR = 2


def _local_ids(ids: torch.Tensor, weights: torch.Tensor, start: int, experts: int):
    """Flattened ids [N] shifted into 0..E-1 (others: E) and their weights [N]."""
    flat = ids.reshape(-1) - start if start else ids.reshape(-1)
    outside = (flat < 0) | (flat >= experts)
    return flat.masked_fill(outside, experts), weights.reshape(-1)


def _experts_gathered(x, w_gate_up, w_down, flat, w, out) -> None:
    # every pair (token t, slot j) -> n = t * k + j; its expert's matrices gathered: [N, 2I, H] and [N, H, I]
    e, k = w_gate_up.shape[0], flat.numel() // max(x.shape[0], 1)
    outside = flat == e
    safe = flat.masked_fill(outside, 0)
    xs = x.repeat_interleave(k, 0).unsqueeze(-1)                                   # [N, H, 1]
    gate, up = torch.bmm(w_gate_up.index_select(0, safe), xs).squeeze(-1).chunk(2, dim=-1)  # [N, I] each
    y = torch.bmm(w_down.index_select(0, safe), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [N, H]
    y.mul_(w.masked_fill(outside, 0).unsqueeze(-1))
    torch.sum(y.view(x.shape[0], k, -1), 1, out=out)


def _experts_grouped(x, w_gate_up, w_down, flat, w, out) -> None:
    e, k = w_gate_up.shape[0], flat.numel() // max(x.shape[0], 1)
    order = torch.argsort(flat, stable=True)                     # pairs grouped by expert, the outside ones last
    counts = torch.bincount(flat, minlength=e + 1)[:e].tolist()  # the one host read: group sizes
    tok = order // k
    xs, ws = x.index_select(0, tok), w.index_select(0, order)    # [N, H], [N] in expert order
    acc = torch.zeros_like(out)
    lo = 0
    for i, n in enumerate(counts):
        if n:
            y = _expert_mlp(xs[lo:lo + n], w_gate_up[i], w_down[i]).mul_(ws[lo:lo + n, None])
            acc.index_add_(0, tok[lo:lo + n], y)
        lo += n
    out.copy_(acc)


def _experts_one_token(x, w_gate_up, w_down, ids: list[int], w, out) -> None:
    # cpu decode, x [1, H], ids the k local expert ids read on the host (E: outside this piece, skipped): each
    # selected expert's gate/up a matrix-vector product into one [k, 2I] buffer (mv beats a [1, H] matmul there),
    # one silu-and-mul over [k, I], the router weights [k] applied to those rows (down is linear: the same sum,
    # rounded once less in low precision), the down products accumulated into out
    e, inter = w_gate_up.shape[0], w_down.shape[2]
    pairs = [(n, i) for n, i in enumerate(ids) if i != e]
    if not pairs:
        out.zero_()
        return
    gu = x.new_empty(len(pairs), 2 * inter)
    for row, (_, i) in zip(gu, pairs, strict=True):
        torch.mv(w_gate_up[i], x[0], out=row)
    h = F.silu(gu[:, :inter]).mul_(gu[:, inter:])                                  # [k, I]
    h.mul_((w if len(pairs) == len(ids) else w[[n for n, _ in pairs]]).unsqueeze(-1))
    torch.mm(h[:1], w_down[pairs[0][1]].t(), out=out)  # down: [1, I] matmuls beat mv with 2 threads
    for j, (_, i) in enumerate(pairs[1:], 1):
        out.addmm_(h[j:j + 1], w_down[i].t())


def _experts_host(x, w_gate_up, w_down, flat, w, out) -> None:
    # cpu only: the ids read on the host (free there), the pairs grouped by expert in Python and each expert's
    # two products run on views of its own matrices: no weight copies, each selected expert's weights read once
    if x.shape[0] == 1:
        _experts_one_token(x, w_gate_up, w_down, flat.tolist(), w, out)
        return
    e, k = w_gate_up.shape[0], flat.numel() // max(x.shape[0], 1)
    groups: dict[int, list[int]] = {}
    for n, i in enumerate(flat.tolist()):
        if i != e:
            groups.setdefault(i, []).append(n)
    acc = torch.zeros_like(out)
    for i, pairs in groups.items():
        if len(pairs) == 1:  # one token: views, no index tensors
            n = pairs[0]
            t = n // k
            y = _expert_mlp(x[t:t + 1], w_gate_up[i], w_down[i]).mul_(w[n:n + 1, None])
            acc[t:t + 1].add_(y)
        else:
            idx = torch.tensor(pairs, device=x.device)
            tok = idx // k
            y = _expert_mlp(x.index_select(0, tok), w_gate_up[i], w_down[i]).mul_(w.index_select(0, idx)[:, None])
            acc.index_add_(0, tok, y)
    out.copy_(acc)


@KERNELS.kernel("llm.moe_experts", FLOATS, provider="torch", meta=READS_IDS)
def moe_experts_torch(ctx, inputs, outputs):
    x, w_gate_up, w_down, weights, ids = inputs
    out = outputs[0]
    experts = w_gate_up.shape[0]
    flat, w = _local_ids(ids, weights, ctx.params.get("expert_start") or 0, experts)
    if not flat.numel():
        out.zero_()
    elif x.device.type == "cpu":  # a host read is free: no gather (the weight copies), no argsort for few pairs
        if flat.numel() * HOST_EXPERTS_PER_PAIR <= experts:
            _experts_host(x, w_gate_up, w_down, flat, w, out)
        else:
            _experts_grouped(x, w_gate_up, w_down, flat, w, out)
    elif flat.numel() * GATHER_EXPERTS_PER_PAIR <= experts:  # accelerators' decode: no host sync
        _experts_gathered(x, w_gate_up, w_down, flat, w, out)
    else:
        _experts_grouped(x, w_gate_up, w_down, flat, w, out)


# The gathered path alone, as its own candidate for captured steps: it reads nothing on the host. It loses to the
# kernels above when nothing is captured (they read the ids where that is free or needed), so it ranks below them;
# its check bounds the gathered weights, the price of not reading the ids (Qwen3-30B-A3B: one token's 8 experts are
# 38M elements, 32 tokens' 1.2G, declined: such a step runs uncaptured).
GATHER_LIMIT = 2**28  # elements of the gathered expert matrices of one call


def _gather_fits(call: Call) -> str | None:
    if call.inputs is None:
        return "chosen on the call's shapes (the gathered expert matrices must fit GATHER_LIMIT)"
    x, w_gate_up, w_down, _, ids = call.inputs
    size = ids.numel() * (w_gate_up[0].numel() + w_down[0].numel())
    return None if size <= GATHER_LIMIT else f"{ids.numel()} (token, expert) pairs would gather {size} weight " \
                                             f"elements > {GATHER_LIMIT}"


@KERNELS.kernel("llm.moe_experts", FLOATS, provider="gathered", priority=5, check=_gather_fits,
                 varies="the experts of every (token, slot) pair gathered and run as one batched matmul")
def moe_experts_gathered(ctx, inputs, outputs):
    x, w_gate_up, w_down, weights, ids = inputs
    out = outputs[0]
    flat, w = _local_ids(ids, weights, ctx.params.get("expert_start") or 0, w_gate_up.shape[0])
    if flat.numel():
        _experts_gathered(x, w_gate_up, w_down, flat, w, out)
    else:
        out.zero_()
