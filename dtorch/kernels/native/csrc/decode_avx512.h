// One-row products (decode: under 4 rows of x) of the super-grouped formats with AVX-512 VNNI, at the memory's read
// rate: the weight's rows are read one after another, each once, ahead_rows on prefetched, and every row's sum is the
// bits the tiles of quant_avx512.h give it (a row gets the same result at every row count: speculative decoding's
// verified rows equal plain decoding).
// - whole super-groups: sg_tile512<F, 1, 1>'s float operations in the same order, its integer sums (exact, any order)
//   split over two chains each, so a row waits on half the vpdpbusd latency; the 32-block formats four weight rows
//   at a time, each activation vector loaded once for the four (a core with 64 bytes of loads a cycle spent the one-row
//   loop on x's loads: 1.1-1.25x at K = 640-1024, two levels);
// - a 32-block format's last super-group of S < 16 blocks: per row, each block's integer sums in its own lane (the
//   weights' 4 S bytes per step spread to the activations' P = sg_period(S) lanes per step, then the 16 / P lanes of
//   a block added up), times x's scale; per 16 rows those floats are transposed to one row per lane and finished as
//   sg_tails512 finishes them (its per-block chain of multiply-adds), instead of transposing every quant of the rows.
// Included inside namespace DTN_ISA of isa_avx512.cpp, after quant_avx512.h.

// Where the weights of each activation vector of a last super-group of S < 16 blocks come from (a 32-block format):
// vector v holds steps s0 = v 16 / P .. of every block, lane l being step s0 + l / P of block l % P; its weight dwords
// are `count` dwords from dword `first` of the quants (Q4: of the first four steps, whose low nibbles meet steps 0..3
// and high nibbles steps 4..7), lane l taking dword idx[l] (zero where `valid` is clear), the high nibble where `high`
// is set, Q5's fifth bit from bit `shift` of each byte of its block's high-bit dword.
struct TailPlan {
  int S, P, nv;  // nv: activation vectors per level
  int first[8], count[8];
  __m512i idx[8], shift[8], hidx;  // hidx: lane l -> block l % P (the high-bit dwords)
  __mmask16 valid[8], high[8], hvalid;
  bool spread;  // false where every lane's dword is its own: the dwords already lie as the lanes want them
};

template <int F>
static inline TailPlan tail_plan(int S) {
  TailPlan t{};
  t.S = S;
  t.P = sg_period(S);
  const int P = t.P, per = 16 / P, steps = 8;  // activation steps per vector; 8 steps a block
  t.nv = P >= 2 ? P / 2 : 1;
  alignas(64) int32_t idx[16], sh[16], hid[16];
  for (int v = 0; v < t.nv; ++v) {
    const int s0 = v * per;
    // Q8_0: step s is dwords s S ..; Q4: step s is the nibbles of dwords (s % 4) S ..
    t.first[v] = F == dtn::Q8_0 ? s0 * S : (s0 % 4) * S;
    int count = 0;
    t.valid[v] = t.high[v] = 0;
    for (int l = 0; l < 16; ++l) {
      const int s = s0 + l / P, j = l % P;
      const int dw = F == dtn::Q8_0 ? s * S + j : (s % 4) * S + j;
      idx[l] = dw - t.first[v] >= 0 && dw - t.first[v] < 16 ? dw - t.first[v] : 0;
      sh[l] = s < steps ? s : 0;
      hid[l] = j < S ? j : 0;
      if (j < S && s < steps) {
        t.valid[v] |= __mmask16(1u << l);
        count = dw - t.first[v] + 1 > count ? dw - t.first[v] + 1 : count;
      }
      if (s >= 4 && s < steps) t.high[v] |= __mmask16(1u << l);
    }
    t.count[v] = count;
    for (int l = 0; l < 16; ++l)
      if ((t.valid[v] >> l & 1) && idx[l] != l) t.spread = true;
    t.idx[v] = _mm512_load_si512(idx);
    t.shift[v] = _mm512_load_si512(sh);
    t.hidx = _mm512_load_si512(hid);
  }
  t.hvalid = 0;
  for (int l = 0; l < 16; ++l)
    if (l % P < S) t.hvalid |= __mmask16(1u << l);
  return t;
}

// lanes l of x summed over l % P: lanes 0..P-1 hold the sums (exact integer adds)
static inline __attribute__((always_inline)) __m512i fold_lanes(__m512i x, int P) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int w = 8; w >= P; w /= 2)
    x = _mm512_add_epi32(x, _mm512_permutexvar_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32(w)), x));
  return x;
}

// Activation vector v's weights in a last super-group at p (its scales, high bits and quants as layouts.py packs a
// super-group of S blocks): unsigned quants as the tiles multiply them
template <int F>
static inline __m512i tail_weights(const TailPlan& t, const uint8_t* p, int v) {
  using G = SG<F>;
  const uint8_t* q = p + 2 * t.S * G::scales + t.S * G::hbytes;
  const __m512i raw = _mm512_maskz_loadu_epi32(__mmask16((1u << t.count[v]) - 1), q + 4 * t.first[v]);
  __m512i x = t.spread ? _mm512_maskz_permutexvar_epi32(t.valid[v], t.idx[v], raw)
                       : _mm512_maskz_mov_epi32(t.valid[v], raw);
  if constexpr (F == dtn::Q8_0) return x;
  const __m512i lo4 = _mm512_set1_epi8(0x0f);
  x = _mm512_mask_blend_epi32(t.high[v], _mm512_and_si512(x, lo4), _mm512_and_si512(_mm512_srli_epi16(x, 4), lo4));
  if constexpr (G::hbytes != 0) {  // bit s of each byte of the block's high-bit dword: step s's fifth bit
    const __m512i h = _mm512_maskz_permutexvar_epi32(
        t.hvalid, t.hidx, _mm512_maskz_loadu_epi32(__mmask16((1u << t.S) - 1), p + 2 * t.S * G::scales));
    x = _mm512_or_si512(x, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, t.shift[v]),
                                                              _mm512_set1_epi32(0x01010101)), 4));
  }
  if constexpr (F == dtn::IQ4_NL) x = _mm512_shuffle_epi8(iq4_table512(), x);
  return x;
}

// row r's lanes of tail_lanes512 from its integer sums: lane b < S = block b's levels times x's scale of the block
template <bool LO, int NR>
static inline void tail_finish512(const TailPlan& t, const SGAct& a, int64_t m, const __m512i* is, const __m512i* il,
                                  float* pl) {
  const __mmask16 km = __mmask16((1u << t.S) - 1);
  const __m512 da = _mm512_maskz_loadu_ps(km, a.d + (m * a.nsg + a.nsg - 1) * 16);
  for (int r = 0; r < NR; ++r) {
    const __m512 lv = LO ? levels512(is[r], il[r]) : _mm512_cvtepi32_ps(is[r]);
    _mm512_store_ps(pl + r * 16, _mm512_maskz_mul_ps(km, lv, da));
  }
}

