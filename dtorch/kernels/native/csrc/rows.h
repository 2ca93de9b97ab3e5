// What every group's kernels may call, included by each ISA unit inside its namespace DTN_ISA after generic.h and
// before its group's header (ops/<group>.h): float32 / bf16 element access, a vectorizable exp, and a vector of 16
// floats in this unit's registers. A group's header includes no other group's header, so an edit to one group's
// kernels (or a new DTN_OP row, whose dtn::<name>_args only its own group's objects see) recompiles that group only.
#pragma once

// float32 / bf16 element access with the type fixed at compile time, so the loops that use it vectorize
static inline float ld(const float* p, int64_t i) { return p[i]; }
static inline float ld(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void st(float* p, int64_t i, float v) { p[i] = v; }
static inline void st(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// exp (the gated activations, attention's and softmax's exps): Cody-Waite range reduction and a degree-6 polynomial
// (< 2 ulp over float32), written so that a loop calling it vectorizes on every ISA (libm's expf does not without
// -ffast-math). Each ISA gets the form GCC vectorizes best, all giving the same bits (k = round(x / ln 2) to
// nearest even; x clamped to [-87.3, 88.3], so 2^k stays a normal float; a NaN stays NaN):
//  - the clamp: on AVX-512 a plain `x < lo ? lo : ...` (masked blends); elsewhere GCC turns that into a branch to a
//    folded constant, which stops the vectorizer, so it is a blend of the bits by compare masks;
//  - the rounding: nearbyint (vrndscaleps / vroundps) where SSE4.1 has it; the portable unit has only SSE2, where
//    nearbyint is a libm call, so it adds and subtracts 1.5 * 2^23 (exact for |x / ln 2| < 2^22).
// A silu loop over 24576 floats, one core: AVX-512 11.6 us, AVX2 18.2 us (111 with the plain clamp), SSE2 38 us
// (138 with nearbyint).
static inline float exp_f32(float x) {
  constexpr float lo = -87.3f, hi = 88.3f;
#if defined(__AVX512F__)
  x = x < lo ? lo : (x > hi ? hi : x);
#else
  int32_t xi, lo_i, hi_i;
  std::memcpy(&xi, &x, 4);
  std::memcpy(&lo_i, &lo, 4);
  std::memcpy(&hi_i, &hi, 4);
  const int32_t below = -int32_t(x < lo), above = -int32_t(x > hi);  // all ones where true
  xi = (xi & ~(below | above)) | (lo_i & below) | (hi_i & above);
  std::memcpy(&x, &xi, 4);
#endif
#if defined(__SSE4_1__)
  const float k = std::nearbyint(x * 1.44269504088896341f);
#else
  const float k = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
#endif
  const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (int32_t(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// -- a vector of 16 floats in this unit's registers -----------------------------------------------------------
#if defined(__AVX512F__)
struct V16 { __m512 a; };
static inline V16 v16_zero() { return {_mm512_setzero_ps()}; }
static inline V16 v16_set1(float x) { return {_mm512_set1_ps(x)}; }
static inline V16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V16 v16_load(const uint16_t* p) {  // bf16 -> float32: the bits shifted up
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
static inline V16 v16_fma(V16 x, V16 y, V16 acc) { return {_mm512_fmadd_ps(x.a, y.a, acc.a)}; }
static inline V16 v16_mul(V16 x, V16 y) { return {_mm512_mul_ps(x.a, y.a)}; }
static inline V16 v16_add(V16 x, V16 y) { return {_mm512_add_ps(x.a, y.a)}; }
static inline float v16_sum(V16 x) { return _mm512_reduce_add_ps(x.a); }
// out[0..3] = the sums of a, b, c, d: 128-bit quarters folded pairwise, then within each quarter
static inline void v16_sum4(V16 a, V16 b, V16 c, V16 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a.a, b.a, 0x44), _mm512_shuffle_f32x4(a.a, b.a, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c.a, d.a, 0x44), _mm512_shuffle_f32x4(c.a, d.a, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // quarter i: x_i
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));  // every element of quarter i: sum(x_i)
  const __m512 firsts = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12), s);
  _mm_storeu_ps(out, _mm512_castps512_ps128(firsts));
}
constexpr bool kTwoChains = true;  // 32 registers: two accumulator sets hide the FMA latency in P V
static inline void v16_store(float* p, V16 x) { _mm512_storeu_ps(p, x.a); }
#elif defined(__AVX2__) && defined(__FMA__)
struct V16 { __m256 a, b; };
static inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 v16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline __m256 bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline V16 v16_load(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
static inline V16 v16_fma(V16 x, V16 y, V16 acc) {
  return {_mm256_fmadd_ps(x.a, y.a, acc.a), _mm256_fmadd_ps(x.b, y.b, acc.b)};
}
static inline V16 v16_mul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V16 v16_add(V16 x, V16 y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline float v16_sum(V16 x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline void v16_sum4(V16 a, V16 b, V16 c, V16 d, float* out) {  // out[0..3] = the sums of a, b, c, d
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(_mm256_add_ps(a.a, a.b), _mm256_add_ps(b.a, b.b)),
                                  _mm256_hadd_ps(_mm256_add_ps(c.a, c.b), _mm256_add_ps(d.a, d.b)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
static inline void v16_store(float* p, V16 x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
constexpr bool kTwoChains = false;  // 16 registers: one V16 is already two independent chains
#else
struct V16 { float a[16]; };
static inline V16 v16_zero() { return V16{}; }
static inline V16 v16_set1(float x) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = x; return r; }
static inline V16 v16_load(const float* p) { V16 r; std::memcpy(r.a, p, sizeof(r.a)); return r; }
static inline V16 v16_load(const uint16_t* p) { V16 r; for (int i = 0; i < 16; ++i) r.a[i] = bf16_to_f32(p[i]); return r; }
static inline V16 v16_fma(V16 x, V16 y, V16 acc) { for (int i = 0; i < 16; ++i) acc.a[i] += x.a[i] * y.a[i]; return acc; }
static inline V16 v16_mul(V16 x, V16 y) { for (int i = 0; i < 16; ++i) x.a[i] *= y.a[i]; return x; }
static inline V16 v16_add(V16 x, V16 y) { for (int i = 0; i < 16; ++i) x.a[i] += y.a[i]; return x; }
static inline float v16_sum(V16 x) {  // pairwise, as the SIMD paths
  for (int w = 8; w; w /= 2)
    for (int i = 0; i < w; ++i) x.a[i] += x.a[i + w];
  return x.a[0];
}
static inline void v16_sum4(V16 a, V16 b, V16 c, V16 d, float* out) {
  out[0] = v16_sum(a), out[1] = v16_sum(b), out[2] = v16_sum(c), out[3] = v16_sum(d);
}
static inline void v16_store(float* p, V16 x) { std::memcpy(p, x.a, sizeof(x.a)); }
constexpr bool kTwoChains = false;
#endif
