"""The GGUF formats laid out in groups of 128 weights: Q2_K and Q3_K. Their packed row is ``[qs | d | aux]``.
(``split_q5_k`` also serves Q5_K's own layout in ``layouts``.)

``qs`` holds each weight's unsigned quant u in groups of 4
sub-blocks of 32, as two halves L = [s0[0:16], s1[0:16], ...] and H = [s0[16:32], ...]. A group is a list of bit
planes, each 64 values wide:

- ``bit``: 1 bit, the L bits then the H bits, little-endian (bit i of the bytes is value i; 8 + 8 bytes);
- ``two``: 2 bits of a whole group, byte i = L[i] | L[32 + i] << 2 | H[i] << 4 | H[32 + i] << 6 (32 bytes).

``d`` holds the fp16 scales (per 256: d, then dmin where the format has one) and
``aux`` the sub-block scales: Q3_K int8 (scale - 32) and Q2_K the GGUF byte
(sc | mn << 4), 8 per group as [L s0..s3, H s0..s3] (a scale per 16 weights).

``values`` computes each weight as ``gguf.quants.dequantize`` does, to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# IQ4_NL's and IQ4_XS's 16 weight levels (llama.cpp's kvalues_iq4nl)
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_SHIFT4 = torch.tensor([0, 4], dtype=torch.uint8)
_BITS8 = torch.arange(8, dtype=torch.uint8)


@dataclass(frozen=True, slots=True)
class Planes:
    """A group's bit planes: (kind, the bit of u its lowest bit holds)."""
    planes: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        """Bytes of a group."""
        return sum({"bit": 16, "two": 32}[kind] for kind, _ in self.planes)


def le_bits(x: torch.Tensor) -> torch.Tensor:
    """0/1 values [..., 8 k] -> bytes [..., k], value i as bit i % 8 of byte i / 8."""
    return (x.reshape(*x.shape[:-1], -1, 8) << _BITS8).sum(-1, dtype=torch.uint8)


def unbits(b: torch.Tensor) -> torch.Tensor:
    """Inverse of le_bits: bytes [..., k] -> 0/1 values [..., 8 k]."""
    return ((b[..., None] >> _BITS8) & 1).reshape(*b.shape[:-1], -1)


def encode(u: torch.Tensor, planes: Planes) -> torch.Tensor:
    """Quants u uint8 [N, K] in weight order -> the qs section [N, K / 128 * planes.bytes]."""
    n = u.shape[0]
    w = u.reshape(n, -1, 4, 2, 16)
    lo, hi = w[:, :, :, 0].reshape(n, -1, 64), w[:, :, :, 1].reshape(n, -1, 64)
    parts = []
    for kind, shift in planes.planes:
        a, b = lo >> shift, hi >> shift
        if kind == "bit":
            parts += [le_bits(a & 1), le_bits(b & 1)]
        else:
            a, b = a & 3, b & 3
            parts.append(a[..., :32] | (a[..., 32:] << 2) | (b[..., :32] << 4) | (b[..., 32:] << 6))
    return torch.cat(parts, -1).reshape(n, -1)


def decode(qs: torch.Tensor, planes: Planes, k: int) -> torch.Tensor:
    """Inverse of encode: the qs section [N, bytes] -> quants u uint8 [N, K] in weight order."""
    n, ng = qs.shape[0], k // 128
    g = qs.reshape(n, ng, planes.bytes)
    lo = torch.zeros(n, ng, 64, dtype=torch.uint8)
    hi = torch.zeros_like(lo)
    off = 0
    for kind, shift in planes.planes:
        if kind == "bit":
            lo |= unbits(g[..., off:off + 8]) << shift
            hi |= unbits(g[..., off + 8:off + 16]) << shift
            off += 16
        else:
            b = g[..., off:off + 32]
            lo |= torch.cat([b & 3, (b >> 2) & 3], -1) << shift
            hi |= torch.cat([(b >> 4) & 3, (b >> 6) & 3], -1) << shift
            off += 32
    return torch.stack([lo.reshape(n, ng, 4, 16), hi.reshape(n, ng, 4, 16)], 3).reshape(n, k)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 2 m] -> float32 [..., m]."""
    return b.contiguous().view(torch.float16).float()


def _per_group(x: torch.Tensor, n: int, ns: int) -> torch.Tensor:
    """16 values per 256 [N, ns, 16] in weight order (2 j + half for sub-block j) -> per group [L s0..3, H s0..3]."""
    return x.reshape(n, ns, 2, 4, 2).transpose(3, 4).reshape(n, -1)


def _from_groups(aux: torch.Tensor, n: int, ns: int) -> torch.Tensor:
    """Inverse of _per_group: [N, 16 ns] -> [N, ns, 16] in weight order."""
    return aux.reshape(n, ns, 2, 2, 4).transpose(3, 4).reshape(n, ns, 16)


# -- per format: GGUF blocks [N, blocks, type_size] -> (u [N, K], d section, aux section), and the values ---------

def q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] each (as gguf's Q4_K.get_scale_min)."""
    s = s.reshape(*s.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    return torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], -1), torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], -1)


