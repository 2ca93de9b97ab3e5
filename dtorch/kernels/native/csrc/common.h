// Shared plain-data declarations of the native kernels: the packed-weight and quantized-activation views and
// the table of kernel entry points each ISA translation unit fills. No code lives here, so the ISA units
// (each compiled with its own -m flags) never share an inline function (one definition rule).
#pragma once
#include <cstdint>

namespace dtn {

// GGUF block formats, repacked (see dtorch/kernels/layouts.py and group_formats.py for the byte layouts). The 32-block
// formats are laid out in super-groups of 16 blocks and Q4_K, Q5_K, Q6_K and IQ4_XS in super-blocks of 8 (SGAct);
// Q2_K and Q3_K in groups of 128 weights (QAct).
enum Fmt : int { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4, Q5_0 = 5, Q5_1 = 6, IQ4_NL = 7, Q2_K = 8, Q3_K = 9,
                 Q5_K = 10, IQ4_XS = 11 };
constexpr bool super_grouped(int fmt) {
  return fmt == Q8_0 || fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1 || fmt == IQ4_NL || fmt == Q4_K ||
         fmt == Q5_K || fmt == Q6_K || fmt == IQ4_XS;
}
// IQ4_NL's and IQ4_XS's 16 weight levels (llama.cpp's kvalues_iq4nl)
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// element types of activations, float weights and outputs (F16: float weights of Table::gemv only)
enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// One packed weight [N, K] (dtorch/kernels/layouts.py): row n of each section starts at its base + n * row
// (elements of that section's type; every section of a row lives in the same packed row).
// The group formats are read in "groups" of 128 weights = 4 sub-blocks of 32; a group's values come in two halves
// L = [s0[0:16], s1[0:16], ...] and H = [s0[16:32], ...], as bit planes (group_formats.py).
struct QWeight {
  int fmt;
  int64_t K;
  const uint8_t* qs;  int64_t qs_row;   // quants (bytes)
  const uint16_t* d;  int64_t d_row;    // fp16 scales
  const uint8_t* aux; int64_t aux_row;  // K-quant sub-block scales (bytes)
};

// Activations quantized per sub-block of 32 to two int8 levels, x = d (hi + lo / 254) (generic.h), in the same
// group order as the weights. Row r: q + r * ng * 256 (int8, group g at g * 256: hi, then lo at + 128, zero
// padded), darep + r * ng * 16 (lane 4s+t of group g: the scale d of sub-block s, 0 past the row end),
// asum + r * ng * 8 (group g: d * sum of (hi + lo / 254) over [L s0..s3, H s0..s3], 0 past the row end).
struct QAct {
  const int8_t* q;
  const float* darep;
  const float* asum;
  int64_t ng;
};

// Activations for the 32-block formats (Q8_0, Q4_0, Q4_1), whose rows are super-groups of up to 16 blocks with
// quants transposed to [step u][block j][4 bytes] (dtorch/kernels/layouts.py), in two levels as QAct. Row r:
// q + r * nsg * 1024 (int8, super-group g at g * 1024: hi as [u 0..7][lane j 0..P-1][4], then lo alike at + 512,
// zero padded past the row end; P = 16, or for the row's last super-group of S < 16 blocks S rounded up to a power
// of two, so its steps lie P lanes apart and a vector holds 16 / P of them), d + r * nsg * 16 (the scale of block 16 g + j, 0 past the end), s + r * nsg * 16
// (that scale times the sum of the block's hi + lo / 254).
struct SGAct {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t nsg;
  const float* sh;  // sh + r * nsg * 32 + g * 32 + 16 h + j: as s, over weights 16 h .. 16 h + 15 of block 16 g + j (Q6_K)
  // 2: the products use both levels (x as d (hi + lo / 254), about 16 bits); 1: the hi levels alone (x rounded to
  // 8 bits per block of 32 as llama.cpp's Q8_0 activations: half the integer work, for batches of rows), and the
  // sums s and sh are then of the hi levels alone (quantize_sg's levels)
  int levels;
};

struct Table {
  const char* name;
  // x rows [r0, r1) of [M, K] (dt, row stride ldx) -> QAct arrays (row strides as in QAct)
  void (*quantize_rows)(const void* x, int dt, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int8_t* q,
                        float* darep, float* asum);
  // y[m, n] = sum_k x[m, k] * w[n, k] for m < M, n in [n0, n1); y has dtype ydt and row stride ldy
  // bias [N] (ydt) or nullptr is added before the one rounding to ydt
  void (*qgemm)(const QWeight& w, const QAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias, void* y,
                int ydt, int64_t ldy);
  // x rows [r0, r1) of [M, K] -> SGAct arrays
  void (*quantize_sg)(const void* x, int dt, int64_t ldx, int64_t r0, int64_t r1, int64_t K, int8_t* q, float* d,
                      float* s, float* sh, int levels);
  // qgemm for the 32-block formats: w.qs is row 0, w.qs_row the row bytes
  void (*qgemm_sg)(const QWeight& w, const SGAct& a, int64_t M, int64_t n0, int64_t n1, const void* bias, void* y,
                   int ydt, int64_t ldy);
  // y[m, n] = sum_k x[m, k] * w[n, k], x [M, K] (xdt), w [N, K] (wdt, rows n0..n1), y [M, ldy] (ydt)
  void (*gemv)(const void* x, int xdt, int64_t M, const void* w, int wdt, int64_t K, int64_t n0, int64_t n1,
               void* y, int ydt, int64_t ldy);
  // rows [r0, r1) of [R, D]: if res: h = x + res (stored to res_out), else h = x; out = w * rmsnorm(h)
  void (*rms_norm)(const void* x, const void* res, void* res_out, const void* w, void* out, int dt, int64_t r0,
                   int64_t r1, int64_t D, float eps);
  // rows [r0, r1) of x [R, H, D] (row stride ldx, heads dense): pairs (i, i + rot/2) (or (2i, 2i + 1)) of the first
  // rot dims rotated by cos/sin [P, rot/2] (row stride ldc) row r % P; out like x with row stride ldo (may be x);
  // dims rot.. copied when out is not x
  void (*rope)(const void* x, int64_t ldx, void* out, int64_t ldo, int dt, const float* cos, const float* sin,
               int64_t ldc, int64_t P, int64_t r0, int64_t r1, int64_t H, int64_t D, int64_t rot, bool interleaved);
  // rows [r0, r1): out[r, i] = silu(gate[r, i]) * up[r, i], i < I; row strides ldg, ldu, I for out
  void (*silu_and_mul)(const void* gate, const void* up, int64_t ldg, int64_t ldu, void* out, int dt, int64_t r0,
                       int64_t r1, int64_t I);
  // rows [n0, n1) of a packed weight -> float32 out [n1 - n0, K] with K in the packed order (see kernel_order in
  // binding.cpp), equal to gguf's dequantization
  void (*dequant)(const QWeight& w, int64_t n0, int64_t n1, float* out);
  // the super-grouped formats' integer tiles beat dequantized float panels in torch's mm at every row count (in
  // oneDNN's GEMM the panels win from 128 rows on most formats: float_rows in binding.cpp)
  bool int_prefill;
};

const Table* table_avx512();
const Table* table_avx2();
const Table* table_portable();

}  // namespace dtn

