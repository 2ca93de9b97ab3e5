"""The paged KV cache: preallocated KV_CACHE memory in fixed-size blocks, split on KV heads.

Per attention layer, keys and values are ``[num_blocks, block_size, Hkv, D]`` ``DistTensor`` s placed as the
layout says (``Shard(2)``: each device holds its KV heads' part of every block), written in place by
``llm.reshape_and_cache`` and read in place by ``llm.flash_attention_with_kvcache`` through each sequence's row of
the block table. Which blocks a sequence holds is the engine's business (``dtorch.engine.block_manager``); the
cache only stores them. Blocks are not zeroed: a kernel reads only rows below a sequence's length, all written.

Beside it, the state cache of the gated delta net layers (hybrid models): per linear layer, the conv state
``[num_state_slots + 1, C, W - 1]`` (the last W - 1 inputs of the short conv, model dtype) and the recurrent state
``[num_state_slots + 1, Hv, Dk, Dv]`` (float32), both split on heads like the layer's weights and advanced in place
by every step. Row ``s`` belongs to the running sequence given state slot ``s`` and is zeroed when it is given
(``reset_state``); the last row (``scratch``) is where padding sequences write.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import torch

from dtorch.core.dtypes import as_dtype
from dtorch.core.errors import ArgumentError, DTypeError
from dtorch.core.memory import MemoryKind, allocate, libc_function
from dtorch.core.placement import local_shape
from dtorch.graph import DeviceMesh
from dtorch.models.config import ModelConfig
from dtorch.models.layout import Layout
from dtorch.models.parallel import Stage
from dtorch.runtime.blob import Blob, DistTensor


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes over every attention layer (all devices together)."""
    return 2 * len(config.attention_layers) * config.num_kv_heads * config.head_dim * dtype.itemsize


KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cache_dtype(value: object, dtype: torch.dtype) -> torch.dtype:
    """LLM's ``kv_cache_dtype``: "auto" (or None) for the activations' ``dtype``, else one of ``KV_DTYPES`` by name
    (as ``as_dtype`` reads it: "bfloat16", "bf16", "float16", "float32" ...) or as a torch dtype."""
    if value is None or value == "auto":
        return dtype
    try:
        got = as_dtype(value) if isinstance(value, (str, torch.dtype)) else None
    except DTypeError:
        got = None
    if got not in KV_DTYPES:
        raise ArgumentError("LLM: kv_cache_dtype must be 'auto', 'bfloat16', 'float16' or 'float32', got "
                            f"{value!r:.60}")
    return got


KV_CACHE_BYTES = 1 << 30  # default KV cache budget (a CPU touches pages only as blocks fill)


