// Quantized products with AVX-512 VNNI: every super-grouped format (SGAct), one lane per block. The group formats
// (Q2_K, Q3_K) and the last super-group of a row under 16 blocks run quant_avx2.h's kernels (included
// before this file).
// Included inside namespace DTN_ISA of isa_avx512.cpp.

// the two activation levels' integer sums as one float: hi + lo / 254 (as the portable kernels round it)
static inline __m512 levels512(__m512i hi, __m512i lo) {
  return _mm512_add_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(1.f / 254.f)));
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// the group formats (Q2_K, Q3_K): quant_avx2.h
static void qgemm512(const QWeight& w, const QAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias, void* y,
                     int ydt, int64_t ldy) {
  qgemm256(w, a, M, n0, n1, bias, y, ydt, ldy);
}

// -- float32 / bf16 weights ------------------------------------------------------------------------------

static inline __m512 load16(const void* p, int dt, int64_t i, __mmask16 k) {
  if (dt == F32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(p) + i);
  if (dt == dtn::F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// NR weight rows n.. against activation row m: y[m, n + j]
template <int NR>
static inline void fdot512(const void* x, int xdt, int64_t m, const void* w, int wdt, int64_t K, int64_t n,
                           void* y, int ydt, int64_t ldy) {
  __m512 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  const int64_t esz = wdt == F32 ? 4 : 2;
  // the rows two groups on, fetched into L2 while these stream: a cold [1024, 1024] bf16 weight reads at ~22 GB/s on 2
  // cores instead of ~15 (the hardware prefetcher restarts at each group); a prefetch past the end does not fault.
  // Into L2 rather than L1 (see prefetch_row): one thread reads a cold bf16 [151936, 896] at 25.6 GB/s, not 13.1
  const char* ahead = static_cast<const char*>(w) + (n + 2 * NR) * K * esz;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    const __m512 xv = load16(x, xdt, m * K + k, mk);
    for (int j = 0; j < NR; ++j) _mm_prefetch(ahead + (j * K + k) * esz, _MM_HINT_T1);
    for (int j = 0; j < NR; ++j) acc[j] = _mm512_fmadd_ps(load16(w, wdt, (n + j) * K + k, mk), xv, acc[j]);
  }
  for (int j = 0; j < NR; ++j) store_f(y, ydt, m * ldy + n + j, _mm512_reduce_add_ps(acc[j]));
}

static void gemv512(const void* x, int xdt, int64_t M, const void* w, int wdt, int64_t K, int64_t n0, int64_t n1,
                    void* y, int ydt, int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)  // the 4 rows stay in L1 while every activation row passes
    for (int64_t m = 0; m < M; ++m) fdot512<4>(x, xdt, m, w, wdt, K, n, y, ydt, ldy);
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) fdot512<1>(x, xdt, m, w, wdt, K, n, y, ydt, ldy);
}

// -- 32-block formats in super-groups (SGAct): lane j of every vector is block j of the super-group ----------
// MR activation rows x NR weight rows: per step u, a 4 S byte load of each weight row meets a 64-byte load of
// each activation row in one vpdpbusd; the scales apply once per super-group, without permutes.
// A row's last super-group of S < 16 blocks is compact: its activations lie P = sg_period(S) lanes per step, so a
// vector holds 16 / P steps (lane l: block l % P) and the weights' 4 S bytes per step are expanded to P lanes; it
// costs ceil(steps P / 16) vectors instead of a whole super-group's steps. Its integer sums are scaled per lane
// (the scales permuted to lane l % P); the per-block offset terms apply unreplicated.

static inline __m512i iq4_table512() {  // IQ4 indices -> level + 128 through vpshufb
  return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dtn::kIq4Levels))),
                          _mm512_set1_epi8(char(0x80)));
}

// two super-blocks side by side: the fp16 at a in lanes 0..7 and the one at b in lanes 8..15 (both halves converted
// in one vcvtph2ps, then spread by one permute)
static inline __m512 fp16_pair(const uint8_t* a, const uint8_t* b) {
  uint16_t x, y;
  std::memcpy(&x, a, 2);
  std::memcpy(&y, b, 2);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(int(x) | int(y) << 16));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                               _mm512_castps128_ps512(f));
}

