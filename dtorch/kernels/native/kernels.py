"""The native kernels as dispatcher kernels (provider "native", cpu only), each next to its registration.

The ops declared whole by a DTN_OP row of the op list (csrc/ops/<group>.def) are registered at the end of this file
from their rows alone (``register_rows``): no code here per such op. The hand-written kernels above it call the
module's DTN_ENTRY functions (csrc/ops.def), whose lines name the dispatcher ops registered here: ``install`` refuses
an op listed there without a kernel here, or the reverse (``oplist.check_registrations``).

Every kernel has the ABI of the torch backend's kernel for the same key (inputs, outputs, params, in-place
behaviour). Inputs the compiled code does not take (strides it cannot walk, a dtype mismatch) go to the torch
backend's kernel for that key, called directly, so a call never fails here that would pass there.

Capture safety (``KernelMeta.capture_safe``): the compiled code reads values (slots, block tables, ids) on the CPU it
runs on, which is no host sync, and every torch fallback here reads nothing on the host; so every kernel is
capture-safe except ``llm.moe_experts``, which groups the ids in Python (``ids.tolist()``).
"""

from __future__ import annotations

import torch

from dtorch.core.dtypes import GGUF_LAYOUTS
from dtorch.core.errors import ArgumentError, DtorchError
from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.dispatch.registration import KernelSet
from dtorch.kernels import layouts
from dtorch.kernels.half import HALF_LAYOUTS
from dtorch.kernels.native import loader, oplist
from dtorch.kernels.torch import (
    causal_conv1d as torch_conv,
    gated_delta_net as torch_gdn,
    gdn_gates as torch_gdn_gates,
    half as torch_half,
    kv_cache as torch_kv_cache,
    llm as torch_llm,
    moe as torch_moe,
    quantized as torch_quantized,
)

KERNELS = KernelSet(devices=("cpu",))
ACTIVATIONS = (torch.float32, torch.bfloat16)
NATIVE = {"provider": "native"}


def _lib():
    mod = loader._mod
    return mod if mod is not None else loader.load()


# -- matmul.linear on GGUF weights -------------------------------------------------------------------------
# inputs: x [..., K] (float32 / bfloat16: the key's dtype), w uint8 [N, row_bytes(layout, K)], bias [N] or None;
# params: coarse (optional): each row's precision may be traded for speed (a prompt's rows, a batch of decodes).
# outputs: out [..., N]. Under 32 rows x is quantized inside to int8 levels per 32 values (two; one for coarse rows,
# 4 and more, in the super-grouped formats), else w is dequantized in panels for oneDNN's float32 GEMM (torch's
# mm without it; see ops.qlinear), except on AVX-512 VNNI, whose integer tiles keep all but q2_k and q3_k: coarse rows
# at every row count, others under 128 rows per thread (q4_k, q5_k, iq4_xs and q8_0 at every row count); the
# reference (torch backend) dequantizes w with layouts.dequantize and runs F.linear.

def _linear_kernel(layout: str):
    code = layouts.format_code(layout)

    def kernel(ctx, inputs, outputs):
        x, w, bias = inputs
        out = outputs[0]
        one_level = ctx.params.get("coarse", False)
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if out.is_contiguous():
            _lib().qlinear(x, w, code, bias, out, one_level)
        else:
            out.copy_(_qlinear(x, w, code, bias, one_level))

    kernel.__name__ = kernel.__qualname__ = f"linear_{layout[5:]}"
    return kernel


def _qlinear(x: torch.Tensor, w: torch.Tensor, code: int, bias: torch.Tensor | None,
             one_level: bool) -> torch.Tensor:
    y = x.new_empty(*x.shape[:-1], w.shape[0])
    _lib().qlinear(x, w, code, bias, y, one_level)
    return y


