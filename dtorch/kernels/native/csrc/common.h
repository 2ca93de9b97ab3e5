// Shared plain-data declarations of the native kernels: the packed-weight and quantized-activation views and the
// call structs of the hand-written entries (the DTN_OP rows' structs: op_args.h; the kernel table: table.h). No code
// lives here, so the ISA units (each compiled with its own -m flags) never share an inline function (one
// definition rule).
#pragma once
#include <cstdint>

namespace dtn {

// GGUF block formats, repacked (see dtorch/kernels/layouts.py and group_formats.py for the byte layouts). The 32-block
// formats are laid out in super-groups of 16 blocks and Q4_K, Q5_K, Q6_K and IQ4_XS in super-blocks of 8 (SGAct);
// Q2_K and Q3_K in groups of 128 weights (QAct).
enum Fmt : int { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4, Q5_0 = 5, Q5_1 = 6, IQ4_NL = 7, Q2_K = 8, Q3_K = 9,
                 Q5_K = 10, IQ4_XS = 11, Q8_0X16 = 12, Q5_0X16 = 13 };
// Q8_0 / Q5_0 with 16 rows interleaved (layouts "gguf.q8_0x16" / "gguf.q5_0x16", AVX-512 VNNI's projections): a
// group of 16 rows is 16 rows' bytes (K / 32 even), per pair of blocks [the 16 rows' fp16 scales of block 2p, then
// of 2p + 1 (64 bytes)], then per block Q5_0's fifth bits as 8 masks of 64 bits ([step u][half h], bit 4 r + t:
// weight 16 h + 4 u + t of row r) and its GGUF quant bytes [step u][row r][4], or Q8_0's [step u 0..7][row r][4] ^
// 0x80: one 64-byte load holds a step of 16 rows (lane = row). x16_base: the row format it interleaves, else -1.
constexpr int x16_base(int fmt) { return fmt == Q8_0X16 ? Q8_0 : fmt == Q5_0X16 ? Q5_0 : -1; }
constexpr int64_t x16_block_bytes(int base) { return base == Q5_0 ? 64 + 256 : 512; }  // a block's after the scales
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

}  // namespace dtn
