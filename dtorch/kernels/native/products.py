"""The native products as dispatcher kernels, each next to its registration on ``registry.KERNELS``: matmul.linear on
GGUF block-quantized weights, on float (bf16) weights and on 16-bit weights beside wider activations, llm.moe_experts
for few tokens, and llm.embedding on GGUF weights. Every kernel has the ABI of the torch backend's kernel for the same
key, and what the compiled code does not take goes to that kernel (``kernels.py``'s docstring says more)."""

from __future__ import annotations

import functools

import torch

from dtorch.core import env
from dtorch.core.dtypes import GGUF_LAYOUTS, GGUF_X16_LAYOUTS
from dtorch.core.errors import DtorchError
from dtorch.kernels import layouts
from dtorch.kernels.half import HALF_LAYOUTS
from dtorch.kernels.native.registry import ACTIVATIONS, KERNELS, NATIVE, lib
from dtorch.kernels.torch import half as torch_half, moe as torch_moe, quantized as torch_quantized

# -- matmul.linear on GGUF weights -------------------------------------------------------------------------
# inputs: x [..., K] (float32 / bfloat16: the key's dtype), w uint8 [N, row_bytes(layout, K)], bias [N] or None;
# params: coarse (optional): each row's precision may be traded for speed (a prompt's rows, a batch of decodes).
# outputs: out [..., N]. Under 32 rows x is quantized inside to int8 levels per 32 values (two; one for coarse rows, 4
# and more, in the super-grouped formats, and for every row under DTORCH_ONE_LEVEL=1), else w is dequantized in panels
# for oneDNN's float32 GEMM (torch's mm without it; see ops.qlinear), except on AVX-512 VNNI, whose integer tiles keep
# all but q2_k and q3_k: coarse rows at every row count, others under 128 rows per thread (q4_k, q5_k, iq4_xs and q8_0
# at every row count); the reference (torch backend) dequantizes w with layouts.dequantize and runs F.linear.

def _one_level(ctx) -> int:
    """DTORCH_ONE_LEVEL: every row one level (2), else coarse rows from 4 rows (1) and the others two levels (0)."""
    return 2 if env.one_level() else int(ctx.params.get("coarse", False))


def _linear_kernel(layout: str):
    code = layouts.format_code(layout)

    def kernel(ctx, inputs, outputs):
        x, w, bias = inputs
        out = outputs[0]
        one_level = _one_level(ctx)
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if out.is_contiguous():
            lib().qlinear(x, w, code, bias, out, one_level)
        else:
            out.copy_(_qlinear(x, w, code, bias, one_level))

    def bind(ctx, inputs, outputs):
        x, w, bias = inputs
        out = outputs[0]
        if not (x.is_contiguous() and out.is_contiguous()) or (bias is not None and bias.dtype != x.dtype):
            return None
        # (DTORCH_ONE_LEVEL as set when bound: a step's bound calls ignored it, so decode kept two levels under it)
        return functools.partial(lib().qlinear, x, w, code, bias, out, _one_level(ctx))

    kernel.bind = bind
    kernel.__name__ = kernel.__qualname__ = f"linear_{layout[5:]}"
    return kernel


def _qlinear(x: torch.Tensor, w: torch.Tensor, code: int, bias: torch.Tensor | None,
             one_level: int) -> torch.Tensor:
    y = x.new_empty(*x.shape[:-1], w.shape[0])
    lib().qlinear(x, w, code, bias, y, one_level)
    return y


for _layout in GGUF_LAYOUTS:
    KERNELS.add("matmul.linear", _linear_kernel(_layout), ACTIVATIONS, layout=_layout, **NATIVE,
                varies="under 32 rows: activations in two int8 levels per 32 values (~16 bits), or one level (8 bits) "
                       "for a batch of 4 or more decodes (param decode) in all but q2_k and q3_k; output rows "
                       "split over torch's intra-op threads; 32 rows and more: float32 weight panels in oneDNN's GEMM "
                       "(torch's mm without oneDNN), but on avx512 the integer levels in all but q2_k and q3_k "
                       "under 128 rows per thread, and at every row count in q4_k, q5_k, iq4_xs and q8_0")