for _layout in GGUF_LAYOUTS:
    KERNELS.add("matmul.linear", _linear_kernel(_layout), ACTIVATIONS, layout=_layout, **NATIVE,
                varies="under 32 rows: activations in two int8 levels per 32 values (~16 bits), or one level (8 bits) "
                       "for a batch of 4 or more decodes (param decode) in all but q2_k and q3_k, for every row "
                       "with DTORCH_DECODE_ONE_LEVEL; output rows "
                       "split over torch's intra-op threads; 32 rows and more: float32 weight panels in oneDNN's GEMM "
                       "(torch's mm without oneDNN), but on avx512 the integer levels in all but q2_k and q3_k "
                       "under 128 rows per thread, and at every row count in q4_k, q5_k, iq4_xs and q8_0")


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
    _lib().gemv(x if x.is_contiguous() else x.contiguous(), w, out)
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
    _lib().gemv(x if x.is_contiguous() else x.contiguous(), w, out)
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
            _lib().moe_decode(x, w_gate_up, w_down, weights, ids, start, out)
            return
        except DtorchError:
            pass
    groups: dict[int, list[int]] = {}
    for n, i in enumerate(ids.reshape(-1).tolist()):
        if 0 <= i - start < e:
            groups.setdefault(i - start, []).append(n)
    lib, flat_w = _lib(), weights.reshape(-1)
    acc = torch.zeros(out.shape, dtype=torch.float32)
    for i, pairs in groups.items():
        if len(pairs) == 1:
            n = pairs[0]
            xs, w = x[n // k:n // k + 1], flat_w[n:n + 1]
        else:
            sel = torch.tensor(pairs)
            xs, w = x.index_select(0, sel // k), flat_w.index_select(0, sel)
        gu = x.new_empty(len(pairs), 2 * inter)
        lib.gemv(xs, w_gate_up[i], gu)
        h = torch.nn.functional.silu(gu[:, :inter]).mul_(gu[:, inter:]).mul_(w[:, None])
        y = x.new_empty(len(pairs), x.shape[1])
        lib.gemv(h, w_down[i], y)
        if len(pairs) == 1:
            acc[pairs[0] // k].add_(y[0])
        else:
            acc.index_add_(0, sel // k, y.float())
    out.copy_(acc)


KERNELS.add("llm.moe_experts", _moe_experts, ACTIVATIONS, **NATIVE, priority=20, meta=torch_moe.READS_IDS,
            varies=f"up to {MOE_PAIRS_PER_EXPERT} (token, slot) pairs per expert: our GEMV per selected expert; "
                   "more: torch's grouped kernel")


# -- the recurrent mixers' decode steps (csrc/recurrent.h) -------------------------------------------------------
# llm.causal_conv1d_update: (x [B, D] or [B, D, 1], weight [D, W], bias [D] or None, conv_state, state_indices [B]
# or absent) -> (out like x, conv_state [B, D, S] or a pool [P, D, S] (outputs[1], advanced in place)); params
# activation. One pass over the state rows in float32; x and out may be row-strided views (a qkv projection's
# columns). Longer x (L > 1), mixed dtypes and other strides go to the torch backend's update kernel.
CONV_META = KernelMeta(inplace=True)


@KERNELS.kernel("llm.causal_conv1d_update", ACTIVATIONS, meta=CONV_META, **NATIVE,
                varies="one step (x [B, D] or [B, D, 1]): our kernel; longer x: torch's update")
def causal_conv1d_update(ctx, inputs, outputs):
    x, weight, bias = inputs[:3]
    indices = inputs[4] if len(inputs) > 4 else None
    out, state = outputs
    if x.dim() == 3 and x.shape[-1] == 1:
        x, out = x[..., 0], out[..., 0]
    if x.dim() == 2:
        try:
            _lib().conv_update(x, weight, bias, state, indices, out, ctx.params.get("activation") == "silu")
            return
        except DtorchError:
            pass
    torch_conv.causal_conv1d_update_torch(ctx, inputs, outputs)


# llm.gated_delta_net's decode step (cu_seqlens None, T == 1): q, k [B, 1, Hk, K], v [B, 1, H, V], g [B, 1, H]
# float32, beta [B, 1, H], initial_state float32 [B, H, K, V], a pool [P, H, K, V] with state_indices [B], or None
# -> (o [B, 1, H, V], final state) with the final state the pool itself (in place) or a copy. Each (sequence, head)
# reads its state row twice (both products, then the update from L2), heads split over threads. The check declines
# every other call (a prefill, varlen, a prepared operator that knows only its params), so the dispatcher picks
# what the key runs without us: the chunked scan, or the per-step reference under mode="recurrent"; calls the
# compiled step does not take (a float64 state, V not a multiple of 16) go to that kernel from here.

def _gdn_torch(ctx, inputs, outputs):
    if ctx.params.get("mode", "chunked") == "recurrent":
        return torch_gdn.gated_delta_net_recurrent(ctx, inputs, outputs)
    return torch_gdn.gated_delta_net_chunked(ctx, inputs, outputs)


# Capture-safe, unlike the torch kernels' META: the check accepts decode steps only (no cu_seqlens, the one host
# read of the torch kernels), and their fallback for those is the torch _step, which reads nothing either.
@KERNELS.kernel("llm.gated_delta_net", ACTIVATIONS, meta=KernelMeta(inplace=True), **NATIVE, priority=20,
                check=torch_gdn.decode_step_only)
def gated_delta_net(ctx, inputs, outputs):
    q, k, v, g, beta, initial, cu_seqlens = inputs[:7]
    indices = inputs[7] if len(inputs) > 7 else None
    final = outputs[1] if len(outputs) > 1 else None
    if cu_seqlens is not None or q.shape[1] != 1 or (indices is not None and initial is None):
        return _gdn_torch(ctx, inputs, outputs)
    p = ctx.params
    scale = p.get("scale")
    try:
        if indices is not None and final is not None and final.data_ptr() != initial.data_ptr():
            final.copy_(initial)  # a pool copy: the step then advances its named rows in place
            initial = final
        _lib().gdn_step(q, k, v, g, beta, initial, final, indices, outputs[0],
                        q.shape[-1] ** -0.5 if scale is None else float(scale), bool(p.get("use_qk_l2norm", False)))
    except DtorchError:
        _gdn_torch(ctx, inputs, outputs)


# -- llm.gdn_gates (csrc/binding.cpp) ---------------------------------------------------------------------------
# a, b [T, H] (one dtype, last dim dense), A_log, dt_bias [H] -> g [T, H] float32, beta [T, H]. Under torch a few
# tiny ops (7-9 us per call at T = 1 on 2 threads); here one call (~1.4 us). beta is at::sigmoid_out (torch's
# bits); g our float32 loop, within an ulp or two of torch's.

@KERNELS.kernel("llm.gdn_gates", ACTIVATIONS, **NATIVE)
def gdn_gates(ctx, inputs, outputs):
    try:
        _lib().gdn_gates(*inputs, *outputs)
    except DtorchError:
        torch_gdn_gates.gdn_gates_torch(ctx, inputs, outputs)


# -- llm.rms_norm / llm.add_rms_norm -------------------------------------------------------------------------
# (x, weight) -> (out,) with out possibly x; (x, residual, weight) -> (out, residual_out) with residual_out
# possibly residual; params eps. One pass per row; contiguous tensors of one dtype, else the torch kernel.

@KERNELS.kernel("llm.rms_norm", ACTIVATIONS, meta=torch_llm.INPLACE, **NATIVE)
def rms_norm(ctx, inputs, outputs):
    x, weight = inputs
    try:
        _lib().rms_norm(x, None, None, weight, outputs[0], ctx.params.eps)
    except DtorchError:
        torch_llm.rms_norm_torch(ctx, inputs, outputs)


@KERNELS.kernel("llm.add_rms_norm", ACTIVATIONS, meta=torch_llm.INPLACE, **NATIVE)
def add_rms_norm(ctx, inputs, outputs):
    x, residual, weight = inputs
    try:
        _lib().rms_norm(x, residual, outputs[1], weight, outputs[0], ctx.params.eps)
    except DtorchError:
        torch_llm.add_rms_norm_torch(ctx, inputs, outputs)


# -- llm.silu_and_mul, llm.gelu_tanh_and_mul ---------------------------------------------------------------------
# (gate, up) -> (out,), or (x [..., 2I], None) fused; gate/up may be row-strided views (a gate_up output's halves).

@KERNELS.kernel("llm.silu_and_mul", ACTIVATIONS, **NATIVE)
def silu_and_mul(ctx, inputs, outputs):
    try:
        _lib().silu_and_mul(inputs[0], inputs[1], outputs[0])
    except DtorchError:
        torch_llm.silu_and_mul_torch(ctx, inputs, outputs)


@KERNELS.kernel("llm.gelu_tanh_and_mul", ACTIVATIONS, **NATIVE,
                 varies="exp by a degree-6 polynomial (< 2 ulp); gelu_tanh(x) as x / (1 + exp(-2u))")
def gelu_tanh_and_mul(ctx, inputs, outputs):
    try:
        _lib().gelu_tanh_and_mul(inputs[0], inputs[1], outputs[0])
    except DtorchError:
        torch_llm.gelu_tanh_and_mul_reference(ctx, inputs, outputs)


# -- llm.rope (the table form that rope_cached runs) -------------------------------------------------------------
# (x [..., T, H, D], cos, sin [..., T, R/2] float32) -> (out,) possibly x; params rotary_dim, interleaved. x, out,
# cos and sin may be row-strided views (q/k heads of a fused qkv output). The positions form goes to torch.

@KERNELS.kernel("llm.rope", ACTIVATIONS, meta=torch_llm.INPLACE, **NATIVE)
def rope(ctx, inputs, outputs):
    if len(inputs) == 3:
        try:
            p = ctx.params
            _lib().rope(inputs[0], inputs[1], inputs[2], outputs[0], p.rotary_dim, p.interleaved)
            return
        except DtorchError:
            pass
    torch_llm.rope_reference(ctx, inputs, outputs)


# == KV cache and quantized embedding ===========================================================================

# -- llm.reshape_and_cache -------------------------------------------------------------------------------------
# (key, value [T, Hkv, D], k_cache, v_cache [blocks, block_size, Hkv, D], slot_mapping int [T]) -> the caches
# themselves (outputs alias inputs 2 and 3), row t to flat row slot_mapping[t], negative slots skipped. Row copies.

@KERNELS.kernel("llm.reshape_and_cache", ACTIVATIONS, meta=torch_kv_cache.INPLACE, **NATIVE)
def reshape_and_cache(ctx, inputs, outputs):
    key, value, _, _, slots = inputs
    try:
        _lib().cache_store(key, value, outputs[0], outputs[1], slots)
    except DtorchError:
        torch_kv_cache.reshape_and_cache_reference(ctx, inputs, outputs)


# -- llm.flash_attention_with_kvcache --------------------------------------------------------------------------
# (q [T, H, D], k_cache, v_cache, cu_seqlens_q int32 [N + 1], seqlens_k int32 [N], block_table int32 [N, blocks])
# -> (out [T, H, D],); params causal (bottom-right), scale, window (0: none; sliding: rows skip keys before their
# window, and blocks before every row's window are never read). Items of (sequence, kv head, <= 16 query rows), keys in
# chunks of 64 with an online softmax in float32 (csrc/attention.h). q/out may be token-strided views (a fused qkv
# output's heads); head dims that are not a multiple of 16 up to 256 go to the torch backend's padded kernel.

def _no_softcap(call: Call) -> str | None:
    return "softcap: csrc/attention.h does not cap the scores" if call.params.get("softcap", 0.0) else None


@KERNELS.kernel("llm.flash_attention_with_kvcache", ACTIVATIONS, **NATIVE, check=_no_softcap,
                varies="float32 online softmax over chunks of 64 keys; items split over torch's intra-op threads "
                       "past ~130k multiply-adds")
def flash_attention_with_kvcache(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    p = ctx.params
    try:
        _lib().paged_attention(q, kc, vc, cu_q, seqlens_k, block_table, outputs[0], p.causal, p.scale,
                               p.get("window", 0))
    except DtorchError:  # the padded torch kernel: it reads nothing on the host either
        torch_kv_cache.flash_attention_with_kvcache_padded(ctx, inputs, outputs)


# -- llm.embedding on GGUF weights ----------------------------------------------------------------------------
# (w uint8 [V, row bytes], ids int [...]) -> (out [..., E],) in the key's dtype; params vocab_start (ids outside
# [vocab_start, vocab_start + V) give zero rows). Each row dequantized as layouts.dequantize (the same float32
# bits), then rounded once.

def _embedding_kernel(layout: str):
    code, fallback = layouts.format_code(layout), torch_quantized._embedding(layout)

    def kernel(ctx, inputs, outputs):
        w, ids = inputs
        try:
            _lib().qembedding(w, ids, code, ctx.params.get("vocab_start"), outputs[0])
        except DtorchError:
            fallback(ctx, inputs, outputs)

    kernel.__name__ = kernel.__qualname__ = f"embedding_{layout[5:]}"
    return kernel


for _layout in GGUF_LAYOUTS:
    KERNELS.add("llm.embedding", _embedding_kernel(_layout), ACTIVATIONS, layout=_layout, **NATIVE)


# == the ops declared whole by a DTN_OP row (csrc/ops/<group>.def) ================================================
# One kernel per row, made from the row: the call's inputs, outputs and params (ctx.params.<name>, in the row's order)
# passed to the row's module function, whose argument checks binding.cpp derives from the row; what the C++ refuses
# (strides it cannot walk, a dtype mix) runs the row's fallback, the torch kernel. A call whose inputs or outputs the
# row does not count is an ArgumentError naming the row (a row that disagrees with the op's ABI must not hide behind
# the fallback).

def row_kernel(row: oplist.RowOp):
    """The dispatcher kernel of a DTN_OP row (reference ABI: inputs, outputs, params as the row lists them)."""
    fallback = row.fallback_kernel()
    name, params, n_in, n_out = row.name, row.params, len(row.inputs), len(row.outputs)

    def kernel(ctx, inputs, outputs):
        if len(inputs) != n_in or len(outputs) != n_out:
            raise ArgumentError(f"{row.op}: the native kernel of DTN_OP {name} ({row.where}) takes inputs "
                                f"{row.inputs} and outputs {row.outputs}, got {len(inputs)} and {len(outputs)}: make "
                                "the row's args list the op's inputs and outputs in order")
        try:
            getattr(_lib(), name)(*inputs, *outputs, *(getattr(ctx.params, p) for p in params))
        except DtorchError:
            fallback(ctx, inputs, outputs)

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def register_rows(kernel_set: KernelSet, ops: oplist.OpList) -> None:
    """Register every DTN_OP row of ``ops`` in ``kernel_set``: cpu, float32 and bfloat16, provider native (at the
    row's priority where it names one)."""
    for row in ops.row_ops:
        meta = KernelMeta(inplace=True) if row.inplace else None
        kernel_set.add(row.op, row_kernel(row), ACTIVATIONS, meta=meta, priority=row.priority, **NATIVE)


register_rows(KERNELS, oplist.parse())

