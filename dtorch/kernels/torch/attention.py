"""Attention kernels in the flash-attn convention: ``llm.flash_attention`` and ``llm.flash_attention_varlen``.

Layouts: dense q [B, T, H, D], k/v [B, S, Hkv, D] -> out [B, T, H, D]; varlen q [total_q, H, D],
k/v [total_k, Hkv, D], cu_seqlens_q/k int32 [N+1] -> out [total_q, H, D]. Query head h reads kv
head h // (H / Hkv) (GQA). ``causal`` is aligned bottom-right: query i of a segment with T queries
and S keys sees keys j <= i + S - T; a query row that sees no key outputs zeros (as flash-attn).
Non-finite input: an output row is NaN when its q row, or a k or v row of a key it sees, holds a NaN or an
inf (``_poison``), whatever a backend's online softmax would make of it, so every provider agrees; a row
that sees no key is 0 all the same.
params: causal, scale (already resolved to a float by the wrapper), and for varlen max_seqlen_q/k.

The reference computes QK^T -> mask -> softmax -> V explicitly in float32 (float64 for float64).
The "sdpa" provider runs torch's ``scaled_dot_product_attention`` on [B, H, T, D] views. Varlen on
CPU runs it per segment (reading cu_seqlens on the host is free there, and it was ~6x faster than
padding for batched decode); on other devices it pads the segments into one batch with a key mask
(gathers, no host sync, one launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.kernels.torch.registry import FLOATS, KERNELS


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _visible(t: int, s: int, causal: bool, device: torch.device, window: int = 0) -> torch.Tensor | None:
    """Bool [T, S]: may query i see key j (bottom-right causal: j <= i + S - T; a sliding ``window`` > 0 also hides
    keys j <= i + S - T - window), or None when every key is visible."""
    slides = window > 0 and s > window
    if not slides and (not causal or t == 1 and s >= 1):
        return None
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(s, device=device).unsqueeze(0)
    diag = i + (s - t)
    seen = j <= diag if causal else torch.ones(t, s, dtype=torch.bool, device=device)
    return seen & (j > diag - window) if slides else seen


def _nonfinite(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> [...] float32: 0 where the row is finite, NaN where it holds a NaN or an inf (one pass)."""
    lo, hi = torch.aminmax(x, dim=-1)  # NaN propagates; an inf shows in the min or the max
    return (lo * 0 + hi * 0).float()


