// Quantized products with AVX2: a group of 128 weights is worked as two pairs of sub-blocks (32 bytes of each
// half); vpmaddubsw + vpmaddwd give 8 int32 lanes, lanes 4j..4j+3 summing sub-block 2p + j (Q2_K, Q3_K: QAct).
// The super-grouped formats (SGAct, at the end): one lane per block.
// Included inside namespace DTN_ISA of isa_avx2.cpp.

struct Row256 {
  const uint8_t* qs;
  const uint16_t* d;
  const uint8_t* aux;
  int64_t nb, nsup;
};

struct Dec256 {
  __m256i wl[2], wh[2];  // per pair p: quants of the L and H halves of sub-blocks 2p, 2p + 1
  __m128 dl, dh;         // scale per sub-block, per half
  __m256 m;              // offsets [L s0..s3, H s0..s3] (unused for Q8_0)
};

template <int F> struct Fmt256;

// -- the group formats (group_formats.py)

static inline __m256i bits_to_bytes(uint32_t bits) {  // byte i = 0xff where bit i is set
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
  const __m256i bm = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf), bm), bm);
}

// OR bit `value` of each quant from a "bit" plane at p (L bits, then H bits, 8 bytes each)
static inline void plane_bit256(const uint8_t* p, uint8_t value, Dec256& o) {
  uint64_t lb, hb;
  std::memcpy(&lb, p, 8);
  std::memcpy(&hb, p + 8, 8);
  const __m256i v = _mm256_set1_epi8(char(value));
  for (int pp = 0; pp < 2; ++pp) {
    o.wl[pp] = _mm256_or_si256(o.wl[pp], _mm256_and_si256(bits_to_bytes(uint32_t(lb >> (32 * pp))), v));
    o.wh[pp] = _mm256_or_si256(o.wh[pp], _mm256_and_si256(bits_to_bytes(uint32_t(hb >> (32 * pp))), v));
  }
}

// the 2-bit plane of a whole group (as Q6_K's high bits): bits 2p, 2p + 1 of byte i: L of pair p, 4 + 2p: H
static inline void plane_two256(const uint8_t* p, Dec256& o) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), three = _mm256_set1_epi8(3);
  for (int pp = 0; pp < 2; ++pp) {
    o.wl[pp] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * pp), three);
    o.wh[pp] = _mm256_and_si256(_mm256_srli_epi16(q, 4 + 2 * pp), three);
  }
}

static inline __m256i iq4_table256() {  // IQ4 indices -> signed levels through vpshufb
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dtn::kIq4Levels)));
}

static inline __m256 int8x8_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <> struct Fmt256<dtn::Q3_K> {  // (d sc) (u - 4), a signed scale per 16 weights
  static constexpr bool split = true, has_m = true, sgn = false;
  static inline void decode(const Row256& r, int64_t g, int, Dec256& o) {
    const uint8_t* p = r.qs + g * 48;
    plane_two256(p, o);
    plane_bit256(p + 32, 4, o);
    const __m256 d = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(r.d[g >> 1])), int8x8_ps(r.aux + g * 8));
    o.dl = _mm256_castps256_ps128(d);
    o.dh = _mm256_extractf128_ps(d, 1);
    o.m = _mm256_mul_ps(d, _mm256_set1_ps(-4.f));
  }
};

template <> struct Fmt256<dtn::Q2_K> {  // (d sc) u - dmin mn, sc | mn << 4 per 16 weights
  static constexpr bool split = true, has_m = true, sgn = false;
  static inline void decode(const Row256& r, int64_t g, int, Dec256& o) {
    plane_two256(r.qs + g * 32, o);
    const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.aux + g * 8));
    const __m128i lo4 = _mm_set1_epi8(15);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(a, lo4)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(a, 4), lo4)));
    const __m256 d = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(r.d[g >> 1])), sc);
    o.dl = _mm256_castps256_ps128(d);
    o.dh = _mm256_extractf128_ps(d, 1);
    o.m = _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(r.d[r.nsup + (g >> 1)])), mn);
  }
};

static inline __m256 pair_scale(__m128 d4, int pp) {  // lanes [d[2p] x4, d[2p+1] x4]
  const __m256i idx = pp == 0 ? _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0) : _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), idx);
}

static inline __m256i dot_u8s8(__m256i w, __m256i a) {  // 8 int32 lanes, each the sum of 4 products
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}

// the same for weights of either sign: |w| (at most 127) times a with w's sign, so no int16 pair sum saturates
template <bool SGN>
static inline __m256i dot_w(__m256i w, __m256i a) {
  if constexpr (SGN) return dot_u8s8(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
  return dot_u8s8(w, a);
}

// the two activation levels' integer sums as one float: hi + lo / 254 (as the portable kernels round it)
static inline __m256 levels256(__m256i hi, __m256i lo) {
  return _mm256_add_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(1.f / 254.f)));
}

static inline float hsum256_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// hsum256_avx2 of 8 vectors at once, each by the same additions in the same order (so the same bits): out[j] = the
// sum of v[j]'s lanes, ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)); 23 instructions where 8 hsum256_avx2 take 48, and
// no row's sum is a chain of dependent additions at the end of its row
static inline void hsum8_avx2(const __m256* v, float* out) {
  __m256 s[4];  // rows 2 i and 2 i + 1: [lo + hi of the first | of the second]
  for (int i = 0; i < 4; ++i)
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  __m256 u[2];  // [(0 + 2) (1 + 3) of rows 4 i, 4 i + 2 | of rows 4 i + 1, 4 i + 3]
  for (int i = 0; i < 2; ++i)
    u[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], 0xee));
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xdd));
  // r: rows [0 2 4 6 | 1 3 5 7]
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// hi and lo levels' int16 pair sums -> 8 int32 lanes of 254 hi + lo, lanes 4j..4j+3 summing the first or second
// 16-byte half of each 128-bit lane (as vpmaddwd with ones would, by sub-block); one conversion instead of two
static inline __m256i levels_i32(__m256i hi16, __m256i lo16) {
  const __m256i k = _mm256_set1_epi32((1 << 16) | 254);
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi16(hi16, lo16), k),
                          _mm256_madd_epi16(_mm256_unpackhi_epi16(hi16, lo16), k));
}

template <bool SGN>
static inline __m256i pairs16(__m256i w, __m256i a) {  // vpmaddubsw, with the sign trick for signed weights
  if constexpr (SGN) return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
  return _mm256_maddubs_epi16(w, a);
}

// MR activation rows m0.. against one weight row: each group is decoded once and used MR times. The integer sums
// are 254 hi + lo (levels_i32), so the sum is scaled by 1 / 254 once at the end.
template <int F, int MR>
static inline void qdot256(const Row256& row, const QAct& a, int64_t m0, float* out) {
  using W = Fmt256<F>;
  const int64_t ng = a.ng;
  __m256 acc[MR], accm[MR];
  for (int r = 0; r < MR; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const int gs = int(row.nb - g * 4 < 4 ? row.nb - g * 4 : 4);
    Dec256 w;
    W::decode(row, g, gs, w);
    for (int pp = 0; pp * 2 < gs; ++pp) {
      const __m256 dl = pair_scale(w.dl, pp), dh = W::split ? pair_scale(w.dh, pp) : dl;
      for (int r = 0; r < MR; ++r) {
        const int8_t* aq = a.q + (m0 + r) * ng * 256 + g * 256;  // zero padded: whole 32-byte loads are safe
        const int8_t* lq = aq + 128;                              // the lo levels
        const __m256i al = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + 32 * pp));
        const __m256i ah = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + 16 * gs + 32 * pp));
        const __m256i ll = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lq + 32 * pp));
        const __m256i lh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lq + 16 * gs + 32 * pp));
        const __m256 dr = _mm256_loadu_ps(a.darep + (m0 + r) * ng * 16 + g * 16 + 8 * pp);
        if constexpr (W::split) {  // each int16 at most 2 * 127 * 127
          const __m256i il = levels_i32(pairs16<W::sgn>(w.wl[pp], al), pairs16<W::sgn>(w.wl[pp], ll));
          const __m256i ih = levels_i32(pairs16<W::sgn>(w.wh[pp], ah), pairs16<W::sgn>(w.wh[pp], lh));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_mul_ps(dl, dr), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_mul_ps(dh, dr), acc[r]);
        } else {  // 4 or 5 bits: each int16 pair sum is at most 2 * 31 * 127, so L + H cannot overflow
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(w.wl[pp], al), _mm256_maddubs_epi16(w.wh[pp], ah));
          const __m256i l16 = _mm256_add_epi16(_mm256_maddubs_epi16(w.wl[pp], ll), _mm256_maddubs_epi16(w.wh[pp], lh));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(levels_i32(p16, l16)), _mm256_mul_ps(dl, dr), acc[r]);
        }
      }
    }
    if constexpr (W::has_m)
      for (int r = 0; r < MR; ++r)
        accm[r] = _mm256_fmadd_ps(w.m, _mm256_loadu_ps(a.asum + (m0 + r) * ng * 8 + g * 8), accm[r]);
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum256_avx2(acc[r]) * (1.f / 254.f) + hsum256_avx2(accm[r]);
}

template <int F>
static void qgemm256_fmt(const QWeight& w, const QAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias, void* y,
                         int ydt, int64_t ldy) {
  float o[4];
  for (int64_t n = n0; n < n1; ++n) {
    const Row256 row{w.qs + n * w.qs_row, w.d + n * w.d_row, w.aux + n * w.aux_row, w.K / 32, w.K / 256};
    if (n + kAhead < n1) prefetch_row(w, n + kAhead);
    const float b = bias ? load_f(bias, ydt, n) : 0.f;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      qdot256<F, 4>(row, a, m, o);
      for (int r = 0; r < 4; ++r) store_f(y, ydt, (m + r) * ldy + n, o[r] + b);
    }
    for (; m < M; ++m) {
      qdot256<F, 1>(row, a, m, o);
      store_f(y, ydt, m * ldy + n, o[0] + b);
    }
  }
}

static void qgemm256(const QWeight& w, const QAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias, void* y,
                     int ydt, int64_t ldy) {
  switch (w.fmt) {
    case dtn::Q2_K: return qgemm256_fmt<dtn::Q2_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q3_K: return qgemm256_fmt<dtn::Q3_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
  }
}

