// Kernels written in plain C++, compiled once per ISA unit inside that unit's namespace DTN_ISA, so the compiler
// vectorizes them for that unit's -m flags: bf16 helpers, activation quantization, the elementwise decode ops
// (rms_norm, rope, silu_and_mul) and the portable (scalar) quantized and float products.
// Included by isa_*.cpp after <cstdint>, <cstring>, <cmath> and common.h, inside namespace DTN_ISA.

using dtn::BF16;
using dtn::F32;
using dtn::QAct;
using dtn::QWeight;
using dtn::SGAct;

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch (NaN stays NaN)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline float fp16_to_f32(uint16_t h);

static inline float load_f(const void* p, int dt, int64_t i) {
  if (dt == dtn::F16) return fp16_to_f32(static_cast<const uint16_t*>(p)[i]);
  return dt == F32 ? static_cast<const float*>(p)[i] : bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

static inline void store_f(void* p, int dt, int64_t i, float v) {
  if (dt == F32) static_cast<float*>(p)[i] = v;
  else static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
}

static inline float round_to(int dt, float v) { return dt == F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

// y[m, n] = (sums + tails) + bias for rows m < M of x and n0 <= n < n1 of w, sums and tails at [m * ld + n - n0]: a
// row whose last super-group of under 16 blocks was summed apart (the SIMD tiles' tails passes), written as the tiles
// write it, so a row gets the same bits at every row count
static void store_with_tails(const float* sums, const float* tails, int64_t ld, int64_t M, int64_t n0, int64_t n1,
                             const void* bias, void* y, int ydt, int64_t ldy) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      const float b = bias ? load_f(bias, ydt, n) : 0.f;
      store_f(y, ydt, m * ldy + n, (sums[m * ld + n - n0] + tails[m * ld + n - n0]) + b);
    }
}

static inline float fp16_to_f32(uint16_t h) {  // exact; the SIMD paths use F16C
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    u = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// -- activation quantization ------------------------------------------------------------------------------
// Two int8 levels per block of 32: hi = round(x / d) with d = amax / 127, then the residual x - d hi, at most d / 2,
// as lo = round((x - d hi) / (d / 254)); x = d (hi + lo / 254) to 1/508 of d, about 16 bits (int8 alone: 1/2 of d,
// NMSE ~3e-5 on Gaussian x, too coarse for the outliers of the down projection's input). The kernels take two
// integer dot products per block, hi and lo, against the same weight bytes.

static inline int8_t round_i8(float t) {  // round to nearest even: adding 1.5 * 2^23 leaves the integer in the low bits
  const float u = t + 12582912.f;
  int32_t bits;
  std::memcpy(&bits, &u, 4);
  return int8_t(bits - 0x4B400000);
}

// Block b of row r of x -> hi[32], lo[32]; returns d; sums[h] = d * sum over half h (16 values) of (hi + lo / 254)
// sums[h]: d times the sum of the levels over weights 16 h .. 16 h + 15 (both levels, or hi alone where the products
// use it alone: then an offset or min term meets the same rounded x as the products, as llama.cpp's Q8_1 sums).
static inline float quantize_block(const void* x, int dt, int64_t off, int8_t* hi, int8_t* lo, float* sums,
                                   int levels = 2) {
  float v[32], amax = 0.f;
  if (dt == F32) {
    std::memcpy(v, static_cast<const float*>(x) + off, sizeof(v));
  } else {
    const uint16_t* xb = static_cast<const uint16_t*>(x) + off;
#pragma omp simd
    for (int j = 0; j < 32; ++j) v[j] = bf16_to_f32(xb[j]);
  }
#pragma omp simd reduction(max : amax)
  for (int j = 0; j < 32; ++j) amax = std::fabs(v[j]) > amax ? std::fabs(v[j]) : amax;  // fmaxf is a libm call
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f, idl = id * 254.f;
#pragma omp simd
  for (int j = 0; j < 32; ++j) {
    hi[j] = round_i8(v[j] * id);
    const float t = (v[j] - d * float(hi[j])) * idl;  // |t| <= 127 up to rounding
    lo[j] = round_i8(t > 127.f ? 127.f : t < -127.f ? -127.f : t);
  }
  for (int h = 0; h < 2; ++h) {
    int sh = 0, sl = 0;
#pragma omp simd reduction(+ : sh, sl)
    for (int i = 0; i < 16; ++i) { sh += hi[16 * h + i]; sl += lo[16 * h + i]; }
    sums[h] = d * (float(sh) + (levels == 2 ? float(sl) * (1.f / 254.f) : 0.f));
  }
  return d;
}

// One row x [K] -> two int8 levels per sub-block of 32, in group order (see QAct in common.h).
static void quantize_rows(const void* x, int dt, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int8_t* q,
                          float* darep, float* asum) {
  const int64_t nb = K / 32, ng = (nb + 3) / 4;
  for (int64_t r = r0; r < r1; ++r) {
    int8_t* qr = q + r * ng * 256;
    float* dr = darep + r * ng * 16;
    float* sr = asum + r * ng * 8;
    if (nb % 4) {  // the last group is partial: zero its padding (its loads are whole vectors)
      std::memset(qr + (ng - 1) * 256, 0, 256);
      std::memset(dr + (ng - 1) * 16, 0, sizeof(float) * 16);
      std::memset(sr + (ng - 1) * 8, 0, sizeof(float) * 8);
    }
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t g = b / 4, s = b % 4, gs = (nb - g * 4) < 4 ? nb - g * 4 : 4;
      int8_t hi[32], lo[32];
      float sums[2];
      const float d = quantize_block(x, dt, r * ldx + b * 32, hi, lo, sums);
      for (int h = 0; h < 2; ++h) {
        std::memcpy(qr + g * 256 + h * 16 * gs + s * 16, hi + h * 16, 16);
        std::memcpy(qr + g * 256 + 128 + h * 16 * gs + s * 16, lo + h * 16, 16);
      }
      for (int t = 0; t < 4; ++t) dr[g * 16 + s * 4 + t] = d;
      sr[g * 8 + s] = sums[0];
      sr[g * 8 + 4 + s] = sums[1];
    }
  }
}