# Q8_0 / Q5_0 with 16 rows interleaved (layouts.X16): 1-3 rows of x on AVX-512 VNNI read the layout itself, lane = row;
# everything else turns each thread's groups back into rows for the row layout's kernels (the same bits)
for _layout in GGUF_X16_LAYOUTS:
    KERNELS.add("matmul.linear", _linear_kernel(_layout), ACTIVATIONS, layout=_layout, **NATIVE,
                varies="as the row layout's kernel (its bits at every row count): 1-3 rows of x on avx512 read the "
                       "16 interleaved rows a vector at a time, the rest through rows turned back per thread")


# -- matmul.linear on float weights: the one-row product ----------------------------------------------------
# inputs: x [..., K] bf16, w [N, K] bf16 (the checkpoint's orientation), bias [N] or None; outputs: out [..., N].
# Up to GEMV_ROWS rows the weight is streamed once by our dot-product kernel (each thread a block of output
# columns, float32 accumulation): a decode step's projections. Without bf16 matrix units torch's bf16 GEMV reads
# ~14 GB/s of a cold [1024, 6176] weight on 2 cores where this reads ~23 (measured over 24 distinct weights, more
# than the L2 holds). More rows go to the torch backend's kernel for the key (upcast or blas).
GEMV_ROWS = 8


def _gemv_linear(ctx, inputs, outputs):
    x, w, bias = inputs
    out = outputs[0]
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > GEMV_ROWS or not w.is_contiguous() or w.dtype != x.dtype or not out.is_contiguous():
        return _torch_linear(ctx, inputs, outputs)
    lib().gemv(x if x.is_contiguous() else x.contiguous(), w, out)
    if bias is not None:
        out.add_(bias.to(out.dtype))


def _torch_linear(ctx, inputs, outputs):
    from dtorch.kernels.torch import matmul as torch_matmul

    if torch_matmul.native_bf16_matmul():
        return torch_matmul.linear_blas(ctx, inputs, outputs)
    return torch_matmul.linear_upcast(ctx, inputs, outputs)  # itself: upcast when it pays, else torch's bf16


KERNELS.add("matmul.linear", _gemv_linear, (torch.bfloat16,), **NATIVE, priority=30,
            varies=f"up to {GEMV_ROWS} rows our GEMV streams the weight once; more rows: torch's upcast or blas")


# -- matmul.linear on 16-bit weights beside wider activations (layouts "f16", "bf16": dtorch.kernels.half) ---------
# inputs: x [..., K] (the key's dtype), w [N, K] float16 / bfloat16, bias [N] or None; outputs: out [..., N]. Up to
# GEMV_ROWS rows our GEMV reads the 16-bit weight as it is (float32 accumulation); more rows, or a float16 x, go to the
# torch backend's kernel for the key (converted panels of W and torch's GEMM).

def _gemv_half(ctx, inputs, outputs):
    x, w, bias = inputs
    out = outputs[0]
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > GEMV_ROWS or x.dtype not in ACTIVATIONS or not w.is_contiguous() or not out.is_contiguous():
        return torch_half.linear_half(ctx, inputs, outputs)
    lib().gemv(x if x.is_contiguous() else x.contiguous(), w, out)
    if bias is not None:
        out.add_(bias.to(out.dtype))


for _layout in HALF_LAYOUTS:
    KERNELS.add("matmul.linear", _gemv_half, ACTIVATIONS, layout=_layout, **NATIVE,
                varies=f"up to {GEMV_ROWS} rows our GEMV reads the 16-bit weight; more rows: converted panels and "
                       "torch's GEMM")


