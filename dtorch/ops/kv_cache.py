"""KV-cache op wrappers: ``reshape_and_cache`` stores a step's keys and values into the cache in place;
``flash_attention_with_kvcache`` attends over each sequence's cached keys through its block table.

Cache layout: key_cache / value_cache [num_blocks, block_size, Hkv, D]. ``slot_mapping`` int [T] gives
each new token's flat row (block * block_size + offset; negative: padding, skipped). Sequence i has
queries ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q [total_q, H, D], ``seqlens_k[i]`` keys in the cache
(its new tokens included), held in blocks ``block_table[i, :ceil(seqlens_k[i] / block_size)]``.
Causal masking is bottom-right, as flash-attn's: query j of a sequence with Tq queries and S keys sees
keys up to j + S - Tq. A sliding ``window`` W (None: no window) hides keys older than the window: that query sees
only keys above j + S - Tq - W, i.e. its own position and the W - 1 before it (transformers' and llama.cpp's
sliding window). Blocks that lie wholly before every query's window are never read, so the engine may free them
(their block-table entries may then name any block). Values are checked on CPU only (``_checks.host_readable``);
device values are trusted, validated where they are made (the step's slot mapping and block table, built on the
host).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dtorch.core.device import Device
from dtorch.core.dtypes import FLOAT_DTYPES, INT_DTYPES
from dtorch.core.errors import ArgumentError, ShapeError
from dtorch.core.placement import Shard
from dtorch.dispatch.context import KernelParams
from dtorch.kernels.torch.kv_cache import first_key
from dtorch.ops import _checks
from dtorch.ops._invoke import run
from dtorch.ops.attention import _flag, _scale
from dtorch.ops.context import RuntimeContext
from dtorch.ops.graph_op import Args, R, Shapes, Strategy, declare, head_strategies

CACHE = "llm.reshape_and_cache"
ATTN = "llm.flash_attention_with_kvcache"


def _check_cache(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _checks.tensor(op, name, t)
        if t.dim() != 4:
            raise ShapeError(f"{op}: {name!r} must be [num_blocks, block_size, Hkv, D], got {tuple(t.shape)}")
    if key_cache.shape != value_cache.shape:
        raise ShapeError(f"{op}: 'key_cache' {tuple(key_cache.shape)} and 'value_cache' {tuple(value_cache.shape)} "
                         "must have the same shape")
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ShapeError(f"{op}: the caches must be contiguous (rows are addressed as block * block_size + offset)")


def _check_cache_dtype(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """The caches share one float dtype, which may differ from the activations' (a bfloat16 cache under float32
    activations: keys and values are rounded once as they are stored, and read back widened)."""
    _checks.dtype_in(op, "key_cache", key_cache, FLOAT_DTYPES)
    _checks.same_dtype(op, {"key_cache": key_cache, "value_cache": value_cache})


def _check_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                             value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             ctx: RuntimeContext | None) -> Device:
    op = CACHE
    _check_cache(op, key_cache, value_cache)
    named = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
             "slot_mapping": slot_mapping}
    for name, t in named.items():
        _checks.tensor(op, name, t)
    device = _checks.same_device(op, named, ctx.device if ctx is not None else None)
    _checks.dtype_in(op, "key", key, FLOAT_DTYPES)
    _checks.same_dtype(op, {"key": key, "value": value})
    _check_cache_dtype(op, key_cache, value_cache)
    _checks.dtype_in(op, "slot_mapping", slot_mapping, INT_DTYPES)
    if key.dim() != 3 or key.shape != value.shape:
        raise ShapeError(f"{op}: 'key' and 'value' must both be [T, Hkv, D], got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ShapeError(f"{op}: 'key' [T, Hkv, D] = {tuple(key.shape)} does not match the cache's [..., Hkv, D] "
                         f"= {tuple(key_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ShapeError(f"{op}: 'slot_mapping' must be [T] = [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.numel() and _checks.host_readable(slot_mapping):
        rows = key_cache.shape[0] * key_cache.shape[1]
        hi = int(slot_mapping.max())
        if hi >= rows:
            raise ArgumentError(f"{op}: 'slot_mapping' holds slot {hi}, but the cache has {rows} rows "
                                f"({key_cache.shape[0]} blocks of {key_cache.shape[1]})")
    return device


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, *, ctx: RuntimeContext | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Write key/value [T, Hkv, D] into rows ``slot_mapping`` [T] of the caches [blocks, block_size, Hkv, D], in
    place (negative slots are skipped); returns (key_cache, value_cache)."""
    device = _check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, ctx)
    _run(CACHE, device, key.dtype, (key, value, key_cache, value_cache, slot_mapping), (key_cache, value_cache),
         None, ctx)
    return key_cache, value_cache


