"""The paged KV cache in triton: ``llm.flash_attention_with_kvcache`` and the cache write ``llm.reshape_and_cache``.

Keys and values are read in place through the block table (no gather copy). One program serves a sequence, a kv
head and a tile of BLOCK_M rows, where a row is a (query, query head) pair of the G = H / Hkv query heads that
share the kv head: a decode step (one query per sequence) fills G rows of one tile and reads each key block once
for the whole group. The program walks the sequence's keys BLOCK_N at a time (each key row's cache block looked
up in the table) with an online softmax in float32; causal programs stop at the last key their rows see, and under a
sliding window start at the first key of their first row's window. A soft-capped model (Gemma 2) caps each score as
softcap * tanh(score / softcap) before the softmax, as the reference does.

Contract as the torch reference (``dtorch/kernels/torch/kv_cache.py``): bottom-right causal; a row that sees no
key is 0; a row that reads a NaN or an inf (its q row, or the k/v row of a key it sees) is NaN, while non-finite
values in keys it does not see never leak. Nothing is read on the host (the grid comes from shapes), so the
kernel is capture safe. float32 inputs use IEEE dots (not tf32), to stay close to the float32 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.kernels.triton.registry import FLOATS, KERNELS, TRITON

MAX_HEAD_DIM = 256  # one [BLOCK_M, D] accumulator per program; beyond this it spills
LOG2E = 1.4426950408889634  # the kernel's softmax runs in base 2: exp(x) = exp2(x * LOG2E)
BLOCK_N = 32  # key rows per step of the softmax loop (any cache block size: rows look up their block)


@triton.jit
def _tanh(x):
    """tanh from exp2, in float32: 1 - 2 / (e^(2x) + 1) is +-1 at the ends (exp2 overflowing to inf gives 1) and
    never NaN for a finite x."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _paged_attention(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, lens_ptr, table_ptr,
                     stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh,
                     stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, stride_od, stride_table,
                     qk_scale, head_dim, window, softcap, softcap_log2,
                     G: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                     SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    q0 = tl.load(cu_q_ptr + seq)
    tq = tl.load(cu_q_ptr + seq + 1) - q0
    s_len = tl.load(lens_ptr + seq)

    first = tl.program_id(2) * BLOCK_M
    rows = first + tl.arange(0, BLOCK_M)  # row r: query r // G, head kvh * G + r % G
    row_ok = rows < tq * G
    qi = rows // G
    head = kvh * G + rows % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim

    q_off = (q0 + qi).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    bad = tl.sum(q.to(tl.float32) * 0.0, axis=1)  # [M]: NaN where the row reads a non-finite value
    q = tl.where(q * 0.0 == 0.0, q, 0.0)

    last = qi + s_len - tq  # [M]: the last key each row sees (bottom-right causal)
    hi = tl.where(first < tq * G, s_len, 0)  # programs past the sequence's rows read nothing
    if CAUSAL:
        top = tl.minimum(first + BLOCK_M - 1, tq * G - 1) // G  # the tile's last query
        hi = tl.minimum(hi, top + s_len - tq + 1)

    lo = 0
    if SLIDING:  # keys before the window of the tile's first query are never read (their blocks may be freed)
        lo = tl.maximum(first // G + s_len - tq - window + 1, 0)
        lo = tl.minimum(lo, hi)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite, so a row that sees no key never makes inf - inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = table_ptr + seq.to(tl.int64) * stride_table
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < s_len
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_off = block * stride_kb + offset * stride_ks + kvh * stride_kh
        v_off = block * stride_vb + offset * stride_vs + kvh * stride_vh
        # [N, D]; a cache of another dtype than q's (bfloat16 under float32 activations) is widened as it is read
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q_ptr.dtype.element_ty)
        kv_bad = tl.sum(k.to(tl.float32) * 0.0, axis=1) + tl.sum(v.to(tl.float32) * 0.0, axis=1)  # [N]
        k = tl.where(k * 0.0 == 0.0, k, 0.0)
        v = tl.where(v * 0.0 == 0.0, v, 0.0)

        visible = n_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            visible = visible & (n[None, :] <= last[:, None])
        if SLIDING:
            visible = visible & (n[None, :] > last[:, None] - window)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N], log2 units (without SOFTCAP)
        if SOFTCAP:  # qk_scale is the plain scale here: cap the score, then go to log2 units
            s = _tanh(s / softcap) * softcap_log2
        s = tl.where(visible, s, float("-inf"))
        bad += tl.sum(tl.where(visible, kv_bad[None, :], 0.0), axis=1)

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None] + bad[:, None]
    o = tl.where(seen[:, None], o, 0.0)
    o_off = (q0 + qi).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_off[:, None] + d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _check(call: Call) -> str | None:
    """Declines head dims above MAX_HEAD_DIM."""
    d = int(call.inputs[0].shape[-1]) if call.inputs is not None else call.params.get("head_dim")
    if d is not None and d > MAX_HEAD_DIM:
        return f"head_dim {d} > {MAX_HEAD_DIM}: the triton paged attention keeps [BLOCK_M, D] in registers"
    return None


