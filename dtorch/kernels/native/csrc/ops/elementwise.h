// Decode-step elementwise kernels in plain C++ (vectorized by the compiler for each ISA unit), matching the
// torch reference kernels of dtorch/kernels/torch/llm.py: statistics in float32, low precision rounded where
// the reference rounds. The elementwise group's kernels (ops/elementwise.def); included inside namespace DTN_ISA
// after generic.h and rows.h (ld, st, exp_f32), by its group's objects only.
#pragma once

// rows [r0, r1) of [R, D]; res == nullptr: h = x, else h = round(x + res) stored to res_out (may alias res).
// out = round(w * round(h * rsqrt(mean(h^2) + eps))) (one rounding for float32), out may alias x.
static void rms_norm(const void* x, const void* res, void* res_out, const void* w, void* out, int dt, int64_t r0,
                     int64_t r1, int64_t D, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * D;
    float ss = 0.f;
    if (dt == F32) {
      const float* xr = static_cast<const float*>(x) + o;
      const float* hr = xr;
      if (res) {
        const float* rr = static_cast<const float*>(res) + o;
        float* ho = static_cast<float*>(res_out) + o;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) ho[i] = rr[i] + xr[i];
        hr = ho;
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += hr[i] * hr[i];
      const float scale = 1.f / std::sqrt(ss / float(D) + eps);
      const float* wr = static_cast<const float*>(w);
      float* outr = static_cast<float*>(out) + o;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) outr[i] = wr[i] * (hr[i] * scale);
    } else {
      const uint16_t* xr = static_cast<const uint16_t*>(x) + o;
      const uint16_t* hr = xr;
      if (res) {
        const uint16_t* rr = static_cast<const uint16_t*>(res) + o;
        uint16_t* ho = static_cast<uint16_t*>(res_out) + o;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) ho[i] = f32_to_bf16(bf16_to_f32(rr[i]) + bf16_to_f32(xr[i]));
        hr = ho;
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += bf16_to_f32(hr[i]) * bf16_to_f32(hr[i]);
      const float scale = 1.f / std::sqrt(ss / float(D) + eps);
      const uint16_t* wr = static_cast<const uint16_t*>(w);
      uint16_t* outr = static_cast<uint16_t*>(out) + o;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i)
        outr[i] = f32_to_bf16(bf16_to_f32(wr[i]) * round_to(BF16, bf16_to_f32(hr[i]) * scale));
    }
  }
}

template <class T>
static void rope_t(const T* x, int64_t ldx, T* out, int64_t ldo, const float* cos, const float* sin, int64_t ldc,
                   int64_t P, int64_t r0, int64_t r1, int64_t H, int64_t D, int64_t rot, bool interleaved) {
  const int64_t half = rot / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* c = cos + (r % P) * ldc;
    const float* s = sin + (r % P) * ldc;
    for (int64_t h = 0; h < H; ++h) {
      const T* xr = x + r * ldx + h * D;
      T* orow = out + r * ldo + h * D;
      if (interleaved) {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = ld(xr, 2 * i), b = ld(xr, 2 * i + 1);
          st(orow, 2 * i, a * c[i] - b * s[i]);
          st(orow, 2 * i + 1, b * c[i] + a * s[i]);
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = ld(xr, i), b = ld(xr, i + half);
          st(orow, i, a * c[i] - b * s[i]);
          st(orow, i + half, b * c[i] + a * s[i]);
        }
      }
      if (orow != xr)
        for (int64_t i = rot; i < D; ++i) orow[i] = xr[i];
    }
  }
}

// rows [r0, r1) of x [R, H, D] (R = batch * T positions, row stride ldx); cos/sin [P, rot/2] float32, row r % P.
// Half split (NeoX/Llama): (i, i + rot/2); interleaved (GPT-J): (2i, 2i + 1). Computed in float32, rounded once.
static void rope(const void* x, int64_t ldx, void* out, int64_t ldo, int dt, const float* cos, const float* sin,
                 int64_t ldc, int64_t P, int64_t r0, int64_t r1, int64_t H, int64_t D, int64_t rot, bool interleaved) {
  if (dt == F32)
    rope_t(static_cast<const float*>(x), ldx, static_cast<float*>(out), ldo, cos, sin, ldc, P, r0, r1, H, D, rot,
           interleaved);
  else
    rope_t(static_cast<const uint16_t*>(x), ldx, static_cast<uint16_t*>(out), ldo, cos, sin, ldc, P, r0, r1, H, D,
           rot, interleaved);
}

// The gated activations, act(gate) for out = act(gate) * up:
//  - silu(x) = x / (1 + exp(-x));
//  - gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)) with u = sqrt(2 / pi) (x + 0.044715 x^3) (GeGLU, Gemma).
struct Silu {
  static inline float act(float x) { return x / (1.f + exp_f32(-x)); }
};
struct GeluTanh {
  static inline float act(float x) { return x / (1.f + exp_f32(-1.5957691216057308f * (x + 0.044715f * x * x * x))); }
};

// out = act(gate) * up; bf16: the activation rounded to bf16, then the product rounded (as torch's F.silu / F.gelu
// then mul)
template <class A, class T>
static void glu_t(const T* gate, const T* up, int64_t ldg, int64_t ldu, T* out, int64_t r0, int64_t r1, int64_t I) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = gate + r * ldg;
    const T* u = up + r * ldu;
    T* o = out + r * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      float a = A::act(ld(g, i));
      if constexpr (sizeof(T) == 2) a = bf16_to_f32(f32_to_bf16(a));
      st(o, i, a * ld(u, i));
    }
  }
}

template <class A>
static void glu(const void* gate, const void* up, int64_t ldg, int64_t ldu, void* out, int dt, int64_t r0, int64_t r1,
                int64_t I) {
  if (dt == F32)
    glu_t<A>(static_cast<const float*>(gate), static_cast<const float*>(up), ldg, ldu, static_cast<float*>(out), r0,
             r1, I);
  else
    glu_t<A>(static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up), ldg, ldu,
             static_cast<uint16_t*>(out), r0, r1, I);
}

static void silu_and_mul(const void* gate, const void* up, int64_t ldg, int64_t ldu, void* out, int dt, int64_t r0,
                         int64_t r1, int64_t I) {
  glu<Silu>(gate, up, ldg, ldu, out, dt, r0, r1, I);
}

static void gelu_tanh_and_mul(const void* gate, const void* up, int64_t ldg, int64_t ldu, void* out, int dt,
                              int64_t r0, int64_t r1, int64_t I) {
  glu<GeluTanh>(gate, up, ldg, ldu, out, dt, r0, r1, I);
}