// a K-quant pair's [d | dmin] (the first 4 bytes at a and at b): d in lanes 0..7 / 8..15, and -dmin the same way
static inline void fp16_pairs2(const uint8_t* a, const uint8_t* b, __m512& d, __m512& mdmin) {
  uint32_t x, y;
  std::memcpy(&x, a, 4);
  std::memcpy(&y, b, 4);
  const __m128 f = _mm_xor_ps(_mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(int(x)), _mm_cvtsi32_si128(int(y)))),
                              _mm_castsi128_ps(_mm_setr_epi32(0, int(0x80000000u), 0, int(0x80000000u))));
  const __m512 v = _mm512_castps128_ps512(f);  // [dA, -dminA, dB, -dminB]
  d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), v);
  mdmin = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), v);
}

// and 8 bytes of each (a super-block's per-block scales): 16 bytes
static inline __m128i bytes_pair(const uint8_t* a, const uint8_t* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}

// Q6_K's epilogue, shared by the decode (kq_rows512) and the tiles (sg_tile512) so a row gets the same bits either
// way. Per super-group and row of x (q6_act512): dl = da / 254 and h0, h1 = -32 hs (x's sums of each lane's first /
// second 16 weights), for every weight row. A row's half from its integer sums s (hi level), l (lo):
// da s + (dl l - 32 hs), two conversions and two FMAs (levels512, da and the -32 took six operations).
template <bool LO>
static inline void q6_act512(__m512 da, const float* hs, __m512& dl, __m512& h0, __m512& h1) {
  const __m512 k32 = _mm512_set1_ps(-32.f);
  dl = LO ? _mm512_mul_ps(da, _mm512_set1_ps(1.f / 254.f)) : da;
  h0 = _mm512_mul_ps(_mm512_loadu_ps(hs), k32);
  h1 = _mm512_mul_ps(_mm512_loadu_ps(hs + 16), k32);
}
template <bool LO>
static inline __m512 q6_half512(__m512i s, __m512i l, __m512 da, __m512 dl, __m512 h) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), da, LO ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), dl, h) : h);
}
// One weight row's scales (p: its first super-block, q: its second): sc0 / sc1 the signed 8-bit scales of each
// lane's first / second 16 weights, d each super-block's fp16 scale
struct Q6W512 {
  __m512 sc0, sc1, d;
};
static inline Q6W512 q6_weights512(const uint8_t* p, const uint8_t* q) {
  const __m128i ev = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i s0 = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)), ev);
  const __m128i s1 = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2)), ev);
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(s0, s1))),
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(s0, s1))), fp16_pair(p, q)};
}
// acc + d (sc0 lo + sc1 hi): d multiplies once, after the scales (not d sc0 and d sc1 formed apart: one multiply
// less a row; with q6_half512, hot Q6_K one-row decode 1.045x, cold 1.035-1.05x, stand-alone harness)
template <bool LO>
static inline __m512 q6_row512(const Q6W512& w, __m512 da, __m512 dl, __m512 h0, __m512 h1, __m512i is, __m512i il,
                               __m512i is2, __m512i il2, __m512 acc) {
  const __m512 lo = q6_half512<LO>(is, il, da, dl, h0), hi = q6_half512<LO>(is2, il2, da, dl, h1);
  return _mm512_fmadd_ps(_mm512_fmadd_ps(hi, w.sc1, _mm512_mul_ps(lo, w.sc0)), w.d, acc);
}

// dwords 0 .. c - 1 (c <= 16) of 16 rows (row r at p + r * stride; rows from nr on read as zero) as vectors of one
// dword per row: out[j] lane r = dword j of row r (a 16 x 16 transpose: unpacks of dwords and qwords, then of the
// 128-bit lanes)
static inline void rows_to_lanes(const uint8_t* p, int64_t stride, int nr, int c, __m512i* out) {
  const __mmask16 cm = c >= 16 ? __mmask16(0xffff) : __mmask16((1u << c) - 1);
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = i < nr ? _mm512_maskz_loadu_epi32(cm, p + i * stride) : _mm512_setzero_si512();
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + j], 128-bit lane k: dword 4 k + j of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), f = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
    if (j < c) out[j] = _mm512_shuffle_i32x4(a, e, 0x88);
    if (4 + j < c) out[4 + j] = _mm512_shuffle_i32x4(a, e, 0xdd);
    if (8 + j < c) out[8 + j] = _mm512_shuffle_i32x4(b, f, 0x88);
    if (12 + j < c) out[12 + j] = _mm512_shuffle_i32x4(b, f, 0xdd);
  }
}

