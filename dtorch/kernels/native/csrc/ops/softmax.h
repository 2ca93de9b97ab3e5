// The softmax group's kernel (ops/softmax.def): llm.softmax_last_dim row by row in float32 (the max, the sum of
// exp(x - max), then each exp(x - max) times 1 / sum rounded once to out's dtype), as the torch kernel's float32
// softmax.
// Reads x[r, i] before it writes out[r, i], so out may be x. Included inside namespace DTN_ISA after generic.h
// and rows.h (ld, st, exp_f32).
#pragma once

// the row's max (NaN-free rows: a NaN anywhere gives NaN, as torch)
template <class T>
static inline float row_max(const T* x, int64_t D) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < D; ++i) {
    const float v = ld(x, i);
    m = v > m ? v : m;
  }
  return m;
}

// exp(x[i] - m) into e[i] (e may be x when T is float32) and their sum, each exp once
template <class T>
static inline float exp_sum(const T* x, float m, float* e, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < D; ++i) {
    const float v = exp_f32(ld(x, i) - m);
    e[i] = v;
    s += v;
  }
  return s;
}

// Each row: its max, the exps kept in float32 (in out itself for float32; for bfloat16 in a per-thread float32 row,
// so each exp is computed once and rounded once, after the scaling), then scaled by 1 / sum (as torch's vectorized
// softmax: one product per element instead of a division, ~4x faster on AVX2). out[i] is written after x[i] is
// read: out may be x.
template <class T>
static void softmax_rows(const T* x, int64_t ldx, T* out, int64_t ldo, int64_t r0, int64_t r1, int64_t D) {
  thread_local std::vector<float> scratch;  // bfloat16 rows' exps; grows, never shrinks
  if constexpr (sizeof(T) == 2)
    if (int64_t(scratch.size()) < D) scratch.resize(size_t(D));
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * ldx;
    T* o = out + r * ldo;
    const float m = row_max(xr, D);
    float* e = sizeof(T) == 4 ? reinterpret_cast<float*>(o) : scratch.data();
    const float inv = 1.f / exp_sum(xr, m, e, D);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) st(o, i, e[i] * inv);
  }
}

// rows [r0, r1) of a.x [R, D] into a.out
static void softmax_last_dim(const dtn::softmax_last_dim_args& a, int64_t r0, int64_t r1) {
  if (a.dt == F32)
    softmax_rows<float>(static_cast<const float*>(a.x), a.ld_x, static_cast<float*>(a.out), a.ld_out, r0, r1, a.D);
  else
    softmax_rows<uint16_t>(static_cast<const uint16_t*>(a.x), a.ld_x, static_cast<uint16_t*>(a.out), a.ld_out, r0,
                           r1, a.D);
}
