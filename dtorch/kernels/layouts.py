"""GGUF block-quantized weights as one plain tensor each, the form every backend reads.

A weight [N, K] (N output rows, K input features) in layout ``"gguf.<type>"`` is a contiguous uint8 tensor
``[N, row_bytes(layout, K)]``: everything of output row r (quants, scales, mins, sub-block scales) lives in
``packed[r]``, so ``packed[r0:r1]`` is the weight of rows r0..r1 (tensor parallelism over output rows) and
placements, sharding and buffers treat it like any tensor. Tensor parallelism over K packs each device's
K-slice of the GGUF bytes separately (K a multiple of ``block_size(layout)``).

Inside a row:

- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: super-groups of 16 blocks of 32 (the row's last one: the remaining
  1..15 blocks), each ``[d: S fp16 | m: S fp16 (Q4_1, Q5_1) | Q5's fifth bits | quants]`` with the quants
  transposed to [step u][block j][4 bytes]: one 4 S byte load holds 4 quants of every block, so SIMD lane j sums
  block j alone and each scale applies once per super-group (see ``_super_groups``). Row bytes equal GGUF's.
- Q4_K, Q5_K, Q6_K, IQ4_XS: super-blocks of 8 sub-blocks laid out as the super-groups above, ``[d | dmin | sc[8] |
  mn[8] | quants [step u][sub-block j][4 bytes]]`` (Q5_K: the fifth bits before the quants, as Q5_0's; Q6_K: ``[d |
  sc[16] | low 4 bits | high 2 bits]``; IQ4_XS: ``[d | sc int8[8] (scale - 32) | indices as Q4_K's quants]``), the
  6-bit scales and mins unpacked (``_pack_q4_k`` ...).
- Q2_K, Q3_K: groups of 128 weights, ``[qs | d | aux]`` (``group_formats``).

| layout | row bytes | K = 576 | K = 1536 | bits per weight |
|---|---|---|---|---|
| gguf.q8_0 | 34 K / 32 | 612 | 1632 | 8.5 |
| gguf.q4_0 | 18 K / 32 | 324 | 864 | 4.5 |
| gguf.q4_1 | 20 K / 32 | 360 | 960 | 5.0 |
| gguf.q5_0 | 22 K / 32 | 396 | 1056 | 5.5 |
| gguf.q5_1 | 24 K / 32 | 432 | 1152 | 6.0 |
| gguf.iq4_nl | 18 K / 32 | 324 | 864 | 4.5 |
| gguf.q2_k | 84 K / 256 | - | 504 | 2.625 |
| gguf.q3_k | 114 K / 256 (GGUF: 110) | - | 684 | 3.5625 |
| gguf.q4_k | 148 K / 256 (GGUF: 144) | - | 888 | 4.625 |
| gguf.q5_k | 180 K / 256 (GGUF: 176) | - | 1080 | 5.625 |
| gguf.q6_k | 210 K / 256 | - | 1260 | 6.5625 |
| gguf.iq4_xs | 138 K / 256 (GGUF: 136) | - | 828 | 4.3125 |

Q8_0 and Q5_0 also come as ``"gguf.q8_0x16"`` / ``"gguf.q5_0x16"``: the same bytes per 16 rows, with 16 rows
interleaved (lane = row: see ``dtorch.kernels.x16``), the layout of the projections where AVX-512 VNNI runs them
(``dtorch.kernels.native.repack.x16_wanted``); ``packed[r]`` is then not row r (N a multiple of 16, K of 64).

Weights are w = d * q (Q8_0), d * (q - 8) (Q4_0), d * q + m (Q4_1), (d * sc) * q - dmin * mn (Q4_K) and
(d * sc) * (q - 32) (Q6_K, a scale per 16 weights), (d * sc) * level (IQ4_XS); Q2_K and Q3_K are laid out in groups
of 128 weights (``group_formats``). ``dequantize`` computes them exactly as ``gguf.quants`` does.
Pure torch: packing and dequantizing need no compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtorch.core.dtypes import GGUF_LAYOUTS, GGUF_X16_LAYOUTS
from dtorch.core.errors import ArgumentError, DTypeError, ShapeError
from dtorch.kernels import group_formats
from dtorch.kernels.x16 import (  # noqa: F401  (re-exported: the layouts' API)
    _X16_CODES,
    X16,
    X16_Q8_0_MIN_K,
    _check_x16,
    _x16_pack,
    row_layout,
    x16_fits,
    x16_of,
    x16_pays,
    x16_rows,
)


@dataclass(frozen=True, slots=True)
class _Spec:
    code: int        # the native kernels' format enum (dtn::Fmt)
    ggml: int        # GGUF's tensor type number (gguf.GGMLQuantizationType)
    block: int       # weights per GGUF block
    type_size: int   # bytes per GGUF block
    qs: int          # bytes of a row section per `block` weights: quants, fp16 scales, aux
    d: int
    aux: int


_SPECS: dict[str, _Spec] = {
    "gguf.q8_0": _Spec(0, 8, 32, 34, 32, 2, 0),
    "gguf.q4_0": _Spec(1, 2, 32, 18, 16, 2, 0),
    "gguf.q4_1": _Spec(2, 3, 32, 20, 16, 4, 0),
    "gguf.q4_k": _Spec(3, 12, 256, 144, 128, 4, 16),
    "gguf.q6_k": _Spec(4, 14, 256, 210, 192, 2, 16),
    "gguf.q5_0": _Spec(5, 6, 32, 22, 20, 2, 0),
    "gguf.q5_1": _Spec(6, 7, 32, 24, 20, 4, 0),
    "gguf.iq4_nl": _Spec(7, 20, 32, 18, 16, 2, 0),
    "gguf.q2_k": _Spec(8, 10, 256, 84, 64, 4, 16),
    "gguf.q3_k": _Spec(9, 11, 256, 110, 96, 2, 16),
    "gguf.q5_k": _Spec(10, 13, 256, 176, 160, 4, 16),
    "gguf.iq4_xs": _Spec(11, 23, 256, 136, 128, 2, 8),
}
assert tuple(_SPECS) == GGUF_LAYOUTS
_BY_GGML = {spec.ggml: name for name, spec in _SPECS.items()}
# the formats in super-groups of 16 blocks (the rest are in groups of 128 weights: group_formats)
SUPER_GROUPED = ("gguf.q8_0", "gguf.q4_0", "gguf.q4_1", "gguf.q5_0", "gguf.q5_1", "gguf.iq4_nl", "gguf.q4_k",
                 "gguf.q5_k", "gguf.q6_k", "gguf.iq4_xs")


def layout_of_gguf(ggml_type: int) -> str | None:
    """The layout name of a GGUF tensor type (a ``gguf.GGMLQuantizationType`` or its number: "gguf.q4_1" for Q4_1),
    or None if it is not a block format kept packed (F32, F16, BF16 and the other quantizations)."""
    return _BY_GGML.get(int(ggml_type))


def _spec(layout: str) -> _Spec:
    spec = _SPECS.get(X16.get(layout, layout))
    if spec is None:
        raise ArgumentError(f"unknown quantized layout {layout!r}; known: "
                            f"{', '.join(GGUF_LAYOUTS + GGUF_X16_LAYOUTS)}")
    return spec


def format_code(layout: str) -> int:
    """The native kernels' format number of ``layout``."""
    return _X16_CODES[layout] if layout in X16 else _spec(layout).code