// -- float32 / bf16 weights ------------------------------------------------------------------------------

static inline __m256 load8(const void* p, int dt, int64_t i) {
  if (dt == F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  if (dt == dtn::F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int NR>
static inline void fdot256(const void* x, int xdt, int64_t m, const void* w, int wdt, int64_t K, int64_t n,
                           void* y, int ydt, int64_t ldy) {
  __m256 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t esz = wdt == F32 ? 4 : 2;
  const char* ahead = static_cast<const char*>(w) + (n + 2 * NR) * K * esz;  // as fdot512: the rows two groups on (L2)
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = load8(x, xdt, m * K + k);
    for (int j = 0; j < NR; ++j) _mm_prefetch(ahead + (j * K + k) * esz, _MM_HINT_T1);
    for (int j = 0; j < NR; ++j) acc[j] = _mm256_fmadd_ps(load8(w, wdt, (n + j) * K + k), xv, acc[j]);
  }
  for (int j = 0; j < NR; ++j) {
    float s = hsum256_avx2(acc[j]);
    for (int64_t t = k; t < K; ++t) s += load_f(x, xdt, m * K + t) * load_f(w, wdt, (n + j) * K + t);
    store_f(y, ydt, m * ldy + n + j, s);
  }
}

static void gemv256(const void* x, int xdt, int64_t M, const void* w, int wdt, int64_t K, int64_t n0, int64_t n1,
                    void* y, int ydt, int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    for (int64_t m = 0; m < M; ++m) fdot256<4>(x, xdt, m, w, wdt, K, n, y, ydt, ldy);
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) fdot256<1>(x, xdt, m, w, wdt, K, n, y, ydt, ldy);
}

// -- 32-block formats in super-groups (SGAct): two 8-lane halves per super-group, lane j = block 8 h + j -------
// Q8_0 is stored as q + 128; vpmaddubsw would saturate on it, so it is flipped back and multiplied with the sign
// trick (|w| times sign(a, w)), which needs no offset term.

static inline __m256i lanes_mask(int cnt) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 u8x8_ps(const uint8_t* p) {  // 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

static inline __m256 load_h8(const uint8_t* p, int cnt = 8) {  // cnt fp16 -> float32, zeros after
  if (cnt == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint16_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::memcpy(h, p, size_t(cnt) * 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

static inline __m256i load_i8(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

struct StepLevels { __m256i al, ah, ll, lh; };  // hi levels of steps u and u + 4, then their lo levels

static inline StepLevels step_levels(const int8_t* am, int u, int64_t st) {
  auto at = [&](int64_t off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(am + off)); };
  return {at(u * st), at((u + 4) * st), at(512 + u * st), at(512 + (u + 4) * st)};
}

// Q8_0 against both levels of x: x as one int16 per value, 254 hi + lo (at most 254 * 127 + 127 = 32385), so one
// vpmaddwd sums both levels where they took two vpmaddubsw, two vpmaddwd and their sign tricks. The weights are read
// as stored (q + 128, widened by vpmovzxbw); corr takes the 128 back, exactly in int32. A row's last super-group of
// under 16 blocks is summed in the row too (masked loads), not by sg_tails256: its 8-row transposes cost as much as
// the products. One-row products, one thread, a 2-core AVX2 VM without AVX-512 (busy: load 5-9), alternating runs
// against the same process's plain read, 2-4 rounds: Q8_0 [151936, 896] 0.16-0.23 -> 0.47-0.73 of the read,
// [262144, 640] 0.23-0.29 -> 0.31-0.48, [4864, 896] 0.16-0.31 -> 0.33-0.79, [896, 4864] 0.20-0.27 -> 0.32-0.62,
// [2048, 8192] 0.19-0.41 -> 0.40-0.73 (the two levels' integer work was the bound: 1.5-2.5x the speed). x is laid out
// as vpunpck{l,h}bw widen a step's 32 bytes (no vpmovzxbw per 16 bytes, no vpermd after each half's hadd): hot-cache
// one-row products at K = 2048-4864 4-5.6 -> 6.4-7.7 GB/s, decode (1 thread) Qwen2.5-0.5B Q8_0 7.1 -> 8.2 tok/s,
// Gemma3-270M 12.8 -> 14.8 (same VM, load 4-5, alternating runs).
struct X16Act {
  const int16_t* q;     // row r: q + r * nsg * 512, super-group g at g * 512: step u, half h at 64 u + 32 h, its
                        // blocks' 4 values in the order [0 1 4 5 2 3 6 7] (as vpunpck{l,h}bw take a step's weights);
                        // a last super-group's half of 1-4 blocks in order (vpmovzxbw of 16 bytes)
  const int32_t* corr;  // row r: corr + r * nsg * 16 + 16 g + j: 128 * the sum of block 16 g + j's values
  const float* dk;      // as corr: the block's scale d / 254 (one multiply a call, not one per weight row)
  int64_t nsg;          // super-groups a row, as SGAct's
};

// rows 0..M-1 of a (both levels, nb blocks a row) as X16Act in q [M * a.nsg * 512], corr, dk [M * a.nsg * 16]; a last
// super-group of S < 16 blocks (a's at its period P: step u of block j at 4 (u P + j)) at the whole groups' period,
// zeros for blocks S..15. Per step and half: the 8 blocks' 4 hi and lo bytes (32 each, blocks past S masked to 0)
// widened as the weights are (vpunpck{l,h}bw, or in order for a half of 1-4 blocks), 254 hi + lo; corr from the
// int16 pair sums (vpmaddwd with ones) of the 8 steps, one hadd a half. The same integers as the scalar loop it
// replaced, which cost 2.3 us at K = 896 and 12 us at K = 4864 a call on this Zen VM (now ~0.2 and ~1).
static X16Act x16_levels(const SGAct& a, int64_t M, int64_t nb, int16_t* q, int32_t* corr, float* dk, bool pairs) {
  const int64_t nsg = a.nsg;
  for (int64_t i = 0; i < M * nsg * 16; i += 8)  // (a's padding lanes are zeros)
    _mm256_storeu_ps(dk + i, _mm256_mul_ps(_mm256_loadu_ps(a.d + i), _mm256_set1_ps(1.f / 254.f)));
  const __m256i k254 = _mm256_set1_epi16(254), ones = _mm256_set1_epi16(1), z = _mm256_setzero_si256();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < nsg; ++g) {
      const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16), P = sg_period(S);
      const int8_t* hi = a.q + (m * nsg + g) * 1024;
      int16_t* o = q + (m * nsg + g) * 512;
      int32_t* c = corr + (m * nsg + g) * 16;
      for (int h = 0; h < 2; ++h) {
        const int cnt = S - 8 * h < 8 ? S - 8 * h : 8;
        if (cnt <= 0) {
          for (int u = 0; u < 8; ++u) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64 * u + 32 * h), z);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64 * u + 32 * h + 16), z);
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 8 * h), z);
          continue;
        }
        const __m256i lm = lanes_mask(cnt);
        __m256i s0 = z, s1 = z;  // int32 pair sums of x16 over the steps, as the two vectors lay them out
        for (int u = 0; u < 8; ++u) {
          const int64_t at = 4 * (int64_t(u) * P + 8 * h);  // (< 512 - 32 for every P: the loads stay in the level)
          const __m256i hv = _mm256_and_si256(load_i8(hi + at), lm), lv = _mm256_and_si256(load_i8(hi + 512 + at), lm);
          __m256i x0, x1;
          if (cnt > 4) {  // blocks [0 1 | 4 5] and [2 3 | 6 7], as vpunpck{l,h}bw take the weights
            x0 = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_srai_epi16(_mm256_unpacklo_epi8(hv, hv), 8), k254),
                                  _mm256_srai_epi16(_mm256_unpacklo_epi8(lv, lv), 8));
            x1 = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_srai_epi16(_mm256_unpackhi_epi8(hv, hv), 8), k254),
                                  _mm256_srai_epi16(_mm256_unpackhi_epi8(lv, lv), 8));
          } else {  // blocks 0-3 in order (vpmovzxbw of 16 bytes), 4-7 zero
            x0 = _mm256_add_epi16(_mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(hv)), k254),
                                  _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lv)));
            x1 = z;
          }
          if (pairs && S == 4) {  // steps 2 j, 2 j + 1 side by side at 128 j: blocks 0-1 of both, then 2-3 of both
            int16_t* op = o + 64 * (u & ~1) + 8 * (u & 1);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(op), _mm256_castsi256_si128(x0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(op + 16), _mm256_extracti128_si256(x0, 1));
          } else {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64 * u + 32 * h), x0);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64 * u + 32 * h + 16), x1);
          }
          s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(x0, ones));
          s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(x1, ones));
        }
        // unpack order: s0 [0 0 1 1 | 4 4 5 5], s1 [2 2 3 3 | 6 6 7 7] -> hadd [0 1 2 3 | 4 5 6 7]; in order: s0
        // [0 0 1 1 | 2 2 3 3] -> hadd [0 1 - - | 2 3 - -]
        __m256i sum = _mm256_hadd_epi32(s0, s1);
        if (cnt <= 4) sum = _mm256_permutevar8x32_epi32(sum, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 8 * h), _mm256_slli_epi32(sum, 7));
      }
    }
  return {q, corr, dk, nsg};
}

