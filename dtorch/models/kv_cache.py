"""The KV cache: preallocated KV_CACHE memory, one slot per running sequence, split on KV heads.

Per layer, keys and values are ``[num_slots, max_len, Hkv, D]`` ``DistTensor`` s placed as the layout
says (``Shard(2)``: each device holds its KV heads), written in place by ``llm.reshape_and_cache`` and
read in place by ``llm.flash_attention_with_kvcache``. A slot is one block of ``max_len`` rows: token
``p`` of the sequence in slot ``s`` lives in flat row ``s * max_len + p``, and the block table of a step
names each sequence's slot. The cache is zero-filled, so padding rows never read garbage.
"""

from __future__ import annotations

import torch

from dtorch.core.errors import ArgumentError, ModelError
from dtorch.core.memory import MemoryKind, allocate
from dtorch.graph import DeviceMesh
from dtorch.graph.placement import local_shape
from dtorch.models.layout import Layout
from dtorch.runtime.blob import Blob, DistTensor


class Slots:
    """One slot per running sequence, each holding at most ``max_len`` tokens: which are free, how long each is."""

    def __init__(self, num_slots: int, max_len: int) -> None:
        for name, value in (("num_slots", num_slots), ("max_len", max_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"KVCache: {name} must be an int >= 1, got {value!r}")
        self.num_slots, self.max_len = num_slots, max_len
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def alloc(self) -> int:
        """Take a free slot for a new sequence (length 0)."""
        if not self._free:
            raise ModelError(f"KVCache: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Give a finished sequence's slot back."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ArgumentError(f"KVCache.release: slot {slot} is not in use")
        self.lengths[slot] = 0
        self._free.append(slot)

    def reset(self) -> None:
        """Free every slot."""
        self.lengths = [0] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))

    def reserve(self, slot: int, n: int) -> int:
        """Grow sequence ``slot`` by ``n`` tokens; returns its old length (the first new position)."""
        start = self.lengths[slot]
        if start + n > self.max_len:
            raise ModelError(f"KVCache: sequence in slot {slot} would reach {start + n} tokens, "
                             f"more than the cache's max_len {self.max_len}")
        self.lengths[slot] = start + n
        return start


class KVCache(Slots):
    """Keys and values of up to ``num_slots`` sequences of at most ``max_len`` tokens each, on ``mesh``."""

    def __init__(self, layout: Layout, mesh: DeviceMesh, local_ids: tuple[int, ...], num_slots: int, max_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__(num_slots, max_len)
        c = layout.config
        self.dtype = dtype
        shape = (num_slots, max_len, c.num_kv_heads, c.head_dim)
        self.tensors: dict[str, DistTensor] = {}
        for i in range(c.num_layers):
            for kind in ("k_cache", "v_cache"):
                pl = layout.placement(kind)
                blobs = {}
                for d in local_ids:
                    mine = local_shape(shape, pl, mesh.rank(d), mesh.size)
                    t = allocate(mine, dtype, mesh.device(d), MemoryKind.KV_CACHE, zero=True)
                    blobs[d] = Blob(mesh.device(d), MemoryKind.KV_CACHE, t, pinned=True)
                self.tensors[f"{kind}.{i}"] = DistTensor(mesh, pl, shape, dtype, blobs)

    def fits(self, num_seqs: int, max_len: int, dtype: torch.dtype) -> bool:
        """Whether this cache can hold ``num_seqs`` sequences of ``max_len`` tokens."""
        return num_seqs <= self.num_slots and max_len <= self.max_len and dtype == self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes this process holds (every local device, keys and values)."""
        return sum(b.tensor.numel() * b.tensor.element_size() for t in self.tensors.values()
                   for b in t.blobs.values())
