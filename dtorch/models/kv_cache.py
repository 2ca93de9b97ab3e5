"""The KV cache: preallocated KV_CACHE memory, one slot per running sequence, split on KV heads.

Per layer, keys and values are ``[num_slots, max_len, Hkv, D]`` ``DistTensor`` s placed as the layout
says (``Shard(2)``: each device holds its KV heads), written in place by ``llm.reshape_and_cache`` and
read in place by ``llm.flash_attention_with_kvcache``. A slot is one block of ``max_len`` rows: token
``p`` of the sequence in slot ``s`` lives in flat row ``s * max_len + p``, and the block table of a step
names each sequence's slot. The cache is zero-filled, so padding rows never read garbage.

Beside it, the state cache of the gated delta net layers (hybrid models): per linear layer, the conv state
``[num_slots + 1, C, W - 1]`` (the last W - 1 inputs of the short conv, model dtype) and the recurrent state
``[num_slots + 1, Hv, Dk, Dv]`` (float32), both split on heads like the layer's weights and advanced in place by
every step. Row ``s`` belongs to slot ``s`` and is zeroed when the slot is taken; the last row (``scratch``) is
where padding sequences write.
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
    """Keys and values of up to ``num_slots`` sequences of at most ``max_len`` tokens each, on ``mesh``, and the
    states of the gated delta net layers where the model has them."""

    def __init__(self, layout: Layout, mesh: DeviceMesh, local_ids: tuple[int, ...], num_slots: int, max_len: int,
                 dtype: torch.dtype) -> None:
        super().__init__(num_slots, max_len)
        c = layout.config
        self.dtype = dtype
        self.tensors: dict[str, DistTensor] = {}
        self._states: list[DistTensor] = []

        def place(name: str, kind: str, shape: tuple[int, ...], dt: torch.dtype) -> DistTensor:
            pl = layout.placement(kind)
            blobs = {}
            for d in local_ids:
                mine = local_shape(shape, pl, mesh.rank(d), mesh.size)
                t = allocate(mine, dt, mesh.device(d), MemoryKind.KV_CACHE, zero=True)
                blobs[d] = Blob(mesh.device(d), MemoryKind.KV_CACHE, t, pinned=True)
            self.tensors[name] = DistTensor(mesh, pl, shape, dt, blobs)
            return self.tensors[name]

        kv = (num_slots, max_len, c.num_kv_heads, c.head_dim)
        for i in c.attention_layers:
            for kind in ("k_cache", "v_cache"):
                place(f"{kind}.{i}", kind, kv, dtype)
        conv = (num_slots + 1, 2 * c.linear_key_dim + c.linear_value_dim, c.linear_conv_kernel_dim - 1)
        ssm = (num_slots + 1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        for i in c.linear_layers:
            self._states.append(place(f"conv_state.{i}", "conv_state", conv, dtype))
            self._states.append(place(f"ssm_state.{i}", "ssm_state", ssm, torch.float32))

    @property
    def scratch(self) -> int:
        """The state row padding sequences read and write (no slot's)."""
        return self.num_slots

    def alloc(self) -> int:
        """Take a free slot for a new sequence (length 0, its gated delta net states zero)."""
        slot = super().alloc()
        for t in self._states:
            for b in t.blobs.values():
                b.tensor[slot].zero_()
        return slot

    def fits(self, num_seqs: int, max_len: int, dtype: torch.dtype) -> bool:
        """Whether this cache can hold ``num_seqs`` sequences of ``max_len`` tokens."""
        return num_seqs <= self.num_slots and max_len <= self.max_len and dtype == self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes this process holds (every local device, keys and values)."""
        return sum(b.tensor.numel() * b.tensor.element_size() for t in self.tensors.values()
                   for b in t.blobs.values())
