"""KV-cache kernels: ``llm.reshape_and_cache`` (store a step's keys and values in place) and
``llm.flash_attention_with_kvcache`` (attention that reads the cache in place through a block table).

The cache is ``[num_blocks, block_size, Hkv, D]`` per layer for keys and for values. Token t goes to
flat row ``slot_mapping[t]`` (block * block_size + offset; a negative slot is padding and is skipped, as
in vLLM). Sequence i owns blocks ``block_table[i, :ceil(seqlens_k[i] / block_size)]``; a cache with one
block per sequence of ``max_len`` rows is the case ``block_size = max_len``, ``block_table[i] = [slot]``,
and then attention reads each sequence's keys as one view, with no copy.
"""

from __future__ import annotations

import torch

from dtorch.dispatch.meta import KernelMeta
from dtorch.kernels.torch.attention import SDPA_VARIES, _sdpa_check, _sdpa_into, attention_dense_reference
from dtorch.kernels.torch.registry import FLOATS, KERNELS

INPLACE = KernelMeta(inplace=True, capture_safe=False)
SMALL_STEP = 8  # rows up to which reshape_and_cache copies row by row (~1 us each) instead of masking and indexing


@KERNELS.kernel("llm.reshape_and_cache", FLOATS, meta=INPLACE)
def reshape_and_cache_reference(ctx, inputs, outputs):
    key, value, _, _, slots = inputs  # key/value [T, Hkv, D]; slots int [T]
    kc, vc = outputs  # the caches themselves, [blocks, block_size, Hkv, D]
    if key.shape[0] == 0:
        return
    if slots.device.type == "cpu" and key.shape[0] <= SMALL_STEP:  # decode: a row copy per token beats the masks
        kflat, vflat = kc.flatten(0, 1), vc.flatten(0, 1)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                kflat[s].copy_(key[t])
                vflat[s].copy_(value[t])
        return
    if slots.device.type != "cpu" or int(slots.min()) < 0:  # padding rows (reading a CPU value is free)
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    if slots.dtype != torch.int64:
        slots = slots.long()
    kc.flatten(0, 1).index_copy_(0, slots, key)
    vc.flatten(0, 1).index_copy_(0, slots, value)


def _sequences(cu_q: torch.Tensor, seqlens_k: torch.Tensor, block_table: torch.Tensor, block_size: int):
    """(q0, q1, keys, blocks) of every sequence with at least one query (host reads of small int tensors;
    only the blocks a sequence uses are read)."""
    bq, lens = cu_q.tolist(), seqlens_k.tolist()
    one = block_table.shape[1] == 1
    table = block_table.view(-1).tolist() if one else None
    for i in range(len(lens)):
        if bq[i + 1] > bq[i]:
            n = lens[i]
            blocks = [table[i]] if one else block_table[i, :-(-n // block_size)].tolist()
            yield bq[i], bq[i + 1], n, blocks


def _keys(cache: torch.Tensor, blocks: list[int], length: int) -> torch.Tensor:
    """[length, Hkv, D]: a view of one block when the sequence fits in it, else the blocks gathered."""
    if len(blocks) <= 1:
        return cache[blocks[0], :length] if length else cache[0, :0]
    return cache[blocks].flatten(0, 1)[:length]


@KERNELS.kernel("llm.flash_attention_with_kvcache", FLOATS)
def flash_attention_with_kvcache_reference(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    out = outputs[0]
    p = ctx.params
    for q0, q1, n, blocks in _sequences(cu_q, seqlens_k, block_table, kc.shape[1]):
        o = attention_dense_reference(q[None, q0:q1], _keys(kc, blocks, n)[None], _keys(vc, blocks, n)[None],
                                      p.causal, p.scale)
        out[q0:q1].copy_(o[0])


@KERNELS.kernel("llm.flash_attention_with_kvcache", FLOATS, provider="sdpa", check=_sdpa_check,
                 varies=SDPA_VARIES)
def flash_attention_with_kvcache_sdpa(ctx, inputs, outputs):
    q, kc, vc, cu_q, seqlens_k, block_table = inputs
    out = outputs[0]
    p = ctx.params
    for q0, q1, n, blocks in _sequences(cu_q, seqlens_k, block_table, kc.shape[1]):
        _sdpa_into(q[None, q0:q1], _keys(kc, blocks, n)[None], _keys(vc, blocks, n)[None], out[None, q0:q1],
                   p.causal, p.scale)
