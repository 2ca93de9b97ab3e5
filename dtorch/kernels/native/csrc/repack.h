// GGUF block bytes -> the packed rows the kernels read (dtorch/kernels/layouts.py says the layout; its torch
// ``pack`` is the reference these match bit for bit). One output row from one input row, so rows split across
// threads freely; every byte is read once and written once: repacking runs at the speed of memory.
#pragma once

#include <cstdint>
#include <cstring>

namespace dtn::repack {

// GGUF's Q5 fifth bits (32 bits, bit i: weight i) -> the step form: byte t, bit u holds weight 4u + t's and bit
// 4 + u weight 16 + 4u + t's (layouts._step_bits). A bit permutation: byte t gathers every fourth bit from t, which
// one multiply of the masked word moves into place (bits 4u + t -> byte t's bits u, no carries: they are 4 apart).
inline uint32_t step_bits(const uint8_t* qh) {
  const uint32_t x = uint32_t(qh[0]) | uint32_t(qh[1]) << 8 | uint32_t(qh[2]) << 16 | uint32_t(qh[3]) << 24;
  uint32_t out = 0;
  for (int t = 0; t < 4; ++t) {
    const uint32_t lo = (x >> t) & 0x1111u, hi = (x >> (16 + t)) & 0x1111u;  // bits 4u: weight 4u + t (+ 16)
    // bits 4u -> 9 + u: times 2^0 + 2^3 + 2^6 + 2^9 shifts bit 4u by 9 - 3u (the other products land on distinct
    // bits outside 9..12: no carries)
    const uint32_t l4 = ((lo * 0x249u) >> 9) & 15u, h4 = ((hi * 0x249u) >> 9) & 15u;
    out |= (l4 | h4 << 4) << (8 * t);
  }
  return out;
}

// The 32-weight formats: blocks [head bytes of fp16 scales | qh bytes of fifth bits | qb bytes of quants] -> super-
// groups of 16 blocks (the row's last one: the rest), each [scale o of every block, for each scale | fifth bits of
// every block in step form | quants as [step u][block j][4 bytes]] (``flip``: each quant byte ^ 0x80, Q8_0).
inline void super_groups(const uint8_t* in, uint8_t* out, int64_t nb, int head, int qh, int qb, bool flip) {
  const int ts = head + qh + qb;
  for (int64_t g0 = 0; g0 < nb; g0 += 16) {
    const int S = int(nb - g0 < 16 ? nb - g0 : 16);
    const uint8_t* blk = in + g0 * ts;
    uint8_t* o = out + g0 * ts;
    for (int s = 0; s < head; s += 2)
      for (int j = 0; j < S; ++j, o += 2) std::memcpy(o, blk + j * ts + s, 2);
    if (qh)
      for (int j = 0; j < S; ++j, o += 4) {
        const uint32_t v = step_bits(blk + j * ts + head);
        o[0] = uint8_t(v), o[1] = uint8_t(v >> 8), o[2] = uint8_t(v >> 16), o[3] = uint8_t(v >> 24);
      }
    const uint8_t mask = flip ? 0x80 : 0;
    for (int u = 0; u < qb / 4; ++u)
      for (int j = 0; j < S; ++j, o += 4) {
        const uint8_t* q = blk + j * ts + head + qh + 4 * u;
        o[0] = q[0] ^ mask, o[1] = q[1] ^ mask, o[2] = q[2] ^ mask, o[3] = q[3] ^ mask;
      }
  }
}

// 4-bit values v[8 sub-blocks][32] -> 128 bytes [step u][sub-block j][t]: weight 4u + t in the low nibble,
// 16 + 4u + t in the high one (layouts._steps).
inline void steps(const uint8_t (*v)[32], uint8_t* o) {
  for (int u = 0; u < 4; ++u)
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t) *o++ = uint8_t((v[j][4 * u + t] & 15) | (v[j][16 + 4 * u + t] & 15) << 4);
}

// Q4_K's 12 bytes of 6-bit scales and mins -> sc[8], mn[8] (gguf's get_scale_min)
inline void q4k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63, mn[j] = s[4 + j] & 63;
    sc[4 + j] = uint8_t((s[8 + j] & 15) | ((s[j] >> 2) & 48));
    mn[4 + j] = uint8_t((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 48));
  }
}

// Q4_K: 144-byte blocks [d | dmin | scales 12 | qs 128] -> 148 bytes [d | dmin | sc 8 | mn 8 | steps]. Sub-block
// 2c takes the low nibbles of qs[32c ..], 2c + 1 the high ones, so a step byte is two nibbles of the same qs chunk.
inline void q4_k(const uint8_t* in, uint8_t* out, int64_t ns) {
  for (int64_t b = 0; b < ns; ++b, in += 144, out += 148) {
    std::memcpy(out, in, 4);
    q4k_scales(in + 4, out + 4, out + 12);
    uint8_t* o = out + 20;
    for (int u = 0; u < 4; ++u)
      for (int j = 0; j < 8; ++j) {
        const uint8_t* q = in + 16 + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int t = 0; t < 4; ++t)
          *o++ = uint8_t(((q[4 * u + t] >> shift) & 15) | ((q[16 + 4 * u + t] >> shift) & 15) << 4);
      }
  }
}