// ahead > 0: as each super-group is read, each row's bytes that far on are asked for (the stream of long rows,
// sg_tiles256); xw: Q8_0's both levels as int16 (LO)
template <int F, int MR, int NR, bool LO>
static inline void sg_tile256(const uint8_t* const* rows, const SGAct& a, int64_t m0, int64_t nb,
                              float (&out)[MR][NR], int64_t ahead = 0, const X16Act* xw = nullptr) {
  using G = SG<F>;
  const __m256i lo4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  const __m256i b4 = _mm256_set1_epi8(0x10), iq4 = iq4_table256();
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t rs = a.nsg * 1024;
  // Q4_K, Q5_K against both levels: a block's int16 pair sums are widened by vpmaddwd with 254 sc (hi levels) and sc
  // (lo) into one int32 lane, sc (254 hi + lo), where each level was widened with ones and the epilogue converted both
  // and scaled by d sc as floats (the scales are 6-bit, at most 63, as layouts.py unpacks them). Bounds: a run's int16
  // at most 2 * 2 * 2 * 31 * 127 (Q5_K, 2 steps) or 4 * 2 * 2 * 15 * 127 (Q4_K, 4), so a lane at most 2 runs * 2 *
  // 31496 * 63 * 255 (2.02e9 < 2^31; Q4_K's one run 0.98e9). Hot one-row tiles on this Zen 1 (2 cores, load 5-6, same
  // process A/B): Q4_K 65 -> 61 cycles per 256 weights, Q5_K 74-77 -> 76; cold Q4_K [2048, 8192] 5.58 -> 5.81 GB/s.
  // 254 sc is one vpmullw with k254 kept opaque (GCC expands the constant multiply into 3 shifts and a subtract); with
  // d and dmin by one vcvtph2ps and dmin mn subtracted by vfnmadd, the 1 x 1 loop takes 80 instructions a super-block
  // where it took 87: hot one-row Q4_K 1.00-1.015x, Q5_K 1.014-1.023x, every bit equal. Tried: an empty asm on each
  // run after its step (sequential int16 sums, no spills, 67 -> 64 ymm): 0.87-0.90x. What bounds two levels here: 16
  // vpmaddubsw + 14 vpaddw + 12 decode + 3 widening = 45 ymm a super-block against one level's 8 + 7 + 12 + 1 = 28,
  // plus ~15 of scales and epilogue each. Q8_0's x16 route (int16 x, one vpmaddwd for both levels) would take 16
  // vpmaddwd + 15 vpaddd + 16 decode (even in a layout whose words give a nibble each to one vpand or vpsrlw, kept
  // in accumulators of their own by its power of 16 and shifted back) + 4 = 51: not tried.
  constexpr bool kFold = LO && (F == dtn::Q4_K || F == dtn::Q5_K);
  __m256i k254 = _mm256_set1_epi16(254);
  if constexpr (kFold) asm("" : "+x"(k254));
  for (int64_t g = 0; g * 16 < nb; ++g) {
    const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16);
    const uint8_t* p[NR];
    for (int n = 0; n < NR; ++n) p[n] = rows[n] + g * (G::kblock ? 2 * G::kblock : 16 * G::bytes);  // K: block 2 g
    if (ahead)  // (a 32-block format's last super-group too: sg_tails256 reads it next)
      for (int n = 0; n < NR; ++n) stream_ahead(p[n], G::kblock ? S / 8 * G::kblock : S * G::bytes, ahead);
    // a 32-block format's last super-group: sg_tails256's (Q8_0's both levels: here, in rows, as the others)
    if (S < 16 && G::kblock == 0 && !(F == dtn::Q8_0 && LO)) continue;
    const int64_t hoff = 2 * S * G::scales, qoff = hoff + S * G::hbytes;
    // where step u of half h starts: [step u][block j][4 bytes] over the super-group, or in K super-block 2 g + h
    auto quants = [&](int n, int h, int u) -> const int* {
      if constexpr (G::kblock != 0) return reinterpret_cast<const int*>(p[n] + h * G::kblock + G::kq + 32 * u);
      return reinterpret_cast<const int*>(p[n] + qoff + u * 4 * S + 32 * h);
    };
    auto high = [&](int n, int h) -> const int* {  // Q5's fifth bits (Q6_K: its high bits, two steps a byte)
      if constexpr (G::kblock != 0) return reinterpret_cast<const int*>(p[n] + h * G::kblock + G::kh);
      return reinterpret_cast<const int*>(p[n] + hoff + 32 * h);
    };
    auto group = [&](auto st) {  // st: activation bytes per step (a constant for whole super-groups)
    for (int h = 0; h * 8 < S; ++h) {  // S is 16, or 8 (a K-quant's lone last super-block): every half is whole,
      const int cnt = S - 8 * h < 8 ? S - 8 * h : 8;  // but Q8_0's last super-group (any S, summed in its rows)
      const __m256i lm = lanes_mask(cnt);              // is partial: its blocks' lanes
      const int8_t* ag = a.q + m0 * rs + g * 1024 + 32 * h;  // hi levels, then lo at + 512
      __m256i is[MR][NR], il[MR][NR];  // the hi and lo levels' int32 sums, lane j: block j
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) is[m][n] = il[m][n] = _mm256_setzero_si256();
      // The unsigned quants' int16 pair sums of kRun steps are added as int16 (exact: 4-bit quants' steps at most
      // 2 * 2 * 15 * 127 each, 4 of them; 5-bit 2 * 2 * 31 * 127, 2; Q6_K's halves 2 * 63 * 127, 2) and widened once
      // (vpmaddwd) per kRun steps instead of every step: the same integers, a quarter / half of the widening
      constexpr int kRun = F == dtn::Q4_0 || F == dtn::Q4_1 || F == dtn::Q4_K ? 4 : 2;
      __m256i s16[MR][NR], l16[MR][NR], s16b[MR][NR], l16b[MR][NR];
      __m256i kl[NR], kh[NR];  // Q6_K's scales as vpmaddwd's multipliers
      // step u's int16 sums v into acc, widened by vpmaddwd with k (ones, or Q6_K's scales)
      auto run16 = [&](int u, __m256i& acc, __m256i& run, __m256i v, __m256i k) {
        run = u % kRun == 0 ? v : _mm256_add_epi16(run, v);
        if (u % kRun == kRun - 1) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(run, k));
      };
      if constexpr (F == dtn::Q6_K) {  // unsigned 6-bit u (each int16 pair sum at most 2 * 63 * 127), the low
        const __m256i b45 = _mm256_set1_epi8(0x30);  // and high nibbles' sums apart (a scale per 16 weights)
        // Each run of two steps is widened by vpmaddwd with its 16 weights' scale (lane j: sc[2 j] for the low
        // nibbles, sc[2 j + 1] the high), so both land in one int32 lane per block: |sum| at most 4 runs * 2 * 128 *
        // 2 * 2 * 63 * 127 (33M; as a float, rounded once past 2^24). The float epilogue then scales one vector by
        // d instead of two by d sc (the bits are the same for a row alone or in a batch: the same ops per row).
        // The decode (the 6-bit bytes wl, wh of 4 steps from ql and qh) is 36 of the 1 x 1 loop's 97 ymm a half. Tried:
        // steps 0-1's high bits by two vpshufb lookups of hq's low nibble (no shifts): 0.96-0.98x (the tables held
        // in registers push other values out). Measured, not done (this layout is also what the AVX-512 kernels
        // read): the same 192 bytes as 6 vectors V_i = W_i | 2 spare bits in bits 6-7, W = wl0 wh0 wl1 wh1 wl2 wh2
        // (one vpand each), wl3 and wh3 gathered from the spare bits of V0-2 and V3-5 (3 vpand, 3 vpsrlw, 2 vpor
        // each): decode 36 -> 22 a half, the loop 97 -> 76 ymm, hot one-row 1.06-1.15x, cold [8192, 2048] 1.12x,
        // [2048, 8192] 1.07x, [1536, 8960] 1.09x, every bit equal: a layout of its own for AVX2 to take up.
        const __m128i even = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
        const __m128i odd = _mm_add_epi8(even, _mm_set1_epi8(1));
        for (int n = 0; n < NR; ++n) {
          const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[n] + h * G::kblock + 2));
          kl[n] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, even));
          kh[n] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, odd));
        }
        for (int u = 0; u < 4; ++u) {
          __m256i wl[NR], wh[NR];
          for (int n = 0; n < NR; ++n) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants(n, h, u)));
            const __m256i hq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high(n, h)) + (u % 2));
            // (hq << 2 as two byte adds: the bits that cross a byte are masked off below, and vpsllw ymm takes 2
            // cycles on Zen 1's one shift pipe: hot one-row Q6_K tiles 84 -> 83 cycles per 256 weights, bit for bit)
            const __m256i h2 = _mm256_add_epi8(hq, hq), h4 = _mm256_add_epi8(h2, h2);
            const __m256i hl = u < 2 ? _mm256_slli_epi16(hq, 4) : hq, hh = u < 2 ? h4 : _mm256_srli_epi16(hq, 2);
            wl[n] = _mm256_or_si256(_mm256_and_si256(v, lo4), _mm256_and_si256(hl, b45));
            wh[n] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), lo4), _mm256_and_si256(hh, b45));
          }
          for (int m = 0; m < MR; ++m) {  // two steps' int16 pair sums added (at most 2 * 2 * 63 * 127) first
            const auto [al, ah, ll, lh] = step_levels(ag + m * rs, u, st);
            for (int n = 0; n < NR; ++n) {
              run16(u, is[m][n], s16[m][n], _mm256_maddubs_epi16(wl[n], al), kl[n]);
              run16(u, is[m][n], s16b[m][n], _mm256_maddubs_epi16(wh[n], ah), kh[n]);
              if constexpr (LO) {
                run16(u, il[m][n], l16[m][n], _mm256_maddubs_epi16(wl[n], ll), kl[n]);
                run16(u, il[m][n], l16b[m][n], _mm256_maddubs_epi16(wh[n], lh), kh[n]);
              }
            }
          }
        }
      } else if constexpr (F == dtn::Q8_0 && LO) {  // is: blocks [0 1 | 4 5], 2 lanes each; il: [2 3 | 6 7]
        const __m256i z = _mm256_setzero_si256();
        for (int u = 0; cnt <= 4 && u < 8; ++u) {  // a last half of 1-4 blocks: 16 bytes a step, x in order
          __m256i w0[NR];
          for (int n = 0; n < NR; ++n) {
            const uint8_t* q = p[n] + qoff + u * 4 * S + 32 * h;
            w0[n] = _mm256_cvtepu8_epi16(cnt == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(q))
                                                  : _mm_maskload_epi32(reinterpret_cast<const int*>(q),
                                                                       _mm256_castsi256_si128(lm)));
          }
          for (int m = 0; m < MR; ++m) {
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                xw->q + ((m0 + m) * xw->nsg + g) * 512 + 64 * u + 32 * h));
            for (int n = 0; n < NR; ++n) is[m][n] = _mm256_add_epi32(is[m][n], _mm256_madd_epi16(w0[n], x0));
          }
        }
        for (int u = 0; cnt > 4 && u < 8; ++u) {
          __m256i w0[NR], w1[NR];  // a last super-group's half of cnt < 8 blocks: its quants masked (read as 0)
          for (int n = 0; n < NR; ++n) {
            const uint8_t* q = p[n] + qoff + u * 4 * S + 32 * h;
            const __m256i v = cnt == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
                                       : _mm256_maskload_epi32(reinterpret_cast<const int*>(q), lm);
            w0[n] = _mm256_unpacklo_epi8(v, z);
            w1[n] = _mm256_unpackhi_epi8(v, z);
          }
          for (int m = 0; m < MR; ++m) {
            const int16_t* xa = xw->q + ((m0 + m) * xw->nsg + g) * 512 + 64 * u + 32 * h;
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa));
            const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa + 16));
            for (int n = 0; n < NR; ++n) {
              is[m][n] = _mm256_add_epi32(is[m][n], _mm256_madd_epi16(w0[n], x0));
              il[m][n] = _mm256_add_epi32(il[m][n], _mm256_madd_epi16(w1[n], x1));
            }
          }
        }
      } else if constexpr (F == dtn::Q8_0) {
        for (int u = 0; u < 8; ++u) {
          __m256i ws[NR], wa[NR];
          for (int n = 0; n < NR; ++n) {
            ws[n] = _mm256_xor_si256(
                load_i8(p[n] + qoff + u * 4 * S + 32 * h), flip);
            wa[n] = _mm256_sign_epi8(ws[n], ws[n]);
          }
          for (int m = 0; m < MR; ++m) {
            const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ag + m * rs + u * st));
            for (int n = 0; n < NR; ++n) {
              is[m][n] = _mm256_add_epi32(is[m][n], dot_u8s8(wa[n], _mm256_sign_epi8(av, ws[n])));
              if constexpr (LO) {
                const __m256i lv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ag + m * rs + 512 + u * st));
                il[m][n] = _mm256_add_epi32(il[m][n], dot_u8s8(wa[n], _mm256_sign_epi8(lv, ws[n])));
              }
            }
          }
        }
      } else {
        __m256i hv[NR];  // Q5: the high bits, laid out as a step's quants (layouts.py)
        if constexpr (G::hbytes != 0)
          for (int n = 0; n < NR; ++n) hv[n] = load_i8(high(n, h));
        if constexpr (kFold)  // words 2 j, 2 j + 1 (block j's int16 pair sums): sc[j] (kl), 254 sc[j] (kh)
          for (int n = 0; n < NR; ++n) {
            const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p[n] + h * G::kblock + 4));
            kl[n] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc, sc));
            kh[n] = _mm256_mullo_epi16(kl[n], k254);
          }
        for (int u = 0; u < 4; ++u) {
          __m256i wl[NR], wh[NR];
          for (int n = 0; n < NR; ++n) {
            const __m256i v = load_i8(quants(n, h, u));
            wl[n] = _mm256_and_si256(v, lo4);
            wh[n] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
            if constexpr (G::hbytes != 0) {  // bit u of each byte is the low nibble's fifth bit, bit 4 + u the high's
              wl[n] = _mm256_or_si256(wl[n], _mm256_and_si256(_mm256_slli_epi16(hv[n], 4 - u), b4));
              wh[n] = _mm256_or_si256(wh[n], _mm256_and_si256(_mm256_srli_epi16(hv[n], u), b4));
            }
            if constexpr (F == dtn::IQ4_NL || F == dtn::IQ4_XS) {
              wl[n] = _mm256_shuffle_epi8(iq4, wl[n]);
              wh[n] = _mm256_shuffle_epi8(iq4, wh[n]);
            }
          }
          for (int m = 0; m < MR; ++m) {
            const auto [al, ah, ll, lh] = step_levels(ag + m * rs, u, st);
            for (int n = 0; n < NR; ++n) {
              if constexpr (F == dtn::IQ4_NL || F == dtn::IQ4_XS) {  // signed levels up to 127: each half its own
                                                                      // int16 sums
                is[m][n] = _mm256_add_epi32(is[m][n], _mm256_add_epi32(dot_w<true>(wl[n], al), dot_w<true>(wh[n], ah)));
                if constexpr (LO)
                  il[m][n] = _mm256_add_epi32(il[m][n], _mm256_add_epi32(dot_w<true>(wl[n], ll), dot_w<true>(wh[n], lh)));
              } else if constexpr (kFold) {  // both levels into is, widened with 254 sc and sc (kh, kl)
                run16(u, is[m][n], s16[m][n],
                      _mm256_add_epi16(_mm256_maddubs_epi16(wl[n], al), _mm256_maddubs_epi16(wh[n], ah)), kh[n]);
                run16(u, is[m][n], l16[m][n],
                      _mm256_add_epi16(_mm256_maddubs_epi16(wl[n], ll), _mm256_maddubs_epi16(wh[n], lh)), kl[n]);
              } else {  // each int16 is at most 2 * 31 * 127 per product: kRun steps' sums fit (run16). (Q5_0
                        // as Q8_0's x16, widened to int16, one vpmaddwd for both levels, ran 7.2 cycles per 32
                        // weights against these 6.6 in L1 on Zen 1: four more unpacks a step outweigh the multiplies.
                        // A hot one-row 1 x 1 tile runs ~9.3 cycles a block (K = 1024, from L2): ~88 ymm instructions
                        // a half, 35 of them the nibbles' and fifth bits' decode; llama.cpp's AVX2 Q5_0 dot takes ~14
                        // ymm and ~5 scalar a block for its one level. Tried, same bits: hv << (4 - u) as byte adds,
                        // steps in the order 3..0 (4 vpsllw -> 4 vpaddb): 1 x 2 tiles 0.80-0.89x at K = 640, 896 (the
                        // shift pipe is not the bound; the count is). Tried (session 54, h54q5's q5w_tried.diff): a
                        // layout of its own, a half's 8 quant vectors stored as 5, each whole in bits 0-4 of a byte
                        // (one vpand), the other 3 from the spare bits 5-7 (V1's and V3's lined up by one vpor:
                        // 24 ymm a half for the decode, not 35; same bytes, same sums). Hot one-row 1 x 1 tiles
                        // 1.09x (K = 4096: whole super-groups), 1 x 2 1.05x once the two constants of the decode
                        // were not five (spills); sg_last_pair256 no faster with it (0.99-1.04x: its chunks' chain
                        // bounds it, not the count). At the real Q5_0 shapes, cold, against tail_x alone: [4864,
                        // 896] 0.98x, [2560, 960] 0.96x, [6912, 1152] 1.06x, [2048, 640] 1.03x: not kept, its
                        // dtype, packing, cache key and fallbacks for a gain only where K has whole super-groups)
                run16(u, is[m][n], s16[m][n],
                      _mm256_add_epi16(_mm256_maddubs_epi16(wl[n], al), _mm256_maddubs_epi16(wh[n], ah)), ones);
                if constexpr (LO)
                  run16(u, il[m][n], l16[m][n],
                        _mm256_add_epi16(_mm256_maddubs_epi16(wl[n], ll), _mm256_maddubs_epi16(wh[n], lh)), ones);
              }
            }
          }
        }
      }
      __m256 dw[NR], mw[NR], dq[NR];
      for (int n = 0; n < NR; ++n) {
        if constexpr (F == dtn::Q6_K) {  // d, and sc per 16 weights for the offset (kl's lane j: sc[2 j] twice)
          uint16_t d16;
          std::memcpy(&d16, p[n] + h * G::kblock, 2);
          dq[n] = _mm256_set1_ps(_cvtsh_ss(d16));
          dw[n] = _mm256_cvtepi32_ps(_mm256_srai_epi32(kl[n], 16));
          mw[n] = _mm256_cvtepi32_ps(_mm256_srai_epi32(kh[n], 16));
        } else if constexpr (F == dtn::IQ4_XS) {  // (d sc) level per sub-block
          const uint8_t* sb = p[n] + h * G::kblock;
          uint16_t d16;
          std::memcpy(&d16, sb, 2);
          dw[n] = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d16)), int8x8_ps(sb + 2));
          mw[n] = dw[n];
        } else if constexpr (G::kblock != 0) {  // (d sc) u - dmin mn per sub-block
          const uint8_t* sb = p[n] + h * G::kblock;
          int dm;  // d and dmin converted at once; mw is dmin mn (subtracted below: the same bits as adding -dmin mn)
          std::memcpy(&dm, sb, 4);
          const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
          dw[n] = kFold ? _mm256_set1_ps(_mm_cvtss_f32(dd) * (1.f / 254.f))  // (sc is in is)
                        : _mm256_mul_ps(_mm256_broadcastss_ps(dd), u8x8_ps(sb + 4));
          mw[n] = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), u8x8_ps(sb + 12));
        } else {
          dw[n] = load_h8(p[n] + 16 * h, cnt);
          mw[n] = G::scales == 2 ? load_h8(p[n] + 2 * S + 16 * h, cnt) : dw[n];
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 da = _mm256_loadu_ps(a.d + (m0 + m) * a.nsg * 16 + g * 16 + 8 * h);
        const __m256 sa = _mm256_loadu_ps(a.s + (m0 + m) * a.nsg * 16 + g * 16 + 8 * h);
        for (int n = 0; n < NR; ++n) {
          if constexpr (F == dtn::Q8_0 && LO) {  // hadd: blocks 0..7 in order (1-4: [0 1 - - 2 3 - -]); x16 is 254 x
            const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                xw->corr + (m0 + m) * xw->nsg * 16 + g * 16 + 8 * h));
            __m256i sum = _mm256_hadd_epi32(is[m][n], il[m][n]);
            if (cnt <= 4) sum = _mm256_permutevar8x32_epi32(sum, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
            sum = _mm256_sub_epi32(sum, c);
            const float* dk = xw->dk + (m0 + m) * xw->nsg * 16 + g * 16 + 8 * h;
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(dk));
            acc[m][n] = _mm256_fmadd_ps(dw[n], t, acc[m][n]);
            continue;
          }
          const __m256i ti = is[m][n];
          const __m256 t = _mm256_mul_ps(LO && !kFold ? levels256(ti, il[m][n]) : _mm256_cvtepi32_ps(ti), da);
          if constexpr (F == dtn::Q6_K) {  // d (sc u a - 32 sc (sum a)) per 16 weights
            const float* hs = a.sh + (m0 + m) * a.nsg * 32 + g * 32 + 8 * h;
            const __m256 o = _mm256_fmadd_ps(_mm256_loadu_ps(hs + 16), mw[n],
                                             _mm256_mul_ps(_mm256_loadu_ps(hs), dw[n]));
            acc[m][n] = _mm256_fmadd_ps(_mm256_fmadd_ps(o, _mm256_set1_ps(-32.f), t), dq[n], acc[m][n]);
          } else if constexpr (G::kblock != 0 && G::scales == 2) {  // Q4_K, Q5_K: (d sc) u - dmin mn
            acc[m][n] = _mm256_fnmadd_ps(mw[n], sa, _mm256_fmadd_ps(t, dw[n], acc[m][n]));
          } else if constexpr (G::scales == 2) {  // Q4_1, Q5_1: d u + m
            acc[m][n] = _mm256_fmadd_ps(mw[n], sa, _mm256_fmadd_ps(t, dw[n], acc[m][n]));
          } else if constexpr (!G::signed_q) {  // Q4_0, Q5_0: d (u + offset)
            acc[m][n] = _mm256_fmadd_ps(dw[n], _mm256_fmadd_ps(sa, _mm256_set1_ps(G::offset), t), acc[m][n]);
          } else {  // Q8_0, IQ4_NL, IQ4_XS: signed quants
            acc[m][n] = _mm256_fmadd_ps(dw[n], t, acc[m][n]);
          }
        }
      }
    }
    };
    if (S == 16) group(std::integral_constant<int64_t, 64>{});
    else group(int64_t(4 * sg_period(S)));
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) out[m][n] = hsum256_avx2(acc[m][n]);
}

