// The avx512 kernel table. AVX-512 F/BW/VL + VNNI (+ FMA, F16C): built with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma -mf16c.
// Everything here lives in its own namespace, so no inline function is shared with a unit built for another ISA.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "common.h"

#define DTN_ISA isa_avx512
namespace DTN_ISA {
#include "generic.h"
#include "elementwise.h"
#include "quant_avx2.h"  // the group formats that have no 512-bit kernel yet run these (qgemm512's default)
#include "quant_avx512.h"
#include "decode_avx512.h"
}  // namespace DTN_ISA

namespace dtn {
const Table* table_avx512() {
  static const Table t{"avx512", DTN_ISA::quantize_rows, DTN_ISA::qgemm512, DTN_ISA::quantize_sg512, DTN_ISA::qgemm_sg512,
                       DTN_ISA::gemv512, DTN_ISA::rms_norm, DTN_ISA::rope,
                       DTN_ISA::silu_and_mul, DTN_ISA::dequant512, true};
  return &t;
}
}  // namespace dtn

// paged KV-cache attention (attention.h) and the recurrent mixers' decode steps (recurrent.h), tables of their own
// so the kernel table above stays as it is
namespace DTN_ISA {
#include "attention.h"
#include "recurrent.h"
}  // namespace DTN_ISA

namespace dtn {
const AttnTable* attn_table_avx512() {
  static const AttnTable t{DTN_ISA::attend};
  return &t;
}
}  // namespace dtn

namespace dtn {
const StateTable* state_table_avx512() {
  static const StateTable t{DTN_ISA::conv_update, DTN_ISA::gdn_step};
  return &t;
}
}  // namespace dtn

namespace dtn {
const GluTable* glu_table_avx512() {
  static const GluTable t{DTN_ISA::gelu_tanh_and_mul};
  return &t;
}
}  // namespace dtn