// -- gated activations besides silu_and_mul (elementwise.h), a table of their own ------------------------------
namespace dtn {

struct GluTable {
  // rows [r0, r1): out[r, i] = gelu_tanh(gate[r, i]) * up[r, i], i < I; row strides ldg, ldu, I for out
  void (*gelu_tanh_and_mul)(const void* gate, const void* up, int64_t ldg, int64_t ldu, void* out, int dt, int64_t r0,
                            int64_t r1, int64_t I);
};

const GluTable* glu_table_avx512();
const GluTable* glu_table_avx2();
const GluTable* glu_table_portable();

}  // namespace dtn

// -- paged KV-cache attention (attention.h) ------------------------------------------------------------------
namespace dtn {

// One llm.flash_attention_with_kvcache call. q and out [T, H, D] (dt) with element strides per token and per
// head (D dense); caches [blocks, block_size, Hkv, D] contiguous. Sequence s has queries cu_q[s]..cu_q[s + 1],
// n = seqlens_k[s] keys held in blocks table[s * ld_table + 0 .. ceil(n / block_size)); query head hq reads kv
// head hq / G. Causal is bottom-right: query i of nq sees keys j < n - nq + i + 1; a sliding window (window > 0)
// also hides keys j <= n - nq + i - window (blocks wholly before every row's window are never read).
struct AttnCall {
  const void* q; int64_t q_tok, q_head;
  const void* k; const void* v; int64_t block_size, hkv;
  void* out; int64_t o_tok, o_head;
  const int32_t* cu_q; const int32_t* seqlens_k; const int32_t* table; int64_t ld_table;
  int dt; int64_t D, G; float scale; bool causal; int64_t window;
  int cdt;  // the caches' dtype (F32 or BF16; dt: q's and out's)
};

// A unit of work: rows [r0, r1) of sequence seq and kv head head, row r = i * G + g being query i of the
// sequence on query head head * G + g (at most 16 rows).
struct AttnItem { int32_t seq, head, r0, r1; };

struct AttnTable {
  // items [i0, i1) of c; D a multiple of 16 up to 256
  void (*attend)(const AttnCall& c, const AttnItem* items, int64_t i0, int64_t i1);
};

const AttnTable* attn_table_avx512();
const AttnTable* attn_table_avx2();
const AttnTable* attn_table_portable();

}  // namespace dtn

