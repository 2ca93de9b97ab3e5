"""KV-cache kernels: ``llm.reshape_and_cache`` (store a step's keys and values in place) and
``llm.flash_attention_with_kvcache`` (attention that reads the cache in place through a block table).

The cache is ``[num_blocks, block_size, Hkv, D]`` per layer for keys and for values. Token t goes to
flat row ``slot_mapping[t]`` (block * block_size + offset; a negative slot is padding and is skipped, as
in vLLM). Sequence i owns blocks ``block_table[i, :ceil(seqlens_k[i] / block_size)]``; a cache with one
block per sequence of ``max_len`` rows is the case ``block_size = max_len``, ``block_table[i] = [slot]``.

Attention has three candidates. "reference" and, on cpu, "sdpa" walk the sequences on the host
(``cu_seqlens_q.tolist()``: free on cpu, and the fastest there, reading only the blocks in use): not capture-safe.
"torch" pads instead and reads nothing on the host (capture-safe, any device): what a captured step, an accelerator
without a faster kernel, and the native kernel's fallback run. ``reshape_and_cache`` reads nothing on the host.
"""

from __future__ import annotations

import torch

from dtorch.dispatch.meta import Call, KernelMeta
from dtorch.kernels.torch.attention import (
    SDPA_VARIES,
    _nonfinite,
    _sdpa_check,
    _sdpa_dense,
    _sdpa_into,
    attention_dense_reference,
)
from dtorch.kernels.torch.registry import FLOATS, KERNELS

INPLACE = KernelMeta(inplace=True)  # outputs are the caches (inputs 2 and 3); no host read
HOST_LOOP = KernelMeta(capture_safe=False)  # walks the sequences on the host (cu_seqlens_q.tolist())


@KERNELS.kernel("llm.reshape_and_cache", FLOATS, meta=INPLACE)
def reshape_and_cache_reference(ctx, inputs, outputs):
    key, value, _, _, slots = inputs  # key/value [T, Hkv, D]; slots int [T]
    kc, vc = outputs  # the caches themselves, [blocks, block_size, Hkv, D]
    t = key.shape[0]
    if t == 0:
        return
    # Padding rows (slot < 0) are skipped without reading a slot on the host: each writes the first valid row's
    # (slot, value) again, so duplicate indices carry identical values; with no valid row, every row rewrites
    # flat row 0 with its own old contents.
    slots = slots.long()
    valid = slots >= 0                                                        # [T]
    first = valid.to(torch.uint8).argmax()                                    # the first valid row (0 if none)
    some = valid[first]                                                       # 0-d: any valid row at all
    src = torch.where(valid, torch.arange(t, device=slots.device), first)     # [T]: the row each row writes
    dst = torch.where(valid, slots, torch.where(some, slots[first], 0))       # [T]: where it goes
    for new, cache in ((key, kc), (value, vc)):
        flat = cache.flatten(0, 1)                                            # [blocks * block_size, Hkv, D]
        rows = torch.where(some, new.index_select(0, src).to(cache.dtype), flat[0])  # new: flat[0] is copied
        flat.index_copy_(0, dst, rows)


# -- llm.flash_attention_with_kvcache ---------------------------------------------------------------------------
# inputs: q [T, H, D], k/v cache [blocks, bs, Hkv, D], cu_seqlens_q int32 [N + 1], seqlens_k int32 [N], block_table
# int32 [N, W]; outputs: out [T, H, D]; params causal (bottom-right), scale.

def first_key(n: int, nq: int, window: int) -> int:
    """The oldest key any of a sequence's ``nq`` queries sees among its ``n`` keys under sliding ``window`` (0: none):
    the first query, at position n - nq, sees keys above n - nq - window."""
    return max(0, n - nq - window + 1) if window else 0


