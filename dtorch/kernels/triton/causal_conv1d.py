"""Depthwise causal conv1d in triton: ``llm.causal_conv1d``, ``llm.causal_conv1d_update``, ``llm.causal_conv1d_varlen``.

Contract as the torch reference (``dtorch/kernels/torch/causal_conv1d.py``): out[t, d] = act(bias[d] + sum_w
weight[d, w] xp[t + w, d]) where xp is the sequence with the W - 1 inputs before it (state columns, or zeros) in
front, computed in float32; the state then holds the last S inputs of (state, sequence).

Each op is two launches on one stream, so the second sees the first's reads done: ``_conv_out`` computes the
outputs in [BLOCK_L, BLOCK_D] tiles, one program per (sequence, channel tile, token tile), reading the old state;
``_conv_state`` then shifts the state, one program per (sequence, channel tile) walking its S columns in order
(column j takes column j + L: a column is read before the step that overwrites it, by the same thread, since
every access is a [BLOCK_D] vector of the same layout). Varlen segment bounds and pool rows are read inside the
kernels, grids come from shapes (token tiles up to the packed length; programs past their segment touch nothing), so
nothing is read on the host and every kernel here is capture safe. An empty varlen segment leaves its pool row as it is.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.triton.registry import FLOATS, KERNELS, TRITON

BLOCK_D = 64  # channels per program
MAX_BLOCK_L = 32  # tokens per output tile


@triton.jit
def _segment(cu_ptr, n, L, VARLEN: tl.constexpr):
    """(first token, length) of sequence n: from cu_seqlens when packed, else (0, L) in batch row n."""
    if VARLEN:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        length = tl.load(cu_ptr + n + 1).to(tl.int64) - bos
    else:
        bos = n.to(tl.int64) * 0
        length = bos + L
    return bos, length


@triton.jit
def _state_row(idx_ptr, n, HAS_INDICES: tl.constexpr):
    if HAS_INDICES:
        return tl.load(idx_ptr + n).to(tl.int64)
    return n.to(tl.int64)


@triton.jit
def _conv_out(x_ptr, w_ptr, bias_ptr, s_ptr, out_ptr, cu_ptr, idx_ptr,
              sx_n, sx_t, sx_d, so_n, so_t, so_d, ss_n, ss_d, ss_s, sw_d, sw_w, D, L,
              WIDTH: tl.constexpr, KEEP: tl.constexpr, VARLEN: tl.constexpr, HAS_STATE: tl.constexpr,
              HAS_INDICES: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
              BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    bos, length = _segment(cu_ptr, n, L, VARLEN)
    ll = (tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)  # times a row stride: past 2^31
    l_ok = ll < length  # all false in a token tile past this sequence's end: it loads and stores nothing
    row = _state_row(idx_ptr, n, HAS_INDICES)
    x_seq = x_ptr + n.to(tl.int64) * sx_n + bos * sx_t
    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for w in tl.static_range(WIDTH):
        c = ll + (w - (WIDTH - 1))  # [BLOCK_L]: the input column this tap reads, < 0 inside the state
        in_x = c >= 0
        xv = tl.load(x_seq + c[:, None] * sx_t + d[None, :] * sx_d,
                     mask=(in_x & l_ok)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:
            sv = tl.load(s_ptr + row * ss_n + d[None, :] * ss_d + (KEEP + c)[:, None] * ss_s,
                         mask=(~in_x & l_ok)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            xv += sv  # exactly one of the two loads is unmasked; the other is 0
        wv = tl.load(w_ptr + d * sw_d + w * sw_w, mask=d_ok, other=0.0).to(tl.float32)
        acc += xv * wv[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    out_seq = out_ptr + n.to(tl.int64) * so_n + bos * so_t
    tl.store(out_seq + ll[:, None] * so_t + d[None, :] * so_d, acc.to(out_ptr.dtype.element_ty),
             mask=l_ok[:, None] & d_ok[None, :])


@triton.jit
def _conv_state(x_ptr, s_ptr, t_ptr, cu_ptr, idx_ptr, sx_n, sx_t, sx_d, ss_n, ss_d, ss_s, st_n, st_d, st_s, D, L,
                KEEP: tl.constexpr, VARLEN: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INDICES: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """new[:, j] = (state || x)[:, j + length] for j < KEEP, from s_ptr into t_ptr (the same pool when in place)."""
    n = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    bos, length = _segment(cu_ptr, n, L, VARLEN)
    if VARLEN:
        live = length > 0  # an empty segment leaves its pool row as it is
    else:
        live = length >= 0  # always: with L = 0 the state is copied over (to final_states, or onto itself)
    if live:
        row = _state_row(idx_ptr, n, HAS_INDICES)
        x_seq = x_ptr + n.to(tl.int64) * sx_n + bos * sx_t + d * sx_d
        for j in tl.static_range(KEEP):
            src = d.to(tl.int64) * 0 + (j + length)  # a [BLOCK_D] vector: the interpreter masks with vectors only
            in_x = src >= KEEP
            val = tl.load(x_seq + (src - KEEP) * sx_t, mask=d_ok & in_x, other=0.0)
            if HAS_STATE:
                val += tl.load(s_ptr + row * ss_n + d * ss_d + src * ss_s, mask=d_ok & ~in_x, other=0.0)
            tl.store(t_ptr + row * st_n + d * st_d + j * st_s, val.to(t_ptr.dtype.element_ty), mask=d_ok)


def _launch(ctx, x, weight, bias, state, new_state, out, cu=None, indices=None) -> None:
    """x [N, L, D] as strides (or packed [T, D] with cu); state [P, D, S] read (None: zeros); new_state [P, D, S]
    written (None: not kept); out like x."""
    varlen = cu is not None
    if varlen:
        n, total, d = cu.shape[0] - 1, x.shape[0], x.shape[1]
        sx, so = (0, *x.stride()), (0, *out.stride())
        length = total
    else:
        n, d, length = x.shape
        sx = (x.stride(0), x.stride(2), x.stride(1))  # [B, D, L] read as (sequence, token, channel)
        so = (out.stride(0), out.stride(2), out.stride(1))
    if n == 0 or d == 0:
        return
    width = weight.shape[1]
    kept = state if state is not None else new_state
    keep = kept.shape[-1] if kept is not None else width - 1
    dummy = x
    ss = state.stride() if state is not None else (0, 0, 0)
    common = dict(VARLEN=varlen, HAS_STATE=state is not None, HAS_INDICES=indices is not None, BLOCK_D=BLOCK_D)
    if length:
        block_l = min(MAX_BLOCK_L, triton.next_power_of_2(length))
        grid = (n, triton.cdiv(d, BLOCK_D), triton.cdiv(length, block_l))
        _conv_out[grid](x, weight, bias if bias is not None else dummy, state if state is not None else dummy, out,
                        cu if varlen else dummy, indices if indices is not None else dummy,
                        *sx, *so, *ss, *weight.stride(), d, length,
                        WIDTH=width, KEEP=keep, HAS_BIAS=bias is not None,
                        SILU=ctx.params.get("activation") == "silu", BLOCK_L=block_l, **common)
    if new_state is not None and keep:
        _conv_state[(n, triton.cdiv(d, BLOCK_D))](x, state if state is not None else dummy, new_state,
                                                 cu if varlen else dummy, indices if indices is not None else dummy,
                                                 *sx, *ss, *new_state.stride(), d, length, KEEP=keep, **common)


# inputs: x [B, D, L], weight [D, W], bias [D] or None, initial_states [B, D, W-1] or None; outputs: out [B, D, L],
# optionally final_states [B, D, W-1] (the last W-1 columns of initial_states || x).
@KERNELS.kernel("llm.causal_conv1d", FLOATS, meta=KernelMeta(capture_safe=True), **TRITON)
def causal_conv1d_triton(ctx, inputs, outputs) -> None:
    x, weight, bias, initial = inputs
    _launch(ctx, x, weight, bias, initial, outputs[1] if len(outputs) > 1 else None, outputs[0])


# inputs: x [B, D, L] or [B, D], weight, bias, conv_state (optional 4th; it is outputs[1]), state_indices [B] or
# None (optional 5th); outputs: out like x, conv_state [B, D, S] or the pool [P, D, S], shifted in place.
@KERNELS.kernel("llm.causal_conv1d_update", FLOATS, meta=KernelMeta(inplace=True, capture_safe=True), **TRITON)
def causal_conv1d_update_triton(ctx, inputs, outputs) -> None:
    x, weight, bias = inputs[:3]
    indices = inputs[4] if len(inputs) > 4 else None
    out, pool = outputs
    if x.dim() == 2:  # [B, D]: one step
        x, out = x.unsqueeze(-1), out.unsqueeze(-1)
    _launch(ctx, x, weight, bias, pool, pool, out, indices=indices)


# inputs: x [T, D] (any strides), weight, bias, conv_states [P, D, S] (= outputs[1]), cu_seqlens [N + 1],
# state_indices [N]; outputs: out [T, D], conv_states advanced in place.
@KERNELS.kernel("llm.causal_conv1d_varlen", FLOATS, meta=KernelMeta(inplace=True, capture_safe=True), **TRITON)
def causal_conv1d_varlen_triton(ctx, inputs, outputs) -> None:
    x, weight, bias, _, cu, indices = inputs
    out, pool = outputs
    _launch(ctx, x, weight, bias, pool, pool, out, cu=cu, indices=indices)