// -- decode steps of the recurrent mixers (recurrent.h) --------------------------------------------------------
namespace dtn {

// One llm.causal_conv1d_update step: batch row b reads and advances the state row rows[b] ([D, S] at
// state + rows[b] * D * S, S >= W - 1): out[b, d] = act(bias[d] + sum_w weight[d, w] xs[d, S + 1 - W + w]) with
// xs = (state row || x[b, d]), then the row shifts left by one and takes x[b, d] last. Every tensor has dtype dt;
// x and out rows lie ldx / ldo elements apart. write[b] == 0: the row is read, not advanced (a later batch row
// names it too, and only the last one writes, from the state before the step).
struct ConvCall {
  const void* x; int64_t ldx;
  const void* weight; const void* bias; int64_t W;
  void* state; int64_t S;
  const int64_t* rows; const uint8_t* write;
  void* out; int64_t ldo;
  int dt; int64_t B, D; bool silu;
};

// One llm.gated_delta_net decode step (T == 1). q, k [B, Hk, K], v and o [B, H, V], g and beta [B, H]: element
// strides per batch row (_b) and head (_h), the last dim dense; g float32, q/k/v/o dtype dt, beta dtype beta_dt.
// State rows [H, K, V] float32: batch row b reads state_in + rows[b] H K V (zeros when state_in is null) and, when
// state_out is set and write[b], writes state_out + rows[b] H K V (may be state_in: in place).
struct GdnCall {
  const void* q; int64_t q_b, q_h;
  const void* k; int64_t k_b, k_h;
  const void* v; int64_t v_b, v_h;
  const float* g; int64_t g_b, g_h;
  const void* beta; int64_t beta_b, beta_h; int beta_dt;
  const float* state_in; float* state_out; const int64_t* rows; const uint8_t* write;
  void* o; int64_t o_b, o_h;
  int dt; int64_t H, Hk, K, V; float scale; bool l2norm;
};
constexpr int64_t kGdnMaxDim = 256;  // K and V up to this (V a multiple of 16)

struct StateTable {
  // channels [d0, d1) of every batch row
  void (*conv_update)(const ConvCall& c, int64_t d0, int64_t d1);
  // items [i0, i1) of the list, item = b * H + h
  void (*gdn_step)(const GdnCall& c, const int64_t* items, int64_t i0, int64_t i1);
};

const StateTable* state_table_avx512();
const StateTable* state_table_avx2();
const StateTable* state_table_portable();

}  // namespace dtn