def _finite(x: torch.Tensor) -> torch.Tensor:
    """x with every NaN and inf replaced by 0 (a copy; the rows that held them are poisoned by ``_poison``)."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _poison(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int = 0) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, S, Hkv, D] -> [B, T, H, 1] float32: NaN for each output row that reads a non-finite
    value (its q row, or the k/v row of a key it sees), else 0; add it to the output. Rows that see no key get 0."""
    b, t, h, _ = q.shape
    s, hkv = k.shape[1], k.shape[2]
    kv = _nonfinite(k) + _nonfinite(v)  # [B, S, Hkv]
    if window and s > window:  # a sliding window: each row's own keys (a prefix sum would carry NaNs it does not see)
        seen = _visible(t, s, causal, q.device, window)
        row = torch.where(seen[None, :, :, None], kv[:, None], 0.0).sum(2)  # [B, T, Hkv]
    elif causal and not (t == 1 and s >= 1):
        last = torch.arange(t, device=q.device) + (s - t)  # the last key each query row sees (< 0: none)
        seen = kv.cumsum(1).index_select(1, last.clamp(min=0))  # [B, T, Hkv]: NaN once a NaN is in the prefix
        row = torch.where((last >= 0).view(1, t, 1), seen, 0.0)
    else:
        row = kv.sum(1, keepdim=True)  # [B, 1, Hkv]
    return (row.repeat_interleave(h // hkv, dim=2) + _nonfinite(q)).unsqueeze(-1)


def attention_dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                              scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, S, Hkv, D] -> [B, T, H, D] in the compute dtype (float32 or float64); ``window`` > 0:
    a sliding window (see ``_visible``); ``softcap`` > 0: scores capped as softcap * tanh(scores / softcap)."""
    cdt = _compute_dtype(q.dtype)
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if s == 0:
        return torch.zeros(b, t, h, v.shape[-1], dtype=cdt, device=q.device)
    mask = _visible(t, s, causal, q.device, window)
    kf, vf = (k, v) if mask is None else (_finite(k), _finite(v))  # a masked key's NaN must not leak (0 * NaN)
    qh = q.to(cdt).transpose(1, 2)  # [B, H, T, D]
    kh = kf.to(cdt).transpose(1, 2).repeat_interleave(h // hkv, dim=1)  # [B, H, S, D]
    vh = vf.to(cdt).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale  # [B, H, T, S]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vh).transpose(1, 2) + _poison(q, k, v, causal, window)  # [B, T, H, D]
    if mask is not None:  # rows with no visible key: softmax of all -inf is NaN; flash-attn gives 0
        out = out.masked_fill(~mask.any(-1)[None, :, None, None], 0.0)
    return out


@KERNELS.kernel("llm.flash_attention", FLOATS)
def flash_attention_reference(ctx, inputs, outputs):
    q, k, v = inputs
    p = ctx.params
    outputs[0].copy_(attention_dense_reference(q, k, v, p.causal, p.scale))


def _sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal_square: bool,
                scale: float) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, S, Hkv, D], mask broadcastable to [B, H, T, S] or None -> [B, T, H, D] view.

    Without a mask (or with one that is the same for every query), the G = H / Hkv query heads that
    share a kv head are folded into the query axis, so k and v are never expanded; decode (T = 1)
    folds with views only.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D]
    if g > 1 and not causal_square and (mask is None or mask.shape[-2] == 1):
        qf = q.view(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)  # [B, Hkv, T*G, D]
        o = F.scaled_dot_product_attention(qf, kh, vh, attn_mask=mask, scale=scale)
        return o.view(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, h, d)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, attn_mask=mask, is_causal=causal_square,
                                       scale=scale, enable_gqa=g > 1)
    return o.transpose(1, 2)


# CUDA's fused sdpa backends (flash, memory-efficient) serve head dims up to 256; above that torch
# silently falls back to its math path, which materializes [B, H, T, S] like the reference does.
SDPA_CUDA_MAX_HEAD_DIM = 256
SDPA_VARIES = f"on cuda, head_dim > {SDPA_CUDA_MAX_HEAD_DIM} falls to the reference"


def _head_dim(call: Call) -> int | None:
    if call.inputs is not None:
        return int(call.inputs[0].shape[-1])
    return call.params.get("head_dim")


def _sdpa_check(call: Call) -> str | None:
    """Declines head dims the CUDA fused backends do not serve (CPU sdpa serves every head dim), and capped scores."""
    if call.params.get("softcap", 0.0):
        return "softcap: sdpa has no soft-capping of the scores"
    d = _head_dim(call)
    if call.device.type == "cuda" and d is not None and d > SDPA_CUDA_MAX_HEAD_DIM:
        return f"head_dim {d} > {SDPA_CUDA_MAX_HEAD_DIM}: no fused sdpa backend on cuda"
    return None


def _sdpa_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, causal: bool,
               scale: float, window: int = 0) -> None:
    """q [B, T, H, D], k/v [B, S, Hkv, D] -> out [B, T, H, D], flash-attn semantics; ``window`` > 0: a sliding
    window (see ``_visible``)."""
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if s == 0:
        out.zero_()
        return
    if window and t == 1 and s > window:  # decode: the window is the last keys
        k, v, s = k[:, s - window:], v[:, s - window:], window
    if window and s > window:
        mask = _visible(t, s, causal, q.device, window)
        poison = _poison(q, k, v, causal, window)
        k, v = _finite(k), _finite(v)  # a hidden key must not leak its NaN or inf
        out.copy_(_sdpa_dense(q, k, v, mask, False, scale))
        out.add_(poison)
        out.masked_fill_(~mask.any(-1)[None, :, None, None], 0.0)  # rows that see no key
        return
    if t == 1 and out.is_contiguous():  # decode: one query sees every key; GQA heads fold into the query axis
        o = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), k.transpose(1, 2), v.transpose(1, 2),
                                           scale=scale)  # [B, Hkv, G, D]
        out.view(b, hkv, h // hkv, d).copy_(o)
        out.add_(_poison(q, k, v, False))
        return
    causal = causal and not (t == 1 and s >= 1)  # one query at the end of its keys sees all of them
    mask = _visible(t, s, causal, q.device) if causal and t != s else None
    poison = _poison(q, k, v, causal)
    if causal:  # a masked-out key must not leak its NaN or inf (sdpa adds the mask): rows that see it are poisoned
        k, v = _finite(k), _finite(v)
    out.copy_(_sdpa_dense(q, k, v, mask, causal and t == s, scale))
    out.add_(poison)
    if causal and t > s:  # leading query rows that see no key
        out[:, : t - s].zero_()


@KERNELS.kernel("llm.flash_attention", FLOATS, provider="sdpa", check=_sdpa_check,
                 varies=SDPA_VARIES)
def flash_attention_sdpa(ctx, inputs, outputs):
    q, k, v = inputs
    _sdpa_into(q, k, v, outputs[0], ctx.params.causal, ctx.params.scale)


# -- varlen ----------------------------------------------------------------------------------------
# Capture safety: the reference, and sdpa on cpu, walk the segments on the host (cu_seqlens.tolist()); sdpa
# elsewhere pads them with gathers and reads nothing (the same device work for the same shapes).
HOST_LOOP = KernelMeta(capture_safe=False)

def _each_segment(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(q0, q1, k0, k1) of every segment with at least one query, from the cumulative lengths (a host read)."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        if bq[i + 1] > bq[i]:
            yield bq[i], bq[i + 1], bk[i], bk[i + 1]


@KERNELS.kernel("llm.flash_attention_varlen", FLOATS, meta=HOST_LOOP)
def flash_attention_varlen_reference(ctx, inputs, outputs):
    q, k, v, cu_q, cu_k = inputs
    out = outputs[0]
    p = ctx.params
    for q0, q1, k0, k1 in _each_segment(cu_q, cu_k):
        o = attention_dense_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], p.causal, p.scale)
        out[q0:q1].copy_(o[0])


def _segments(cu: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu [N+1] -> (index [N, max_len] into the packed axis, valid [N, max_len], lengths [N]); no host sync."""
    cu = cu.long()
    lengths = cu[1:] - cu[:-1]
    pos = torch.arange(max_len, device=cu.device)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
    index = torch.where(valid, cu[:-1].unsqueeze(1) + pos, 0)
    return index, valid, lengths


@KERNELS.kernel("llm.flash_attention_varlen", FLOATS, provider="sdpa", devices=("cpu",), meta=HOST_LOOP,
                check=_sdpa_check, varies=SDPA_VARIES)
@KERNELS.kernel("llm.flash_attention_varlen", FLOATS, provider="sdpa", devices=("cuda",), check=_sdpa_check,
                varies=SDPA_VARIES)
def flash_attention_varlen_sdpa(ctx, inputs, outputs):
    if inputs[0].device.type == "cpu":
        varlen_sdpa_per_segment(ctx, inputs, outputs)
    else:
        varlen_sdpa_padded(ctx, inputs, outputs)


def varlen_sdpa_per_segment(ctx, inputs, outputs) -> None:
    """One sdpa call per segment on views of the packed tensors (a decode segment folds its GQA heads)."""
    q, k, v, cu_q, cu_k = inputs
    out = outputs[0]
    p = ctx.params
    for q0, q1, k0, k1 in _each_segment(cu_q, cu_k):
        _sdpa_into(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1], p.causal, p.scale)