# -- llm.moe_experts for few tokens ---------------------------------------------------------------------------
# inputs: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] (x's dtype), weights [T, k], ids [T, k] int64; params
# expert_start (this device's first expert); outputs: out [T, H]. With at most MOE_PAIRS_PER_EXPERT (token, slot)
# pairs per expert on average (decode), the ids are read on the host (free on cpu), the pairs grouped by expert, and
# each selected expert's two products run as our GEMV on views of its own matrices (W [N, K] already: transformers'
# layout), the router weight applied between them (down is linear) and the rows summed in float32. Many tokens
# (prefill) go to the torch backend's grouped kernel.
MOE_PAIRS_PER_EXPERT = 2


def _moe_experts(ctx, inputs, outputs):
    x, w_gate_up, w_down, weights, ids = inputs
    out = outputs[0]
    e, inter = w_gate_up.shape[0], w_down.shape[2]
    if (ids.numel() > MOE_PAIRS_PER_EXPERT * e or w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype
            or not (x.is_contiguous() and w_gate_up.is_contiguous() and w_down.is_contiguous())):
        return torch_moe.moe_experts_torch(ctx, inputs, outputs)
    k = ids.shape[1]
    start = ctx.params.get("expert_start") or 0
    if x.shape[0] == 1 and out.is_contiguous():  # one token: the whole MLP in one call (csrc/binding.cpp)
        try:
            lib().moe_decode(x, w_gate_up, w_down, weights, ids, start, out)
            return
        except DtorchError:
            pass
    groups: dict[int, list[int]] = {}
    for n, i in enumerate(ids.reshape(-1).tolist()):
        if 0 <= i - start < e:
            groups.setdefault(i - start, []).append(n)
    mod, flat_w = lib(), weights.reshape(-1)
    acc = torch.zeros(out.shape, dtype=torch.float32)
    for i, pairs in groups.items():
        if len(pairs) == 1:
            n = pairs[0]
            xs, w = x[n // k:n // k + 1], flat_w[n:n + 1]
        else:
            sel = torch.tensor(pairs)
            xs, w = x.index_select(0, sel // k), flat_w.index_select(0, sel)
        gu = x.new_empty(len(pairs), 2 * inter)
        mod.gemv(xs, w_gate_up[i], gu)
        h = torch.nn.functional.silu(gu[:, :inter]).mul_(gu[:, inter:]).mul_(w[:, None])
        y = x.new_empty(len(pairs), x.shape[1])
        mod.gemv(h, w_down[i], y)
        if len(pairs) == 1:
            acc[pairs[0] // k].add_(y[0])
        else:
            acc.index_add_(0, sel // k, y.float())
    out.copy_(acc)


KERNELS.add("llm.moe_experts", _moe_experts, ACTIVATIONS, **NATIVE, priority=20, meta=torch_moe.READS_IDS,
            varies=f"up to {MOE_PAIRS_PER_EXPERT} (token, slot) pairs per expert: our GEMV per selected expert; "
                   "more: torch's grouped kernel")


# -- llm.embedding on GGUF weights ----------------------------------------------------------------------------
# (w uint8 [V, row bytes], ids int [...]) -> (out [..., E],) in the key's dtype; params vocab_start (ids outside
# [vocab_start, vocab_start + V) give zero rows). Each row dequantized as layouts.dequantize (the same float32
# bits), then rounded once.

def _embedding_kernel(layout: str):
    code, fallback = layouts.format_code(layout), torch_quantized._embedding(layout)

    def kernel(ctx, inputs, outputs):
        w, ids = inputs
        try:
            lib().qembedding(w, ids, code, ctx.params.get("vocab_start"), outputs[0])
        except DtorchError:
            fallback(ctx, inputs, outputs)

    kernel.__name__ = kernel.__qualname__ = f"embedding_{layout[5:]}"
    return kernel


for _layout in GGUF_LAYOUTS:
    KERNELS.add("llm.embedding", _embedding_kernel(_layout), ACTIVATIONS, layout=_layout, **NATIVE)