// Step u of a 4-bit 32-block format's super-group for one weight row: v's 128 nibbles (low ones: the step's first
// 64 weights, high ones: those 4 steps on), each with its fifth bit from hv (Q5_0, Q5_1: bit u of each byte the low
// nibble's, 4 + u the high's; hv is not read otherwise), dotted with the hi level (ah, ah2) and, with LO, the lo
// level (al, al2) of x
template <int F, bool LO>
static inline __attribute__((always_inline)) void nib_step512(__m512i v, const __m512i& hv, int u, __m512i ah,
                                                              __m512i ah2, __m512i al, __m512i al2, __m512i& is,
                                                              __m512i& is2, __m512i& il, __m512i& il2) {
  const __m512i lo4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
  __m512i wl = _mm512_and_si512(v, lo4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
  if constexpr (SG<F>::hbytes != 0) {
    wl = _mm512_or_si512(wl, _mm512_and_si512(_mm512_slli_epi16(hv, 4 - u), b4));
    wh = _mm512_or_si512(wh, _mm512_and_si512(_mm512_srli_epi16(hv, u), b4));
  }
  if constexpr (F == dtn::IQ4_NL) {
    wl = _mm512_shuffle_epi8(iq4_table512(), wl);
    wh = _mm512_shuffle_epi8(iq4_table512(), wh);
  }
  is = _mm512_dpbusd_epi32(is, wl, ah);
  is2 = _mm512_dpbusd_epi32(is2, wh, ah2);
  if constexpr (LO) {
    il = _mm512_dpbusd_epi32(il, wl, al);
    il2 = _mm512_dpbusd_epi32(il2, wh, al2);
  }
}

// tail_lanes512 for S of 9..15 blocks (P = 16): a step a vector, as the whole super-groups (lanes from S on read as
// zero)
template <int F, bool LO, int NR>
static void tail_steps512(const TailPlan& t, const uint8_t* const* p, const SGAct& a, int64_t m, float* pl) {
  const int8_t* ag = a.q + (m * a.nsg + a.nsg - 1) * 1024;
  constexpr int kSteps = F == dtn::Q8_0 ? 8 : 4;
  const __mmask16 km = __mmask16((1u << t.S) - 1);
  const int64_t qoff = 2 * t.S * SG<F>::scales + t.S * SG<F>::hbytes;
  __m512i is[NR], il[NR], hv[NR], is2[NR], il2[NR];
  for (int r = 0; r < NR; ++r) {
    is[r] = il[r] = is2[r] = il2[r] = _mm512_setzero_si512();
    if constexpr (SG<F>::hbytes != 0) hv[r] = _mm512_maskz_loadu_epi32(km, p[r] + 2 * t.S * SG<F>::scales);
  }
  for (int u = 0; u < kSteps; ++u) {
    if constexpr (F == dtn::Q8_0) {
      const __m512i ah = _mm512_loadu_si512(ag + 64 * u), al = LO ? _mm512_loadu_si512(ag + 512 + 64 * u) : ah;
      for (int r = 0; r < NR; ++r) {
        const __m512i v = _mm512_maskz_loadu_epi32(km, p[r] + qoff + 4 * t.S * u);
        is[r] = _mm512_dpbusd_epi32(is[r], v, ah);
        if constexpr (LO) il[r] = _mm512_dpbusd_epi32(il[r], v, al);
      }
      continue;
    }
    const __m512i ah = _mm512_loadu_si512(ag + 64 * u), ah2 = _mm512_loadu_si512(ag + 64 * (u + 4));
    const __m512i al = LO ? _mm512_loadu_si512(ag + 512 + 64 * u) : ah;
    const __m512i al2 = LO ? _mm512_loadu_si512(ag + 512 + 64 * (u + 4)) : ah;
    for (int r = 0; r < NR; ++r) {
      nib_step512<F, LO>(_mm512_maskz_loadu_epi32(km, p[r] + qoff + 4 * t.S * u), hv[r], u, ah, ah2, al, al2, is[r],
                         is2[r], il[r], il2[r]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    is[r] = _mm512_add_epi32(is[r], is2[r]);
    il[r] = _mm512_add_epi32(il[r], il2[r]);
  }
  tail_finish512<LO, NR>(t, a, m, is, il, pl);
}

// tail_lanes512 for S of 1..8 blocks (P = sg_period(S) < 16): 16 / P steps a vector, then the lanes of each block
// added up
template <int F, bool LO, int NR, int P>
static void tail_spread512(const TailPlan& t, const uint8_t* const* p, const SGAct& a, int64_t m, float* pl) {
  const int8_t* ag = a.q + (m * a.nsg + a.nsg - 1) * 1024;
  constexpr int nv = P >= 2 ? P / 2 : 1;
  __m512i is[NR], il[NR];
  for (int r = 0; r < NR; ++r) is[r] = il[r] = _mm512_setzero_si512();
  for (int v = 0; v < nv; ++v) {
    const __m512i ah = _mm512_loadu_si512(ag + 64 * v), al = LO ? _mm512_loadu_si512(ag + 512 + 64 * v) : ah;
    for (int r = 0; r < NR; ++r) {
      const __m512i wv = tail_weights<F>(t, p[r], v);
      is[r] = _mm512_dpbusd_epi32(is[r], wv, ah);
      if constexpr (LO) il[r] = _mm512_dpbusd_epi32(il[r], wv, al);
    }
  }
  for (int r = 0; r < NR; ++r) {
    is[r] = fold_lanes(is[r], P);
    if constexpr (LO) il[r] = fold_lanes(il[r], P);
  }
  tail_finish512<LO, NR>(t, a, m, is, il, pl);
}

// The last super-groups (at p[r] in NR weight rows) against activation row m: pl[r * 16 + b], b < S = row r's block
// b's integer sums as levels512 rounds them, times x's scale of the block (the products sg_tails512 multiplies by the
// weights' scales). Each activation vector is loaded once for the NR rows.
template <int F, bool LO, int NR>
static inline void tail_lanes512(const TailPlan& t, const uint8_t* const* p, const SGAct& a, int64_t m, float* pl) {
  switch (t.P) {
    case 16: return tail_steps512<F, LO, NR>(t, p, a, m, pl);
    case 8: return tail_spread512<F, LO, NR, 8>(t, p, a, m, pl);
    case 4: return tail_spread512<F, LO, NR, 4>(t, p, a, m, pl);
    case 2: return tail_spread512<F, LO, NR, 2>(t, p, a, m, pl);
    default: return tail_spread512<F, LO, NR, 1>(t, p, a, m, pl);
  }
}

// Rows n0..n1 (at most 16) of the last super-groups, activation row m: pl[r * 16 + b] the products of row n0 + r's
// block b (tail_lanes512) -> out[r] = sg_tails512's sum for that row, the same operations in the same order (the
// products transposed to a row per lane, the rows' scales as sg_tails512 transposes them)
template <int F>
static inline void tail_chain512(const QWeight& w, const SGAct& a, int64_t m, const TailPlan& t, const float* pl,
                                 int64_t n0, int64_t n1, float* out) {
  using G = SG<F>;
  const int S = t.S, nr = int(n1 - n0);
  const int64_t g = a.nsg - 1;
  const float* as = a.s + (m * a.nsg + g) * 16;
  __m512i sc[16], pv[16];
  rows_to_lanes(w.qs + n0 * w.qs_row + g * 16 * G::bytes, w.qs_row, nr, (2 * S * G::scales + 3) / 4, sc);
  rows_to_lanes(reinterpret_cast<const uint8_t*>(pl), 64, nr, S, pv);
  auto half = [&](int byte) {  // the fp16 at byte (even) of each row
    const __m512i v = sc[byte / 4];
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(byte % 4 ? _mm512_srli_epi32(v, 16) : v));
  };
  __m512 acc = _mm512_setzero_ps();
  for (int b = 0; b < S; ++b) {
    const __m512 dw = half(2 * b);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(pv[b]), dw, acc);
    if (G::scales == 2 || G::offset != 0.f) {
      const __m512 mw = G::scales == 2 ? half(2 * S + 2 * b) : _mm512_mul_ps(dw, _mm512_set1_ps(G::offset));
      acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(as[b]), acc);
    }
  }
  _mm512_mask_storeu_ps(out, __mmask16(nr == 16 ? 0xffffu : (1u << nr) - 1), acc);
}