// The last super-group of a row of S < 16 blocks (32-block formats; K = 576: S = 2), one weight row per lane: its
// few blocks cost a whole tile's epilogue per pair of rows in the tiles' lane-per-block order, here one per block and
// activation row for 16 weight rows. The rows' scales, Q5's fifth bits and quants (S dwords per step) are transposed
// to one dword per lane, and step j of block b meets the activation's dword of that step and block, broadcast; per
// block, x's scale and sum are broadcast and the weights' scales are lanes. out[m * ldo + n - n0]: that part of
// y[m, n] for rows m < M, weight rows n0..n1 (the tiles add it to the whole super-groups' sum).
template <int F, bool LO>
static void sg_tails512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, float* out,
                        int64_t ldo) {
  using G = SG<F>;
  constexpr int kSteps = F == dtn::Q8_0 ? 8 : 4;  // dwords of a block's quants
  const int64_t nb = w.K / 32, g = nb / 16;
  const int S = int(nb - g * 16), P = sg_period(S);
  const int64_t qoff = 2 * S * G::scales + S * G::hbytes, rs = a.nsg * 1024, ars = a.nsg * 16;
  const __m512i lo4 = _mm512_set1_epi8(0x0f), bit0 = _mm512_set1_epi32(0x01010101), iq4 = iq4_table512();
  __m512i raw[8 * 15], sc[16], hb[16];
  __m512i wq[8 * 15];  // [b][j]: block b's quants that meet x's step j (Q4: the low nibbles of steps 0..3, the high)
  __m512 dw[15], mw[15];
  for (int64_t nc = n0; nc < n1; nc += 16) {
    const int nr = int(n1 - nc < 16 ? n1 - nc : 16);
    const __mmask16 km = __mmask16(nr == 16 ? 0xffffu : (1u << nr) - 1);
    const uint8_t* p = w.qs + nc * w.qs_row + g * 16 * G::bytes;
    rows_to_lanes(p, w.qs_row, nr, (2 * S * G::scales + 3) / 4, sc);
    auto half = [&](int byte) {  // the fp16 at byte (even) of each row
      const __m512i v = sc[byte / 4];
      return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(byte % 4 ? _mm512_srli_epi32(v, 16) : v));
    };
    if constexpr (G::hbytes != 0) rows_to_lanes(p + 2 * S * G::scales, w.qs_row, nr, S, hb);
    for (int c0 = 0; c0 < kSteps * S; c0 += 16)
      rows_to_lanes(p + qoff + 4 * c0, w.qs_row, nr, kSteps * S - c0 < 16 ? kSteps * S - c0 : 16, raw + c0);
    for (int b = 0; b < S; ++b) {
      dw[b] = half(2 * b);
      mw[b] = G::scales == 2 ? half(2 * S + 2 * b) : _mm512_mul_ps(dw[b], _mm512_set1_ps(G::offset));
      for (int u = 0; u < kSteps; ++u) {
        const __m512i v = raw[u * S + b];
        if constexpr (F == dtn::Q8_0) {
          wq[b * 8 + u] = v;
          continue;
        }
        __m512i wl = _mm512_and_si512(v, lo4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        if constexpr (G::hbytes != 0) {  // bit u of each byte: the low nibble's fifth bit, 4 + u the high's
          wl = _mm512_or_si512(wl, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb[b], u), bit0), 4));
          wh = _mm512_or_si512(wh, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb[b], 4 + u), bit0), 4));
        }
        if constexpr (F == dtn::IQ4_NL) {
          wl = _mm512_shuffle_epi8(iq4, wl);
          wh = _mm512_shuffle_epi8(iq4, wh);
        }
        wq[b * 8 + u] = wl;
        wq[b * 8 + 4 + u] = wh;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* am = a.q + m * rs + g * 1024;
      const float* ad = a.d + m * ars + g * 16;
      const float* as = a.s + m * ars + g * 16;
      __m512 v = _mm512_setzero_ps();
      for (int b = 0; b < S; ++b) {  // step j of block b: activation dword j P + b (Q4's high nibbles: steps 4..7)
        __m512i is0 = _mm512_setzero_si512(), is1 = is0, il0 = is0, il1 = is0;
        auto dword = [&](int off) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(am + off)); };
        for (int j = 0; j < 8; j += 2) {
          is0 = _mm512_dpbusd_epi32(is0, wq[b * 8 + j], dword(4 * (j * P + b)));
          is1 = _mm512_dpbusd_epi32(is1, wq[b * 8 + j + 1], dword(4 * ((j + 1) * P + b)));
          if constexpr (LO) {
            il0 = _mm512_dpbusd_epi32(il0, wq[b * 8 + j], dword(512 + 4 * (j * P + b)));
            il1 = _mm512_dpbusd_epi32(il1, wq[b * 8 + j + 1], dword(512 + 4 * ((j + 1) * P + b)));
          }
        }
        const __m512i is = _mm512_add_epi32(is0, is1);
        const __m512 t = LO ? levels512(is, _mm512_add_epi32(il0, il1)) : _mm512_cvtepi32_ps(is);
        v = _mm512_fmadd_ps(_mm512_mul_ps(t, _mm512_set1_ps(ad[b])), dw[b], v);
        if (G::scales == 2 || G::offset != 0.f) v = _mm512_fmadd_ps(mw[b], _mm512_set1_ps(as[b]), v);
      }
      _mm512_mask_storeu_ps(out + m * ldo + (nc - n0), km, v);
    }
  }
}

