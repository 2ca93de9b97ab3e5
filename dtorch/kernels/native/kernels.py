"""The native kernels as dispatcher kernels (provider "native", cpu only), each next to its registration on
``registry.KERNELS``: here the recurrent mixers' steps, rope, the KV cache's store and paged attention, and the
DTN_OP rows; the products (matmul.linear, llm.moe_experts, llm.embedding) in ``products.py``, imported here so that
``KERNELS`` holds both.

The ops declared whole by a DTN_OP row of the op list (csrc/ops/<group>.def: llm.rms_norm, llm.add_rms_norm,
llm.silu_and_mul, llm.gelu_tanh_and_mul, llm.softmax_last_dim, ...) are registered at the end of this file from their
rows alone (``register_rows``): no code here per such op. The hand-written kernels (above it and in products.py)
call the module's DTN_ENTRY functions (csrc/entries.def), whose lines name the dispatcher ops registered there:
``install`` refuses an op listed there without a kernel, or the reverse (``oplist.check_registrations``).

Every kernel has the ABI of the torch backend's kernel for the same key (inputs, outputs, params, in-place
behaviour). Inputs the compiled code does not take (strides it cannot walk, a dtype mismatch) go to the torch
backend's kernel for that key, called directly, so a call never fails here that would pass there.

Capture safety (``KernelMeta.capture_safe``): the compiled code reads values (slots, block tables, ids) on the CPU it
runs on, which is no host sync, and every torch fallback here reads nothing on the host; so every kernel is
capture-safe except ``llm.moe_experts``, which groups the ids in Python (``ids.tolist()``).
"""

from __future__ import annotations

import functools

from dtorch.core.errors import ArgumentError, DtorchError
from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.dispatch.registration import KernelSet
from dtorch.kernels.native import (
    oplist,
    products,  # noqa: F401  (its kernels join KERNELS: matmul.linear, moe, embedding)
)
from dtorch.kernels.native.registry import ACTIVATIONS, KERNELS, NATIVE, binds, bound, lib, or_fallback
from dtorch.kernels.torch import (
    causal_conv1d as torch_conv,
    gated_delta_net as torch_gdn,
    gdn_gates as torch_gdn_gates,
    kv_cache as torch_kv_cache,
    llm as torch_llm,
)

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
            lib().conv_update(x, weight, bias, state, indices, out, ctx.params.get("activation") == "silu")
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
        lib().gdn_step(q, k, v, g, beta, initial, final, indices, outputs[0],
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
        lib().gdn_gates(*inputs, *outputs)
    except DtorchError:
        torch_gdn_gates.gdn_gates_torch(ctx, inputs, outputs)


# -- llm.rope (the table form that rope_cached runs) -------------------------------------------------------------
# (x [..., T, H, D], cos, sin [..., T, R/2] float32) -> (out,) possibly x; params rotary_dim, interleaved. x, out,
# cos and sin may be row-strided views (q/k heads of a fused qkv output). The positions form goes to torch.

def _bind_rope(ctx, inputs, outputs):
    if len(inputs) != 3:
        return None
    p = ctx.params
    args = (inputs[0], inputs[1], inputs[2], outputs[0], p.rotary_dim, p.interleaved)
    once = bound(lib().rope, *args)  # refused only by its checks, which bound runs now
    return once if once is not None else or_fallback(functools.partial(lib().rope, *args), torch_llm.rope_reference,
                                                     ctx, inputs, outputs)


@KERNELS.kernel("llm.rope", ACTIVATIONS, meta=torch_llm.INPLACE, **NATIVE)
@binds(_bind_rope)
def rope(ctx, inputs, outputs):
    if len(inputs) == 3:
        try:
            p = ctx.params
            lib().rope(inputs[0], inputs[1], inputs[2], outputs[0], p.rotary_dim, p.interleaved)
            return
        except DtorchError:
            pass
    torch_llm.rope_reference(ctx, inputs, outputs)


# == KV cache and quantized embedding ===========================================================================

# -- llm.reshape_and_cache -------------------------------------------------------------------------------------
# (key, value [T, Hkv, D], k_cache, v_cache [blocks, block_size, Hkv, D], slot_mapping int [T]) -> the caches
# themselves (outputs alias inputs 2 and 3), row t to flat row slot_mapping[t], negative slots skipped. Row copies.

def _bind_cache_store(ctx, inputs, outputs):
    key, value, _, _, slots = inputs
    args = (key, value, outputs[0], outputs[1], slots)
    call = bound(lib().cache_store, *args) or functools.partial(lib().cache_store, *args)  # slots checked each call
    return or_fallback(call, torch_kv_cache.reshape_and_cache_reference, ctx, inputs, outputs)


@KERNELS.kernel("llm.reshape_and_cache", ACTIVATIONS, meta=torch_kv_cache.INPLACE, **NATIVE)
@binds(_bind_cache_store)
def reshape_and_cache(ctx, inputs, outputs):
    key, value, _, _, slots = inputs
    try:
        lib().cache_store(key, value, outputs[0], outputs[1], slots)
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


def _bind_attention(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    p = ctx.params
    call = functools.partial(lib().paged_attention, q, kc, vc, cu_q, seqlens_k, block_table, outputs[0], p.causal,
                             p.scale, p.get("window", 0))
    return or_fallback(call, torch_kv_cache.flash_attention_with_kvcache_padded, ctx, inputs, outputs)


@KERNELS.kernel("llm.flash_attention_with_kvcache", ACTIVATIONS, **NATIVE, check=_no_softcap,
                varies="float32 online softmax over chunks of 64 keys; items split over torch's intra-op threads "
                       "past ~130k multiply-adds")
@binds(_bind_attention)
def flash_attention_with_kvcache(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    p = ctx.params
    try:
        lib().paged_attention(q, kc, vc, cu_q, seqlens_k, block_table, outputs[0], p.causal, p.scale,
                               p.get("window", 0))
    except DtorchError:  # the padded torch kernel: it reads nothing on the host either
        torch_kv_cache.flash_attention_with_kvcache_padded(ctx, inputs, outputs)


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
            getattr(lib(), name)(*inputs, *outputs, *(getattr(ctx.params, p) for p in params))
        except DtorchError:
            fallback(ctx, inputs, outputs)

    def bind(ctx, inputs, outputs):
        """This call on these very tensors as a callable of no arguments (a static plan's bare loop calls it every
        step): the row's call parsed and checked once (``bound``), or, where the C++ refuses these tensors, the
        fallback; None for a call the row does not count (the kernel itself then runs, and names the row)."""
        if len(inputs) != n_in or len(outputs) != n_out:
            return None
        fn, args = getattr(lib(), name), (*inputs, *outputs, *(getattr(ctx.params, p) for p in params))
        once = bound(fn, *args)
        if once is not None:
            return once

        def run():
            try:
                fn(*args)
            except DtorchError:
                fallback(ctx, inputs, outputs)
        return run

    kernel.bind = bind
    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def register_rows(kernel_set: KernelSet, ops: oplist.OpList) -> None:
    """Register every DTN_OP row of ``ops`` in ``kernel_set``: cpu, float32 and bfloat16, provider native (at the
    row's priority where it names one)."""
    for row in ops.row_ops:
        meta = KernelMeta(inplace=True) if row.inplace else None
        kernel_set.add(row.op, row_kernel(row), ACTIVATIONS, meta=meta, priority=row.priority, **NATIVE)


register_rows(KERNELS, oplist.parse())

