"""The paged block manager: which KV cache blocks each sequence holds, and the prefix cache.

The cache is ``num_blocks`` blocks of ``block_size`` tokens. A sequence holds a list of blocks (its row of the block
table); token ``p`` lives in block ``blocks[p // block_size]`` at offset ``p % block_size``. A block may be held by
several sequences at once (a shared prefix): it counts its holders, and returns to the free list when the last one
lets go.

Prefix caching: a full block is named by its tokens and the name of the block before it (so a name stands for the
whole prefix up to the block's end). When a sequence has computed a full block, the block is registered under its
name; a new sequence whose prompt starts with the same blocks takes them instead of computing them again. A freed
block keeps its name and contents until it is reused, so the prefix stays cached while memory allows: the free list
hands out the least recently freed block first (a sequence's last blocks are freed first, so a prefix outlives its
tail).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from dtorch.core.errors import ArgumentError

Name = tuple[int, tuple[int, ...]]  # (the previous block's key, or -1; this block's tokens)


class BlockManager:
    """Blocks of the paged KV cache: allocation, sharing and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"BlockManager: {name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.holders = [0] * num_blocks
        self._unnamed: list[int] = []  # free, memory in use, no name: a stack
        self._untouched: list[int] = list(range(num_blocks))  # free, never used (or trimmed): a min-heap
        self._named: OrderedDict[int, None] = OrderedDict()  # free, holding a cached prefix: least recent first
        self._by_name: dict[Name, int] = {}  # name -> block holding those tokens
        self._name_of: dict[int, Name] = {}  # block -> its name
        self._key_of: dict[Name, int] = {}  # name -> a number that stands for it in the next block's name
        self._next_key = 0
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of them, found

    # -- counts ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (some may still carry a cached prefix)."""
        return len(self._unnamed) + len(self._untouched) + len(self._named)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_resident(self) -> int:
        """Blocks whose memory is in use: held, or free with contents (unnamed or cached)."""
        return self.num_blocks - len(self._untouched)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------------

    def _key(self, name: Name) -> int:
        key = self._key_of.get(name)
        if key is None:
            key = self._key_of[name] = self._next_key
            self._next_key += 1
        return key

    def cached_prefix(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The cached blocks that hold the longest prefix of ``tokens`` in whole blocks, leaving at least one token
        to compute (its logits give the next token), and the key of the last one's name (-1: none). Takes nothing;
        ``hold`` the blocks to use them."""
        if not self.enable_prefix_caching:
            return [], -1
        bs = self.block_size
        found, prev = [], -1
        for i in range((len(tokens) - 1) // bs):
            name = (prev, tuple(tokens[i * bs:(i + 1) * bs]))
            block = self._by_name.get(name)
            if block is None:
                break
            found.append(block)
            prev = self._key_of[name]
        self.queries += len(tokens)
        self.hits += len(found) * bs
        return found, prev

    def register(self, blocks: Sequence[int], tokens: Sequence[int], first: int, computed: int, prev: int) -> int:
        """Name the full blocks among ``blocks`` (a sequence's) that became complete when its computed tokens grew
        from ``first`` to ``computed`` (``tokens``: the sequence's tokens; ``prev``: the key of the name of the block
        before the first new one, -1 for none), so later prompts can share them. Returns the key of the last."""
        if not self.enable_prefix_caching:
            return prev
        bs = self.block_size
        for i in range(first // bs, computed // bs):
            name = (prev, tuple(tokens[i * bs:(i + 1) * bs]))
            if name not in self._by_name and blocks[i] not in self._name_of:
                self._by_name[name] = blocks[i]
                self._name_of[blocks[i]] = name
            prev = self._key(name)
        return prev

    # -- holding and freeing ---------------------------------------------------------------------

    def hold(self, blocks: Sequence[int]) -> None:
        """One more holder of each of ``blocks`` (cached blocks a new sequence shares)."""
        for b in blocks:
            if self.holders[b] == 0:
                del self._named[b]
            self.holders[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (their old cached contents forgotten); the caller checks ``num_free`` first."""
        if n > self.num_free:
            raise ArgumentError(f"BlockManager: {n} blocks asked, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._unnamed:
                b = self._unnamed.pop()
            elif self._untouched:
                b = heapq.heappop(self._untouched)
            else:
                b, _ = self._named.popitem(last=False)
                self._forget(b)
            self.holders[b] = 1
            out.append(b)
        return out

    def _forget(self, block: int) -> None:
        name = self._name_of.pop(block, None)
        if name is not None:
            del self._by_name[name]
            self._key_of.pop(name, None)

    def free(self, blocks: Sequence[int]) -> None:
        """Let go of a sequence's blocks; the last blocks go first, so they are reused before the prefix. Entries < 0
        (blocks already freed behind a sliding window) are skipped."""
        for b in reversed(blocks):
            if b < 0:
                continue
            self.holders[b] -= 1
            if self.holders[b] == 0:
                if b in self._name_of:
                    self._named[b] = None
                else:
                    self._unnamed.append(b)
            elif self.holders[b] < 0:
                raise ArgumentError(f"BlockManager.free: block {b} freed more often than held")

    def trim(self, keep_named: int) -> list[int]:
        """Free blocks whose memory can go back to the system: every unnamed one, and the named ones beyond the
        ``keep_named`` most recently freed (their prefixes are forgotten). They count as never used again."""
        out = self._unnamed
        self._unnamed = []
        while len(self._named) > keep_named:
            b, _ = self._named.popitem(last=False)
            self._forget(b)
            out.append(b)
        for b in out:
            heapq.heappush(self._untouched, b)
        return sorted(out)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self._by_name.clear()
        self._name_of.clear()
        self._key_of.clear()
