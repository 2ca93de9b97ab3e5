// Decode steps of the recurrent mixers of hybrid models (Qwen3-Next's Gated DeltaNet layers): the short causal
// conv's update (llm.causal_conv1d_update) and one step of the gated delta rule (llm.gated_delta_net), both
// computed in float32 as the torch kernels of dtorch/kernels/torch/{causal_conv1d,gated_delta_net}.py.
// The recurrent group's kernels (its slots: slots/recurrent.def); included inside namespace DTN_ISA after
// generic.h and rows.h (ld, st, exp_f32, V16).
#pragma once

using dtn::ConvCall;
using dtn::GdnCall;

// the state rows of channels [d0, d1) advanced by one step
template <class T>
static void conv_shift(const ConvCall& c, int64_t d0, int64_t d1) {
  const int64_t S = c.S, D = c.D;
  if (d1 <= d0) return;
  for (int64_t b = 0; b < c.B; ++b) {  // flat, the shift by one is one move within [d0 S, d1 S); then x goes last
    if (!c.write[b]) continue;
    const T* x = static_cast<const T*>(c.x) + b * c.ldx;
    T* s = static_cast<T*>(c.state) + c.rows[b] * D * S;
    std::memmove(s + d0 * S, s + d0 * S + 1, size_t((d1 - d0) * S - 1) * sizeof(T));
    for (int64_t d = d0; d < d1; ++d) s[d * S + S - 1] = x[d];
  }
}

// channels in blocks of kConvBlock: each tap is one strided pass over the block, so the sums and the SiLU vectorize
constexpr int64_t kConvBlock = 64;

template <class T>
static void conv_update_t(const ConvCall& c, int64_t d0, int64_t d1) {
  const T* w = static_cast<const T*>(c.weight);
  const T* bias = static_cast<const T*>(c.bias);
  const int64_t W = c.W, S = c.S, D = c.D, first = S + 1 - W;  // the window's oldest state column
  float acc[kConvBlock];
  for (int64_t b = 0; b < c.B; ++b) {  // all outputs first: a later row may read a state an earlier one names
    const T* x = static_cast<const T*>(c.x) + b * c.ldx;
    const T* srow = static_cast<const T*>(c.state) + c.rows[b] * D * S;
    T* out = static_cast<T*>(c.out) + b * c.ldo;
    for (int64_t e0 = d0; e0 < d1; e0 += kConvBlock) {  // the taps in the reference's order: w 0, 1, ..., bias
      const int64_t n = std::min(kConvBlock, d1 - e0);
      const T* s = srow + e0 * S;
      const T* wd = w + e0 * W;
      const T* xe = x + e0;
      if (W == 1) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) acc[i] = ld(xe, i) * ld(wd, i);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) acc[i] = ld(s, i * S + first) * ld(wd, i * W);
        for (int64_t j = 1; j < W - 1; ++j) {
#pragma omp simd
          for (int64_t i = 0; i < n; ++i) acc[i] += ld(s, i * S + first + j) * ld(wd, i * W + j);
        }
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) acc[i] += ld(xe, i) * ld(wd, i * W + W - 1);
      }
      if (bias) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) acc[i] += ld(bias, e0 + i);
      }
      if (c.silu) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) acc[i] = acc[i] / (1.f + exp_f32(-acc[i]));
      }
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) st(out + e0, i, acc[i]);
    }
  }
  conv_shift<T>(c, d0, d1);
}

// the outputs for the common widths, W and S known at compile time: the compiler reads the interleaved state and
// weight columns with vector loads and permutes instead of strided gathers
template <class T, int W, int S>
static void conv_outputs_fixed(const ConvCall& c, int64_t d0, int64_t d1) {
  const T* w = static_cast<const T*>(c.weight);
  const T* bias = static_cast<const T*>(c.bias);
  constexpr int first = S + 1 - W;
  for (int64_t b = 0; b < c.B; ++b) {
    const T* x = static_cast<const T*>(c.x) + b * c.ldx;
    const T* s = static_cast<const T*>(c.state) + c.rows[b] * c.D * S;
    T* out = static_cast<T*>(c.out) + b * c.ldo;
#pragma omp simd
    for (int64_t d = d0; d < d1; ++d) {
      float acc = ld(s, d * S + first) * ld(w, d * W);
      for (int j = 1; j < W - 1; ++j) acc += ld(s, d * S + first + j) * ld(w, d * W + j);
      acc += ld(x, d) * ld(w, d * W + W - 1);
      if (bias) acc += ld(bias, d);
      if (c.silu) acc = acc / (1.f + exp_f32(-acc));
      st(out, d, acc);
    }
  }
}

template <class T>
static void conv_update_dt(const ConvCall& c, int64_t d0, int64_t d1) {
#if defined(__AVX512F__)  // measured on AVX2 and plain builds, the blocked form runs faster (~46 vs ~58 us, D 6144)
  if (c.W == 4 && (c.S == 3 || c.S == 4)) {
    if (c.S == 3) conv_outputs_fixed<T, 4, 3>(c, d0, d1);
    else conv_outputs_fixed<T, 4, 4>(c, d0, d1);
    return conv_shift<T>(c, d0, d1);
  }
#endif
  conv_update_t<T>(c, d0, d1);
}