def gguf_block_bytes(layout: str) -> int:
    """Bytes of one GGUF block of ``layout`` as the file stores it."""
    return _spec(layout).type_size


def block_size(layout: str) -> int:
    """Weights per GGUF block of ``layout`` (32, or 256 for the K-quants); K must be a multiple of it."""
    return _spec(layout).block


def _check_k(op: str, layout: str, k: object) -> _Spec:
    spec = _spec(layout)
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % spec.block:
        raise ShapeError(f"{op}: {layout} needs K a positive multiple of {spec.block} (its block size), got {k!r}")
    return spec


def row_bytes(layout: str, k: int) -> int:
    """Bytes of one packed output row of a ``layout`` weight with K input features."""
    spec = _check_k("row_bytes", layout, k)
    return k // spec.block * (spec.qs + spec.d + spec.aux)


def _sections(spec: _Spec, k: int) -> tuple[int, int]:
    """(end of qs, end of d) within a row."""
    nb = k // spec.block
    return nb * spec.qs, nb * (spec.qs + spec.d)


# -- nibbles ----------------------------------------------------------------------------------------------

def _unnibble(b: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> uint8 [..., 32] values, byte i holding value i and i + 16."""
    return torch.cat([b & 15, b >> 4], -1)


# -- pack -------------------------------------------------------------------------------------------------

def pack(raw: torch.Tensor, layout: str, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes(layout, k)] from the GGUF bytes of a weight [N, K]: ``raw`` uint8 [N, K / block *
    type_size] (GGUFReader's rows) or any shape holding those bytes in GGUF row order, e.g. flat. Copies once."""
    spec = _check_k("pack", layout, k)
    if not isinstance(raw, torch.Tensor):
        raise ArgumentError(f"pack: raw must be a torch.Tensor of GGUF bytes, got {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raise DTypeError(f"pack: raw GGUF bytes must be uint8, got {raw.dtype}")
    nb, per_row = k // spec.block, k // spec.block * spec.type_size
    if raw.dim() == 2 and raw.shape[1] != per_row:
        raise ShapeError(f"pack: a {layout} row of K = {k} is {per_row} GGUF bytes, got raw {list(raw.shape)}")
    if raw.numel() == 0 or raw.numel() % per_row:
        raise ShapeError(f"pack: {raw.numel()} bytes ({list(raw.shape)}) are not whole {layout} rows of K = {k} "
                         f"({per_row} bytes each)")
    n = raw.numel() // per_row
    blocks = raw.cpu().reshape(n, nb, spec.type_size)
    if layout in X16:
        _check_x16("pack", layout, n, k)
        return _x16_pack(blocks, layout)
    if layout in group_formats.FORMATS:
        planes, split, _ = group_formats.FORMATS[layout]
        u, d, aux = split(blocks, n, k)
        return torch.cat([group_formats.encode(u, planes), d, aux], 1).contiguous()
    qs, d, aux = _PACK[layout](blocks, n, k)
    return torch.cat([qs.reshape(n, -1), d.reshape(n, -1), aux.reshape(n, -1)], 1).contiguous()


# 32-block formats: super-groups of S = 16 blocks (the last: the rest), each [d: S fp16 | m: S fp16 (Q4_1, Q5_1) |
# Q5's high bits: S x 4 bytes | quants transposed to [step u][block j][4 bytes]]: a 4 * S byte load holds 4 quants of
# every block, so SIMD lane j sums block j alone and its scale applies once per super-group. Quant bytes are GGUF's
# own (a 4-bit byte holds weight i and i + 16; IQ4_NL's are indices into its levels), Q8_0's flipped by 0x80
# (unsigned: q + 128). Q5's high bits are laid out as a step's quants are: byte t of block j holds in bit u (0..3)
# the fifth bit of weight 4 u + t and in bit 4 + u that of weight 16 + 4 u + t, so step u's low nibbles take bit u
# and its high nibbles bit 4 + u of the bytes at the same place.

def _spans(nb: int) -> list[tuple[int, int, int]]:
    """(first block, blocks, blocks per super-group) of the whole super-groups and of the last partial one."""
    full, rest = nb // 16 * 16, nb % 16
    return [span for span in ((0, full, 16), (full, rest, rest)) if span[1]]


def _step_bits(qh: torch.Tensor) -> torch.Tensor:
    """GGUF's Q5 high bits [..., 4] (bit i: weight i) -> the step form [..., 4] (see above)."""
    bits = group_formats.unbits(qh).reshape(*qh.shape[:-1], 2, 4, 4)   # [half, step u, t]
    return group_formats.le_bits(bits.movedim(-1, -3).reshape(*qh.shape[:-1], 4, 8)).reshape(qh.shape)


def _gguf_bits(steps: torch.Tensor) -> torch.Tensor:
    """Inverse of _step_bits: the step form [..., 4] -> 0/1 values [..., 32] in weight order."""
    bits = group_formats.unbits(steps).reshape(*steps.shape[:-1], 4, 2, 4)  # [t, half, step u]
    return bits.movedim(-3, -1).reshape(*steps.shape[:-1], 32)


def _super_groups(b: torch.Tensor, head: int, flip: bool, qh: int = 0) -> torch.Tensor:
    """Blocks b [N, nb, type_size] (``head`` bytes of fp16 scales, then ``qh`` bytes of Q5 high bits) -> packed rows
    [N, nb * type_size]."""
    n, nb, ts = b.shape
    q = b[..., head + qh:] ^ 0x80 if flip else b[..., head + qh:]
    parts = []
    for g0, s, size in _spans(nb):
        blk, qb = b[:, g0:g0 + s].reshape(n, s // size, size, ts), q[:, g0:g0 + s].reshape(n, s // size, size, -1, 4)
        scales = [blk[..., o:o + 2].reshape(n, s // size, 2 * size) for o in range(0, head, 2)]
        if qh:
            scales.append(_step_bits(blk[..., head:head + qh]).reshape(n, s // size, qh * size))
        parts.append(torch.cat([*scales, qb.transpose(2, 3).reshape(n, s // size, -1)], -1).reshape(n, -1))
    return torch.cat(parts, 1)


def _blocks(rows: torch.Tensor, nb: int, head: int, qb: int, qh: int = 0) -> tuple[torch.Tensor, ...]:
    """Inverse of _super_groups: (quant bytes [N, nb, qb], then each fp16 scale array float32 [N, nb], then with
    ``qh`` the high bits [N, nb, 32] in weight order)."""
    n = rows.shape[0]
    ts, out = head + qh + qb, []
    for g0, s, size in _spans(nb):
        sg = rows[:, g0 * ts:(g0 + s) * ts].reshape(n, s // size, size * ts)
        scales = [sg[..., o * size:(o + 2) * size].contiguous().view(torch.float16).float().reshape(n, s)
                  for o in range(0, head, 2)]
        if qh:
            scales.append(_gguf_bits(sg[..., head * size:(head + qh) * size].reshape(n, s, qh)))
        q = sg[..., (head + qh) * size:].reshape(n, s // size, qb // 4, size, 4).transpose(2, 3).reshape(n, s, qb)
        out.append((q, *scales))
    return tuple(torch.cat(t, 1) for t in zip(*out, strict=True))


def _pack_q8_0(b: torch.Tensor, n: int, k: int):
    return _super_groups(b, 2, True), b[..., :0], b[..., :0]


def _pack_q4_0(b: torch.Tensor, n: int, k: int):
    return _super_groups(b, 2, False), b[..., :0], b[..., :0]


def _pack_q4_1(b: torch.Tensor, n: int, k: int):
    return _super_groups(b, 4, False), b[..., :0], b[..., :0]


def _pack_q5_0(b: torch.Tensor, n: int, k: int):
    return _super_groups(b, 2, False, 4), b[..., :0], b[..., :0]


def _pack_q5_1(b: torch.Tensor, n: int, k: int):
    return _super_groups(b, 4, False, 4), b[..., :0], b[..., :0]


# Q4_K as a super-group of its own 8 sub-blocks: [d fp16 | dmin fp16 | sc[8] | mn[8] | quants [step u][sub-block j]
# [4 bytes]] (148 bytes per 256 weights), a quant byte holding weight 4 u + t (low nibble) and 16 + 4 u + t of its
# sub-block, as the 32-block formats' super-groups do: lane j of a vector sums sub-block j alone.

def _steps(u: torch.Tensor) -> torch.Tensor:
    """4-bit values [N, ns, 8, 32] -> quant bytes [N, ns, 128] as [step u][sub-block j][4]."""
    v = u.reshape(*u.shape[:2], 8, 2, 4, 4)                      # [j, half, step, t]
    return ((v[:, :, :, 0] | (v[:, :, :, 1] << 4)).transpose(2, 3)).reshape(*u.shape[:2], 128)


def _unsteps(q: torch.Tensor) -> torch.Tensor:
    """Inverse of _steps: [N, ns, 128] -> values [N, ns, 8, 32]."""
    v = q.reshape(*q.shape[:2], 4, 8, 4)                         # [step, j, t]
    return torch.stack([v & 15, v >> 4], 2).permute(0, 1, 4, 2, 3, 5).reshape(*q.shape[:2], 8, 32)


def _pack_q4_k(b: torch.Tensor, n: int, k: int):
    ns = k // 256
    u = torch.cat([b[..., 16:].reshape(n, ns, 4, 1, 32) & 15, b[..., 16:].reshape(n, ns, 4, 1, 32) >> 4], 3)
    sc, mn = group_formats.q4k_scales(b[..., 4:16])
    return torch.cat([b[..., :4], sc, mn, _steps(u.reshape(n, ns, 8, 32))], -1).reshape(n, -1), b[..., :0], b[..., :0]


def _pack_q5_k(b: torch.Tensor, n: int, k: int):
    """[d | dmin | sc[8] | mn[8] | fifth bits [sub-block j][4] (as Q5_0's) | low 4 bits as Q4_K's]: 180 bytes."""
    ns = k // 256
    u = group_formats.split_q5_k(b, n, k)[0].reshape(n, ns, 8, 32)
    sc, mn = group_formats.q4k_scales(b[..., 4:16])
    fifth = _step_bits(group_formats.le_bits(u >> 4)).reshape(n, ns, 32)
    return torch.cat([b[..., :4], sc, mn, fifth, _steps(u & 15)], -1).reshape(n, -1), b[..., :0], b[..., :0]


def _pack_q6_k(b: torch.Tensor, n: int, k: int):
    """[d | sc int8[16] | low 4 bits as Q4_K's | high 2 bits [step u' 0..1][sub-block j][4]]: 210 bytes; a high-bit
    byte holds, 2 bits each, step u' low nibble's weight, its high nibble's, then step u' + 2's two."""
    ns = k // 256
    u = _q6k_values(b).reshape(n, ns, 8, 32)
    h = (u >> 4).reshape(n, ns, 8, 2, 4, 4)                     # [j, half, step, t]
    hb = h[:, :, :, 0, :2] | (h[:, :, :, 1, :2] << 2) | (h[:, :, :, 0, 2:] << 4) | (h[:, :, :, 1, 2:] << 6)
    high = hb.transpose(2, 3).reshape(n, ns, 64)                 # [u', j, t]
    return torch.cat([b[..., 208:210], b[..., 192:208], _steps(u & 15), high], -1).reshape(n, -1), \
        b[..., :0], b[..., :0]


def _pack_iq4_xs(b: torch.Tensor, n: int, k: int):
    """[d | sc int8[8] (scale - 32) | level indices as Q4_K's quants]: 138 bytes. GGUF's 6-bit scale of sub-block j:
    the low 4 bits from nibble j of bytes 4..7, the high 2 from bits 2 j of the uint16 at 2."""
    ns = k // 256
    idx = ((b[..., 8:136].reshape(n, ns, 8, 1, 16) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]) & 15)
    low = ((b[..., 4:8].reshape(n, ns, 4, 1) >> torch.tensor([0, 4], dtype=torch.uint8)) & 15).reshape(n, ns, 8)
    sh = b[..., 2:4].to(torch.int32)
    high = (((sh[..., 0:1] | (sh[..., 1:2] << 8)) >> (2 * torch.arange(8))) & 3).to(torch.uint8)
    scale = ((low | (high << 4)).view(torch.int8) - 32).view(torch.uint8)
    return torch.cat([b[..., 0:2], scale, _steps(idx.reshape(n, ns, 8, 32))], -1).reshape(n, -1), \
        b[..., :0], b[..., :0]


def _q6k_values(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [N, ns, 210] -> quants 0..63 uint8 [N, ns, 256] in weight order (as gguf's dequantize)."""
    n, ns = b.shape[:2]
    sh_l = torch.tensor([0, 4], dtype=torch.uint8).reshape(2, 1)
    sh_h = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    ql = (b[..., :128].reshape(n, ns, 2, 1, 64) >> sh_l) & 15      # [N, ns, 2, 2, 64]
    qh = (b[..., 128:192].reshape(n, ns, 2, 1, 32) >> sh_h) & 3    # [N, ns, 2, 4, 32]
    return ql.reshape(n, ns, 256) | (qh.reshape(n, ns, 256) << 4)


_PACK = {"gguf.q8_0": _pack_q8_0, "gguf.q4_0": _pack_q4_0, "gguf.q4_1": _pack_q4_1, "gguf.q5_0": _pack_q5_0,
         "gguf.q5_1": _pack_q5_1, "gguf.iq4_nl": _pack_q4_0, "gguf.q4_k": _pack_q4_k,
         "gguf.q6_k": _pack_q6_k, "gguf.q5_k": _pack_q5_k, "gguf.iq4_xs": _pack_iq4_xs}


# -- dequantize -------------------------------------------------------------------------------------------

def dequantize(packed: torch.Tensor, layout: str, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] of a packed ``layout`` tensor [N, row_bytes]; with float32, equal bit for bit to
    ``gguf.quants.dequantize`` of the original bytes (other dtypes: that, rounded once)."""
    spec = _check_k("dequantize", layout, k)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        what = f"{packed.dtype} {list(packed.shape)}" if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise DTypeError(f"dequantize: packed must be a uint8 tensor [N, row bytes], got {what}")
    if packed.shape[1] != row_bytes(layout, k):
        raise ShapeError(f"dequantize: a {layout} row of K = {k} is {row_bytes(layout, k)} bytes, got packed "
                         f"{list(packed.shape)}")
    n = packed.shape[0]
    if layout in X16:
        return dequantize(x16_rows(packed, layout, k), X16[layout], k, dtype)
    if layout in group_formats.FORMATS:
        planes, _, values = group_formats.FORMATS[layout]
        e_qs, e_d = _sections(spec, k)
        u = group_formats.decode(packed[:, :e_qs], planes, k)
        w = values(u, packed[:, e_qs:e_d], packed[:, e_d:], n, k)
    elif layout in SUPER_GROUPED:
        w = _DEQUANTIZE[layout](packed, n, k)
    else:
        e_qs, e_d = _sections(spec, k)
        qs, aux = packed[:, :e_qs], packed[:, e_d:]
        d = packed[:, e_qs:e_d].contiguous().view(torch.float16).float()
        w = _DEQUANTIZE[layout](qs, d, aux, n, k)
    return w if dtype == torch.float32 else w.to(dtype)


def _dq_q8_0(rows, n, k):
    q, d = _blocks(rows, k // 32, 2, 32)
    return ((q ^ 0x80).view(torch.int8).float() * d[..., None]).reshape(n, k)


def _dq_q4_0(rows, n, k):
    q, d = _blocks(rows, k // 32, 2, 16)
    return (d[..., None] * (_unnibble(q).to(torch.int8) - 8).float()).reshape(n, k)


def _dq_q5_0(rows, n, k):
    q, d, hb = _blocks(rows, k // 32, 2, 16, 4)
    u = _unnibble(q) | (hb << 4)
    return (d[..., None] * (u.to(torch.int8) - 16).float()).reshape(n, k)


def _dq_q5_1(rows, n, k):
    q, d, m, hb = _blocks(rows, k // 32, 4, 16, 4)
    return (d[..., None] * (_unnibble(q) | (hb << 4)).float() + m[..., None]).reshape(n, k)


def _dq_iq4_nl(rows, n, k):
    q, d = _blocks(rows, k // 32, 2, 16)
    return (d[..., None] * torch.tensor(group_formats.KVALUES, dtype=torch.float32)[_unnibble(q).long()]).reshape(n, k)


def _dq_q4_1(rows, n, k):
    q, d, m = _blocks(rows, k // 32, 4, 16)
    return (d[..., None] * _unnibble(q).float() + m[..., None]).reshape(n, k)


def _dq_q4_k(rows, n, k):
    sb = rows.reshape(n, k // 256, 148)
    d = sb[..., 0:4].contiguous().view(torch.float16).float()  # [N, ns, 2]: d, dmin
    scale = (d[..., 0:1] * sb[..., 4:12].float())[..., None]   # [N, ns, 8, 1]
    dm = (d[..., 1:2] * sb[..., 12:20].float())[..., None]
    return (scale * _unsteps(sb[..., 20:]).float() - dm).reshape(n, k)


def _dq_q5_k(rows, n, k):
    sb = rows.reshape(n, k // 256, 180)
    d = sb[..., 0:4].contiguous().view(torch.float16).float()
    scale = (d[..., 0:1] * sb[..., 4:12].float())[..., None]
    dm = (d[..., 1:2] * sb[..., 12:20].float())[..., None]
    u = _unsteps(sb[..., 52:]) | (_gguf_bits(sb[..., 20:52].reshape(n, -1, 8, 4)) << 4)
    return (scale * u.float() - dm).reshape(n, k)


def _dq_q6_k(rows, n, k):
    ns = k // 256
    sb = rows.reshape(n, ns, 210)
    hb = sb[..., 146:].reshape(n, ns, 2, 8, 4).transpose(2, 3)  # [j, u', t]
    lo_steps = torch.cat([hb & 3, (hb >> 4) & 3], 3)             # half 0 (weights 0..15): steps 0..3
    hi_steps = torch.cat([(hb >> 2) & 3, hb >> 6], 3)            # half 1
    high = torch.stack([lo_steps, hi_steps], 3).reshape(n, ns, 8, 32)
    u = (_unsteps(sb[..., 18:146]) | (high << 4)).reshape(n, ns, 16, 16)
    d = sb[..., 0:2].contiguous().view(torch.float16).float()
    scale = d * sb[..., 2:18].contiguous().view(torch.int8).float()
    return (scale[..., None] * (u.to(torch.int8) - 32).float()).reshape(n, k)


def _dq_iq4_xs(rows, n, k):
    sb = rows.reshape(n, k // 256, 138)
    d = sb[..., 0:2].contiguous().view(torch.float16).float()
    scale = (d * sb[..., 2:10].contiguous().view(torch.int8).float())[..., None]   # [N, ns, 8, 1]
    levels = torch.tensor(group_formats.KVALUES, dtype=torch.float32)[_unsteps(sb[..., 10:]).long()]
    return (scale * levels).reshape(n, k)


_DEQUANTIZE = {"gguf.q8_0": _dq_q8_0, "gguf.q4_0": _dq_q4_0, "gguf.q4_1": _dq_q4_1, "gguf.q5_0": _dq_q5_0,
               "gguf.q5_1": _dq_q5_1, "gguf.iq4_nl": _dq_iq4_nl, "gguf.q4_k": _dq_q4_k,
               "gguf.q6_k": _dq_q6_k, "gguf.q5_k": _dq_q5_k, "gguf.iq4_xs": _dq_iq4_xs}
