// Paged KV-cache attention (llm.flash_attention_with_kvcache) for float32 / bf16 caches, one item (a sequence, a
// kv head, up to 16 query rows) at a time: keys in chunks of 64, online softmax in float32, dot products and the
// V accumulation on 16-float vectors (one zmm, two ymm, or a plain array the compiler vectorizes). The rows of an
// item that see the same keys (a decode step's query heads of one kv head) go through each chunk together, so one
// load of a K or V vector serves them all (1.4-1.6x a row at a time at one row on AVX-512).
// The attention group's kernel (slots/attention.def); included inside namespace DTN_ISA after generic.h and rows.h
// (exp_f32, V16).
#pragma once


namespace attn {
constexpr int kChunk = 64;  // keys per online-softmax step
constexpr int kRows = 16;   // rows per item at most
// A block: rows of one item that see the same keys (a decode step's G query heads; one query's heads in a prefill),
// so each K and V vector loaded serves all of them. kBlock rows at most, kKeys keys per score step, kVecs 16-float
// vectors of D per P V pass: sizes that keep the sums in registers.
#if defined(__AVX512F__)  // 32 zmm: 4 x 4 score sums, 4 rows x 4 vectors of P V
constexpr int kBlock = 4, kKeys = 4, kVecs = 4;
#elif defined(__AVX2__) && defined(__FMA__)  // 16 ymm, two to a V16
constexpr int kBlock = 2, kKeys = 2, kVecs = 2;
#else  // plain arrays: attend_item_rowwise, a row at a time (blocks of arrays spill: 0.6-0.75x)
constexpr int kBlock = 1, kKeys = 4, kVecs = 16;
#endif

// Keys a fixed distance ahead are prefetched while the scores of a chunk's first block compute (K and V rows, through
// the block table into the next chunk): the rows of a paged cache lie in blocks of a few KiB, at whose page
// boundaries the hardware's prefetchers stop, and a decode step finds them in memory (a layer's weights passed
// through the caches since)
struct Ahead {
  const void* const* k;  // k[j], v[j]: the rows to prefetch when at key j of the block, j < n
  const void* const* v;
  int64_t n, bytes;
};

static inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 3);
}

static inline void ahead(const Ahead& a, int64_t j) {
  if (j < a.n) prefetch_row(a.k[j], a.bytes), prefetch_row(a.v[j], a.bytes);
}

// s[r][j] = q_r . k_j for the NR rows of a block (q: [NR][D] float32) and keys kp[0, n): kKeys keys at a time, each
// key vector loaded once for all NR rows, the NR x kKeys sums reduced together.
template <int NV, int NR, class C>
static void block_scores(const float* q, const C* const* kp, int64_t n, float (*s)[kChunk], const Ahead& pre,
                         int64_t off = 0) {
  constexpr int D = 16 * NV;
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) {
    for (int k = 0; k < kKeys; ++k) ahead(pre, j + k);
    V16 acc[NR][kKeys];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < kKeys; ++k) acc[r][k] = v16_zero();
    for (int v = 0; v < NV; ++v) {
      V16 kv[kKeys];
      for (int k = 0; k < kKeys; ++k) kv[k] = v16_load(kp[j + k] + off + 16 * v);
      for (int r = 0; r < NR; ++r) {
        const V16 qv = v16_load(q + r * D + 16 * v);
        for (int k = 0; k < kKeys; ++k) acc[r][k] = v16_fma(qv, kv[k], acc[r][k]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      if constexpr (kKeys == 4) v16_sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s[r] + j);
      else
        for (int k = 0; k < kKeys; ++k) s[r][j + k] = v16_sum(acc[r][k]);
    }
  }
  for (; j < n; ++j) {
    ahead(pre, j);
    V16 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = v16_zero();
    for (int v = 0; v < NV; ++v) {
      const V16 kv = v16_load(kp[j] + off + 16 * v);
      for (int r = 0; r < NR; ++r) acc[r] = v16_fma(v16_load(q + r * D + 16 * v), kv, acc[r]);
    }
    for (int r = 0; r < NR; ++r) s[r][j] = v16_sum(acc[r]);
  }
}