// Lane period of a super-group of S blocks in SGAct: S rounded up to a power of two (16 for whole ones)
static inline int sg_period(int S) {
  int p = 1;
  while (p < S) p <<= 1;
  return p;
}

// Row r's place in SGAct's buffers (q, d, s, sh; see common.h), its last super-group's padding lanes zeroed where
// that super-group is partial (nb % 16 blocks)
struct SGRow {
  int8_t* q; float* d; float* s; float* sh;
};
static inline SGRow sg_row(int8_t* q, float* d, float* s, float* sh, int64_t r, int64_t nb) {
  const int64_t nsg = (nb + 15) / 16;
  SGRow o{q + r * nsg * 1024, d + r * nsg * 16, s + r * nsg * 16, sh + r * nsg * 32};
  if (nb % 16) {
    std::memset(o.q + (nsg - 1) * 1024, 0, 1024);
    std::memset(o.d + (nsg - 1) * 16, 0, sizeof(float) * 16);
    std::memset(o.s + (nsg - 1) * 16, 0, sizeof(float) * 16);
    std::memset(o.sh + (nsg - 1) * 32, 0, sizeof(float) * 32);
  }
  return o;
}

// One row x [K] -> two int8 levels per block of 32 in super-group order (see SGAct in common.h).
static void quantize_sg(const void* x, int dt, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int8_t* q, float* d,
                        float* s, float* sh, int levels) {
  const int64_t nb = K / 32, nsg = (nb + 15) / 16;
  for (int64_t r = r0; r < r1; ++r) {
    const SGRow o = sg_row(q, d, s, sh, r, nb);
    int8_t* qr = o.q;
    float *dr = o.d, *sr = o.s, *hr = o.sh;
    for (int64_t b = 0; b < nb; ++b) {
      int8_t hi[32], lo[32];
      float sums[2];
      dr[b] = quantize_block(x, dt, r * ldx + b * 32, hi, lo, sums, levels);  // (b / 16) * 16 + b % 16 == b
      sr[b] = sums[0] + sums[1];
      hr[(b / 16) * 32 + b % 16] = sums[0];
      hr[(b / 16) * 32 + 16 + b % 16] = sums[1];
      const int64_t P = sg_period(int(nb - b / 16 * 16 < 16 ? nb - b / 16 * 16 : 16));
      int8_t* dst = qr + (b / 16) * 1024 + (b % 16) * 4;
      for (int u = 0; u < 8; ++u) {
        std::memcpy(dst + u * 4 * P, hi + 4 * u, 4);
        std::memcpy(dst + 512 + u * 4 * P, lo + 4 * u, 4);
      }
    }
  }
}