def varlen_sdpa_padded(ctx, inputs, outputs) -> None:
    """Pads the N segments into one [N, max_q, H, D] x [N, max_k, Hkv, D] batch with a key mask.

    The padded keys cost one gather of k and v; in exchange the batch is one sdpa call with no host
    sync, which is what batched decode (N segments of one query each) needs on an accelerator.
    """
    q, k, v, cu_q, cu_k = inputs
    out = outputs[0]
    p = ctx.params
    n = cu_q.shape[0] - 1
    max_q, max_k = p.max_seqlen_q, p.max_seqlen_k
    total_q, h, d = q.shape
    if n == 0 or total_q == 0:
        return
    if k.shape[0] == 0 or max_k == 0:
        out.zero_()
        return
    kidx, kvalid, klen = _segments(cu_k, max_k)
    kp = k[kidx]  # [N, max_k, Hkv, D]
    vp = v[kidx]
    decode = max_q == 1 and total_q == n  # every segment has exactly one query
    if decode:
        qp = q.view(n, 1, h, d)
        qlen = None
        visible = kvalid.view(n, 1, 1, max_k)  # bottom-right causal: the one query sees every key
    else:
        qidx, _, qlen = _segments(cu_q, max_q)
        qp = q[qidx]  # [N, max_q, H, D]
        visible = kvalid.view(n, 1, 1, max_k)
        if p.causal:
            i = torch.arange(max_q, device=q.device).view(1, max_q, 1)
            j = torch.arange(max_k, device=q.device).view(1, 1, max_k)
            shift = (klen - qlen).view(n, 1, 1)
            visible = (visible & (j <= i + shift).unsqueeze(1))  # [N, 1, max_q, max_k]
    # rows that see a non-finite q, k or v value are NaN; padded and masked keys are zeroed so they leak nothing
    kv = _nonfinite(kp) + _nonfinite(vp)  # [N, max_k, Hkv]
    sees = visible.squeeze(1).unsqueeze(-1)  # [N, max_q or 1, max_k, 1]
    row = torch.where(sees, kv.unsqueeze(1), 0.0).sum(2).repeat_interleave(h // k.shape[1], dim=2)
    poison = (row + _nonfinite(qp)).unsqueeze(-1)  # [N, max_q, H, 1]
    kp, vp = kp.nan_to_num_(0.0, 0.0, 0.0), vp.nan_to_num_(0.0, 0.0, 0.0)  # fresh gathers: safe in place
    o = _sdpa_dense(qp, kp, vp, visible, False, p.scale) + poison  # [N, max_q, H, D]
    # rows whose segment has no visible key (no keys at all, or causal rows before the first key)
    seen = visible.any(-1).transpose(1, 2)  # [N, max_q or 1, 1]
    o = o.masked_fill(~seen.unsqueeze(-1), 0.0)
    if decode:
        out.copy_(o.view(total_q, h, d))
        return
    # packed token t of segment i sits at padded row i * max_q + (t - cu_q[i]); computed without a host sync
    tok = torch.arange(total_q, device=q.device)
    cu = cu_q.long()
    seg = torch.searchsorted(cu[1:], tok, right=True)
    rows = seg * max_q + tok - cu[seg]
    out.copy_(o.reshape(n * max_q, h, d)[rows])