static void conv_update(const ConvCall& c, int64_t d0, int64_t d1) {
  if (c.dt == F32) conv_update_dt<float>(c, d0, d1);
  else conv_update_dt<uint16_t>(c, d0, d1);
}

// dst[0..n) = src[0..n) as float32 (src of dtype dt)
static inline void load_row(const void* src, int dt, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_f(src, dt, i);
}

// value head h of batch row b: S' = exp(g) S + k u^T with u = beta (v - exp(g) S^T k), o = S'^T (q scale),
// computed from the state before the step (o = exp(g) S^T q + (q.k) u), so S is read twice: once for both
// products, once for the update (a head's 64 KiB stays in L2 between them)
static void gdn_item(const GdnCall& c, int64_t b, int64_t h) {
  const int64_t K = c.K, V = c.V, hk = h / (c.H / c.Hk);
  alignas(64) float q[dtn::kGdnMaxDim], k[dtn::kGdnMaxDim], sk[dtn::kGdnMaxDim], sq[dtn::kGdnMaxDim],
      u[dtn::kGdnMaxDim];
  load_row(static_cast<const char*>(c.q) + (b * c.q_b + hk * c.q_h) * (c.dt == F32 ? 4 : 2), c.dt, K, q);
  load_row(static_cast<const char*>(c.k) + (b * c.k_b + hk * c.k_h) * (c.dt == F32 ? 4 : 2), c.dt, K, k);
  float qs = c.scale, ks = 1.f;
  if (c.l2norm) {  // x * rsqrt(sum x^2 + 1e-6)
    float sqq = 0.f, skk = 0.f;
    for (int64_t i = 0; i < K; ++i) sqq += q[i] * q[i], skk += k[i] * k[i];
    qs *= 1.f / std::sqrt(sqq + 1e-6f);
    ks = 1.f / std::sqrt(skk + 1e-6f);
  }
  float qk = 0.f;
  for (int64_t i = 0; i < K; ++i) {
    q[i] *= qs;
    k[i] *= ks;
    qk += q[i] * k[i];
  }
  const float decay = std::exp(c.g[b * c.g_b + h * c.g_h]);
  const float beta = load_f(c.beta, c.beta_dt, b * c.beta_b + h * c.beta_h);
  const int64_t row = (c.rows[b] * c.H + h) * K * V;
  const float* S = c.state_in ? c.state_in + row : nullptr;
  if (S) {
    for (int64_t j0 = 0; j0 < V; j0 += 64) {  // 4 vectors of columns for k and for q
      const int nv = int(std::min<int64_t>(64, V - j0) / 16);
      V16 ak[4] = {v16_zero(), v16_zero(), v16_zero(), v16_zero()}, aq[4] = {ak[0], ak[0], ak[0], ak[0]};
      for (int64_t i = 0; i < K; ++i) {
        const V16 kv = v16_set1(k[i]), qv = v16_set1(q[i]);
        const float* s = S + i * V + j0;
        for (int t = 0; t < nv; ++t) {
          const V16 sv = v16_load(s + 16 * t);
          ak[t] = v16_fma(sv, kv, ak[t]);
          aq[t] = v16_fma(sv, qv, aq[t]);
        }
      }
      for (int t = 0; t < nv; ++t) {
        v16_store(sk + j0 + 16 * t, ak[t]);
        v16_store(sq + j0 + 16 * t, aq[t]);
      }
    }
  } else {
    for (int64_t j = 0; j < V; ++j) sk[j] = sq[j] = 0.f;
  }
  const int64_t esz = c.dt == F32 ? 4 : 2;
  const void* vp = static_cast<const char*>(c.v) + (b * c.v_b + h * c.v_h) * esz;
  void* op = static_cast<char*>(c.o) + (b * c.o_b + h * c.o_h) * esz;
  for (int64_t j = 0; j < V; ++j) {
    u[j] = beta * (load_f(vp, c.dt, j) - decay * sk[j]);
    store_f(op, c.dt, j, decay * sq[j] + qk * u[j]);
  }
  if (!c.state_out || !c.write[b]) return;
  float* So = c.state_out + row;
  const V16 dv = v16_set1(decay);
  for (int64_t i = 0; i < K; ++i) {
    const V16 kv = v16_set1(k[i]);
    for (int64_t j = 0; j < V; j += 16) {
      const V16 ku = v16_mul(kv, v16_load(u + j));
      v16_store(So + i * V + j, S ? v16_add(v16_mul(dv, v16_load(S + i * V + j)), ku) : ku);
    }
  }
}

static void gdn_step(const GdnCall& c, const int64_t* items, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) gdn_item(c, items[i] / c.H, items[i] % c.H);
}
