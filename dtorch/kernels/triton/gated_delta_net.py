"""The gated delta rule in triton (``llm.gated_delta_net``): one recurrent scan per (sequence, value head, V tile).

Contract as the torch reference (``dtorch/kernels/torch/gated_delta_net.py``): per head the state is S [K, V] and
per step ``S = S exp(g); u = beta (v - S^T k); S = S + k u^T; o = S^T (q scale)``, with q and k l2-normalised
first when ``use_qk_l2norm``. A program keeps its [K, BLOCK_V] slice of S in float32 and walks its sequence's
tokens one at a time; the columns of S are independent, so V splits over programs with no exchange. Products
are broadcasts plus ``tl.sum`` (no ``tl.dot``): a step is a rank-1 update and two matrix-vector products, and
triton's interpreter gets bfloat16 dots wrong.

Nothing is read on the host: segment bounds come from ``cu_seqlens`` and pool rows from ``state_indices``
inside the kernel, and the grid is (N, H, V tiles) from shapes alone, so the kernel is capture safe. Every
program reads its state before it writes it, so the final state may alias the initial one (the in-place decode
step); with ``state_indices`` and a separate output pool, the pool is copied over first (rows not named keep
their values) and an empty segment's row is left as it is, as the reference does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.torch.gated_delta_net import L2NORM_EPS
from dtorch.kernels.triton.registry import FLOATS, KERNELS, TRITON

MAX_BLOCK_V = 32  # state columns per program: [K, 32] float32 stays in registers for K up to 256


@triton.jit
def _gdn_scan(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, idx_ptr,
              sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, sv_b, sv_t, sv_h, sv_d,
              sg_b, sg_t, sg_h, sb_b, sb_t, sb_h, so_b, so_t, so_h, so_d,
              s0_n, s0_h, s0_k, s0_v, st_n, st_h, st_k, st_v,
              T, G, K, V, scale, eps,
              VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, HAS_INDICES: tl.constexpr,
              L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // G  # the q/k head this value head reads
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = kk < K
    v_ok = vv < V
    kv_ok = k_ok[:, None] & v_ok[None, :]

    if VARLEN:  # packed along T (B == 1): segment n is tokens cu[n]:cu[n+1] of batch row 0
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
        b = 0
    else:
        b = n.to(tl.int64)
        bos = b * 0  # int64 token offsets: T times a fused projection's row stride can pass 2^31
        eos = bos + T
    if HAS_INDICES:  # the pool row this sequence starts from and advances
        row = tl.load(idx_ptr + n).to(tl.int64)
    else:
        row = n.to(tl.int64)

    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # S[:, tile]
    if HAS_H0:
        h0 = h0_ptr + row * s0_n + h * s0_h + kk[:, None] * s0_k + vv[None, :] * s0_v
        state += tl.load(h0, mask=kv_ok, other=0.0).to(tl.float32)

    q_head = q_ptr + b * sq_b + hk * sq_h
    k_head = k_ptr + b * sk_b + hk * sk_h
    v_head = v_ptr + b * sv_b + h * sv_h
    o_head = o_ptr + b * so_b + h * so_h
    for t in range(bos, eos):
        q = tl.load(q_head + t * sq_t + kk * sq_d, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_head + t * sk_t + kk * sk_d, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(v_head + t * sv_t + vv * sv_d, mask=v_ok, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + b * sg_b + t * sg_t + h * sg_h).to(tl.float32))
        beta = tl.load(beta_ptr + b * sb_b + t * sb_t + h * sb_h).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        state = state * decay
        u = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BLOCK_V]
        state = state + k[:, None] * u[None, :]
        o = tl.sum(state * q[:, None], axis=0) * scale
        tl.store(o_head + t * so_t + vv * so_d, o.to(o_ptr.dtype.element_ty), mask=v_ok)

    if STORE_HT:
        keep = kv_ok
        if HAS_INDICES and VARLEN:  # an empty segment leaves its pool row as it is (a tensor mask: the
            keep = keep & (vv[None, :] * 0 + (eos - bos) > 0)  # interpreter refuses a scalar one)
        ht = ht_ptr + row * st_n + h * st_h + kk[:, None] * st_k + vv[None, :] * st_v
        tl.store(ht, state.to(ht_ptr.dtype.element_ty), mask=keep)


def _same_view(a, b) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


# inputs: q, k [B, T, Hk, K], v [B, T, H, V] (any strides), g, beta [B, T, H], initial_state
# [N, H, K, V] (or the pool [S, H, K, V]) or None, cu_seqlens [N + 1] or None, state_indices [N] or None (may be
# absent); outputs: o [B, T, H, V], optionally the final state [N, H, K, V] or pool (may alias initial_state).
@KERNELS.kernel("llm.gated_delta_net", FLOATS, meta=KernelMeta(inplace=True, capture_safe=True), **TRITON)
def gated_delta_net_triton(ctx, inputs, outputs) -> None:
    q, k, v, g, beta, h0, cu = inputs[:7]
    indices = inputs[7] if len(inputs) > 7 else None
    o = outputs[0]
    ht = outputs[1] if len(outputs) > 1 else None
    b, t, hk, kd = q.shape
    h, vd = v.shape[2], v.shape[3]
    n = b if cu is None else cu.shape[0] - 1
    if ht is not None and indices is not None and not _same_view(ht, h0):
        ht.copy_(h0)  # a separate output pool: rows no sequence names keep the input pool's values
    if n == 0 or h == 0 or vd == 0:
        return
    scale = ctx.params.get("scale")
    scale = kd ** -0.5 if scale is None else scale
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(vd))
    s0 = h0.stride() if h0 is not None else (0, 0, 0, 0)
    st = ht.stride() if ht is not None else (0, 0, 0, 0)
    grid = (n, h, triton.cdiv(vd, block_v))
    _gdn_scan[grid](q, k, v, g, beta, o, h0 if h0 is not None else o, ht if ht is not None else o,
                    cu if cu is not None else o, indices if indices is not None else o,
                    *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(), *s0, *st,
                    t, h // hk, kd, vd, scale, L2NORM_EPS,
                    VARLEN=cu is not None, HAS_H0=h0 is not None, STORE_HT=ht is not None,
                    HAS_INDICES=indices is not None, L2NORM=bool(ctx.params.get("use_qk_l2norm", False)),
                    BLOCK_K=triton.next_power_of_2(kd), BLOCK_V=block_v)