// -- the K-quants (Q4_K, Q5_K, Q6_K, IQ4_XS) -----------------------------------------------------------------
// R weight rows against activation row m, whole super-groups of two super-blocks: each row's sum takes
// sg_tile512<F, 1, 1>'s float operations in its order (its bits), the activation vectors are loaded once for R rows.
// One-row products of these formats are bound by vpdpbusd (16 a super-group with both levels: on this Zen 4 a zmm
// vpdpbusd issues every ~2 cycles, so ~31 GB/s of Q4_K at most), and the weights stream from memory:
// - as each super-group is summed, the same bytes of the rows whole blocks of R rows on (at least kStreamAhead bytes
//   on) are fetched into L2: a steady stream, where prefetch_row's bursts of whole rows 8 KB on left the memory idle
//   between them (cold, both levels: Q6_K [2048, 8192] 17 -> 28 GB/s, Q4_K [16384, 2048] 20 -> 27.5, [1536, 8960]
//   -> 27.7, against a ~32 GB/s plain read);
// - R = 4 rows of the 4-bit formats share each activation load (hot Q4_K 21 -> 30 GB/s), R = 2 of Q6_K (its
//   unpacking fills the registers beyond two rows): one row loaded x's 1 KB a super-group against 420 bytes of
//   weight, and a Zen 4 core spends a cycle on each 64-byte load (hot [256, 2048] 27.8 -> 30.0 GB/s, [64, 8192]
//   29.5 -> 31.7; cold, as a Llama 3.2 1B step reads them, the tied head 25.8 -> 28.1, down 26.5 -> 28.0; three or
//   four rows ran no faster). kStreamAhead, stream_ahead: generic.h.

// Inlined into kq_decode512: called out of line (GCC's choice once Q6_K took two rows) the library's Q6_K ran 0.88x
// its stand-alone build's speed, hot, where inlined it runs 1.15x the one-row loop (Q4_K 1.03x).
// SPLIT: kq_split512's rows (whole super-groups, no prefetch: the hardware prefetcher follows its streams); else
// each super-group's bytes `ahead` on are prefetched at the first row of x and a last lone super-block may come
template <int F, int R, bool LO, bool SPLIT>
static inline __attribute__((always_inline)) void kq_rows512(const uint8_t* const* rows, const SGAct& a, int64_t m, int64_t nb, int64_t ahead,
                              float* out) {
  using G = SG<F>;
  constexpr bool Q6 = F == dtn::Q6_K, Q4 = F == dtn::Q4_K;
  const __m512i lo4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10), b45 = _mm512_set1_epi8(0x30);
  __m512 acc[R];
  float tail[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    tail[r] = 0.f;
  }
  for (int64_t g = 0; g * 16 < nb; ++g) {
    const uint8_t* p[R];
    for (int r = 0; r < R; ++r) p[r] = rows[r] + g * 2 * G::kblock;
    if (!SPLIT && m == 0)  // (further rows of x find the weight rows in L1)
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 2 * G::kblock; i += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p[r]) + ahead + i, _MM_HINT_T1);
    if (!SPLIT && nb - g * 16 < 16) {  // the lone last super-block: quant_avx2.h's tile, as sg_tile512
      const SGAct at{a.q + g * 1024, a.d + g * 16, a.s + g * 16, a.nsg, a.sh + g * 32, a.levels};
      float o[1][R];
      sg_tile256<F, 1, R, LO>(p, at, m, nb - g * 16, o);
      for (int r = 0; r < R; ++r) tail[r] = o[0][r];
      continue;
    }
    const int8_t* ag = a.q + (m * a.nsg + g) * 1024;  // hi levels, then lo at + 512
    __m512i is[R], il[R], is2[R], il2[R], hv[R];  // low nibbles' sums (is, il), high nibbles' (is2, il2)
    for (int r = 0; r < R; ++r) {
      is[r] = il[r] = is2[r] = il2[r] = _mm512_setzero_si512();
      if constexpr (G::hbytes != 0) hv[r] = two_halves(p[r] + G::kh, p[r] + G::kblock + G::kh);
    }
    for (int u = 0; u < 4; ++u) {
      __m512i a0 = _mm512_loadu_si512(ag + 64 * u), a1 = _mm512_loadu_si512(ag + 64 * (u + 4)), l0, l1;
      // held in registers: left as memory operands GCC copies them to the stack once per row (0.75x the speed)
      asm("" : "+v"(a0), "+v"(a1));
      if constexpr (LO) {
        l0 = _mm512_loadu_si512(ag + 512 + 64 * u);
        l1 = _mm512_loadu_si512(ag + 512 + 64 * (u + 4));
        asm("" : "+v"(l0), "+v"(l1));
      }
      for (int r = 0; r < R; ++r) {
        const __m512i v = two_halves(p[r] + G::kq + 32 * u, p[r] + G::kblock + G::kq + 32 * u);
        // Q4_K: the high nibbles in place, 16 times their value (an unsigned byte still), is2 / il2 16 times the sums
        __m512i wl = _mm512_and_si512(v, lo4),
                wh = Q4 ? _mm512_andnot_si512(lo4, v) : _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        if constexpr (Q6) {  // two high bits per quant, 4 steps a byte (as sg_tile512)
          const int off = 32 * (u % 2);
          const __m512i hq = two_halves(p[r] + G::kh + off, p[r] + G::kblock + G::kh + off);
          const __m512i hl = u < 2 ? _mm512_slli_epi16(hq, 4) : hq;
          const __m512i hh = u < 2 ? _mm512_slli_epi16(hq, 2) : _mm512_srli_epi16(hq, 2);
          wl = _mm512_or_si512(wl, _mm512_and_si512(hl, b45));
          wh = _mm512_or_si512(wh, _mm512_and_si512(hh, b45));
        } else if constexpr (G::hbytes != 0) {  // Q5_K: bit u of each byte the low nibble's fifth bit, 4 + u the high's
          wl = _mm512_or_si512(wl, _mm512_and_si512(_mm512_slli_epi16(hv[r], 4 - u), b4));
          wh = _mm512_or_si512(wh, _mm512_and_si512(_mm512_srli_epi16(hv[r], u), b4));
        }
        if constexpr (F == dtn::IQ4_XS) {
          const __m512i iq4 = iq4_table512();
          wl = _mm512_shuffle_epi8(iq4, wl);
          wh = _mm512_shuffle_epi8(iq4, wh);
        }
        is[r] = _mm512_dpbusd_epi32(is[r], wl, a0);
        is2[r] = _mm512_dpbusd_epi32(is2[r], wh, a1);
        if constexpr (LO) {
          il[r] = _mm512_dpbusd_epi32(il[r], wl, l0);
          il2[r] = _mm512_dpbusd_epi32(il2[r], wh, l1);
        }
      }
    }
    const __m512 da = _mm512_loadu_ps(a.d + (m * a.nsg + g) * 16);
    const __m512 sa = _mm512_loadu_ps(a.s + (m * a.nsg + g) * 16);
    __m512 dl, h0, h1;  // (Q6_K)
    if constexpr (Q6) q6_act512<LO>(da, a.sh + (m * a.nsg + g) * 32, dl, h0, h1);
    for (int r = 0; r < R; ++r) {  // sg_tile512's epilogue
      const uint8_t* q = p[r] + G::kblock;
      if constexpr (Q6) {  // d sc (u - 32) per 16 weights (q6_row512)
        acc[r] = q6_row512<LO>(q6_weights512(p[r], q), da, dl, h0, h1, is[r], il[r], is2[r], il2[r], acc[r]);
        continue;
      }
      // (exact: Q4_K's is2 and il2 are multiples of 16)
      const __m512i s = _mm512_add_epi32(is[r], Q4 ? _mm512_srai_epi32(is2[r], 4) : is2[r]);
      const __m512i l = _mm512_add_epi32(il[r], Q4 ? _mm512_srai_epi32(il2[r], 4) : il2[r]);
      const __m512 t = _mm512_mul_ps(LO ? levels512(s, l) : _mm512_cvtepi32_ps(s), da);
      __m512 dw, mw;
      if constexpr (F == dtn::IQ4_XS) {
        dw = _mm512_mul_ps(fp16_pair(p[r], q), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes_pair(p[r] + 2, q + 2))));
        mw = dw;
      } else {
        const __m128i ha = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[r] + 4));
        const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4));
        __m512 d, mdmin;
        fp16_pairs2(p[r], q, d, mdmin);
        dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(ha, hb))));
        mw = _mm512_mul_ps(mdmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(ha, hb))));
      }
      if constexpr (G::scales == 2) acc[r] = _mm512_fmadd_ps(mw, sa, _mm512_fmadd_ps(t, dw, acc[r]));
      else acc[r] = _mm512_fmadd_ps(dw, _mm512_fmadd_ps(sa, _mm512_set1_ps(G::offset), t), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) + tail[r];
}