// Super-group geometry of a 32-block format: fp16 scale arrays per block (1, or 2 with the Q4_1 / Q5_1 mins), bytes
// of Q5's high bits and of quants per block, and the weight of a quant's unsigned offset (Q4_0: q - 8; Q5_0: q - 16;
// Q8_0 stored as q + 128; IQ4_NL: its level + 128). The K-quants Q4_K, Q5_K and Q6_K are super-blocks of 8 blocks
// (kblock bytes; layouts.py): [d | dmin | sc[8] | mn[8] | Q5_K's fifth bits | quants] as Q4_1 / Q5_1 with a scale and
// min per block, or Q6_K's [d | sc[16] | low 4 bits | high 2 bits] (q - 32, a scale per 16 weights: its offset meets
// SGAct's sums per 16 weights).
template <int F> struct SG {
  static constexpr int scales = F == dtn::Q4_1 || F == dtn::Q5_1 || F == dtn::Q4_K || F == dtn::Q5_K ? 2 : 1;
  static constexpr int hbytes = F == dtn::Q5_0 || F == dtn::Q5_1 || F == dtn::Q5_K ? 4 : 0;
  static constexpr int qbytes = F == dtn::Q8_0 ? 32 : 16;
  static constexpr int bytes = 2 * scales + hbytes + qbytes;  // per block (32-block formats)
  static constexpr float offset = F == dtn::Q8_0 || F == dtn::IQ4_NL || F == dtn::IQ4_XS ? -128.f
                                  : F == dtn::Q4_0 ? -8.f : F == dtn::Q5_0 ? -16.f : F == dtn::Q6_K ? -32.f : 0.f;
  // the SIMD kernels multiply these as signed int8 (sign trick) and need no offset term
  static constexpr bool signed_q = F == dtn::Q8_0 || F == dtn::IQ4_NL || F == dtn::IQ4_XS;
  static constexpr int kblock = F == dtn::Q4_K ? 148 : F == dtn::Q5_K ? 180 : F == dtn::Q6_K ? 210
                                : F == dtn::IQ4_XS ? 138 : 0;
  // the quants' offset in a super-block, and the high bits'
  static constexpr int kq = F == dtn::Q5_K ? 52 : F == dtn::Q6_K ? 18 : F == dtn::IQ4_XS ? 10 : 20;
  static constexpr int kh = F == dtn::Q6_K ? 146 : 20;
};

// A 4-bit byte's two unsigned quants (low: weight 4 u + t, high: weight 16 + 4 u + t of step u), with Q5's fifth
// bits from the high-bit byte h at the same place, or IQ4_NL's levels + 128
template <int F>
static inline void sg_quants(uint8_t v, uint8_t h, int u, int& lo, int& hi) {
  lo = v & 15;
  hi = v >> 4;
  if constexpr (SG<F>::hbytes != 0) {
    lo |= ((h >> u) & 1) << 4;
    hi |= ((h >> (4 + u)) & 1) << 4;
  }
  if constexpr (F == dtn::IQ4_NL) {
    lo = dtn::kIq4Levels[lo] + 128;
    hi = dtn::kIq4Levels[hi] + 128;
  }
}

template <int F>
static void qgemm_sg_portable_fmt(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1,
                                  const void* bias, void* y, int ydt, int64_t ldy) {
  using G = SG<F>;
  const int64_t nb = w.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.qs + n * w.qs_row;
    for (int64_t m = 0; m < M; ++m) {
      float acc = bias ? load_f(bias, ydt, n) : 0.f;
      for (int64_t g = 0; g * 16 < nb; ++g) {
        const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16);
        const uint8_t* p = row + g * 16 * G::bytes;
        const uint16_t* dw = reinterpret_cast<const uint16_t*>(p);
        const uint8_t* qh = p + 2 * S * G::scales;
        const uint8_t* q = qh + S * G::hbytes;
        const int8_t* aq = a.q + (m * a.nsg + g) * 1024;  // hi levels, then lo at + 512
        const float* ad = a.d + (m * a.nsg + g) * 16;
        const float* as = a.s + (m * a.nsg + g) * 16;
        const int64_t st = 4 * sg_period(S);  // activation bytes per step
        for (int j = 0; j < S; ++j) {
          int32_t isum[2] = {0, 0};
          for (int l = 0; l < a.levels; ++l)
            for (int u = 0; u < G::qbytes / 4; ++u)
              for (int b = 0; b < 4; ++b) {
                const uint8_t v = q[u * 4 * S + j * 4 + b];
                const int8_t* al = aq + 512 * l + j * 4 + b;
                if constexpr (F == dtn::Q8_0) {  // signed quants as the SIMD kernels (sign trick): no offset term
                  isum[l] += (int32_t(v) - 128) * al[u * st];
                } else {
                  int lo, hi;
                  sg_quants<F>(v, G::hbytes ? qh[j * 4 + b] : 0, u, lo, hi);
                  if constexpr (G::signed_q) lo -= 128, hi -= 128;
                  isum[l] += lo * al[u * st] + hi * al[(u + 4) * st];
                }
              }
          const float d = fp16_to_f32(dw[j]);
          const float m_ = G::scales == 2 ? fp16_to_f32(dw[S + j]) : G::signed_q ? 0.f : G::offset * d;
          acc += d * (ad[j] * (float(isum[0]) + float(isum[1]) * (1.f / 254.f))) + m_ * as[j];
        }
      }
      store_f(y, ydt, m * ldy + n, acc);
    }
  }
}