// Every super-grouped format (SG in generic.h) on whole super-groups: per step u, one 64-byte vector of each weight
// row (a K-quant's two super-blocks side by side) meets a 64-byte load of each activation row in vpdpbusd, the
// quants unsigned (Q8_0 stored as q + 128, IQ4_NL and IQ4_XS as their level + 128; their offsets meet SGAct's
// sums). A last super-group of S < 16 blocks: the 32-block formats' come from sg_tails512 (pre[m * ldp + n], added
// to the sum of the whole super-groups), a K-quant's lone super-block from quant_avx2.h's tile on the activations
// from that group on. LO: both activation levels.
static inline __m512i two_halves(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

template <int F, int MR, int NR, bool LO>
static inline void sg_tile512(const uint8_t* const* rows, const SGAct& a, int64_t m0, int64_t nb, const float* pre,
                              int64_t ldp, float (&out)[MR][NR]) {
  using G = SG<F>;
  constexpr bool Q6 = F == dtn::Q6_K;
  const __m512i lo4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10), b45 = _mm512_set1_epi8(0x30);
  const __m512i iq4 = iq4_table512();
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  float tail[MR][NR] = {};  // the last super-group of S < 16 blocks
  if (pre)
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) tail[m][n] = pre[m * ldp + n];
  const int64_t rs = a.nsg * 1024;
  const int64_t gbytes = G::kblock ? 2 * G::kblock : 16 * G::bytes;  // a super-group's bytes in a weight row
  for (int64_t g = 0; g * 16 < nb; ++g) {
    const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16);
    const uint8_t* p[NR];
    for (int n = 0; n < NR; ++n) p[n] = rows[n] + g * gbytes;
    const int8_t* ag = a.q + m0 * rs + g * 1024;  // hi levels, then lo at + 512
    if (S < 16) {
      if constexpr (G::kblock != 0) {  // (the 32-block formats' are in pre)
        const SGAct at{a.q + g * 1024, a.d + g * 16, a.s + g * 16, a.nsg, a.sh + g * 32, a.levels};
        sg_tile256<F, MR, NR, LO>(p, at, m0, nb - g * 16, tail);
      }
      continue;
    }
    const int64_t qoff = 2 * 16 * G::scales + 16 * G::hbytes;  // 32-block formats: the quants after scales, high bits
    auto quants = [&](int n, int u) -> __m512i {  // step u's 64 bytes of row n
      if constexpr (G::kblock != 0) return two_halves(p[n] + G::kq + 32 * u, p[n] + G::kblock + G::kq + 32 * u);
      return _mm512_loadu_si512(p[n] + qoff + 64 * u);
    };
    auto high = [&](int n, int off) -> __m512i {  // Q5's fifth bits of the 16 blocks (Q6_K: high bits at + off)
      if constexpr (G::kblock != 0) return two_halves(p[n] + G::kh + off, p[n] + G::kblock + G::kh + off);
      return _mm512_loadu_si512(p[n] + 2 * 16 * G::scales);
    };
    __m512i is[MR][NR], il[MR][NR], is2[MR][NR], il2[MR][NR];  // is2, il2: Q6_K's high nibbles (own scales)
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) is[m][n] = il[m][n] = is2[m][n] = il2[m][n] = _mm512_setzero_si512();
    if constexpr (F == dtn::Q8_0 && MR == 1) {
      for (int u = 0; u < 8; ++u) {
        __m512i wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = _mm512_loadu_si512(p[n] + qoff + 64 * u);
        const __m512i av = _mm512_loadu_si512(ag + u * 64);
        for (int n = 0; n < NR; ++n) is[0][n] = _mm512_dpbusd_epi32(is[0][n], wv[n], av);
        if constexpr (LO) {
          const __m512i lv = _mm512_loadu_si512(ag + 512 + u * 64);
          for (int n = 0; n < NR; ++n) il[0][n] = _mm512_dpbusd_epi32(il[0][n], wv[n], lv);
        }
      }
    } else if constexpr (F == dtn::Q8_0) {
      // several rows of x: two steps a pass, each sum taking two products in a row (as the 4-bit formats'), 1.2-1.9x
      // the speed of one step a pass from 9 rows on
      for (int u = 0; u < 8; u += 2) {
        __m512i w0[NR], w1[NR];
        for (int n = 0; n < NR; ++n) {
          w0[n] = _mm512_loadu_si512(p[n] + qoff + 64 * u);
          w1[n] = _mm512_loadu_si512(p[n] + qoff + 64 * (u + 1));
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* am = ag + m * rs + u * 64;
          const __m512i a0 = _mm512_loadu_si512(am), a1 = _mm512_loadu_si512(am + 64);
          for (int n = 0; n < NR; ++n) is[m][n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is[m][n], w0[n], a0), w1[n], a1);
          if constexpr (LO) {
            const __m512i l0 = _mm512_loadu_si512(am + 512), l1 = _mm512_loadu_si512(am + 576);
            for (int n = 0; n < NR; ++n)
              il[m][n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(il[m][n], w0[n], l0), w1[n], l1);
          }
        }
      }
    } else {
      __m512i hv[NR];
      if constexpr (G::hbytes != 0)
        for (int n = 0; n < NR; ++n) hv[n] = high(n, 0);
      for (int u = 0; u < 4; ++u) {
        __m512i wl[NR], wh[NR];
        for (int n = 0; n < NR; ++n) {
          const __m512i v = quants(n, u);
          wl[n] = _mm512_and_si512(v, lo4);
          wh[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
          if constexpr (Q6) {  // two high bits per quant, 4 steps a byte (as quant_avx2.h)
            const __m512i hq = high(n, 32 * (u % 2));
            const __m512i hl = u < 2 ? _mm512_slli_epi16(hq, 4) : hq;
            const __m512i hh = u < 2 ? _mm512_slli_epi16(hq, 2) : _mm512_srli_epi16(hq, 2);
            wl[n] = _mm512_or_si512(wl[n], _mm512_and_si512(hl, b45));
            wh[n] = _mm512_or_si512(wh[n], _mm512_and_si512(hh, b45));
          } else if constexpr (G::hbytes != 0) {  // bit u of each byte: the low nibble's fifth bit, 4 + u the high's
            wl[n] = _mm512_or_si512(wl[n], _mm512_and_si512(_mm512_slli_epi16(hv[n], 4 - u), b4));
            wh[n] = _mm512_or_si512(wh[n], _mm512_and_si512(_mm512_srli_epi16(hv[n], u), b4));
          }
          if constexpr (F == dtn::IQ4_NL || F == dtn::IQ4_XS) {
            wl[n] = _mm512_shuffle_epi8(iq4, wl[n]);
            wh[n] = _mm512_shuffle_epi8(iq4, wh[n]);
          }
        }
        // one level's sums: low nibbles against step u (a), high ones against step u + 4 (b); Q6_K keeps them apart
        auto dots = [&](__m512i a, __m512i b, __m512i(&s)[MR][NR], __m512i(&s2)[MR][NR], int m) {
          for (int n = 0; n < NR; ++n) {
            if constexpr (Q6) {
              s[m][n] = _mm512_dpbusd_epi32(s[m][n], wl[n], a);
              s2[m][n] = _mm512_dpbusd_epi32(s2[m][n], wh[n], b);
            } else {
              s[m][n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[m][n], wl[n], a), wh[n], b);
            }
          }
        };
        for (int m = 0; m < MR; ++m) {
          const int8_t* am = ag + m * rs;
          dots(_mm512_loadu_si512(am + u * 64), _mm512_loadu_si512(am + (u + 4) * 64), is, is2, m);
          if constexpr (LO)
            dots(_mm512_loadu_si512(am + 512 + u * 64), _mm512_loadu_si512(am + 512 + (u + 4) * 64), il, il2, m);
        }
      }
    }
    __m512 dw[NR], mw[NR];  // per block: the scale, and the min
    Q6W512 w6[NR];          // Q6_K's scales
    for (int n = 0; n < NR; ++n) {
      const uint8_t* q = p[n] + G::kblock;  // K-quants: the second super-block
      if constexpr (Q6) {
        w6[n] = q6_weights512(p[n], q);
      } else if constexpr (F == dtn::IQ4_XS) {  // (d sc) level per block
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes_pair(p[n] + 2, q + 2)));
        dw[n] = _mm512_mul_ps(fp16_pair(p[n], q), sc);
        mw[n] = dw[n];
      } else if constexpr (G::kblock != 0) {  // (d sc) u - dmin mn per block
        // [sc | mn] of each super-block in one load: the scales the low halves of both, the mins the high
        const __m128i ha = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[n] + 4));
        const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4));
        __m512 d, mdmin;
        fp16_pairs2(p[n], q, d, mdmin);
        dw[n] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(ha, hb))));
        mw[n] = _mm512_mul_ps(mdmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(ha, hb))));
      } else {
        dw[n] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[n])));
        mw[n] = G::scales == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[n] + 32)))
                               : dw[n];
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 da = _mm512_loadu_ps(a.d + (m0 + m) * a.nsg * 16 + g * 16);
      const __m512 sa = _mm512_loadu_ps(a.s + (m0 + m) * a.nsg * 16 + g * 16);
      if constexpr (Q6) {  // d sc (u - 32) per 16 weights: - 32 meets x's sums of each 16
        __m512 dl, h0, h1;
        q6_act512<LO>(da, a.sh + (m0 + m) * a.nsg * 32 + g * 32, dl, h0, h1);
        for (int n = 0; n < NR; ++n)
          acc[m][n] = q6_row512<LO>(w6[n], da, dl, h0, h1, is[m][n], il[m][n], is2[m][n], il2[m][n], acc[m][n]);
        continue;
      }
      for (int n = 0; n < NR; ++n) {
        const __m512 t = _mm512_mul_ps(LO ? levels512(is[m][n], il[m][n]) : _mm512_cvtepi32_ps(is[m][n]), da);
        if constexpr (G::scales == 2) {  // Q4_1, Q5_1, Q4_K, Q5_K: d u + m
          acc[m][n] = _mm512_fmadd_ps(mw[n], sa, _mm512_fmadd_ps(t, dw[n], acc[m][n]));
        } else {  // d (u + offset): d (da isum + offset sa)
          acc[m][n] = _mm512_fmadd_ps(dw[n], _mm512_fmadd_ps(sa, _mm512_set1_ps(G::offset), t), acc[m][n]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m][n] = _mm512_reduce_add_ps(acc[m][n]) + tail[m][n];
}

template <int F, int MR, int NR, bool LO>
static inline void sg_block512(const QWeight& w, const SGAct& a, int64_t m, int64_t n, const float* pre, int64_t ldp,
                               const void* bias, void* y, int ydt, int64_t ldy) {
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w.qs + (n + j) * w.qs_row;
  float o[MR][NR];
  sg_tile512<F, MR, NR, LO>(rows, a, m, w.K / 32, pre, ldp, o);
  for (int j = 0; j < NR; ++j) {
    const float b = bias ? load_f(bias, ydt, n + j) : 0.f;
    for (int r = 0; r < MR; ++r) store_f(y, ydt, (m + r) * ldy + n + j, o[r][j] + b);
  }
}

// decode (under 4 rows): sg_decode512 (decode_avx512.h)
template <int F, bool LO>
static void sg_decode512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                         void* y, int ydt, int64_t ldy);

