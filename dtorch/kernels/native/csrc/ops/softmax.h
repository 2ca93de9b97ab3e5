// The softmax group's kernel (ops/softmax.def): llm.softmax_last_dim row by row in float32 (the max, the sum of
// exp(x - max), then each exp(x - max) / sum rounded once to out's dtype), as the torch kernel's float32 softmax.
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

// float32: each exp once, kept in out (out[i] is written after x[i] is read: out may be x), then divided
static void softmax_rows(const float* x, int64_t ldx, float* out, int64_t ldo, int64_t r0, int64_t r1, int64_t D) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * ldx;
    float* o = out + r * ldo;
    const float m = row_max(xr, D);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < D; ++i) {
      const float e = exp_f32(xr[i] - m);
      o[i] = e;
      s += e;
    }
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] = o[i] / s;
  }
}

// bfloat16: the exps computed twice (for the sum, then for out), so each is rounded once, after the division
static void softmax_rows(const uint16_t* x, int64_t ldx, uint16_t* out, int64_t ldo, int64_t r0, int64_t r1,
                         int64_t D) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* xr = x + r * ldx;
    uint16_t* o = out + r * ldo;
    const float m = row_max(xr, D);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < D; ++i) s += exp_f32(ld(xr, i) - m);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) st(o, i, exp_f32(ld(xr, i) - m) / s);
  }
}

// rows [r0, r1) of a.x [R, D] into a.out
static void softmax_last_dim(const dtn::softmax_last_dim_args& a, int64_t r0, int64_t r1) {
  if (a.dt == F32)
    softmax_rows(static_cast<const float*>(a.x), a.ld_x, static_cast<float*>(a.out), a.ld_out, r0, r1, a.D);
  else
    softmax_rows(static_cast<const uint16_t*>(a.x), a.ld_x, static_cast<uint16_t*>(a.out), a.ld_out, r0, r1, a.D);
}