// acc_r = alpha_r acc_r + sum_j p_r[j] v_j over D's vectors [V0, V0 + W) and on (W = kVecs at most): each V vector
// loaded once for all NR rows; a lone row keeps two chains of keys so the FMA latency hides (AVX-512). v_j starts
// `off` values into row vp[j].
template <int NV, int NR, int V0, class C>
static void block_pv(float* const* acc, const float (*p)[kChunk], const C* const* vp, int64_t n, const float* alpha,
                     int64_t off = 0) {
  constexpr int W = NV - V0 < kVecs ? NV - V0 : kVecs;
  constexpr int CH = kTwoChains && NR * W < 8 ? 2 : 1;
  V16 o[CH][NR][W];
  for (int r = 0; r < NR; ++r) {
    const V16 a = v16_set1(alpha[r]);
    for (int w = 0; w < W; ++w) {
      o[0][r][w] = v16_mul(v16_load(acc[r] + 16 * (V0 + w)), a);
      if constexpr (CH == 2) o[1][r][w] = v16_zero();
    }
  }
  int64_t j = 0;
  for (; j + CH <= n; j += CH)
    for (int c = 0; c < CH; ++c) {
      V16 vv[W];
      for (int w = 0; w < W; ++w) vv[w] = v16_load(vp[j + c] + off + 16 * (V0 + w));
      for (int r = 0; r < NR; ++r) {
        const V16 pj = v16_set1(p[r][j + c]);
        for (int w = 0; w < W; ++w) o[c][r][w] = v16_fma(pj, vv[w], o[c][r][w]);
      }
    }
  for (; j < n; ++j) {
    V16 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = v16_load(vp[j] + off + 16 * (V0 + w));
    for (int r = 0; r < NR; ++r) {
      const V16 pj = v16_set1(p[r][j]);
      for (int w = 0; w < W; ++w) o[0][r][w] = v16_fma(pj, vv[w], o[0][r][w]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w) {
      if constexpr (CH == 2) o[0][r][w] = v16_add(o[0][r][w], o[1][r][w]);
      v16_store(acc[r] + 16 * (V0 + w), o[0][r][w]);
    }
  if constexpr (V0 + W < NV) block_pv<NV, NR, V0 + W>(acc, p, vp, n, alpha, off);
}

// The running softmax of one row over its scores p[0, n) of this chunk (scaled in place to exp(scale p - m)):
// m, l and bad updated, and the factor that rescales what the row accumulated before returned
static inline float online_softmax(float* p, int64_t n, float scale, float& m, float& l, bool& bad) {
  float mx = m;
  int nonfinite = 0;
#pragma omp simd reduction(max : mx) reduction(| : nonfinite)
  for (int64_t k = 0; k < n; ++k) {
    p[k] *= scale;
    nonfinite |= !(p[k] - p[k] == 0.f);  // NaN or an inf (x - x is NaN for both)
    mx = p[k] > mx ? p[k] : mx;
  }
  bad = bad || nonfinite;
  const float alpha = m == -INFINITY ? 0.f : exp_f32(m - mx);  // rescales what came before
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < n; ++k) {
    p[k] = exp_f32(p[k] - mx);
    sum += p[k];
  }
  l = l * alpha + sum;
  m = mx;
  return alpha;
}

// Each row's output: its sums over l, rounded once; a row that sees no key gives zeros (as flash-attn), and a row
// that read a non-finite q, k or v value is NaN (the rule every provider follows)
template <class T, int D>
static void finish(float (*acc)[D], T* const* op, const int64_t* lim, const float* l, const bool* bad, int nr) {
  for (int r = 0; r < nr; ++r) {
    const float inv = lim[r] > 0 ? 1.f / l[r] : 0.f;
    float* a = acc[r];
    int nonfinite = bad[r];  // a non-finite value in a visible v row shows in the sums (p v, or 0 * inf)
#pragma omp simd reduction(| : nonfinite)
    for (int d = 0; d < D; ++d) nonfinite |= !(a[d] - a[d] == 0.f);
    if (nonfinite)
      for (int d = 0; d < D; ++d) a[d] = NAN;
#pragma omp simd
    for (int d = 0; d < D; ++d) {
      if constexpr (sizeof(T) == 4) op[r][d] = a[d] * inv;
      else op[r][d] = f32_to_bf16(a[d] * inv);
    }
  }
}

// One block's share of a chunk: NR rows from row b of the item, seeing keys kp/vp[0, n) of it
template <int NV, int NR, class C>
static void block_chunk(const float* qf, float (*acc)[16 * NV], const C* const* kp, const C* const* vp, int64_t n,
                        float scale, float* m, float* l, bool* bad, const Ahead& pre) {
  alignas(64) float p[NR][kChunk];
  float alpha[NR];
  float* rows[NR];
  block_scores<NV, NR>(qf, kp, n, p, pre);
  for (int r = 0; r < NR; ++r) {
    alpha[r] = online_softmax(p[r], n, scale, m[r], l[r], bad[r]);
    rows[r] = acc[r];
  }
  block_pv<NV, NR, 0>(rows, p, vp, n, alpha);
}

// One item: for each row, softmax(scale * q k^T) v over its visible keys, accumulated chunk by chunk. Rows that see
// the same keys go through a chunk together in blocks of kBlock; the next chunk's rows are prefetched meanwhile.
// The keys [lo, lim) that query row i of an item's nq rows sees among its n keys (causal: up to its own position;
// sliding: from the window's oldest key on), widening the item's range [kmin, kmax) to take them in
static inline void row_keys(const dtn::AttnCall& c, int64_t n, int64_t nq, int64_t i, int64_t& lo, int64_t& lim,
                            int64_t& kmin, int64_t& kmax) {
  const int64_t seen = c.causal ? n - nq + i + 1 : n;  // keys [0, seen) visible
  lim = seen < 0 ? 0 : (seen > n ? n : seen);
  const int64_t first = c.window > 0 ? n - nq + i - c.window + 1 : 0;  // sliding: the window's oldest key
  lo = first < 0 ? 0 : first;
  if (lo > lim) lo = lim;
  kmax = lim > kmax ? lim : kmax;
  kmin = lo < kmin ? lo : kmin;
}

// An item's sequence as its kernel reads it: its nq query rows from q0, its n keys in the blocks of its table row,
// its kv head's K and V columns (D values a key)
template <class C>
struct ItemSeq {
  int64_t q0, nq, n;
  const int32_t* blocks;
  const C* kc;
  const C* vc;
};

template <class C, int D>
static inline ItemSeq<C> item_seq(const dtn::AttnCall& c, const dtn::AttnItem& it) {
  const int64_t q0 = c.cu_q[it.seq];
  return {q0, c.cu_q[it.seq + 1] - q0, c.seqlens_k[it.seq], c.table + it.seq * c.ld_table,
          static_cast<const C*>(c.k) + it.head * D, static_cast<const C*>(c.v) + it.head * D};
}

template <class T, class C, int NV>
static void attend_item(const dtn::AttnCall& c, const dtn::AttnItem& it) {
  constexpr int D = 16 * NV;
  const int64_t G = c.G, bs = c.block_size, row = c.hkv * D, h = it.head;
  const auto [q0, nq, n, blocks, kc, vc] = item_seq<C, D>(c, it);
  const int nr = it.r1 - it.r0;
  T* op[kRows];
  int64_t lim[kRows], lo[kRows], kmax = 0, kmin = INT64_MAX;  // row r sees keys [lo[r], lim[r])
  float m[kRows], l[kRows];
  bool bad[kRows];  // a non-finite score seen: q or a visible key holds a NaN or an inf
  alignas(64) float qf[kRows][D];
  alignas(64) float acc[kRows][D];
  for (int r = 0; r < nr; ++r) {
    const int64_t rr = it.r0 + r, i = rr / G, hq = h * G + rr % G;
    const T* qp = static_cast<const T*>(c.q) + (q0 + i) * c.q_tok + hq * c.q_head;
    op[r] = static_cast<T*>(c.out) + (q0 + i) * c.o_tok + hq * c.o_head;
    row_keys(c, n, nq, i, lo[r], lim[r], kmin, kmax);
    m[r] = -INFINITY;
    l[r] = 0.f;
    bad[r] = false;
    for (int d = 0; d < D; ++d) qf[r][d] = ld(qp, d);
    for (int v = 0; v < NV; ++v) v16_store(acc[r] + 16 * v, v16_zero());
  }
  // blocks: runs of consecutive rows with the same keys, kBlock at most
  int nb = 0, start[kRows + 1];
  for (int r = 0; r < nr; ++r)
    if (r == 0 || r - start[nb - 1] == kBlock || lo[r] != lo[r - 1] || lim[r] != lim[r - 1]) start[nb++] = r;
  start[nb] = nr;
  if (kmin > kmax) kmin = kmax;
  const C* kpc[2 * kChunk];  // this chunk's key rows through the block table [0, cn), then the next one's
  const C* vpc[2 * kChunk];
  const int64_t row_bytes = D * int64_t(sizeof(C));
  auto rows_of = [&](int64_t j0, int64_t at) {  // the chunk from key j0: its row count, pointers from kpc/vpc[at]
    const int64_t cn = kmax - j0 < kChunk ? kmax - j0 : kChunk;
    int64_t b = j0 / bs, off = j0 % bs;  // no division per key
    for (int64_t jj = 0; jj < cn; ++jj) {
      const int64_t slot = int64_t(blocks[b]) * bs + off;
      kpc[at + jj] = kc + slot * row;
      vpc[at + jj] = vc + slot * row;
      if (++off == bs) off = 0, ++b;
    }
    return cn;
  };
  // prefetch distance: ~8 KiB of keys ahead, at least 4 keys
  const int64_t dist = row_bytes >= 2048 ? 4 : 8192 / row_bytes;
  int64_t cn = kmin < kmax ? rows_of(kmin, 0) : 0;
  for (int64_t j0 = kmin; j0 < kmax; j0 += kChunk) {
    const int64_t nn = j0 + kChunk < kmax ? rows_of(j0 + kChunk, cn) : 0;
    bool first = true;
    for (int bi = 0; bi < nb; ++bi) {
      const int r = start[bi], nrb = start[bi + 1] - r;
      const int64_t s0 = lo[r] > j0 ? lo[r] - j0 : 0;  // the block's keys of the chunk: [s0, s0 + cr)
      const int64_t cr = (lim[r] - j0 < cn ? lim[r] - j0 : cn) - s0;
      if (cr <= 0) continue;
      const C* const* kp = kpc + s0;
      const C* const* vp = vpc + s0;
      const int64_t far = s0 + dist < cn + nn ? cn + nn - s0 - dist : 0;  // rows past the chunk's next one: none
      const Ahead pre{reinterpret_cast<const void* const*>(kp + dist), reinterpret_cast<const void* const*>(vp + dist),
                      first ? far : 0, row_bytes};
      first = false;
      switch (nrb) {
        case 1: block_chunk<NV, 1>(qf[r], acc + r, kp, vp, cr, c.scale, m + r, l + r, bad + r, pre); break;
        case 2:
          if constexpr (kBlock >= 2) block_chunk<NV, 2>(qf[r], acc + r, kp, vp, cr, c.scale, m + r, l + r, bad + r, pre);
          break;
        case 3:
          if constexpr (kBlock >= 3) block_chunk<NV, 3>(qf[r], acc + r, kp, vp, cr, c.scale, m + r, l + r, bad + r, pre);
          break;
        default:
          if constexpr (kBlock >= 4) block_chunk<NV, 4>(qf[r], acc + r, kp, vp, cr, c.scale, m + r, l + r, bad + r, pre);
          break;
      }
    }
    for (int64_t jj = 0; jj < nn; ++jj) kpc[jj] = kpc[cn + jj], vpc[jj] = vpc[cn + jj];  // the next chunk to the front
    cn = nn;
  }
  finish<T, D>(acc, op, lim, l, bad, nr);
}

// The portable unit's item (plain arrays, which the blocks would spill): a row at a time, 4 keys per score step
template <class T, class C, int NV>
static void attend_item_rowwise(const dtn::AttnCall& c, const dtn::AttnItem& it) {
  constexpr int D = 16 * NV;
  const int64_t G = c.G, bs = c.block_size, row = c.hkv * D, h = it.head;
  const auto [q0, nq, n, blocks, kc, vc] = item_seq<C, D>(c, it);
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
    row_keys(c, n, nq, i, lo[r], lim[r], kmin, kmax);
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
      const float alpha = online_softmax(p, cr, scale, m[r], l[r], bad[r]);
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
  finish<T, D>(acc, op, lim, l, bad, nr);
}

// == One query row over its kv heads, key by key ==================================================================
// A decode step's row of a sequence finds its keys in memory (a layer's weights passed through the caches since the
// last step), and an item per kv head reads D of every Hkv D values of the cache rows: ~5-10 GB/s. Here the items of
// consecutive heads go together (one head too): for each key the nh D values of their K (then V) vectors lie side by
// side, and each chunk's K and V spans are first read front to back by plain loads (software prefetches of the same
// lines gained nothing on this machine, an AMD Zen 4), so the keys arrive at the read rate and the scores and P V
// then run on cached rows. Keys from memory, 129 of them: Llama 3.2 1B (8 heads of 64) 1.2-1.4x, Qwen2.5-1.5B (2 of
// 128) 1.1-1.2x, Gemma 3 1B (1 of 256) 1.25x; with the keys already cached it costs ~1.3x (the loads first). Same
// sums in the same order as attend_item's (scores per key and row; P V chained over the chunk's keys in steps of
// kPvKeys).
constexpr int kHeadRows = 32;      // rows (nh x G) at most: q, the sums and the scores stay in L1
constexpr int kHeadFloats = 2048;  // rows x D at most (8 KiB each for q and the sums)
constexpr int kPvKeys = 8;         // keys per P V step (each step reloads a block's sums)

// items[i..] of one sequence's single query row, kv heads h, h + 1, ... each with all its G rows: how many go
// together (0: attend_item instead)
static inline int64_t head_run(const dtn::AttnCall& c, const dtn::AttnItem* items, int64_t i, int64_t i1) {
  const dtn::AttnItem& it = items[i];
  if (c.cu_q[it.seq + 1] - c.cu_q[it.seq] != 1 || it.r0 != 0 || it.r1 != c.G) return 0;
  int64_t k = 1;
  while (i + k < i1 && (k + 1) * c.G <= kHeadRows && (k + 1) * c.G * c.D <= kHeadFloats) {
    const dtn::AttnItem& nx = items[i + k];
    if (nx.seq != it.seq || nx.head != it.head + k || nx.r0 != 0 || nx.r1 != c.G) break;
    ++k;
  }
  return k;
}

// Every 64-byte line of the spans [p, p + span) of K and V rows kp[0, n), vp[0, n) loaded once (their values
// discarded): the loads are independent, so many lines are in flight at once. span: a multiple of 32 bytes, >= 64.
static inline void touch_rows(const char* const* kp, const char* const* vp, int64_t n, int64_t span) {
  V16 t0 = v16_zero(), t1 = v16_zero(), t2 = v16_zero(), t3 = v16_zero();  // four chains: the adds never wait
  const int64_t last = span - 64;  // a span of 32-byte multiples ends on its last 64 bytes (overlapping)
  for (int64_t j = 0; j < n; ++j) {
    int64_t b = 0;
    for (; b + 128 <= span; b += 128) {
      t0 = v16_add(t0, v16_load(reinterpret_cast<const float*>(kp[j] + b)));
      t1 = v16_add(t1, v16_load(reinterpret_cast<const float*>(kp[j] + b + 64)));
      t2 = v16_add(t2, v16_load(reinterpret_cast<const float*>(vp[j] + b)));
      t3 = v16_add(t3, v16_load(reinterpret_cast<const float*>(vp[j] + b + 64)));
    }
    if (b < span) {
      const int64_t e = b < last ? b : last;
      t0 = v16_add(t0, v16_load(reinterpret_cast<const float*>(kp[j] + e)));
      t2 = v16_add(t2, v16_load(reinterpret_cast<const float*>(vp[j] + e)));
    }
  }
  volatile float keep = v16_sum(v16_add(v16_add(t0, t1), v16_add(t2, t3)));  // the loads must happen
  (void)keep;
}

// the rows of a block (NR of them, from q row / sums row r) at one step: scores of keys kp[jj, jj + n) or P V of
// vp[jj, jj + n), each key's vector `off` values into its row
template <int NV, int NR, class C>
static inline void heads_scores(const float* qf, float (*p)[kChunk], int r, const C* const* kp, int64_t jj, int64_t n,
                                int64_t off) {
  static const Ahead none{nullptr, nullptr, 0, 0};
  block_scores<NV, NR>(qf + r * 16 * NV, kp + jj, n, reinterpret_cast<float (*)[kChunk]>(&p[r][jj]), none, off);
}

template <int NV, int NR, class C>
static inline void heads_pv(float* acc, float (*p)[kChunk], int r, const C* const* vp, int64_t jj, int64_t n,
                            const float* alpha, int64_t off) {
  float* rows[NR];
  for (int i = 0; i < NR; ++i) rows[i] = acc + (r + i) * 16 * NV;
  block_pv<NV, NR, 0>(rows, reinterpret_cast<const float (*)[kChunk]>(&p[r][jj]), vp + jj, n, alpha + r, off);
}

// CALL(NR) for each block of the G rows of each of the nh heads (kBlock rows at most), with r its first row and off
// its head's offset into a key's span
#define DTN_HEAD_BLOCKS(nh, G, CALL)                                                   \
  for (int64_t hh = 0; hh < (nh); ++hh)                                                \
    for (int64_t g = 0; g < (G); g += kBlock) {                                         \
      const int r = int(hh * (G) + g), nrb = int((G) - g < kBlock ? (G) - g : kBlock); \
      const int64_t off = hh * D;                                                       \
      switch (nrb) {                                                                    \
        case 1: CALL(1); break;                                                         \
        case 2: if constexpr (kBlock >= 2) CALL(2); break;                              \
        case 3: if constexpr (kBlock >= 3) CALL(3); break;                              \
        default: if constexpr (kBlock >= 4) CALL(4); break;                             \
      }                                                                                 \
    }

template <class T, class C, int NV>
static void attend_heads(const dtn::AttnCall& c, int64_t seq, int64_t h0, int64_t nh) {
  constexpr int D = 16 * NV;
  const int64_t G = c.G, bs = c.block_size, row = c.hkv * D, R = nh * G;
  const int64_t q0 = c.cu_q[seq], n = c.seqlens_k[seq];
  const int32_t* blocks = c.table + seq * c.ld_table;
  const C* kc = static_cast<const C*>(c.k) + h0 * D;  // key j's values of head h0 + hh: kc + slot(j) row + hh D
  const C* vc = static_cast<const C*>(c.v) + h0 * D;
  int64_t lo, lim, kmin = INT64_MAX, kmax = 0;  // every row sees keys [lo, lim)
  row_keys(c, n, 1, 0, lo, lim, kmin, kmax);
  T* op[kHeadRows];
  int64_t lims[kHeadRows];
  float m[kHeadRows], l[kHeadRows], alpha[kHeadRows], ones[kHeadRows];
  bool bad[kHeadRows];
  alignas(64) float qf[kHeadFloats];  // [R][D]
  alignas(64) float acc[kHeadFloats];
  alignas(64) float p[kHeadRows][kChunk];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t hq = h0 * G + r;
    const T* qp = static_cast<const T*>(c.q) + q0 * c.q_tok + hq * c.q_head;
    op[r] = static_cast<T*>(c.out) + q0 * c.o_tok + hq * c.o_head;
    for (int d = 0; d < D; ++d) qf[r * D + d] = ld(qp, d);
    for (int v = 0; v < NV; ++v) v16_store(acc + r * D + 16 * v, v16_zero());
    m[r] = -INFINITY, l[r] = 0.f, bad[r] = false, lims[r] = lim, ones[r] = 1.f;
  }
  const int64_t span = nh * D * int64_t(sizeof(C));  // bytes of a key's heads, side by side
  const C* kpc[kChunk];
  const C* vpc[kChunk];
  for (int64_t j0 = lo; j0 < lim; j0 += kChunk) {
    const int64_t cn = lim - j0 < kChunk ? lim - j0 : kChunk;
    int64_t b = j0 / bs, o = j0 % bs;  // this chunk's cache rows through the block table (no division per key)
    for (int64_t jj = 0; jj < cn; ++jj) {
      const int64_t slot = int64_t(blocks[b]) * bs + o;
      kpc[jj] = kc + slot * row;
      vpc[jj] = vc + slot * row;
      if (++o == bs) o = 0, ++b;
    }
    touch_rows(reinterpret_cast<const char* const*>(kpc), reinterpret_cast<const char* const*>(vpc), cn, span);
    for (int64_t jj = 0; jj < cn; jj += kKeys) {  // scores: kKeys keys of every head, then the next keys
      const int64_t nk = cn - jj < kKeys ? cn - jj : kKeys;
#define DTN_SCORES(NR) heads_scores<NV, NR>(qf, p, r, kpc, jj, nk, off)
      DTN_HEAD_BLOCKS(nh, G, DTN_SCORES)
#undef DTN_SCORES
    }
    for (int64_t r = 0; r < R; ++r) alpha[r] = online_softmax(p[r], cn, c.scale, m[r], l[r], bad[r]);
    for (int64_t jj = 0; jj < cn; jj += kPvKeys) {  // P V: kPvKeys keys of every head, then the next keys
      const int64_t nk = cn - jj < kPvKeys ? cn - jj : kPvKeys;
      const float* scale_by = jj == 0 ? alpha : ones;  // the chunk's rescale once, on its first keys
#define DTN_PV(NR) heads_pv<NV, NR>(acc, p, r, vpc, jj, nk, scale_by, off)
      DTN_HEAD_BLOCKS(nh, G, DTN_PV)
#undef DTN_PV
    }
  }
  finish<T, D>(reinterpret_cast<float (*)[D]>(acc), op, lims, l, bad, int(R));
}
#undef DTN_HEAD_BLOCKS

