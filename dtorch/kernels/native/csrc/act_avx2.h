// The activations of the super-grouped formats (SGAct) with AVX2: generic.h's quantize_sg, bit for bit, in 256-bit
// vectors. Per block of 32: amax, d = amax / 127, the hi levels round(x / d) and the lo levels of the residual, with
// quantize_block's float operations in its order (no FMA; vcvtps2dq rounds to nearest even as round_i8 does); each
// half's level sums from the int32 levels (exact), scaled as quantize_block scales them; per super-group the blocks'
// bytes transposed to the steps' order ([u][block j][4] at period P) by rows_to_lanes256. Every qlinear call on AVX2
// quantizes its x once: the scalar loop cost ~4.7 us at K = 896 and ~25 us at K = 4864 on this session's Zen VM (a
// one-row Q8_0 product of [896, 896] takes ~100 us).
// Included inside namespace DTN_ISA of isa_avx2.cpp, after quant_avx2.h (lanes_mask, rows_to_lanes256).

static inline __m256 load_x8(const void* x, int dt, int64_t off) {  // 8 floats of x (f32 or bf16)
  if (dt == F32) return _mm256_loadu_ps(static_cast<const float*>(x) + off);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + off));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 32 int32 levels (4 vectors, values 8 i .. 8 i + 7) as 32 int8 in order
static inline __m256i levels_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void quantize_sg256(const void* x, int dt, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int8_t* q,
                           float* d, float* s, float* sh, int levels) {
  const int64_t nb = K / 32, nsg = (nb + 15) / 16;
  const __m256 k127 = _mm256_set1_ps(127.f), m127 = _mm256_set1_ps(-127.f);
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  alignas(32) int8_t th[16 * 32], tl[16 * 32];  // a super-group's blocks: hi and lo levels, 32 bytes a block
  for (int64_t r = r0; r < r1; ++r) {
    const SGRow row = sg_row(q, d, s, sh, r, nb);
    int8_t* qr = row.q;
    float *dr = row.d, *sr = row.s, *hr = row.sh;
    for (int64_t g = 0; g < nsg; ++g) {
      const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16), P = sg_period(S);
      for (int j = 0; j < S; ++j) {
        const int64_t off = r * ldx + (g * 16 + j) * 32, b = g * 16 + j;
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = load_x8(x, dt, off + 8 * i);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absm), _mm256_and_ps(v[1], absm)),
                                  _mm256_max_ps(_mm256_and_ps(v[2], absm), _mm256_and_ps(v[3], absm)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f, idl = id * 254.f;
        const __m256 vid = _mm256_set1_ps(id), vd = _mm256_set1_ps(dd), vidl = _mm256_set1_ps(idl);
        __m256i hi[4], lo[4];
        for (int i = 0; i < 4; ++i) {
          hi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
          const __m256 t = _mm256_mul_ps(_mm256_sub_ps(v[i], _mm256_mul_ps(vd, _mm256_cvtepi32_ps(hi[i]))), vidl);
          lo[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(t, k127), m127));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(th + 32 * j), levels_i8(hi[0], hi[1], hi[2], hi[3]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(tl + 32 * j), levels_i8(lo[0], lo[1], lo[2], lo[3]));
        // [sum hi 0..15, sum hi 16..31, sum lo 0..15, sum lo 16..31]
        const __m256i a = _mm256_hadd_epi32(_mm256_add_epi32(hi[0], hi[1]), _mm256_add_epi32(hi[2], hi[3]));
        const __m256i c = _mm256_hadd_epi32(_mm256_add_epi32(lo[0], lo[1]), _mm256_add_epi32(lo[2], lo[3]));
        const __m256i e = _mm256_hadd_epi32(a, c);
        alignas(16) int32_t hs[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(hs),
                        _mm_add_epi32(_mm256_castsi256_si128(e), _mm256_extracti128_si256(e, 1)));
        float sums[2];
        for (int h = 0; h < 2; ++h)
          sums[h] = dd * (float(hs[h]) + (levels == 2 ? float(hs[2 + h]) * (1.f / 254.f) : 0.f));
        dr[b] = dd;
        sr[b] = sums[0] + sums[1];
        hr[g * 32 + j] = sums[0];
        hr[g * 32 + 16 + j] = sums[1];
      }
      for (int h = 0; h * 8 < S; ++h) {  // out[u] lane i: dword u of block 8 h + i
        const int nr = S - 8 * h < 8 ? S - 8 * h : 8;
        for (int lv = 0; lv < 2; ++lv) {
          __m256i out[8];
          rows_to_lanes256(reinterpret_cast<const uint8_t*>(lv ? tl : th) + 256 * h, 32, nr, 8, out);
          int8_t* o = qr + g * 1024 + 512 * lv + 32 * h;
          for (int u = 0; u < 8; ++u) {
            if (P == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 64 * u), out[u]);
            else _mm256_maskstore_epi32(reinterpret_cast<int*>(o + 4 * u * P), lanes_mask(P), out[u]);
          }
        }
      }
    }
  }
}