template <int F, int MR, int NR, bool LO>
static inline void sg_block256(const QWeight& w, const SGAct& a, int64_t m, int64_t n, const void* bias, void* y,
                               int ydt, int64_t ldy, int64_t ahead = 0, const X16Act* xw = nullptr) {
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w.qs + (n + j) * w.qs_row;
  float o[MR][NR];
  sg_tile256<F, MR, NR, LO>(rows, a, m, w.K / 32, o, ahead, xw);
  for (int j = 0; j < NR; ++j) {
    const float b = bias ? load_f(bias, ydt, n + j) : 0.f;
    for (int r = 0; r < MR; ++r) store_f(y, ydt, (m + r) * ldy + n + j, o[r][j] + b);
  }
}

// One Q8_0 weight row (its bytes at p) against row m of x as X16Act, for decode: sg_tile256's sums with its float
// operations in its order (the same bits as a row of a batch, once the vector returned is summed as hsum256_avx2
// does: sg_tiles256 sums 8 rows' at once), in a loop of its own. Whole super-groups run with the
// step fixed at 64 bytes; the last one (S < 16 blocks) reads plain 16- and 32-byte loads where they end in the row
// (lanes past S meet zeros of x and of its scales), masked loads only where they would not (see `from`). ahead > 0:
// each super-group's bytes that far on are asked for as it is read (sg_tiles256's stream). On the 2-core Zen 1 VM
// (AVX2, no AVX-512; load 6-7, main and this alternating) against sg_tile256's rows: hot one-row products 8.0 -> 6.5
// cycles a block at K = 4864, 9.1 -> 8.0 at 896, 11.3 -> 8.4 at 960, 10.2-11.3 -> 8.6-9.1 at 640 (four builds of a
// harness that move the code; the stand-alone loop without the epilogue runs 4.8 from L2: the bound is the ~14
// macro-ops a block, not vpmaddwd's 4 cycles); decode at 1 thread, CPU ms a token (medians of 5, two rounds): Gemma 3
// 270M Q8_0 42.2-42.6 -> 35.5-35.9, Qwen2.5-0.5B Q8_0 67.7-71.4 -> 55.5-57.1, SmolLM2-360M Q8_0 59.0-59.6 -> 43.9-44.7,
// Gemma 3 270M Q4_K_M (its Q8_0 head) 42.4-43.4 -> 37.5-37.8, the same tokens.
static inline __m256 q8x16_row(const uint8_t* p, const X16Act& xw, int64_t m, int64_t nb, int64_t ahead) {
  const __m256i z = _mm256_setzero_si256();
  const int16_t* x = xw.q + m * xw.nsg * 512;
  const int32_t* c = xw.corr + m * xw.nsg * 16;
  const float* dk = xw.dk + m * xw.nsg * 16;
  __m256 acc = _mm256_setzero_ps();
  auto close = [&](__m256i is, __m256i il, bool in_order, const int32_t* cg, const float* dg, __m256 dw) {
    // in order (a half of 1-4 blocks, il zero): is [0 0 1 1 | 2 2 3 3] -> [0 1 2 3] by one 128-bit hadd
    __m256i sum = in_order ? _mm256_zextsi128_si256(_mm_hadd_epi32(_mm256_castsi256_si128(is),
                                                                   _mm256_extracti128_si256(is, 1)))
                           : _mm256_hadd_epi32(is, il);
    sum = _mm256_sub_epi32(sum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg)));
    const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(dg));
    acc = _mm256_fmadd_ps(dw, t, acc);
  };
  const int64_t nw = nb / 16;
  for (int64_t g = 0; g < nw; ++g, p += 16 * 34, x += 512, c += 16, dk += 16) {
    if (ahead) stream_ahead(p, 16 * 34, ahead);
    for (int h = 0; h < 2; ++h) {
      __m256i is = z, il = z;
      for (int u = 0; u < 8; ++u) {
        const __m256i v = load_i8(p + 32 + 64 * u + 32 * h);
        const int16_t* xa = x + 64 * u + 32 * h;
        is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_unpacklo_epi8(v, z), load_i8(xa)));
        il = _mm256_add_epi32(il, _mm256_madd_epi16(_mm256_unpackhi_epi8(v, z), load_i8(xa + 16)));
      }
      close(is, il, false, c + 8 * h, dk + 8 * h,
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h))));
    }
  }
  const int S = int(nb - nw * 16);
  if (S > 0) {
    if (ahead) stream_ahead(p, S * 34, ahead);
    const int64_t st = 4 * S;
    const uint8_t* q = p + 2 * S;
    // A last super-group of 4 blocks (K = 640, 1152: Gemma 3's head and projections; K = 128) is its 128 bytes as 4
    // vectors of two steps each (x16_levels lays x out so for the stream), not 8 steps of 16 bytes by vpmovzxbw:
    // 4 loads, 8 vpunpck{l,h}bw where there were 8 vpmovzxbw (slow on Zen 1: the whole groups' loop with vpmovzxbw
    // of 16 bytes for its unpacks ran 0.81-0.84x). The same integers. On the 2-core Zen 1 VM (load 5, same process,
    // every bit equal): hot one-row [256, 640] 1.04-1.05x, [256, 1152] 1.01x, [256, 128] 1.15-1.27x; cold [262144,
    // 640] 1.00-1.075x, [262144, 1152] 1.01-1.02x. Tried: each 8 rows' last groups after their 8 whole parts (the
    // same float order): hot 1.07-1.10x at 640, but cold 0.89-1.00x (the row's stream read out of order).
    if (S == 4) {
      __m256i is = z, il = z;
      for (int j = 0; j < 4; ++j) {
        const __m256i v = load_i8(q + 32 * j);
        is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_unpacklo_epi8(v, z), load_i8(x + 128 * j)));
        il = _mm256_add_epi32(il, _mm256_madd_epi16(_mm256_unpackhi_epi8(v, z), load_i8(x + 128 * j + 16)));
      }
      const __m256i t = _mm256_hadd_epi32(is, il);  // [0 1 2 3 | 0 1 2 3]: the even steps', the odd steps'
      const __m128i d16 = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                                        _mm_setr_epi16(-1, -1, -1, -1, 0, 0, 0, 0));
      const __m256i sum = _mm256_sub_epi32(
          _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)));
      return _mm256_fmadd_ps(_mm256_cvtph_ps(d16), _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(dk)), acc);
    }
    for (int h = 0; h * 8 < S; ++h) {
      const int cnt = S - 8 * h < 8 ? S - 8 * h : 8;
      __m256i is = z, il = z;
      // Steps from `from` on are read masked: a half of 8 or 4 blocks ends each step's bytes in the row (from 8), one
      // of 5-7 blocks its last step past the row's end (7), one of 1-3 blocks may from step 6 on (0: all masked);
      // each case straight-line code, no branch per step
      auto wide = [&](auto from) {  // 32 bytes a step, x as vpunpck{l,h}bw take them
        const __m256i lm = lanes_mask(cnt);
        for (int u = 0; u < 8; ++u) {
          const uint8_t* qa = q + u * st + 32 * h;
          const __m256i v = u >= from ? _mm256_maskload_epi32(reinterpret_cast<const int*>(qa), lm) : load_i8(qa);
          const int16_t* xa = x + 64 * u + 32 * h;
          is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_unpacklo_epi8(v, z), load_i8(xa)));
          il = _mm256_add_epi32(il, _mm256_madd_epi16(_mm256_unpackhi_epi8(v, z), load_i8(xa + 16)));
        }
      };
      auto narrow = [&](auto from) {  // 16 bytes a step, x in order
        const __m128i lm = _mm_cmpgt_epi32(_mm_set1_epi32(cnt), _mm_setr_epi32(0, 1, 2, 3));
        for (int u = 0; u < 8; ++u) {
          const uint8_t* qa = q + u * st + 32 * h;
          const __m128i v = u >= from ? _mm_maskload_epi32(reinterpret_cast<const int*>(qa), lm)
                                      : _mm_loadu_si128(reinterpret_cast<const __m128i*>(qa));
          is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_cvtepu8_epi16(v), load_i8(x + 64 * u + 32 * h)));
        }
      };
      if (cnt == 8) wide(std::integral_constant<int, 8>{});
      else if (cnt > 4) wide(std::integral_constant<int, 7>{});
      else if (cnt == 4) narrow(std::integral_constant<int, 8>{});
      else narrow(std::integral_constant<int, 0>{});
      // the scales: 16 bytes from 16 h (in the row: the quants follow), lanes past cnt zeroed
      const __m128i hm = _mm_cmpgt_epi16(_mm_set1_epi16(short(cnt)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
      const __m128i d16 = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)), hm);
      close(is, il, cnt <= 4, c + 8 * h, dk + 8 * h, _mm256_cvtph_ps(d16));
    }
  }
  return acc;
}

