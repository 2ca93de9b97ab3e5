// The kernel table of one ISA: a field per kernel, value and DTN_OP row of the op list (ops.def), set by name from
// the functions each ISA object registered (isa_fill.h). Included by table.cpp and binding.cpp only: the ISA objects
// read their own group's rows, so a new row recompiles its group's objects, table.cpp and binding.cpp.
#pragma once
#include <cstdint>

#include "common.h"
#include "op_args.h"

namespace dtn {

struct Table {
  const char* name;  // the ISA: "avx512", "avx2" or "portable"
#define DTN_KERNEL(group, op, ret, params) ret(*op) params = nullptr;
#define DTN_VALUE(group, type, name) type name{};
#define DTN_OP(group, name, op, fallback, meta, doc, args) void (*name)(const name##_args&, int64_t, int64_t) = nullptr;
#include "op_rows.h"
};

// The table of `isa` assembled from every slot its objects registered, or nullptr when no object of that ISA was
// linked (an ISA the build skips on this machine). A table that lacks a row of ops.def, or whose object registered
// it with another signature, is not returned: *missing then names the rows and their groups.
const Table* table(const char* isa, const char** missing);

}  // namespace dtn