def kv_blocks(config: ModelConfig, dtype: torch.dtype, max_num_seqs: int, max_len: int, budget: int | None,
              block_size: int) -> int:
    """Blocks of LLM's KV cache: ``max_num_seqs`` sequences of ``max_len`` tokens within ``budget`` bytes
    (``kv_cache_memory_bytes``; None: the default, at most half the available memory), and never less than one
    sequence of ``max_len``: an ArgumentError says what to lower when that does not fit."""
    from dtorch.models.loaders.checkpoint import available_memory

    per_token = kv_bytes_per_token(config, dtype)
    tokens = max_num_seqs * max_len
    if per_token:
        have = available_memory()
        if budget is not None and have is not None and budget > have:
            raise ArgumentError(f"LLM: kv_cache_memory_bytes {budget} is more than the {have} bytes this machine "
                                "has available; lower it")
        one = per_token * max_len  # the default holds at least one full sequence where memory allows
        default = max(KV_CACHE_BYTES, one) if have is None else min(max(KV_CACHE_BYTES, one), have // 2)
        fit = (budget or default) // per_token
        if fit < max_len:
            what = f"kv_cache_memory_bytes {budget}" if budget is not None else \
                f"the default KV cache ({default} bytes: half the available memory)"
            raise ArgumentError(f"LLM: {what} holds {fit} tokens, less than one sequence of max_model_len "
                                f"{max_len} ({per_token} bytes per token); lower max_model_len or give "
                                "kv_cache_memory_bytes")
        tokens = max(max_len, min(tokens, fit))
    return -(-tokens // block_size)


class KVCache:
    """``num_blocks`` blocks of ``block_size`` tokens per attention layer on ``mesh``, and ``num_state_slots`` rows
    of gated delta net state per linear layer where the model has them.

    ``max_blocks_per_seq`` is the width of a step's block table (a sequence of ``max_len`` tokens at most).
    ``stages`` (a pipeline's, ``Transformer.stages``): each layer's caches live on its stage's tp group only.
    """

    def __init__(self, layout: Layout, mesh: DeviceMesh, local_ids: tuple[int, ...], num_blocks: int,
                 block_size: int, max_len: int, num_state_slots: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, stages: tuple[Stage, ...] | None = None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_len", max_len),
                            ("num_state_slots", num_state_slots)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"KVCache: {name} must be an int >= 1, got {value!r}")
        c = layout.config
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.max_blocks_per_seq = -(-max_len // block_size)
        self.num_state_slots = num_state_slots
        self.dtype = dtype  # the activations' (and the gated delta nets' conv state)
        self.kv_dtype = kv_dtype or dtype  # the keys' and values' (LLM's kv_cache_dtype)
        self.tensors: dict[str, DistTensor] = {}
        self._states: list[DistTensor] = []
        # rank 0 of a model served across ranks: told of each change made from the host (``ranks.Teller``), which the
        # other ranks then make to their caches alike
        self.mirror: Any = None

        mesh_of = {i: st.mesh for st in stages or () for i in st.layers}

        def place(layer: int, kind: str, shape: tuple[int, ...], dt: torch.dtype, zero: bool) -> DistTensor:
            pl = layout.placement(kind)
            m = mesh_of.get(layer, mesh)
            blobs = {}
            for d in local_ids:
                if d in m.ids:
                    mine = local_shape(shape, pl, m.rank(d), m.size)
                    t = allocate(mine, dt, m.device(d), MemoryKind.KV_CACHE, zero=zero)
                    blobs[d] = Blob(m.device(d), MemoryKind.KV_CACHE, t, pinned=True)
            self.tensors[f"{kind}.{layer}"] = DistTensor(m, pl, shape, dt, blobs)
            return self.tensors[f"{kind}.{layer}"]

        kv = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        for i in c.attention_layers:  # untouched blocks cost no resident memory on a CPU (pages come on first write)
            for kind in ("k_cache", "v_cache"):
                place(i, kind, kv, self.kv_dtype, zero=False)
        conv = (num_state_slots + 1, 2 * c.linear_key_dim + c.linear_value_dim, c.linear_conv_kernel_dim - 1)
        ssm = (num_state_slots + 1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        for i in c.linear_layers:
            self._states.append(place(i, "conv_state", conv, dtype, zero=True))
            self._states.append(place(i, "ssm_state", ssm, torch.float32, zero=True))

    @property
    def has_state(self) -> bool:
        """Whether the model has gated delta net layers (their sequences each need a state slot)."""
        return bool(self._states)

    @property
    def scratch(self) -> int:
        """The state row padding sequences read and write (no sequence's)."""
        return self.num_state_slots

    def state_rows(self, slot: int) -> list[torch.Tensor]:
        """Row ``slot`` of every gated delta net state (conv and recurrent, each local device's piece), as views."""
        return [b.tensor[slot] for t in self._states for b in t.blobs.values()]

    def reset_state(self, slot: int) -> None:
        """Zero state row ``slot`` for a sequence that starts from its first token."""
        if self.mirror is not None:
            self.mirror.tell("reset_state", slot)
        for t in self._states:
            for b in t.blobs.values():
                b.tensor[slot].zero_()

    def release(self, blocks: list[int]) -> None:
        """Give the memory of ``blocks`` (sorted, free) back to the system where the cache lives on a CPU (Linux): their
        pages are dropped and read as zeros when next written; elsewhere nothing happens."""
        if self.mirror is not None:
            self.mirror.tell("release", blocks)
        runs, start = [], None
        for i, b in enumerate(blocks):
            if start is None:
                start = b
            if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
                runs.append((start, b + 1))
                start = None
        for name, t in self.tensors.items():
            if name.startswith(("k_cache.", "v_cache.")):
                for blob in t.blobs.values():
                    _drop_pages(blob.tensor, runs)

    @property
    def nbytes(self) -> int:
        """Bytes this process holds (every local device, keys, values and states)."""
        return self.device_bytes()

    def device_bytes(self, device_id: int | None = None) -> int:
        """Bytes device ``device_id`` holds (default: every local device), keys, values and states."""
        return sum(b.tensor.numel() * b.tensor.element_size() for t in self.tensors.values()
                   for i, b in t.blobs.items() if device_id is None or i == device_id)


def _drop_pages(t: torch.Tensor, runs: list[tuple[int, int]]) -> None:
    """madvise(MADV_DONTNEED) over the whole pages of rows [a, b) of ``t`` (dim 0), for each run."""
    madvise = libc_function("madvise")
    if madvise is None or t.device.type != "cpu" or not t.is_contiguous():
        return
    row, base, page = t.stride(0) * t.element_size(), t.data_ptr(), mmap.PAGESIZE
    for a, b in runs:
        lo = -(-(base + a * row) // page) * page
        hi = (base + b * row) // page * page
        if hi > lo:
            madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED
