// Decode-step elementwise kernels in plain C++ (vectorized by the compiler for each ISA unit), matching the
// torch reference kernels of dtorch/kernels/torch/llm.py: statistics in float32, low precision rounded where
// the reference rounds. The elementwise group's kernels (its rows ops/elementwise.def, its slots
// slots/elementwise.def); included inside namespace DTN_ISA after generic.h and rows.h (ld, st, exp_f32), by its
// group's objects only.
#pragma once

// rows [r0, r1), each of D elements at its own row stride; res == nullptr: h = x, else h = round(x + res) stored to
// res_out (may alias res). out = round(w * round(h * rsqrt(mean(h^2) + eps))) (one rounding for float32), out may
// alias x (h is read before out is written).
template <class T>
static void rms_rows(const T* x, int64_t ldx, const T* res, int64_t ldr, T* res_out, int64_t ldro, const T* w, T* out,
                     int64_t ldo, int64_t r0, int64_t r1, int64_t D, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * ldx;
    const T* hr = xr;
    if (res) {
      const T* rr = res + r * ldr;
      T* ho = res_out + r * ldro;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) st(ho, i, ld(rr, i) + ld(xr, i));
      hr = ho;
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; ++i) ss += ld(hr, i) * ld(hr, i);
    const float scale = 1.f / std::sqrt(ss / float(D) + eps);
    T* outr = out + r * ldo;
    if constexpr (sizeof(T) == 4) {
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) outr[i] = w[i] * (hr[i] * scale);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) st(outr, i, ld(w, i) * round_to(BF16, ld(hr, i) * scale));
    }
  }
}

// llm.rms_norm: rows [r0, r1) of a.x into a.out
static void rms_norm(const dtn::rms_norm_args& a, int64_t r0, int64_t r1) {
  if (a.dt == F32)
    rms_rows<float>(static_cast<const float*>(a.x), a.ld_x, nullptr, 0, nullptr, 0, static_cast<const float*>(a.weight),
                    static_cast<float*>(a.out), a.ld_out, r0, r1, a.D, a.eps);
  else
    rms_rows<uint16_t>(static_cast<const uint16_t*>(a.x), a.ld_x, nullptr, 0, nullptr, 0,
                       static_cast<const uint16_t*>(a.weight), static_cast<uint16_t*>(a.out), a.ld_out, r0, r1, a.D,
                       a.eps);
}

// llm.add_rms_norm: rows [r0, r1) of a.x and a.residual into a.out and a.residual_out
static void add_rms_norm(const dtn::add_rms_norm_args& a, int64_t r0, int64_t r1) {
  if (a.dt == F32)
    rms_rows<float>(static_cast<const float*>(a.x), a.ld_x, static_cast<const float*>(a.residual), a.ld_residual,
                    static_cast<float*>(a.residual_out), a.ld_residual_out, static_cast<const float*>(a.weight),
                    static_cast<float*>(a.out), a.ld_out, r0, r1, a.D, a.eps);
  else
    rms_rows<uint16_t>(static_cast<const uint16_t*>(a.x), a.ld_x, static_cast<const uint16_t*>(a.residual),
                       a.ld_residual, static_cast<uint16_t*>(a.residual_out), a.ld_residual_out,
                       static_cast<const uint16_t*>(a.weight), static_cast<uint16_t*>(a.out), a.ld_out, r0, r1, a.D,
                       a.eps);
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
static void glu_t(const T* gate, const T* up, int64_t ldg, int64_t ldu, T* out, int64_t ldo, int64_t r0, int64_t r1,
                  int64_t I) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = gate + r * ldg;
    const T* u = up + r * ldu;
    T* o = out + r * ldo;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      float a = A::act(ld(g, i));
      if constexpr (sizeof(T) == 2) a = bf16_to_f32(f32_to_bf16(a));
      st(o, i, a * ld(u, i));
    }
  }
}

// a DTN_OP row of a gated activation (silu_and_mul_args, gelu_tanh_and_mul_args: gate, up, out)
template <class A, class Args>
static void glu_row(const Args& a, int64_t r0, int64_t r1) {
  if (a.dt == F32)
    glu_t<A>(static_cast<const float*>(a.gate), static_cast<const float*>(a.up), a.ld_gate, a.ld_up,
             static_cast<float*>(a.out), a.ld_out, r0, r1, a.D);
  else
    glu_t<A>(static_cast<const uint16_t*>(a.gate), static_cast<const uint16_t*>(a.up), a.ld_gate, a.ld_up,
             static_cast<uint16_t*>(a.out), a.ld_out, r0, r1, a.D);
}

static void silu_and_mul(const dtn::silu_and_mul_args& a, int64_t r0, int64_t r1) { glu_row<Silu>(a, r0, r1); }

static void gelu_tanh_and_mul(const dtn::gelu_tanh_and_mul_args& a, int64_t r0, int64_t r1) {
  glu_row<GeluTanh>(a, r0, r1);
}

// binary.mul_scalar: rows [r0, r1) of a.x times a.value into a.out (may alias x)
template <class T>
static void scale_rows(const T* x, int64_t ldx, T* out, int64_t ldo, float value, int64_t r0, int64_t r1, int64_t D) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * ldx;
    T* o = out + r * ldo;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) st(o, i, ld(xr, i) * value);
  }
}

static void mul_scalar(const dtn::mul_scalar_args& a, int64_t r0, int64_t r1) {
  if (a.dt == F32)
    scale_rows(static_cast<const float*>(a.x), a.ld_x, static_cast<float*>(a.out), a.ld_out, a.value, r0, r1, a.D);
  else
    scale_rows(static_cast<const uint16_t*>(a.x), a.ld_x, static_cast<uint16_t*>(a.out), a.ld_out, a.value, r0, r1,
               a.D);
}

// the slot silu_mul (slots/elementwise.def): moe_decode's hidden rows, out rows I apart
static void silu_mul(const void* gate, const void* up, int64_t ldg, int64_t ldu, void* out, int dt, int64_t r0,
                     int64_t r1, int64_t I) {
  if (dt == F32)
    glu_t<Silu>(static_cast<const float*>(gate), static_cast<const float*>(up), ldg, ldu, static_cast<float*>(out), I,
                r0, r1, I);
  else
    glu_t<Silu>(static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up), ldg, ldu,
                static_cast<uint16_t*>(out), I, r0, r1, I);
}
