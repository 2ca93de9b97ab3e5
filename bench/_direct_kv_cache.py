"""The direct path's KV cache (kept as the benchmarks' baseline): KV_CACHE memory, one slot per sequence.

Its slot bookkeeping (``Slots``) lives here: the runtime's paged cache left slots for blocks.

``k`` and ``v`` are ``[num_layers, num_slots, max_len, num_kv_heads, head_dim]``. A sequence owns
one slot; its keys for layer l are ``k[l, slot, :length]``, a contiguous ``[length, Hkv, D]`` view,
so attention over one sequence reads the cache in place.
"""

from __future__ import annotations

import torch

from dtorch.core.device import Device, as_device
from dtorch.core.errors import ArgumentError, ModelError
from dtorch.core.memory import MemoryKind, allocate


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
    """Keys and values of up to ``num_slots`` sequences of at most ``max_len`` tokens each."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_len: int,
                 dtype: torch.dtype, device: Device | str = "cpu") -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ArgumentError(f"KVCache: {name} must be an int >= 1, got {value!r}")
        super().__init__(num_slots, max_len)
        self.device = as_device(device)
        self.dtype = dtype
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = allocate(shape, dtype, self.device, MemoryKind.KV_CACHE)
        self.v = allocate(shape, dtype, self.device, MemoryKind.KV_CACHE)
        # [layer][slot] -> ([max_len, Hkv, D] keys, values): views made once, sliced every step
        self.views = [[(self.k[i, s], self.v[i, s]) for s in range(num_slots)] for i in range(num_layers)]

    def fits(self, num_seqs: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether this cache can hold ``num_seqs`` sequences of ``max_len`` tokens with this layout."""
        return (num_seqs <= self.num_slots and max_len <= self.max_len and dtype == self.dtype
                and self.k.shape[3:] == (num_kv_heads, head_dim))

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, step, k: torch.Tensor, v: torch.Tensor,
              read: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Store a step's new keys and values of ``layer``; with ``read``, return every sequence's keys and values.

        step: a ``model.Step`` (its slots, starts, counts, positions and per-row slots); k, v: [T, Hkv, D].
        Returns packed ``(keys, values)`` [sum(start + count), Hkv, D] in sequence order (a view of the
        cache for one sequence, a copy for several), or ``(None, None)`` without ``read``.
        """
        if len(step.slots) == 1:
            ks, vs = self.views[layer][step.slots[0]]  # [max_len, Hkv, D]
            start = step.starts[0]
            end = start + step.counts[0]
            ks[start:end].copy_(k)
            vs[start:end].copy_(v)
            return (ks[:end], vs[:end]) if read else (None, None)
        kc, vc = self.k[layer], self.v[layer]  # [slots, max_len, Hkv, D]
        index = (step.row_slots, step.positions)
        kc.index_put_(index, k)
        vc.index_put_(index, v)
        if not read:
            return None, None
        ends = [s + c for s, c in zip(step.starts, step.counts, strict=True)]
        keys = torch.cat([kc[s, :e] for s, e in zip(step.slots, ends, strict=True)])
        values = torch.cat([vc[s, :e] for s, e in zip(step.slots, ends, strict=True)])
        return keys, values
