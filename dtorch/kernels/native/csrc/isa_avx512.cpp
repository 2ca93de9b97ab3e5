// The avx512 kernels: AVX-512 F/BW/VL + VNNI (+ FMA, F16C), built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni
// -mfma -mf16c. build.py compiles this unit once per group of
// the op list (ops.def, entries.def) (-DDTN_GROUP=<group>, -DDTN_GROUP_<group>=1, -DDTN_GROUP_DEF, -DDTN_GROUP_SLOTS,
// -DDTN_GROUP_H): each object includes its own group's rows and headers
// and registers that group's kernels (isa_fill.h).
// Everything here lives in its own namespace, so no inline function is shared with a unit built for another ISA.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "common.h"
#include "op_args.h"  // the structs of this group's DTN_OP rows

#define DTN_ISA isa_avx512
#define DTN_ISA_NAME "avx512"
namespace DTN_ISA {
#include "generic.h"
#if DTN_GROUP_quant
#include "quant_avx2.h"  // the group formats that have no 512-bit kernel yet run these (qgemm512's default)
#include "quant_avx512.h"
#include "decode_avx512.h"
#endif
#include "rows.h"  // ld, st, exp_f32, V16: what every group may call
#ifdef DTN_GROUP_H
#include DTN_GROUP_H  // the group's kernels (ops/<group>.h)
#endif
}  // namespace DTN_ISA

// the kernels of this unit by their names in the op list (entries.def, ops.def), where the functions are named otherwise
namespace DTN_ISA::kernels {
using namespace DTN_ISA;
#if DTN_GROUP_quant
constexpr auto quantize_sg = quantize_sg512;
constexpr auto qgemm = qgemm512;
constexpr auto qgemm_sg = qgemm_sg512;
constexpr auto gemv = gemv512;
constexpr auto dequant = dequant512;
constexpr auto x16_rows = x16_rows512;
constexpr auto x16_decode = x16_decode512;
constexpr bool int_prefill = true;
#endif
}  // namespace DTN_ISA::kernels

#include "isa_fill.h"