// dwords 0 .. c - 1 of 8 rows (row r at p + r * stride; rows from nr on read as zero) as vectors of one dword per
// row: out[j] lane r = dword j of row r (8 x 8 transposes: unpacks of dwords and qwords, then of the 128-bit lanes)
static inline void rows_to_lanes256(const uint8_t* p, int64_t stride, int nr, int c, __m256i* out) {
  for (int c0 = 0; c0 < c; c0 += 8) {
    const __m256i cm = lanes_mask(c - c0);
    __m256i r[8], t[8];
    for (int i = 0; i < 8; ++i)  // (a masked load only where the mask is: a slow one on AMD's cores)
      r[i] = i >= nr ? _mm256_setzero_si256()
             : c - c0 >= 8 ? load_i8(p + i * stride + 4 * c0)
                           : _mm256_maskload_epi32(reinterpret_cast<const int*>(p + i * stride + 4 * c0), cm);
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  // r[i + j], 128-bit lane k: dword 4 k + j of rows i .. i + 3
      r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; ++j) {
      if (c0 + j < c) out[c0 + j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x20);
      if (c0 + 4 + j < c) out[c0 + 4 + j] = _mm256_permute2x128_si256(r[j], r[4 + j], 0x31);
    }
  }
}

// the fp16 in the low half of each of 8 dwords, as floats
static inline __m256 low_halves(__m256i v) {
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08)));
}