def _check_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     seqlens_k: torch.Tensor, block_table: torch.Tensor, ctx: RuntimeContext | None,
                     window: int = 0) -> Device:
    op = ATTN
    _check_cache(op, key_cache, value_cache)
    named = {"q": q, "key_cache": key_cache, "value_cache": value_cache, "cu_seqlens_q": cu_seqlens_q,
             "seqlens_k": seqlens_k, "block_table": block_table}
    for name, t in named.items():
        _checks.tensor(op, name, t)
    device = _checks.same_device(op, named, ctx.device if ctx is not None else None)
    _checks.dtype_in(op, "q", q, FLOAT_DTYPES)
    _check_cache_dtype(op, key_cache, value_cache)
    for name in ("cu_seqlens_q", "seqlens_k", "block_table"):
        _checks.dtype_in(op, name, named[name], (torch.int32,))
    if q.dim() != 3 or q.shape[-1] != key_cache.shape[-1]:
        raise ShapeError(f"{op}: 'q' must be [total_q, H, D] with the cache's D = {key_cache.shape[-1]}, "
                         f"got {tuple(q.shape)}")
    h, hkv = q.shape[1], key_cache.shape[2]
    if hkv == 0 or h % hkv:
        raise ShapeError(f"{op}: q's head count H = {h} must be a multiple of the cache's Hkv = {hkv} (GQA)")
    n = seqlens_k.shape[0] if seqlens_k.dim() == 1 else -1
    if n < 0 or cu_seqlens_q.shape != (n + 1,) or block_table.dim() != 2 or block_table.shape[0] != n:
        raise ShapeError(f"{op}: need seqlens_k [N], cu_seqlens_q [N + 1] and block_table [N, max_blocks]; got "
                         f"{tuple(seqlens_k.shape)}, {tuple(cu_seqlens_q.shape)} and {tuple(block_table.shape)}")
    if _checks.host_readable(cu_seqlens_q):
        _check_values(cu_seqlens_q, seqlens_k, block_table, q.shape[0], key_cache.shape[0], key_cache.shape[1],
                      window)
    return device


def window_param(window: object, op: str = ATTN) -> int:
    """A sliding window as the kernels take it: an int >= 1, or 0 for none (``window`` None)."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ArgumentError(f"{op}: 'window' must be None (no sliding window) or an int >= 1 (keys a query sees, "
                            f"itself included), got {window!r}")
    return window


def _check_values(cu_q: torch.Tensor, lens: torch.Tensor, table: torch.Tensor, total_q: int, blocks: int,
                  block_size: int, window: int) -> None:
    op = ATTN
    bq = cu_q.tolist()
    if bq[0] != 0 or bq[-1] != total_q or any(b > a for a, b in zip(bq[1:], bq[:-1], strict=True)):
        raise ArgumentError(f"{op}: 'cu_seqlens_q' must rise from 0 to total_q = {total_q}, got {bq}")
    for i, n in enumerate(lens.tolist()):
        if n < 0:
            raise ArgumentError(f"{op}: 'seqlens_k' must be >= 0, got {n} for sequence {i}")
        used = -(-n // block_size)
        if used > table.shape[1]:
            raise ArgumentError(f"{op}: sequence {i} has {n} keys, more than its {table.shape[1]} blocks of "
                                f"{block_size} hold")
        # blocks wholly before the window are never read (the engine may have freed them)
        ids = table[i, first_key(n, bq[i + 1] - bq[i], window) // block_size:used].tolist()
        if ids and (min(ids) < 0 or max(ids) >= blocks):
            raise ArgumentError(f"{op}: block_table row {i} names block(s) {ids}, outside 0..{blocks - 1}")


def kvcache_params(head_dim: int, causal: object = True, scale: object = None, window: object = None,
                   softcap: object = None) -> KernelParams:
    """The owned params of a ``flash_attention_with_kvcache`` call: causal, scale (default 1 / sqrt(head_dim)),
    window (0: none) and, where given, softcap (the scores capped: softcap * tanh(scores / softcap))."""
    return _kv_params(_flag(ATTN, "causal", causal), _scale(ATTN, scale, head_dim), window_param(window),
                      softcap_param(softcap))


def softcap_param(softcap: object) -> float:
    """A soft-cap of the attention scores as the kernels take it: a positive finite float, or 0.0 for none (None)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not math.isfinite(softcap) or softcap <= 0:
        raise ArgumentError(f"{ATTN}: 'softcap' must be None (no cap) or a positive finite number, got {softcap!r}")
    return float(softcap)


