// The avx2 kernels: AVX2 + FMA + F16C, built with -mavx2 -mfma -mf16c. build.py compiles this unit once per group of
// the op list (ops.def, entries.def) (-DDTN_GROUP=<group>, -DDTN_GROUP_<group>=1, -DDTN_GROUP_DEF, -DDTN_GROUP_SLOTS,
// -DDTN_GROUP_H): each object includes its own group's rows and headers
// and registers that group's kernels (isa_fill.h).
// Everything here lives in its own namespace, so no inline function is shared with a unit built for another ISA.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <type_traits>
#include <vector>

#include "common.h"
#include "op_args.h"  // the structs of this group's DTN_OP rows

#define DTN_ISA isa_avx2
#define DTN_ISA_NAME "avx2"
namespace DTN_ISA {
#include "generic.h"
#if DTN_GROUP_quant
#include "quant_avx2.h"
#include "act_avx2.h"
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
constexpr auto quantize_sg = quantize_sg256;
constexpr auto qgemm = qgemm256;
constexpr auto qgemm_sg = qgemm_sg256;
constexpr auto gemv = gemv256;
constexpr bool int_prefill = false;
#endif
}  // namespace DTN_ISA::kernels

#include "isa_fill.h"