// The last super-group of a row of S < 16 blocks (32-block formats; K = 576: S = 2), one weight row per lane, as
// quant_avx512.h's sg_tails512 does it for 16 rows: the tiles' half-groups would pay a whole half's products and
// epilogue per pair of rows for its few blocks. out[m * ldo + n - n0]: that part of y[m, n], rows m < M, weight
// rows n0..n1 (at most 8 a call).
template <int F, bool LO>
static void sg_tails256(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, float* out,
                        int64_t ldo) {
  using G = SG<F>;
  constexpr int kSteps = F == dtn::Q8_0 ? 8 : 4;  // dwords of a block's quants
  constexpr bool kSigned = F == dtn::Q8_0 || F == dtn::IQ4_NL;  // multiplied with their sign (dot_w)
  const int64_t nb = w.K / 32, g = nb / 16;
  const int S = int(nb - g * 16), P = sg_period(S), nr = int(n1 - n0);
  const int64_t qoff = 2 * S * G::scales + S * G::hbytes, rs = a.nsg * 1024, ars = a.nsg * 16;
  const __m256i lo4 = _mm256_set1_epi8(0x0f), bit0 = _mm256_set1_epi32(0x01010101);
  const __m256i flip = _mm256_set1_epi8(char(0x80)), iq4 = iq4_table256(), ones = _mm256_set1_epi16(1);
  const uint8_t* p = w.qs + n0 * w.qs_row + g * 16 * G::bytes;
  __m256i raw[8 * 15], sc[15], hb[15], wq[8 * 15];  // wq[b][j]: block b's quants that meet x's step j
  __m256 dw[15], mw[15];
  rows_to_lanes256(p, w.qs_row, nr, (2 * S * G::scales + 3) / 4, sc);
  auto half = [&](int byte) {  // the fp16 at byte (even) of each row
    const __m256i v = sc[byte / 4];
    return low_halves(byte % 4 ? _mm256_srli_epi32(v, 16) : v);
  };
  if constexpr (G::hbytes != 0) rows_to_lanes256(p + 2 * S * G::scales, w.qs_row, nr, S, hb);
  rows_to_lanes256(p + qoff, w.qs_row, nr, kSteps * S, raw);
  for (int b = 0; b < S; ++b) {
    dw[b] = half(2 * b);
    mw[b] = G::scales == 2 ? half(2 * S + 2 * b) : _mm256_mul_ps(dw[b], _mm256_set1_ps(G::offset));
    for (int u = 0; u < kSteps; ++u) {
      const __m256i v = raw[u * S + b];
      if constexpr (F == dtn::Q8_0) {
        wq[b * 8 + u] = _mm256_xor_si256(v, flip);  // q, signed
        continue;
      }
      __m256i wl = _mm256_and_si256(v, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
      if constexpr (G::hbytes != 0) {  // bit u of each byte: the low nibble's fifth bit, 4 + u the high's
        wl = _mm256_or_si256(wl, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb[b], u), bit0), 4));
        wh = _mm256_or_si256(wh, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb[b], 4 + u), bit0), 4));
      }
      if constexpr (F == dtn::IQ4_NL) {  // signed levels
        wl = _mm256_shuffle_epi8(iq4, wl);
        wh = _mm256_shuffle_epi8(iq4, wh);
      }
      wq[b * 8 + u] = wl;
      wq[b * 8 + 4 + u] = wh;
    }
  }
  const __m256i keep = lanes_mask(nr);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* am = a.q + m * rs + g * 1024;
    const float* ad = a.d + m * ars + g * 16;
    const float* as = a.s + m * ars + g * 16;
    __m256 v = _mm256_setzero_ps();
    for (int b = 0; b < S; ++b) {  // step j of block b: activation dword j P + b (Q4's high nibbles: steps 4..7)
      __m256i is = _mm256_setzero_si256(), il = is;
      auto dword = [&](int off) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(am + off)); };
      if constexpr (kSigned) {
        for (int j = 0; j < 8; ++j) {
          const __m256i q = wq[b * 8 + j];
          is = _mm256_add_epi32(is, dot_w<kSigned>(q, dword(4 * (j * P + b))));
          if constexpr (LO) il = _mm256_add_epi32(il, dot_w<kSigned>(q, dword(512 + 4 * (j * P + b))));
        }
      } else {  // unsigned quants: kRun steps' int16 pair sums added first (as sg_tile256's run16: exact)
        constexpr int kRun = G::hbytes != 0 ? 4 : 8;
        __m256i s16 = is, l16 = is;
        for (int j = 0; j < 8; ++j) {
          const __m256i q = wq[b * 8 + j];
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(q, dword(4 * (j * P + b))));
          if constexpr (LO) l16 = _mm256_add_epi16(l16, _mm256_maddubs_epi16(q, dword(512 + 4 * (j * P + b))));
          if (j % kRun == kRun - 1) {
            is = _mm256_add_epi32(is, _mm256_madd_epi16(s16, ones));
            if constexpr (LO) il = _mm256_add_epi32(il, _mm256_madd_epi16(l16, ones));
            s16 = l16 = _mm256_setzero_si256();
          }
        }
      }
      const __m256 t = LO ? levels256(is, il) : _mm256_cvtepi32_ps(is);
      v = _mm256_fmadd_ps(_mm256_mul_ps(t, _mm256_set1_ps(ad[b])), dw[b], v);
      if (!kSigned && (G::scales == 2 || G::offset != 0.f)) v = _mm256_fmadd_ps(mw[b], _mm256_set1_ps(as[b]), v);
    }
    if (nr == 8) _mm256_storeu_ps(out + m * ldo, v);
    else _mm256_maskstore_ps(out + m * ldo, keep, v);
  }
}

// tail_x: the 16-byte pieces of x that sg_last_pair256 multiplies, each twice (both rows' lanes) in 32 bytes, for
// rows 0..M-1 of x: row m, chunk c, level l, step v (0..7: u, then u + 4) at xb + 32 (((m nch + c) 2 + l) 8 + v), nch
// the chunks of 4 blocks; laid out once a call, so each product reads its x as vpmaddubsw's memory operand, not
// through a vbroadcasti128 per product and pair of weight rows (the same bytes: the same sums). Zen 1, 2 cores, load
// 2-3.5, every output bit equal: sg_last_pair256 alone, one row of x, Q5_0 (TSC ticks a block and weight row) S = 12:
// 9.0 -> 8.1, S = 4: 11.8 -> 10.7, S = 14: 11.1 -> 10.4; whole one-row products, main vs this in one process
// (h54q5's kq): hot [256, K] Q5_0 K = 640 / 896 / 960 / 1152 1.035x / 1.060x / 1.044x / 1.022x, Q4_0 1.041x / 1.056x /
// 1.062x / 1.028x; cold Q5_0 [4864, 896] 1.053x, [2560, 960] 1.080x, [6912, 1152] 1.025x, [2048, 640] 1.030x (a
// copy of main's own code read 1.01-1.03x there: the harness's bias). Tried: two pairs of weight rows a call (their
// chains side by side): 0.79x, spills.
static inline int64_t tail_x_bytes(int64_t M, int64_t nb) { return M * ((nb % 16 + 3) / 4) * 512; }

static void tail_x(const SGAct& a, int64_t M, int64_t nb, int8_t* xb) {
  const int64_t g = nb / 16;
  const int S = int(nb - g * 16), nch = (S + 3) / 4;
  const int64_t st = 4 * sg_period(S);
  for (int64_t m = 0; m < M; ++m)
    for (int c = 0; c < nch; ++c)
      for (int l = 0; l < a.levels; ++l)
        for (int v = 0; v < 8; ++v) {
          const __m128i x = _mm_loadu_si128(
              reinterpret_cast<const __m128i*>(a.q + (m * a.nsg + g) * 1024 + 512 * l + v * st + 16 * c));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + 32 * (((m * nch + c) * 2 + l) * 8 + v)),
                              _mm256_broadcastsi128_si256(x));
        }
}