// The K-quants' decode driver: R rows at a time (then one), y = sum + bias as sg_block512 writes it.
// The 4-bit formats' rows of whole super-groups of at most kSplitRowBytes (K = 1536 / 2048: the attention and gate_up
// projections) are read as R streams, each in memory order (kq_split512): stream r holds rows n0 + r q .. n0 + (r + 1)
// q - 1, q = (n1 - n0) / R, and the rest come one at a time after; the core's hardware prefetcher follows each stream.
// R neighbouring rows side by side (the longer rows' order) are R streams 888-1184 bytes apart that it does not
// follow (4.5 GB/s without software prefetch), so they need kStreamAhead's software stream, which read a Qwen2.5-1.5B
// step's K = 1536 products at ~0.88 of a plain read where the R streams read ~0.93 (stand-alone harness, cold, one
// thread, 2 MiB pages; through qlinear, its gate_up 1.04-1.10x). With the streams the arithmetic is what is left:
// without the epilogue's scales they read 1.0-1.02 of the read. Long rows (the down projections, K = 4864-8960) in
// the streams' order ran 0.45-0.6x (software prefetch a stream 1-4 KB on did not help), and Q6_K's two streams (its
// R) ran 0.75-1.0x (the tied heads, K = 2048 / 1536): they keep the software stream. Every row's sum is unchanged
// (rows are independent: R only shares x's loads).
constexpr int64_t kSplitRowBytes = 2048;

// (chosen by sg_decode512 and kept out of line, so that kq_decode512's loops compile as before: with the choice inside
// it GCC compiled them otherwise, and they ran 1-4% slower in a stand-alone harness)
template <int F, bool LO>
static __attribute__((noinline)) void kq_split512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1,
                                                  const void* bias, void* y, int ydt, int64_t ldy) {
  static_assert(F != dtn::Q6_K, "Q6_K keeps the software stream");
  constexpr int R = 4;
  const int64_t nb = w.K / 32, q = (n1 - n0) / R;
  auto put = [&](int64_t m, int64_t n, float v) { store_f(y, ydt, m * ldy + n, v + (bias ? load_f(bias, ydt, n) : 0.f)); };
  for (int64_t i = 0; i < q; ++i) {
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = w.qs + (n0 + r * q + i) * w.qs_row;
    for (int64_t m = 0; m < M; ++m) {
      float o[R];
      kq_rows512<F, R, LO, true>(rows, a, m, nb, 0, o);
      for (int r = 0; r < R; ++r) put(m, n0 + r * q + i, o[r]);
    }
  }
  for (int64_t n = n0 + R * q; n < n1; ++n) {
    const uint8_t* row = w.qs + n * w.qs_row;
    for (int64_t m = 0; m < M; ++m) {
      float o[1];
      kq_rows512<F, 1, LO, true>(&row, a, m, nb, 0, o);
      put(m, n, o[0]);
    }
  }
  // the bytes after the rows, kStreamAhead of them, as the software stream asks for them past its rows' end: the next
  // weight in the arena's order (a Q6_K [256, 1536] after a split product started ~10% slower without them)
  const char* next = reinterpret_cast<const char*>(w.qs + n1 * w.qs_row);
  for (int64_t i = 0; i < kStreamAhead; i += 64) _mm_prefetch(next + i, _MM_HINT_T1);
}

// longer rows and Q6_K: R neighbouring rows side by side, the software stream kStreamAhead bytes on
template <int F, bool LO>
static void kq_decode512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                         void* y, int ydt, int64_t ldy) {
  constexpr int R = F == dtn::Q6_K ? 2 : 4;
  const int64_t nb = w.K / 32;
  // each row fetches the same bytes of a row whole blocks of R rows on, at least kStreamAhead bytes: R rows are read
  // side by side, so kStreamAhead bytes on would land in this block's own rows once R rows span that much
  const int64_t block = R * w.qs_row, ahead = (kStreamAhead + block - 1) / block * block;
  const char* first = reinterpret_cast<const char*>(w.qs + n0 * w.qs_row);  // the stream's start, before it asks
  for (int64_t i = 0; i < ahead && i < (n1 - n0) * w.qs_row; i += 64) _mm_prefetch(first + i, _MM_HINT_T1);
  auto put = [&](int64_t m, int64_t n, float v) { store_f(y, ydt, m * ldy + n, v + (bias ? load_f(bias, ydt, n) : 0.f)); };
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = w.qs + (n + r) * w.qs_row;
    for (int64_t m = 0; m < M; ++m) {
      float o[R];
      kq_rows512<F, R, LO, false>(rows, a, m, nb, ahead, o);
      for (int r = 0; r < R; ++r) put(m, n + r, o[r]);
    }
  }
  for (; n < n1; ++n) {
    const uint8_t* row = w.qs + n * w.qs_row;
    for (int64_t m = 0; m < M; ++m) {
      float o[1];
      kq_rows512<F, 1, LO, false>(&row, a, m, nb, ahead, o);
      put(m, n, o[0]);
    }
  }
}