// A K-quant super-block's quant of weight 4 v + t (v < 4: low nibble of step v; else high nibble of step v - 4) of
// sub-block j, unsigned (Q6_K: 0..63)
template <int F>
static inline int k_quant(const uint8_t* sb, int v, int j, int t) {
  using G = SG<F>;
  const int u = v % 4, at = j * 4 + t;
  const uint8_t q = sb[G::kq + u * 32 + at];
  int x = v < 4 ? q & 15 : q >> 4;
  if constexpr (F == dtn::Q5_K) x |= ((sb[G::kh + at] >> (v < 4 ? u : 4 + u)) & 1) << 4;
  if constexpr (F == dtn::Q6_K) x |= ((sb[G::kh + (u % 2) * 32 + at] >> (4 * (u / 2) + 2 * (v >= 4))) & 3) << 4;
  if constexpr (F == dtn::IQ4_XS) x = dtn::kIq4Levels[x];
  return x;
}

// The K-quants in super-blocks of 8 (Q4_K, Q5_K: (d sc) u - dmin mn; Q6_K: (d sc) (u - 32), sc per 16 weights;
// IQ4_XS: (d sc) level, its signed levels summed as the SIMD kernels' sign trick does)
template <int F>
static void qgemm_k_portable(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                             void* y, int ydt, int64_t ldy) {
  using G = SG<F>;
  const int64_t nb = w.K / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = bias ? load_f(bias, ydt, n) : 0.f;
      for (int64_t b = 0; b < nb / 8; ++b) {
        const uint8_t* sb = w.qs + n * w.qs_row + b * G::kblock;
        uint16_t dm[2];
        std::memcpy(dm, sb, 4);
        const float d = fp16_to_f32(dm[0]), dmin = fp16_to_f32(dm[1]);
        for (int j = 0; j < 8; ++j) {
          const int64_t blk = 8 * b + j, g = blk / 16, jj = blk % 16;
          const int64_t st = 4 * sg_period(int(nb - g * 16 < 16 ? nb - g * 16 : 16));
          const int8_t* aq = a.q + (m * a.nsg + g) * 1024 + jj * 4;
          int32_t isum[2][2] = {{0, 0}, {0, 0}};  // [level][half: weights 0..15, 16..31] of unsigned quants
          for (int l = 0; l < a.levels; ++l)
            for (int v = 0; v < 8; ++v)
              for (int t = 0; t < 4; ++t)
                isum[l][v / 4] += k_quant<F>(sb, v, j, t) * aq[512 * l + v * st + t];
          const float ad = a.d[(m * a.nsg + g) * 16 + jj], as = a.s[(m * a.nsg + g) * 16 + jj];
          if constexpr (F == dtn::Q6_K) {  // (u - 32): the offset meets the sums per 16 weights, as the SIMD kernels
            const float* hs = a.sh + (m * a.nsg + g) * 32 + jj;
            for (int h = 0; h < 2; ++h)
              acc += (d * float(int8_t(sb[2 + 2 * j + h]))) *
                     (ad * (float(isum[0][h]) + float(isum[1][h]) * (1.f / 254.f)) + G::offset * hs[16 * h]);
          } else {
            const float sum = ad * (float(isum[0][0] + isum[0][1]) + float(isum[1][0] + isum[1][1]) * (1.f / 254.f));
            if constexpr (F == dtn::IQ4_XS) acc += (d * float(int8_t(sb[2 + j]))) * sum;
            else acc += (d * float(sb[4 + j])) * sum - (dmin * float(sb[12 + j])) * as;
          }
        }
      }
      store_f(y, ydt, m * ldy + n, acc);
    }
}

static void qgemm_sg_portable(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                              void* y, int ydt, int64_t ldy) {
  switch (w.fmt) {
    case dtn::Q8_0: return qgemm_sg_portable_fmt<dtn::Q8_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_0: return qgemm_sg_portable_fmt<dtn::Q4_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_1: return qgemm_sg_portable_fmt<dtn::Q4_1>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_0: return qgemm_sg_portable_fmt<dtn::Q5_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_1: return qgemm_sg_portable_fmt<dtn::Q5_1>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::IQ4_NL: return qgemm_sg_portable_fmt<dtn::IQ4_NL>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_K: return qgemm_k_portable<dtn::Q4_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_K: return qgemm_k_portable<dtn::Q5_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q6_K: return qgemm_k_portable<dtn::Q6_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::IQ4_XS: return qgemm_k_portable<dtn::IQ4_XS>(w, a, M, n0, n1, bias, y, ydt, ldy);
  }
}