// Decode (under 4 rows) goes to sg_decode512; more rows: MR x 2 tiles over panels of the weight (a prompt's rows are as
// many as its tokens: x is reread from L1 by every pair of weight rows of a panel, the panel from L2 by every tile of
// x). A 32-block format's last super-group of under 16 blocks is summed first, for a panel's rows (sg_tails512), and
// each tile adds it.
template <int F, bool LO>
static void sg_tiles512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                        void* y, int ydt, int64_t ldy) {
  constexpr int MR = F == dtn::Q6_K && LO ? 2 : 4;  // Q6_K's four integer sums per tile fill the registers at 4
  constexpr int64_t kPanel = 192 << 10;
  const bool tails = SG<F>::kblock == 0 && (w.K / 32) % 16 != 0;
  if (M < 4) return sg_decode512<F, LO>(w, a, M, n0, n1, bias, y, ydt, ldy);
  // panels of weight rows that stay in L2 (kPanel bytes); in a panel, each MR-row tile of x stays in L1 while the
  // panel's rows pass two at a time (the first tile's pass brings them in, kAhead rows ahead). With tails, that first
  // pass keeps its sums apart, the tails are summed once the panel is in cache, and its rows are written then.
  const int64_t panel = kPanel / w.qs_row >= 4 ? kPanel / w.qs_row / 2 * 2 : 2;
  thread_local std::vector<float> t_pre, t_part;
  if (tails && int64_t(t_pre.size()) < M * panel) t_pre.resize(size_t(M * panel));
  if (tails && int64_t(t_part.size()) < MR * panel) t_part.resize(size_t(MR * panel));
  float* const pre = t_pre.data();
  float* const part = t_part.data();
  for (int64_t nc = n0; nc < n1; nc += panel) {
    const int64_t ne = nc + panel < n1 ? nc + panel : n1, npair = nc + (ne - nc) / 2 * 2, ld = ne - nc;
    auto at = [&](int64_t m, int64_t n) { return tails ? pre + m * ld + (n - nc) : nullptr; };
    int64_t m = 0;
    if (tails) {
      const uint8_t* rows[2];
      for (int64_t n = nc; n < npair; n += 2) {
        if (n + 2 + kAhead <= ne)
          for (int j = 0; j < 2; ++j) prefetch_row(w, n + kAhead + j);
        rows[0] = w.qs + n * w.qs_row;
        rows[1] = rows[0] + w.qs_row;
        float o[MR][2];
        sg_tile512<F, MR, 2, LO>(rows, a, 0, w.K / 32, nullptr, 0, o);
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < 2; ++j) part[r * ld + n - nc + j] = o[r][j];
      }
      sg_tails512<F, LO>(w, a, M, nc, ne, pre, ld);
      store_with_tails(part, pre, ld, MR, nc, npair, bias, y, ydt, ldy);  // (an odd last row: below, with pre)
      m = MR;
    }
    for (; m + MR <= M; m += MR)
      for (int64_t n = nc; n < npair; n += 2) {
        if (m == 0 && n + 2 + kAhead <= ne)
          for (int j = 0; j < 2; ++j) prefetch_row(w, n + kAhead + j);
        sg_block512<F, MR, 2, LO>(w, a, m, n, at(m, n), ld, bias, y, ydt, ldy);
      }
    for (; m < M; ++m)
      for (int64_t n = nc; n < npair; n += 2) sg_block512<F, 1, 2, LO>(w, a, m, n, at(m, n), ld, bias, y, ydt, ldy);
    if (npair < ne)
      for (int64_t r = 0; r < M; ++r) sg_block512<F, 1, 1, LO>(w, a, r, npair, at(r, npair), ld, bias, y, ydt, ldy);
  }
}