// NR weight rows of a 32-block format against activation row m over its whole super-groups: out[r] = row r's
// sg_tile512<F, 1, 1, LO> sum, the same float operations in the same order, each activation vector loaded once for
// the NR rows (a core that loads 64 bytes a cycle, as Zen 4, spends the one-row loop on loads: x's 1 KB per
// super-group against 352 bytes of a Q5_0 row). ahead > 0: each super-group's bytes that far on are asked for as it
// is read (the stream of long rows, sg_decode32_512).
template <int F, bool LO, int NR>
static inline void sg_rows512(const uint8_t* const* rows, const SGAct& a, int64_t m, int64_t nb, int64_t ahead,
                              float* out) {
  using G = SG<F>;
  static_assert(G::kblock == 0, "the 32-block formats");
  constexpr int64_t gbytes = 16 * G::bytes, qoff = 2 * 16 * G::scales + 16 * G::hbytes;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g * 16 + 16 <= nb; ++g) {
    const int8_t* ag = a.q + (m * a.nsg + g) * 1024;
    if (m == 0 && ahead)  // (further rows of x find the weight rows in L1)
      for (int r = 0; r < NR; ++r) stream_ahead(rows[r] + g * gbytes, gbytes, ahead);
    // is/il: the low nibbles' (Q8_0: every step's) sums, is2/il2 the high nibbles'
    __m512i is[NR], il[NR], is2[NR], il2[NR];
    for (int r = 0; r < NR; ++r) is[r] = il[r] = is2[r] = il2[r] = _mm512_setzero_si512();
    if constexpr (F == dtn::Q8_0) {
      for (int u = 0; u < 8; ++u) {
        const __m512i ah = _mm512_loadu_si512(ag + 64 * u), al = LO ? _mm512_loadu_si512(ag + 512 + 64 * u) : ah;
        for (int r = 0; r < NR; ++r) {
          const __m512i v = _mm512_loadu_si512(rows[r] + g * gbytes + qoff + 64 * u);
          is[r] = _mm512_dpbusd_epi32(is[r], v, ah);
          if constexpr (LO) il[r] = _mm512_dpbusd_epi32(il[r], v, al);
        }
      }
    } else {
      __m512i hv[NR];
      if constexpr (G::hbytes != 0)
        for (int r = 0; r < NR; ++r) hv[r] = _mm512_loadu_si512(rows[r] + g * gbytes + 2 * 16 * G::scales);
      for (int u = 0; u < 4; ++u) {
        const __m512i ah = _mm512_loadu_si512(ag + 64 * u), ah2 = _mm512_loadu_si512(ag + 64 * (u + 4));
        const __m512i al = LO ? _mm512_loadu_si512(ag + 512 + 64 * u) : ah;
        const __m512i al2 = LO ? _mm512_loadu_si512(ag + 512 + 64 * (u + 4)) : ah;
        for (int r = 0; r < NR; ++r) {
          nib_step512<F, LO>(_mm512_loadu_si512(rows[r] + g * gbytes + qoff + 64 * u), hv[r], u, ah, ah2, al, al2,
                             is[r], is2[r], il[r], il2[r]);
        }
      }
    }
    const __m512 da = _mm512_loadu_ps(a.d + (m * a.nsg + g) * 16);
    const __m512 sa = _mm512_loadu_ps(a.s + (m * a.nsg + g) * 16);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = rows[r] + g * gbytes;
      const __m512i hi = _mm512_add_epi32(is[r], is2[r]), lo = _mm512_add_epi32(il[r], il2[r]);
      const __m512 t = _mm512_mul_ps(LO ? levels512(hi, lo) : _mm512_cvtepi32_ps(hi), da);
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      if constexpr (G::scales == 2) {
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
        acc[r] = _mm512_fmadd_ps(mw, sa, _mm512_fmadd_ps(t, dw, acc[r]));
      } else {
        acc[r] = _mm512_fmadd_ps(dw, _mm512_fmadd_ps(sa, _mm512_set1_ps(G::offset), t), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

constexpr int64_t kFourRowBytes = 768;  // sg_decode32_512 reads rows of at most this many bytes four at a time
// sg_decode32_512 streams rows of more than kStreamRowBytes (generic.h) a super-group at a time: the down projections (Q8_0 at
// K = 4864-8960, rows of 5-9.5 KB), whose whole-row bursts (at least 4 rows, 20-38 KB, on) left the memory idle
// between them: cold [2048, 8192] 16.5-20 -> 28-30 GB/s, [1536, 8960] 15.6-16.6 -> 24-27.5, [1152, 6912] 20-20.7 ->
// 26.5-28, [896, 4864] 22.5-24 -> 28-33 (one thread, same-run A/B, 2 MiB pages). Shorter rows keep whole rows
// ahead_rows on: the stream at K = 896-2048 ran 0.85-1.05x them (four rows of K = 896 / 960 streamed 0.75-0.85x).

// The 32-block formats' decode: chunks of 16 weight rows, read 4 at a time where the rows are short and end in a last
// super-group of under 16 blocks (sg_rows512, tail_lanes512), else one at a time; without a
// last super-group of under 16 blocks y = sum + bias, as sg_block512 writes it; with one, the whole super-groups'
// sums and the tails' per-block products, then the tails finished for the chunk (tail_chain512) and y = (sums +
// tails) + bias (store_with_tails), as the tiles write it.
template <int F, bool LO>
static void sg_decode32_512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                            void* y, int ydt, int64_t ldy) {
  constexpr int64_t kChunk = 16;
  constexpr int NR = 4;
  const int64_t nb = w.K / 32, ahead = ahead_rows(w);
  const bool tails = nb % 16 != 0;
  // four rows at a time only for short rows with a last super-group (K = 576 / 640 / 896 of Q4_0 and Q5_0, 576 / 640
  // of Q8_0): streamed from memory, longer rows four at a time (their prefetches issued together) ran 0.7-0.9x one
  // after another (Q8_0 K = 896, 1024, 2048), though in cache 1.2-1.3x
  const bool four = tails && w.qs_row <= kFourRowBytes;
  // long rows: the stream kStreamAhead bytes (at least a row) on, asked for a super-group at a time; else whole rows
  const bool stream = w.qs_row > kStreamRowBytes;
  const int64_t stream_at = (kStreamAhead + w.qs_row - 1) / w.qs_row * w.qs_row;
  const TailPlan t = tails ? tail_plan<F>(int(nb % 16)) : TailPlan{};
  const int64_t tail_at = nb / 16 * 16 * SG<F>::bytes;  // the last super-group's offset in a row
  alignas(64) float pl[3][kChunk * 16];
  float part[3 * kChunk], pre[3 * kChunk];
  auto rows = [&](auto nr, int64_t n, int64_t nc) {  // rows n .. n + nr, every row of x
    constexpr int R = decltype(nr)::value;
    const uint8_t* row[R];
    const uint8_t* tail[R];
    for (int r = 0; r < R; ++r) {
      if (!stream && n + r + ahead < n1) prefetch_row(w, n + r + ahead);
      row[r] = w.qs + (n + r) * w.qs_row;
      tail[r] = row[r] + tail_at;
      if (stream && tails) stream_ahead(tail[r], w.qs_row - tail_at, stream_at);
    }
    for (int64_t m = 0; m < M; ++m) {
      sg_rows512<F, LO, R>(row, a, m, nb, stream ? stream_at : 0, part + m * kChunk + n - nc);
      if (tails) tail_lanes512<F, LO, R>(t, tail, a, m, pl[m] + (n - nc) * 16);
    }
  };
  for (int64_t n = n0; n < n1 && n < n0 + (stream ? stream_at / w.qs_row : ahead); ++n)
    prefetch_row(w, n);  // the first rows, before the loop asks
  for (int64_t nc = n0; nc < n1; nc += kChunk) {
    const int64_t ne = nc + kChunk < n1 ? nc + kChunk : n1;
    int64_t n = nc;
    if (four)
      for (; n + NR <= ne; n += NR) rows(std::integral_constant<int, NR>{}, n, nc);
    for (; n < ne; ++n) rows(std::integral_constant<int, 1>{}, n, nc);
    if (!tails) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = nc; r < ne; ++r)
          store_f(y, ydt, m * ldy + r, part[m * kChunk + r - nc] + (bias ? load_f(bias, ydt, r) : 0.f));
      continue;
    }
    for (int64_t m = 0; m < M; ++m) tail_chain512<F>(w, a, m, t, pl[m], nc, ne, pre + m * kChunk);
    store_with_tails(part, pre, kChunk, M, nc, ne, bias, y, ydt, ldy);
  }
}

