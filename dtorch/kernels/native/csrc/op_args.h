// The argument struct of each DTN_OP row (ops.def): dtn::<name>_args, what binding.cpp fills from the checked
// arguments (at the field offsets table.cpp records in the row's RowInfo) and the op's kernel reads. Included by the
// ISA objects (their group's rows) and table.cpp (every row); never by binding.cpp.
#pragma once
#include <cstdint>

namespace dtn {

#define DTN_IN(n) const void* n; int64_t ld_##n;    // row r at n + r * ld_n elements, the last dim dense
#define DTN_HALF(n) const void* n; int64_t ld_##n;  // as DTN_IN (binding.cpp resolves a fused pair to two halves)
#define DTN_VEC(n) const void* n;                   // [D], dense
#define DTN_OUT(n) void* n; int64_t ld_##n;
#define DTN_F32(n) float n;
#define DTN_I64(n) int64_t n;
#define DTN_BOOL(n) bool n;
// dt: dtn::F32 or dtn::BF16, the dtype of every tensor; rows R of D elements
#define DTN_OP(group, name, op, fallback, meta, doc, args) struct name##_args { int dt; int64_t R, D; args };
#include "op_rows.h"

}  // namespace dtn