// -- portable quantized product of the group formats ----------------------------------------------------------
// A group decoded to unsigned quants u and per-sub-block scale/offset: w = dl[s] * u (L half) or dh[s] * u (H half)
// plus the offset m, applied through the activation sums: sum(w * a) = d * sum(u * a) + m * sum(a). A format whose
// offset is an integer multiple of its scale (w = d (u - off)) keeps off too, so dequant computes w as gguf does.
// IQ4 quants are their level + 128 (1..241) with off = 128.

struct GroupS {
  uint8_t wl[64], wh[64];
  float dl[4], dh[4], m[8];  // m: [L s0..s3, H s0..s3]
  int off;
};

// Bytes of a whole group's quants (the qs section) per group format
static inline int64_t group_bytes(int fmt) {
  switch (fmt) {
    case dtn::Q3_K: return 48;
    case dtn::Q2_K: return 32;
  }
  return 0;
}

// bit planes (group_formats.py): OR each quant's bits in at `shift`
static inline void plane_bit(const uint8_t* p, int shift, GroupS& o) {
  for (int i = 0; i < 64; ++i) {
    o.wl[i] |= uint8_t(((p[i >> 3] >> (i & 7)) & 1) << shift);
    o.wh[i] |= uint8_t(((p[8 + (i >> 3)] >> (i & 7)) & 1) << shift);
  }
}

static inline void plane_two(const uint8_t* p, GroupS& o) {  // whole groups only
  for (int i = 0; i < 32; ++i) {
    o.wl[i] |= p[i] & 3;
    o.wl[32 + i] |= (p[i] >> 2) & 3;
    o.wh[i] |= (p[i] >> 4) & 3;
    o.wh[32 + i] |= (p[i] >> 6) & 3;
  }
}

static inline void decode_group_scalar(const QWeight& w, int64_t n, int64_t g, GroupS& o) {
  const uint8_t* p = w.qs + n * w.qs_row + g * group_bytes(w.fmt);
  const uint16_t* d = w.d + n * w.d_row;
  const uint8_t* aux = w.aux + n * w.aux_row;
  const int64_t sup = g / 2, nsup = w.K / 256;
  for (int s = 0; s < 4; ++s) o.dl[s] = o.dh[s] = o.m[s] = o.m[4 + s] = 0.f;
  std::memset(o.wl, 0, 64);
  std::memset(o.wh, 0, 64);
  o.off = 0;
  switch (w.fmt) {
    case dtn::Q3_K: {  // (d sc) (u - 4), a signed scale per 16 weights
      plane_two(p, o);
      plane_bit(p + 32, 2, o);
      o.off = 4;
      const float dd = fp16_to_f32(d[sup]);
      for (int s = 0; s < 4; ++s) {
        o.dl[s] = dd * float(int8_t(aux[g * 8 + s]));
        o.dh[s] = dd * float(int8_t(aux[g * 8 + 4 + s]));
        o.m[s] = -4.f * o.dl[s];
        o.m[4 + s] = -4.f * o.dh[s];
      }
      break;
    }
    case dtn::Q2_K: {  // (d sc) u - dmin mn, a scale and a min per 16 weights
      plane_two(p, o);
      const float dd = fp16_to_f32(d[sup]), dmin = fp16_to_f32(d[nsup + sup]);
      for (int s = 0; s < 4; ++s) {
        const uint8_t al = aux[g * 8 + s], ah = aux[g * 8 + 4 + s];
        o.dl[s] = dd * float(al & 15);
        o.dh[s] = dd * float(ah & 15);
        o.m[s] = -(dmin * float(al >> 4));
        o.m[4 + s] = -(dmin * float(ah >> 4));
      }
      break;
    }
  }
}

// Decode streams rows from memory: ask for row n + kAhead's bytes while row n computes, so the loads overlap
// the arithmetic instead of waiting on the hardware prefetcher's ramp-up at every short row (quant_avx2.h's tiles, and the prompt panels' first pass).
constexpr int64_t kAhead = 8;

// The AVX-512 decode's distance, in bytes rather than rows: its rows are read one after another, and 8 KB on hides
// the memory's latency behind their arithmetic (at 8 rows of 576 bytes one-row products read ~20 GB/s of the ~30 a
// plain read of the same weights gets here; at 8 KB ~26-30). ahead_rows: that many bytes in rows, 4 to 64.
constexpr int64_t kAheadBytes = 8 << 10;

static inline int64_t ahead_rows(const QWeight& w) {
  const int64_t r = kAheadBytes / (w.qs_row > 0 ? w.qs_row : 1);
  return r < 4 ? 4 : r > 64 ? 64 : r;
}