// The decode driver (M < 4 rows of x): each weight row once, against every row of x while it is in L1; y = sum + bias
// as sg_block512 writes it (a K-quant's lone last super-block included). The 32-block formats: sg_decode32_512.
template <int F, bool LO>
static void sg_decode512(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias,
                         void* y, int ydt, int64_t ldy) {
  if constexpr (SG<F>::kblock == 0) {
    sg_decode32_512<F, LO>(w, a, M, n0, n1, bias, y, ydt, ldy);
  } else if constexpr (F == dtn::Q6_K) {
    kq_decode512<F, LO>(w, a, M, n0, n1, bias, y, ydt, ldy);
  } else {  // short rows of whole super-groups as four streams (see kq_decode512)
    if (w.qs_row <= kSplitRowBytes && w.K % 512 == 0) kq_split512<F, LO>(w, a, M, n0, n1, bias, y, ydt, ldy);
    else kq_decode512<F, LO>(w, a, M, n0, n1, bias, y, ydt, ldy);
  }
}

// -- the activations: quantize_sg (generic.h) in 512-bit vectors, bit for bit -------------------------------------
// Per block of 32: amax, d = amax / 127, the hi levels round(x / d) and the lo levels of the residual, as
// quantize_block computes them (the same float operations, round to nearest even); per super-group the blocks' bytes
// are transposed to the steps' order ([u][block j][4], rows_to_lanes) and each half's level sums come from vpdpbusd
// against ones (exact), scaled as quantize_block scales them. ~10x the scalar loop's speed: a decode step quantizes
// its x once per product, ~2.5 us at K = 896 before.
static inline __m512 load_x16(const void* x, int dt, int64_t off) {
  if (dt == F32) return _mm512_loadu_ps(static_cast<const float*>(x) + off);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + off));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static void quantize_sg512(const void* x, int dt, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int8_t* q,
                           float* d, float* s, float* sh, int levels) {
  const int64_t nb = K / 32, nsg = (nb + 15) / 16;
  const __m512 k127 = _mm512_set1_ps(127.f), m127 = _mm512_set1_ps(-127.f);
  const __m512i ones = _mm512_set1_epi8(1);
  alignas(64) int8_t th[16 * 32], tl[16 * 32];  // a super-group's blocks: hi and lo levels, 32 bytes a block
  alignas(64) float td[16];
  for (int64_t r = r0; r < r1; ++r) {
    int8_t* qr = q + r * nsg * 1024;
    float* dr = d + r * nsg * 16;
    float* sr = s + r * nsg * 16;
    float* hr = sh + r * nsg * 32;
    for (int64_t g = 0; g < nsg; ++g) {
      const int S = int(nb - g * 16 < 16 ? nb - g * 16 : 16), P = sg_period(S);
      if (S < 16) std::memset(qr + g * 1024, 0, 1024);
      for (int j = 0; j < S; ++j) {
        const int64_t off = r * ldx + (g * 16 + j) * 32;
        const __m512 v0 = load_x16(x, dt, off), v1 = load_x16(x, dt, off + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float dd = amax / 127.f, id = dd != 0.f ? 1.f / dd : 0.f, idl = id * 254.f;
        td[j] = dd;
        const __m512 vid = _mm512_set1_ps(id), vd = _mm512_set1_ps(dd), vidl = _mm512_set1_ps(idl);
        const __m512i h0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), h1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
        auto lo = [&](__m512 v, __m512i h) {  // (v - d hi) / (d / 254), clamped to +-127, rounded
          const __m512 t = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(h))), vidl);
          return _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(t, k127), m127));
        };
        _mm_store_si128(reinterpret_cast<__m128i*>(th + 32 * j), _mm512_cvtepi32_epi8(h0));
        _mm_store_si128(reinterpret_cast<__m128i*>(th + 32 * j + 16), _mm512_cvtepi32_epi8(h1));
        _mm_store_si128(reinterpret_cast<__m128i*>(tl + 32 * j), _mm512_cvtepi32_epi8(lo(v0, h0)));
        _mm_store_si128(reinterpret_cast<__m128i*>(tl + 32 * j + 16), _mm512_cvtepi32_epi8(lo(v1, h1)));
      }
      __m512i hs[8], ls[8];  // step u, lane j: dword u of block j
      rows_to_lanes(reinterpret_cast<const uint8_t*>(th), 32, S, 8, hs);
      rows_to_lanes(reinterpret_cast<const uint8_t*>(tl), 32, S, 8, ls);
      const __mmask16 pm = __mmask16(P == 16 ? 0xffffu : (1u << P) - 1);
      __m512i sh0 = _mm512_setzero_si512(), sh1 = sh0, sl0 = sh0, sl1 = sh0;  // [half] sums of the levels
      for (int u = 0; u < 8; ++u) {
        _mm512_mask_storeu_epi32(qr + g * 1024 + u * 4 * P, pm, hs[u]);
        _mm512_mask_storeu_epi32(qr + g * 1024 + 512 + u * 4 * P, pm, ls[u]);
        if (u < 4) {
          sh0 = _mm512_dpbusd_epi32(sh0, ones, hs[u]);
          sl0 = _mm512_dpbusd_epi32(sl0, ones, ls[u]);
        } else {
          sh1 = _mm512_dpbusd_epi32(sh1, ones, hs[u]);
          sl1 = _mm512_dpbusd_epi32(sl1, ones, ls[u]);
        }
      }
      // sums[h] = d (float(sum hi) + float(sum lo) / 254), the lo term where both levels are used
      const __mmask16 sm = __mmask16(S == 16 ? 0xffffu : (1u << S) - 1);
      const __m512 vd = _mm512_maskz_load_ps(sm, td), inv = _mm512_set1_ps(1.f / 254.f);
      auto scaled = [&](__m512i hsum, __m512i lsum) {
        const __m512 f = _mm512_cvtepi32_ps(hsum);
        return _mm512_mul_ps(vd, levels == 2 ? _mm512_add_ps(f, _mm512_mul_ps(_mm512_cvtepi32_ps(lsum), inv))
                                             : _mm512_add_ps(f, _mm512_setzero_ps()));
      };
      const __m512 s0 = scaled(sh0, sl0), s1 = scaled(sh1, sl1);
      _mm512_storeu_ps(dr + g * 16, vd);
      _mm512_storeu_ps(sr + g * 16, _mm512_maskz_add_ps(sm, s0, s1));
      _mm512_storeu_ps(hr + g * 32, _mm512_maskz_mov_ps(sm, s0));
      _mm512_storeu_ps(hr + g * 32 + 16, _mm512_maskz_mov_ps(sm, s1));
    }
  }
}