template <int F>
static void qgemm_sg512_fmt(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                            void* y, int ydt, int64_t ldy) {
  if (a.levels == 1) return sg_tiles512<F, false>(w, a, M, n0, n1, bias, y, ydt, ldy);
  sg_tiles512<F, true>(w, a, M, n0, n1, bias, y, ydt, ldy);
}

static void qgemm_sg512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                        void* y, int ydt, int64_t ldy) {
  switch (w.fmt) {
    case dtn::Q8_0: return qgemm_sg512_fmt<dtn::Q8_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_0: return qgemm_sg512_fmt<dtn::Q4_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_1: return qgemm_sg512_fmt<dtn::Q4_1>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_K: return qgemm_sg512_fmt<dtn::Q4_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_K: return qgemm_sg512_fmt<dtn::Q5_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q6_K: return qgemm_sg512_fmt<dtn::Q6_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_0: return qgemm_sg512_fmt<dtn::Q5_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_1: return qgemm_sg512_fmt<dtn::Q5_1>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::IQ4_NL: return qgemm_sg512_fmt<dtn::IQ4_NL>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::IQ4_XS: return qgemm_sg512_fmt<dtn::IQ4_XS>(w, a, M, n0, n1, bias, y, ydt, ldy);
  }
}

// -- dequantization in the packed order (Table::dequant; see generic.h): 16 lanes = 4 blocks x 4 bytes per chunk ----