template <class T, class C, int NV = 1>
static void attend_items(const dtn::AttnCall& c, const dtn::AttnItem* items, int64_t i0, int64_t i1) {
  if constexpr (NV < 16) {
    if (c.D != 16 * NV) return attend_items<T, C, NV + 1>(c, items, i0, i1);
  }
  for (int64_t i = i0; i < i1;) {
    if constexpr (kBlock > 1) {
      const int64_t nh = head_run(c, items, i, i1);
      if (nh > 0) {
        attend_heads<T, C, NV>(c, items[i].seq, items[i].head, nh);
        i += nh;
        continue;
      }
      attend_item<T, C, NV>(c, items[i++]);
    } else {
      attend_item_rowwise<T, C, NV>(c, items[i++]);
    }
  }
}
}  // namespace attn

static void attend(const dtn::AttnCall& c, const dtn::AttnItem* items, int64_t i0, int64_t i1) {
  // q and out in c.dt, the caches in c.cdt (a bf16 cache under float32 activations: half the bytes read)
  if (c.dt == F32 && c.cdt == F32) attn::attend_items<float, float>(c, items, i0, i1);
  else if (c.dt == F32) attn::attend_items<float, uint16_t>(c, items, i0, i1);
  else if (c.cdt == F32) attn::attend_items<uint16_t, float>(c, items, i0, i1);
  else attn::attend_items<uint16_t, uint16_t>(c, items, i0, i1);
}