// -- the 16-row interleaved layout (common.h's x16_base): lane = row -----------------------------------------------
// Per block of a group of 16 rows, each 64-byte load holds one step of the 16 rows and meets one broadcast dword of x
// in one vpdpbusd (no horizontal sums, no activation vector loads), Q5_0's fifth bits one kmovq and one masked add a
// half-step; one float step per block for 16 rows. Each row's sum takes sg_decode32_512's float operations in its
// order, so y is bit for bit the row layout's: the whole super-groups' 16 block positions in 16 accumulators, added
// in _mm512_reduce_add_ps's tree (j + 8, + 4, + 2, + 1), the last super-group of S < 16 blocks as tail_chain512's
// per-block chain, then (sums + tails) + bias. One forward stream: the hardware prefetcher alone keeps it fed.
static inline __m512i x16_bc(const int8_t* p) { return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// a block of 16 rows expanded to 8 steps of unsigned bytes (Q5_0: the fifth bit added, Q8_0: as stored, q + 128)
template <int F>
static inline __attribute__((always_inline)) void x16_expand(const uint8_t* q, __m512i* W) {
  if constexpr (F == dtn::Q5_0) {
    const __m512i lo4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
    for (int u = 0; u < 4; ++u) {
      uint64_t k0, k1;
      std::memcpy(&k0, q + 16 * u, 8), std::memcpy(&k1, q + 16 * u + 8, 8);
      const __m512i v = _mm512_loadu_si512(q + 64 + 64 * u);
      const __m512i wl = _mm512_and_si512(v, lo4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
      W[u] = _mm512_mask_add_epi8(wl, _cvtu64_mask64(k0), wl, b4);
      W[u + 4] = _mm512_mask_add_epi8(wh, _cvtu64_mask64(k1), wh, b4);
    }
  } else {
    for (int u = 0; u < 8; ++u) W[u] = _mm512_loadu_si512(q + 64 * u);
  }
}

// sum over the block's steps of W against x's levels of block position j (period P: sg_period of the super-group),
// both levels as levels512 combines them
template <bool LO>
static inline __attribute__((always_inline)) __m512 x16_dot(const __m512i* W, const int8_t* ag, int P, int j) {
  __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
  for (int u = 0; u < 8; u += 2) {
    h0 = _mm512_dpbusd_epi32(h0, W[u], x16_bc(ag + 4 * (u * P + j)));
    h1 = _mm512_dpbusd_epi32(h1, W[u + 1], x16_bc(ag + 4 * ((u + 1) * P + j)));
    if constexpr (LO) {
      l0 = _mm512_dpbusd_epi32(l0, W[u], x16_bc(ag + 512 + 4 * (u * P + j)));
      l1 = _mm512_dpbusd_epi32(l1, W[u + 1], x16_bc(ag + 512 + 4 * ((u + 1) * P + j)));
    }
  }
  const __m512i hi = _mm512_add_epi32(h0, h1);
  return LO ? levels512(hi, _mm512_add_epi32(l0, l1)) : _mm512_cvtepi32_ps(hi);
}

// groups [g0, g1) against the M (1..3) rows of x, both levels: each block's weights expanded once for the M rows
template <int F, int M, bool LO>
static void x16_decode_m(const QWeight& w, const SGAct& a, int64_t g0, int64_t g1, const void* bias, void* y, int ydt,
                         int64_t ldy) {
  constexpr float off = SG<F>::offset;
  constexpr int64_t qb = dtn::x16_block_bytes(F), pair = 64 + 2 * qb;
  const int64_t nb = w.K / 32, nsg = a.nsg, gb = 16 * w.qs_row;
  const int S = int(nb % 16), P = sg_period(S);
  const __m512 voff = _mm512_set1_ps(off);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = w.qs + g * gb;
    __m512 acc[M][16];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 16; ++j) acc[m][j] = _mm512_setzero_ps();
    int64_t b = 0;
    for (int64_t s = 0; s < nb / 16; ++s)
      for (int j = 0; j < 16; ++j, ++b) {
        __m512i W[8];
        x16_expand<F>(gp + b / 2 * pair + 64 + (b & 1) * qb, W);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + b / 2 * pair + 32 * (b & 1))));
        for (int m = 0; m < M; ++m) {
          const int64_t o = m * nsg + s;
          const __m512 t = _mm512_mul_ps(x16_dot<LO>(W, a.q + o * 1024, 16, j), _mm512_set1_ps(a.d[o * 16 + j]));
          acc[m][j] = _mm512_fmadd_ps(dw, _mm512_fmadd_ps(_mm512_set1_ps(a.s[o * 16 + j]), voff, t), acc[m][j]);
        }
      }
    for (int m = 0; m < M; ++m) {
      for (int w8 = 8; w8 >= 1; w8 /= 2)
        for (int j = 0; j < w8; ++j) acc[m][j] = _mm512_add_ps(acc[m][j], acc[m][j + w8]);
      acc[m][1] = _mm512_setzero_ps();  // the tail's chain
    }
    const int64_t s = nb / 16;
    for (int j = 0; j < S; ++j, ++b) {
      __m512i W[8];
      x16_expand<F>(gp + b / 2 * pair + 64 + (b & 1) * qb, W);
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + b / 2 * pair + 32 * (b & 1))));
      const __m512 mw = _mm512_mul_ps(dw, voff);
      for (int m = 0; m < M; ++m) {
        const int64_t o = m * nsg + s;
        const __m512 t = x16_dot<LO>(W, a.q + o * 1024, P, j);
        acc[m][1] = _mm512_fmadd_ps(_mm512_mul_ps(t, _mm512_set1_ps(a.d[o * 16 + j])), dw, acc[m][1]);
        acc[m][1] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[o * 16 + j]), acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m) {
      alignas(64) float out[16];
      _mm512_store_ps(out, S ? _mm512_add_ps(acc[m][0], acc[m][1]) : acc[m][0]);
      for (int r = 0; r < 16; ++r)
        store_f(y, ydt, m * ldy + 16 * g + r, out[r] + (bias ? load_f(bias, ydt, 16 * g + r) : 0.f));
    }
  }
}

// one row of x: the block's steps loaded and summed as they come (x16_expand's and x16_dot's work, interleaved)
template <int F, bool LO>
static void x16_decode1(const QWeight& w, const SGAct& a, int64_t g0, int64_t g1, const void* bias, void* y,
                        int ydt) {
  constexpr float off = SG<F>::offset;
  constexpr int64_t qb = dtn::x16_block_bytes(F);
  const int64_t nb = w.K / 32, gb = 16 * w.qs_row;
  const int S = int(nb % 16), P = sg_period(S);
  const __m512 voff = _mm512_set1_ps(off);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* p = w.qs + g * gb;
    const uint8_t* sc = p;  // the scales of the pair of blocks b is in
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    int64_t b = 0;
    for (int64_t s = 0; s < nb / 16; ++s) {
      const int8_t* ag = a.q + s * 1024;
      const float *da = a.d + s * 16, *sa = a.s + s * 16;
      for (int j = 0; j < 16; ++j, ++b) {
        if (!(b & 1)) sc = p, p += 64;
        __m512i W[8];
        x16_expand<F>(p, W);
        p += qb;
        const __m512 t = _mm512_mul_ps(x16_dot<LO>(W, ag, 16, j), _mm512_set1_ps(da[j]));
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32 * (b & 1))));
        acc[j] = _mm512_fmadd_ps(dw, _mm512_fmadd_ps(_mm512_set1_ps(sa[j]), voff, t), acc[j]);
      }
    }
    for (int w8 = 8; w8 >= 1; w8 /= 2)
      for (int j = 0; j < w8; ++j) acc[j] = _mm512_add_ps(acc[j], acc[j + w8]);
    __m512 out = acc[0];
    if (S) {
      const int64_t s = nb / 16;
      const int8_t* ag = a.q + s * 1024;
      const float *da = a.d + s * 16, *sa = a.s + s * 16;
      __m512 v = _mm512_setzero_ps();
      for (int j = 0; j < S; ++j, ++b) {
        if (!(b & 1)) sc = p, p += 64;
        __m512i W[8];
        x16_expand<F>(p, W);
        p += qb;
        const __m512 t = x16_dot<LO>(W, ag, P, j);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32 * (b & 1))));
        v = _mm512_fmadd_ps(_mm512_mul_ps(t, _mm512_set1_ps(da[j])), dw, v);
        v = _mm512_fmadd_ps(_mm512_mul_ps(dw, voff), _mm512_set1_ps(sa[j]), v);
      }
      out = _mm512_add_ps(out, v);
    }
    alignas(64) float o[16];
    _mm512_store_ps(o, out);
    for (int r = 0; r < 16; ++r) store_f(y, ydt, 16 * g + r, o[r] + (bias ? load_f(bias, ydt, 16 * g + r) : 0.f));
  }
}