def _sequences(cu_q: torch.Tensor, seqlens_k: torch.Tensor, block_table: torch.Tensor, block_size: int,
               window: int = 0):
    """(q0, q1, keys, blocks) of every sequence with at least one query (host reads of small int tensors;
    only the blocks a sequence uses are read). Under a sliding ``window``, blocks wholly before every query's window
    are left out (keys and blocks then count from the first block kept: bottom-right masks do not change)."""
    bq, lens = cu_q.tolist(), seqlens_k.tolist()
    one = block_table.shape[1] == 1
    table = block_table.view(-1).tolist() if one else None
    for i in range(len(lens)):
        if bq[i + 1] > bq[i]:
            n = lens[i]
            skip = first_key(n, bq[i + 1] - bq[i], window) // block_size
            blocks = [table[i]] if one else block_table[i, skip:-(-n // block_size)].tolist()
            yield bq[i], bq[i + 1], n - skip * block_size, blocks


def _keys(cache: torch.Tensor, blocks: list[int], length: int, dtype: torch.dtype) -> torch.Tensor:
    """[length, Hkv, D] in ``dtype`` (q's): a view of one block when the sequence fits in it, else the blocks
    gathered; a cache of another dtype (bfloat16 under float32 activations) is widened."""
    if len(blocks) <= 1:
        keys = cache[blocks[0], :length] if length else cache[0, :0]
    else:
        keys = cache[blocks].flatten(0, 1)[:length]
    return keys.to(dtype)


@KERNELS.kernel("llm.flash_attention_with_kvcache", FLOATS, meta=HOST_LOOP)
def flash_attention_with_kvcache_reference(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    out = outputs[0]
    p = ctx.params
    w = p.get("window", 0)
    for q0, q1, n, blocks in _sequences(cu_q, seqlens_k, block_table, kc.shape[1], w):
        o = attention_dense_reference(q[None, q0:q1], _keys(kc, blocks, n, q.dtype)[None],
                                      _keys(vc, blocks, n, q.dtype)[None], p.causal, p.scale, w,
                                      p.get("softcap", 0.0))
        out[q0:q1].copy_(o[0])


@KERNELS.kernel("llm.flash_attention_with_kvcache", FLOATS, provider="sdpa", devices=("cpu",), meta=HOST_LOOP,
                check=_sdpa_check, varies="one sdpa call per sequence, on views of its blocks")
def flash_attention_with_kvcache_sdpa(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    out = outputs[0]
    p = ctx.params
    w = p.get("window", 0)
    for q0, q1, n, blocks in _sequences(cu_q, seqlens_k, block_table, kc.shape[1], w):
        _sdpa_into(q[None, q0:q1], _keys(kc, blocks, n, q.dtype)[None], _keys(vc, blocks, n, q.dtype)[None],
                   out[None, q0:q1], p.causal, p.scale, w)


# The "torch" kernel pads instead of walking the sequences, so nothing is read on the host: each sequence's whole
# block-table row is gathered (S = W * block_size keys, masked past seqlens_k and by causal position), and the
# query rows are laid out one of two ways, whichever holds fewer elements (static shapes decide):
#   per token:    each query row is a batch of one against its sequence's keys: T * S * Hkv * D gathered (decode);
#   per sequence: q padded to [N, T, H, D] (T: the static bound on a sequence's queries) against [N, S, Hkv, D],
#                 scores N * H * T * S (prefill).
# The check declines calls over PADDED_LIMIT elements (a long prefill of many sequences): the loops serve them.
PADDED_LIMIT = 2**27


def _padded_sizes(t: int, h: int, d: int, n: int, s: int, hkv: int) -> tuple[int, int]:
    """Elements of the per-token and the per-sequence layouts."""
    return t * s * hkv * d, n * s * hkv * d + n * t * h * s


def _padded_check(call: Call) -> str | None:
    reason = _sdpa_check(call)
    if reason is not None or call.inputs is None:
        return reason
    q, kc, _, _, _, table = call.inputs
    (t, h, d), (n, w), (bs, hkv) = q.shape, table.shape, kc.shape[1:3]
    size = min(_padded_sizes(t, h, d, n, w * bs, hkv))
    return None if size <= PADDED_LIMIT else f"padded attention would hold {size} elements > {PADDED_LIMIT}"


@KERNELS.kernel("llm.flash_attention_with_kvcache", FLOATS, provider="torch", check=_padded_check,
                varies=SDPA_VARIES + "; one query row per batch when that is smaller than padding the sequences")
def flash_attention_with_kvcache_padded(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    out = outputs[0]
    (t, h, d), (n, w), (bs, hkv) = q.shape, block_table.shape, kc.shape[1:3]
    s = w * bs
    if t == 0:
        return
    if s == 0:  # no block to read: every row sees no key
        out.zero_()
        return
    p = ctx.params
    table = block_table.long()
    cu, lens = cu_q.long(), seqlens_k.long()
    tok = torch.arange(t, device=q.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)                     # [T]: each query row's sequence
    qpos = tok - cu[seq]                                                  # its index among its sequence's queries
    klen = lens[seq]                                                      # [T]: keys it may see
    j = torch.arange(s, device=q.device)
    visible = j < klen[:, None]                                           # [T, S]
    diag = qpos + klen - (cu[1:] - cu[:-1])[seq]                          # [T]: i + S_i - T_i
    if p.causal:
        visible &= j <= diag[:, None]                                     # bottom-right
    window = p.get("window", 0)
    if window:                                                            # sliding: keys above diag - window
        visible &= j > (diag - window)[:, None]
    per_token, per_seq = _padded_sizes(t, h, d, n, s, hkv)
    if per_token <= per_seq:
        rows = table.index_select(0, seq)                                 # [T, W]
        kp, vp = kc[rows].flatten(1, 2), vc[rows].flatten(1, 2)           # [T, S, Hkv, D], fresh gathers
        qp, mask = q[:, None], visible[:, None, None]                     # [T, 1, H, D], [T, 1, 1, S]
        kvseq, where = visible, None
    else:
        kp, vp = kc[table].flatten(1, 2), vc[table].flatten(1, 2)         # [N, S, Hkv, D]
        where = seq * t + qpos                                            # [T]: padded row of each query row
        qp = q.new_zeros(n * t, h, d).index_copy_(0, where, q).view(n, t, h, d)
        mask = visible.new_zeros(n * t, s).index_copy_(0, where, visible).view(n, 1, t, s)
        kvseq = visible
    kp, vp = kp.to(q.dtype), vp.to(q.dtype)                               # a cache of another dtype, widened
    # NaN rows: a query row that reads a non-finite q, k or v value; padded and masked keys are zeroed, leaking nothing
    bad = _nonfinite(kp) + _nonfinite(vp)                                 # [T or N, S, Hkv]
    bad = bad if where is None else bad.index_select(0, seq)              # [T, S, Hkv]
    row = torch.where(kvseq[..., None], bad, 0.0).sum(1).repeat_interleave(h // hkv, dim=1)  # [T, H]
    poison = (row + _nonfinite(q)).unsqueeze(-1)                          # [T, H, 1]
    # slots past a sequence's keys were never written: whatever they hold (huge finite values too, whose scores
    # overflow to inf and turn NaN under the mask's -inf) is zeroed, and the non-finite keys it sees become 0
    written = j < (lens if where is not None else klen)[:, None]           # [T or N, S]
    if window:  # keys before the window may sit in freed blocks, reused by another sequence: never multiplied
        written &= visible if where is None else j >= (lens - (cu[1:] - cu[:-1]) - window + 1)[:, None]
    written = written[..., None, None]                                    # [T or N, S, 1, 1]
    kp = kp.nan_to_num_(0.0, 0.0, 0.0).masked_fill_(~written, 0.0)
    vp = vp.nan_to_num_(0.0, 0.0, 0.0).masked_fill_(~written, 0.0)
    o = _sdpa_dense(qp, kp, vp, mask, False, p.scale)                     # [T, 1, H, D] or [N, T, H, D]
    o = o[:, 0] if where is None else o.reshape(n * t, h, d).index_select(0, where)
    seen = visible.any(-1)[:, None, None]                                 # [T, 1, 1]: rows that see no key give 0
    out.copy_(torch.where(seen, o + poison, 0.0))