// The last super-group of S < 16 blocks of two weight rows (an unsigned 4- or 5-bit 32-block format: Q4_0, Q4_1,
// Q5_0, Q5_1) against row m of x, in chunks of 4 blocks: each vector holds the first row's 16 bytes of a step in its
// low 128 bits and the second row's in its high (x's 16 bytes of the step in both), so a chunk of the two rows costs
// what a half of one row does, where sg_tails256 transposes 8 rows' quants and decodes them for one row of x, and the
// tiles' half-groups would pay a whole half for the last 4 (S = 12: K = 896) or all 4 (S = 4: K = 640, 1152) blocks.
// A chunk of cnt < 4 blocks (S % 4) reads its quants, high bits and scales as zeros from block cnt on. Every lane
// takes the same operations, and each row's 4 lanes are added alike, so a row gets the same bits as either row
// (an odd last row goes in both). MR rows of x from m0 share each decoded vector; out[r][0], out[r][1]: the weight
// rows' sums against row m0 + r; xb: x as tail_x lays it out. Its blocks cost ~13 cycles each against the tiles' ~9.3 (hot one-row Q5_0, Zen 1:
// K = 896 [16 + 12 blocks] 308 cycles a row, K = 1024 [32] 297). Tried: a last super-group of 8-15 blocks summed in
// the tile's row instead (x's period is 16 there, as a whole one's; the partial half's quants masked): 0.64-0.76x at
// K = 896, 0.76-0.90x at 960, inlined or in a call of its own (GCC spills the partial halves' x and decode; load_h8's
// copy of cnt halves stalls the load after it: 13% of that part); whole rows (K = 1024) 0.94-0.96x beside it (a
// base-against-base run: +-5%); its first 8 blocks in the tile, the rest here: 0.86-0.90x at K = 896, 960, but
// 0.81x at K = 640, which never ran the new code (the tile's codegen, unresolved). Decoding the tails' rows one at a
// time (1 x 1 tiles): 0.98x, the same bits.
template <int F, int MR, bool LO>
static inline void sg_last_pair256(const uint8_t* r0, const uint8_t* r1, const SGAct& a, int64_t m0, int64_t nb,
                                   float (&out)[MR][2], const int8_t* xb) {
  using G = SG<F>;
  const int64_t g = nb / 16;
  const int S = int(nb - g * 16);
  const int64_t hoff = 2 * S * G::scales, qoff = hoff + S * G::hbytes;
  const uint8_t* p0 = r0 + g * 16 * G::bytes;
  const uint8_t* p1 = r1 + g * 16 * G::bytes;
  const int64_t ars = a.nsg * 16;
  const float* ad = a.d + (m0 * a.nsg + g) * 16;
  const float* as = a.s + (m0 * a.nsg + g) * 16;
  const __m256i lo4 = _mm256_set1_epi8(0x0f), b4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int c = 0; c * 4 < S; ++c) {
    const int cnt = S - 4 * c < 4 ? S - 4 * c : 4;
    const __m128i lm = _mm_cmpgt_epi32(_mm_set1_epi32(cnt), _mm_setr_epi32(0, 1, 2, 3));
    auto pair = [&](int64_t off) {  // 16 bytes at off of each row (masked to cnt dwords: the row may end there)
      const __m128i* a0 = reinterpret_cast<const __m128i*>(p0 + off);
      const __m128i* a1 = reinterpret_cast<const __m128i*>(p1 + off);
      if (cnt == 4) return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(a0)), _mm_loadu_si128(a1), 1);
      return _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_maskload_epi32(reinterpret_cast<const int*>(a0), lm)),
          _mm_maskload_epi32(reinterpret_cast<const int*>(a1), lm), 1);
    };
    const int nch = (S + 3) / 4;
    auto xv = [&](int r, int l, int v) {  // row m0 + r of x: level l, step v (u or u + 4), chunk c (tail_x)
      return load_i8(xb + 32 * ((((m0 + r) * nch + c) * 2 + l) * 8 + v));
    };
    __m256i hv = _mm256_setzero_si256();
    if constexpr (G::hbytes != 0) hv = pair(hoff + 16 * c);
    constexpr int kRun = F == dtn::Q4_0 || F == dtn::Q4_1 ? 4 : 2;  // as sg_tile256's run16
    __m256i is[MR], il[MR], s16[MR], l16[MR];
    for (int r = 0; r < MR; ++r) is[r] = il[r] = s16[r] = l16[r] = _mm256_setzero_si256();
    for (int u = 0; u < 4; ++u) {
      const __m256i v = pair(qoff + u * 4 * S + 16 * c);
      __m256i wl = _mm256_and_si256(v, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
      if constexpr (G::hbytes != 0) {  // bit u of each byte is the low nibble's fifth bit, bit 4 + u the high's
        wl = _mm256_or_si256(wl, _mm256_and_si256(_mm256_slli_epi16(hv, 4 - u), b4));
        wh = _mm256_or_si256(wh, _mm256_and_si256(_mm256_srli_epi16(hv, u), b4));
      }
      for (int r = 0; r < MR; ++r) {
        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(wl, xv(r, 0, u)), _mm256_maddubs_epi16(wh, xv(r, 0, u + 4)));
        s16[r] = u % kRun == 0 ? t : _mm256_add_epi16(s16[r], t);
        if constexpr (LO) {
          const __m256i tl = _mm256_add_epi16(_mm256_maddubs_epi16(wl, xv(r, 1, u)),
                                              _mm256_maddubs_epi16(wh, xv(r, 1, u + 4)));
          l16[r] = u % kRun == 0 ? tl : _mm256_add_epi16(l16[r], tl);
        }
        if (u % kRun == kRun - 1) {
          is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(s16[r], ones));
          if constexpr (LO) il[r] = _mm256_add_epi32(il[r], _mm256_madd_epi16(l16[r], ones));
        }
      }
    }
    auto scales = [&](int64_t off) {  // 4 fp16 of each row (zeros from cnt on), as 8 floats
      uint64_t h0 = 0, h1 = 0;
      std::memcpy(&h0, p0 + off, 8);
      std::memcpy(&h1, p1 + off, 8);
      const uint64_t keep = cnt == 4 ? ~uint64_t(0) : (uint64_t(1) << (16 * cnt)) - 1;
      return _mm256_cvtph_ps(_mm_set_epi64x(int64_t(h1 & keep), int64_t(h0 & keep)));
    };
    const __m256 dw = scales(8 * c), mw = G::scales == 2 ? scales(2 * S + 8 * c) : dw;
    for (int r = 0; r < MR; ++r) {
      const __m256 da = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(ad + r * ars + 4 * c));
      const __m256 sa = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(as + r * ars + 4 * c));
      const __m256 t = _mm256_mul_ps(LO ? levels256(is[r], il[r]) : _mm256_cvtepi32_ps(is[r]), da);
      if constexpr (G::scales == 2) {  // Q4_1, Q5_1: d u + m
        acc[r] = _mm256_fmadd_ps(mw, sa, _mm256_fmadd_ps(t, dw, acc[r]));
      } else {  // Q4_0, Q5_0: d (u + offset)
        acc[r] = _mm256_fmadd_ps(dw, _mm256_fmadd_ps(sa, _mm256_set1_ps(G::offset), t), acc[r]);
      }
    }
  }
  auto hsum4 = [](__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
  };
  for (int r = 0; r < MR; ++r) {
    out[r][0] = hsum4(_mm256_castps256_ps128(acc[r]));
    out[r][1] = hsum4(_mm256_extractf128_ps(acc[r], 1));
  }
}