// rows m0 .. m0 + mm of x (mm <= 3) against groups [g0, g1)
template <int F, bool LO>
static void x16_rows_of_x(const QWeight& w, const SGAct& a, int64_t m0, int mm, int64_t g0, int64_t g1,
                          const void* bias, void* y, int ydt, int64_t ldy) {
  const int64_t es = ydt == dtn::F32 ? 4 : 2, nsg = a.nsg;
  const SGAct am{a.q + m0 * nsg * 1024, a.d + m0 * nsg * 16, a.s + m0 * nsg * 16, nsg, a.sh, a.levels};
  void* ym = static_cast<char*>(y) + m0 * ldy * es;
  if (mm == 1) x16_decode1<F, LO>(w, am, g0, g1, bias, ym, ydt);
  else if (mm == 2) x16_decode_m<F, 2, LO>(w, am, g0, g1, bias, ym, ydt, ldy);
  else x16_decode_m<F, 3, LO>(w, am, g0, g1, bias, ym, ydt, ldy);
}

// 1-3 rows of x: each group once against them; more (up to kX16Rows): each group against 3 rows at a time while it
// is in L1 (16 rows of K = 896: 10-15 KB)
constexpr int64_t kX16Rows = 32;
template <int F, bool LO>
static void x16_decode512_fmt(const QWeight& w, const SGAct& a, int64_t M, int64_t g0, int64_t g1, const void* bias,
                              void* y, int ydt, int64_t ldy) {
  if (M <= 3) return x16_rows_of_x<F, LO>(w, a, 0, int(M), g0, g1, bias, y, ydt, ldy);
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t m0 = 0; m0 < M; m0 += 3)
      x16_rows_of_x<F, LO>(w, a, m0, int(M - m0 < 3 ? M - m0 : 3), g, g + 1, bias, y, ydt, ldy);
}

// generic.h's x16_decode on AVX-512 VNNI: under kX16Rows rows of x, either level count
static bool x16_decode512(const QWeight& w, const SGAct& a, int64_t M, int64_t g0, int64_t g1, const void* bias,
                          void* y, int ydt, int64_t ldy) {
  if (M >= kX16Rows || (w.K / 32) % 2) return false;
  const bool lo = a.levels == 2;
  if (w.fmt == dtn::Q5_0X16)
    lo ? x16_decode512_fmt<dtn::Q5_0, true>(w, a, M, g0, g1, bias, y, ydt, ldy)
       : x16_decode512_fmt<dtn::Q5_0, false>(w, a, M, g0, g1, bias, y, ydt, ldy);
  else if (w.fmt == dtn::Q8_0X16)
    lo ? x16_decode512_fmt<dtn::Q8_0, true>(w, a, M, g0, g1, bias, y, ydt, ldy)
       : x16_decode512_fmt<dtn::Q8_0, false>(w, a, M, g0, g1, bias, y, ydt, ldy);
  else
    return false;
  return true;
}

// 16 vectors v[j] (dword r: row r's dword of block j) -> t[r] (dword j: block j's): a 16 x 16 dword transpose
static inline void x16_transpose(const __m512i* v, __m512i* t) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4 i + c], 128-bit lane L: dword 4 L + c of v[4 i .. 4 i + 3]
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of 128-bit lanes
    const __m512i x0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xee);
    const __m512i x2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xee);
    t[c] = _mm512_shuffle_i32x4(x0, x2, 0x88), t[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xdd);
    t[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88), t[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xdd);
  }
}

// generic.h's x16_rows as 16 x 16 dword transposes (scales, fifth bits, each step) per super-group, the last one of
// S < 16 blocks with its missing blocks zero and masked stores (its row form has a stride of S blocks, not 16): bit
// for bit the same rows
static void x16_rows512(int base, const uint8_t* gp, int64_t K, uint8_t* rows, int64_t rb) {
  const bool q5 = base == dtn::Q5_0;
  const int qd = q5 ? 4 : 8, hb = q5 ? 4 : 0;
  const int64_t nb = K / 32, qb = dtn::x16_block_bytes(base), pair = 64 + 2 * qb, ts = 2 + hb + 4 * qd;
  auto qp = [&](int64_t b) { return gp + b / 2 * pair + 64 + (b & 1) * qb; };
  __m512i v[16], t[16];
  for (int64_t s = 0; s * 16 < nb; ++s) {
    const int S = int(nb - 16 * s < 16 ? nb - 16 * s : 16);  // even: nb is
    const __mmask16 keep = __mmask16((1u << S) - 1);
    const int64_t sg = s * 16 * ts;
    for (int p = 0; p < 8; ++p) {  // dword r of v[p]: (block 2p row r) | (block 2p + 1 row r) << 16
      if (2 * p >= S) {
        v[p] = _mm512_setzero_si512();
        continue;
      }
      const __m512i x = _mm512_loadu_si512(gp + (8 * s + p) * pair);
      const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(x));
      const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(x, 1));
      v[p] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    }
    for (int p = 8; p < 16; ++p) v[p] = _mm512_setzero_si512();
    x16_transpose(v, t);
    for (int r = 0; r < 16; ++r)
      _mm256_mask_storeu_epi16(rows + r * rb + sg, keep, _mm512_castsi512_si256(t[r]));
    if (q5) {
      for (int j = 0; j < 16; ++j) {  // byte 4 r + t of v[j]: row r's fifth-bit byte t of block j (step form)
        __m512i h = _mm512_setzero_si512();
        if (j < S) {
          const uint8_t* km = qp(16 * s + j);
          for (int k = 0; k < 8; ++k) {
            uint64_t m;
            std::memcpy(&m, km + 8 * k, 8);
            h = _mm512_or_si512(h, _mm512_maskz_mov_epi8(_cvtu64_mask64(m), _mm512_set1_epi8(char(1 << (k / 2 + 4 * (k % 2))))));
          }
        }
        v[j] = h;
      }
      x16_transpose(v, t);
      for (int r = 0; r < 16; ++r) _mm512_mask_storeu_epi32(rows + r * rb + sg + 2 * S, keep, t[r]);
    }
    for (int u = 0; u < qd; ++u) {
      for (int j = 0; j < 16; ++j)
        v[j] = j < S ? _mm512_loadu_si512(qp(16 * s + j) + (q5 ? 64 : 0) + 64 * u) : _mm512_setzero_si512();
      x16_transpose(v, t);
      for (int r = 0; r < 16; ++r) _mm512_mask_storeu_epi32(rows + r * rb + sg + (2 + hb) * S + 4 * u * S, keep, t[r]);
    }
  }
}
