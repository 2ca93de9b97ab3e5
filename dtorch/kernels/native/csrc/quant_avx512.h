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
  // the rows two groups on, fetched while these stream: a cold [1024, 1024] bf16 weight reads at ~22 GB/s on 2
  // cores instead of ~15 (the hardware prefetcher restarts at each group); a prefetch past the end does not fault
  const char* ahead = static_cast<const char*>(w) + (n + 2 * NR) * K * esz;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    const __m512 xv = load16(x, xdt, m * K + k, mk);
    for (int j = 0; j < NR; ++j) _mm_prefetch(ahead + (j * K + k) * esz, _MM_HINT_T0);
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

// two super-blocks side by side: the fp16 at a in lanes 0..7 and the one at b in lanes 8..15
static inline __m512 fp16_pair(const uint8_t* a, const uint8_t* b) {
  uint16_t x, y;
  std::memcpy(&x, a, 2);
  std::memcpy(&y, b, 2);
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(_cvtsh_ss(x)))),
                                             _mm256_castps_pd(_mm256_set1_ps(_cvtsh_ss(y))), 1));
}

// and 8 bytes of each (a super-block's per-block scales): 16 bytes
static inline __m128i bytes_pair(const uint8_t* a, const uint8_t* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}

template <int F, int MR, int NR, bool LO>
static inline void sg_tail512(const uint8_t* const* p, const int8_t* ag, int64_t rs, const float* ad, const float* as,
                              int64_t ars, int S, __m512 (&acc)[MR][NR]) {
  using G = SG<F>;
  const __m512i lo4 = _mm512_set1_epi8(0x0f), bit0 = _mm512_set1_epi32(0x01010101);
  const __m512i iq4 = iq4_table512();
  const int P = sg_period(S), T = (F == dtn::Q8_0 ? 8 : 4) * P;  // T: dword lanes of weights in all
  const int nch = (T + 15) / 16, per = 16 / P * S;                 // vectors; weight dwords per whole vector
  const int lgp = __builtin_ctz(unsigned(P));
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx = _mm512_and_si512(iota, _mm512_set1_epi32(P - 1));
  const __mmask16 pat = _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(S));
  const __mmask16 sm = __mmask16((1u << S) - 1);
  const int64_t qoff = 2 * S * G::scales + S * G::hbytes;
  __m512i hv[NR];  // Q5: each block's high-bit dword in its lanes (lane l: block l % P)
  if constexpr (G::hbytes != 0)
    for (int n = 0; n < NR; ++n)
      hv[n] = _mm512_permutexvar_epi32(idx, _mm512_maskz_loadu_epi32(sm, p[n] + 2 * S * G::scales));
  __m512i is[MR][NR], il[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) is[m][n] = il[m][n] = _mm512_setzero_si512();
  for (int c = 0; c < nch; ++c) {
    const __mmask16 km = __mmask16(pat & (T - 16 * c >= 16 ? 0xffffu : (1u << (T - 16 * c)) - 1));
    const int cnt = __builtin_popcount(unsigned(km));
    const __mmask16 lm = __mmask16(cnt == 16 ? 0xffffu : (1u << cnt) - 1);
    __m512i wv[NR];
    for (int n = 0; n < NR; ++n) {
      wv[n] = _mm512_maskz_loadu_epi32(lm, p[n] + qoff + int64_t(c) * per * 4);
      if (S != P) wv[n] = _mm512_maskz_expand_epi32(km, wv[n]);
    }
    if constexpr (F == dtn::Q8_0) {
      for (int m = 0; m < MR; ++m) {
        const __m512i av = _mm512_loadu_si512(ag + m * rs + 64 * c);
        for (int n = 0; n < NR; ++n) is[m][n] = _mm512_dpbusd_epi32(is[m][n], wv[n], av);
        if constexpr (LO) {
          const __m512i lv = _mm512_loadu_si512(ag + m * rs + 512 + 64 * c);
          for (int n = 0; n < NR; ++n) il[m][n] = _mm512_dpbusd_epi32(il[m][n], wv[n], lv);
        }
      }
    } else {
      __m512i wl[NR], wh[NR];
      // lane l holds step (16 c + l) / P (< 4): Q5's fifth bits are bit u (low nibble) and 4 + u (high) of each byte
      const __m512i step = _mm512_srlv_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32(16 * c)), _mm512_set1_epi32(lgp));
      for (int n = 0; n < NR; ++n) {
        wl[n] = _mm512_and_si512(wv[n], lo4);
        wh[n] = _mm512_and_si512(_mm512_srli_epi16(wv[n], 4), lo4);
        if constexpr (G::hbytes != 0) {  // lanes outside km hold no weight (their activations may be another step's)
          const __m512i bl = _mm512_maskz_and_epi32(km, _mm512_srlv_epi32(hv[n], step), bit0);
          const __m512i bh = _mm512_maskz_and_epi32(
              km, _mm512_srlv_epi32(hv[n], _mm512_add_epi32(step, _mm512_set1_epi32(4))), bit0);
          wl[n] = _mm512_or_si512(wl[n], _mm512_slli_epi32(bl, 4));
          wh[n] = _mm512_or_si512(wh[n], _mm512_slli_epi32(bh, 4));
        }
        if constexpr (F == dtn::IQ4_NL) {  // and lanes outside km stay zero, not the level of index 0
          wl[n] = _mm512_maskz_mov_epi32(km, _mm512_shuffle_epi8(iq4, wl[n]));
          wh[n] = _mm512_maskz_mov_epi32(km, _mm512_shuffle_epi8(iq4, wh[n]));
        }
      }
      for (int m = 0; m < MR; ++m) {  // a low nibble meets step u, a high one step u + 4 (16 P bytes on)
        const int8_t* am = ag + m * rs + 64 * c;
        const __m512i al = _mm512_loadu_si512(am), ah = _mm512_loadu_si512(am + 16 * P);
        for (int n = 0; n < NR; ++n)
          is[m][n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(is[m][n], wl[n], al), wh[n], ah);
        if constexpr (LO) {
          const __m512i ll = _mm512_loadu_si512(am + 512), lh = _mm512_loadu_si512(am + 512 + 16 * P);
          for (int n = 0; n < NR; ++n)
            il[m][n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(il[m][n], wl[n], ll), wh[n], lh);
        }
      }
    }
  }
  __m512 dwr[NR], mw[NR];
  for (int n = 0; n < NR; ++n) {
    const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, p[n]));
    dwr[n] = _mm512_permutexvar_ps(idx, dw);
    mw[n] = G::scales == 2 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(sm, p[n] + 2 * S))
                           : _mm512_mul_ps(dw, _mm512_set1_ps(G::offset));
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 dar = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(ad + m * ars));
    const __m512 sa = _mm512_loadu_ps(as + m * ars);
    for (int n = 0; n < NR; ++n) {
      const __m512 t = LO ? levels512(is[m][n], il[m][n]) : _mm512_cvtepi32_ps(is[m][n]);
      acc[m][n] = _mm512_fmadd_ps(_mm512_mul_ps(t, dar), dwr[n], acc[m][n]);
      if (G::scales == 2 || G::offset != 0.f) acc[m][n] = _mm512_fmadd_ps(mw[n], sa, acc[m][n]);
    }
  }
}