@KERNELS.kernel("llm.flash_attention_with_kvcache", FLOATS, **TRITON, meta=KernelMeta(capture_safe=True),
                 check=_check)
def flash_attention_with_kvcache_triton(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs  # q [total_q, H, D]; caches [blocks, block_size, Hkv, D]
    out = outputs[0]  # [total_q, H, D]
    total_q, h, d = q.shape
    n, hkv = seqlens_k.shape[0], kc.shape[2]
    if total_q == 0 or n == 0:
        return
    g = h // hkv
    window = int(ctx.params.get("window", 0))
    softcap = float(ctx.params.get("softcap", 0.0))  # 0: scores uncapped
    block_m = 16 if total_q <= n else 64  # decode-shaped steps have at most G rows per sequence
    # A sequence has at most total_q queries; programs past its rows store nothing.
    grid = (n, hkv, triton.cdiv(total_q * g, block_m))
    _paged_attention[grid](
        q, kc, vc, out, cu_q, seqlens_k, block_table,
        *q.stride(), *kc.stride()[:3], *vc.stride()[:3], *out.stride(), block_table.stride(0),
        ctx.params.scale * (1.0 if softcap else LOG2E), d, window, softcap or 1.0, softcap * LOG2E,
        G=g, BLOCK_SIZE=kc.shape[1], CAUSAL=bool(ctx.params.causal), SLIDING=window > 0, SOFTCAP=softcap > 0,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


# -- llm.reshape_and_cache ---------------------------------------------------------------------------------------
# inputs: key/value [T, Hkv, D] (token-strided views of a fused projection are fine), the caches [blocks, block_size,
# Hkv, D], slots int [T] (block * block_size + offset; < 0: padding, written nowhere); outputs: the caches, in place.
# One program per (token, kv head) copies its D values; the slot is read on the device, so the launch is capture-safe.

@triton.jit
def _cache_write(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, D,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, stride_kch, stride_vs, stride_vch,
                 BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = (d < D) & (d * 0 + slot >= 0)  # a block mask: padding rows (slot < 0) store nothing
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
    tl.store(kc_ptr + slot * stride_ks + h * stride_kch + d, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + slot * stride_vs + h * stride_vch + d, v.to(vc_ptr.dtype.element_ty), mask=ok)


def _unit_last(call: Call) -> str | None:
    """Declines a key, value or cache whose last dim is not unit-strided, or caches whose (block, offset) rows are
    not one flat stride apart (the kernel addresses a slot as one row index)."""
    if call.inputs is None:
        return None
    key, value, kc, vc = call.inputs[:4]
    for name, t in (("key", key), ("value", value), ("k_cache", kc), ("v_cache", vc)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has a last-dim stride of {t.stride(-1)}; the triton cache write needs 1"
    for name, c in (("k_cache", kc), ("v_cache", vc)):
        if c.shape[1] > 1 and c.stride(0) != c.shape[1] * c.stride(1):
            return f"{name}'s blocks are not laid out one after another (strides {tuple(c.stride())})"
    return None


@KERNELS.kernel("llm.reshape_and_cache", FLOATS, **TRITON, meta=KernelMeta(inplace=True, capture_safe=True),
                 check=_unit_last)
def reshape_and_cache_triton(ctx, inputs, outputs):
    key, value, _, _, slots = inputs
    kc, vc = outputs  # the caches themselves
    t, hkv, d = key.shape
    if t == 0:
        return
    _cache_write[(t, hkv)](key, value, kc, vc, slots, d, key.stride(0), key.stride(1), value.stride(0),
                           value.stride(1), kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2),
                           BLOCK_D=triton.next_power_of_2(d))