// Q6_K: 210-byte blocks [ql 128 | qh 64 | sc 16 | d] -> [d | sc 16 | low 4 bits as steps | high 2 bits [u' 0..1]
// [sub-block j][t], 2 bits each: step u' low nibble's weight, its high nibble's, then step u' + 2's two]
inline void q6_k(const uint8_t* in, uint8_t* out, int64_t ns) {
  uint8_t v[8][32];
  for (int64_t b = 0; b < ns; ++b, in += 210, out += 210) {
    for (int h = 0; h < 2; ++h) {  // the 6-bit values of weights 128 h .. (gguf's dequantize order)
      const uint8_t *ql = in + 64 * h, *qh = in + 128 + 32 * h;
      uint8_t* y = &v[4 * h][0];
      for (int l = 0; l < 32; ++l) {
        y[l] = uint8_t((ql[l] & 15) | (qh[l] & 3) << 4);
        y[l + 32] = uint8_t((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4);
        y[l + 64] = uint8_t((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
        y[l + 96] = uint8_t((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4);
      }
    }
    std::memcpy(out, in + 208, 2);
    std::memcpy(out + 2, in + 192, 16);
    steps(v, out + 18);
    uint8_t* o = out + 146;
    for (int u = 0; u < 2; ++u)
      for (int j = 0; j < 8; ++j) {
        const uint8_t* w = v[j];
        for (int t = 0; t < 4; ++t)
          *o++ = uint8_t(((w[4 * u + t] >> 4) & 3) | ((w[16 + 4 * u + t] >> 4) & 3) << 2 |
                         ((w[4 * (u + 2) + t] >> 4) & 3) << 4 | ((w[16 + 4 * (u + 2) + t] >> 4) & 3) << 6);
      }
  }
}

// 16 GGUF rows of Q8_0 (code 0) or Q5_0 (5), K = 32 nb weights each (nb even), row r at in + r * in_row -> one group
// of the 16-row interleaved layout (common.h's x16_base; layouts.py's _x16 the reference): per pair of blocks the
// 16 rows' fp16 scales of both blocks, then per block the fifth bits as masks [step u][half h] (bit 4 r + t: weight
// 16 h + 4 u + t of row r) and the quants [step u][row r][4 bytes] (Q8_0's ^ 0x80).
inline void x16_group(int code, const uint8_t* in, int64_t in_row, uint8_t* o, int64_t nb) {
  const int ts = code == 5 ? 22 : 34;
  for (int64_t b = 0; b < nb; ++b) {
    if (b % 2 == 0)
      for (int bb = 0; bb < 2; ++bb)
        for (int r = 0; r < 16; ++r, o += 2) std::memcpy(o, in + r * in_row + (b + bb) * ts, 2);
    if (code == 5) {
      uint64_t m[8] = {};
      for (int r = 0; r < 16; ++r) {  // bits 16 h + 4 u .. + 3 of row r -> mask (u, h) bits 4 r ..
        uint32_t qh;
        std::memcpy(&qh, in + r * in_row + b * ts + 2, 4);
        for (int k = 0; k < 8; ++k) m[2 * (k % 4) + k / 4] |= uint64_t((qh >> (4 * k)) & 15u) << (4 * r);
      }
      for (int k = 0; k < 8; ++k, o += 8)
        for (int i = 0; i < 8; ++i) o[i] = uint8_t(m[k] >> (8 * i));
      for (int u = 0; u < 4; ++u)
        for (int r = 0; r < 16; ++r, o += 4) std::memcpy(o, in + r * in_row + b * ts + 6 + 4 * u, 4);
    } else {
      for (int u = 0; u < 8; ++u)
        for (int r = 0; r < 16; ++r, o += 4) {
          uint32_t v;
          std::memcpy(&v, in + r * in_row + b * ts + 2 + 4 * u, 4);
          v ^= 0x80808080u;
          std::memcpy(o, &v, 4);
        }
    }
  }
}

// (weights, GGUF bytes, packed bytes) of one block of format ``code``; false when it has no native repack
inline bool block_bytes(int code, int64_t* block, int64_t* in, int64_t* out) {
  static const int64_t table[8][3] = {{32, 34, 34}, {32, 18, 18}, {32, 20, 20}, {256, 144, 148},
                                      {256, 210, 210}, {32, 22, 22}, {32, 24, 24}, {32, 18, 18}};
  if (code < 0 || code > 7) return false;
  *block = table[code][0], *in = table[code][1], *out = table[code][2];
  return true;
}

// One row of K weights in format ``code`` (dtn::Fmt numbers, layouts._SPECS): false when this format has no native
// repack (the torch one then serves it).
inline bool row(int code, const uint8_t* in, uint8_t* out, int64_t K) {
  switch (code) {
    case 0: super_groups(in, out, K / 32, 2, 0, 32, true); return true;   // Q8_0
    case 1: super_groups(in, out, K / 32, 2, 0, 16, false); return true;  // Q4_0
    case 2: super_groups(in, out, K / 32, 4, 0, 16, false); return true;  // Q4_1
    case 3: q4_k(in, out, K / 256); return true;
    case 4: q6_k(in, out, K / 256); return true;
    case 5: super_groups(in, out, K / 32, 2, 4, 16, false); return true;  // Q5_0
    case 6: super_groups(in, out, K / 32, 4, 4, 16, false); return true;  // Q5_1
    case 7: super_groups(in, out, K / 32, 2, 0, 16, false); return true;  // IQ4_NL: indices as Q4_0's quants
    default: return false;
  }
}

}  // namespace dtn::repack