// A packed row (qs_row bytes from qs) fetched into L2, not L1 (prefetcht1): an L1 prefetch holds one of the core's
// few L1 miss buffers until its line arrives, so 8 KB of them in flight left the loads themselves waiting; into L2
// the same distance streams cold one-row products at 1.2-2x the speed (AVX-512 Q8_0 151936 x 896: 15 -> 27 GB/s, Q6_K
// 896 x 4864: 12 -> 23, Q5_0 9728 x 896: 15 -> 17.5; the AVX2 tiles 1.6-2.8x), and prompt tiles alike (0.97-1.1x)
static inline void prefetch_row(const QWeight& w, int64_t n) {
  const char* q = reinterpret_cast<const char*>(w.qs + n * w.qs_row);
  for (int64_t i = 0; i < w.qs_row; i += 64) __builtin_prefetch(q + i, 0, 2);
}

// Decode streams instead: as each super-group of a row is read, the bytes kStreamAhead on (rounded up to the rows read
// side by side) are asked for into L2 (stream_ahead), a steady stream where whole rows several KB on came in bursts
// that left the memory idle between them (decode_avx512.h's drivers, quant_avx2.h's tiles at decode; the AVX-512
// 32-block decode streams only rows of more than kStreamRowBytes).
constexpr int64_t kStreamAhead = 16 << 10;
constexpr int64_t kStreamRowBytes = 4096;

// Bytes [p, p + n) of the weight, read now, ask for the bytes `ahead` on into L2 (prefetcht1, see prefetch_row)
static inline __attribute__((always_inline)) void stream_ahead(const uint8_t* p, int64_t n, int64_t ahead) {
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + ahead + i, 0, 2);
}

static void qgemm_portable(const QWeight& w, const QAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                           void* y, int ydt, int64_t ldy) {
  const int64_t nb = w.K / 32, ng = a.ng;
  GroupS gr;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* aq = a.q + m * ng * 256;
      const float* dr = a.darep + m * ng * 16;
      const float* as = a.asum + m * ng * 8;
      float acc = bias ? load_f(bias, ydt, n) : 0.f;
      for (int64_t g = 0; g < ng; ++g) {
        const int gs = int(nb - g * 4 < 4 ? nb - g * 4 : 4);
        decode_group_scalar(w, n, g, gr);
        const int8_t* al = aq + g * 256;  // hi levels, then lo at + 128
        const int8_t* ah = al + 16 * gs;
        for (int s = 0; s < gs; ++s) {
          int32_t il[2] = {0, 0}, ih[2] = {0, 0};
          for (int l = 0; l < 2; ++l)
            for (int i = 0; i < 16; ++i) {
              il[l] += int32_t(gr.wl[s * 16 + i]) * al[128 * l + s * 16 + i];
              ih[l] += int32_t(gr.wh[s * 16 + i]) * ah[128 * l + s * 16 + i];
            }
          const float fl = float(il[0]) + float(il[1]) * (1.f / 254.f), fh = float(ih[0]) + float(ih[1]) * (1.f / 254.f);
          acc += dr[g * 16 + 4 * s] * (gr.dl[s] * fl + gr.dh[s] * fh);
          acc += gr.m[s] * as[g * 8 + s] + gr.m[4 + s] * as[g * 8 + 4 + s];
        }
      }
      store_f(y, ydt, m * ldy + n, acc);
    }
  }
}

// -- dequantization for many-row products --------------------------------------------------------------------
// A weight row comes out in its packed order, so every loop here is a plain vectorizable stream: a super-group of S
// blocks as [v 0..7][block j][4] holding element 32 j + 4 v + t (Q4: v < 4 the low nibbles of step v, v >= 4 the
// high nibbles of step v - 4), a K-quant group of 128 as its L half, then its H half. Values equal gguf's.

template <int F>
static void dequant_sg_fmt(const QWeight& w, int64_t n0, int64_t n1, float* out) {
  using G = SG<F>;
  const int64_t nb = w.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.qs + n * w.qs_row;
    float* o = out + (n - n0) * w.K;
    for (int64_t g = 0; g * 16 < nb; ++g) {
      const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16), L = 4 * S;
      const uint8_t* p = row + g * 16 * G::bytes;
      const uint16_t* dw = reinterpret_cast<const uint16_t*>(p);
      const uint8_t* qh = p + 2 * S * G::scales;
      const uint8_t* q = qh + S * G::hbytes;
      float* og = o + g * 512;
      float ds[16], ms[16], d[64], m[64];  // d, m per lane l: those of block l / 4
      for (int j = 0; j < S; ++j) {
        ds[j] = fp16_to_f32(dw[j]);
        ms[j] = G::scales == 2 ? fp16_to_f32(dw[S + j]) : 0.f;
      }
      for (int l = 0; l < L; ++l) {
        d[l] = ds[l / 4];
        m[l] = ms[l / 4];
      }
      for (int u = 0; u < G::qbytes / 4; ++u) {
        const uint8_t* qu = q + u * L;
        if constexpr (F == dtn::Q8_0) {
#pragma omp simd
          for (int l = 0; l < L; ++l) og[u * L + l] = d[l] * float(int8_t(qu[l] ^ 0x80));
        } else if constexpr (F == dtn::Q4_0) {
#pragma omp simd
          for (int l = 0; l < L; ++l) {
            og[u * L + l] = d[l] * float(int(qu[l] & 15) - 8);
            og[(u + 4) * L + l] = d[l] * float(int(qu[l] >> 4) - 8);
          }
        } else if constexpr (F == dtn::Q4_1) {
#pragma omp simd
          for (int l = 0; l < L; ++l) {
            og[u * L + l] = d[l] * float(qu[l] & 15) + m[l];
            og[(u + 4) * L + l] = d[l] * float(qu[l] >> 4) + m[l];
          }
        } else {  // Q5_0: d (u - 16); Q5_1: d u + m; IQ4_NL: d level
          for (int l = 0; l < L; ++l) {
            int lo, hi;
            sg_quants<F>(qu[l], G::hbytes ? qh[l] : 0, u, lo, hi);
            if constexpr (F == dtn::Q5_1) {
              og[u * L + l] = d[l] * float(lo) + m[l];
              og[(u + 4) * L + l] = d[l] * float(hi) + m[l];
            } else {
              og[u * L + l] = d[l] * float(lo + int(G::offset));
              og[(u + 4) * L + l] = d[l] * float(hi + int(G::offset));
            }
          }
        }
      }
    }
  }
}