template <int F>
static void dequant_sg512_fmt(const QWeight& w, int64_t n0, int64_t n1, float* out) {
  using G = SG<F>;
  const int64_t nb = w.K / 32;
  const __m512i lo4 = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi32(8);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.qs + n * w.qs_row;
    float* o = out + (n - n0) * w.K;
    for (int64_t g = 0; g * 16 < nb; ++g) {
      const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16), L = 4 * S, C = (L + 15) / 16;
      const uint8_t* p = row + g * 16 * G::bytes;
      const __mmask16 sm = __mmask16((1u << S) - 1);
      const __mmask64 bm = S == 16 ? ~0ull : (1ull << L) - 1;
      const __m512 ds = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, p));
      const __m512 ms = G::scales == 2 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, p + 2 * S)) : ds;
      __m512 d[4], m[4];
      __mmask16 km[4];
      for (int c = 0; c < C; ++c) {  // chunk c: lanes 16 c.. = blocks 4 c + lane / 4
        const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * c),
                                             _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
        d[c] = _mm512_permutexvar_ps(idx, ds);
        m[c] = _mm512_permutexvar_ps(idx, ms);
        km[c] = L - 16 * c >= 16 ? __mmask16(0xffff) : __mmask16((1u << (L - 16 * c)) - 1);
      }
      const uint8_t* q = p + 2 * S * G::scales;
      float* og = o + g * 512;
      for (int u = 0; u < G::qbytes / 4; ++u) {
        const __m512i v = _mm512_maskz_loadu_epi8(bm, q + u * L);
        if constexpr (F == dtn::Q8_0) {
          const __m512i sv = _mm512_xor_si512(v, _mm512_set1_epi8(char(0x80)));
          alignas(64) int8_t b[64];
          _mm512_store_si512(b, sv);
          for (int c = 0; c < C; ++c) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(b + 16 * c))));
            _mm512_mask_storeu_ps(og + u * L + 16 * c, km[c], _mm512_mul_ps(d[c], f));
          }
        } else {
          alignas(64) uint8_t b[2][64];
          _mm512_store_si512(b[0], _mm512_and_si512(v, lo4));
          _mm512_store_si512(b[1], _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
          for (int h = 0; h < 2; ++h)
            for (int c = 0; c < C; ++c) {
              __m512i i = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(b[h] + 16 * c)));
              __m512 f;
              if constexpr (F == dtn::Q4_0) {
                f = _mm512_mul_ps(d[c], _mm512_cvtepi32_ps(_mm512_sub_epi32(i, eight)));
              } else {
                f = _mm512_add_ps(_mm512_mul_ps(d[c], _mm512_cvtepi32_ps(i)), m[c]);
              }
              _mm512_mask_storeu_ps(og + (u + 4 * h) * L + 16 * c, km[c], f);
            }
        }
      }
    }
  }
}

static void dequant512(const QWeight& w, int64_t n0, int64_t n1, float* out) {
  switch (w.fmt) {
    case dtn::Q8_0: return dequant_sg512_fmt<dtn::Q8_0>(w, n0, n1, out);
    case dtn::Q4_0: return dequant_sg512_fmt<dtn::Q4_0>(w, n0, n1, out);
    case dtn::Q4_1: return dequant_sg512_fmt<dtn::Q4_1>(w, n0, n1, out);
  }
  dequant(w, n0, n1, out);  // the others: generic.h
}