// Rows n0..n1 of w against M rows of x in MR x 2 tiles (the two weight rows decoded once for MR rows of x), the rows
// kAhead on prefetched; LO: both levels of x. A 32-block format's last super-group of under 16 blocks is summed
// after the tiles of 8 weight rows (the rows are in cache then): Q4_0, Q4_1, Q5_0 and Q5_1 two rows a vector
// (sg_last_pair256), the others by sg_tails256 for the 8 rows at a time; y = (tiles' sum + tails) + bias for every
// row count alike. Q8_0's against both levels is summed in its rows instead (X16Act).
// Decode (under 4 rows of x) streams the rows instead: the first tile of x asks for each super-group's bytes
// kStreamAhead on (rounded up to whole pairs of rows, which are read side by side) as it reads it. Cold one-row
// products, one thread, AVX2 forced on this Zen 4 (same-run A/B, medians, a loaded machine: 2 cores, load 3-4.5):
// Q8_0 [2048, 8192] 6.4 -> 14.8 GB/s, [1536, 8960] 5.7 -> 14.4, [896, 4864] 5.4 -> 14.1, [4864, 896] 3.1 -> 10.0,
// [896, 896] 2.1 -> 6.1, [2048, 2048] 4.7 -> 14.0; Q4_K [2048, 8192] 4.6 -> 12.1, [8192, 2048] 1.9 -> 7.5; Q6_K
// [2048, 8192] 6.1 -> 13.1, [16384, 2048] 2.3 -> 9.0 (whole rows 8 on came in bursts, the first 8 not at all).
// Rows of whole super-groups are streamed one at a time: two side by side (each x vector loaded once for both) need
// more registers than the 16 ymm, and the spills cost more than the loads saved (an AVX2-only 2-core EPYC VM, cold,
// one thread, stand-alone harness: Q6_K [1536, 8960] / [2048, 8192] 1.19x, Q4_K [17920, 1536] 1.09x, [2048, 2048]
// 1.12x, Q4_0 [2048, 2048] 1.22x, Q5_K, Q5_0, Q8_0 1.0-1.04x; every row's sum is unchanged).
template <int F, int MR, bool LO>
static void sg_tiles256(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                        void* y, int ydt, int64_t ldy) {
  const bool stream = M < 4;
  const int64_t pair = 2 * w.qs_row, stream_at = stream ? (kStreamAhead + pair - 1) / pair * pair : 0;
  if (stream) {  // the stream's start, before the first tile asks
    const char* first = reinterpret_cast<const char*>(w.qs + n0 * w.qs_row);
    for (int64_t i = 0; i < stream_at && i < (n1 - n0) * w.qs_row; i += 64) __builtin_prefetch(first + i, 0, 2);
  }
  auto ahead_of = [&](int64_t m) { return m == 0 ? stream_at : 0; };  // (further rows of x find the rows in cache)
  thread_local std::vector<int16_t> t_x16;
  thread_local std::vector<int32_t> t_corr;
  thread_local std::vector<float> t_dk;
  X16Act xv{nullptr, nullptr, nullptr, 0};
  const X16Act* xw = nullptr;
  if (F == dtn::Q8_0 && LO) {
    if (int64_t(t_x16.size()) < M * a.nsg * 512) {
      t_x16.resize(size_t(M * a.nsg * 512));
      t_corr.resize(size_t(M * a.nsg * 16));
      t_dk.resize(size_t(M * a.nsg * 16));
    }
    xv = x16_levels(a, M, w.K / 32, t_x16.data(), t_corr.data(), t_dk.data(), stream);
    xw = &xv;
  }
  auto prefetch_pair = [&](int64_t n) {  // whole rows kAhead on, unless streaming
    if (!stream && n + 2 + kAhead <= n1)
      for (int j = 0; j < 2; ++j) prefetch_row(w, n + kAhead + j);
  };
  if (SG<F>::kblock != 0 || (w.K / 32) % 16 == 0 || (F == dtn::Q8_0 && LO)) {  // (Q8_0's both levels: tails in rows)
    int64_t n = n0;
    if (stream) {  // one weight row at a time (see above), its stream kStreamAhead on rounded up to whole rows
      const int64_t row_at = (kStreamAhead + w.qs_row - 1) / w.qs_row * w.qs_row;
      // Q8_0 against both levels: 8 rows' vectors summed at once (hsum8_avx2, the same bits), not each at its row's
      // end. Hot one-row products, same process, HEAD vs this (Zen 1, load 5-6; every output bit equal): cycles a
      // block [256, 640] 8.75-8.77 -> 7.73-7.79, [256, 512] 8.45 -> 6.98, [256, 896] 8.00 -> 7.17, [256, 960] 8.47 ->
      // 7.77, [64, 4864] 6.45 -> 6.32; decode at 1 thread, CPU ms a token (medians of 3, alternating, load 6-8, three
      // rounds): Gemma 3 270M Q8_0 34.5 / 36.5 / 33.7 -> 31.0 / 31.1 / 30.4, Qwen2.5-0.5B Q8_0 56.2 / 54.5 / 57.1 ->
      // 53.4 / 52.7 / 51.1, SmolLM2-360M Q8_0 (two) 43.2 / 42.9 -> 40.4 / 40.5
      if constexpr (F == dtn::Q8_0 && LO) {
        for (; n + 8 <= n1; n += 8)
          for (int64_t m = 0; m < M; ++m) {
            __m256 acc[8];
            float o[8];
            for (int j = 0; j < 8; ++j)
              acc[j] = q8x16_row(w.qs + (n + j) * w.qs_row, xv, m, w.K / 32, m ? 0 : row_at);
            hsum8_avx2(acc, o);
            for (int j = 0; j < 8; ++j)
              store_f(y, ydt, m * ldy + n + j, o[j] + (bias ? load_f(bias, ydt, n + j) : 0.f));
          }
      }
      for (; n < n1; ++n) {
        if constexpr (F == dtn::Q8_0 && LO) {
          const float b = bias ? load_f(bias, ydt, n) : 0.f;
          for (int64_t m = 0; m < M; ++m)
            store_f(y, ydt, m * ldy + n,
                    hsum256_avx2(q8x16_row(w.qs + n * w.qs_row, xv, m, w.K / 32, m ? 0 : row_at)) + b);
        } else {
          for (int64_t m = 0; m < M; ++m) sg_block256<F, 1, 1, LO>(w, a, m, n, bias, y, ydt, ldy, m ? 0 : row_at, xw);
        }
      }
      return;
    }
    for (; n + 2 <= n1; n += 2) {
      prefetch_pair(n);
      int64_t m = 0;
      for (; m + MR <= M; m += MR) sg_block256<F, MR, 2, LO>(w, a, m, n, bias, y, ydt, ldy, ahead_of(m), xw);
      for (; m < M; ++m) sg_block256<F, 1, 2, LO>(w, a, m, n, bias, y, ydt, ldy, ahead_of(m), xw);
    }
    for (; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) sg_block256<F, 1, 1, LO>(w, a, m, n, bias, y, ydt, ldy, ahead_of(m), xw);
    return;
  }
  constexpr int64_t kChunk = 8;
  thread_local std::vector<float> t_part, t_pre;
  if (int64_t(t_part.size()) < M * kChunk) {
    t_part.resize(size_t(M * kChunk));
    t_pre.resize(size_t(M * kChunk));
  }
  float* const part = t_part.data();
  float* const pre = t_pre.data();
  const int64_t row_at = stream ? (kStreamAhead + w.qs_row - 1) / w.qs_row * w.qs_row : 0;  // (a row at a time)
  thread_local std::vector<int8_t> t_xb;  // the last super-group's x for sg_last_pair256 (tail_x)
  constexpr bool kPair = F == dtn::Q4_0 || F == dtn::Q4_1 || F == dtn::Q5_0 || F == dtn::Q5_1;
  if (kPair) {
    if (int64_t(t_xb.size()) < tail_x_bytes(M, w.K / 32)) t_xb.resize(size_t(tail_x_bytes(M, w.K / 32)));
    tail_x(a, M, w.K / 32, t_xb.data());
  }
  const uint8_t* rows[2];
  for (int64_t nc = n0; nc < n1; nc += kChunk) {
    const int64_t ne = nc + kChunk < n1 ? nc + kChunk : n1;
    int64_t n = nc;
    // one row of x (Q4_0, Q4_1, Q5_0, Q5_1): the whole super-groups a weight row at a time, each streamed as a long
    // row's are (the 1 x 2 tile keeps both rows' decode and sums in 16 ymm registers only with spills; the same
    // sums a row). Zen 1, load 4-6, one-row products, HEAD vs this in one process (a copy of HEAD against HEAD:
    // 0.99-1.01x): cold Q5_0 [4864, 896] 1.007x / 1.087x (two rounds), [2560, 960] 1.067x / 1.043x, [6912, 1152]
    // 0.986x / 1.039x, [2048, 640] 1.053x / 1.051x; Q4_0 [4864, 896] 1.19x, [2048, 640] 1.17x; hot [256, 896] Q5_0
    // 1.02-1.04x, Q4_0 1.07x
    for (; kPair && M == 1 && n < ne; ++n) {
      rows[0] = w.qs + n * w.qs_row;
      float o[1][1];
      sg_tile256<F, 1, 1, LO>(rows, a, 0, w.K / 32, o, row_at, xw);
      part[n - nc] = o[0][0];
    }
    for (; n + 2 <= ne; n += 2) {
      prefetch_pair(n);
      rows[0] = w.qs + n * w.qs_row;
      rows[1] = rows[0] + w.qs_row;
      int64_t m = 0;
      for (; m + MR <= M; m += MR) {
        float o[MR][2];
        sg_tile256<F, MR, 2, LO>(rows, a, m, w.K / 32, o, ahead_of(m), xw);
        for (int r = 0; r < MR; ++r)
          for (int j = 0; j < 2; ++j) part[(m + r) * kChunk + n - nc + j] = o[r][j];
      }
      for (; m < M; ++m) {
        float o[1][2];
        sg_tile256<F, 1, 2, LO>(rows, a, m, w.K / 32, o, ahead_of(m), xw);
        for (int j = 0; j < 2; ++j) part[m * kChunk + n - nc + j] = o[0][j];
      }
    }
    if (n < ne) {
      rows[0] = w.qs + n * w.qs_row;
      for (int64_t m = 0; m < M; ++m) {
        float o[1][1];
        sg_tile256<F, 1, 1, LO>(rows, a, m, w.K / 32, o, ahead_of(m), xw);
        part[m * kChunk + n - nc] = o[0][0];
      }
    }
    if constexpr (kPair) {
      for (int64_t n = nc; n < ne; n += 2) {  // (an odd last row in both halves)
        const uint8_t* r0 = w.qs + n * w.qs_row;
        const uint8_t* r1 = n + 1 < ne ? r0 + w.qs_row : r0;
        auto put = [&](int64_t m, const float* o) {
          pre[m * kChunk + n - nc] = o[0];
          if (n + 1 < ne) pre[m * kChunk + n + 1 - nc] = o[1];
        };
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
          float o[2][2];
          sg_last_pair256<F, 2, LO>(r0, r1, a, m, w.K / 32, o, t_xb.data());
          put(m, o[0]);
          put(m + 1, o[1]);
        }
        for (; m < M; ++m) {
          float o[1][2];
          sg_last_pair256<F, 1, LO>(r0, r1, a, m, w.K / 32, o, t_xb.data());
          put(m, o[0]);
        }
      }
    } else {
      sg_tails256<F, LO>(w, a, M, nc, ne, pre, kChunk);
    }
    store_with_tails(part, pre, kChunk, M, nc, ne, bias, y, ydt, ldy);
  }
}

// a batch of decodes on one level: 4 x 2 tiles (half the accumulators of two levels); else 2 x 2
template <int F>
static void qgemm_sg256_fmt(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                            void* y, int ydt, int64_t ldy) {
  if (a.levels == 1) return sg_tiles256<F, 4, false>(w, a, M, n0, n1, bias, y, ydt, ldy);
  sg_tiles256<F, 2, true>(w, a, M, n0, n1, bias, y, ydt, ldy);
}

static void qgemm_sg256(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                        void* y, int ydt, int64_t ldy) {
  switch (w.fmt) {
    case dtn::Q8_0: return qgemm_sg256_fmt<dtn::Q8_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_0: return qgemm_sg256_fmt<dtn::Q4_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_1: return qgemm_sg256_fmt<dtn::Q4_1>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q4_K: return qgemm_sg256_fmt<dtn::Q4_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_K: return qgemm_sg256_fmt<dtn::Q5_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q6_K: return qgemm_sg256_fmt<dtn::Q6_K>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_0: return qgemm_sg256_fmt<dtn::Q5_0>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::Q5_1: return qgemm_sg256_fmt<dtn::Q5_1>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::IQ4_NL: return qgemm_sg256_fmt<dtn::IQ4_NL>(w, a, M, n0, n1, bias, y, ydt, ldy);
    case dtn::IQ4_XS: return qgemm_sg256_fmt<dtn::IQ4_XS>(w, a, M, n0, n1, bias, y, ydt, ldy);
  }
}