// super-block b: [v 0..7][sub-block j][t 0..3] holds element 256 b + 32 j + 4 v + t (gguf: (d sc) q - (dmin mn), or
// Q6_K's (d sc) (q - 32)). Step u's 32 bytes hold lanes i = 4 j + t of v = u (low nibbles) and v = u + 4 (high), so
// each step is one vectorizable loop over 32 lanes with the lanes' scales spread once per super-block (k_quant's
// bits, 32 at a time).
template <int F>
static void dequant_k(const QWeight& w, int64_t n0, int64_t n1, float* out) {
  using G = SG<F>;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < w.K / 256; ++b) {
      const uint8_t* sb = w.qs + n * w.qs_row + b * G::kblock;
      uint16_t dm[2];
      std::memcpy(dm, sb, 4);
      const float d = fp16_to_f32(dm[0]), dmin = fp16_to_f32(dm[1]);
      float sl[32], sh[32], mn[32];  // lane i's scale for the low and the high nibbles, and its min
      for (int i = 0; i < 32; ++i) {
        const int j = i / 4;
        if constexpr (F == dtn::Q6_K) {
          sl[i] = d * float(int8_t(sb[2 + 2 * j]));
          sh[i] = d * float(int8_t(sb[3 + 2 * j]));
          mn[i] = 0.f;
        } else if constexpr (F == dtn::IQ4_XS) {
          sl[i] = sh[i] = d * float(int8_t(sb[2 + j]));
          mn[i] = 0.f;
        } else {
          sl[i] = sh[i] = d * float(sb[4 + j]);
          mn[i] = dmin * float(sb[12 + j]);
        }
      }
      float* o = out + (n - n0) * w.K + b * 256;
      for (int u = 0; u < 4; ++u) {
        const uint8_t* q = sb + G::kq + u * 32;
#pragma omp simd
        for (int i = 0; i < 32; ++i) {
          int lo = q[i] & 15, hi = q[i] >> 4;
          if constexpr (F == dtn::Q5_K) {
            const int hb = sb[G::kh + i];
            lo |= ((hb >> u) & 1) << 4;
            hi |= ((hb >> (4 + u)) & 1) << 4;
          }
          if constexpr (F == dtn::Q6_K) {
            const int hb = sb[G::kh + (u % 2) * 32 + i] >> (4 * (u / 2));
            lo |= (hb & 3) << 4;
            hi |= ((hb >> 2) & 3) << 4;
            o[u * 32 + i] = sl[i] * float(lo - 32);
            o[(u + 4) * 32 + i] = sh[i] * float(hi - 32);
          } else if constexpr (F == dtn::IQ4_XS) {
            o[u * 32 + i] = sl[i] * float(dtn::kIq4Levels[lo]);
            o[(u + 4) * 32 + i] = sh[i] * float(dtn::kIq4Levels[hi]);
          } else {
            o[u * 32 + i] = sl[i] * float(lo) - mn[i];
            o[(u + 4) * 32 + i] = sh[i] * float(hi) - mn[i];
          }
        }
      }
    }
}