// Every super-grouped format (SG in generic.h) on whole super-groups: per step u, one 64-byte vector of each weight
// row (a K-quant's two super-blocks side by side) meets a 64-byte load of each activation row in vpdpbusd, the
// quants unsigned (Q8_0 stored as q + 128, IQ4_NL and IQ4_XS as their level + 128; their offsets meet SGAct's
// sums). A last super-group of S < 16 blocks: sg_tail512 for the 32-block formats, else (a K-quant's lone
// super-block) quant_avx2.h's tile on the activations from that group on. LO: both activation levels.
static inline __m512i two_halves(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

template <int F, int MR, int NR, bool LO>
static inline void sg_tile512(const uint8_t* const* rows, const SGAct& a, int64_t m0, int64_t nb,
                              float (&out)[MR][NR]) {
  using G = SG<F>;
  constexpr bool Q6 = F == dtn::Q6_K;
  const __m512i lo4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10), b45 = _mm512_set1_epi8(0x30);
  const __m512i iq4 = iq4_table512();
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  float tail[MR][NR] = {};  // a K-quant row's lone last super-block (the AVX2 tile's sums)
  const int64_t rs = a.nsg * 1024;
  const int64_t gbytes = G::kblock ? 2 * G::kblock : 16 * G::bytes;  // a super-group's bytes in a weight row
  for (int64_t g = 0; g * 16 < nb; ++g) {
    const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16);
    const uint8_t* p[NR];
    for (int n = 0; n < NR; ++n) p[n] = rows[n] + g * gbytes;
    const int8_t* ag = a.q + m0 * rs + g * 1024;  // hi levels, then lo at + 512
    if (S < 16) {
      if constexpr (G::kblock == 0) {
        sg_tail512<F, MR, NR, LO>(p, ag, rs, a.d + m0 * a.nsg * 16 + g * 16, a.s + m0 * a.nsg * 16 + g * 16,
                              a.nsg * 16, S, acc);
      } else {
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
    if constexpr (F == dtn::Q8_0) {
      for (int u = 0; u < 8; ++u) {
        __m512i wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = _mm512_loadu_si512(p[n] + qoff + 64 * u);
        for (int m = 0; m < MR; ++m) {
          const __m512i av = _mm512_loadu_si512(ag + m * rs + u * 64);
          for (int n = 0; n < NR; ++n) is[m][n] = _mm512_dpbusd_epi32(is[m][n], wv[n], av);
          if constexpr (LO) {
            const __m512i lv = _mm512_loadu_si512(ag + m * rs + 512 + u * 64);
            for (int n = 0; n < NR; ++n) il[m][n] = _mm512_dpbusd_epi32(il[m][n], wv[n], lv);
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
    __m512 dw[NR], mw[NR];  // per block: the scale, and the min (Q6_K: the second 16 weights' scale)
    for (int n = 0; n < NR; ++n) {
      const uint8_t* q = p[n] + G::kblock;  // K-quants: the second super-block
      if constexpr (Q6) {  // d sc per 16 weights: dw the first 16 weights' (sc[2 j]), mw the second's
        const __m128i ev = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const __m128i s0 = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[n] + 2)), ev);
        const __m128i s1 = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 2)), ev);
        const __m512 d = fp16_pair(p[n], q);
        dw[n] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(s0, s1))));
        mw[n] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(s0, s1))));
      } else if constexpr (F == dtn::IQ4_XS) {  // (d sc) level per block
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes_pair(p[n] + 2, q + 2)));
        dw[n] = _mm512_mul_ps(fp16_pair(p[n], q), sc);
        mw[n] = dw[n];
      } else if constexpr (G::kblock != 0) {  // (d sc) u - dmin mn per block
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes_pair(p[n] + 4, q + 4)));
        dw[n] = _mm512_mul_ps(fp16_pair(p[n], q), sc);
        mw[n] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), fp16_pair(p[n] + 2, q + 2)),
                              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes_pair(p[n] + 12, q + 12))));
      } else {
        dw[n] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[n])));
        mw[n] = G::scales == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[n] + 32)))
                               : dw[n];
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 da = _mm512_loadu_ps(a.d + (m0 + m) * a.nsg * 16 + g * 16);
      const __m512 sa = _mm512_loadu_ps(a.s + (m0 + m) * a.nsg * 16 + g * 16);
      for (int n = 0; n < NR; ++n) {
        const __m512 t = _mm512_mul_ps(LO ? levels512(is[m][n], il[m][n]) : _mm512_cvtepi32_ps(is[m][n]), da);
        if constexpr (Q6) {  // (d sc) (u - 32) per 16 weights: - 32 meets the sums of each 16
          const float* hs = a.sh + (m0 + m) * a.nsg * 32 + g * 32;
          const __m512 t2 = _mm512_mul_ps(LO ? levels512(is2[m][n], il2[m][n]) : _mm512_cvtepi32_ps(is2[m][n]), da);
          const __m512 k32 = _mm512_set1_ps(-32.f);
          const __m512 lo_ = _mm512_fmadd_ps(_mm512_loadu_ps(hs), k32, t);
          const __m512 hi_ = _mm512_fmadd_ps(_mm512_loadu_ps(hs + 16), k32, t2);
          acc[m][n] = _mm512_fmadd_ps(hi_, mw[n], _mm512_fmadd_ps(lo_, dw[n], acc[m][n]));
        } else if constexpr (G::scales == 2) {  // Q4_1, Q5_1, Q4_K, Q5_K: d u + m
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
static inline void sg_block512(const QWeight& w, const SGAct& a, int64_t m, int64_t n, const void* bias, void* y,
                               int ydt, int64_t ldy) {
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w.qs + (n + j) * w.qs_row;
  float o[MR][NR];
  sg_tile512<F, MR, NR, LO>(rows, a, m, w.K / 32, o);
  for (int j = 0; j < NR; ++j) {
    const float b = bias ? load_f(bias, ydt, n + j) : 0.f;
    for (int r = 0; r < MR; ++r) store_f(y, ydt, (m + r) * ldy + n + j, o[r][j] + b);
  }
}

// decode (under 4 rows): 1 x 4 tiles, 4 weight rows sharing each activation load, the rows kAhead on prefetched;
// more rows: MR x 2 tiles over panels of the weight (a prompt's rows are as many as its tokens: x is reread from
// L1 by every pair of weight rows of a panel, the panel from L2 by every tile of x)
template <int F, bool LO>
static void sg_tiles512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                        void* y, int ydt, int64_t ldy) {
  constexpr int NR = F == dtn::Q6_K && LO ? 2 : 4;  // Q6_K's four integer sums per tile fill the registers at 4
  constexpr int MR = F == dtn::Q6_K && LO ? 2 : 4;
  constexpr int64_t kPanel = 192 << 10;
  if (M < 4) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
      if (n + NR + kAhead <= n1)
        for (int j = 0; j < NR; ++j) prefetch_row(w, n + kAhead + j);
      for (int64_t m = 0; m < M; ++m) sg_block512<F, 1, NR, LO>(w, a, m, n, bias, y, ydt, ldy);
    }
    for (; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) sg_block512<F, 1, 1, LO>(w, a, m, n, bias, y, ydt, ldy);
    return;
  }
  // panels of weight rows that stay in L2 (kPanel bytes); in a panel, each MR-row tile of x stays in L1 while the
  // panel's rows pass two at a time (the first tile's pass brings them in, kAhead rows ahead)
  const int64_t panel = kPanel / w.qs_row >= 4 ? kPanel / w.qs_row / 2 * 2 : 2;
  for (int64_t nc = n0; nc < n1; nc += panel) {
    const int64_t ne = nc + panel < n1 ? nc + panel : n1, npair = nc + (ne - nc) / 2 * 2;
    int64_t m = 0;
    for (; m + MR <= M; m += MR)
      for (int64_t n = nc; n < npair; n += 2) {
        if (m == 0 && n + 2 + kAhead <= ne)
          for (int j = 0; j < 2; ++j) prefetch_row(w, n + kAhead + j);
        sg_block512<F, MR, 2, LO>(w, a, m, n, bias, y, ydt, ldy);
      }
    for (; m < M; ++m)
      for (int64_t n = nc; n < npair; n += 2) sg_block512<F, 1, 2, LO>(w, a, m, n, bias, y, ydt, ldy);
    if (npair < ne)
      for (int64_t r = 0; r < M; ++r) sg_block512<F, 1, 1, LO>(w, a, r, npair, bias, y, ydt, ldy);
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

