// The kernel table of one ISA, and the declared rows as binding.cpp reads them at run time. Included by table.cpp and
// binding.cpp. The Table's typed fields are the hand-written slots of entries.def (slots/<group>.def); the DTN_OP
// rows of ops.def reach binding.cpp only as data (RowInfo: names, argument kinds, field offsets) and type-erased
// kernels (Table::ops), so a new or edited row recompiles its group's objects and table.cpp, never binding.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common.h"

namespace dtn {

// The kernel of a declared row, type-erased: args points at the row's dtn::<name>_args (isa_fill.h's thunk casts
// it back), rows [r0, r1) of its R
using RowFn = void (*)(const void* args, int64_t r0, int64_t r1);

// the argument kinds of a DTN_OP row (ops.def): DTN_IN, DTN_HALF, DTN_VEC, DTN_OUT, DTN_F32, DTN_I64, DTN_BOOL
enum ArgKind : int { ARG_IN, ARG_HALF, ARG_VEC, ARG_OUT, ARG_F32, ARG_I64, ARG_BOOL };

// One argument of a row: its kind, its name, and the offsets of its fields in the row's struct (ld_off: the row
// stride's field of an IN, HALF or OUT, else 0)
struct RowArg {
  int kind;
  const char* name;
  size_t off, ld_off;
};

// One DTN_OP row: its module function's name and doc, its args as written in the row (spec, for messages), the
// size of its struct and the offsets of the fields every struct has (dt, R, D)
struct RowInfo {
  const char *name, *group, *doc, *spec;
  size_t size, off_dt, off_R, off_D;
  int nargs;
  const RowArg* args;
};

// the rows of ops.def in its order; *n their number (table.cpp)
const RowInfo* rows(int* n);

struct Table {
  const char* name;  // the ISA: "avx512", "avx2" or "portable"
#define DTN_KERNEL(group, op, ret, params) ret(*op) params = nullptr;
#define DTN_VALUE(group, type, name) type name{};
#include "slot_rows.h"
  const RowFn* ops = nullptr;  // ops[i]: the kernel of rows()[i]
};

// The table of `isa` assembled from every slot its objects registered, or nullptr when no object of that ISA was
// linked (an ISA the build skips on this machine). A table that lacks a slot of entries.def or a row of ops.def, or
// whose object registered it with another signature, is not returned: *missing then names them and their groups.
const Table* table(const char* isa, const char** missing);

}  // namespace dtn