static void dequant(const QWeight& w, int64_t n0, int64_t n1, float* out) {
  switch (w.fmt) {
    case dtn::Q8_0: return dequant_sg_fmt<dtn::Q8_0>(w, n0, n1, out);
    case dtn::Q4_0: return dequant_sg_fmt<dtn::Q4_0>(w, n0, n1, out);
    case dtn::Q4_1: return dequant_sg_fmt<dtn::Q4_1>(w, n0, n1, out);
    case dtn::Q5_0: return dequant_sg_fmt<dtn::Q5_0>(w, n0, n1, out);
    case dtn::Q5_1: return dequant_sg_fmt<dtn::Q5_1>(w, n0, n1, out);
    case dtn::IQ4_NL: return dequant_sg_fmt<dtn::IQ4_NL>(w, n0, n1, out);
    case dtn::Q4_K: return dequant_k<dtn::Q4_K>(w, n0, n1, out);
    case dtn::Q5_K: return dequant_k<dtn::Q5_K>(w, n0, n1, out);
    case dtn::Q6_K: return dequant_k<dtn::Q6_K>(w, n0, n1, out);
    case dtn::IQ4_XS: return dequant_k<dtn::IQ4_XS>(w, n0, n1, out);
  }
  GroupS gr;  // the group formats (K a multiple of 256): the L half of group g, then its H half, at 128 g
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t g = 0; g < w.K / 128; ++g) {
      decode_group_scalar(w, n, g, gr);
      float* o = out + (n - n0) * w.K + g * 128;
      for (int i = 0; i < 64; ++i) {
        if (gr.off) {  // gguf: d (u - off)
          o[i] = gr.dl[i / 16] * float(int(gr.wl[i]) - gr.off);
          o[64 + i] = gr.dh[i / 16] * float(int(gr.wh[i]) - gr.off);
        } else {  // gguf: (d sc) u - dmin mn
          o[i] = gr.dl[i / 16] * float(gr.wl[i]) + gr.m[i / 16];
          o[64 + i] = gr.dh[i / 16] * float(gr.wh[i]) + gr.m[4 + i / 16];
        }
      }
    }
}

// -- the 16-row interleaved layout (common.h's x16_base) -----------------------------------------------------------
// One group (16 rows of K = 32 nb weights, nb even) of Q8_0 / Q5_0 (base) -> its 16 rows in the row layout
// (repack.h's super_groups, what every other kernel reads), row r at rows + r * rb: bit for bit repack::row's.
static void x16_rows_scalar(int base, const uint8_t* gp, int64_t b0, int64_t b1, int64_t nb, uint8_t* rows, int64_t rb) {
  const int qd = base == dtn::Q5_0 ? 4 : 8, hb = base == dtn::Q5_0 ? 4 : 0;  // quant dwords, fifth-bit bytes
  const int64_t qb = dtn::x16_block_bytes(base), pair = 64 + 2 * qb, ts = 2 + hb + 4 * qd;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t s = b / 16, j = b % 16, S = nb - 16 * s < 16 ? nb - 16 * s : 16;
    const uint8_t* sc = gp + b / 2 * pair + 32 * (b & 1);
    const uint8_t* q = gp + b / 2 * pair + 64 + (b & 1) * qb;
    for (int r = 0; r < 16; ++r) {
      uint8_t* o = rows + r * rb + s * 16 * ts;
      std::memcpy(o + 2 * j, sc + 2 * r, 2);
      if (hb) {
        uint8_t h[4] = {};
        for (int k = 0; k < 8; ++k) {  // mask k = (u, half): bit 4 r + t -> byte t, bit u + 4 half
          uint64_t m;
          std::memcpy(&m, q + 8 * k, 8);
          for (int t = 0; t < 4; ++t) h[t] |= uint8_t(((m >> (4 * r + t)) & 1) << (k / 2 + 4 * (k % 2)));
        }
        std::memcpy(o + 2 * S + 4 * j, h, 4);
      }
      for (int u = 0; u < qd; ++u) std::memcpy(o + (2 + hb) * S + 4 * (u * S + j), q + 64 * (hb ? 1 : 0) + 64 * u + 4 * r, 4);
    }
  }
}

static void x16_rows(int base, const uint8_t* gp, int64_t K, uint8_t* rows, int64_t rb) {
  x16_rows_scalar(base, gp, 0, K / 32, K / 32, rows, rb);
}

// The interleaved layout's own products (M < 4 rows of x): false where this ISA has none (the caller converts the
// groups to rows: x16_rows). Groups [g0, g1) of w (qs: the first group's bytes, qs_row: a row's), y as qgemm_sg's.
static bool x16_decode(const QWeight&, const SGAct&, int64_t, int64_t, int64_t, const void*, void*, int, int64_t) {
  return false;
}

// -- portable float product -------------------------------------------------------------------------------

static void gemv_portable(const void* x, int xdt, int64_t M, const void* w, int wdt, int64_t K, int64_t n0,
                          int64_t n1, void* y, int ydt, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += load_f(x, xdt, m * K + k) * load_f(w, wdt, n * K + k);
      store_f(y, ydt, m * ldy + n, acc);
    }
}
