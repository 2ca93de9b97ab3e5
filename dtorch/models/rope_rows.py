"""A model's RoPE table, grown with the positions used.

The table is float32 [rows, 2, R / 2] (cos then sin of every rotary frequency, one gather a step) for positions
0 .. rows - 1. It starts at ``FIRST`` rows (or the loaded maximum if smaller) and doubles, capped at the loaded maximum
``positions``, when a step reaches a later position: a model loaded for a 32k context that answers short prompts holds
4096 rows, not 32k (Gemma 3 270M: two tables of 32 MiB at 32k, a quarter of its Q4_K_M file).

Row p is the full table's row p, bit for bit: the frequencies are computed once for the whole ``positions`` (scaled
RoPE depends on the context), the angle is p * inv_freq in float32 as before, and cos, sin and the scale are
elementwise float32 functions of that angle alone. A growth builds the new rows in chunks of ``CHUNK`` rows, so its
temporaries are a few hundred KiB, not the table's size again.
"""

from __future__ import annotations

import torch

FIRST = 4096  # rows a table starts with (fewer where the model is loaded for fewer positions)
CHUNK = 1024  # rows computed at a time while a table grows


class RopeRows:
    """cos / sin rows of positions 0 .. ``rows - 1``, grown by ``reach`` up to ``positions`` rows.

    ``inv_freq``: float32 [R / 2], for a context of ``positions``; ``scale``: the attention factor on every rotated dim
    (YaRN / LongRoPE; 1.0 for plain RoPE). ``table`` is replaced (never written in place) when it grows, so a view a
    step took of the old one stays valid.
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float, positions: int, first: int | None = None) -> None:
        self.inv_freq = inv_freq.to(torch.float32)
        self.scale = float(scale)
        self.positions = positions
        self.table = self._grown(torch.empty(0, 2, self.inv_freq.numel(), dtype=torch.float32),
                                 min(FIRST if first is None else first, positions))

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    def reach(self, top: int) -> torch.Tensor:
        """The table, grown (doubling, capped at ``positions``) until it holds position ``top`` (the caller checks
        ``top < positions``)."""
        if top >= self.rows:
            n = max(self.rows, 1)
            while n <= top:
                n *= 2
            self.table = self._grown(self.table, min(n, self.positions))
        return self.table

    def _grown(self, old: torch.Tensor, n: int) -> torch.Tensor:
        """A table of ``n`` rows: ``old``'s rows copied, the rest computed ``CHUNK`` rows at a time."""
        new = torch.empty(n, 2, self.inv_freq.numel(), dtype=torch.float32)
        have = old.shape[0]
        new[:have] = old
        for a in range(have, n, CHUNK):
            b = min(a + CHUNK, n)
            angles = torch.arange(a, b, dtype=torch.float32)[:, None] * self.inv_freq
            new[a:b, 0] = angles.cos()
            new[a:b, 1] = angles.sin()
            if self.scale != 1.0:
                new[a:b].mul_(self.scale)
        return new