@lru_cache(maxsize=256)
def _kv_params(causal: bool, scale: float, window: int, softcap: float) -> KernelParams:
    if softcap:  # only where a model caps its scores: every other call's params stay as they were
        return KernelParams(causal=causal, scale=scale, window=window, softcap=softcap)
    return KernelParams(causal=causal, scale=scale, window=window)


def flash_attention_with_kvcache(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_table: torch.Tensor,
                                 causal: bool = True, scale: float | None = None, window: int | None = None,
                                 softcap: float | None = None, *, out: torch.Tensor | None = None,
                                 ctx: RuntimeContext | None = None) -> torch.Tensor:
    """Attention of q [total_q, H, D] over each sequence's cached keys/values (read in place); -> [total_q, H, D].
    ``window``: each query sees only the ``window`` keys up to its own position (None: every earlier key).
    ``softcap``: each score (q k^T times scale) capped as softcap * tanh(score / softcap) before the softmax."""
    params = kvcache_params(q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() else 1, causal, scale, window,
                            softcap)
    device = _check_attention(q, key_cache, value_cache, cu_seqlens_q, seqlens_k, block_table, ctx, params.window)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _checks.out(ATTN, out, q.shape, q.dtype, q.device)
    _run(ATTN, device, q.dtype, (q, key_cache, value_cache, cu_seqlens_q, seqlens_k, block_table), (out,),
         params, ctx)
    return out


def _run(op: str, device: Device, dtype: torch.dtype, inputs: tuple, outputs: tuple, params,
         ctx: RuntimeContext | None) -> None:
    from dtorch.dispatch.context import NO_PARAMS

    params = NO_PARAMS if params is None else params
    if ctx is None:
        run(op, device, dtype, inputs, outputs, params)
    else:
        run(op, device, dtype, inputs, outputs, params, ctx.stream, ctx.workspace)


# -- in a graph -------------------------------------------------------------------------------------------------

def _graph_params(op: str, a: Args) -> KernelParams:
    return kvcache_params(a["q"].shape[-1], a["causal"], a["scale"], a["window"], a["softcap"])


def _cache_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # key, value [T, Hkv, D], caches [blocks, block_size, Hkv, D], slots [T] -> (key_cache, value_cache), in place
    return [Strategy((R,) * 5, (R, R)), Strategy((Shard(1), Shard(1), Shard(2), Shard(2), R), (Shard(2), Shard(2)))]


def _attention_rule(op: str, shapes: Shapes, params: KernelParams, n: int) -> list[Strategy]:
    # q [total_q, H, D], caches [blocks, block_size, Hkv, D], cu_seqlens_q, seqlens_k, block_table -> [total_q, H, D]
    ints = (R,) * (len(shapes) - 3)
    return [Strategy((R, R, R) + ints, R)] + head_strategies(shapes[0][1], shapes[1][2], n, 1, 2, ints)


# the kernel writes both caches in place (outputs 2 and 3 are its inputs key_cache and value_cache)
declare(CACHE, reshape_and_cache, ("key", "value", "key_cache", "value_cache", "slot_mapping"), rule=_cache_rule,
        outputs=2, result=lambda r, a: tuple(r), always_inplace=(2, 3))
declare(ATTN, flash_attention_with_kvcache, ("q", "key_cache", "value_cache", "cu_seqlens_q", "seqlens_k",
                                             "block_table"), params=_graph_params, rule=_attention_rule)

__all__ = ["flash_attention_with_kvcache", "reshape_and_cache"]
