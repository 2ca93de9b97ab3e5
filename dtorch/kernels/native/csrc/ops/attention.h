// Paged KV-cache attention (llm.flash_attention_with_kvcache) for float32 / bf16 caches, one item (a sequence, a
// kv head, up to 16 query rows) at a time: keys in chunks of 64, online softmax in float32, dot products and the
// V accumulation on 16-float vectors (one zmm, two ymm, or a plain array the compiler vectorizes).
// The attention group's kernel (ops/attention.def); included inside namespace DTN_ISA after generic.h and rows.h
// (exp_f32, V16).
#pragma once


namespace attn {
constexpr int kChunk = 64;  // keys per online-softmax step
constexpr int kRows = 16;   // rows per item at most

// One item: for each row, softmax(scale * q k^T) v over its visible keys, accumulated chunk by chunk.
template <class T, class C, int NV>
static void attend_item(const dtn::AttnCall& c, const dtn::AttnItem& it) {
  constexpr int D = 16 * NV;
  const int64_t G = c.G, bs = c.block_size, row = c.hkv * D, h = it.head;
  const int64_t q0 = c.cu_q[it.seq], nq = c.cu_q[it.seq + 1] - q0, n = c.seqlens_k[it.seq];
  const int32_t* blocks = c.table + it.seq * c.ld_table;
  const C* kc = static_cast<const C*>(c.k) + h * D;
  const C* vc = static_cast<const C*>(c.v) + h * D;
  const int nr = it.r1 - it.r0;
  const float scale = c.scale;
  const T* qp[kRows];
  T* op[kRows];
  int64_t lim[kRows], lo[kRows], kmax = 0, kmin = INT64_MAX;  // row r sees keys [lo[r], lim[r])
  float m[kRows], l[kRows];
  bool bad[kRows];  // a non-finite score seen: q or a visible key holds a NaN or an inf
  alignas(64) float acc[kRows][D];
  for (int r = 0; r < nr; ++r) {
    const int64_t rr = it.r0 + r, i = rr / G, hq = h * G + rr % G;
    qp[r] = static_cast<const T*>(c.q) + (q0 + i) * c.q_tok + hq * c.q_head;
    op[r] = static_cast<T*>(c.out) + (q0 + i) * c.o_tok + hq * c.o_head;
    const int64_t seen = c.causal ? n - nq + i + 1 : n;  // keys [0, seen) visible
    lim[r] = seen < 0 ? 0 : (seen > n ? n : seen);
    const int64_t first = c.window > 0 ? n - nq + i - c.window + 1 : 0;  // sliding: the window's oldest key
    lo[r] = first < 0 ? 0 : first;
    if (lo[r] > lim[r]) lo[r] = lim[r];
    kmax = lim[r] > kmax ? lim[r] : kmax;
    kmin = lo[r] < kmin ? lo[r] : kmin;
    m[r] = -INFINITY;
    l[r] = 0.f;
    bad[r] = false;
    for (int v = 0; v < NV; ++v) v16_store(acc[r] + 16 * v, v16_zero());
  }
  const C* kpc[kChunk];
  const C* vpc[kChunk];
  alignas(64) float p[kChunk];
  if (kmin > kmax) kmin = kmax;
  for (int64_t j0 = kmin; j0 < kmax; j0 += kChunk) {
    const int64_t cn = kmax - j0 < kChunk ? kmax - j0 : kChunk;
    int64_t b = j0 / bs, off = j0 % bs;  // this chunk's key rows through the block table (no division per key)
    for (int64_t jj = 0; jj < cn; ++jj) {
      const int64_t slot = int64_t(blocks[b]) * bs + off;
      kpc[jj] = kc + slot * row;
      vpc[jj] = vc + slot * row;
      if (++off == bs) off = 0, ++b;
    }
    for (int r = 0; r < nr; ++r) {
      const int64_t s0 = lo[r] > j0 ? lo[r] - j0 : 0;  // this row's keys of the chunk: [s0, cr)
      const int64_t cr = (lim[r] - j0 < cn ? lim[r] - j0 : cn) - s0;
      if (cr <= 0) continue;
      const C* const* kp = kpc + s0;
      const C* const* vp = vpc + s0;
      V16 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = v16_load(qp[r] + 16 * v);
      int64_t jj = 0;
      for (; jj + 4 <= cr; jj += 4) {  // scores of 4 keys, reduced together
        V16 s0 = v16_mul(qv[0], v16_load(kp[jj])), s1 = v16_mul(qv[0], v16_load(kp[jj + 1]));
        V16 s2 = v16_mul(qv[0], v16_load(kp[jj + 2])), s3 = v16_mul(qv[0], v16_load(kp[jj + 3]));
        for (int v = 1; v < NV; ++v) {
          s0 = v16_fma(qv[v], v16_load(kp[jj] + 16 * v), s0);
          s1 = v16_fma(qv[v], v16_load(kp[jj + 1] + 16 * v), s1);
          s2 = v16_fma(qv[v], v16_load(kp[jj + 2] + 16 * v), s2);
          s3 = v16_fma(qv[v], v16_load(kp[jj + 3] + 16 * v), s3);
        }
        v16_sum4(s0, s1, s2, s3, p + jj);
      }
      for (; jj < cr; ++jj) {
        V16 s0 = v16_mul(qv[0], v16_load(kp[jj]));
        for (int v = 1; v < NV; ++v) s0 = v16_fma(qv[v], v16_load(kp[jj] + 16 * v), s0);
        p[jj] = v16_sum(s0);
      }
      float mx = m[r];
      int nonfinite = 0;
#pragma omp simd reduction(max : mx) reduction(| : nonfinite)
      for (int64_t k = 0; k < cr; ++k) {
        p[k] *= scale;
        nonfinite |= !(p[k] - p[k] == 0.f);  // NaN or an inf (x - x is NaN for both)
        mx = p[k] > mx ? p[k] : mx;
      }
      bad[r] = bad[r] || nonfinite;
      const float alpha = m[r] == -INFINITY ? 0.f : exp_f32(m[r] - mx);  // rescales what came before
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t jj = 0; jj < cr; ++jj) {
        p[jj] = exp_f32(p[jj] - mx);
        sum += p[jj];
      }
      l[r] = l[r] * alpha + sum;
      m[r] = mx;
      V16 o[NV], o2[NV];
      const V16 va = v16_set1(alpha);
      for (int v = 0; v < NV; ++v) o[v] = v16_mul(v16_load(acc[r] + 16 * v), va), o2[v] = v16_zero();
      int64_t j = 0;
      if constexpr (kTwoChains) {
        for (; j + 2 <= cr; j += 2) {
          const V16 p0 = v16_set1(p[j]), p1 = v16_set1(p[j + 1]);
          for (int v = 0; v < NV; ++v) {
            o[v] = v16_fma(p0, v16_load(vp[j] + 16 * v), o[v]);
            o2[v] = v16_fma(p1, v16_load(vp[j + 1] + 16 * v), o2[v]);
          }
        }
      }
      for (; j < cr; ++j) {
        const V16 pj = v16_set1(p[j]);
        for (int v = 0; v < NV; ++v) o[v] = v16_fma(pj, v16_load(vp[j] + 16 * v), o[v]);
      }
      if constexpr (kTwoChains)
        for (int v = 0; v < NV; ++v) o[v] = v16_add(o[v], o2[v]);
      for (int v = 0; v < NV; ++v) v16_store(acc[r] + 16 * v, o[v]);
    }
  }
  for (int r = 0; r < nr; ++r) {  // normalize; a row that sees no key gives zeros (as flash-attn)
    const float inv = lim[r] > 0 ? 1.f / l[r] : 0.f;
    float* a = acc[r];
    int nonfinite = bad[r];  // a non-finite value in a visible v row shows in the sums (p v, or 0 * inf)
#pragma omp simd reduction(| : nonfinite)
    for (int d = 0; d < D; ++d) nonfinite |= !(a[d] - a[d] == 0.f);
    if (nonfinite)  // the rule every provider follows: a row reading a non-finite q, k or v value is NaN
      for (int d = 0; d < D; ++d) a[d] = NAN;
#pragma omp simd
    for (int d = 0; d < D; ++d) {
      if constexpr (sizeof(T) == 4) op[r][d] = a[d] * inv;
      else op[r][d] = f32_to_bf16(a[d] * inv);
    }
  }
}

template <class T, class C, int NV = 1>
static void attend_items(const dtn::AttnCall& c, const dtn::AttnItem* items, int64_t i0, int64_t i1) {
  if constexpr (NV < 16) {
    if (c.D != 16 * NV) return attend_items<T, C, NV + 1>(c, items, i0, i1);
  }
  for (int64_t i = i0; i < i1; ++i) attend_item<T, C, NV>(c, items[i]);
}
}  // namespace attn

static void attend(const dtn::AttnCall& c, const dtn::AttnItem* items, int64_t i0, int64_t i1) {
  // q and out in c.dt, the caches in c.cdt (a bf16 cache under float32 activations: half the bytes read)
  if (c.dt == F32 && c.cdt == F32) attn::attend_items<float, float>(c, items, i0, i1);
  else if (c.dt == F32) attn::attend_items<float, uint16_t>(c, items, i0, i1);
  else if (c.cdt == F32) attn::attend_items<uint16_t, float>(c, items, i0, i1);
  else attn::attend_items<uint16_t, uint16_t>(c, items, i0, i1);
}
