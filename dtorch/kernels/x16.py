"""The 16-row interleaved layouts ``"gguf.q8_0x16"`` / ``"gguf.q5_0x16"`` (Q8_0 / Q5_0 projections where AVX-512 VNNI
runs them): which layouts they are, when a weight takes one, and their torch pack and turn-back to rows, the
reference the native group repack matches bit for bit. ``dtorch.kernels.layouts`` serves them through its ``pack``,
``dequantize`` and ``format_code`` and re-exports the names below."""

from __future__ import annotations

import torch

from dtorch.core.dtypes import GGUF_X16_LAYOUTS
from dtorch.core.errors import ArgumentError, ShapeError
from dtorch.kernels import group_formats

# the interleaved layouts: their row layout, and their native format numbers (dtn::Fmt)
X16 = {"gguf.q8_0x16": "gguf.q8_0", "gguf.q5_0x16": "gguf.q5_0"}
_X16_CODES = {"gguf.q8_0x16": 12, "gguf.q5_0x16": 13}
assert tuple(X16) == GGUF_X16_LAYOUTS


def x16_of(layout: str) -> str | None:
    """The interleaved layout of row layout ``layout`` ("gguf.q8_0" -> "gguf.q8_0x16"), or None where it has none."""
    return next((x for x, base in X16.items() if base == layout), None)


def row_layout(layout: str) -> str:
    """The row layout of ``layout``: "gguf.q8_0" for "gguf.q8_0x16", else ``layout`` itself."""
    return X16.get(layout, layout)


# Q8_0 rows read as fast as the interleaved ones at short K on AVX-512 VNNI (one-row products, same-process A/B, 1
# thread: K = 896 0.83-0.87x the rows' speed interleaved, K = 4864 1.10-1.27x; Q5_0 1.6-1.75x at every K): Q8_0 is
# interleaved from this K on
X16_Q8_0_MIN_K = 2048


def x16_pays(layout: str, k: int) -> bool:
    """Whether a row ``layout`` weight of K = ``k`` is kept interleaved where the interleaved kernels run (Q5_0
    always, Q8_0 from ``X16_Q8_0_MIN_K``)."""
    return layout == "gguf.q5_0" or (layout == "gguf.q8_0" and k >= X16_Q8_0_MIN_K)


def x16_fits(rows: int, k: int) -> bool:
    """Whether a weight of ``rows`` rows of ``k`` inputs can be interleaved: whole groups of 16 rows, K / 32 even."""
    return rows > 0 and rows % 16 == 0 and k % 64 == 0


# -- the 16-row interleaved layouts (gguf.q8_0x16, gguf.q5_0x16) ------------------------------------------------------
# A group of 16 rows [16 g, 16 g + 16) is 16 rows' bytes: per pair of blocks p, [the 16 rows' fp16 scales of block 2 p,
# then of 2 p + 1 (64 bytes)], then per block of the pair Q5_0's fifth bits as 8 masks of 64 bits, [step u][half h] bit
# 4 r + t: weight 16 h + 4 u + t of row r (the byte order of step u's expanded quants: one kmovq and a masked add),
# then its GGUF quant bytes as [step u][row r][4] (bytes 4 u .. 4 u + 3 of each row's 16), or Q8_0's [step u 0..7]
# [row r][4] ^ 0x80. One 64-byte load holds one step of 16 rows: lane r of a vpdpbusd sums row r alone.

def _check_x16(op: str, layout: str, n: int, k: int) -> None:
    if not x16_fits(n, k):
        raise ShapeError(f"{op}: {layout} interleaves 16 rows with K a multiple of 64; got {n} rows of K = {k} (keep "
                         f"such a weight in {X16[layout]})")


def _x16_pack(b: torch.Tensor, layout: str) -> torch.Tensor:
    """GGUF blocks b [N, nb, type_size] -> the interleaved layout [N, nb * type_size]."""
    n, nb, ts = b.shape
    g, blk = n // 16, b.reshape(n // 16, 16, nb, ts)
    scales = blk[..., 0:2].reshape(g, 16, nb // 2, 2, 2).permute(0, 2, 3, 1, 4).reshape(g, nb // 2, 64)
    if layout == "gguf.q5_0x16":
        bits = group_formats.unbits(blk[..., 2:6]).reshape(g, 16, nb, 2, 4, 4)        # [G, r, b, h, u, t]
        masks = group_formats.le_bits(bits.permute(0, 2, 4, 3, 1, 5).reshape(g, nb, 8, 64)).reshape(g, nb, 64)
        quants = blk[..., 6:22].reshape(g, 16, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 256)
        body = torch.cat([masks, quants], -1)
    else:
        body = (blk[..., 2:34] ^ 0x80).reshape(g, 16, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 512)
    return torch.cat([scales, body.reshape(g, nb // 2, -1)], -1).reshape(n, -1).contiguous()


def _x16_blocks(packed: torch.Tensor, layout: str, k: int) -> torch.Tensor:
    """Inverse of _x16_pack: the interleaved layout [N, row bytes] -> GGUF blocks [N, nb, type_size]."""
    n, nb = packed.shape[0], k // 32
    g = n // 16
    grp = packed.reshape(g, nb // 2, -1)
    d = grp[..., :64].reshape(g, nb // 2, 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(g, 16, nb, 2)
    body = grp[..., 64:].reshape(g, nb, -1)
    if layout == "gguf.q5_0x16":
        # [G, b, u, h, r, t]
        bits = group_formats.unbits(body[..., :64].reshape(g, nb, 8, 8)).reshape(g, nb, 4, 2, 16, 4)
        qh = group_formats.le_bits(bits.permute(0, 4, 1, 3, 2, 5).reshape(g, 16, nb, 32))
        qs = body[..., 64:].reshape(g, nb, 4, 16, 4).permute(0, 3, 1, 2, 4).reshape(g, 16, nb, 16)
        blocks = torch.cat([d, qh, qs], -1)
    else:
        blocks = torch.cat([d, body.reshape(g, nb, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(g, 16, nb, 32) ^ 0x80], -1)
    return blocks.reshape(n, nb, -1)


def x16_rows(packed: torch.Tensor, layout: str, k: int) -> torch.Tensor:
    """An interleaved ``layout`` weight [N, row bytes] in its row layout (``X16[layout]``, what ``pack`` gives from
    the same GGUF bytes): the reference of the native kernels' group -> rows step."""
    from dtorch.kernels.layouts import _check_k, pack, row_bytes  # layouts imports this module

    _check_k("x16_rows", layout, k)
    if layout not in X16:
        raise ArgumentError(f"x16_rows: {layout!r} is not an interleaved layout ({', '.join(X16)})")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2 or \
            packed.shape[1] != row_bytes(layout, k):
        what = f"{packed.dtype} {list(packed.shape)}" if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ShapeError(f"x16_rows: packed must be uint8 [N, {row_bytes(layout, k)}] for K = {k}, got {what}")
    _check_x16("x16_rows", layout, packed.shape[0], k)
    return pack(_x16_blocks(packed.cpu(), layout, k).reshape(packed.shape[0], -1), X16[layout], k)