def split_q5_k(b, n, k):
    ns = k // 256
    lo = ((b[..., 48:176].reshape(n, ns, 4, 1, 32) >> _SHIFT4[:, None]) & 15).reshape(n, ns, 8, 32)
    hi = (b[..., 16:48].reshape(n, ns, 1, 32) >> _BITS8[:, None]) & 1
    sc, mn = q4k_scales(b[..., 4:16])
    return (lo | (hi << 4)).reshape(n, k), torch.cat([b[..., :2], b[..., 2:4]], 1).reshape(n, -1), \
        torch.cat([sc, mn], -1).reshape(n, -1)


def _two_bit(qs: torch.Tensor, n: int, ns: int) -> torch.Tensor:
    """GGUF's 2-bit quants [N, ns, 64] -> [N, ns, 8, 32]: sub-block 4 c + s is bits 2 s of bytes 32 c.."""
    return ((qs.reshape(n, ns, 2, 1, 32) >> _SHIFT2[:, None]) & 3).reshape(n, ns, 8, 32)


def split_q3_k(b, n, k):
    ns = k // 256
    hb = (b[..., 0:32].reshape(n, ns, 1, 32) >> _BITS8[:, None]) & 1
    u = _two_bit(b[..., 32:96], n, ns) | (hb << 2)
    sc = b[..., 96:108]
    low = ((sc[..., 0:8].reshape(n, ns, 1, 8) >> _SHIFT4[:, None]) & 15).reshape(n, ns, 16)
    high = ((sc[..., 8:12].reshape(n, ns, 1, 4) >> _SHIFT2[:, None]) & 3).reshape(n, ns, 16)
    scale = ((low | (high << 4)).view(torch.int8) - 32).view(torch.uint8)  # weight order: 2 j + half
    return u.reshape(n, k), b[..., 108:110].reshape(n, -1), _per_group(scale, n, ns)


def values_q3_k(u, d, aux, n, k):
    ns = k // 256
    scale = _from_groups(aux, n, ns).view(torch.int8).float()
    dl = (_fp16(d)[..., None] * scale)[..., None]                          # [N, ns, 16, 1]
    return (dl * (u.reshape(n, ns, 16, 16).to(torch.int8) - 4).float()).reshape(n, k)


def split_q2_k(b, n, k):
    ns = k // 256
    return _two_bit(b[..., 16:80], n, ns).reshape(n, k), \
        torch.cat([b[..., 80:82], b[..., 82:84]], 1).reshape(n, -1), _per_group(b[..., 0:16], n, ns)


def values_q2_k(u, d, aux, n, k):
    ns = k // 256
    dd, sc = _fp16(d), _from_groups(aux, n, ns)
    dl = (dd[:, :ns, None] * (sc & 15).float())[..., None]
    ml = (dd[:, ns:, None] * (sc >> 4).float())[..., None]
    return (dl * u.reshape(n, ns, 16, 16).float() - ml).reshape(n, k)


# layout -> (planes, split, values)
FORMATS = {
    "gguf.q2_k": (Planes((("two", 0),)), split_q2_k, values_q2_k),
    "gguf.q3_k": (Planes((("two", 0), ("bit", 2))), split_q3_k, values_q3_k),
}
